"""Example LightningDataModules for ``pl-pipedream-train``: no downloads, deterministic splits.

The image modules yield ``(inputs, targets)`` batches shaped ``input_shape`` (character windows
for ``TextDataModule``); the sequence module yields ``(source, decoder_input, target)`` token
batches. Each says what the model needs to know about its data (``input_shape``,
``num_classes``).
"""

from __future__ import annotations

from pl_pipedream.data.digits import DigitsDataModule
from pl_pipedream.data.sequences import SequenceDataModule
from pl_pipedream.data.synthetic import SyntheticDataModule
from pl_pipedream.data.text import TextDataModule

__all__ = ["DigitsDataModule", "SequenceDataModule", "SyntheticDataModule", "TextDataModule"]
