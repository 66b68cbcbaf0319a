"""Example LightningDataModules for ``pl-pipedream-train``: no downloads, deterministic splits.

Each yields ``(inputs, targets)`` batches (images, or character windows for ``TextDataModule``)
and says what the model needs to know about them (``input_shape``, ``num_classes``).
"""

from __future__ import annotations

from pl_pipedream.data.digits import DigitsDataModule
from pl_pipedream.data.synthetic import SyntheticDataModule
from pl_pipedream.data.text import TextDataModule

__all__ = ["DigitsDataModule", "SyntheticDataModule", "TextDataModule"]
