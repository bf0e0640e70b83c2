"""What decides whether conversion workers must run the caller's script (fastdata/writer/mainless.py);
the end-to-end runs are in tests/project/test_examples.py (a docs/guides/sources.md snippet as a script)."""

from __future__ import annotations

import pickle
import sys

import numpy as np

from fastdata.writer.mainless import refers_to_main


class _Local:
    pass


def test_plain_payloads_do_not_refer_to_main():
    payload = ([{"image": b"\xff\xd8", "boxes": np.zeros((2, 4), np.float32), "caption": "x"}], _Local, print)
    assert not refers_to_main(payload)


def _helper():
    pass


def test_a_class_its_instances_and_functions_of_main_do(monkeypatch):
    """Made findable in ``__main__`` (so that they pickle there, by reference): only the scan tells."""
    main = sys.modules["__main__"]
    for obj in (_Local, _helper):
        monkeypatch.setattr(obj, "__module__", "__main__")
        monkeypatch.setattr(main, obj.__name__, obj, raising=False)
    pickle.dumps([_Local(), _helper])  # the control: they do pickle
    assert refers_to_main([{"value": _Local()}])
    assert refers_to_main({"cls": _Local})
    assert refers_to_main((1, _helper))


def test_what_does_not_pickle_keeps_the_usual_workers():
    assert refers_to_main([lambda: None])
