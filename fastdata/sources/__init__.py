"""Conversion inputs beyond the ImageFolder tree and the path,label list.

Each module parses one input format into numpy arrays the converter feeds to the
writer (never one Python object per sample kept around):

- :mod:`fastdata.sources.coco`: a COCO instances annotation file and its image folder.
- :mod:`fastdata.sources.table`: JSONL and CSV/TSV lists of image paths plus any typed
  fields (inferred or declared with a schema spec), including multi-label classes.
"""
