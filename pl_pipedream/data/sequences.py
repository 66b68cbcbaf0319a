"""``SequenceDataModule``: generated sequence-to-sequence data, reversing token sequences.

Each example is a source of random tokens (length drawn between ``min_length`` and ``length``,
padded with token 0 to ``length``), the decoder's input (start token 1, then the target shifted
right) and the target: the source's tokens reversed (or copied, ``task="copy"``), padded
alike. A sequence model with attention learns either quickly; the loss ignores padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pl_pipedream.data.split import SplitDataModule

__all__ = ["SequenceDataModule"]

PAD, START = 0, 1  # the first real token is 2
TASKS = ("reverse", "copy")


class SequenceDataModule(SplitDataModule):
    """``num_examples`` generated sequence pairs; batches are ``(source, decoder_input,
    target)``, each ``(batch, length)`` int64. See ``SplitDataModule`` for the other arguments.

    Args:
        num_examples: examples generated (before the split).
        vocab: tokens, padding and start included (``num_classes`` for the model).
        length: padded length of every sequence (``input_shape == (length,)``).
        min_length: shortest source.
        task: ``"reverse"`` or ``"copy"``.
    """

    data_kind = "sequences"

    def __init__(
        self,
        num_examples: int = 2048,
        vocab: int = 32,
        length: int = 8,
        min_length: int = 4,
        task: str = "reverse",
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        if task not in TASKS or vocab < 3 or not 1 <= min_length <= length:
            raise ValueError(
                f"sequences need a task in {TASKS}, vocab >= 3 and 1 <= min_length <= length "
                f"(task: {task!r}, vocab: {vocab}, min_length: {min_length}, length: {length}); "
                "for example data.task=reverse data.vocab=32 data.min_length=4 data.length=8"
            )
        self.num_examples, self.vocab, self.length = int(num_examples), int(vocab), int(length)
        self.min_length, self.task = int(min_length), task
        self.input_shape = (self.length,)
        self.num_classes = self.vocab

    def tensors(self) -> tuple[Tensor, ...]:
        generator = torch.Generator().manual_seed(self.seed)
        n, length = self.num_examples, self.length
        tokens = torch.randint(START + 1, self.vocab, (n, length), generator=generator)
        lengths = torch.randint(self.min_length, length + 1, (n,), generator=generator)
        real = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
        source = tokens.masked_fill(~real, PAD)
        target = source.clone()
        if self.task == "reverse":
            for row, count in enumerate(lengths.tolist()):
                target[row, :count] = source[row, :count].flip(0)
        decoder_input = torch.cat([torch.full((n, 1), START), target[:, :-1]], dim=1)
        return source, decoder_input, target
