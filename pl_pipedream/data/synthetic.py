"""``SyntheticDataModule``: generated, learnable classification data (no files needed).

Each class gets a random mean image; an example is its class mean plus Gaussian noise. With
``noise`` below about 1 the classes are well separated, so accuracy should climb quickly; raise it
to make the task harder.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pl_pipedream.data.split import SplitDataModule

__all__ = ["SyntheticDataModule"]


class SyntheticDataModule(SplitDataModule):
    """``num_examples`` generated examples; see ``SplitDataModule`` for the other arguments.

    Args:
        num_examples: examples generated (before the split).
        input_shape: shape of one example, e.g. ``[1, 8, 8]``.
        num_classes: number of classes.
        noise: standard deviation of the noise around each class mean.
    """

    def __init__(
        self,
        num_examples: int = 2048,
        input_shape: Sequence[int] = (1, 8, 8),
        num_classes: int = 10,
        noise: float = 1.0,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        self.num_examples = int(num_examples)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        self.noise = float(noise)

    def tensors(self) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        means = torch.randn(self.num_classes, *self.input_shape, generator=generator)
        targets = torch.randint(self.num_classes, (self.num_examples,), generator=generator)
        noise = torch.randn(self.num_examples, *self.input_shape, generator=generator)
        return means[targets] + self.noise * noise, targets
