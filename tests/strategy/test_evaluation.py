"""Pipelined validation, test and predict; metrics on every rank for callbacks.

One process: the evaluation pipe of a one-stage plan and of a replica that does not evaluate.
Spawned: fit, validate, test and predict on three stages with callbacks that monitor metrics.
"""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.stage import cut_stage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.strategy.evaluation import EvaluationPipe


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.example_input_array = torch.zeros(2, 8)

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(*self.body, self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self(x)
        self.accuracy(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.accuracy, prog_bar=True)

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def predict_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self(batch[0]).argmax(1)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.5)


def data(n: int = 96) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=12)


class Doubled(Classifier):
    def test_step(self, batch, batch_idx, dataloader_idx=0):  # type: ignore[no-untyped-def]
        return 2 * self(batch[0]), batch_idx, dataloader_idx


def one_stage(replicas: int = 1, rank: int = 0) -> tuple[Doubled, EvaluationPipe]:
    model = Doubled()
    plan = Plan.from_balance([5], replicas=[replicas])
    local = cut_stage(model, model.configure_pipeline(), plan, rank)
    return model, EvaluationPipe(plan, local, channel=None, rank=rank)  # type: ignore[arg-type]


def test_the_last_stage_runs_the_hook_with_self_x_returning_the_pipelines_output() -> None:
    model, pipe = one_stage()
    x = torch.randn(4, 8)
    output, batch_idx, dataloader_idx = pipe.run(model, "test_step", (x, None), 3, 1)
    assert torch.allclose(output, 2 * model.head(model.body(x)))
    assert (batch_idx, dataloader_idx) == (3, 1)
    assert "forward" not in vars(model)
    assert pipe.predictions_to_every_rank(output, 3) is output  # one rank: the last stage
    assert pipe.metrics_source == 0


def test_only_the_first_replica_of_a_stage_evaluates() -> None:
    model, pipe = one_stage(replicas=2, rank=1)
    assert not pipe.evaluates
    assert pipe.run(model, "test_step", (torch.randn(4, 8), None), 0) is None
    assert pipe.metrics_source == 0


@pytest.mark.slow
def test_fit_validate_test_predict_on_three_stages(tmp_path) -> None:
    model = Classifier()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1)
    stopping = EarlyStopping(monitor="val_loss", patience=5)
    trainer = Trainer(
        accelerator="cpu",
        devices=3,
        strategy=PipeDreamStrategy(
            sync="async", balance=[2, 2, 1], microbatches=3, start_method="fork", timeout=60
        ),
        max_epochs=3,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        callbacks=[checkpoint, stopping],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data(), data(48))
    assert "val_acc" in trainer.callback_metrics
    assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").iterdir())
    best = checkpoint.best_model_path
    assert best and (tmp_path / "ckpt" / best.split("/")[-1] / "pipeline.json").is_file()
    assert 0.0 <= float(trainer.callback_metrics["val_acc"]) <= 1.0
    tested = trainer.test(model, data(48))
    assert tested[0]["test_acc"] > 0.5
    # Lightning returns no predictions from spawned processes; the script test checks them.
    trainer.predict(model, data(48), return_predictions=False)


class Handover(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        return {"x": x, "layer": self}


class HandsOverAModule(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.handover = Handover()

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.body[0], self.handover, nn.Identity())


def test_evaluation_names_the_layer_whose_output_cannot_cross() -> None:
    from pl_pipedream.runtime.executor import ExecutorError

    model = HandsOverAModule()
    plan = Plan.from_balance([2, 1])
    local = cut_stage(model, model.configure_pipeline(), plan, 0)
    pipe = EvaluationPipe(plan, local, channel=None, rank=0)  # type: ignore[arg-type]
    with pytest.raises(ExecutorError, match=r"\(layer 1: Handover, on rank 0 \(stage 0\), "):
        pipe.run(model, "validation_step", (torch.randn(4, 8), None), 0)


def _predict_seq2seq(rank: int, world: int) -> object:
    from pl_pipedream.runtime.channel import Channel
    from tests.runtime.test_boundary import seq2seq_batches
    from tests.strategy.fit_script import seq2seq_net

    class Predicting(type(seq2seq_net())):  # type: ignore[misc]
        def predict_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            tokens, _ = self.pipeline_split_batch(batch)
            return {"tokens": self(tokens).argmax(-1), "batch": batch_idx, "none": None}

    model = seq2seq_net()
    model.__class__ = Predicting
    (source, decoder_input), target = seq2seq_batches(2)[0]
    plan = Plan.from_balance([2, 2, 1])
    local = cut_stage(model, model.configure_pipeline(), plan, rank)
    pipe = EvaluationPipe(plan, local, Channel(rank, torch.device("cpu"), timeout=30.0), rank)
    result = pipe.run(model, "predict_step", (source, decoder_input, target), 7)
    predictions = pipe.predictions_to_every_rank(result, 7)
    pipe.channel.flush()  # sends do not wait for the peer; the strategy's teardown flushes too
    return predictions


@pytest.mark.slow
def test_structured_activations_and_predictions_cross_to_the_next_stage_and_every_rank() -> None:
    from tests.runtime.distributed import run
    from tests.runtime.test_boundary import seq2seq_batches
    from tests.strategy.fit_script import seq2seq_net

    results = run(3, _predict_seq2seq, timeout=120.0)
    assert all(status == "ok" for status, _ in results.values()), results
    (source, decoder_input), _ = seq2seq_batches(2)[0]
    expected = seq2seq_net()((source, decoder_input)).argmax(-1)
    for rank in range(3):  # every rank returns the predictions, not only rank 0
        got = results[rank][1]
        assert set(got) == {"tokens", "batch", "none"}, (rank, got)
        assert got["none"] is None and got["batch"] == 7
        assert torch.equal(got["tokens"], expected)


@pytest.mark.slow
def test_trainer_predict_returns_the_predictions_on_every_rank(tmp_path) -> None:
    """A popen run (as a user's script): after fit, ``trainer.predict`` returns on rank 1 the
    same list as on rank 0, each batch's logits equal to the trained model's on one device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.strategy.test_lightning_features import Net, loader

    script = Path(__file__).with_name("predict_script.py")
    result = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = [torch.load(tmp_path / f"predictions-{r}.pt", weights_only=False) for r in (0, 1)]
    states = [torch.load(tmp_path / f"stage-{r}.pt") for r in (0, 1)]
    one_device = Net(optimizer="sgd")
    one_device.load_state_dict({**states[0], **states[1]})
    batches = list(loader(2))
    for rank in (0, 1):
        assert len(got[rank]) == len(batches), (rank, got[rank])
        for index, ((x, _), prediction) in enumerate(zip(batches, got[rank], strict=True)):
            assert prediction["batch"] == index
            assert torch.allclose(prediction["logits"], one_device.net(x), atol=1e-6)
