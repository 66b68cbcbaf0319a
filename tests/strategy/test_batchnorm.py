"""BatchNorm through PipeDreamStrategy: a replicated stage's running statistics, in the weights
Lightning returns, in evaluation and in checkpoints, equal one device's that runs the same
microbatches one after another (gradient accumulation); ``sync_batchnorm=True`` is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy, consolidate_checkpoint
from pl_pipedream.planner.plan import Plan
from tests.runtime.test_running_stats import loss_fn, make_batches, make_model

MICROBATCHES = 2
PLAN = Plan.from_balance([3, 3], replicas=[2, 1])  # each replica of stage 0: one microbatch


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()  # Linear, BatchNorm1d, Tanh | Linear, BatchNorm1d(None), Linear

    def configure_pipeline(self) -> torch.nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return loss_fn(self(x), y)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", loss_fn(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(batch_size: int) -> DataLoader:
    batches = make_batches(MICROBATCHES)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def trainer(**kwargs) -> Trainer:  # type: ignore[no-untyped-def]
    settings = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "use_distributed_sampler": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": "callbacks" in kwargs,
    }
    return Trainer(**{**settings, **kwargs})


def test_sync_batchnorm_is_refused_naming_the_fix() -> None:
    strategy = PipeDreamStrategy(sync="flush", plan=PLAN, start_method="fork")
    with pytest.raises(ValueError, match=r"sync_batchnorm: True.*Trainer\(sync_batchnorm=False\)"):
        trainer(devices=3, strategy=strategy, sync_batchnorm=True)


@pytest.mark.slow
def test_replicated_batchnorm_equals_one_device_in_weights_evaluation_and_checkpoint(
    tmp_path: Path,
) -> None:
    microbatch = len(make_batches(MICROBATCHES)[0][0]) // MICROBATCHES
    reference = Net()
    one = trainer(devices=1, accumulate_grad_batches=MICROBATCHES)
    one.fit(reference, loader(microbatch), loader(microbatch))
    expected = {k: v.clone() for k, v in reference.state_dict().items()}

    pipelined = Net()
    strategy = PipeDreamStrategy(
        sync="flush", plan=PLAN, microbatches=MICROBATCHES, start_method="fork", timeout=60
    )
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run = trainer(devices=3, strategy=strategy, callbacks=[saver])
    run.fit(pipelined, loader(microbatch * MICROBATCHES), loader(microbatch))
    saved = consolidate_checkpoint(tmp_path / "last.ckpt")
    worst = {"weights": 0.0, "buffers": 0.0}
    for got, source in ((pipelined.state_dict(), "returned"), (saved, "checkpoint")):
        for key, tensor in expected.items():
            diff = (got[key].double() - tensor.double()).abs().max().item()
            kind = "weights" if key.endswith(("weight", "bias")) else "buffers"
            worst[kind] = max(worst[kind], diff)
            assert diff <= 1e-5, f"{source} {key}: {diff}"
    print(f"largest difference from one device: {worst}")
    assert int(saved["net.1.num_batches_tracked"]) == int(expected["net.1.num_batches_tracked"])
    val_one = float(one.callback_metrics["val_loss"])  # evaluation on the running statistics
    val_pipe = float(run.callback_metrics["val_loss"])
    assert abs(val_one - val_pipe) <= 1e-5, (val_one, val_pipe)
    print(f"validation loss: one device {val_one:.7f}, pipeline {val_pipe:.7f}")
