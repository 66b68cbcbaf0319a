"""Every ``docs/*.md`` that the package's configs, recipes and sources name exists.

The configs' comments, the docstrings and the error messages send a user to a page of ``docs/``;
a renamed or missing page would leave them at a dead end.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"docs/[\w./-]*?\.md")


def named_pages(path: Path) -> set[str]:
    return set(NAMED.findall(path.read_text()))


def files_that_name_docs() -> list[Path]:
    package = REPO / "pl_pipedream"
    return sorted([*package.rglob("*.py"), *package.rglob("*.yaml"), *REPO.glob("recipes/*.yaml")])


def test_the_files_scanned_name_docs() -> None:
    named = {path.relative_to(REPO).as_posix() for path in files_that_name_docs()}
    assert "pl_pipedream/configs/train.yaml" in named
    assert "docs/replan-lightning.md" in named_pages(REPO / "pl_pipedream/configs/train.yaml")
    assert "docs/precision.md" in named_pages(REPO / "pl_pipedream/strategy/precision.py")


def test_every_docs_page_named_in_the_configs_and_the_package_exists() -> None:
    missing = [
        f"{path.relative_to(REPO)}: {page}"
        for path in files_that_name_docs()
        for page in sorted(named_pages(path))
        if not (REPO / page).is_file()
    ]
    assert not missing, missing
