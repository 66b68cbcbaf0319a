"""``PennTreebankDataModule``: the word-level Penn Treebank as next-word windows.

Files (in ``path``): ``ptb.train.txt``, ``ptb.valid.txt`` and ``ptb.test.txt``, the corpus as
Mikolov et al. preprocessed it (lower case, numbers as ``N``, rare words already ``<unk>``), one
sentence per line, words separated by spaces. As the standard preprocessing does, every line
becomes its words followed by ``<eos>``, and each split is one stream of words.

The vocabulary is ``<eos>`` (id 0), ``<unk>`` (id 1), then the training file's other words, the
most frequent first (ties broken by first appearance), up to ``vocab_size`` in all (the real
corpus has exactly 10,000 words, ``<eos>`` included); words outside it become ``<unk>``.
``num_classes`` is always ``vocab_size``. Each split's stream is cut into consecutive windows of
``length`` words; a window's targets are the same words shifted by one (the next word of each),
so batches are ``(tokens, targets)``, each ``(batch, length)`` int64, what AWDLM and CharGPT
take. The last incomplete window is dropped.

Without ``path`` the module generates a word stream instead (each next word drawn from a few
successors of the previous one, so that there is something to learn) with the same vocabulary
size, cut into windows alike, and logs that it does.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from pl_pipedream.data.split import SplitDataModule

__all__ = ["EOS", "UNK", "PennTreebankDataModule", "windows"]

logger = logging.getLogger(__name__)

EOS, UNK = 0, 1
FILES = {"train": "ptb.train.txt", "val": "ptb.valid.txt", "test": "ptb.test.txt"}
SUCCESSORS = 4  # the generated stream's choices of next word


def read_words(file: Path) -> list[str]:
    """The words of ``file``, each line closed by ``<eos>``."""
    with open(file, encoding="utf-8") as handle:
        return [word for line in handle for word in (*line.split(), "<eos>")]


def windows(stream: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Consecutive windows of ``length`` ids of ``stream`` and their next ids as targets."""
    count = (len(stream) - 1) // length
    inputs = stream[: count * length].view(count, length)
    targets = stream[1 : count * length + 1].view(count, length)
    return inputs.contiguous(), targets.contiguous()


class PennTreebankDataModule(SplitDataModule):
    """Penn Treebank (or generated) next-word windows; see the module docstring and
    ``SplitDataModule`` for the other arguments.

    Args:
        path: the directory holding the three ``ptb.*.txt`` files; ``None`` generates words.
        length: words per window (``input_shape == (length,)``).
        vocab_size: the vocabulary, ``<eos>`` and ``<unk>`` included (``num_classes``).
        num_examples: generated windows (before the split); unused with ``path``.
    """

    data_kind = "text"

    def __init__(
        self,
        path: str | None = None,
        length: int = 70,
        vocab_size: int = 10000,
        num_examples: int = 2048,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        if vocab_size < 3 or length < 1:
            raise ValueError(
                f"the Penn Treebank needs vocab_size of at least 3 and a positive length "
                f"(vocab_size: {vocab_size}, length: {length}); e.g. data.vocab_size=10000 "
                "data.length=70"
            )
        self.path = None if path is None else Path(path)
        self.length, self.vocab_size = int(length), int(vocab_size)
        self.num_examples = int(num_examples)
        self.input_shape = (self.length,)
        self.num_classes = self.vocab_size
        self.vocabulary: dict[str, int] = {}
        if self.path is not None:
            for split, name in FILES.items():
                if not (self.path / name).is_file():
                    raise FileNotFoundError(
                        f"the Penn Treebank's {split} split needs {name} (missing: "
                        f"{self.path / name}); give data.path the directory holding "
                        f"{', '.join(FILES.values())}"
                    )

    def build_vocabulary(self, words: list[str]) -> dict[str, int]:
        """``<eos>``, ``<unk>``, then the most frequent other words, ``vocab_size`` in all."""
        ranked = [w for w, _ in Counter(words).most_common() if w not in ("<eos>", "<unk>")]
        ranked = ranked[: self.vocab_size - 2]
        return {word: index for index, word in enumerate(("<eos>", "<unk>", *ranked))}

    def stream(self, words: list[str]) -> Tensor:
        return torch.tensor([self.vocabulary.get(w, UNK) for w in words], dtype=torch.long)

    def tensors(self) -> tuple[Tensor, Tensor]:
        """Generated windows (without ``path``): a stream in which each word is followed by one
        of ``SUCCESSORS`` words fixed for it."""
        generator = torch.Generator().manual_seed(self.seed)
        table = torch.randint(self.vocab_size, (self.vocab_size, SUCCESSORS), generator=generator)
        total = self.num_examples * self.length + 1
        choices = torch.randint(SUCCESSORS, (total,), generator=generator)
        stream = torch.empty(total, dtype=torch.long)
        word = int(torch.randint(self.vocab_size, (), generator=generator))
        for position, choice in enumerate(choices.tolist()):
            stream[position] = word
            word = int(table[word, choice])
        return windows(stream, self.length)

    def datasets(self) -> dict[str, Dataset[Any]]:
        if self.path is None:
            logger.warning(
                "data.path is not set: generating %d windows of %d words (vocabulary %d) "
                "instead of reading the Penn Treebank",
                self.num_examples,
                self.length,
                self.vocab_size,
            )
            return super().datasets()
        assert self.path is not None
        words = {split: read_words(self.path / name) for split, name in FILES.items()}
        self.vocabulary = self.build_vocabulary(words["train"])
        logger.info(
            "reading the Penn Treebank from %s (%d training words, %d in the vocabulary)",
            self.path,
            len(words["train"]),
            len(self.vocabulary),
        )
        splits: dict[str, Dataset[Any]] = {}
        for split, stream in words.items():
            inputs, targets = windows(self.stream(stream), self.length)
            if not len(inputs):
                raise ValueError(
                    f"the Penn Treebank's {split} split must be longer than one window "
                    f"(words: {len(stream)}, length: {self.length}); lower data.length"
                )
            splits[split] = TensorDataset(inputs, targets)
        return splits
