"""planner and schedule are pure Python: no module there imports torch or Lightning."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pl_pipedream"
FORBIDDEN = {"torch", "lightning", "pytorch_lightning", "lightning_fabric"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("layer", ["planner", "schedule"])
def test_no_torch_or_lightning_import(layer: str) -> None:
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(PACKAGE)): imported_roots(f) & FORBIDDEN for f in files}
    assert {f: roots for f, roots in offenders.items() if roots} == {}
