"""How an error names where it happened: ``describe(1, 1)`` is ``"rank 1 (stage 1)"``.

Runtime errors name the rank and its stage (STYLE.md); every module that builds that text calls
``describe``, so that the user meets one form, whichever layer raised.
"""

from __future__ import annotations

__all__ = ["describe"]


def describe(rank: int, stage: int | None = None) -> str:
    """``"rank 1 (stage 1)"``, or ``"rank 1"`` where the stage is not known."""
    return f"rank {rank}" if stage is None else f"rank {rank} (stage {stage})"
