"""Lightning's precision flags through the pipeline: each stage computes as one device would.

``flush`` on two CPU ranks against one device with the same flag: ``bf16-mixed`` (autocast
around every forward, the loss and evaluation; recomputed forwards too), the true precisions
(the stage's layers converted), and ``16-mixed`` (CPU fp16 autocast with a CPU ``GradScaler``:
one loss scale for the pipeline, evolving step by step as one device's). The flags the strategy
cannot honour stop at setup.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.utils.data import DataLoader

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.precision import (
    check_optimizers,
    check_precision,
    share_found_inf,
    stage_precision,
)
from tests.runtime.distributed import run
from tests.runtime.test_executor import loss_fn
from tests.strategy.test_lightning_features import Net, loader, trainer

BF16_TOLERANCE = 0.0  # measured: bit-identical; fp32 and bf16-mixed differ by 1.3e-3
TRUE_TOLERANCE = 0.0  # measured: bit-identical
FP16_TOLERANCE = 0.0  # measured: bit-identical, the scale's history equal step by step


class EvaluatedNet(Net):
    """``Net`` with a validation loss, so evaluation runs in the precision's context too."""

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = loss_fn(self(x), y)
        self.log("val_loss", loss)
        return loss


class SaveStage(Callback):
    """Writes the tensors this rank holds (its stage's, as trained) to ``stage-rank{r}.pt``:
    the spawn launcher hands the parent rank 0's weights loaded into the parent's unconverted
    module, so the stages' own dtypes and values are read from here."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        state = {k: t for k, t in pl_module.state_dict().items() if t.device.type != "meta"}
        torch.save(state, self.out / f"stage-rank{trainer.global_rank}.pt")


def fit_and_validate(  # type: ignore[no-untyped-def]
    out: Path,
    precision: str = "32-true",
    plugins=(),
    extra_callbacks=(),
    accumulate: int = 1,
    gpu: bool = False,
    launched: bool = False,
    **strategy_settings,
):
    """The weights after a fit of ``EvaluatedNet`` (SGD), in the dtype they were trained in,
    and the validation loss at the end of its epoch. Without ``strategy_settings``: one device,
    accumulating the gradients of ``accumulate`` slices of each batch (what a pipeline of as
    many microbatches computes); else a two-stage pipeline (spawn; one microbatch per batch
    unless ``microbatches`` is given). With ``gpu``, on CUDA: the two ranks on two GPUs, or
    both on the one GPU there is (over gloo: NCCL refuses two ranks on one device). With
    ``launched``, this process is already one of the two ranks (``pipelines``): the weights are
    this rank's stage's alone."""
    out.mkdir(parents=True, exist_ok=True)
    model = EvaluatedNet(optimizer="sgd")
    settings = {"plugins": list(plugins)} if plugins else {"precision": precision}
    settings["accelerator"] = "gpu" if gpu else "cpu"
    devices = 2
    if strategy_settings and gpu and torch.cuda.device_count() < 2:
        one = torch.device("cuda", 0)
        strategy_settings = {**strategy_settings, "parallel_devices": [one, one]}
        strategy_settings["process_group_backend"] = "gloo"
        devices = 1
    if not strategy_settings:
        run = trainer(
            devices=1,
            callbacks=list(extra_callbacks),
            enable_checkpointing=False,
            accumulate_grad_batches=accumulate,
            **settings,
        )
        slices = DataLoader(loader(2).dataset, batch_size=4 // accumulate, shuffle=False)
        run.fit(model, slices, loader(2))
        return model.state_dict(), float(run.callback_metrics["val_loss"])
    launcher = {} if launched else {"start_method": "spawn"}
    strategy = PipeDreamStrategy(balance=[3, 3], timeout=120, **launcher, **strategy_settings)
    callbacks = [SaveStage(out), *extra_callbacks]
    run = trainer(
        devices=devices,
        strategy=strategy,
        callbacks=callbacks,
        enable_checkpointing=False,
        **settings,
    )
    run.fit(model, loader(2), loader(2))  # validated in the ranks, at the end of the epoch
    val_loss = float(run.callback_metrics["val_loss"])
    if launched:
        return torch.load(out / f"stage-rank{run.global_rank}.pt"), val_loss
    stages = [torch.load(out / f"stage-rank{rank}.pt") for rank in (0, 1)]
    return {k: t for stage in stages for k, t in stage.items()}, val_loss


def largest_difference(got: dict, expected: dict) -> float:
    return max(
        (got[k].double().cpu() - v.double().cpu()).abs().max().item() for k, v in expected.items()
    )


# Every two-rank pipeline the slow tests below compare, trained in turn in one launch of two
# ranks (``pipelines``): name -> (precision, or "16-mixed-scaled" for ``fp16_plugin``, strategy).
PIPELINES = {
    **{
        f"bf16-mixed-m{m}{'-recompute' if recompute else ''}": (
            "bf16-mixed",
            {"sync": "flush", "microbatches": m, "recompute": recompute},
        )
        for m, recompute in ((1, False), (2, False), (2, True))
    },
    **{
        precision: (precision, {"sync": "flush"})
        for precision in ("bf16-true", "16-true", "64-true")
    },
    "async-32-true": ("32-true", {"sync": "async", "microbatches": 2}),
    "async-bf16-mixed": ("bf16-mixed", {"sync": "async", "microbatches": 2}),
    **{f"16-mixed-m{m}": ("16-mixed-scaled", {"sync": "flush", "microbatches": m}) for m in (1, 2)},
}


def _every_pipeline(rank: int, world: int, out: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    results = {}
    for name, (precision, settings) in PIPELINES.items():
        folder = Path(out) / name
        if precision == "16-mixed-scaled":
            scaled = {"plugins": [fp16_plugin()], "extra_callbacks": [RecordScale(folder)]}
            results[name] = fit_and_validate(folder, launched=True, **scaled, **settings)
        else:
            results[name] = fit_and_validate(folder, precision, launched=True, **settings)
    return results


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, float, Path]]:
    """name -> (both stages' weights, rank 0's validation loss, the run's folder)."""
    out = tmp_path_factory.mktemp("precision")
    results = run(2, _every_pipeline, str(out), timeout=900.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    first, second = results[0][1], results[1][1]
    return {
        name: ({**first[name][0], **second[name][0]}, first[name][1], out / name)
        for name in PIPELINES
    }


@pytest.mark.slow
@pytest.mark.parametrize(("microbatches", "recompute"), [(1, False), (2, False), (2, True)])
def test_flush_bf16_mixed_equals_one_device_and_differs_from_fp32(
    tmp_path: Path, pipelines: dict, microbatches: int, recompute: bool
) -> None:
    one = tmp_path / "one"
    reference, reference_val = fit_and_validate(one, "bf16-mixed", accumulate=microbatches)
    fp32, _ = fit_and_validate(tmp_path / "fp32", "32-true", accumulate=microbatches)
    got, val, _ = pipelines[f"bf16-mixed-m{microbatches}{'-recompute' if recompute else ''}"]
    assert largest_difference(got, reference) <= BF16_TOLERANCE
    assert abs(val - reference_val) <= BF16_TOLERANCE
    assert largest_difference(got, fp32) > 1e-3  # the flag is not ignored
    assert all(t.dtype == torch.float32 for t in got.values())  # fp32 master weights


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("64-true", torch.float64)],
)
def test_flush_true_precision_equals_one_device(
    tmp_path: Path, pipelines: dict, precision: str, dtype: torch.dtype
) -> None:
    reference, reference_val = fit_and_validate(tmp_path / "one", precision)
    got, val, _ = pipelines[precision]
    assert all(t.dtype == dtype for t in got.values())
    assert largest_difference(got, reference) <= TRUE_TOLERANCE
    assert abs(val - reference_val) <= TRUE_TOLERANCE


@pytest.mark.slow
def test_async_bf16_mixed_runs_its_forwards_in_autocast(pipelines: dict) -> None:
    fp32, got = pipelines["async-32-true"][0], pipelines["async-bf16-mixed"][0]
    assert largest_difference(got, fp32) > 1e-3
    assert all(t.dtype == torch.float32 for t in got.values())


class RecordScale(Callback):
    """Writes the loss scale after every step to ``scale-rank{r}.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        path = self.out / f"scale-rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.scales))


def fp16_plugin(device: str = "cpu") -> MixedPrecision:
    """fp16 autocast, with a scale that overflows at first, then grows."""
    scaler = torch.amp.GradScaler(device, init_scale=2.0**17, growth_interval=2)
    return MixedPrecision("16-mixed", device, scaler=scaler)


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
def test_flush_16_mixed_has_one_loss_scale_that_evolves_as_one_devices(
    tmp_path: Path, pipelines: dict, microbatches: int
) -> None:
    one = tmp_path / "one"
    reference, _ = fit_and_validate(
        one, plugins=[fp16_plugin()], extra_callbacks=[RecordScale(one)], accumulate=microbatches
    )
    got, _, pipe = pipelines[f"16-mixed-m{microbatches}"]
    per_batch = json.loads((one / "scale-rank0.json").read_text())
    expected = per_batch[microbatches - 1 :: microbatches]  # after each optimizer step
    assert min(expected) < 2.0**17 and max(expected) > min(expected)  # skipped, and grew
    for rank in (0, 1):
        assert json.loads((pipe / f"scale-rank{rank}.json").read_text()) == expected
    fp32, _ = fit_and_validate(tmp_path / "fp32", "32-true", accumulate=microbatches)
    assert largest_difference(got, reference) <= FP16_TOLERANCE
    assert largest_difference(got, fp32) > 1e-4
    assert all(t.dtype == torch.float32 for t in got.values())


def _found_inf_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 alone has an inf gradient; both must skip the step and back off alike."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        layer = torch.nn.Linear(2, 1)
        before = layer.weight.detach().clone()
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        stage_precision(plugin, torch.device("cpu"))
        share_found_inf(scaler, torch.device("cpu"))  # twice: still one agreement per unscale
        loss = scaler.scale(layer(torch.ones(1, 2)).sum())
        loss.backward()
        if rank == 1:
            layer.weight.grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        record = {"stepped": not torch.equal(layer.weight, before), "scale": scaler.get_scale()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_an_inf_on_one_stage_skips_the_step_on_every_stage(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_found_inf_worker, (port, str(tmp_path)), nprocs=2, start_method="fork")
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {"stepped": False, "scale": 2.0}


@pytest.mark.parametrize("sync", [SyncMode.ASYNC, SyncMode.VERTICAL_SYNC, SyncMode.TWO_BW])
def test_16_mixed_is_refused_where_the_stages_step_inside_the_pipeline(sync: SyncMode) -> None:
    with pytest.raises(ValueError, match=r"sync: .*\); use Trainer\(precision='bf16-mixed'\)"):
        check_precision(MixedPrecision("16-mixed", "cpu"), sync)


@pytest.mark.parametrize("sync", list(SyncMode))
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_other_precisions_run_in_every_mode(sync: SyncMode, precision: str) -> None:
    plugin = MixedPrecision("bf16-mixed", "cpu") if precision == "bf16-mixed" else Precision()
    check_precision(plugin, sync)


def test_16_mixed_runs_in_the_flushed_modes() -> None:
    for sync in (SyncMode.FLUSH, SyncMode.GPIPE):
        check_precision(MixedPrecision("16-mixed", "cpu"), sync)


class Unknown(Precision):
    precision = "transformer-engine"


def test_a_precision_plugin_the_strategy_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match=r"precision: 'transformer-engine', plugin: Unknown\)"):
        check_precision(Unknown(), SyncMode.FLUSH)


@pytest.mark.slow
def test_async_16_mixed_stops_at_setup_naming_the_alternatives() -> None:
    strategy = PipeDreamStrategy(
        sync="async", balance=[3, 3], microbatches=2, start_method="fork", timeout=30
    )
    run = trainer(devices=2, strategy=strategy, plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(Exception, match=r"sync: async\); use Trainer\(precision='bf16-mixed'\)"):
        run.fit(Net(), loader(2))


def test_a_fused_optimizer_is_refused_under_a_loss_scale() -> None:
    layer = torch.nn.Linear(2, 2)
    fused = torch.optim.Adam(layer.parameters(), fused=True)
    with pytest.raises(ValueError, match=r"optimizer: Adam unscales inside its fused step"):
        check_optimizers(MixedPrecision("16-mixed", "cpu"), [fused])
    check_optimizers(MixedPrecision("bf16-mixed", "cpu"), [fused])
