"""Read a COCO instances annotation file into numpy arrays, in ``CocoDetection``'s order.

``torchvision.datasets.CocoDetection(root, annFile)`` yields one sample per image of the
file, ordered by sorted image id (``sorted(coco.imgs.keys())``), and its target is
``coco.loadAnns(coco.getAnnIds(img_id))``: the annotation dicts of that image, in the
order the file lists them, exactly as ``json.load`` made them. :func:`load_coco` builds a
:class:`CocoIndex` that reproduces both without keeping one Python object per image or
annotation: the fields a converter needs live in typed arrays (ids, file names, sizes,
category ids, boxes, areas, iscrowd), and everything else of a dict (segmentation
polygons or RLE, keypoints, attributes, any extra key) is packed with msgpack, together
with the dict's key order, so that :meth:`CocoIndex.annotations` rebuilds the very dicts
``json.load`` gives: same keys, same key order, same values and Python types.

Where the file is inconsistent the index does what pycocotools (and so ``CocoDetection``)
does, and reports it in :attr:`CocoIndex.problems` as ``(where, reason)`` pairs, like the
rejected inputs of an ImageFolder conversion (a strict conversion stops on any of them):

- an annotation whose ``image_id`` names no image is left out (no sample ever shows it);
- an image id listed twice keeps its last entry (pycocotools' ``imgs[id] = img``);
- an annotation id listed twice: every occurrence yields the last one's dict
  (pycocotools' ``anns[id] = ann`` looked up by ``loadAnns``);
- a ``category_id`` missing from a non-empty ``categories`` list is kept;
- an image whose file is missing under the image folder (when one is given).

Some images are rejected (:attr:`CocoIndex.refused`; reported, never read; ``strict`` stops
before anything is written): a ``file_name`` that resolves (``..``, an absolute path, a symbolic
link) outside the image folder, more than :data:`MAX_ANNOTATIONS_PER_IMAGE` annotations, an RLE
segmentation whose ``size`` is not the image's listed ``[height, width]`` or whose run lengths
do not add up to its pixels (:mod:`fastdata.common.coco_rle`).

A file that cannot be used at all (not JSON, not an object, no ``images`` list, an image or
annotation without a required key or with one of the wrong type) raises one
:class:`~fastdata.errors.SourceError` naming the file and the entry's position.

:class:`CocoInput` is the write source of :func:`fastdata.convert_coco` (annotations, image dir, dst)
(:func:`fastdata.convert_coco`): one sample per image of the annotation file, in
``CocoDetection``'s order, images without annotations included, each holding the fields of
:data:`COCO_SCHEMA`:

* ``image``: the image file's bytes, bit-exact (decoded when read);
* ``image_id``: the image's id (``CocoDetection.ids[i]``), in the shard index;
* ``width``, ``height``: the sizes the file lists (-1 when absent or not an integer), in the index;
* ``annotations``: the image's annotation dicts exactly as ``json.load`` gave them (same keys,
  key order, values and types: msgpack keeps ints apart from floats and bools), in file order;
* ``image_info``: the image's entry of the file's ``images`` list as ``json.load`` gave it
  (``file_name``, ``height``, ``width``, ``id`` and any other key), so that the annotation file's
  ground truth can be rebuilt from the store (``CocoStoreDataset.coco``). Appended after the
  others: stores converted before it existed lack it, and readers rebuild the entry from
  ``image_id``, ``width``, ``height`` and the stored path.

The file's ``categories``, ``info`` and ``licenses`` go into the manifest
(``metadata.coco``), where :class:`fastdata.reader.coco.CocoStoreDataset` finds them. The
samples are a map-style input whose items name the image file (:class:`CocoSamples`), so
the files are read and validated in the worker processes, and ``resume`` finishes an
interrupted conversion. An image file that is missing or not a usable image is skipped and
reported as rejected (the image ids of the others do not move: each sample stores its own);
the annotation file's problems are reported as warnings. With ``strict`` any of them stops
the conversion before anything is written, naming them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import xxhash

from fastdata.common.coco_rle import rle_size
from fastdata.common.imageio import pixel_limit
from fastdata.errors import RejectedInputError, SourceError
from fastdata.format.fields import JSON, Image, Int, Schema
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.python import MapInput

__all__ = ["COCO_SCHEMA", "CocoIndex", "CocoInput", "CocoSamples", "load_coco", "Problem"]

#: ``(where, reason)``: where names the file, or the annotation file and the entry's position
Problem = tuple[str, str]

_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
#: top-level keys the index keeps apart; any other top-level key lands in ``CocoIndex.other``
_SECTIONS = ("info", "licenses", "images", "annotations", "categories")
#: at most this many problems of one kind are listed one by one; the rest are counted in one line
MAX_LISTED_PROBLEMS = 1000
#: the most annotations one image may have: an image with more is rejected (reported; the conversion goes on)
MAX_ANNOTATIONS_PER_IMAGE = 5000
# msgpack cannot pack a lone surrogate as UTF-8, and json.load can produce one ("\ud800")
_UNICODE_ERRORS = "surrogatepass"


def _is_int(v: Any, bounds: tuple[int, int] = _INT64) -> bool:
    """A JSON integer (``bool`` is not one, although Python says it is an ``int``) within ``bounds``."""
    return type(v) is int and bounds[0] <= v <= bounds[1]


def _is_real(v: Any) -> bool:
    return type(v) is int or type(v) is float


def _is_float(v: Any) -> bool:
    return type(v) is float


def _is_float_box(v: Any) -> bool:
    """A box the float64 column rebuilds exactly: a list of four Python floats."""
    return type(v) is list and len(v) == 4 and all(type(x) is float for x in v)


def _is_box(v: Any) -> bool:
    """A box the converter can use: a list of four JSON numbers."""
    return type(v) is list and len(v) == 4 and all(_is_real(x) for x in v)


@dataclass
class _PackedRows:
    """Dicts kept as key layouts plus msgpack blobs of the values no column holds.

    A layout is the dict's keys in order, each flagged ``True`` when its value is rebuilt
    from a typed column (the column holds it exactly) and ``False`` when it is in the blob.
    Distinct layouts are few (every COCO annotation of a file usually has the same keys),
    so a row costs one int32 and its blob bytes.
    """

    layouts: list[tuple[tuple[str, bool], ...]]
    layout_of: np.ndarray  # int32 per row
    blob: np.ndarray  # uint8, the rows' msgpack payloads one after the other
    offsets: np.ndarray  # int64, len(rows) + 1

    def rest(self, row: int) -> list:
        """The values of ``row`` that no column holds, in key order."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if start == end:
            return []
        data = self.blob.data[start:end]  # a view, no copy
        return msgpack.unpackb(data, raw=False, unicode_errors=_UNICODE_ERRORS)

    def rebuild(self, row: int, typed: Callable[[str, int], Any]) -> dict:
        """The dict of ``row``; ``typed(key, row)`` gives a value held by a column."""
        rest = iter(self.rest(row))
        return {key: (typed(key, row) if in_column else next(rest))
                for key, in_column in self.layouts[int(self.layout_of[row])]}


class _RowPacker:
    """Builds :class:`_PackedRows` one dict at a time.

    ``exact`` maps a column's key to a test: a value passing it is rebuilt from the column
    as the same Python object, so it is not packed again.
    """

    def __init__(self, exact: dict[str, Callable[[Any], bool]], source: str):
        self._exact = exact
        self._source = source
        self._layout_ids: dict[tuple[tuple[str, bool], ...], int] = {}
        self.layouts: list[tuple[tuple[str, bool], ...]] = []
        self._layout_of: list[int] = []
        self._parts: list[bytes] = []
        self._packer = msgpack.Packer(use_bin_type=True, unicode_errors=_UNICODE_ERRORS)

    def add(self, row: dict, where: str) -> None:
        layout = []
        rest = []
        for key, value in row.items():
            test = self._exact.get(key)
            in_column = test is not None and test(value)
            layout.append((key, in_column))
            if not in_column:
                rest.append(value)
        key_order = tuple(layout)
        layout_id = self._layout_ids.get(key_order)
        if layout_id is None:
            layout_id = self._layout_ids[key_order] = len(self.layouts)
            self.layouts.append(key_order)
        self._layout_of.append(layout_id)
        self._parts.append(self._pack(rest, where) if rest else b"")

    def _pack(self, values: list, where: str) -> bytes:
        try:
            return self._packer.pack(values)
        except (OverflowError, ValueError, TypeError) as err:  # an integer beyond 64 bits
            raise SourceError(f"{self._source}: {where} holds a value that cannot be stored ({err}); "
                              "integers must fit in 64 bits") from None

    def finish(self, order: np.ndarray) -> _PackedRows:
        """The rows taken in ``order`` (file positions; one may repeat)."""
        parts = [self._parts[j] for j in order.tolist()]
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        layout_of = np.asarray(self._layout_of, dtype=np.int32).reshape(-1)
        return _PackedRows(
            layouts=self.layouts,
            layout_of=layout_of[order] if len(order) else np.zeros(0, np.int32),
            blob=np.frombuffer(b"".join(parts), dtype=np.uint8),
            offsets=offsets,
        )


@dataclass
class CocoIndex:
    """One COCO annotation file, as arrays in ``CocoDetection``'s order.

    Image ``i`` (``0 <= i < len(index)``) is the one with the ``i``-th smallest id.
    Its annotations are rows ``ann_start[i]:ann_start[i + 1]`` of the ``ann_*`` arrays,
    in file order.

    Attributes:
        ann_file (str): the annotation file (absolute path).
        image_dir (str | None): the image folder file names are relative to, if given.
        ids (np.ndarray): int64 image ids, sorted ascending (``CocoDetection.ids``).
        width, height (np.ndarray): int32 image sizes from the file (-1 when absent or not an integer).
        sizes (np.ndarray): int64 file sizes found under ``image_dir`` (-1: missing; all -1 without ``image_dir``).
        ann_start (np.ndarray): int64, ``len(ids) + 1`` offsets into the annotation arrays.
        ann_id, ann_image_id, ann_category_id, ann_iscrowd (np.ndarray): int64 per annotation
            (``iscrowd`` 0 when absent).
        ann_bbox (np.ndarray): float64 ``(N, 4)`` boxes as in the file, COCO ``[x, y, w, h]``.
        ann_area (np.ndarray): float64 per annotation (NaN when absent or not a number).
        categories (list[dict]): the file's ``categories`` (``[]`` when absent).
        info (dict | None), licenses (list | None): as in the file, ``None`` when absent.
        other (dict): any other top-level key of the file.
        problems (list[Problem]): ``(where, reason)`` for every inconsistency met (see the module doc).
    """

    ann_file: str
    image_dir: str | None
    ids: np.ndarray
    width: np.ndarray
    height: np.ndarray
    sizes: np.ndarray
    ann_start: np.ndarray
    ann_id: np.ndarray
    ann_image_id: np.ndarray
    ann_category_id: np.ndarray
    ann_bbox: np.ndarray
    ann_area: np.ndarray
    ann_iscrowd: np.ndarray
    categories: list[dict]
    info: dict | None
    licenses: list | None
    other: dict
    problems: list[Problem]
    _names: np.ndarray = field(repr=False)  # uint8, os.fsencode'd file names one after the other
    _name_offsets: np.ndarray = field(repr=False)  # int64, len(ids) + 1
    _image_rows: _PackedRows = field(repr=False)
    _ann_rows: _PackedRows = field(repr=False)
    #: images (sorted position) that are rejected, and why: a file outside the image folder, an RLE
    #: segmentation that does not fit the image, more than MAX_ANNOTATIONS_PER_IMAGE annotations
    refused: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_annotations(self) -> int:
        """Annotations kept (those of a listed image), over all images."""
        return int(self.ann_start[-1])

    def relpath(self, i: int) -> bytes:
        """The ``file_name`` of image ``i`` as bytes (``os.fsencode``)."""
        return bytes(self._names[self._name_offsets[i]:self._name_offsets[i + 1]])

    def file_name(self, i: int) -> str:
        """The ``file_name`` of image ``i`` (str)."""
        return os.fsdecode(self.relpath(i))

    def path(self, i: int) -> str:
        """Where ``CocoDetection`` opens image ``i``: ``os.path.join(image_dir, file_name)``.

        Raises:
            ValueError: the index was loaded without an image folder.
        """
        if self.image_dir is None:
            raise ValueError("this COCO index was loaded without an image folder; pass image_dir to load_coco")
        return os.path.join(self.image_dir, self.file_name(i))

    def ann_slice(self, i: int) -> slice:
        """Rows of image ``i`` in the ``ann_*`` arrays."""
        return slice(int(self.ann_start[i]), int(self.ann_start[i + 1]))

    def annotations(self, i: int) -> list[dict]:
        """The annotation dicts of image ``i``, equal to ``coco.loadAnns(coco.getAnnIds(self.ids[i]))``
        and to what ``json.load`` gave (same keys, key order, values and types)."""
        start, end = int(self.ann_start[i]), int(self.ann_start[i + 1])
        return [self._ann_rows.rebuild(row, self._ann_value) for row in range(start, end)]

    def image(self, i: int) -> dict:
        """The ``images`` entry of image ``i`` as ``json.load`` gave it (the last one when its id repeats)."""
        return self._image_rows.rebuild(i, self._image_value)

    def _ann_value(self, key: str, row: int) -> Any:
        if key == "bbox":
            return self.ann_bbox[row].tolist()
        if key == "area":
            return float(self.ann_area[row])
        column = {"id": self.ann_id, "image_id": self.ann_image_id, "category_id": self.ann_category_id,
                  "iscrowd": self.ann_iscrowd}[key]
        return int(column[row])

    def _image_value(self, key: str, i: int) -> Any:
        if key == "file_name":
            return self.file_name(i)
        return int({"id": self.ids, "width": self.width, "height": self.height}[key][i])


def load_coco(ann_file: str | os.PathLike, image_dir: str | os.PathLike | None = None) -> CocoIndex:
    """Parse a COCO instances annotation file (and check its images exist under ``image_dir``).

    Args:
        ann_file (str | os.PathLike): the annotation JSON file.
        image_dir (str | os.PathLike | None): the folder ``file_name`` is relative to; when
            given, every image file is looked up and a missing one is a problem.

    Returns:
        CocoIndex: images sorted by id, their annotations in file order, and the problems found.

    Raises:
        SourceError: the file is missing, not JSON, not a COCO object, or an entry lacks a
            required key (images: ``id``, ``file_name``; annotations: ``id``, ``image_id``,
            ``category_id``, ``bbox``) or has one of the wrong type; the message names the entry.
    """
    source = os.path.abspath(os.fspath(ann_file))
    data = _read_json(source)
    images = _section(data, source, "images", required=True)
    annotations = _section(data, source, "annotations", required=False)
    categories = _section(data, source, "categories", required=False)
    problems: list[Problem] = []
    img = _parse_images(images, source, problems)
    anns = _parse_annotations(annotations, source)
    root = None if image_dir is None else os.path.abspath(os.fspath(image_dir))
    refused: dict[int, str] = {}
    sizes = _stat_images(root, img["names"], img["keep"], problems, refused)
    grouping = _group_annotations(anns, img["sorted_ids"], source, annotations, problems)
    _refuse_annotations(anns, grouping, img["height"][img["keep"]], img["width"][img["keep"]], refused)
    _check_categories(categories, anns, source, problems)
    keep, content = img["keep"], grouping["content"]
    names = [img["names"][j] for j in keep.tolist()]
    name_offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=name_offsets[1:])
    return CocoIndex(
        ann_file=source,
        image_dir=root,
        ids=img["sorted_ids"],
        width=img["width"][keep],
        height=img["height"][keep],
        sizes=sizes,
        ann_start=grouping["start"],
        ann_id=anns["id"][content],
        ann_image_id=anns["image_id"][content],
        ann_category_id=anns["category_id"][content],
        ann_bbox=anns["bbox"][content].reshape(-1, 4),
        ann_area=anns["area"][content],
        ann_iscrowd=anns["iscrowd"][content],
        categories=categories,
        info=data.get("info"),
        licenses=data.get("licenses"),
        other={k: v for k, v in data.items() if k not in _SECTIONS},
        problems=problems,
        _names=np.frombuffer(b"".join(names), dtype=np.uint8),
        _name_offsets=name_offsets,
        _image_rows=img["packer"].finish(keep),
        _ann_rows=anns["packer"].finish(content),
        refused=refused,
    )


def _read_json(source: str) -> dict:
    """The file's top-level object; every way it can fail is one :class:`SourceError`."""
    try:
        with open(source, "rb") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise SourceError(f"COCO annotation file not found: {source}") from None
    except IsADirectoryError:
        raise SourceError(f"{source} is a folder; give the COCO annotation .json file") from None
    except PermissionError:
        raise SourceError(f"cannot read COCO annotation file (permission denied): {source}") from None
    except json.JSONDecodeError as err:
        raise SourceError(f"{source}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); "
                          "is this a COCO annotation file?") from None
    except (UnicodeDecodeError, RecursionError) as err:
        raise SourceError(f"{source}: not a readable JSON file ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{source}: a COCO annotation file is a JSON object with an 'images' list; "
                          f"this one holds a {type(data).__name__}")
    return data


def _section(data: dict, source: str, key: str, *, required: bool) -> list:
    """``data[key]``, a list of objects; an absent optional section is ``[]`` (pycocotools skips it)."""
    if key not in data:
        if required:
            found = ", ".join(repr(k) for k in list(data)[:10]) or "none"
            raise SourceError(f"{source}: no {key!r} list (top-level keys: {found}); "
                              "is this a COCO annotation file?")
        return []
    entries = data[key]
    if not isinstance(entries, list):
        raise SourceError(f"{source}: {key!r} must be a list, not a {type(entries).__name__}")
    for pos, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise SourceError(f"{source}: {key}[{pos}] must be an object, not a {type(entry).__name__}")
    return entries


def _required(entry: dict, key: str, test: Callable[[Any], bool], what: str, source: str, where: str) -> Any:
    if key not in entry:
        raise SourceError(f"{source}: {where} has no {key!r} key (fix the entry or remove it)")
    value = entry[key]
    if not test(value):
        raise SourceError(f"{source}: {where} has {key}={_short(value)}, which is not {what}")
    return value


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_images(images: list[dict], source: str, problems: list[Problem]) -> dict:
    """Columns of the ``images`` section in file order, plus which entry each sorted id keeps."""
    packer = _RowPacker({"id": _is_int, "file_name": _is_fs_name,
                         "width": lambda v: _is_int(v, _INT32), "height": lambda v: _is_int(v, _INT32)}, source)
    n = len(images)
    ids = np.empty(n, dtype=np.int64)
    width = np.full(n, -1, dtype=np.int32)
    height = np.full(n, -1, dtype=np.int32)
    names: list[bytes] = []
    for pos, entry in enumerate(images):
        where = f"images[{pos}]"
        ids[pos] = _required(entry, "id", _is_int, "an integer", source, where)
        name = _required(entry, "file_name", lambda v: type(v) is str and v != "", "a file name", source, where)
        if not _is_fs_name(name):
            raise SourceError(f"{source}: {where} (image id {entry.get('id')!r}) has file_name={_short(name)}, which "
                              "no file system path can hold (a NUL byte, or not encodable)")
        names.append(os.fsencode(name))
        width[pos] = entry["width"] if _is_int(entry.get("width"), _INT32) else -1
        height[pos] = entry["height"] if _is_int(entry.get("height"), _INT32) else -1
        packer.add(entry, where)
    # pycocotools' imgs[id] = img keeps the last entry of a repeated id
    sorted_ids, rev_first, counts = np.unique(ids[::-1], return_index=True, return_counts=True)
    keep = (n - 1 - rev_first).astype(np.int64)
    for k in np.flatnonzero(counts > 1).tolist()[:MAX_LISTED_PROBLEMS]:
        dup = int(sorted_ids[k])
        positions = np.flatnonzero(ids == dup).tolist()
        problems.append((f"{source}: images{positions}",
                         f"image id {dup} is listed {len(positions)} times; the last entry is kept "
                         "(as pycocotools does) and every annotation of that id goes to it"))
    _count_more(problems, int(np.count_nonzero(counts > 1)), "repeated image ids", source)
    return {"sorted_ids": sorted_ids.astype(np.int64), "keep": keep, "names": names, "width": width,
            "height": height, "packer": packer}


def _is_fs_name(v: Any) -> bool:
    if type(v) is not str or "\x00" in v:  # no path can hold a NUL (os.stat would raise a bare ValueError)
        return False
    try:
        os.fsencode(v)
    except UnicodeEncodeError:
        return False
    return True


def _parse_annotations(annotations: list[dict], source: str) -> dict:
    """Columns of the ``annotations`` section in file order."""
    packer = _RowPacker({"id": _is_int, "image_id": _is_int, "category_id": _is_int, "iscrowd": _is_int,
                         "area": _is_float, "bbox": _is_float_box}, source)
    n = len(annotations)
    ann_id = np.empty(n, dtype=np.int64)
    image_id = np.zeros(n, dtype=np.int64)
    image_id_ok = np.ones(n, dtype=bool)
    category_id = np.empty(n, dtype=np.int64)
    bbox = np.empty((n, 4), dtype=np.float64)
    area = np.full(n, math.nan, dtype=np.float64)
    iscrowd = np.zeros(n, dtype=np.int64)
    rle_hw = np.full((n, 2), -1, dtype=np.int64)
    rle_problem: dict[int, str] = {}
    for pos, entry in enumerate(annotations):
        where = f"annotations[{pos}]"
        ann_id[pos] = _required(entry, "id", _is_int, "an integer", source, where)
        value = _required(entry, "image_id", lambda v: True, "", source, where)
        # an image id of another type names no image: reported as a dangling annotation, not an error
        if _is_int(value):
            image_id[pos] = value
        else:
            image_id_ok[pos] = False
        category_id[pos] = _required(entry, "category_id", _is_int, "an integer", source, where)
        bbox[pos] = _required(entry, "bbox", _is_box, "a list of 4 numbers [x, y, width, height]", source, where)
        if _is_real(entry.get("area")):
            area[pos] = entry["area"]
        crowd = entry.get("iscrowd", 0)
        iscrowd[pos] = int(crowd) if _is_int(crowd) or type(crowd) is bool else 0
        segmentation = entry.get("segmentation")
        if isinstance(segmentation, dict):
            size, why = rle_size(segmentation)
            if why is not None:
                rle_problem[pos] = why
            else:
                rle_hw[pos] = size
        packer.add(entry, where)
    return {"id": ann_id, "image_id": image_id, "image_id_ok": image_id_ok, "category_id": category_id,
            "bbox": bbox, "area": area, "iscrowd": iscrowd, "packer": packer, "rle_hw": rle_hw,
            "rle_problem": rle_problem}


def _refuse_annotations(anns: dict, grouping: dict, height: np.ndarray, width: np.ndarray,
                        refused: dict[int, str]) -> None:
    """Refuse the images with more than :data:`MAX_ANNOTATIONS_PER_IMAGE` annotations, or with an RLE
    segmentation that is unusable or whose size is not the image's listed ``[height, width]``."""
    start, content = grouping["start"], grouping["content"]
    counts = np.diff(start)
    limit = pixel_limit()
    # masks (pycocotools' annToMask, polygons included) are allocated at the listed size
    for i in np.flatnonzero(height.astype(np.int64) * width.astype(np.int64) > limit).tolist():
        refused.setdefault(i, f"its listed size {int(height[i])} x {int(width[i])} is more than the {limit:,} pixels "
                              "an image may have (PIL.Image.MAX_IMAGE_PIXELS)")
    for i in np.flatnonzero(counts > MAX_ANNOTATIONS_PER_IMAGE).tolist():
        refused.setdefault(i, f"{int(counts[i]):,} annotations, more than the {MAX_ANNOTATIONS_PER_IMAGE:,} "
                              "allowed for one image")
    rle_hw, rle_problem = anns["rle_hw"], anns["rle_problem"]
    slots = np.flatnonzero((rle_hw[content, 0] >= 0) | np.isin(content, list(rle_problem)))
    if not len(slots):
        return
    images = np.searchsorted(start, slots, side="right") - 1
    for slot, i in zip(slots.tolist(), images.tolist(), strict=True):
        pos = int(content[slot])
        where = f"annotation id {int(anns['id'][pos])}"
        if pos in rle_problem:
            refused.setdefault(i, f"{where}: {rle_problem[pos]}")
            continue
        h, w = (int(v) for v in rle_hw[pos])
        if height[i] >= 0 and width[i] >= 0 and (h, w) != (int(height[i]), int(width[i])):
            refused.setdefault(i, f"{where}: RLE segmentation size [{h}, {w}] is not the image's "
                                  f"[{int(height[i])}, {int(width[i])}] (height, width)")
        elif h * w > limit:
            refused.setdefault(i, f"{where}: RLE segmentation size [{h}, {w}] is more than the {limit:,} pixels an "
                                  "image may have (PIL.Image.MAX_IMAGE_PIXELS)")


def _group_annotations(anns: dict, sorted_ids: np.ndarray, source: str, annotations: list[dict],
                       problems: list[Problem]) -> dict:
    """Per-image ranges and, for each slot, the file position of the dict it shows.

    Slots follow pycocotools: ``imgToAnns[image_id]`` in file order; the dict shown for
    annotation id ``a`` is ``anns[a]``, the last annotation with that id.
    """
    image_id = anns["image_id"]
    slot_image = np.searchsorted(sorted_ids, image_id)
    found = anns["image_id_ok"] & (slot_image < len(sorted_ids))
    found[found] = sorted_ids[slot_image[found]] == image_id[found]
    dangling = np.flatnonzero(~found).tolist()
    for pos in dangling[:MAX_LISTED_PROBLEMS]:
        problems.append((f"{source}: annotations[{pos}] (id {int(anns['id'][pos])})",
                         f"image_id {_short(annotations[pos]['image_id'])} is not in 'images'; "
                         "the annotation is left out (no sample can show it)"))
    _count_more(problems, len(dangling), "annotations of unknown images", source)
    kept = np.flatnonzero(found)
    order = kept[np.argsort(slot_image[kept], kind="stable")]
    counts = np.bincount(slot_image[kept], minlength=len(sorted_ids))
    start = np.zeros(len(sorted_ids) + 1, dtype=np.int64)
    np.cumsum(counts, out=start[1:])
    return {"start": start, "content": _last_of_id(anns["id"], source, problems)[order]}


def _last_of_id(ann_ids: np.ndarray, source: str, problems: list[Problem]) -> np.ndarray:
    """For each file position, the position of the last annotation with the same id."""
    n = len(ann_ids)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    uniq, rev_first, inverse, counts = np.unique(ann_ids[::-1], return_index=True, return_inverse=True,
                                                 return_counts=True)
    last = (n - 1 - rev_first).astype(np.int64)
    repeated = np.flatnonzero(counts > 1).tolist()
    for k in repeated[:MAX_LISTED_PROBLEMS]:
        positions = np.flatnonzero(ann_ids == uniq[k]).tolist()
        problems.append((f"{source}: annotations{positions}",
                         f"annotation id {int(uniq[k])} is listed {len(positions)} times; as in pycocotools, "
                         "each of them shows the last one's dict"))
    _count_more(problems, len(repeated), "repeated annotation ids", source)
    return last[inverse.reshape(-1)[::-1]]


def _check_categories(categories: list[dict], anns: dict, source: str, problems: list[Problem]) -> None:
    """Report annotations whose category is not listed (only when categories are listed at all)."""
    known: set[Any] = {c.get("id") for c in categories}
    if not known:
        return
    known_ints = np.asarray(sorted(k for k in known if _is_int(k)), dtype=np.int64)
    unknown = np.flatnonzero(~np.isin(anns["category_id"], known_ints)).tolist()
    for pos in unknown[:MAX_LISTED_PROBLEMS]:
        problems.append((f"{source}: annotations[{pos}] (id {int(anns['id'][pos])})",
                         f"category_id {int(anns['category_id'][pos])} is not in 'categories'; kept as it is"))
    _count_more(problems, len(unknown), "annotations of unlisted categories", source)


def _stat_images(root: str | None, names: list[bytes], keep: np.ndarray, problems: list[Problem],
                 refused: dict[int, str] | None = None) -> np.ndarray:
    """File sizes of the kept images under ``root`` (-1 when missing or not looked up). A ``file_name``
    that resolves (symbolic links followed) outside ``root`` is refused: never read."""
    sizes = np.full(len(keep), -1, dtype=np.int64)
    if root is None:
        return sizes
    missing = 0
    broot = os.fsencode(root)
    real_root = os.path.join(os.path.realpath(broot), b"")
    for i, j in enumerate(keep.tolist()):
        path = os.path.join(broot, names[j])
        if not os.path.realpath(path).startswith(real_root):
            if refused is not None:
                refused[i] = (f"file_name {os.fsdecode(names[j])!r} resolves outside the image folder {root} (an "
                              "absolute path, '..' or a symbolic link leading out): only files inside it are read; "
                              "copy or move the image into the folder")
            continue
        try:
            sizes[i] = os.stat(path).st_size
        except OSError as err:
            missing += 1
            if missing <= MAX_LISTED_PROBLEMS:
                problems.append((os.fsdecode(path), f"image file cannot be read ({err.strerror})"))
    _count_more(problems, missing, "missing image files", root)
    return sizes


def _count_more(problems: list[Problem], total: int, what: str, where: str) -> None:
    if total > MAX_LISTED_PROBLEMS:
        problems.append((where, f"... and {total - MAX_LISTED_PROBLEMS} more {what} (the first "
                                f"{MAX_LISTED_PROBLEMS} are listed)"))


# --------------------------------------------------------------------------- the write source

#: the fields of a store converted from a COCO annotation file
COCO_SCHEMA = Schema.of({
    "image": Image(),
    "image_id": Int("int64"),
    "width": Int("int32"),
    "height": Int("int32"),
    "annotations": JSON(),
    "image_info": JSON(),
})
#: problems named in a strict=True error (the rest are counted)
_STRICT_LISTED = 5


class CocoSamples:
    """A :class:`CocoIndex` as a map-style dataset of sample dicts: ``samples[i]`` names image
    ``i``'s file (read by the writer's worker) and carries its id, listed size and annotation dicts."""

    def __init__(self, index: CocoIndex):
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        index = self.index
        why = index.refused.get(i)
        if why is not None:  # rejected (reported) unless strict, which stops at planning
            raise RejectedInputError(why)
        return {
            "image": index.path(i),
            "image_id": int(index.ids[i]),
            "width": int(index.width[i]),
            "height": int(index.height[i]),
            "annotations": index.annotations(i),
            "image_info": index.image(i),
        }

    def input_name(self, i: int) -> str:
        """Image ``i``'s ``file_name``: what the rejected list names it by."""
        return self.index.file_name(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def _missing_files(index: CocoIndex) -> set[str]:
    """Paths of the images :func:`load_coco` could not find (they come back as rejected inputs)."""
    return {index.path(i) for i in (index.sizes < 0).nonzero()[0].tolist()}


def _strict_error(ann_file: str, problems: list[Problem]) -> RejectedInputError:
    listed = "; ".join(f"{where}: {why}" for where, why in problems[:_STRICT_LISTED])
    more = f" (and {len(problems) - _STRICT_LISTED} more)" if len(problems) > _STRICT_LISTED else ""
    return RejectedInputError(
        f"{ann_file}: {len(problems)} problem(s) with the COCO data: {listed}{more}. strict=True stops at any of "
        "them; without it, missing or unusable images are skipped and reported, and the rest are warnings")


def coco_metadata(index: CocoIndex, warnings: list[Problem]) -> dict:
    """What the manifest keeps of the annotation file (``metadata.coco``)."""
    return {"coco": {
        "annotation_file": index.ann_file,
        "image_dir": index.image_dir,
        "categories": index.categories,
        "info": index.info,
        "licenses": index.licenses,
        "problems": [{"path": where, "warning": why} for where, why in warnings],
    }}


class CocoInput(MapInput):
    """A COCO instances annotation file and the folder its images' ``file_name`` is relative to,
    as a map-style input of :class:`CocoSamples` with :data:`COCO_SCHEMA` (see the module docstring)."""

    unit = "images"

    def __init__(self, ann_file: str | os.PathLike, image_dir: str | os.PathLike):
        super().__init__(None, COCO_SCHEMA)
        self.ann_file, self.image_dir = ann_file, image_dir
        self.index: CocoIndex | None = None

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        index = self.index = self._load()
        refusals = [(index.path(i), why) for i, why in sorted(index.refused.items())]
        if run.strict and (index.problems or refusals):
            raise _strict_error(index.ann_file, index.problems + refusals)
        missing = _missing_files(index) | {path for path, _ in refusals}
        problems = [(where, why) for where, why in index.problems if where not in missing]
        self.samples, self.metadata = self._samples(index), coco_metadata(index, problems)
        self.warnings.extend(f"{where}: {why}" for where, why in problems)
        return super().plan(run, dst)

    def _load(self) -> CocoIndex:
        """The parsed annotation file (a remote source reads it from its URL)."""
        return load_coco(self.ann_file, self.image_dir)

    def _samples(self, index: CocoIndex) -> CocoSamples:
        """The samples the workers encode (a remote source's fetch their images)."""
        return CocoSamples(index)

    def fingerprint(self, run: RunOptions) -> str:
        """:meth:`MapInput.fingerprint` (a few encoded samples) and, for every image, its id, file
        name, size on disk and annotations' ids, categories, boxes, areas and crowd flags, and the
        categories: a resume refuses an annotation file or an image file changed anywhere (names,
        labels and sizes, as an image folder's resume), not only at the samples probed."""
        index = self.index
        assert index is not None, "CocoInput.plan loads the annotation file first"
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        for arr in (index.ids, index.width, index.height, index.sizes, index._names, index._name_offsets,
                    index.ann_start, index.ann_id, index.ann_image_id, index.ann_category_id, index.ann_bbox,
                    index.ann_area, index.ann_iscrowd):
            h.update(repr((arr.dtype.str, arr.shape)).encode())
            h.update(np.ascontiguousarray(arr).tobytes())
        h.update(json.dumps(index.categories, sort_keys=True, default=repr).encode())
        return h.hexdigest()

    def options_text(self, run: RunOptions) -> str:
        assert self.index is not None, "CocoInput.plan loads the annotation file first"
        return f"COCO {self.index.ann_file}, images in {self.index.image_dir}; {super().options_text(run)}"
