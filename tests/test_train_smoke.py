"""Smoke runs of the paper's seven models through ``pl-pipedream-train`` and the strategy.

Each test runs the Hydra app as a user would (a subprocess that starts a second rank: 2 CPU
processes over gloo) with ``smoke=true`` and the reduced settings a recipe would carry in its
``smoke_settings`` block, given here as ``++smoke_settings.*`` overrides: a small width, small
inputs, a few steps, and a straight pipeline of two stages (``strategy.balance``), each model
on the cluster of one of its Table 1 rows (2 processes fit on one of its servers; with a balance
given the strategy does not plan, so the cluster only meets the machine check). Each run must
give a finite loss, a plan of two stages, and a ``results.json`` that holds the metrics the app
printed and the merged settings.

The data exists in the app for six models (``synthetic`` images, ``sequences``, ``text``); S2VT
reads video (frame features and captions), for which this file writes a small generated data
module and a data config beside it (``VideoDataModule``, ``--config-dir``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

from tests.test_train import run_app

COMMON = (
    "smoke=true",
    "++smoke_settings.trainer.max_epochs=1",
    "++smoke_settings.trainer.max_steps=3",
    "++smoke_settings.trainer.limit_val_batches=1",
    "++smoke_settings.trainer.enable_progress_bar=false",
    "++smoke_settings.data.batch_size=16",
)
# model config: (data config, the model's and data's reduced settings, then a straight split in
# two: at this size the planner may well choose one replicated stage, which is not what is tested)
RUNS = {
    "vgg16": (
        "synthetic",
        ("model.width=16", "data.input_shape=[3,32,32]", "strategy.balance=[20,20]"),
    ),
    "alexnet": (
        "synthetic",
        ("model.width=16", "data.input_shape=[3,64,64]", "strategy.balance=[11,11]"),
    ),
    "resnet50": (
        "synthetic",
        ("model.width=16", "data.input_shape=[3,32,32]", "strategy.balance=[9,9]"),
    ),
    "gnmt8": ("sequences", ("model.scale=64", "strategy.balance=[5,6]")),
    "gnmt16": ("sequences", ("model.scale=64", "strategy.balance=[9,10]")),
    "awd_lm": ("text", ("model.scale=50", "strategy.balance=[2,3]")),  # the tie crosses the cut
    "s2vt": ("video", ("model.scale=50", "model.caption_length=6", "strategy.balance=[2,2]")),
}
# each model on a cluster of one of its Table 1 rows, which 2 processes on one node fit
CLUSTERS = {"gnmt8": "cluster_b", "s2vt": "cluster_c"}  # the others: cluster_a


class VideoDataModule(LightningDataModule):
    """Generated videos: ``frames`` feature vectors per video and a caption of ``length`` tokens
    (token 0 pads, token 1 starts the caption's input), the same on every rank."""

    data_kind = "video"

    def __init__(
        self,
        num_examples: int = 128,
        frames: int = 8,
        feature_size: int = 32,
        vocab: int = 20,
        length: int = 6,
        batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.input_shape = (frames, feature_size)
        self.num_classes = vocab
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(num_examples, frames, feature_size, generator=generator)
        target = torch.randint(2, vocab, (num_examples, length), generator=generator)
        caption_input = torch.cat(
            [torch.ones(num_examples, 1, dtype=torch.long), target[:, :-1]], 1
        )
        self.dataset = TensorDataset(features, caption_input, target)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


def write_video_config(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "video.yaml").write_text(
        "_target_: tests.test_train_smoke.VideoDataModule\nbatch_size: 16\nseed: ${seed}\n"
    )
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("model", list(RUNS))
def test_smoke_run_trains_the_model_on_two_stages_and_writes_its_results(
    model: str, tmp_path: Path
) -> None:
    data, settings = RUNS[model]
    run_dir = tmp_path / "run"
    extra = [f"--config-dir={write_video_config(tmp_path / 'configs')}"] if data == "video" else []
    done = run_app(
        *extra,
        f"model={model}",
        f"data={data}",
        f"cluster={CLUSTERS.get(model, 'cluster_a')}",
        *COMMON,
        *(f"++smoke_settings.{setting}" for setting in settings),
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    results = json.loads((run_dir / "results.json").read_text())
    metrics = results["metrics"]
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["val_loss"])
    printed = next(line for line in output.splitlines() if "Final metrics:" in line)
    assert f"val_loss={metrics['val_loss']:.4f}" in printed
    assert results["plan"]["stages"] == 2
    balance = next(s for s in settings if s.startswith("strategy.balance="))
    assert results["plan"]["balance"] == json.loads(balance.split("=")[1])
    assert results["config"]["smoke"] is True
    assert results["config"]["trainer"]["max_steps"] == 3  # the smoke settings were merged
    name, value = settings[0].split("=")
    assert str(results["config"]["model"][name.split(".")[1]]) == value
