"""``PipelineClassifier``: the Lightning side shared by the example models.

A subclass builds ``self.pipeline`` (an ``nn.Sequential`` of its own submodules) and nothing
else. ``forward`` runs the whole pipeline; under ``PipeDreamStrategy`` the strategy runs
``training_step`` on the last stage with ``self(x)`` returning the pipeline's output, so the step
reads exactly as it would on one device. The strategy logs ``train_loss`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["PipelineClassifier"]

OPTIMIZERS = ("sgd", "adam")


class PipelineClassifier(LightningModule):
    """Cross-entropy classification over ``self.pipeline``; subclasses build the layers.

    Args:
        input_shape: shape of one example (without the batch dimension), e.g. ``(1, 8, 8)``.
        num_classes: number of classes the last layer scores.
        optimizer: ``"sgd"`` or ``"adam"``.
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 penalty on every parameter, as the optimizer applies it.
        lr_milestones: epochs at whose start the learning rate is multiplied by ``lr_gamma``
            (a step schedule, stepped once per epoch); empty: a constant learning rate.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        optimizer: str = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)} (optimizer: {optimizer!r}); "
                "for example model.optimizer=sgd"
            )
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        self.optimizer_name = optimizer
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.lr_milestones = [int(epoch) for epoch in lr_milestones]
        if self.lr_milestones != sorted(set(self.lr_milestones)) or any(
            epoch < 1 for epoch in self.lr_milestones
        ):
            raise ValueError(
                f"lr_milestones must be increasing epochs from 1 on (lr_milestones: "
                f"{list(lr_milestones)}); for example model.lr_milestones=[30,60]"
            )
        self.lr_gamma = float(lr_gamma)
        self.example_input_array = torch.zeros(2, *self.input_shape)
        self.val_acc = MulticlassAccuracy(num_classes=self.num_classes)
        self.test_acc = MulticlassAccuracy(num_classes=self.num_classes)
        self.pipeline = nn.Sequential()  # subclasses fill it

    def configure_pipeline(self) -> nn.Sequential:
        return self.pipeline

    def forward(self, x: Tensor) -> Tensor:
        return self.pipeline(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=1)

    def _evaluate(self, batch: Any, prefix: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        accuracy(logits, y)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log(f"{prefix}_acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(),
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
            )
        else:
            optimizer = torch.optim.Adam(
                self.parameters(), lr=self.lr, weight_decay=self.weight_decay
            )
        if not self.lr_milestones:
            return optimizer
        schedule = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=self.lr_milestones, gamma=self.lr_gamma
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": schedule, "interval": "epoch"},
        }
