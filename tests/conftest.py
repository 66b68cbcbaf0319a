"""Shared fixtures: the published PipeDream profiles, as the package ships them."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path

import pytest


@pytest.fixture
def profiles_dir() -> Iterator[Path]:
    with as_file(files("pl_pipedream.published") / "profiles") as path:
        yield path
