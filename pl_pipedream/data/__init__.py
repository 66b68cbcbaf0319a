"""LightningDataModules for ``pl-pipedream-train``: no downloads, deterministic splits.

The paper's data sets (``ImageNetDataModule``, ``WMT16DataModule``, ``PennTreebankDataModule``,
``MSVDDataModule``) read their standard files from ``path``, or generate data of the same
shapes when it is not given.

The image modules yield ``(inputs, targets)`` batches shaped ``input_shape`` (character windows
for ``TextDataModule``); the sequence module yields ``(source, decoder_input, target)`` token
batches. Each says what the model needs to know about its data (``input_shape``,
``num_classes``).
"""

from __future__ import annotations

from pl_pipedream.data.digits import DigitsDataModule
from pl_pipedream.data.imagenet import ImageNetDataModule
from pl_pipedream.data.msvd import MSVDDataModule
from pl_pipedream.data.ptb import PennTreebankDataModule
from pl_pipedream.data.sequences import SequenceDataModule
from pl_pipedream.data.synthetic import SyntheticDataModule
from pl_pipedream.data.text import TextDataModule
from pl_pipedream.data.wmt16 import WMT16DataModule

__all__ = [
    "DigitsDataModule",
    "ImageNetDataModule",
    "MSVDDataModule",
    "PennTreebankDataModule",
    "SequenceDataModule",
    "SyntheticDataModule",
    "TextDataModule",
    "WMT16DataModule",
]
