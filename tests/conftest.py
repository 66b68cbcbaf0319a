"""Shared fixtures (the published PipeDream profiles, as the package ships them) and the opt-in
``bench`` tier: a benchmark's quick run is collected only with ``--bench`` or a ``-m``
expression that names ``bench`` (``-m bench``), so ``pytest tests`` stays within its budget."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench", action="store_true", help="also run the benchmarks' quick runs (marker bench)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--bench") or "bench" in (config.getoption("-m") or ""):
        return
    benches = [item for item in items if item.get_closest_marker("bench")]
    if benches:
        config.hook.pytest_deselected(items=benches)
        items[:] = [item for item in items if not item.get_closest_marker("bench")]


@pytest.fixture
def profiles_dir() -> Iterator[Path]:
    with as_file(files("pl_pipedream.published") / "profiles") as path:
        yield path
