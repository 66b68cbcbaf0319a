"""``runtime/ranks.py``: one text names a rank and its stage in every error."""

from __future__ import annotations

import re
from pathlib import Path

from pl_pipedream.runtime.ranks import describe

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
