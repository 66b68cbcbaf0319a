"""``DigitsCNN``: a small convolutional network for single-channel images such as 8x8 digits."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pl_pipedream.models.classifier import PipelineClassifier

__all__ = ["DigitsCNN"]


class DigitsCNN(PipelineClassifier):
    """Two conv blocks (Conv 3x3 + ReLU + MaxPool 2), then Flatten, Linear + ReLU, Linear.

    With 8x8 inputs the two poolings leave a 2x2 map. Each layer is its own pipeline layer, so
    the planner may cut between any two of them.

    Args:
        channels: output channels of the two convolutions, e.g. ``[16, 32]``.
        hidden: width of the Linear layer after flattening.
        Other arguments: see ``PipelineClassifier``.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        hidden: int = 64,
        optimizer: str = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
    ) -> None:
        super().__init__(input_shape, num_classes, optimizer, lr, momentum)
        self.save_hyperparameters()
        if len(self.input_shape) != 3:
            raise ValueError(
                "DigitsCNN needs image inputs shaped (channels, height, width) "
                f"(input_shape: {list(self.input_shape)}); use data=digits or give the "
                "synthetic data an input_shape of three numbers"
            )
        depth, height, width = self.input_shape
        layers: list[nn.Module] = []
        for out in channels:
            layers += [nn.Conv2d(depth, int(out), 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            depth, height, width = int(out), height // 2, width // 2
        if height < 1 or width < 1:
            raise ValueError(
                f"the images are too small for {len(channels)} poolings (input_shape: "
                f"{list(self.input_shape)}); use fewer channels entries"
            )
        layers += [
            nn.Flatten(),
            nn.Linear(depth * height * width, int(hidden)),
            nn.ReLU(),
            nn.Linear(int(hidden), self.num_classes),
        ]
        self.pipeline = nn.Sequential(*layers)
