"""The train/val/test split and the loaders both example data modules share."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from pl_pipedream.data.resumable import ResumableLoader

__all__ = ["SplitDataModule"]


class SplitDataModule(LightningDataModule):
    """Splits ``(inputs, targets)`` tensors once, by a seeded permutation, into train/val/test
    (or takes the splits an override of ``datasets()`` reads).

    Every process builds the same split and, with ``shuffle`` on, the same order of training
    batches (one seeded generator draws each epoch's permutation), which a pipeline needs: every
    stage must see the same batches in the same order. Training batches drop the last incomplete
    batch so that each one splits into equal microbatches; their loader resumes mid-epoch from a
    checkpoint exactly (``data.resumable``).

    Args:
        batch_size: examples per Lightning batch (a multiple of the strategy's microbatches).
        val_fraction, test_fraction: shares of the examples held out.
        shuffle: reshuffle the training examples every epoch (seeded).
        seed: seeds the split and the shuffling.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not (val_fraction > 0 and test_fraction >= 0 and val_fraction + test_fraction < 1):
            raise ValueError(
                "val_fraction must be positive, test_fraction non-negative and their sum below 1 "
                f"(val_fraction: {val_fraction}, test_fraction: {test_fraction})"
            )
        self.batch_size = int(batch_size)
        self.val_fraction = float(val_fraction)
        self.test_fraction = float(test_fraction)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        self.splits: dict[str, Dataset[Any]] = {}

    def tensors(self) -> tuple[Tensor, ...]:
        """All examples: inputs shaped ``(n, *input_shape)`` (float) and targets ``(n,)`` (long),
        or any tensors of ``n`` rows (a batch then holds one slice of each)."""
        raise NotImplementedError

    def datasets(self) -> dict[str, Dataset[Any]]:
        """The ``"train"``, ``"val"`` and ``"test"`` datasets: by default a seeded split of
        ``tensors()``. Modules whose files come split already override this."""
        return self.split(TensorDataset(*self.tensors()))

    def split(self, data: Dataset[Any]) -> dict[str, Dataset[Any]]:
        """``data`` split by a permutation drawn from ``seed``: the same on every process."""
        count = len(data)  # type: ignore[arg-type]
        order = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed))
        num_val = max(1, round(self.val_fraction * count))
        num_test = round(self.test_fraction * count)
        return {
            "val": Subset(data, order[:num_val].tolist()),
            "test": Subset(data, order[num_val : num_val + num_test].tolist()),
            "train": Subset(data, order[num_val + num_test :].tolist()),
        }

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        splits = self.datasets()
        num_train = len(splits["train"])  # type: ignore[arg-type]
        if num_train < self.batch_size:
            raise ValueError(
                f"the training split is smaller than one batch (training examples: "
                f"{num_train}, batch_size: {self.batch_size}); lower data.batch_size"
            )
        self.splits = splits

    def train_dataloader(self) -> DataLoader[Any]:
        # Every rank draws the same permutation each epoch from identically seeded generators.
        generator = torch.Generator().manual_seed(self.seed)
        return ResumableLoader(
            self.splits["train"],
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            generator=generator if self.shuffle else None,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return self._evaluation_loader("val")

    def test_dataloader(self) -> DataLoader[Any]:
        return self._evaluation_loader("test")

    def predict_dataloader(self) -> DataLoader[Any]:
        return self._evaluation_loader("test")

    def _evaluation_loader(self, split: str) -> DataLoader[Any]:
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
        )
