"""The step x rank table."""

from __future__ import annotations

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import build, render

GOLDEN = """\
async schedule, plan 1-1, 4 batches x 1 microbatches (cells: stage kind minibatch v version)
step | r0 s0 | r1 s1
--------------------
   0 | 0F0v0 |
   1 | 0F1v0 | 1F0v0
   2 |       | 1B0v0
   3 | 0B0v0 | 1F1v1
   4 | 0F2v1 | 1B1v1
   5 | 0B1v0 | 1F2v2
   6 | 0F3v2 | 1B2v2
   7 | 0B2v1 | 1F3v3
   8 |       | 1B3v3
   9 | 0B3v2 |"""


def test_golden_table() -> None:
    assert render(build(Plan.from_balance([1, 1]), "async", 4, 1)) == GOLDEN


def test_messages_and_updates_on_request() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 2, 1)
    assert ">a0@1" not in render(schedule)
    shown = render(schedule, show_messages=True, show_updates=True)
    assert "0>a0@1" in shown and "1<a0@0" in shown and "1Sv1" in shown
    lines = shown.splitlines()
    assert lines.index(next(x for x in lines if "0>a0@1" in x)) < lines.index(
        next(x for x in lines if "1<a0@0" in x)
    )


def test_marks_and_width() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 2, 1)
    text = render(schedule, mark=[(1, 1)], width=9)
    assert "*1F0v0*" in text
    row = next(line for line in text.splitlines() if "*1F0v0*" in line)
    assert row.split(" | ")[2].strip() == "*1F0v0*"


def test_eight_ranks_stay_readable() -> None:
    schedule = build(Plan.from_balance([1] * 8), "async", 4, 4)
    lines = render(schedule, max_rows=20).splitlines()
    assert max(len(line) for line in lines[1:]) <= 100
    assert lines[-1].startswith(" ...")
