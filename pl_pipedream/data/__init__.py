"""Example LightningDataModules for ``pl-pipedream-train``: no downloads, deterministic splits.

Both yield ``(inputs, targets)`` batches of images shaped ``input_shape`` and say what the model
needs to know about them (``input_shape``, ``num_classes``).
"""

from __future__ import annotations

from pl_pipedream.data.digits import DigitsDataModule
from pl_pipedream.data.synthetic import SyntheticDataModule

__all__ = ["DigitsDataModule", "SyntheticDataModule"]
