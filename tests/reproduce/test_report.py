"""``reproduce.report``: the table's cells, its text and Markdown forms, and the assumptions."""

from __future__ import annotations

from pl_pipedream.reproduce.predict import predict
from pl_pipedream.reproduce.report import HEADER, assumptions, cells, render_markdown, render_text
from pl_pipedream.reproduce.table import Row

VGG = Row("VGG-16", "A", 4, 4, "15-1", 5.28)
AWD = Row("AWD-LM", "A", 1, 4, "straight", 4.25)


def test_a_row_without_a_published_profile_has_no_prediction() -> None:
    (outcome,) = predict([AWD], profiles=None)
    assert cells(outcome) == (
        "awdlm_A_1x4",
        "straight",
        "no published profile",
        "-",
        "4.25x (epoch)",
        "-",
        "-",
        "-",
        "-",
    )


def test_text_and_markdown_hold_one_line_per_row_under_the_header() -> None:
    outcomes = predict([VGG, AWD], profiles=None)
    text = render_text(outcomes).splitlines()
    assert len(text) == 3 and text[0].startswith("row  ")
    assert [line.split()[0] for line in text[1:]] == ["vgg16_A_4x4", "awdlm_A_1x4"]
    markdown = render_markdown(outcomes, "first note\nsecond note")
    lines = markdown.splitlines()
    assert lines[0] == "| " + " | ".join(HEADER) + " |"
    assert lines[3] == "| " + " | ".join(cells(outcomes[1])) + " |"
    assert markdown.endswith("\nfirst note\n\nsecond note\n")


def test_assumptions_mention_our_profile_only_when_it_was_used() -> None:
    with_own = assumptions([], 140.0, None)
    without = assumptions([], 140.0, None, own_profile=False)
    assert "Our profile:" in with_own and "speed factor 140" in with_own
    assert "Our profile:" not in without and "speed factor" not in without
    assert without.splitlines() == [
        line for line in with_own.splitlines() if "Our profile" not in line
    ]
    assert "GEMM rate when profiled: 112.0 GFLOP/s" in assumptions(["112.0"], 140.0, 8)
