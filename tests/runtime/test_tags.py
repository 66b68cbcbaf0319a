"""``runtime/tags.py``: one table holds the tag of every message the package sends."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pl_pipedream.runtime.tags import Tag, tie_tag

PACKAGE = Path(__file__).resolve().parents[2] / "pl_pipedream"
TABLE = PACKAGE / "runtime" / "tags.py"


def test_no_module_but_the_table_numbers_a_tag() -> None:
    """A tag numbered anywhere else is a second table that can reuse a value."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            numbered = isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            targets = node.targets if numbered else []
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            found += [
                f"{path.relative_to(PACKAGE)}: {n}"
                for n in names
                if re.search(r"(^|_)TAGS?(_|$)", n)
            ]
    assert found == []


def test_every_tag_passed_to_torch_distributed_comes_from_the_table() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "tag":
                value = ast.unparse(node.value)
                assert value == "tag" or value.startswith("Tag."), f"{path}: tag={value}"


def test_the_tags_differ_and_the_ties_stay_between_theirs_and_the_save() -> None:
    assert len({int(t) for t in Tag}) == len(Tag)
    assert tie_tag(0) == Tag.TIED and tie_tag(3) == Tag.TIED + 3
    assert all(tie_tag(k) not in set(Tag) for k in range(1, 100))
    with pytest.raises(ValueError, match=r"a tie's tag must stay below the save's \(index: "):
        tie_tag(Tag.SAVE - Tag.TIED)
