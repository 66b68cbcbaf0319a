"""Every exception the strategy and its core raise, in one module.

Each message follows "<rule> (<name>: <value>); <fix>". The built-in base says what kind of
failure it is: a ``ValueError`` for what the user gave (a module, a plan, data, a path), a
``RuntimeError`` for what happened while training.
"""

from __future__ import annotations

__all__ = [
    "BadData",
    "CheckpointError",
    "LightningChangedError",
    "OtherStageParameterError",
    "PipelineDataError",
    "PipelineSetupError",
    "TrainingDiverged",
]


class PipelineSetupError(ValueError):
    """The module, the plan and the launch do not fit together."""


class PipelineDataError(ValueError):
    """The ranks do not train on the same data."""


class OtherStageParameterError(ValueError):
    """User code computed with a parameter that another stage holds."""


class CheckpointError(ValueError):
    """A path that is not a complete PipeDream checkpoint."""


class TrainingDiverged(RuntimeError):
    """The training loss diverged (raised on every rank at the same step, with one message)."""


class BadData(TrainingDiverged):
    """The training loss is not finite because a batch's data hold NaN or inf values."""


class LightningChangedError(RuntimeError):
    """The installed Lightning lacks an internal the strategy relies on."""
