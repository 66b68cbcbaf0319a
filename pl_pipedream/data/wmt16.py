"""``WMT16DataModule``: WMT16 English-German parallel text as padded token sequences.

Files (in ``path``; tokenised, optionally BPE-segmented, one sentence per line, tokens separated
by spaces, line ``i`` of the source file translating line ``i`` of the target file):

* ``train.en`` / ``train.de``: the training pairs;
* ``newstest2013.en`` / ``newstest2013.de``: validation;
* ``newstest2014.en`` / ``newstest2014.de``: test;
* ``vocab.txt`` (optional): the vocabulary, one token per line (anything after a tab or space
  on the line, such as a count, is ignored), most useful first.

The split names (``train``, ``val``, ``test``) and the languages (``source``, ``target``)
change the file names. Source and target share one vocabulary (GNMT embeds both with it):
``PAD`` (0), ``START`` (1), ``END`` (2), ``UNK`` (3), then the ``vocab_size - 4`` first tokens
of ``vocab.txt``, or, without it, the most frequent tokens of both training files (ties broken
by first appearance). ``num_classes`` is always ``vocab_size``; ids the corpus does not fill
are never produced. Tokens outside the vocabulary become ``UNK``.

Every sentence is cut to ``length - 1`` tokens and closed by ``END``, then padded with ``PAD``
to ``length``; pairs with an empty side are dropped. Batches are ``(source, decoder input,
target)``, each ``(batch, length)`` int64: the decoder input is ``START`` followed by the target
shifted right, the layout the sequence models (Seq2Seq, GNMT) take.

Without ``path`` the module generates ``SequenceDataModule``'s reversal task with the same
``vocab_size`` and ``length`` instead, and logs that it does.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from pl_pipedream.data.sequences import PAD, START, SequenceDataModule
from pl_pipedream.data.split import SplitDataModule

__all__ = ["END", "PAD", "START", "UNK", "WMT16DataModule", "build_vocabulary", "encode"]

logger = logging.getLogger(__name__)

END, UNK = 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids PAD, START, END, UNK


def build_vocabulary(sentences: Iterable[list[str]], size: int) -> dict[str, int]:
    """Token -> id for the ``size - 4`` most frequent tokens of ``sentences`` (ties: first seen
    first), after the four special ids."""
    counts: Counter[str] = Counter()
    for tokens in sentences:
        counts.update(tokens)  # Counter keeps first-seen order; most_common's sort is stable
    words = [w for w, _ in counts.most_common() if w not in SPECIALS][: size - len(SPECIALS)]
    return {word: index for index, word in enumerate((*SPECIALS, *words))}


def encode(tokens: list[str], vocabulary: dict[str, int], length: int) -> list[int]:
    """``tokens`` as ids cut to ``length - 1``, closed by ``END`` and padded to ``length``."""
    ids = [vocabulary.get(token, UNK) for token in tokens[: length - 1]] + [END]
    return ids + [PAD] * (length - len(ids))


def read_lines(file: Path) -> list[list[str]]:
    """The whitespace-separated tokens of every line of ``file``."""
    with open(file, encoding="utf-8") as handle:
        return [line.split() for line in handle]


class WMT16DataModule(SplitDataModule):
    """WMT16 En-De (or generated) token sequences; see the module docstring and
    ``SplitDataModule`` for the other arguments.

    Args:
        path: the directory holding the files; ``None`` generates sequences.
        vocab_size: the shared vocabulary, special tokens included (``num_classes``).
        length: padded length of every sentence (``input_shape == (length,)``).
        source, target: the languages' file suffixes (``en``, ``de``).
        train, val, test: the splits' file names before the suffix.
        num_examples: training pairs kept (the first ones; ``None``: all), or generated pairs.
        min_length: shortest generated sequence (without ``path``).
    """

    data_kind = "sequences"

    def __init__(
        self,
        path: str | None = None,
        vocab_size: int = 32000,
        length: int = 50,
        source: str = "en",
        target: str = "de",
        train: str = "train",
        val: str = "newstest2013",
        test: str = "newstest2014",
        num_examples: int | None = None,
        min_length: int = 4,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        if vocab_size <= len(SPECIALS) or length < 2:
            raise ValueError(
                f"WMT16 needs vocab_size above {len(SPECIALS)} and length at least 2 "
                f"(vocab_size: {vocab_size}, length: {length}); e.g. data.vocab_size=32000 "
                "data.length=50"
            )
        self.path = None if path is None else Path(path)
        self.vocab_size, self.length = int(vocab_size), int(length)
        self.languages = (source, target)
        self.files = {"train": train, "val": val, "test": test}
        self.num_examples = None if num_examples is None else int(num_examples)
        self.min_length = int(min_length)
        self.input_shape = (self.length,)
        self.num_classes = self.vocab_size
        self.vocabulary: dict[str, int] = {}
        if self.path is not None:
            self._check_files()

    def _file(self, split: str, language: str) -> Path:
        assert self.path is not None
        return self.path / f"{self.files[split]}.{language}"

    def _check_files(self) -> None:
        assert self.path is not None
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"WMT16 needs a directory of parallel text (missing: {self.path}); give "
                "data.path the directory holding train.en, train.de, newstest2013.* ..."
            )
        for split in self.files:
            for language in self.languages:
                if not self._file(split, language).is_file():
                    raise FileNotFoundError(
                        f"WMT16's {split} split needs its {language} file (missing: "
                        f"{self._file(split, language)}); add it, or name the split's files "
                        f"with data.{split}=NAME"
                    )

    def load_vocabulary(self, pairs: list[tuple[list[str], list[str]]]) -> dict[str, int]:
        """``vocab.txt``'s first ``vocab_size - 4`` tokens if it exists, else the training
        pairs' most frequent tokens."""
        assert self.path is not None
        file = self.path / "vocab.txt"
        if not file.is_file():
            return build_vocabulary((t for pair in pairs for t in pair), self.vocab_size)
        words = [line[0] for line in read_lines(file) if line]
        words = [w for w in words if w not in SPECIALS][: self.vocab_size - len(SPECIALS)]
        return {word: index for index, word in enumerate((*SPECIALS, *words))}

    def pairs(self, split: str) -> list[tuple[list[str], list[str]]]:
        """The split's sentence pairs with no empty side (training: the first
        ``num_examples``)."""
        source, target = (read_lines(self._file(split, lang)) for lang in self.languages)
        if len(source) != len(target):
            raise ValueError(
                f"parallel files must have one line per sentence pair (lines in "
                f"{self._file(split, self.languages[0])}: {len(source)}, in "
                f"{self._file(split, self.languages[1])}: {len(target)}); fix the files"
            )
        pairs = [(s, t) for s, t in zip(source, target, strict=True) if s and t]
        if split == "train" and self.num_examples is not None:
            pairs = pairs[: self.num_examples]
        return pairs

    def encode_pairs(self, pairs: list[tuple[list[str], list[str]]]) -> Dataset[Any]:
        """``(source, decoder input, target)`` rows of the pairs."""
        source = torch.tensor([encode(s, self.vocabulary, self.length) for s, _ in pairs])
        target = torch.tensor([encode(t, self.vocabulary, self.length) for _, t in pairs])
        source, target = source.view(-1, self.length), target.view(-1, self.length)
        decoder_input = torch.cat([torch.full((len(target), 1), START), target[:, :-1]], dim=1)
        return TensorDataset(source, decoder_input, target)

    def tensors(self) -> tuple[Tensor, ...]:
        """The generated reversal task (without ``path``)."""
        generated = SequenceDataModule(
            num_examples=self.num_examples or 2048,
            vocab=self.vocab_size,
            length=self.length,
            min_length=min(self.min_length, self.length),
            seed=self.seed,
        )
        return generated.tensors()

    def datasets(self) -> dict[str, Dataset[Any]]:
        if self.path is None:
            logger.warning(
                "data.path is not set: generating token sequences to reverse (vocabulary %d, "
                "length %d) instead of reading WMT16",
                self.vocab_size,
                self.length,
            )
            return super().datasets()
        train = self.pairs("train")
        self.vocabulary = self.load_vocabulary(train)
        logger.info(
            "reading WMT16 from %s (%d training pairs, %d tokens in the vocabulary)",
            self.path,
            len(train),
            len(self.vocabulary),
        )
        return {
            "train": self.encode_pairs(train),
            "val": self.encode_pairs(self.pairs("val")),
            "test": self.encode_pairs(self.pairs("test")),
        }
