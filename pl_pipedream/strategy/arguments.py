"""The checks ``PipeDreamStrategy.__init__`` runs on its plain arguments, before anything starts:
each refusal names the argument, the value given and an example that works."""

from __future__ import annotations

from typing import Any

from pl_pipedream.strategy.divergence import DIVERGENCE_ACTIONS

__all__ = ["check_arguments"]


def check_arguments(microbatches: Any, start_method: str, divergence: str, timeout: Any) -> None:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"microbatches must be a positive integer (microbatches: {microbatches!r}); for "
            "example PipeDreamStrategy(microbatches=4)"
        )
    if not isinstance(timeout, (int, float)) or not timeout > 0:  # 0 would fail every wait
        raise ValueError(
            f"timeout must be a positive number of seconds (timeout: {timeout!r}); for example "
            "PipeDreamStrategy(timeout=300)"
        )
    if start_method not in ("popen", "spawn", "fork"):
        raise ValueError(
            f"start_method must be 'popen', 'spawn' or 'fork' (start_method: {start_method!r})"
        )
    if divergence not in DIVERGENCE_ACTIONS:
        raise ValueError(
            f"divergence must be one of {', '.join(DIVERGENCE_ACTIONS)} (divergence: "
            f'{divergence!r}); for example PipeDreamStrategy(divergence="warn")'
        )
