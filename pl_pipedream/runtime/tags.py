"""The tag of every point-to-point message the package sends, in one table.

Two ranks may exchange several kinds of message at once (activations one way, gradients the
other, a tied parameter's versions, evaluation outputs, a checkpoint's shards); the tag keeps
each kind on its own link, and one table keeps two kinds from sharing a tag.
"""

from __future__ import annotations

import enum

__all__ = ["Tag", "tie_tag"]


@enum.unique
class Tag(enum.IntEnum):
    """A kind of message; its value is the tag ``torch.distributed`` carries."""

    ACTIVATION = 1  # a stage's output, forward to the next stage
    GRAD = 2  # the gradient of that output, back to the stage that sent it
    EVALUATION = 3  # validation and test: a stage's output, forward
    PREDICTIONS = 4  # predict: the last stage's outputs, to every rank
    TIED = 16  # the first tie's versions; tie k uses TIED + k (``tie_tag``)
    SAVE = 0x5AFE  # a checkpoint's shards, on the default process group
    RELAYOUT = 0x5AFF  # layers and optimizer state moving to a new plan (core.relayout)


def tie_tag(index: int) -> int:
    """The tag of the tie at ``index`` in the pipeline's list of ties."""
    tag = Tag.TIED + index
    if not Tag.TIED <= tag < Tag.SAVE:
        raise ValueError(
            f"a tie's tag must stay below the save's (index: {index}); tie fewer parameters"
        )
    return tag
