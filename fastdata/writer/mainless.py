"""Conversion workers that do not run the caller's script again.

A forkserver (or spawn) child normally re-runs the parent's ``__main__`` file (as ``__mp_main__``)
before its first task, so that objects pickled by reference to the script (a ``Dataset`` class
defined there) can be found. That also re-runs whatever the script does at its top level: a
``fastdata.write(...)`` there, as the README shows it, would start a conversion inside every
worker, and multiprocessing refuses it, so the pool broke ("a conversion worker died
unexpectedly") unless the call sat under ``if __name__ == "__main__":``.

Most conversions send nothing of the script: paths, index ranges, sample dicts of bytes, arrays
and strings, fastdata's own functions. Then the pool's forkserver children skip that step
(:func:`pool_context`), the call works at a script's top level, and no worker pays for the
script's imports or side effects. When the workers' payload does refer to ``__main__``
(:func:`refers_to_main`), the children import it as before, and then, as for any
multiprocessing code, the call needs the guard. A chunk of samples that refers to ``__main__``
sent to workers that skipped it is encoded in the converting process instead (the pipeline's
fallback), never sent to a worker that could not unpickle it.

Where the platform has no forkserver (Windows: spawn), children always import ``__main__``; so
they do on Pythons after 3.13, whose forkserver launch (with its new authentication step) this
module has not been checked against: ``_Popen._launch`` repeats CPython's own, identical in
3.11, 3.12 and 3.13.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
from multiprocessing import context as mp_context
from typing import Any


class _FromMain(Exception):
    """Raised inside the scan: the payload refers to ``__main__``."""


class _Finder(pickle.Pickler):
    """A pickler that only looks for references to ``__main__``.

    ``reducer_override`` sees every object but the builtin atoms and containers (None, bools,
    ints, floats, str, bytes, dict, list, tuple, set), classes and functions included, so the
    scan costs little on the dicts, strings and arrays a payload is mostly made of."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj).__module__ == "__main__" or (
                isinstance(obj, type | types.FunctionType) and getattr(obj, "__module__", None) == "__main__"):
            raise _FromMain
        return NotImplemented


class _Sink:
    """Counts nothing, keeps nothing: where the scan's pickle goes."""

    def write(self, data: Any) -> int:
        return len(data)


def refers_to_main(payload: Any) -> bool:
    """Whether ``payload`` pickles with a reference to the ``__main__`` module (a class, a function
    or an instance of a class defined in the running script), so that a process unpickling it must
    have imported the script. True also when it does not pickle at all with the standard pickler:
    the caller then keeps multiprocessing's usual behaviour (and its own error).

    Array buffers are not copied (pickle protocol 5, out of band).
    """
    try:
        _Finder(_Sink(), protocol=5, buffer_callback=lambda _buffer: False).dump(payload)
    except _FromMain:
        return True
    except Exception:  # noqa: BLE001 - unpicklable here: leave the decision to multiprocessing as before
        return True
    return False


if os.name == "posix" and sys.version_info < (3, 14):
    from multiprocessing import forkserver, popen_forkserver, spawn, util
    from multiprocessing import reduction
    from multiprocessing.context import set_spawning_popen

    class _Popen(popen_forkserver.Popen):
        """``popen_forkserver.Popen`` whose child is not told to run the parent's ``__main__``:
        ``_launch`` as in CPython 3.11-3.13, with the two ``init_main_*`` entries of the
        preparation data left out (the child's ``spawn.prepare`` then leaves ``__main__`` alone)."""

        def _launch(self, process_obj: Any) -> None:
            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data.pop("init_main_from_path", None)
            prep_data.pop("init_main_from_name", None)
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
            # a duplicate of the data pipe's write end: the child's sentinel of its parent
            parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    class _Process(mp_context.ForkServerProcess):
        @staticmethod
        def _Popen(process_obj: Any) -> _Popen:  # noqa: N802 - multiprocessing's name
            return _Popen(process_obj)

    class _Context(mp_context.ForkServerContext):
        """The forkserver start method, children without the parent's ``__main__``."""

        Process = _Process

    _MAINLESS: mp_context.BaseContext | None = _Context()
else:  # pragma: no cover - no forkserver, or one whose launch this module does not know
    _MAINLESS = None


def pool_context(ctx: mp_context.BaseContext, payload: Any) -> mp_context.BaseContext:
    """The context a worker pool of ``ctx`` starts with: ``ctx`` itself, or, for the forkserver
    method with a ``payload`` (what every worker is sent before its first task) that does not
    refer to ``__main__``, the same method with children that skip running the script.

    Args:
        ctx: the start method chosen for the pool (fork children never run ``__main__`` again).
        payload: the worker function and initializer arguments, as the pool will pickle them.

    Returns:
        multiprocessing.context.BaseContext: the context to give ``ProcessPoolExecutor``.
    """
    if _MAINLESS is None or ctx.get_start_method() != "forkserver" or refers_to_main(payload):
        return ctx
    return _MAINLESS


def is_mainless(ctx: mp_context.BaseContext) -> bool:
    """Whether ``ctx`` (from :func:`pool_context`) starts children that skip the script."""
    return ctx is _MAINLESS and ctx is not None
