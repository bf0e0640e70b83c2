"""Fixtures of the training-framework tests: one small store for every run, and a launcher of
two-process runs (torchrun, gloo on CPU) of the examples in ``examples/frameworks``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from framework_runs import EXAMPLES, SAMPLES

sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Path:
    from demo_store import make_store

    return make_store(tmp_path_factory.mktemp("frameworks") / "noise.lmdb", n=SAMPLES)
