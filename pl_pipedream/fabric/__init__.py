"""FABRIC: ``PipeDreamFabricStrategy`` and its registration as ``Fabric(strategy="pipedream")``.

A front end beside the Lightning strategy (neither imports the other), over the plain engine.
"""

from __future__ import annotations

from pl_pipedream.fabric.strategy import PipeDreamFabricStrategy

__all__ = ["PipeDreamFabricStrategy", "register"]


def register() -> None:
    """Make ``Fabric(strategy="pipedream")`` find ``PipeDreamFabricStrategy``."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "pipedream" not in STRATEGY_REGISTRY:
        PipeDreamFabricStrategy.register_strategies(STRATEGY_REGISTRY)


register()
