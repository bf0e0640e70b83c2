"""Command-line options several commands share: the remote-store ones (``--storage-option``,
``--cache-dir``, ``--cache-limit``) and how they become keyword arguments of the API."""

from __future__ import annotations

import argparse


def add_remote_options(p: argparse.ArgumentParser, cache_dir_help: str, limit: bool = True,
                       cache_dir_dest: str = "cache_dir") -> None:
    """``--storage-option``, ``--cache-dir`` (and ``--cache-limit``) for commands that read URLs;
    ``cache_dir_dest`` is the API's name for the folder (``dest``: what an error names)."""
    p.add_argument("--storage-option", action="append", default=None, metavar="KEY=VALUE", dest="storage_options",
                   help="fsspec option for a URL store, repeatable (e.g. endpoint_url=http://host:9000, anon=true; "
                        "a value that parses as JSON takes that type); credentials and endpoints also come from "
                        "the usual variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
    p.add_argument("--cache-dir", default=None, metavar="DIR", dest=cache_dir_dest, help=cache_dir_help)
    if limit:
        p.add_argument("--cache-limit", default=None, metavar="SIZE",
                       help="most bytes of shards the cache keeps, e.g. 50GiB (default: $FASTDATA_CACHE_LIMIT, "
                            "else no limit)")


def remote_options(args, limit: bool = True) -> dict:
    """The remote-store options given on the command line, as keyword arguments (only those given)."""
    from fastdata.remote.location import parse_storage_options

    out: dict = {}
    if args.storage_options:
        out["storage_options"] = parse_storage_options(args.storage_options)
    if getattr(args, "cache_dir", None):
        out["cache_dir"] = args.cache_dir
    if limit and getattr(args, "cache_limit", None):
        out["cache_limit"] = args.cache_limit
    return out
