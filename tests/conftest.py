"""Shared fixtures: where the published PipeDream profiles live (beside the repository)."""

from __future__ import annotations

from pathlib import Path

import pytest

PROFILES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pipedream_profiles"


@pytest.fixture
def profiles_dir() -> Path:
    if not PROFILES.is_dir():
        pytest.skip(f"PipeDream's published profiles are not beside the repository ({PROFILES})")
    return PROFILES
