"""LIGHTNING: ``PipeDreamStrategy``, its registration as ``"pipedream"``, sharded checkpoints.

The only package that imports Lightning.
"""

from __future__ import annotations

from pl_pipedream.core.checkpoint import consolidate_checkpoint
from pl_pipedream.strategy.pipedream import PipeDreamStrategy

__all__ = ["PipeDreamStrategy", "consolidate_checkpoint", "register"]


def register() -> None:
    """Make ``Trainer(strategy="pipedream")`` find ``PipeDreamStrategy``."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "pipedream" not in StrategyRegistry:
        PipeDreamStrategy.register_strategies(StrategyRegistry)


register()
