"""PROFILE: per-layer costs of a model, read from PipeDream's files or measured with torch.

``Profile`` and friends are pure Python. ``profile_layers`` needs torch, so it is imported on
first use: ``import pl_pipedream.profile`` alone does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pl_pipedream.profile.graph import Node, Profile, ProfileError

if TYPE_CHECKING:
    from pl_pipedream.profile.measure import profile_layers

__all__ = ["Node", "Profile", "ProfileError", "profile_layers"]


def __getattr__(name: str) -> Any:
    if name == "profile_layers":
        from pl_pipedream.profile.measure import profile_layers

        return profile_layers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
