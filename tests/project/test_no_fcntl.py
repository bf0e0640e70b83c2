"""``import fastdata`` and the readers work where ``fcntl`` is missing (it is POSIX-only: the
writer's lock takes ``msvcrt`` instead, through ``fastdata.common.portable``, and the remote shard
cache needs flock's shared locks), and a plain ``import fastdata`` loads neither the writer nor
torch, h5py or lmdb (the facade is lazy). The writer without fcntl runs in the Windows proxy
(``tests/platform``).

Each check runs in a fresh interpreter whose first meta-path finder refuses ``fcntl``, as on
a platform without it; a control shows the blocker does block.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent("""
    import sys

    class _NoFcntl:
        '''A meta-path finder that refuses fcntl, as a platform without it does.'''

        def find_spec(self, name, path=None, target=None):
            if name == "fcntl" or name.startswith("fcntl."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.modules.pop("fcntl", None)
    sys.meta_path.insert(0, _NoFcntl())
    HEAVY = ("fcntl", "torch", "h5py", "lmdb", "fastdata.writer")

    def loaded(names=HEAVY):
        return sorted(m for m in sys.modules if sys.modules[m] is not None
                      and any(m == n or m.startswith(n + ".") for n in names))
""")


def _run_blocked(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def test_control_the_blocker_makes_fcntl_imports_fail():
    result = _run_blocked("""
        import fcntl
    """)
    assert result.returncode != 0, result.stdout
    assert "No module named 'fcntl' (blocked by the test)" in result.stderr, result.stderr


def test_plain_import_loads_no_fcntl_torch_h5py_lmdb_or_writer():
    result = _run_blocked("""
        import fastdata
        assert loaded() == [], loaded()
        fastdata.__version__, fastdata.errors, fastdata.fields  # the light names stay light
        assert loaded() == [], loaded()
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from helpers.images import make_tree

    import fastdata

    root = tmp_path_factory.mktemp("no-fcntl")
    src = make_tree(root / "src", {"a": 2, "b": 2}, size=(16, 12))
    fastdata.convert(src, str(root / "s.lmdb"), workers=1, progress=False)
    return str(root / "s.lmdb")


def test_a_local_store_opens_and_reads_without_fcntl_and_a_remote_cache_says_why_not(store):
    result = _run_blocked("""
        import fastdata
        ds = fastdata.open_dataset(sys.argv[1], output="numpy")  # torch may load: fcntl must not
        image, label = ds[3]
        assert image.shape == (12, 16, 3) and int(label) == 1, (image.shape, label)
        assert loaded(("fcntl", "fastdata.writer")) == [], loaded()
        # a remote store's cache cannot lock without it: one clear error, not an ImportError
        from fastdata.errors import RemoteStoreError
        from fastdata.remote.cache import ShardCache
        try:
            ShardCache(sys.argv[1] + "-cache")
        except RemoteStoreError as err:
            assert "fcntl" in str(err), err
        else:
            raise AssertionError("the cache started without flock")
        print("ok")
    """, store)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
