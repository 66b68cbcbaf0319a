"""``TextDataModule``: character-level next-token data from text that ships with Python.

The text is the source of standard-library modules (read with ``inspect.getsource``), so nothing
is downloaded and every process reads the same characters. Each character becomes its byte
value (anything outside ASCII becomes ``?``), so the vocabulary is 128 tokens. An example is a
window of ``length`` characters and the same window shifted by one as its targets.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence

import torch
from torch import Tensor

from pl_pipedream.data.split import SplitDataModule

__all__ = ["TextDataModule"]

VOCAB = 128


class TextDataModule(SplitDataModule):
    """Windows of ``length`` characters from ``modules``' source; see ``SplitDataModule``.

    Args:
        modules: standard-library modules whose source is the text, e.g. ``["textwrap"]``.
        length: characters per example (the model's context).
        num_examples: windows taken, at evenly spaced offsets of the text.
    """

    data_kind = "text"  # pl-pipedream-train pairs it with data=text

    def __init__(
        self,
        modules: Sequence[str] = ("textwrap", "string"),
        length: int = 32,
        num_examples: int = 1024,
        batch_size: int = 32,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        self.modules = list(modules)
        self.length = int(length)
        self.num_examples = int(num_examples)
        self.input_shape = (self.length,)
        self.num_classes = VOCAB

    def tensors(self) -> tuple[Tensor, Tensor]:
        text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in self.modules)
        codes = torch.tensor([ord(c) if ord(c) < VOCAB else ord("?") for c in text])
        last = len(codes) - self.length - 1
        if last < 1:
            raise ValueError(
                f"the text must be longer than one window (characters: {len(codes)}, length: "
                f"{self.length}); add modules or lower data.length"
            )
        starts = torch.linspace(0, last, self.num_examples).long()
        windows = torch.stack([codes[s : s + self.length + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
