"""SyncMode: each mode's properties, parsing, the update settings, and names stated once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pl_pipedream.schedule import SYNC_MODES, SyncMode
from pl_pipedream.schedule.modes import (
    check_chunked,
    check_chunks_per_rank,
    check_fp16,
    update_settings,
)

PACKAGE = Path(__file__).resolve().parents[2] / "pl_pipedream"


def test_names_and_order() -> None:
    assert SYNC_MODES == (
        "async",
        "vertical_sync",
        "2bw",
        "flush",
        "gpipe",
        "zero_bubble",
        "interleaved",
        "zbv",
    )
    assert tuple(SyncMode) == tuple(SyncMode(name) for name in SYNC_MODES)
    assert SyncMode.ASYNC == "async"
    assert str(SyncMode.TWO_BW) == "2bw" and f"{SyncMode.FLUSH}" == "flush"
    assert f"{SyncMode.GPIPE:>6}" == " gpipe"


@pytest.mark.parametrize(
    ("mode", "per_minibatch", "flushes", "forwards_first"),
    [
        (SyncMode.ASYNC, True, False, False),
        (SyncMode.VERTICAL_SYNC, True, False, False),
        (SyncMode.TWO_BW, False, False, False),
        (SyncMode.FLUSH, False, True, False),
        (SyncMode.GPIPE, False, True, True),
        (SyncMode.ZERO_BUBBLE, False, True, False),
        (SyncMode.INTERLEAVED, False, True, False),
        (SyncMode.ZBV, False, True, False),
    ],
)
def test_properties(
    mode: SyncMode, per_minibatch: bool, flushes: bool, forwards_first: bool
) -> None:
    assert mode.updates_per_minibatch is per_minibatch
    assert mode.flushes is flushes
    assert mode.updates_in_pipeline is not flushes
    assert mode.forwards_first is forwards_first


def test_min_microbatches() -> None:
    for stages in (1, 2, 5):
        assert SyncMode.TWO_BW.min_microbatches(stages) == stages
        assert {m.min_microbatches(stages) for m in SyncMode if m is not SyncMode.TWO_BW} == {1}


def test_the_chunked_modes_refuse_ties_and_replanning() -> None:
    assert [m for m in SyncMode if m.chunked] == [SyncMode.INTERLEAVED, SyncMode.ZBV]
    assert (SyncMode.INTERLEAVED.placement, SyncMode.ZBV.placement) == ("interleaved", "v")
    assert SyncMode.ZBV.splits_backward and not SyncMode.INTERLEAVED.splits_backward
    call = "Pipeline(..., sync='{sync}')"
    check_chunked(SyncMode.FLUSH, ["w: stages 0, 1"], True, call)  # not chunked: no rule
    check_chunked(SyncMode.ZBV, [], False, call)
    with pytest.raises(ValueError) as error:
        check_chunked(SyncMode.INTERLEAVED, ["head.weight: stages 0, 3"], False, call)
    message = str(error.value)
    assert "sync='interleaved' trains without tied parameters" in message
    assert "tied: head.weight: stages 0, 3); use Pipeline(..., sync='zero_bubble')" in message
    with pytest.raises(ValueError, match=r"sync='zbv' keeps the plan it starts with"):
        check_chunked(SyncMode.ZBV, [], True, call)


def test_chunks_per_rank_default_to_two_and_a_v_has_two() -> None:
    assert [m.chunks_per_rank() for m in SyncMode if m.chunked] == [2, 2]
    assert SyncMode.INTERLEAVED.chunks_per_rank(3) == 3 and SyncMode.ZBV.chunks_per_rank(2) == 2
    assert {m.chunks_per_rank() for m in SyncMode if not m.chunked} == {1}


@pytest.mark.parametrize(
    ("sync", "chunks", "message"),
    [
        ("interleaved", 1, r"^chunks_per_rank must be an integer of at least 2, the stages each "
         r"rank holds \(chunks_per_rank: 1\); for example S\(sync='interleaved', chunks_per_r"),
        ("interleaved", 2.0, r"\(chunks_per_rank: 2\.0\)"),
        ("zbv", True, r"\(chunks_per_rank: True\)"),
        ("flush", 2, r"^chunks_per_rank sets the stages per rank of the chunked modes, interleaved "
         r"and zbv, and sync='flush' holds one stage per rank \(chunks_per_rank: 2, sync: "
         r"'flush'\); use S\(sync='interleaved', chunks_per_rank=2\), or leave out"),
        ("zbv", 3, r"^sync='zbv' places two stages on each rank, in a V \(chunks_per_rank: 3\); "
         r"leave out chunks_per_rank, or use S\(sync='interleaved', chunks_per_rank=3\)$"),
    ],
)  # fmt: skip
def test_a_chunks_per_rank_the_mode_cannot_take_is_refused(
    sync: str, chunks: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_chunks_per_rank(SyncMode(sync), chunks, "S({args})")


def test_a_chunks_per_rank_the_mode_takes_passes() -> None:
    for mode in SyncMode:
        check_chunks_per_rank(mode, None, "S({args})")  # the default: any mode
    check_chunks_per_rank(SyncMode.INTERLEAVED, 4, "S({args})")
    check_chunks_per_rank(SyncMode.ZBV, 2, "S({args})")


def test_parse_takes_a_name_or_a_mode() -> None:
    for mode in SyncMode:
        assert SyncMode.parse(mode.value) is mode
        assert SyncMode.parse(mode) is mode


@pytest.mark.parametrize("bad", ["fast", "ASYNC", "", "flush "])
def test_parse_names_the_choices(bad: str) -> None:
    with pytest.raises(ValueError, match=r"sync must be one of async, vertical_sync, 2bw, flush, "):
        SyncMode.parse(bad)
    with pytest.raises(ValueError, match=r"for example sync='async'$"):
        SyncMode.parse(bad)


def old_update_settings(sync: str, m: int, replicas: int) -> tuple[int, float, bool, bool]:
    """The formulas restated by hand: (update size, loss scale, Linear sums, split)."""
    split = sync in ("zero_bubble", "zbv")  # the weight half adds the Linear products held
    if sync in ("async", "vertical_sync"):
        return replicas, 1.0, False, False
    summed = m > replicas
    if m & (m - 1) == 0:  # a power of two: dividing the loss seed is exact
        return 1, 1.0 / m, summed, split
    return m, 1.0, summed, split


@pytest.mark.parametrize("sync", SYNC_MODES)
def test_update_settings_match_the_formulas(sync: str) -> None:
    for m in range(1, 17):
        for replicas in range(1, 5):
            settings = update_settings(SyncMode(sync), m, replicas)
            expected = old_update_settings(sync, m, replicas)
            assert (
                settings.update_size,
                settings.loss_scale,
                settings.sum_linear_gradients,
                settings.split_backward,
            ) == expected, (sync, m, replicas)


def test_the_fused_linear_threshold_has_a_default_and_passes_through() -> None:
    """Every mode's settings carry the size from which Linear layers fuse their sums: None by
    default (the runtime's measured default for the weights' device), or the one given."""
    for mode in SyncMode:
        assert update_settings(mode, 8, 1).fused_linear_min_elements is None
        assert update_settings(mode, 8, 1, 0).fused_linear_min_elements == 0


def mode_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in SYNC_MODES
    ]


def test_mode_names_are_literals_only_in_modes() -> None:
    """Everything else asks a SyncMode; configs (YAML beside Python) are where users name modes."""
    configs = PACKAGE / "configs"
    files = [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "schedule" / "modes.py"
        and configs not in path.parents
        # the interleaved placement of stages shares its name with the mode that runs it
        and path != PACKAGE / "planner" / "chunks.py"
    ]
    assert files
    found = {str(p.relative_to(PACKAGE)): mode_literals(p) for p in files}
    assert {path: hits for path, hits in found.items() if hits} == {}


@pytest.mark.parametrize("mode", list(SyncMode), ids=str)
def test_fp16_is_refused_where_updates_happen_inside_the_pipeline_naming_every_flushed_mode(
    mode: SyncMode,
) -> None:
    call, bf16 = "Pipeline(..., sync='{sync}')", "Pipeline(..., precision='bf16-mixed')"
    if mode.flushes:
        check_fp16(mode, call, bf16)
        return
    with pytest.raises(ValueError) as error:
        check_fp16(mode, call, bf16)
    text = str(error.value)
    assert f"(precision: '16-mixed', sync: {mode}); use {bf16}" in text
    flushed = [m.value for m in SyncMode if m.flushes]
    assert len(flushed) == 5 and f"({', '.join(flushed)})" in text
    assert text.endswith("e.g. Pipeline(..., sync='flush')")


ROOT = PACKAGE.parent
TEXTS = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]


def test_every_text_that_lists_the_flushed_modes_lists_them_all() -> None:
    """Where prose says "the flushed modes (...)" and names modes in the parentheses, it names
    ``SyncMode``'s flushed modes, all of them and no other, or the others ("every mode but")."""
    flushed = {m.value for m in SyncMode if m.flushes}
    others = set(SYNC_MODES) - flushed
    wrong = []
    for path in TEXTS:
        text = " ".join(path.read_text().split())
        for listed in re.findall(r"flushed modes \(([^)]*)\)", text):
            names = set(re.findall(r"`+([a-z_0-9]+)`+", listed)) & set(SYNC_MODES)
            if names and names not in (flushed, others):
                wrong.append(f"{path.relative_to(ROOT)}: ({listed})")
    assert wrong == []
