"""``MSVDDataModule``: MSVD video captions over precomputed frame features.

Files (in ``path``):

* ``features/<video_id>.npy``: one float32 array per video, ``(frames_i, feature_size)``, the
  CNN features of its frames in order (fc7 of VGG-16, 4096 wide, in the S2VT paper). Videos
  with more than ``frames`` frames are sampled at evenly spaced frames, shorter ones padded
  with zero frames at the end. Read one video at a time when a batch asks for it.
* ``captions.txt``: lines ``<video_id>\\t<caption>``, several per video; each caption is one
  example. Captions are lower-cased and split into words (runs of letters, digits and
  apostrophes); captions of videos without features are skipped.
* ``splits.txt`` (optional): lines ``<video_id>\\t<train|val|test>``. Without it the videos
  that have features are sorted in natural order (``vid2`` before ``vid10``) and the first
  ``train_videos`` (1,200) train, the next ``val_videos`` (100) validate and the rest (670 in
  the 1,970-video corpus) test: the standard MSVD split when the ids follow the corpus's order.

The vocabulary is ``PAD`` (0), ``START`` (1), ``END`` (2), ``UNK`` (3), then the training
captions' most frequent words, ``vocab_size`` in all (``num_classes``). A caption becomes its
words cut to ``caption_length - 1``, closed by ``END`` and padded; batches are ``(features
(batch, frames, feature_size) float32, caption input (batch, caption_length), caption target
(batch, caption_length))``, the input being ``START`` then the target shifted right: the layout
S2VT takes.

Without ``path`` the module generates ``num_examples`` videos instead: each has one of
``topics`` random feature directions (plus noise) in every frame and that topic's fixed random
caption, so the captions can be learnt from the features; it logs that it does.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from pl_pipedream.data.sequences import PAD, START
from pl_pipedream.data.split import SplitDataModule
from pl_pipedream.data.wmt16 import END, UNK, build_vocabulary, encode

__all__ = ["END", "PAD", "START", "UNK", "MSVDDataModule", "fit_frames", "words"]

logger = logging.getLogger(__name__)

WORD = re.compile(r"[a-z0-9']+")
SPLITS = ("train", "val", "test")


def words(caption: str) -> list[str]:
    """A caption's words: lower-cased runs of letters, digits and apostrophes."""
    return WORD.findall(caption.lower())


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``vid2`` before ``vid10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def fit_frames(features: np.ndarray, frames: int) -> Tensor:
    """``features`` as ``(frames, feature_size)``: evenly spaced frames of a longer video,
    zero frames after a shorter one."""
    count = len(features)
    if count > frames:
        features = features[np.linspace(0, count - 1, frames).round().astype(int)]
    out = torch.zeros(frames, features.shape[1])
    out[: min(count, frames)] = torch.from_numpy(np.asarray(features, dtype=np.float32))
    return out


def teacher_forcing(target: Tensor) -> Tensor:
    """The decoder's input: ``START`` then ``target`` shifted right."""
    return torch.cat([torch.full((len(target), 1), START), target[:, :-1]], dim=1)


class VideoCaptions(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """``(features, caption input, caption target)`` per caption; features read per item."""

    def __init__(
        self, files: list[Path], video: Tensor, target: Tensor, frames: int, feature_size: int
    ) -> None:
        self.files, self.video, self.target = files, video, target
        self.frames, self.feature_size = frames, feature_size
        self.input = teacher_forcing(target)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        file = self.files[int(self.video[index])]
        features = np.load(file)
        if features.ndim != 2 or features.shape[1] != self.feature_size:
            raise ValueError(
                f"MSVD features must be (frames, feature_size) arrays (file: {file}, shape: "
                f"{list(features.shape)}, feature_size: {self.feature_size}); set "
                "data.feature_size to the features' width"
            )
        return fit_frames(features, self.frames), self.input[index], self.target[index]


class GeneratedVideos(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """Generated videos: a topic's feature direction plus noise in every frame, the topic's
    caption; each video's noise drawn from ``seed`` and its index."""

    def __init__(
        self,
        count: int,
        frames: int,
        feature_size: int,
        length: int,
        vocab: int,
        topics: int,
        seed: int,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.directions = torch.randn(topics, feature_size, generator=generator)
        captions = torch.randint(UNK + 1, vocab, (topics, length), generator=generator)
        sizes = torch.randint(max(1, length // 2), length, (topics,), generator=generator)
        for topic, size in enumerate(sizes.tolist()):
            captions[topic, size] = END
            captions[topic, size + 1 :] = PAD
        self.topic = torch.randint(topics, (count,), generator=generator)
        self.target = captions[self.topic]
        self.input = teacher_forcing(self.target)
        self.frames, self.seed = frames, seed

    def __len__(self) -> int:
        return len(self.topic)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        noise = torch.randn(self.frames, self.directions.shape[1], generator=generator)
        features = self.directions[self.topic[index]] + noise
        return features, self.input[index], self.target[index]


class MSVDDataModule(SplitDataModule):
    """MSVD (or generated) frame features and captions; see the module docstring and
    ``SplitDataModule`` for the other arguments.

    Args:
        path: the directory holding ``features/`` and ``captions.txt``; ``None`` generates.
        frames: frames per video (``input_shape == (frames, feature_size)``; 80 in S2VT).
        feature_size: width of one frame's features.
        caption_length: padded caption length, ``END`` included.
        vocab_size: the vocabulary, special tokens included (``num_classes``).
        train_videos, val_videos: the split by natural order of the ids, without splits.txt.
        num_examples, topics: generated videos and their topics; unused with ``path``.
    """

    data_kind = "video"

    def __init__(
        self,
        path: str | None = None,
        frames: int = 80,
        feature_size: int = 4096,
        caption_length: int = 20,
        vocab_size: int = 10000,
        train_videos: int = 1200,
        val_videos: int = 100,
        num_examples: int = 1024,
        topics: int = 16,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        if caption_length < 2 or vocab_size <= UNK + 1 or frames < 1 or feature_size < 1:
            raise ValueError(
                f"MSVD needs caption_length >= 2, vocab_size > {UNK + 1} and positive frames "
                f"and feature_size (caption_length: {caption_length}, vocab_size: "
                f"{vocab_size}, frames: {frames}, feature_size: {feature_size}); e.g. "
                "data.caption_length=20 data.vocab_size=10000"
            )
        self.path = None if path is None else Path(path)
        self.frames, self.feature_size = int(frames), int(feature_size)
        self.caption_length, self.vocab_size = int(caption_length), int(vocab_size)
        self.train_videos, self.val_videos = int(train_videos), int(val_videos)
        self.num_examples, self.topics = int(num_examples), int(topics)
        self.input_shape = (self.frames, self.feature_size)
        self.num_classes = self.vocab_size
        self.vocabulary: dict[str, int] = {}
        if self.path is not None:
            for needed in (self.path / "features", self.path / "captions.txt"):
                if not needed.exists():
                    raise FileNotFoundError(
                        f"MSVD needs features/<video_id>.npy and captions.txt (missing: "
                        f"{needed}); give data.path the directory holding both"
                    )

    def video_splits(self, videos: list[str]) -> dict[str, list[str]]:
        """Each split's video ids: from ``splits.txt`` or by natural order."""
        assert self.path is not None
        file = self.path / "splits.txt"
        if file.is_file():
            splits: dict[str, list[str]] = {split: [] for split in SPLITS}
            for line in file.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                video, split = line.split("\t")
                if split not in splits:
                    raise ValueError(
                        f"splits.txt names train, val or test (line: {line!r}); fix {file}"
                    )
                splits[split].append(video)
        else:
            ordered = sorted(videos, key=natural_key)
            first, second = self.train_videos, self.train_videos + self.val_videos
            splits = {"train": ordered[:first], "val": ordered[first:second]}
            splits["test"] = ordered[second:]
        for split, ids in splits.items():
            if not ids:
                raise ValueError(
                    f"MSVD's {split} split has no videos (videos with features: "
                    f"{len(videos)}, train_videos: {self.train_videos}, val_videos: "
                    f"{self.val_videos}); lower data.train_videos/data.val_videos or list "
                    "the split in splits.txt"
                )
        return splits

    def captions(self) -> dict[str, list[list[str]]]:
        """Each video's captions as word lists (videos with features only)."""
        assert self.path is not None
        have = {file.stem for file in (self.path / "features").glob("*.npy")}
        captions: dict[str, list[list[str]]] = {video: [] for video in have}
        for line in (self.path / "captions.txt").read_text(encoding="utf-8").splitlines():
            video, _, caption = line.partition("\t")
            if video in captions and words(caption):
                captions[video].append(words(caption))
        return captions

    def encode(self, captions: list[list[str]]) -> Tensor:
        rows = [encode(c, self.vocabulary, self.caption_length) for c in captions]
        return torch.tensor(rows, dtype=torch.long).view(-1, self.caption_length)

    def datasets(self) -> dict[str, Dataset[Any]]:
        if self.path is None:
            logger.warning(
                "data.path is not set: generating %d videos of %d frames x %d features with "
                "captions of their %d topics instead of reading MSVD",
                self.num_examples,
                self.frames,
                self.feature_size,
                self.topics,
            )
            videos = GeneratedVideos(
                self.num_examples,
                self.frames,
                self.feature_size,
                self.caption_length,
                self.vocab_size,
                self.topics,
                self.seed,
            )
            return self.split(videos)
        assert self.path is not None
        captions = self.captions()
        splits = self.video_splits(sorted(captions))
        train = [c for video in splits["train"] for c in captions.get(video, [])]
        self.vocabulary = build_vocabulary(train, self.vocab_size)
        logger.info(
            "reading MSVD from %s (%d training captions, %d words in the vocabulary)",
            self.path,
            len(train),
            len(self.vocabulary),
        )
        datasets: dict[str, Dataset[Any]] = {}
        for split, ids in splits.items():
            ids = [video for video in ids if captions.get(video)]
            if not ids:
                raise ValueError(
                    f"MSVD's {split} split has no video with features and captions (path: "
                    f"{self.path}); add its features/<video_id>.npy and captions.txt lines"
                )
            files = [self.path / "features" / f"{video}.npy" for video in ids]
            counts = [len(captions[video]) for video in ids]
            video = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(counts))
            target = self.encode([c for v in ids for c in captions[v]])
            datasets[split] = VideoCaptions(files, video, target, self.frames, self.feature_size)
        return datasets
