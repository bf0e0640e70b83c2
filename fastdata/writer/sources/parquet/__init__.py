"""Parquet files and Hugging Face ``datasets`` objects as write sources, through pyarrow (the
``parquet`` extra), image bytes kept as they are:

- :mod:`~fastdata.writer.sources.parquet.detect`: whether a path names Parquet files (a file, a
  folder of them, a glob), and whether an object is a ``datasets`` one (no pyarrow needed).
- :mod:`~fastdata.writer.sources.parquet.columns`: an Arrow schema (and a Hugging Face ``features``
  description) as fastdata fields, and an Arrow table's rows as sample values.
- :mod:`~fastdata.writer.sources.parquet.files`: the Parquet files' metadata read for the plan:
  schemas checked alike, row groups, null counts, class names from the Hugging Face metadata.
- :mod:`~fastdata.writer.sources.parquet.input`: the write sources (Parquet row groups read in the
  worker processes; a ``datasets.Dataset``'s Arrow rows sent to them in chunks).
"""
