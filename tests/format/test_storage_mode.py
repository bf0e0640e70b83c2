"""The storage mode is a :class:`StorageMode`: its manifest strings never change, a string becomes
a member once (when a spec is built or a manifest read), and nowhere but its own module is a mode
compared with one of those strings (an AST scan of the package, with a control)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from fastdata.errors import FormatError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.storage_mode import StorageMode

PACKAGE = Path(__file__).resolve().parents[2] / "fastdata"
MODE_MODULE = PACKAGE / "format" / "storage_mode.py"
#: the strings manifests have always recorded: a store written by any version reads the same
MANIFEST_STRINGS = {"original", "reencode", "lossless", "raw", "raw-native", "mixed"}


def test_the_manifest_strings_are_the_members_values():
    assert {m.value for m in StorageMode} == MANIFEST_STRINGS
    assert StorageMode("raw") is StorageMode.FIXED_SIZE_PIXELS
    assert StorageMode("raw-native") is StorageMode.NATIVE_SIZE_PIXELS


@pytest.mark.parametrize("spec", [
    StorageSpec(),
    StorageSpec("raw", raw_shape=(4, 6)),
    StorageSpec("raw-native", max_side=64, raw_budget=1 << 20),
    StorageSpec("mixed", max_side=64, raw_fraction=0.25),
    StorageSpec("reencode", max_side=64, quality=90),
    StorageSpec("lossless"),
])
def test_a_spec_round_trips_through_the_manifest_as_plain_strings(spec):
    on_disk = json.loads(json.dumps(spec.to_json()))
    assert type(spec.to_json()["mode"]) is str  # not the enum: the manifest holds the bare string
    assert isinstance(spec.mode, StorageMode)
    assert StorageSpec.from_json(on_disk) == spec


def test_a_string_and_its_member_build_the_same_spec():
    assert StorageSpec("raw-native", max_side=64) == StorageSpec(StorageMode.NATIVE_SIZE_PIXELS, max_side=64)
    assert StorageSpec().mode is StorageMode.ORIGINAL


def test_an_unknown_mode_is_a_format_error_that_names_the_modes():
    with pytest.raises(FormatError, match="'squashed' is not a storage mode .*'raw-native'"):
        StorageSpec("squashed")
    with pytest.raises(FormatError):
        StorageSpec.from_json({"mode": ["raw"]})


def test_the_two_pixel_modes_say_which_is_which():
    fixed, native, mixed = StorageMode.FIXED_SIZE_PIXELS, StorageMode.NATIVE_SIZE_PIXELS, StorageMode.MIXED
    assert fixed.holds_fixed_size_pixels and not fixed.may_hold_native_size_pixels
    assert native.holds_only_native_size_pixels and native.may_hold_native_size_pixels
    assert not native.holds_fixed_size_pixels
    assert mixed.may_hold_native_size_pixels and mixed.picks_images_to_hold_as_pixels
    assert not mixed.holds_only_native_size_pixels
    # each mode answers exactly one of the "what does it keep" questions
    kinds = ("keeps_files_as_given", "reencodes_large_images", "transcodes_losslessly",
             "holds_fixed_size_pixels", "holds_only_native_size_pixels", "picks_images_to_hold_as_pixels")
    for mode in StorageMode:
        assert sum(getattr(mode, kind) for kind in kinds) == 1, mode


# -- no string comparison of a mode outside its module ----------------------------------------------


def _is_mode_string(node: ast.expr) -> bool:
    """A storage mode's manifest string, or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in MANIFEST_STRINGS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_mode_string(e) for e in node.elts)
    return False


def mode_string_comparisons(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: code`` for each comparison of an expression about a mode (one whose text names
    ``mode``: ``spec.mode``, ``storage["mode"]``, ``storage.get("mode")``) with a mode's string."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        strings = [o for o in operands if _is_mode_string(o)]
        others = [o for o in operands if not _is_mode_string(o)]
        if strings and any("mode" in ast.unparse(o).lower() for o in others):
            hits.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_the_scan_finds_string_comparisons_of_a_mode_control():
    flagged = mode_string_comparisons(
        'if spec.mode == "raw-native": pass\n'
        'if storage.get("mode") not in ("raw", "mixed"): pass\n'
        'ok = storage["mode"] != "original"\n')
    assert len(flagged) == 3
    assert mode_string_comparisons(
        "if spec.mode.holds_fixed_size_pixels: pass\n"
        'if codec.name == "raw": pass\n'  # a chunk codec's name, not a storage mode
        'if image_mode == "RGB": pass\n'
        "if spec.mode is StorageMode.MIXED: pass\n") == []


def test_no_module_but_its_own_compares_a_storage_mode_with_a_string():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != MODE_MODULE:
            hits += mode_string_comparisons(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert hits == [], "compare the StorageMode (its properties), not its string:\n" + "\n".join(hits)
