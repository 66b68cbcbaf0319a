"""Every Lightning internal the strategy touches, checked against the installed Lightning: the
attribute each patch names is there, and the patch has its effect."""

from __future__ import annotations

import inspect

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import (
    _LoggerConnector,
)
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.core.errors import LightningChangedError
from pl_pipedream.strategy import lightning_patches as patches
from pl_pipedream.strategy.batches import shape_forward
from tests.runtime.distributed import run


def trainer(**kwargs) -> Trainer:  # type: ignore[no-untyped-def]
    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return Trainer(**{**settings, **kwargs})


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 3)
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.example_input_array = torch.ones(2, 4)

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.first, self.second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_require_names_the_missing_attribute_and_the_supported_versions() -> None:
    with pytest.raises(LightningChangedError) as error:
        patches._require(object(), "_gone", "_SomeLoop")
    assert "(_SomeLoop._gone); install lightning>=2.6,<2.7" in str(error.value)


def test_a_patch_checks_before_it_patches() -> None:
    with pytest.raises(LightningChangedError, match=r"\(object\.clip_grad_by_norm\)"):
        patches.clip_by_global_norm(object(), lambda optimizer, clip: None)


# ----- _TrainingEpochLoop._broadcast_sigterm_tensor ------------------------------------------


def test_lightning_broadcasts_sigterm_before_every_training_step() -> None:
    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    assert isinstance(inspect.getattr_static(Trainer, "received_sigterm"), property)


def test_each_rank_checks_its_own_sigterm_flag() -> None:
    run_trainer = trainer()
    patches.check_sigterm_per_rank(run_trainer)
    check = run_trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
    check()  # no flag: nothing happens, and no collective runs
    run_trainer._signal_connector.received_sigterm = True
    with pytest.raises(SIGTERMException):
        check()


# ----- Precision.clip_grad_by_norm --------------------------------------------------------------


def test_lightning_clips_norms_through_the_precision_plugin() -> None:
    assert hasattr(Precision, "clip_grad_by_norm")
    assert "self.clip_grad_by_norm(" in inspect.getsource(Precision.clip_gradients)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clip_by_global_norm_replaces_only_clipping_by_norm(algorithm: str) -> None:
    run_trainer = trainer(gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    model = Model()
    model.trainer = run_trainer
    calls = []
    patches.clip_by_global_norm(
        run_trainer.precision_plugin, lambda optimizer, clip: calls.append((optimizer, clip))
    )
    optimizer = model.configure_optimizers()
    model.first.weight.grad = torch.full_like(model.first.weight, 10.0)
    model.clip_gradients(optimizer)  # what configure_gradient_clipping does by default
    if algorithm == "norm":
        assert calls == [(optimizer, 0.5)]
        assert model.first.weight.grad.max() == 10.0  # Lightning's own clipping did not run
    else:
        assert calls == []
        assert model.first.weight.grad.max() == 0.5


# ----- LightningModule.forward for the model summary -------------------------------------------


def test_the_summary_runs_forward_on_the_example_input_with_other_stages_on_meta() -> None:
    model = Model()
    model.second.to("meta")  # another stage's layer
    with pytest.raises(RuntimeError, match="meta"):
        ModelSummary(model)
    patches.summary_forward(model, shape_forward(model.configure_pipeline()))
    summary = ModelSummary(model)
    assert summary.layer_names[:2] == ["first", "second"]
    assert summary.out_sizes[:2] == [[2, 8], [2, 3]]


# ----- torchmetrics' Metric.sync_on_compute ----------------------------------------------------


def test_stop_metric_sync_turns_off_every_metrics_gather() -> None:
    model = Model()
    assert model.accuracy.sync_on_compute is True
    patches.stop_metric_sync(model)
    assert model.accuracy.sync_on_compute is False
    assert "sync_on_compute" not in vars(model.first)


# ----- _AcceleratorConnector.use_distributed_sampler ------------------------------------------


def test_lightning_decides_on_a_distributed_sampler_from_the_accelerator_connector() -> None:
    source = inspect.getsource(_DataConnector._requires_distributed_sampler)
    assert "self.trainer._accelerator_connector.use_distributed_sampler" in source
    assert "_requires_distributed_sampler(dataloader)" in inspect.getsource(
        _DataConnector._prepare_dataloader
    )


def test_keep_user_samplers_stops_lightning_from_injecting_a_distributed_sampler() -> None:
    run_trainer = trainer()
    connector = run_trainer._accelerator_connector
    assert connector.use_distributed_sampler is True
    patches.keep_user_samplers(run_trainer)
    assert connector.use_distributed_sampler is False
    loader = DataLoader(TensorDataset(torch.zeros(4, 4)), shuffle=False)
    assert run_trainer._data_connector._requires_distributed_sampler(loader) is False
    with pytest.raises(LightningChangedError, match="_AcceleratorConnector"):
        patches.keep_user_samplers(type("T", (), {"_accelerator_connector": object()})())


# ----- _FitLoop._data_source, and the public trainer.is_last_batch ----------------------------


class Record(Callback):
    """What the strategy reads, where it reads it: at setup, and in each training step."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.first_batch = patches.first_training_batch(trainer)
        self.last = []

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        self.last.append(trainer.is_last_batch)


def test_lightning_keeps_the_data_source_on_the_fit_loop() -> None:
    fit_loop = trainer().fit_loop
    assert isinstance(fit_loop, _FitLoop) and "_data_source" in vars(fit_loop)
    assert trainer().is_last_batch is False


def test_outside_fit_there_is_no_first_training_batch() -> None:
    assert patches.first_training_batch(trainer()) is None


def test_while_fitting_the_first_batch_and_the_epochs_last_step_are_known(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = torch.arange(24.0).reshape(6, 4)
    data = DataLoader(TensorDataset(x, torch.zeros(6)), batch_size=2)
    record = Record()
    trainer(max_epochs=1, callbacks=[record], default_root_dir=tmp_path).fit(Model(), data)
    assert torch.equal(record.first_batch[0], x[:2])
    assert record.last == [False, False, True]


# ----- _LoggerConnector.update_eval_epoch_metrics, over two ranks ------------------------------


def test_lightning_updates_the_eval_metrics_stores_behind_its_properties() -> None:
    for name in ("callback_metrics", "progress_bar_metrics", "logged_metrics"):
        assert isinstance(inspect.getattr_static(_LoggerConnector, name), property)
        assert f"_{name}" in vars(trainer()._logger_connector)
    assert hasattr(_LoggerConnector, "update_eval_epoch_metrics")


class Logs(Model):
    """Rank ``r`` logs ``r``; a metric sees ``r`` too."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.mean = torchmetrics.MeanMetric()

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val_rank", float(self.rank), prog_bar=True)


def _evaluate_on_two_ranks(rank: int, world: int) -> dict:
    out = {}
    model = Logs(rank)
    value = torch.tensor(float(rank))
    model.mean.update(value)
    out["synced mean"] = model.mean.compute().item()
    patches.stop_metric_sync(model)  # at setup, before any step
    model.mean.reset()
    model.mean.update(value)  # update only: self.metric.update(preds, target) in a step
    out["mean after update"] = model.mean.compute().item()
    model.mean.reset()
    model.mean(value)  # forward: self.metric(preds, target) in a step
    out["mean after forward"] = model.mean.compute().item()

    run_trainer = trainer()
    calls = []
    # an earlier pipeline's patch (a re-plan's old one): replaced, not wrapped
    patches.share_evaluation_metrics(run_trainer, 0, lambda: calls.append("old pipeline"))
    patches.share_evaluation_metrics(run_trainer, 1, lambda: calls.append("before"))
    data = DataLoader(TensorDataset(torch.zeros(4, 4)), batch_size=2)
    out["returned"] = run_trainer.validate(model, data, verbose=False)
    out["callback"] = {k: float(v) for k, v in run_trainer.callback_metrics.items()}
    out["progress bar"] = {k: float(v) for k, v in run_trainer.progress_bar_metrics.items()}
    out["logged"] = {k: float(v) for k, v in run_trainer.logged_metrics.items()}
    out["before"] = calls
    return out


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, dict]:
    """One spawn of two ranks that import Lightning (about 5 s) for the tests below."""
    results = run(2, _evaluate_on_two_ranks, timeout=90.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    return {rank: value for rank, (_, value) in results.items()}


@pytest.mark.slow
def test_every_rank_adopts_the_source_ranks_evaluation_metrics(two_ranks) -> None:  # type: ignore[no-untyped-def]
    for value in two_ranks.values():
        assert value["returned"] == [{"val_rank": 1.0}]
        assert value["callback"] == value["progress bar"] == value["logged"] == {"val_rank": 1.0}
    # before() and the broadcast run as often on every rank (at each evaluation epoch's end)
    assert two_ranks[0]["before"] == two_ranks[1]["before"] != []
    assert set(two_ranks[0]["before"]) == {"before"}  # the patch of the pipeline in use only


@pytest.mark.slow
def test_a_metric_called_after_stop_metric_sync_computes_locally(two_ranks) -> None:  # type: ignore[no-untyped-def]
    for rank, value in two_ranks.items():
        assert value["synced mean"] == 0.5  # torchmetrics gathers over the ranks by default
        assert value["mean after forward"] == float(rank)


@pytest.mark.slow
def test_a_metric_updated_after_stop_metric_sync_computes_locally(two_ranks) -> None:  # type: ignore[no-untyped-def]
    for rank, value in two_ranks.items():
        assert value["mean after update"] == float(rank)


# ----- _ResultCollection.update_metrics: the per-step training loss ---------------------------


class StepLogged(Model):
    """Logs ``100 * epoch + batch_idx`` as ``train_loss`` through ``log_step_value`` and counts
    the calls that reach ``LightningModule.log``."""

    def __init__(self) -> None:
        super().__init__()
        self.full_logs = 0

    def log(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.full_logs += 1
        super().log(*args, **kwargs)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        value = torch.tensor(100.0 * self.current_epoch + batch_idx)
        patches.log_step_value(self, "train_loss", value)
        return self(batch[0]).sum()


class Logged(Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        self.seen.append(float(trainer.callback_metrics["train_loss"]))


def test_log_step_value_logs_every_step_through_lightning_once_per_epoch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = DataLoader(TensorDataset(torch.ones(8, 4), torch.zeros(8)), batch_size=2)
    model, logged = StepLogged(), Logged()
    trainer(max_epochs=2, callbacks=[logged], default_root_dir=tmp_path).fit(model, data)
    # every step's value reaches the callback metrics (the progress bar's and loggers' source)
    assert logged.seen == [0.0, 1.0, 2.0, 3.0, 100.0, 101.0, 102.0, 103.0]
    # LightningModule.log registers the metric at each epoch's first step; the rest update it
    assert model.full_logs == 2


def test_layer_sync_reads_what_sync_batchnorm_sets() -> None:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    synced = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", sync_batchnorm=True)
    assert isinstance(patches.layer_sync(synced.strategy), TorchSyncBatchNorm)
    plain = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn")
    assert patches.layer_sync(plain.strategy) is None


def test_capture_logs_sees_every_log_and_log_dict_call_then_puts_log_back() -> None:
    model = LightningModule()
    seen: list = []
    record = lambda name, value, **options: seen.append((name, value, options["prog_bar"]))  # noqa: E731
    with patches.capture_logs(model, record):
        model.log("a", 1.0, prog_bar=False)
        model.log_dict({"b": 2.0, "c": 3.0}, prog_bar=True)  # Lightning's log_dict calls log
    assert seen == [("a", 1.0, False), ("b", 2.0, True), ("c", 3.0, True)]
    assert "log" not in model.__dict__


# ----- internals with a public replacement stay out of the package ------------------------------

REPLACED = (
    "_after_closure",  # the precision plugin's post_backward and optimizer_step (updates.py)
    "_call_callback_hooks",
    "_call_lightning_module_hook",
    "_init_dist_connection",  # torch.distributed.init_process_group (core/placement.py)
    "_set_num_threads_if_needed",  # core/placement.share_threads
    "_hydra_subprocess_cmd",  # Hydra's HydraConfig (strategy/launcher.py)
    "._trainer",  # LightningModule.trainer
)


def test_no_module_uses_a_lightning_internal_that_has_a_public_replacement() -> None:
    from pathlib import Path

    package = Path(patches.__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        used = [name for name in REPLACED if name in source]
        assert not used, f"{path.relative_to(package)} uses {used}"


# ----- _CheckpointConnector._loaded_checkpoint -------------------------------------------------


def test_the_resumed_checkpoint_s_weights_are_readable_at_setup(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = DataLoader(TensorDataset(torch.ones(4, 4), torch.zeros(4)), batch_size=2)
    first = trainer(max_steps=1, default_root_dir=tmp_path)
    first.fit(Model(), data)
    first.save_checkpoint(tmp_path / "one.ckpt")
    assert patches.resumed_state_dict(first) is None  # released after the restore
    # Lightning's fit calls resume_start before the strategy's setup, resume_end after.
    fresh = trainer(max_steps=2, default_root_dir=tmp_path)
    fresh._checkpoint_connector.resume_start(tmp_path / "one.ckpt")
    state = patches.resumed_state_dict(fresh)
    assert state is not None and torch.equal(state["first.weight"], first.model.first.weight)
    assert patches.resumed_state_dict(trainer()) is None
