"""The plain PyTorch engine: ``Pipeline``, PipeDream's pipeline driven from a user's own loop.

It sits between the core and the front ends (the Lightning strategy today; Fabric and Accelerate
adapters next) and imports no Lightning.
"""

from pl_pipedream.engine.pipeline import Pipeline

__all__ = ["Pipeline"]
