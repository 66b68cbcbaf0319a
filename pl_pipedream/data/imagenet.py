"""``ImageNetDataModule``: ImageNet from a directory of class folders, decoded with Pillow.

The layout is the usual one for ImageNet-1k: ``path/train/<class>/<image>`` and
``path/val/<class>/<image>`` with ``.JPEG``, ``.jpg``, ``.jpeg`` or ``.png`` images (any case).
The classes are the sorted folder names of ``train``; ``val`` must hold the same set of folders
(its images sorted by class then by file name). ImageNet's test labels are not published, so the
``val`` folder serves as both the validation and the test split. Images are decoded one at a
time, when a batch asks for them, so the loader can run in ``num_workers`` processes.

Training images get a random resized crop (a region of 8%-100% of the image's area with an
aspect ratio between 3/4 and 4/3, resized to ``image_size``), a horizontal flip with
probability 1/2 and per-channel normalisation by ImageNet's mean and standard deviation;
validation and test images are resized so that their shorter side is ``image_size * 256 /
224`` and center-cropped to ``image_size``, then normalised alike. Every process of a pipeline
must feed identical batches, so the random draws do not come from a process's global generator:
the training sampler draws the order and one seed per example from a generator seeded with
``seed``, and each example's crop and flip come from its own seed, in whichever worker decodes it.

Without ``path`` the module generates ``num_examples`` images of the same shape instead (a
coarse random pattern per class, upsampled, plus Gaussian noise, so that the classes can be
learnt), one image per index drawn from ``seed``, and logs that it does.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from pl_pipedream.data.split import SplitDataModule

__all__ = ["MEAN", "STD", "ImageNetDataModule", "center_crop", "random_resized_crop"]

logger = logging.getLogger(__name__)

MEAN = (0.485, 0.456, 0.406)  # ImageNet's per-channel mean and standard deviation (RGB, 0..1)
STD = (0.229, 0.224, 0.225)
EXTENSIONS = (".jpeg", ".jpg", ".png")
PATTERN = 4  # side of the coarse per-class pattern of the generated images


def to_tensor(image: Any) -> Tensor:
    """A Pillow RGB image as a normalised ``(3, height, width)`` float tensor."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    return (pixels.float() / 255.0 - mean) / std


def resize(image: Any, width: int, height: int) -> Any:
    """``image`` resized bilinearly to ``width`` x ``height`` (unchanged if it has that size)."""
    from PIL import Image

    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling.BILINEAR)


def center_crop(image: Any, size: int) -> Any:
    """The validation transform's geometry: the shorter side resized to ``size * 256 / 224``,
    then the central ``size`` x ``size`` square."""
    width, height = image.size
    shorter = round(size * 256 / 224)
    if width <= height:
        image = resize(image, shorter, max(shorter, round(height * shorter / width)))
    else:
        image = resize(image, max(shorter, round(width * shorter / height)), shorter)
    width, height = image.size
    left, top = (width - size) // 2, (height - size) // 2
    return image.crop((left, top, left + size, top + size))


def random_resized_crop(
    image: Any,
    size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> Any:
    """A random region covering a share of the area in ``scale`` with a width/height ratio in
    ``ratio`` (drawn uniformly on a log scale), resized to ``size`` x ``size``. After ten draws
    that do not fit inside the image, the largest central region of ratio within ``ratio``.
    The draws come from ``generator`` (torch's global one if ``None``)."""
    width, height = image.size
    area = width * height
    for _ in range(10):
        target = area * float(torch.empty(()).uniform_(*scale, generator=generator))
        low, high = math.log(ratio[0]), math.log(ratio[1])
        aspect = math.exp(float(torch.empty(()).uniform_(low, high, generator=generator)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(width - w + 1, (), generator=generator))
            top = int(torch.randint(height - h + 1, (), generator=generator))
            return resize(image.crop((left, top, left + w, top + h)), size, size)
    aspect = min(max(width / height, ratio[0]), ratio[1])
    w, h = (
        (width, round(width / aspect))
        if width / height < aspect
        else (round(height * aspect), height)
    )
    w, h = min(w, width), min(h, height)
    left, top = (width - w) // 2, (height - h) // 2
    return resize(image.crop((left, top, left + w, top + h)), size, size)


class AugmentationSampler(Sampler[tuple[int, int]]):
    """The training order and a seed per example, ``(index, seed)``, drawn from one generator
    seeded once: every process draws the same sequence, a new one each epoch."""

    def __init__(self, count: int, seed: int, shuffle: bool) -> None:
        self.count, self.shuffle = count, shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Any:
        if self.shuffle:
            order = torch.randperm(self.count, generator=self.generator)
        else:
            order = torch.arange(self.count)
        seeds = torch.randint(2**62, (self.count,), generator=self.generator)
        return iter(zip(order.tolist(), seeds.tolist(), strict=True))


class ImageFolder(Dataset[tuple[Tensor, Tensor]]):
    """``(image, label)`` pairs of a list of files, each file decoded when it is asked for.
    Training items are asked for as ``(index, seed)`` (``AugmentationSampler``), the seed
    fixing the crop and the flip; a plain index uses the index as the seed."""

    def __init__(self, files: list[tuple[Path, int]], image_size: int, train: bool) -> None:
        self.files, self.image_size, self.train = files, image_size, train

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
        from PIL import Image

        index, seed = key if isinstance(key, tuple) else (key, key)
        file, label = self.files[index]
        with Image.open(file) as opened:
            image = opened.convert("RGB")
        if self.train:
            generator = torch.Generator().manual_seed(seed)
            image = random_resized_crop(image, self.image_size, generator=generator)
            if float(torch.rand((), generator=generator)) < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            image = center_crop(image, self.image_size)
        return to_tensor(image), torch.tensor(label)


class GeneratedImages(Dataset[tuple[Tensor, Tensor]]):
    """``count`` generated images: the upsampled pattern of a random class plus noise, each
    drawn from ``seed`` and its index, so any process and any worker draws the same one."""

    def __init__(self, count: int, image_size: int, num_classes: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, 3, PATTERN, PATTERN, generator=generator)
        self.labels = torch.randint(num_classes, (count,), generator=generator)
        self.image_size, self.seed = image_size, seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        label = self.labels[index]
        pattern = F.interpolate(self.patterns[label][None], size=self.image_size, mode="nearest")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        noise = torch.randn(pattern.shape[1:], generator=generator)
        return pattern[0] + noise, label


class ImageNetDataModule(SplitDataModule):
    """ImageNet-shaped ``(3, image_size, image_size)`` images with labels, from ``path`` or
    generated; see the module docstring and ``SplitDataModule`` for the other arguments.

    Args:
        path: the directory holding ``train/`` and ``val/``; ``None`` generates images.
        image_size: side of the square crops (224 as in the paper; 32 for quick runs).
        num_classes: the classes; with ``path`` it must equal the number of class folders.
        num_examples: generated images (before the split); unused with ``path``.
        val_fraction, test_fraction: shares held out of the generated images; unused with
            ``path`` (the ``val`` folder is both).
    """

    data_kind = "images"

    def __init__(
        self,
        path: str | None = None,
        image_size: int = 224,
        num_classes: int = 1000,
        num_examples: int = 2048,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, test_fraction, shuffle, seed, num_workers)
        self.path = None if path is None else Path(path)
        self.image_size, self.num_examples = int(image_size), int(num_examples)
        self.input_shape = (3, self.image_size, self.image_size)
        self.num_classes = int(num_classes)
        self.classes: list[str] = []
        if self.path is not None:
            self.classes = self._class_folders()
            if len(self.classes) != self.num_classes:
                raise ValueError(
                    f"the class folders must be num_classes (num_classes: {self.num_classes}, "
                    f"class folders in {self.path / 'train'}: {len(self.classes)}); set "
                    f"data.num_classes={len(self.classes)}"
                )

    def _class_folders(self) -> list[str]:
        """The sorted class folder names of ``train``, checked against ``val``'s."""
        assert self.path is not None
        folders = {}
        for split in ("train", "val"):
            directory = self.path / split
            if not directory.is_dir():
                raise FileNotFoundError(
                    f"ImageNet needs a {split} folder of class folders (missing: {directory}); "
                    f"give data.path the directory that holds train/ and val/"
                )
            folders[split] = sorted(p.name for p in directory.iterdir() if p.is_dir())
        if not folders["train"]:
            raise FileNotFoundError(
                f"ImageNet's train folder must hold class folders (none in: "
                f"{self.path / 'train'}); put each class's images in train/<class>/"
            )
        if folders["train"] != folders["val"]:
            only = sorted(set(folders["train"]) ^ set(folders["val"]))
            raise ValueError(
                f"train/ and val/ must hold the same class folders (in one only: "
                f"{only[:5]}{' ...' if len(only) > 5 else ''}); add or remove those folders"
            )
        return folders["train"]

    def _files(self, split: str) -> list[tuple[Path, int]]:
        assert self.path is not None
        files = [
            (file, label)
            for label, name in enumerate(self.classes)
            for file in sorted((self.path / split / name).iterdir())
            if file.suffix.lower() in EXTENSIONS
        ]
        if not files:
            raise FileNotFoundError(
                f"ImageNet's {split} folders hold no images (folder: {self.path / split}, "
                f"extensions: {', '.join(EXTENSIONS)}); check data.path"
            )
        return files

    def datasets(self) -> dict[str, Dataset[Any]]:
        if self.path is None:
            logger.warning(
                "data.path is not set: generating %d ImageNet-shaped images %s (%d classes) "
                "instead of reading ImageNet",
                self.num_examples,
                self.input_shape,
                self.num_classes,
            )
            return self.split(
                GeneratedImages(self.num_examples, self.image_size, self.num_classes, self.seed)
            )
        val = ImageFolder(self._files("val"), self.image_size, train=False)
        logger.info("reading ImageNet from %s (%d classes)", self.path, self.num_classes)
        return {
            "train": ImageFolder(self._files("train"), self.image_size, train=True),
            "val": val,
            "test": val,
        }

    def train_dataloader(self) -> DataLoader[Any]:
        train = self.splits["train"]
        if not isinstance(train, ImageFolder):
            return super().train_dataloader()
        return DataLoader(
            train,
            batch_size=self.batch_size,
            sampler=AugmentationSampler(len(train), self.seed, self.shuffle),
            drop_last=True,
            num_workers=self.num_workers,
        )
