"""LMDB readers of one shard in one process share its environment, counted: a release can come
from a finalizer that runs in the middle of another open of the same shard (the garbage collector,
or a free-threaded build freeing in its own thread what a loader thread let go), and must not close
the environment that open hands out.
"""

from __future__ import annotations

import sys

from helpers.images import make_tree

import fastdata


def test_a_shard_released_by_a_finalizer_inside_an_open_of_it_stays_open(tmp_path):
    """The first dataset (the shard's only reader) is freed right after the second one's open looked
    the shard up (a profile hook drops its last reference there, as a deferred free would): the second
    dataset reads. Before the release waited for the open, the environment it got was closed:
    "cannot read the shard index (Attempt to operate on closed/deleted/dropped object.)"."""
    src = make_tree(tmp_path / "images", {"a": 3, "b": 3}, size=(20, 16))
    store = str(tmp_path / "s.lmdb")
    fastdata.convert(src, store, workers=1, progress=False)
    holder = [fastdata.open_dataset(store, output="numpy")]
    assert holder[0][0][1] == 0  # (its reader holds the shard's environment now)

    def drop_the_first_dataset(frame, event, arg) -> None:
        # after the open's lookup of the shard (a dict's get, inside LMDB's environment cache)
        if event == "c_return" and holder and getattr(arg, "__name__", "") == "get" \
                and "lmdb" in frame.f_code.co_filename:
            holder.pop()

    sys.setprofile(drop_the_first_dataset)
    try:
        second = fastdata.open_dataset(store, output="numpy")
    finally:
        sys.setprofile(None)
    assert not holder, "the hook did not run inside the open"
    assert [second[i][1] for i in range(len(second))] == [0, 0, 0, 1, 1, 1]
