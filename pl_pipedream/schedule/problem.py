"""A broken rule and the cells where it breaks, as the checks report it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cell", "Problem"]

Cell = tuple[int, int]  # (rank, index of the action in that rank's list)


@dataclass(frozen=True)
class Problem:
    """A broken rule, said as ``"<rule> (<name>: <value>); <how to fix>"``, and where."""

    message: str
    cells: tuple[Cell, ...] = ()
