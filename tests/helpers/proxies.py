"""Start scripts in the platform proxies of tests/platform (``proxy_site/sitecustomize.py``) and collect
the JSON each prints: one subprocess per run, all running at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: tests/platform: the proxies' site folder and their step scripts
PLATFORM = Path(__file__).resolve().parents[1] / "platform"


def start(script: str, system: str | None, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python tests/platform/SCRIPT ARGS...`` in the proxy of ``system`` (``"macos"``, ``"windows"``;
    None: plain Linux, the control), with ``env`` added to this process's environment."""
    full = dict(os.environ, **(env or {}))
    if system is not None:
        full["FASTDATA_PROXY_SYSTEM"] = system
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLATFORM / "proxy_site"), full.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, str(PLATFORM / script), *args], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def collect(procs: dict[str, subprocess.Popen], timeout: float = 200) -> dict[str, dict]:
    """Each run's printed JSON, by name; a run that exits non-zero fails with the end of its stderr."""
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name} exited {proc.returncode}: {stderr[-3000:]}"
        out[name] = json.loads(stdout)
    return out
