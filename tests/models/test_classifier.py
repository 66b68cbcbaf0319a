"""PipelineClassifier: cross-entropy over ``self.pipeline``, accuracy metrics, the optimizer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.models.classifier import PipelineClassifier


class Linear(PipelineClassifier):
    """Two features, three classes: logits = x @ W.T + b with W, b given."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__((2,), 3, **kwargs)  # type: ignore[arg-type]
        self.pipeline = nn.Sequential(nn.Linear(2, 3))
        with torch.no_grad():
            self.pipeline[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
            self.pipeline[0].bias.zero_()


def by_hand(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of the logits (x0, x1, -x0 - x1), computed in Python."""
    losses, hits = [], 0
    for (a, b), label in zip(x.tolist(), y.tolist(), strict=True):
        logits = [a, b, -a - b]
        losses.append(math.log(sum(math.exp(v) for v in logits)) - logits[label])
        hits += max(range(3), key=lambda c: logits[c]) == label
    return sum(losses) / len(losses), hits / len(losses)


# Balanced (two examples per class, one of each predicted right), so that the accuracy is the
# same whether averaged over examples or over classes (MulticlassAccuracy's default).
X = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [1.0, 0.0], [-2.0, -1.0], [1.0, 1.0]])
Y = torch.tensor([0, 0, 1, 1, 2, 2])


def test_the_step_is_cross_entropy_of_the_pipeline() -> None:
    model = Linear()
    loss, _ = by_hand(X, Y)
    assert model.training_step((X, Y), 0).item() == pytest.approx(loss, rel=1e-6)
    assert torch.equal(model(X), model.pipeline(X))
    assert model.configure_pipeline() is model.pipeline


def test_predictions_are_the_highest_logit() -> None:
    model = Linear()
    expected = [0, 1, 1, 0, 2, 0]  # ties (1, 1) go to the first class
    assert model.predict_step((X, Y), 0).tolist() == expected
    assert model.predict_step([X, Y], 0).tolist() == expected
    assert model.predict_step(X, 0).tolist() == expected


def test_the_example_input_has_the_input_shape() -> None:
    model = Linear()
    assert model.input_shape == (2,) and model.num_classes == 3
    assert torch.equal(model.example_input_array, torch.zeros(2, 2))


def quiet_trainer() -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_validation_and_test_log_loss_and_accuracy() -> None:
    loader = DataLoader(TensorDataset(X, Y), batch_size=3)
    loss, accuracy = by_hand(X, Y)
    assert accuracy == 0.5
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        validated = quiet_trainer().validate(Linear(), loader, verbose=False)[0]
        tested = quiet_trainer().test(Linear(), loader, verbose=False)[0]
    assert validated == pytest.approx({"val_loss": loss, "val_acc": accuracy}, rel=1e-6)
    assert tested == pytest.approx({"test_loss": loss, "test_acc": accuracy}, rel=1e-6)


@pytest.mark.parametrize(("name", "kind"), [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam)])
def test_the_optimizer_is_the_one_named(name: str, kind: type) -> None:
    model = Linear(optimizer=name, lr=0.25, momentum=0.5, weight_decay=0.125)
    optimizer = model.configure_optimizers()
    assert type(optimizer) is kind
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.25
    assert group["weight_decay"] == 0.125
    assert group["params"] == list(model.parameters())
    if name == "sgd":
        assert group["momentum"] == 0.5


def test_an_unknown_optimizer_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"sgd, adam \(optimizer: 'rmsprop'\).*model.optimizer=sgd"
    ):
        Linear(optimizer="rmsprop")


def test_lr_milestones_step_the_learning_rate_once_per_epoch_through_fit() -> None:
    """Epochs 1 and 2 at 0.4, 3 at 0.04 (milestone 2), 4 at 0.004 (milestone 3): the learning
    rate every training step saw, read off the optimizer, against the schedule by hand."""
    seen: list[float] = []

    class Recorded(Linear):
        def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
            seen.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    model = Recorded(optimizer="sgd", lr=0.4, lr_milestones=[2, 3], lr_gamma=0.1)
    loader = DataLoader(TensorDataset(X, Y), batch_size=len(X))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(model, loader)
    assert seen == pytest.approx([0.4, 0.4, 0.04, 0.004])


@pytest.mark.parametrize("milestones", [[3, 2], [0, 5], [2, 2]])
def test_lr_milestones_must_be_increasing_epochs(milestones: list[int]) -> None:
    with pytest.raises(ValueError, match=r"increasing epochs .*model.lr_milestones=\[30,60\]"):
        Linear(lr_milestones=milestones)
