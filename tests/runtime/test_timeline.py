"""The timeline: bubbles and the Chrome trace from synthetic events, gathered in a gloo group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pl_pipedream.runtime.timeline import (
    Recording,
    TimelineEvent,
    bubble_fractions,
    chrome_trace,
    gather_trace,
    write_trace,
)
from pl_pipedream.schedule.actions import Action, ActionKind
from tests.runtime.distributed import one_rank_group

EVENTS = [
    TimelineEvent(0, "0F0", "FORWARD", 10.0, 11.0),
    TimelineEvent(0, "0<A", "RECV_GRAD", 11.0, 12.0),  # waiting is bubble
    TimelineEvent(0, "0B0", "BACKWARD", 12.0, 13.5),
    TimelineEvent(0, "0S", "STEP", 13.5, 14.0),
    TimelineEvent(1, "1F0", "FORWARD", 11.0, 12.0),
    TimelineEvent(1, "1B0", "BACKWARD", 12.0, 14.0),
]


def test_an_event_kind_counts_as_busy_as_its_action_kind_does() -> None:
    from pl_pipedream.schedule.result import BUSY_KINDS

    assert {kind.value for kind in ActionKind if kind.value in BUSY_KINDS} == {
        "FORWARD",
        "BACKWARD",
        "BACKWARD_INPUT",
        "BACKWARD_WEIGHT",
        "STEP",
    }


def test_a_ranks_bubble_is_its_span_without_compute_and_updates() -> None:
    bubbles = bubble_fractions(EVENTS)
    assert list(bubbles) == [0, 1]
    assert bubbles[0] == pytest.approx(1 - 3.0 / 4.0)
    assert bubbles[1] == pytest.approx(0.0)


def test_a_rank_without_a_span_has_no_bubble() -> None:
    assert bubble_fractions([TimelineEvent(2, "2F0", "FORWARD", 5.0, 5.0)]) == {2: 0.0}
    assert bubble_fractions([]) == {}


def test_chrome_trace_has_one_thread_per_rank_in_microseconds_from_the_first_start() -> None:
    trace = chrome_trace(EVENTS)
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert isinstance(events, list)
    spans = [e for e in events if e["ph"] == "X"]
    assert spans[0] == {
        "name": "0F0",
        "cat": "FORWARD",
        "ph": "X",
        "pid": 0,
        "tid": 0,
        "ts": 0.0,
        "dur": pytest.approx(1e6),
    }
    assert spans[-1]["tid"] == 1
    assert spans[-1]["ts"] == pytest.approx(2e6)
    assert spans[-1]["dur"] == pytest.approx(2e6)
    names = [(e["tid"], e["args"]["name"]) for e in events if e["ph"] == "M"]
    assert names == [(0, "rank 0"), (1, "rank 1")]


def test_an_empty_timeline_is_an_empty_trace() -> None:
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_write_trace_writes_json_and_returns_the_bubbles(tmp_path: Path) -> None:
    path = tmp_path / "new" / "trace.json"
    assert write_trace(EVENTS, path) == bubble_fractions(EVENTS)
    assert json.loads(path.read_text()) == json.loads(json.dumps(chrome_trace(EVENTS)))


def test_gather_trace_in_a_group_writes_every_ranks_events(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    with one_rank_group():
        bubbles = gather_trace(EVENTS, path)
    assert bubbles == bubble_fractions(EVENTS)
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [e.action for e in EVENTS]


def test_a_recording_names_its_actions_when_read_and_take_empties_it() -> None:
    recording = Recording(3)
    forward = Action(ActionKind.FORWARD, 3, 1, 0, 0, 0, 0)
    recording.add(forward, 1.0, 1.5)
    expected = [TimelineEvent(3, str(forward), "FORWARD", 1.0, 1.5)]
    assert recording.events == expected
    assert recording.take() == expected
    assert recording.events == []
