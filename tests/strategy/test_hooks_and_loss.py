"""Lightning's hooks and the logged ``train_loss`` under every sync mode, recorded on real ranks.

One launch of two gloo ranks fits a recording LightningModule once per mode (Lightning sees the
ranks as started by a launcher, so it starts none); a second launch of three ranks fits a plan
whose last stage has two replicas. The hooks each rank ran, how often, and whether the local
stage's ``.grad`` was set, must match the table in docs/lightning-hooks.md; every rank must log
the same ``train_loss``, the mean over a whole batch (one device's loss of that batch in the flushed
modes), and never NaN.
"""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.planner.plan import Plan
from tests.runtime.distributed import run
from tests.runtime.test_executor import MODES, NUM_BATCHES, make_batches
from tests.strategy.test_lightning_features import Net

pytestmark = pytest.mark.slow  # two launches (2 and 3 ranks), about 25 s together

M = 4  # microbatches
HOOKS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "lightning-hooks.md"
GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "training_step",
    "on_before_zero_grad",
    "on_before_backward",
    *GRAD_HOOKS,
    "optimizer_step",
    "lr_scheduler_step",
)


class Recording(Net):
    """``Net`` that counts its hooks and notes, for the hooks of gradient work, whether every
    parameter of this rank's stage has its ``.grad`` set; and logs a gradient norm."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", schedule=True)
        self.counts: dict[str, int] = {}
        self.grads: dict[str, list[bool]] = {}

    def _note(self, hook: str) -> None:
        self.counts[hook] = self.counts.get(hook, 0) + 1
        if hook in GRAD_HOOKS:
            local = [p for p in self.parameters() if p.device.type != "meta"]
            self.grads.setdefault(hook, []).append(all(p.grad is not None for p in local))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._note("training_step")
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._note("on_train_batch_start")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._note("on_train_batch_end")

    def on_before_zero_grad(self, optimizer) -> None:  # type: ignore[no-untyped-def]
        self._note("on_before_zero_grad")

    def on_before_backward(self, loss) -> None:  # type: ignore[no-untyped-def]
        self._note("on_before_backward")

    def on_after_backward(self) -> None:
        self._note("on_after_backward")

    def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
        self._note("on_before_optimizer_step")
        local = [p.grad for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.stack([g.norm() for g in local]).norm())

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):  # type: ignore[no-untyped-def]
        self._note("configure_gradient_clipping")

    def optimizer_step(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._note("optimizer_step")
        super().optimizer_step(*args, **kwargs)

    def lr_scheduler_step(self, scheduler, metric) -> None:  # type: ignore[no-untyped-def]
        self._note("lr_scheduler_step")
        super().lr_scheduler_step(scheduler, metric)


class BatchNormNet(Net):
    """A Linear, a BatchNorm1d and a Linear: BatchNorm normalises each microbatch on its own."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def loader(batch_size: int) -> DataLoader:
    batches = make_batches(M)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class LossPerStep(Recording):
    """Also keeps ``train_loss`` as this rank's Lightning logged it after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float | None] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        super().on_train_batch_end(outputs, batch, batch_idx)
        value = self.trainer.callback_metrics.get("train_loss")
        self.losses.append(None if value is None else float(value))


def fit(  # type: ignore[no-untyped-def]
    model, strategy, devices: int, out: Path | None = None, batch_size: int = 2 * M, **kwargs
) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy or "auto",
        max_epochs=1,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(str(out)) if out is not None else False,
        log_every_n_steps=1,
        **kwargs,
    )
    trainer.fit(model, loader(batch_size))
    return trainer


def _as_launched(rank: int, world: int) -> None:
    """Tell Lightning that a launcher started this rank (so it starts no process)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))


def _every_mode(rank: int, world: int, out: str) -> dict:
    _as_launched(rank, world)
    results = {}
    for sync in MODES:
        model = LossPerStep()
        strategy = PipeDreamStrategy(sync=sync, balance=[3, 3], microbatches=M, timeout=60)
        fit(model, strategy, world, Path(out) / sync)
        results[sync] = {"counts": model.counts, "grads": model.grads, "losses": model.losses}
    model = BatchNormNet()
    strategy = PipeDreamStrategy(sync="flush", balance=[2, 2], microbatches=M, timeout=60)
    fit(model, strategy, world)
    results["batchnorm"] = {
        k: v.detach().clone() for k, v in model.state_dict().items() if v.device.type != "meta"
    }
    return results


def _replicated(rank: int, world: int) -> dict:
    """``flush`` with the last stage replicated twice, then ``async`` with the first stage so."""
    _as_launched(rank, world)
    out = {}
    for sync, replicas in (("flush", [1, 2]), ("async", [2, 1])):
        model = LossPerStep()
        plan = Plan.from_balance([3, 3], replicas=replicas)
        fit(model, PipeDreamStrategy(sync=sync, plan=plan, microbatches=M, timeout=60), world)
        out[sync, tuple(replicas)] = model.losses
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("hooks")
    results = run(2, _every_mode, str(out), timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    got = {rank: value for rank, (_, value) in results.items()}
    got[0]["csv"] = str(out)
    return got


def single_device_losses() -> list[float]:
    """The loss of each batch as one device computes it (the full batch at once)."""
    model = Recording()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    losses: list[float] = []
    model.on_train_batch_end = lambda outputs, batch, idx: losses.append(float(outputs["loss"]))
    trainer.fit(model, loader(2 * M))
    return losses


# ----- the hook table ----------------------------------------------------------------------------


def readme_hook_table() -> dict[str, dict[str, str]]:
    """docs/lightning-hooks.md's table: {hook: {mode: cell}}, from the rows after the header
    naming the modes."""
    text = HOOKS_PAGE.read_text()
    start = text.index("| hook |")
    lines = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        lines.append(line)
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    columns = [re.findall(r"`([^`]+)`", cell) for cell in header[1:]]
    table: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for hook in re.findall(r"`([^`]+)`", cells[0]):
            pairs = zip(columns, cells[1:], strict=True)
            table[hook] = {mode: cell for modes, cell in pairs for mode in modes}
    return table


def expected_count(cell: str, sync: str, rank: int) -> int:
    """What a table cell means for one rank of the 2-stage runs (rank 1 is the last stage)."""
    updates = NUM_BATCHES * M if sync in ("async", "vertical_sync") else NUM_BATCHES
    if cell.startswith("never"):
        return 0
    if cell.startswith("each batch"):
        return NUM_BATCHES
    if cell.startswith("each update"):
        return updates
    if cell.startswith("each microbatch, last stage"):
        return NUM_BATCHES * M if rank == 1 else 0
    raise AssertionError(f"docs/lightning-hooks.md: unknown cell {cell!r}")


def test_the_readme_hook_table_names_every_recorded_hook() -> None:
    table = readme_hook_table()
    assert set(HOOKS) <= set(table), sorted(set(HOOKS) - set(table))
    assert all(set(row) == set(MODES) for row in table.values())


@pytest.mark.parametrize("sync", MODES)
def test_hooks_fire_as_the_readme_table_says(ranks, sync: str) -> None:  # type: ignore[no-untyped-def]
    table = readme_hook_table()
    for rank in (0, 1):
        got = ranks[rank][sync]
        for hook, row in table.items():
            cell = row[sync]
            count = got["counts"].get(hook, 0)
            assert count == expected_count(cell, sync, rank), f"rank {rank} {hook}: {count}"
            if ".grad set" in cell:
                assert got["grads"][hook] and all(got["grads"][hook]), f"rank {rank} {hook}"


# ----- train_loss --------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", MODES)
def test_every_rank_logs_the_same_train_loss_and_never_nan(ranks, sync: str) -> None:  # type: ignore[no-untyped-def]
    logged = [ranks[rank][sync]["losses"] for rank in (0, 1)]
    assert logged[0] == logged[1]
    assert logged[0][-1] is not None  # the drain at the epoch's end finished the last batch
    with open(next((Path(ranks[0]["csv"]) / sync).rglob("metrics.csv"))) as file:
        column = [row["train_loss"] for row in csv.DictReader(file) if row.get("train_loss")]
    assert column and all(math.isfinite(float(value)) for value in column)


@pytest.mark.parametrize("sync", ["flush", "gpipe"])
def test_flushed_modes_log_one_devices_batch_loss_on_every_rank(ranks, sync: str) -> None:  # type: ignore[no-untyped-def]
    expected = single_device_losses()
    for rank in (0, 1):
        assert ranks[rank][sync]["losses"] == pytest.approx(expected, abs=1e-6), f"rank {rank}"


def test_replicated_stages_log_the_whole_batchs_mean_on_every_rank() -> None:
    results = run(3, _replicated, timeout=180.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    expected = single_device_losses()
    for rank in range(3):
        got = results[rank][1]["flush", (1, 2)]
        assert got == pytest.approx(expected, abs=1e-6), f"rank {rank}"
    logged = [results[rank][1]["async", (2, 1)] for rank in range(3)]
    assert logged[0] == logged[1] == logged[2]
    assert logged[0][-1] is not None


# ----- BatchNorm ---------------------------------------------------------------------------------


def test_batchnorm_in_flush_equals_one_device_on_microbatches_with_accumulation(ranks) -> None:  # type: ignore[no-untyped-def]
    """GPipe's semantics: each microbatch is normalised on its own, so ``flush`` with ``M``
    microbatches equals one device on batches of ``batch / M`` with ``accumulate_grad_batches=M``
    (running statistics included), and not one device on the whole batch."""
    small = BatchNormNet()
    fit(small, None, 1, accumulate_grad_batches=M, batch_size=2)
    whole = BatchNormNet()
    fit(whole, None, 1)
    got = ranks[0]["batchnorm"]
    for key, tensor in small.state_dict().items():
        if key.startswith("net.0") or key.startswith("net.1"):  # rank 0's stage
            assert torch.allclose(got[key].float(), tensor.float(), atol=1e-6), key
    differs = max(
        (got[k].float() - v.float()).abs().max().item()
        for k, v in whole.state_dict().items()
        if k.startswith("net.0.") and "num_batches" not in k
    )
    assert differs > 1e-4
