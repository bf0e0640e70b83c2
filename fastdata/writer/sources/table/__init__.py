"""JSONL and CSV/TSV lists with typed fields:

- :mod:`~fastdata.writer.sources.table.reader`: a list file parsed into typed numpy columns
  (:func:`~fastdata.writer.sources.table.reader.scan_table`; its docstring holds the rules).
- :mod:`~fastdata.writer.sources.table.input`: such a list as a write source (chunks, workers, resume).
"""
