"""Conversion inputs: each module turns one kind of input into a write source
(:class:`~fastdata.writer.sources.base.WriteSource`) that plugs into the write session,
and into the chunks of work the session's pipeline runs (never one Python object per
sample kept around):

- :mod:`~fastdata.writer.sources.base`: what a source gives the session.
- :mod:`~fastdata.writer.sources.folder`: ImageFolder trees and ``path,label`` lists.
- :mod:`~fastdata.writer.sources.table`: JSONL and CSV/TSV lists with typed fields (parsing, and
  :mod:`~fastdata.writer.sources.table.input`, the source).
- :mod:`~fastdata.writer.sources.volumes`: NIfTI volumes and large TIFF images as chunked arrays
  (scanning, reading, and :mod:`~fastdata.writer.sources.volumes.input`, the sources).
- :mod:`~fastdata.writer.sources.coco`: a COCO instances annotation file and its image folder.
- :mod:`~fastdata.writer.sources.python`: samples from Python (map-style datasets and iterables).
- :mod:`~fastdata.writer.sources.parquet`: Parquet files through pyarrow (their columns as fields,
  image bytes as they are), and :mod:`~fastdata.writer.sources.hf`: Hugging Face ``datasets``
  objects through the same Arrow code.
- :mod:`~fastdata.writer.sources.webdataset`: WebDataset tar shards (members grouped into samples by key).
"""
