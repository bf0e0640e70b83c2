"""JSONL and CSV/TSV lists with typed fields, from the list file to a write source:

- :mod:`~fastdata.writer.sources.table.spec`: the ``schema`` grammar (declared fields and defaults).
- :mod:`~fastdata.writer.sources.table.cells`: cell and value conversion, and the inference of undeclared kinds.
- :mod:`~fastdata.writer.sources.table.columns`: the column builders that hold every row's values.
- :mod:`~fastdata.writer.sources.table.reader`: a list file parsed into typed columns
  (:func:`~fastdata.writer.sources.table.reader.scan_table`; the module's docstring holds the rules).
- :mod:`~fastdata.writer.sources.table.input`: such a list as a write source (chunks, workers, resume).
"""
