"""The ``fastdata`` command line: a thin layer over the public API.

``main(argv=None) -> int`` so tests run it in-process. Errors are one line on
stderr and a non-zero exit code: 2 for a fastdata error or bad usage, 1 when a
check fails (``verify``, ``doctor``), 130 on Ctrl-C; ``verify`` also exits 3 on
a path that is not a store and 4 on an unfinished conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fastdata._version import __version__
from fastdata.cli.flags import cli_spelling, command_parser
from fastdata.cli.options import add_remote_options, remote_options
from fastdata.common.text import printable
from fastdata.errors import FastdataError

EXIT_OK, EXIT_FAILED_CHECK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
#: ``verify`` only: the path is not a fastdata store / holds an unfinished conversion
EXIT_NOT_A_STORE, EXIT_UNFINISHED = 3, 4


def _cmd_convert(args) -> int:
    from fastdata.writer.api import convert
    from fastdata.writer.distributed import current_group, init_from_env, shutdown

    created = init_from_env()  # under torchrun: join the job's process group (gloo)
    try:
        report = _run_coco(args) if getattr(args, "coco", None) else _run_convert(convert, args)
        group = current_group()
        rank = group.rank if group else 0
    finally:
        shutdown(created)
    for warning in report.warnings:
        print(f"warning: {printable(args.say(warning), keep_newlines=True)}", file=sys.stderr)
    if not args.quiet and rank == 0:
        print(printable(args.say(report.summary()), keep_newlines=True))
    return EXIT_OK


def _run_convert(convert, args):
    return convert(
        args.src, args.dst, format=args.format, workers=args.workers, shard_size=args.shard_size,
        max_side=args.max_side, quality=args.quality, raw=args.raw, lossless=args.lossless,
        storage=args.storage, raw_fraction=args.raw_fraction, raw_budget=args.raw_budget, image_mode=args.image_mode,
        dicom_tags=args.dicom_tags, strict=args.strict, resume=args.resume,
        overwrite=args.overwrite, append=args.append, add_classes=args.add_classes,
        progress=False if args.quiet else None, lmdb_map_size=args.lmdb_map_size,
        chunks=args.chunks, codec=args.codec, max_pixels=args.max_pixels, image_column=args.image_column,
        **_list_options(args), **_upload_options(args), **_added_options(args),
    )


def _added_options(args) -> dict:
    """``convert --append``'s values for the store's added fields, as keyword arguments (only those given)."""
    import json

    from fastdata.writer.add_fields import appended_values_from_files

    out: dict = {}
    if args.added_values:
        out["added_values"] = appended_values_from_files(args.added_values)
    if args.added_defaults:
        defaults = {}
        for spec in args.added_defaults:
            name, sep, text = spec.partition("=")
            if not sep or not name:
                raise ValueError(f"--added-default takes NAME=JSON (e.g. score=0.0, caption='\"none\"'), got {spec!r}")
            try:
                defaults[name] = json.loads(text)
            except ValueError:
                raise ValueError(f"--added-default {spec}: {text!r} is not a JSON value (a string needs quotes: "
                                 f"{name}='\"{text}\"')") from None
        out["added_defaults"] = defaults
    return out


def _upload_options(args) -> dict:
    """``convert``'s options for a URL destination, as keyword arguments (only those given)."""
    from fastdata.remote.location import parse_storage_options

    out: dict = {}
    if args.storage_options:
        out["storage_options"] = parse_storage_options(args.storage_options)
    if args.staging_dir:
        out["staging_dir"] = args.staging_dir
    return out


def _storage_options(args) -> dict | None:
    """``--storage-option`` pairs as ``storage_options`` (None when none were given)."""
    from fastdata.remote.location import parse_storage_options

    return parse_storage_options(args.storage_options) if args.storage_options else None


def _cmd_merge(args) -> int:
    from fastdata.writer.merge import merge

    report = merge(args.stores, args.output, overwrite=args.overwrite, link=not args.copy,
                   storage_options=_storage_options(args))
    if not args.quiet:
        print(printable(args.say(report.summary()), keep_newlines=True))
    return EXIT_OK


def _cmd_info(args) -> int:
    from fastdata.common.units import exact_size, format_size
    from fastdata.format.storage_mode import StorageMode
    from fastdata.tools.verify import info

    data = info(args.store, **remote_options(args, limit=False))
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    storage = data["storage"]
    kind = StorageMode.parse(storage["mode"])
    mode = kind.value + (f" (max side {storage['max_side']}, quality {storage['quality']})"
                         if kind.reencodes_large_images else
                         f" ({storage['raw_shape'][0]}x{storage['raw_shape'][1]})"
                         if kind.holds_fixed_size_pixels else
                         f" (pixels up to {storage['max_side']} px, raw budget "
                         f"{exact_size(storage['raw_budget'])})"
                         if kind.picks_images_to_hold_as_pixels and storage.get("raw_budget") is not None else
                         f" (pixels up to {storage['max_side']} px, raw fraction {storage['raw_fraction']:g})"
                         if kind.picks_images_to_hold_as_pixels else
                         f" (pixels up to {storage['max_side']} px"
                         + (f", raw budget {exact_size(storage['raw_budget'])}"
                            if storage.get("raw_budget") is not None else "") + ")"
                         if kind.holds_only_native_size_pixels else "")
    print(f"store:    {printable(data['path'])}")
    print(f"backend:  {data['backend']} (layout version {data['version']})")
    print(f"storage:  {mode}")
    categories = data.get("categories")
    labels = (f"{data['num_categories']} categories (detection)" if categories is not None
              else f"{data['num_classes']} classes")
    print(f"samples:  {data['num_samples']} in {labels}; {data['rejected']} input(s) rejected")
    print(f"size:     {format_size(data['total_bytes'])} in {len(data['shards'])} shard(s)")
    options = data.get("options") or {}
    merged, appends = options.get("merged") or [], options.get("appends") or []
    if merged:
        # a merge, or the parts of an engine's tasks published as one store (e.g. fastdata.integrations.ray)
        source = options.get("source") or "fastdata.merge"
        made = (f"fastdata merge of {len(merged)} stores" if source == "fastdata.merge" else
                f"{printable(str(source))}, {len(merged)} part(s) published as one store")
        print(f"made by:  {made}: "
              + ", ".join(f"{printable(str(m.get('store')))} ({m.get('samples')})" for m in merged))
    if appends:
        print(f"appends:  {len(appends)}, adding " + ", ".join(str(a.get("samples")) for a in appends) + " samples")
    remapped = sum(1 for sh in data["shards"] if sh.get("label_map") is not None)
    if remapped:
        print(f"labels:   {remapped} shard(s) carry a label map (merged from stores with other class tables)")
    split = data.get("raw_split")
    if split:
        print(f"records:  {split['raw']['count']} raw (PPM pixels, {format_size(split['raw']['bytes'])}), "
              f"{split['encoded']['count']} encoded ({format_size(split['encoded']['bytes'])})")
    _print_images(data)
    for name, census in (data.get("arrays") or {}).items():
        shapes = ("no samples" if census["min_shape"] is None else
                  f"shapes {tuple(census['min_shape'])} .. {tuple(census['max_shape'])}")
        print(f"{printable(name) + ':':<9} {shapes}; {format_size(census['raw_bytes'])} of values uncompressed")
    if data.get("schema"):
        from fastdata.format.fields import Schema

        print("schema:")
        for line in Schema.from_json(data["schema"]).describe_markdown().splitlines():
            print(f"  {printable(line)}")
    if data.get("added_fields"):
        print("added fields:")
        for f in data["added_fields"]:
            params = ", ".join(f"{k}={v}" for k, v in f.items() if k not in ("name", "kind", "generation", "added"))
            print(f"  {printable(f['name'])}: {f['kind']}{f' ({params})' if params else ''}, added {f['added']} "
                  f"(generation {f['generation']})")
    if categories is not None:  # a detection store: its labels are the annotation file's categories
        print("categories:")
        for c in categories:
            group = f" ({printable(str(c['supercategory']))})" if "supercategory" in c else ""
            print(f"  {printable(str(c.get('id'))):>5}  {printable(str(c.get('name')))}{group}")
    if data["classes"] or categories is None:
        print("classes:")
        for c in data["classes"]:
            print(f"  {c['index']:>5}  {printable(c['name'])}: {c['count']}")
    print("shards:")
    for s in data["shards"]:
        print(f"  {printable(s['name'])}: {s['count']} records, {format_size(s['bytes'])}")
    return EXIT_OK


def _cmd_add_fields(args) -> int:
    from fastdata.writer.add_fields import add_fields, values_from_file

    options = _storage_options(args)
    values = values_from_file(args.store, args.values_file, names=args.names or (), key=args.key)
    say = (lambda *a: None) if args.quiet else (lambda text: print(printable(text), file=sys.stderr))
    say(f"adding {', '.join(values)} to {args.store} ...")
    m = add_fields(args.store, values, replace=args.replace, storage_options=options, resume=args.resume,
                   progress=None if args.quiet else lambda done, total: say(f"  field files: {done}/{total} shards"))
    if not args.quiet:
        added = [f for f in m.get("added_fields", []) if f["name"] in values]
        print(printable(f"{args.store}: added {', '.join(f['name'] + ' (' + f['field']['kind'] + ')' for f in added)} "
                        f"to {m['num_samples']} samples in {len(m['shards'])} shard(s), as generation "
                        f"{added[0]['generation'] if added else '?'}; no shard file was rewritten"))
    return EXIT_OK


def _cmd_drop_fields(args) -> int:
    from fastdata.writer.add_fields import drop_fields

    drop_fields(args.store, args.names, storage_options=_storage_options(args))
    if not args.quiet:
        print(printable(f"{args.store}: dropped {', '.join(args.names)} (their files go with the next change, or "
                        "with 'fastdata gc')"))
    return EXIT_OK


def _cmd_rename_field(args) -> int:
    from fastdata.writer.add_fields import rename_field

    rename_field(args.store, args.old, args.new, storage_options=_storage_options(args))
    if not args.quiet:
        print(printable(f"{args.store}: renamed {args.old} to {args.new}"))
    return EXIT_OK


def _cmd_gc(args) -> int:
    from fastdata.writer.add_fields import gc

    removed = gc(args.store, storage_options=_storage_options(args))
    if not args.quiet:
        print(printable(f"{args.store}: removed {len(removed)} field file(s) the store no longer lists"))
    return EXIT_OK


def _add_store_url_option(parser) -> None:
    """``--storage-option`` of a command whose STORE may be a URL."""
    parser.add_argument("--storage-option", action="append", metavar="KEY=VALUE", dest="storage_options",
                        help="fsspec option for a STORE at a URL (repeatable), e.g. endpoint_url=http://host:9000")


def _add_field_commands(sub) -> None:
    a = sub.add_parser("add-fields", help="add fields (embeddings, predictions, scores) to a store without "
                                          "rewriting it",
                       description="Add fields to the published store STORE (a directory or a URL), as a new "
                                   "version: the values go into new field files beside each shard (no shard is "
                                   "rewritten) and the manifest is replaced last; an interrupted call leaves the "
                                   "previous version: the same command with --resume finishes it (without it, what "
                                   "the interrupted call left is removed and written again). Datasets opened before "
                                   "keep their version. Fixed-size numbers (scores, N x D embeddings) are read by "
                                   "ds.column(NAME) without reading a record.")
    a.add_argument("store", metavar="STORE", help="a local store directory, or its URL (s3://...)")
    a.add_argument("--from", dest="values_file", required=True, metavar="FILE",
                   help="the values: a .npy array (one field, rows in store order; give --name), or a .parquet or "
                        ".csv table (one field a column)")
    a.add_argument("--name", dest="names", action="append", metavar="NAME",
                   help="the field's name for a .npy file; for a table, a column to add (repeatable; default: every "
                        "column but the key)")
    a.add_argument("--key", choices=("index", "path"), default="index",
                   help="how table rows find their samples: index (row order, or the table's 'index' column), or "
                        "path (the table's 'path' column: each sample's stored path, e.g. cat/001.jpg)")
    a.add_argument("--replace", action="store_true", help="replace added fields of these names")
    a.add_argument("--resume", action="store_true",
                   help="finish an interrupted add-fields of the same values: the field files it wrote (or uploaded) "
                        "are kept where they hold the same bytes, the rest written; nothing is done when it had "
                        "published already")
    _add_store_url_option(a)
    a.add_argument("--quiet", action="store_true", help="no progress and no summary")
    a.set_defaults(func=_cmd_add_fields)
    d = sub.add_parser("drop-fields", help="drop added fields (a new version)",
                       description="Drop added fields of STORE as a new version; their files are removed by the next "
                                   "change or by 'fastdata gc' (a dataset opened before may still read them).")
    d.add_argument("store", metavar="STORE", help="a local store directory, or its URL (s3://...)")
    d.add_argument("names", nargs="+", metavar="NAME", help="an added field to drop (repeatable)")
    _add_store_url_option(d)
    d.add_argument("--quiet", action="store_true", help="no summary")
    d.set_defaults(func=_cmd_drop_fields)
    r = sub.add_parser("rename-field", help="rename an added field (a new version)",
                       description="Rename added field OLD of STORE to NEW, as a new version (no file is written).")
    r.add_argument("store", metavar="STORE", help="a local store directory, or its URL (s3://...)")
    r.add_argument("old", metavar="OLD", help="the added field's name")
    r.add_argument("new", metavar="NEW", help="its new name (not a field of the store)")
    _add_store_url_option(r)
    r.add_argument("--quiet", action="store_true", help="no summary")
    r.set_defaults(func=_cmd_rename_field)
    g = sub.add_parser("gc", help="remove field files a store no longer lists",
                       description="Remove the field files STORE's manifest no longer lists (dropped or replaced "
                                   "fields, an interrupted add-fields). A dataset still open on an older version "
                                   "then cannot read those fields: run it when none is.")
    g.add_argument("store", metavar="STORE", help="a local store directory, or its URL (s3://...)")
    _add_store_url_option(g)
    g.add_argument("--quiet", action="store_true", help="no summary")
    g.set_defaults(func=_cmd_gc)


def _print_images(data: dict) -> None:
    """``info``'s lines on the images held: dtype x channels and formats per image field (from the
    store index), and the default read mode of each."""
    from fastdata.writer.census import listing

    images, modes = data.get("images"), data.get("image_modes") or {}
    for name, mode in modes.items():
        label = "images:" if name == "image" else f"{printable(name)}:"
        if images is None:
            print(f"{label:<9} {data.get('images_error') or 'not recorded'}; read as {mode!r} by default")
            continue
        census = images.get(name, {})
        kinds = listing(census.get("kinds", {})) or "none"
        formats = listing(census.get("formats", {}))
        print(f"{label:<9} {kinds}" + (f" ({formats})" if formats else "") + f"; read as {mode!r} by default")


def _cmd_verify(args) -> int:
    from fastdata.tools.verify import verify

    remote = remote_options(args, limit=False)
    report = verify(args.store, decode=args.decode, storage_options=remote.get("storage_options"),
                    scratch_dir=args.scratch_dir)
    if args.json:
        print(json.dumps(report.__dict__, indent=2))
    else:
        print(printable(args.say(report.summary()), keep_newlines=True), file=sys.stdout if report.ok else sys.stderr)
    return {"ok": EXIT_OK, "not_a_store": EXIT_NOT_A_STORE, "unfinished": EXIT_UNFINISHED}.get(
        report.status, EXIT_FAILED_CHECK)


_CACHE_DIR_HELP = "shard cache directory (default: $FASTDATA_CACHE_DIR, else ~/.cache/fastdata)"


def _cmd_cache_list(args) -> int:
    from fastdata.remote.inventory import cache_report

    report = cache_report(args.cache_dir, check=args.check, storage_options=remote_options(args).get(
        "storage_options"))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(printable(report.table(), keep_newlines=True))
    return EXIT_OK


def _cmd_cache_clear(args) -> int:
    from fastdata.remote.inventory import clear_cache

    removed, kept = clear_cache(args.url, args.cache_dir)
    what = f" of {args.url}" if args.url else ""
    print(printable(f"{removed} shard(s){what} removed, {kept} kept (in use by a live process)"))
    return EXIT_OK


def _add_cache_command(sub) -> None:
    """``fastdata cache list|clear``: the local shard cache of remote stores."""
    c = sub.add_parser("cache", help="show or clear the local cache of remote stores' shards",
                       description="The shard cache that reading a remote store (s3://, gs://, az://, https://) "
                                   "fills: one folder per store version (URL + manifest checksum), shared by every "
                                   "process on the machine.")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION")
    csub.required = True
    ls = csub.add_parser("list", help="what is cached, per store version",
                         description="Per cached store version: URL, shards cached / shards in the store, bytes, "
                                     "last use, and whether it is the store's current version (only with --check, "
                                     "which asks the server; otherwise '?'). Then a total, with the limit when "
                                     "FASTDATA_CACHE_LIMIT is set.")
    ls.add_argument("--cache-dir", default=None, metavar="DIR", help=_CACHE_DIR_HELP)
    ls.add_argument("--check", action="store_true",
                    help="read each store's manifest from its server to say whether the cached version is current")
    ls.add_argument("--storage-option", action="append", default=None, metavar="KEY=VALUE", dest="storage_options",
                    help="fsspec option for --check, repeatable (as for info)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_cmd_cache_list)
    cl = csub.add_parser("clear", help="remove cached shards (never those a live process has open)",
                         description="Remove the cached shards of the store at URL (every cached version of it), "
                                     "or of every store. Shards a live process has open are kept and counted; "
                                     "they can be removed once that process ends.")
    cl.add_argument("url", nargs="?", default=None, metavar="URL", help="the store's URL (default: every store)")
    cl.add_argument("--cache-dir", default=None, metavar="DIR", help=_CACHE_DIR_HELP)
    cl.set_defaults(func=_cmd_cache_clear)


def _cmd_demo(args) -> int:
    from fastdata.tools.demo import run_demo

    return run_demo(size=args.size, out=args.out, keep=args.keep, quiet=args.quiet, bench=not args.no_bench)


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree (also used to render ``--help``)."""
    p = argparse.ArgumentParser(
        prog="fastdata",
        description="Pack image folders into LMDB/HDF5 shards, read them fast, and measure DataLoader settings.",
    )
    p.add_argument("--version", action="version", version=f"fastdata {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("convert", help="convert an image folder, list file, NIfTI volumes or Parquet files to a store",
                       description="Convert an ImageFolder tree (SRC/<class>/<images>) or a CSV/TSV list "
                                   "(path,label) into an LMDB or HDF5 store at DST (a directory, or a URL: "
                                   "s3://bucket/train.lmdb, gs://, az://; shards are written in a local staging "
                                   "folder, each uploaded and checked as it finishes, the manifest last). "
                                   "NIfTI volumes (a folder of .nii/.nii.gz files, a CSV/TSV/JSONL list with "
                                   "image[,label] columns naming them, or a Decathlon dataset.json) become "
                                   "chunked arrays (fields image, label, affine, spacing, scl_slope, scl_inter), "
                                   "and so do the TIFF images of a folder given --chunks or --max-pixels "
                                   "(read tile by tile); read them by region with fastdata.open_dataset. "
                                   "Parquet files (a .parquet file, a folder of them, or a quoted glob such as "
                                   "'data/train-*.parquet'; needs pip install 'fastdata[parquet]') become a general "
                                   "store with one field per column: Hugging Face image columns "
                                   "(struct<bytes, path>) and binary columns of images keep their bytes exactly, "
                                   "ClassLabel columns keep their class names; see the Parquet rules below. "
                                   "WebDataset tar shards (a .tar file, a quoted brace pattern such as "
                                   "'shards/train-{000000..000099}.tar', a glob, or a folder of .tar files) become "
                                   "a general store with a field per member extension plus __key__.")
    c.add_argument("src", metavar="SRC", help="image folder, or a .csv/.tsv file of path,label rows (when every "
                   "label is an integer, it is the target itself: classes '0'..max label; otherwise labels are "
                   "class names, numbered in sorted order); or NIfTI volumes: a folder of .nii/.nii.gz files "
                   "(class subfolders give a label), a list whose image column names them (a label column of "
                   "NIfTI paths names label volumes; other columns are kept as fields), or a Decathlon "
                   "dataset.json (its training image/label pairs); or Parquet files: a .parquet file, a folder "
                   "holding .parquet files, or a glob (quote it: 'data/train-*.parquet'); or WebDataset shards: "
                   "a .tar file, a brace pattern 'train-{000000..000099}.tar', a glob or a folder of .tar files. "
                   "An image folder, a list, Parquet files, WebDataset shards (a prefix holding .tar objects, "
                   "a .tar URL, a brace pattern or a glob), a folder of NIfTI volumes or a DICOM folder with "
                   "--dicom-tags may be a URL (s3://bucket/imgs/, gs://, az://; https:// for lists and named "
                   "tars): read where it lies, each object checked against its listing (--storage-option applies "
                   "to it)")
    c.add_argument("dst", metavar="DST", help="destination directory or URL (s3://, gs://, az://; https:// is "
                   "read-only); *.lmdb -> LMDB, *.h5/*.hdf5 -> HDF5")
    from fastdata.format.backends.registry import format_choices
    from fastdata.writer.options import WORKERS_HELP

    c.add_argument("--format", choices=format_choices(), help="backend (overrides DST's suffix)")
    c.add_argument("--workers", type=int, default=None, help=WORKERS_HELP)
    c.add_argument("--shard-size", default=None, metavar="SIZE",
                   help="target shard file size, at least 1MiB and at most 10,000 shards (default 1GiB); "
                        "kB/MB/GB and k/M/G are decimal (2G = 2GB = 2,000,000,000 bytes), KiB/MiB/GiB binary")
    mode = c.add_mutually_exclusive_group()
    mode.add_argument("--max-side", type=int, metavar="N",
                      help="re-encode as JPEG only images whose longer side exceeds N pixels (with --storage "
                           "raw|mixed: the longest side of the stored pixels)")
    mode.add_argument("--raw", metavar="HxW", help="store decoded uint8 RGB pixels resized to HxW (e.g. 32x32)")
    from fastdata.common.imagemodes import IMAGE_MODES
    from fastdata.writer.options import LOSSLESS_CODECS

    mode.add_argument("--lossless", choices=LOSSLESS_CODECS, default=None,
                      help="storage mode 'lossless': re-encode every image but JPEG, WebP and DICOM files (and "
                           "palette/CMYK images) as a zstd TIFF of its unchanged pixels, checked bit-exact while "
                           "converting (a mismatch rejects the image, with the reason); 16-bit PNGs decode several "
                           "times faster. Exclusive with --max-side/--quality/--raw")
    c.add_argument("--image-mode", choices=IMAGE_MODES, default=None,
                   help="the default read mode recorded for the images (readers' image_mode= overrides it): "
                        "'unchanged' gives the stored dtype and channels; default: 'unchanged' for a store holding "
                        "DICOM images, else RGB")
    c.add_argument("--dicom-tags", metavar="TAG,TAG", default=None,
                   help="for a folder of class folders of DICOM files: keep these DICOM keywords (e.g. "
                        "RescaleSlope,RescaleIntercept,PhotometricInterpretation,PixelSpacing) as json fields of a "
                        "general store (fields image, label, then one per tag; read in the worker processes); "
                        "without it a DICOM folder makes an ordinary classification store")
    c.add_argument("--quality", type=int, metavar="Q", help="JPEG quality for --max-side (default 90)")
    c.add_argument("--storage", choices=("raw", "mixed"), default=None,
                   help="'raw': store every image's decoded RGB pixels at its own size, the longer side capped at "
                        "--max-side N (required, >= 32; Pillow LANCZOS), as a PPM record readers crop and resize "
                        "without decoding (several times the disk of JPEGs); 'mixed': --raw-fraction F of the images "
                        "so (chosen by a hash of the relative path), or as many as --raw-budget SIZE holds, the "
                        "rest kept as they are")
    c.add_argument("--raw-fraction", type=float, default=None, metavar="F",
                   help="with --storage mixed: the share of images stored as pixels, 0 to 1")
    c.add_argument("--raw-budget", metavar="SIZE", default=None,
                   help="with --storage mixed (instead of --raw-fraction): the most bytes the images may take "
                        "(e.g. 200GB); keeps as pixels the images whose decode costs the most per extra byte "
                        "(high-quality JPEGs first), as many as fit, the rest as they are; with --storage raw: "
                        "refuse a source whose pixels do not fit. Reads every image's header before writing; a "
                        "source that cannot fit is refused before anything is written")
    from fastdata.format.chunk_codecs import CHUNK_CODECS

    c.add_argument("--chunks", metavar="N,N[,N...]", default=None,
                   help="chunk shape of chunked arrays: for NIfTI volumes (default 48,48,48, sized for 96^3 patches; "
                        "256,256 for 2-D ones; axes after those given are chunked by 1, e.g. a 4-D volume's time "
                        "axis), and, for a folder of TIFF images, rows,columns (default 512,512, every band in each "
                        "chunk): each image is then stored as a chunked HxW[xC] array read tile by tile")
    c.add_argument("--codec", choices=list(CHUNK_CODECS), default=None,
                   help="codec of the chunks of chunked arrays: blosc-lz4 (default, fastest to read), blosc-zstd "
                        "(smaller stores, about half the read speed), zstd, lz4, raw (uncompressed)")
    c.add_argument("--max-pixels", metavar="N", default=None,
                   help="for a folder of TIFF images stored as chunked arrays: the most pixels (height x width) one "
                        "image may have, e.g. 2G (k/M/G decimal); default: the decompression-bomb limit "
                        "(PIL.Image.MAX_IMAGE_PIXELS, 89,478,485), which an image over it is rejected naming. "
                        "Implies chunked storage (default --chunks 512,512)")
    c.add_argument("--strict", action="store_true", default=None,
                   help="stop at the first unusable input instead of skipping it")
    again = c.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="finish an interrupted conversion, keeping finished shards; options left out "
                            "(--shard-size, --format, --max-side/--quality/--raw/--lossless, --strict) take the values "
                            "the interrupted run recorded, and one given that differs is refused, naming it")
    again.add_argument("--overwrite", action="store_true", help="replace an existing store at DST")
    c.add_argument("--append", action="store_true",
                   help="add SRC to the published store DST as new shards (its backend and storage options; the "
                        "schema must match, class names map to the store's labels); atomic: a crash leaves DST as it "
                        "was, --append --resume finishes it, and datasets opened before keep reading their version")
    c.add_argument("--add-classes", action="store_true",
                   help="with --append: class names DST lacks are appended at the end of its class table (else an "
                        "error); the table is then no longer sorted as ImageFolder's")
    c.add_argument("--added-values", action="append", metavar="FILE",
                   help="with --append to a store with added fields (fastdata add-fields): values of the new samples "
                        "for them, a .parquet or .csv table (one field a column, rows in the order the samples are "
                        "appended) or NAME=FILE.npy; repeatable")
    c.add_argument("--added-default", action="append", metavar="NAME=JSON", dest="added_defaults",
                   help="with --append: one value (JSON: 0.0, '\"none\"', [0,0]) for every new sample of added "
                        "field NAME; repeatable. An added field given neither (nor a default declared when it was "
                        "added) is an error naming it")
    _add_coco_argument(c)
    c.add_argument("--lmdb-map-size", metavar="SIZE", help="initial LMDB map size (it grows as needed)")
    c.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    c.add_argument("--storage-option", action="append", metavar="KEY=VALUE", dest="storage_options",
                   help="fsspec option for a URL DST or SRC (repeatable), e.g. endpoint_url=http://host:9000; "
                        "credentials otherwise come from the usual AWS_* / cloud SDK environment")
    c.add_argument("--staging-dir", metavar="DIR",
                   help="local folder a URL DST's shards are written in before upload (at most 3 shards at a "
                        "time; default: under $FASTDATA_CACHE_DIR, else ~/.cache/fastdata)")
    c.add_argument("--image-column", action="append", metavar="NAME", default=None,
                   help="for Parquet files: store this column's values as images (binary bytes, a "
                        "struct<bytes, path> or file paths relative to the file's folder) besides the columns "
                        "recognised as images; repeatable, or NAME,NAME")
    _add_list_arguments(c)
    c.set_defaults(func=_cmd_convert)

    mg = sub.add_parser("merge", help="make one store from several, without re-encoding (hard links)",
                        description="Make one store OUTPUT from the stores STORE... (same backend, storage mode and "
                                    "schema), their samples concatenated in the order given. No record is read or "
                                    "re-encoded: shard files are hard-linked where the filesystem allows (no extra "
                                    "disk), copied otherwise; stores at URLs are copied by the server. Class tables "
                                    "are unified by name: the sorted union "
                                    "when every table is sorted, else in order of first appearance; shards whose "
                                    "labels change get a label map the readers apply (nothing is rewritten). "
                                    "Stores that differ are refused with the differences named.")
    mg.add_argument("stores", nargs="+", metavar="STORE",
                    help="two or more published stores: local directories, or URLs of one S3-compatible server")
    mg.add_argument("-o", "--output", required=True, metavar="OUTPUT",
                    help="the merged store's directory, or a URL on the inputs' server (new)")
    mg.add_argument("--overwrite", action="store_true", help="replace a store at OUTPUT")
    mg.add_argument("--copy", action="store_true", help="copy the shard files instead of hard-linking them")
    mg.add_argument("--storage-option", action="append", metavar="KEY=VALUE", dest="storage_options",
                    help="fsspec option for stores at URLs (repeatable), e.g. endpoint_url=http://host:9000; "
                         "URL stores merge into a URL on the same server, their shards copied by the server")
    mg.add_argument("--quiet", action="store_true", help="no summary")
    mg.set_defaults(func=_cmd_merge)

    _add_field_commands(sub)

    i = sub.add_parser("info", help="describe a store",
                       description="Describe a store: backend, counts, classes, shards. STORE is a directory or "
                                   "a URL (s3://, gs://, az://, https://); a URL's manifest is read, no shard is "
                                   "downloaded.")
    i.add_argument("store", metavar="STORE")
    i.add_argument("--json", action="store_true", help="print JSON")
    add_remote_options(i, "where a URL's manifest is kept (the shard cache; default: $FASTDATA_CACHE_DIR, else "
                           "~/.cache/fastdata)", limit=False)
    i.set_defaults(func=_cmd_info)

    v = sub.add_parser("verify", help="check every record of a store",
                       description="Check every shard and record against its checksum and the manifest counts. "
                                   "Exit 0 when sound, 1 when damaged (each problem names shard and record), "
                                   "2 on an error (the path does not exist, the server cannot be reached, bad "
                                   "usage), "
                                   "3 when the path is not a fastdata store (no manifest.json), "
                                   "4 when it holds an unfinished conversion (finish it with convert --resume). "
                                   "STORE may be a URL (s3://, gs://, az://, https://): its manifest and store "
                                   "index are checked, then each shard is streamed from the server into one "
                                   "temporary file, checksummed as it arrives, its records checked, and deleted. "
                                   "The shard cache is not used: a store larger than the cache can be verified "
                                   "without evicting shards other jobs use, and the server's copy is what is "
                                   "checked, not a cached one.")
    v.add_argument("store", metavar="STORE")
    v.add_argument("--decode", action="store_true", help="also fully decode every image")
    v.add_argument("--json", action="store_true", help="print JSON")
    add_remote_options(v, "folder a URL's shard is downloaded into while it is checked (one shard at a time; "
                           "default: the shard cache directory)", limit=False, cache_dir_dest="scratch_dir")
    v.set_defaults(func=_cmd_verify)

    d = sub.add_parser("demo", help="synthesize a dataset, convert, verify and compare (no data needed)",
                       description="Synthesize a small photo-like JPEG dataset in a temporary folder, convert it to "
                                   "LMDB and HDF5, verify both and compare loading speed and memory.")
    d.add_argument("--size", choices=["tiny", "small", "full"], default="full",
                   help="dataset and grid size (full: about two minutes on 2 cores)")
    d.add_argument("--out", default=None,
                   help="folder for the results table, JSON/CSV and plots (default: ./fastdata-demo)")
    d.add_argument("--keep", action="store_true", help="keep the generated dataset and stores")
    d.add_argument("--no-bench", action="store_true", help="skip the loading comparison")
    d.add_argument("--quiet", action="store_true", help="less output")
    d.set_defaults(func=_cmd_demo)

    _add_cache_command(sub)
    _add_optional_commands(sub)
    return p


_LIST_HELP = """\
lists with more fields than path,label (a general store, layout version 2):
  SRC may be a JSONL file (.jsonl/.ndjson), one object per line, or a CSV/TSV whose
  header names more columns than path,label. 'path' (relative to the list's folder)
  becomes the image field 'image'; every other key or column becomes a field. JSONL
  values: true/false -> bool, integers -> int64, numbers -> float64, strings ->
  string, lists of numbers (or of equal-length lists) -> ragged arrays (N, ...),
  objects and anything else -> json. A key 'label' or 'labels' is a class field:
  class names (sorted, as ImageFolder) or integers (the index itself); a list of
  names per row is multi-label, and in a CSV cell labels are separated by '|'
  (cat|dog). Undeclared CSV columns are int, float or string.
  e.g.  {"path": "a.jpg", "boxes": [[1, 2, 30, 40]], "caption": "a cat", "label": ["cat", "dog"]}

Parquet files (a general store, layout version 2; pyarrow needed):
  every column becomes a field, by its Arrow type: integers -> int, floats -> float
  (NaN kept), strings -> string, lists of numbers -> ragged arrays, fixed-size lists
  (Hugging Face Array2D/Array3D) -> ndarray, binary -> bytes in a json field, structs,
  maps and other lists -> json; a number or string column holding nulls -> json. Image
  columns: Hugging Face's struct<bytes, path>, a binary column whose values are images,
  or --image-column NAME; their bytes are stored exactly as they are, each decoded once
  to check it (an unusable one is skipped and listed in rejected.tsv; --strict stops).
  A Hugging Face ClassLabel column (names from the files' schema metadata, or a
  dataset_info.json / README.md beside them) is a class field with its names (holding
  -1, "no label": a plain int field, its names in the manifest's metadata). All files
  must have the same columns. Each shard holds whole row groups (what --resume keeps).
  e.g.  fastdata convert 'data/train-*.parquet' train.lmdb

WebDataset tar shards (a general store):
  members are grouped into samples by key (the path up to the first '.' of the file
  name); each extension becomes a field: jpg/jpeg/png/webp/tif/tiff/bmp/ppm (and e.g.
  seg.png) -> image bytes stored as they are (validated), cls/cls2/index -> int,
  txt/text -> string, json -> json, npy -> ragged array (no pickles), anything else ->
  bytes; __key__ keeps the key. Nothing is extracted (absolute or '..' names are only
  keys; links are skipped). A sample lacking an extension the others have, a bad
  value, or a member claiming more bytes than the file holds is skipped and listed in
  rejected.tsv (--strict stops). Uncompressed .tar only (gunzip a .tar.gz first).
  e.g.  fastdata convert 'shards/train-{000000..000099}.tar' train.lmdb

--schema declares fields instead of inferring them (the others are still inferred):
"""


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions as usual but keeps multi-line text (the list rules) as written."""

    def _fill_text(self, text, width, indent):
        return text if "\n" in text else super()._fill_text(text, width, indent)


def _add_list_arguments(c) -> None:
    """``convert``'s options for lists with more fields than path,label."""
    from fastdata.writer.sources.table.spec import SPEC_GRAMMAR

    c.formatter_class = _HelpFormatter
    c.epilog = _LIST_HELP + "\n".join("  " + line for line in SPEC_GRAMMAR.splitlines())
    c.add_argument("--schema", metavar="SPEC_OR_JSON_FILE",
                   help="declare fields of a JSONL/CSV/TSV list: an inline spec or a .json file (grammar and "
                        "example below)")


def _list_options(args) -> dict:
    """The list options given, as keywords of :func:`fastdata.writer.api.convert`."""
    schema = getattr(args, "schema", None)
    return {"schema": schema} if schema is not None else {}


def _add_coco_argument(c) -> None:
    """``convert --coco ANNOTATIONS.json IMAGE_DIR DST``."""
    c.add_argument("--coco", metavar="ANNOTATIONS.json",
                   help="convert a COCO detection set: SRC is then the image folder the file's file_name entries "
                        "are relative to; one sample per listed image in CocoDetection's order (sorted ids), "
                        "fields image, image_id, width, height, annotations (the image's annotation dicts "
                        "exactly as in the file) and image_info (its images entry); open it with "
                        "fastdata.open_dataset. Missing or unusable images are skipped and reported, problems "
                        "of the file (annotations of unknown images, repeated ids) are warnings; --strict stops "
                        "at any of them")


def _run_coco(args):
    """``convert --coco``: the COCO options checked, then :func:`fastdata.convert_coco`."""
    from fastdata.writer.api import convert_coco
    from fastdata.writer.distributed import current_group

    group = current_group()
    if group is not None and group.world_size > 1:
        raise ValueError(f"convert --coco runs in one process (its workers use the cores): run it without torchrun, "
                         f"not on {group.world_size} ranks")
    unused = [flag for flag, value in (("--max-side", args.max_side), ("--quality", args.quality),
                                       ("--raw", args.raw), ("--lossless", args.lossless),
                                       ("--storage", args.storage), ("--raw-fraction", args.raw_fraction),
                                       ("--raw-budget", args.raw_budget),
                                       ("--image-mode", args.image_mode), ("--dicom-tags", args.dicom_tags),
                                       ("--lmdb-map-size", args.lmdb_map_size),
                                       ("--chunks", args.chunks), ("--codec", args.codec),
                                       ("--max-pixels", args.max_pixels), ("--image-column", args.image_column),
                                       ("--schema", getattr(args, "schema", None))) if value is not None]
    if unused:
        raise ValueError(f"{', '.join(unused)} do(es) not apply to --coco: COCO images are stored as they are, "
                         "with the fields the annotation file gives")
    return convert_coco(args.coco, args.src, args.dst, format=args.format, workers=args.workers,
                        shard_size=args.shard_size, strict=args.strict, resume=args.resume, overwrite=args.overwrite,
                        append=args.append, add_classes=args.add_classes, progress=False if args.quiet else None,
                        **_upload_options(args), **_added_options(args))


def _add_optional_commands(sub) -> None:
    """Commands whose modules live outside the core (benchmark harness, doctor)."""
    try:
        from fastdata.cli.bench import add_commands
    except ImportError:
        return
    add_commands(sub)


#: libraries whose log records the command would print unconfigured (Python's last-resort handler
#: writes WARNING and above to stderr): gcsfs logs a traceback for each request it gives up on,
#: which fastdata then reports in one line of its own
QUIET_LOGGERS = ("gcsfs", "adlfs", "s3fs", "fsspec", "aiobotocore", "azure")


def quiet_library_loggers() -> None:
    """Keep the remote libraries' log records off stderr (where no handler of the user's takes
    them): the command's errors are its own one line. ``FASTDATA_DEBUG=1`` leaves them on."""
    import logging

    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # the library's messages name its parameters (resume=True); a CLI user reads the flags (--resume)
    say = args.say = cli_spelling(parser, command_parser(parser, args))
    if not os.environ.get("FASTDATA_DEBUG"):
        quiet_library_loggers()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("fastdata: interrupted; an interrupted convert can be finished with --resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except FastdataError as err:
        print(f"fastdata: error: {printable(say(str(err)), keep_newlines=True)}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as err:
        print(f"fastdata: error: {printable(say(str(err)), keep_newlines=True)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. `fastdata info X | head`
        return EXIT_OK
    except OSError as err:
        print(printable(f"fastdata: error: {err.filename or ''}{': ' if err.filename else ''}{err.strerror or err}"),
              file=sys.stderr)
        return EXIT_ERROR
    except Exception as err:  # never a bare traceback; FASTDATA_DEBUG=1 shows it
        if os.environ.get("FASTDATA_DEBUG"):
            raise
        print(f"fastdata: internal error: {type(err).__name__}: {printable(say(str(err)), keep_newlines=True)} "
              "(please report it; rerun with FASTDATA_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
