"""One error, two readers: from Python it names the parameter (``resume=True``), from the command
line the flag (``--resume``). The CLI's spelling is derived from its argparse parser
(:mod:`fastdata.cli.flags`), so these tests also check that a parser's own options are translated
without any table."""

from __future__ import annotations

import argparse

import pytest
from helpers.images import make_tree

import fastdata
from fastdata.cli.flags import cli_spelling, command_parser
from fastdata.cli.main import build_parser, main
from fastdata.errors import FastdataError


@pytest.fixture
def src(tmp_path) -> str:
    return make_tree(tmp_path / "src", {"a": 3, "b": 3}, size=(40, 32))


def _python_error(call) -> str:
    with pytest.raises((FastdataError, ValueError)) as info:
        call()
    return str(info.value)


def _cli_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) != 0
    return capsys.readouterr().err


def test_a_changed_option_on_a_complete_store_names_overwrite(src, tmp_path, capsys):
    dst = str(tmp_path / "s.lmdb")
    fastdata.convert(src, dst, progress=False)
    said = _python_error(lambda: fastdata.convert(src, dst, resume=True, max_side=16, progress=False))
    assert "overwrite=True" in said and "--overwrite" not in said
    shown = _cli_error(["convert", src, dst, "--resume", "--max-side", "16", "--quiet"], capsys)
    assert "--overwrite" in shown and "overwrite=True" not in shown


def test_an_option_that_does_not_apply_names_its_parameter_or_flag(src, tmp_path, capsys):
    dst = str(tmp_path / "s.lmdb")
    said = _python_error(lambda: fastdata.convert(src, dst, add_classes=True, progress=False))
    assert "add_classes=True applies to an append (append=True)" in said
    shown = _cli_error(["convert", src, dst, "--add-classes", "--quiet"], capsys)
    assert "--add-classes applies to an append (--append)" in shown and "=True" not in shown


def test_a_bad_max_side_names_max_side_or_the_flag(src, tmp_path, capsys):
    dst = str(tmp_path / "s.lmdb")
    said = _python_error(lambda: fastdata.convert(src, dst, storage="raw", max_side=8, progress=False))
    assert "max_side" in said and "--" not in said
    shown = _cli_error(["convert", src, dst, "--storage", "raw", "--max-side", "8", "--quiet"], capsys)
    assert "--max-side" in shown and "--storage raw" in shown and "max_side" not in shown


@pytest.fixture(scope="module")
def convert_spelling():
    parser = build_parser()
    return cli_spelling(parser, command_parser(parser, parser.parse_args(["convert", "a", "b"])))


@pytest.mark.parametrize(("library", "cli"), [
    ("rerun with resume=True.", "rerun with --resume."),
    ("storage='raw' needs max_side=N (N >= 32)", "--storage raw needs --max-side N (N >= 32)"),
    ('lossless="tiff" keeps them', "--lossless tiff keeps them"),
    ("raw_fraction applies to a mixed store", "--raw-fraction applies to a mixed store"),
    ("a quality=90 re-encode", "a --quality 90 re-encode"),
    ("strict=False goes on", "no --strict goes on"),
    ("set allow_redirects=true in storage_options", "set allow_redirects=true in --storage-option"),
])
def test_the_convert_command_spells_parameters_as_its_flags(convert_spelling, library, cli):
    assert convert_spelling(library) == cli


@pytest.mark.parametrize("text", [
    "/data/max_side/x.jpg: not an image",  # a path that happens to hold a parameter's name
    "manifest key 'max_side' is not an int",  # a quoted key
    "options.max_side is None",  # an attribute
    "rejected: shard_size.jpg is empty",  # a file name
    "a resume of the run",  # a word without an underscore stays a word
    "image_modes={'image': 'L'}",  # a longer name
])
def test_other_text_is_left_alone(convert_spelling, text):
    assert convert_spelling(text) == text


def test_the_spelling_comes_from_the_parser_not_a_table():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    one = sub.add_parser("one")
    one.add_argument("--tile-edge", dest="tile_edge")
    one.add_argument("--dry", action="store_true")
    one.add_argument("--no-draw", action="store_false", dest="draw")
    other = sub.add_parser("other")
    other.add_argument("--edge-of-tile", dest="tile_edge")
    spell_one = cli_spelling(parser, one)
    assert spell_one("tile_edge=64 with dry=True") == "--tile-edge 64 with --dry"
    assert spell_one("skip it with draw=False") == "skip it with --no-draw"
    assert cli_spelling(parser, other)("tile_edge=64") == "--edge-of-tile 64"  # the running command decides
    # control: a parser without the option leaves the parameter as it is
    assert cli_spelling(argparse.ArgumentParser())("tile_edge=64 with dry=True") == "tile_edge=64 with dry=True"


# -- parameters named alone, without an underscore (English words too) --------------------------------

def _one_line(shown: str) -> str:
    """The CLI's error: one line, no traceback."""
    lines = shown.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastdata: error: "), shown
    return lines[0]


@pytest.mark.parametrize(("call", "argv", "said", "shown"), [
    (lambda src, dst: fastdata.convert(src, dst, chunks=(4,), progress=False), ["--chunks", "4"],
     "chunks for images takes 2 sides", "--chunks for images takes 2 sides"),
    (lambda src, dst: fastdata.convert(src, dst, codec="zstd", progress=False), ["--codec", "zstd"],
     ": chunks/codec/max_pixels apply to NIfTI volumes", ": --chunks/--codec/--max-pixels apply to NIfTI volumes"),
    (lambda src, dst: fastdata.convert(fastdata.sources.Table(src, schema="label:int"), dst), ["--schema", "label:int"],
     "a Table (schema) is a JSONL/CSV/TSV list file", "a Table (--schema) is a JSONL/CSV/TSV list file"),
    (lambda src, dst: fastdata.convert(fastdata.sources.ImageFolder(src), dst, fastdata.WriteOptions(workers=-3)),
     ["--workers", "-3"], "workers must be 0 (no worker processes", "--workers must be 0 (no worker processes"),
    (lambda src, dst: fastdata.convert(src, dst, raw="bad", progress=False), ["--raw", "bad"],
     "raw shape must look like HxW", "--raw shape must look like HxW"),
], ids=["chunks", "codec", "schema", "workers", "raw"])
def test_a_parameter_named_alone_is_its_flag_on_the_command_line(src, tmp_path, capsys, call, argv, said, shown):
    """From Python the error names the parameter; from the CLI, in one line and a non-zero exit, the flag."""
    dst = str(tmp_path / "s.lmdb")
    message = _python_error(lambda: call(src, dst))
    assert said in message and "--" not in message, message
    line = _one_line(_cli_error(["convert", src, dst, *argv, "--quiet"], capsys))
    assert shown in line, line
    assert said not in line.replace(shown, ""), line  # the parameter's spelling is not left beside the flag


@pytest.mark.parametrize(("library", "cli"), [
    ("codec must be one of 'zstd', 'raw'", "--codec must be one of 'zstd', 'raw'"),
    ("x.nii: chunks must be a chunk shape", "x.nii: --chunks must be a chunk shape"),
    ("quality must be within 1..100; storage needs max_side=N",
     "--quality must be within 1..100; --storage needs --max-side N"),
    ("chunks/codec apply to volumes", "--chunks/--codec apply to volumes"),
    ("a Table (schema)", "a Table (--schema)"),
])
def test_the_convert_command_spells_bare_parameters_as_its_flags(convert_spelling, library, cli):
    assert convert_spelling(library) == cli


@pytest.mark.parametrize("text", [
    "size must be positive",  # convert has no --size (synth does): another command's parameter
    "schema field 'x': cannot read kind 'y'",  # a noun, not the subject of a check
    "the store's format must be 2",  # not where a message or clause opens
    "a raw chunk of 10 bytes",
    "declare Image(mode=...) in schema for a default read mode",
    "(storage mode)",  # not alone in the parentheses
    "data/chunks/codec.bin is missing",  # a path
    "no chunks must be lost",
])
def test_bare_words_that_are_not_parameters_are_left_alone(convert_spelling, text):
    assert convert_spelling(text) == text
