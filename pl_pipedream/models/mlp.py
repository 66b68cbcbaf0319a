"""``MLP``: flatten, then Linear + ReLU blocks, then a Linear scoring the classes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from pl_pipedream.models.classifier import PipelineClassifier

__all__ = ["MLP"]


class MLP(PipelineClassifier):
    """A multilayer perceptron; every Linear and every ReLU is its own pipeline layer.

    Args:
        hidden: widths of the hidden layers, e.g. ``[128, 128, 64]``.
        Other arguments: see ``PipelineClassifier``.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: Sequence[int] = (128, 128, 64),
        optimizer: str = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
    ) -> None:
        super().__init__(input_shape, num_classes, optimizer, lr, momentum)
        self.save_hyperparameters()
        widths = [math.prod(self.input_shape), *(int(h) for h in hidden)]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], self.num_classes))
        self.pipeline = nn.Sequential(*layers)
