"""The public entry points of the writer (``fastdata.convert``, ``fastdata.write``, ...)."""

from fastdata.writer.coco import convert_coco
from fastdata.writer.convert import convert, convert_table
from fastdata.writer.sources.python import write

__all__ = ["convert", "convert_coco", "convert_table", "write"]
