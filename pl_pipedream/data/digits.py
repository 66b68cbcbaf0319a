"""``DigitsDataModule``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

The images ship with scikit-learn (``sklearn.datasets.load_digits``), so nothing is downloaded.
Pixel values 0..16 are scaled to 0..1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pl_pipedream.data.split import SplitDataModule

__all__ = ["DigitsDataModule"]


class DigitsDataModule(SplitDataModule):
    """Handwritten digits as ``(1, 8, 8)`` float images with labels 0..9; see ``SplitDataModule``
    for the arguments."""

    input_shape = (1, 8, 8)
    num_classes = 10

    def tensors(self) -> tuple[Tensor, Tensor]:
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:
            raise ImportError(
                "data=digits needs scikit-learn (pip install scikit-learn, or "
                "pip install 'pl-pipedream[test]'); or train on generated data with data=synthetic"
            ) from error
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        return images, torch.tensor(digits.target, dtype=torch.long)
