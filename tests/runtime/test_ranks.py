"""``runtime/ranks.py``: one text names a rank and its stage in every error."""

from __future__ import annotations

import re
from pathlib import Path

from pl_pipedream.runtime.ranks import backend_detail, describe, peer_failure

PACKAGE = Path(__file__).resolve().parents[2] / "pl_pipedream"


def test_describe_names_the_rank_and_its_stage() -> None:
    assert describe(1, 1) == "rank 1 (stage 1)"
    assert describe(3) == "rank 3"


def test_no_module_builds_the_description_itself() -> None:
    """``rank {r} (stage {s})``, ``rank {r}, stage {s}`` or ``stage {s} (rank {r})`` written out
    anywhere but ``ranks.py`` is a second form that drifts from the first."""
    pattern = re.compile(r"rank \{[^}]*\}\W{1,3}stage \{|stage \{[^}]*\}\W{1,3}rank \{")
    found = [
        f"{path.relative_to(PACKAGE)}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "ranks.py"
        for line in path.read_text().splitlines()
        if pattern.search(line)
    ]
    assert found == []


GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:25496. This is typically caused by a remote worker crashing."
)


def test_a_failed_exchange_names_the_peer_and_says_what_its_end_means() -> None:
    cause = RuntimeError("pair.cc:553] Connection closed by peer [127.0.0.1]:41563\nmore")
    closed = peer_failure("rank 1 could not receive x from rank 2", "rank 2", cause, 0.5, 30)
    assert closed == (
        "rank 1 could not receive x from rank 2: the connection was closed by rank 2 after 0.5 s "
        "of waiting (Connection closed by peer); rank 2 has stopped: look for its error above "
        "(or in its log)"
    )
    assert backend_detail(RuntimeError(GLOO)) == "Connection closed by peer"
    posted = peer_failure("a", "rank 2", RuntimeError(), None, 30)
    assert "closed by rank 2 as it was posted (RuntimeError)" in posted
    late = peer_failure("a", "rank 2 (stage 1)", RuntimeError("timed out"), 29.0, 30)
    assert late.startswith("a within 30 s (timed out); rank 2 (stage 1) has probably failed")
    assert "(timeout=..., the same argument in every front end)" in late
