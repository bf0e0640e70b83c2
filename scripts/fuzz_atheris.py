"""Coverage-guided fuzzing of fastdata's untrusted-input parsers with atheris (long runs).

The Hypothesis tests in ``tests/test_fuzz.py`` run in the normal suite; this
harness is for hours-long runs that explore the C-level msgpack and JSON paths
with coverage feedback. Any exception other than the documented error type is
a finding (atheris stops and writes the crashing input).

Usage::

    pip install atheris
    python scripts/fuzz_atheris.py record   [atheris/libFuzzer options, e.g. -max_total_time=3600 corpus_dir]
    python scripts/fuzz_atheris.py manifest [options]

Targets:
    record    ``fastdata.format.record.decode_record(bytes)`` may only raise ``CorruptRecordError``
    manifest  ``fastdata.format.manifest.parse_manifest(bytes)`` may only raise ``FormatError``
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("record", "manifest"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: pip install atheris (Linux, CPython with clang-built wheels)",
              file=sys.stderr)
        return 2
    with atheris.instrument_imports():
        import msgpack  # noqa: F401  (instrumented with the parsers)

        from fastdata.errors import CorruptRecordError, FormatError
        from fastdata.format.manifest import parse_manifest
        from fastdata.format.record import decode_record

    target = argv[1]

    def one_input(data: bytes) -> None:
        if target == "record":
            try:
                decode_record(data, where="fuzz")
            except CorruptRecordError:
                pass
        else:
            try:
                parse_manifest(data, where="fuzz")
            except FormatError:
                pass

    atheris.Setup([argv[0]] + argv[2:], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
