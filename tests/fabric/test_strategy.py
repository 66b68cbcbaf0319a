"""``Fabric(strategy="pipedream")`` over gloo, launched by ``fabric.launch``: flush equals one
device and async the oracle on 2 and 3 ranks, the GPT example trains, a signal stops every rank,
save/load resumes under another plan, the loss reaches Fabric's logger, and what a pipeline
cannot do is refused naming the alternative."""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

import pl_pipedream
from pl_pipedream.core.preemption import Preempted
from pl_pipedream.fabric import PipeDreamFabricStrategy
from pl_pipedream.planner.plan import Plan
from tests.engine.test_pipeline import (
    STEPS,
    M,
    build_model,
    gpt_batches,
    gpt_layers,
    gpt_loss,
    make_batches,
    make_model,
    one_device,
    sgd,
)
from tests.engine.test_precision import bf16_one_device
from tests.fabric.launch import launch
from tests.runtime import oracle

ROOT = Path(__file__).resolve().parents[2]
MSE = nn.functional.mse_loss


def _train(fabric: Fabric, make: Any = make_model, batches: Any = make_batches) -> dict:
    """The README loop: every rank the same model and batches."""
    model = make()
    optimizer = sgd(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step, batch in enumerate(batches()):
        loss = model(batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.log("train_loss", loss, step=step)
        losses.append(loss.item())
    model.eval()
    x, y = batches()[0]
    result = {"losses": losses, "evaluated": model((x, y)), "predicted": model(inputs=x)}
    result["state"] = fabric.strategy.pipeline.state_dict()["model"]
    fabric.strategy.teardown()  # closes the pipeline
    for logger in fabric.loggers:
        logger.finalize("success")
    return result


def _merged(results: dict) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for value in results.values():
        merged.update(value["state"])
    return merged


def _logged(root: Path) -> list[float]:
    with open(root / "run" / "version_0" / "metrics.csv") as file:
        return [float(row["train_loss"]) for row in csv.DictReader(file)]


@pytest.mark.slow
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]], ids=["2 ranks", "3 ranks"])
def test_flush_equals_one_device_and_the_loss_reaches_the_logger(
    balance: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = CSVLogger(tmp_path / "logs", name="run", version=0)
    results = launch(
        monkeypatch, tmp_path, len(balance), _train, loggers=logger, loss_fn=MSE,
        microbatches=M, balance=balance,
    )  # fmt: skip
    losses, weights = one_device(make_batches())
    merged = _merged(results)
    assert merged.keys() == weights.keys()
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    final = make_model()
    final.load_state_dict(weights)
    x, y = make_batches()[0]
    with torch.no_grad():
        output = final(x)
    for rank, value in results.items():
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank  # the same on every rank
        assert torch.allclose(value["predicted"], output, rtol=0, atol=1e-6), rank
        assert torch.allclose(value["evaluated"], MSE(output, y), rtol=0, atol=1e-6), rank
    assert _logged(tmp_path / "logs") == pytest.approx(losses, abs=1e-6)  # rank 0 logs, once


@pytest.mark.slow
def test_bf16_mixed_equals_one_device_under_the_same_autocast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fabric's ``precision="bf16-mixed"`` is the engine's: autocast around each stage's
    forward passes only (Fabric's own autocast around the call is left), evaluation included."""
    results = launch(
        monkeypatch, tmp_path, 2, _train, precision="bf16-mixed", loss_fn=MSE,
        microbatches=M, balance=[3, 3],
    )  # fmt: skip
    expected, model = bf16_one_device()
    merged = _merged(results)
    for name, tensor in model.state_dict().items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    x, y = make_batches()[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = MSE(model(x), y)
    for value in results.values():
        assert value["losses"] == pytest.approx(expected, abs=1e-6)
        assert torch.allclose(value["evaluated"], reference, rtol=0, atol=1e-6)


def _train_built_empty(fabric: Fabric) -> dict:
    torch.manual_seed(0)  # the record replays from the generator's state at the build's start
    with fabric.init_module(empty_init=True):
        model = build_model()
    assert all(p.is_meta for p in model.parameters())
    return _train(fabric, make=lambda: model)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["record", "pretrained"])
def test_a_model_built_empty_creates_only_each_ranks_stage(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fabric.init_module(empty_init=True)`` builds on ``meta``; each rank creates its stage
    from the build's record (the whole build's values) or from ``pretrained`` weights."""
    given = {}
    if source == "pretrained":
        given["pretrained"] = str(tmp_path / "weights.pt")
        torch.save(make_model().state_dict(), given["pretrained"])
    results = launch(
        monkeypatch, tmp_path / "run", 2, _train_built_empty, loss_fn=MSE, microbatches=M,
        balance=[3, 3], **given,
    )  # fmt: skip
    _, weights = one_device(make_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_without_a_layout_it_plans_from_an_example(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = make_batches()[0][0]
    results = launch(
        monkeypatch, tmp_path, 2, _train, loss_fn=MSE, microbatches=M,
        example_input=inputs[: len(inputs) // M],
    )  # fmt: skip
    _, weights = one_device(make_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]], ids=["2 ranks", "3 ranks"])
def test_async_equals_the_oracle(
    balance: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = launch(
        monkeypatch, tmp_path, len(balance), _train, loss_fn=MSE, sync="async",
        microbatches=M, balance=balance,
    )  # fmt: skip
    plan = Plan.from_balance(balance)
    expected = oracle.train(make_model(), plan, "async", make_batches(), M, MSE, sgd)
    merged = _merged(results)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    logged = [value["losses"] for value in results.values()]
    assert math.isnan(logged[0][0]) and not math.isnan(logged[0][-1])  # lags while filling
    assert all(str(losses) == str(logged[0]) for losses in logged)  # the same on every rank


@pytest.mark.slow
def test_the_gpt_example_with_its_tied_embedding_trains_as_on_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = launch(
        monkeypatch, tmp_path, 2, _train, gpt_layers, gpt_batches, loss_fn=gpt_loss,
        microbatches=M, balance=[2, 2],
    )  # fmt: skip
    model = gpt_layers()
    optimizer, losses = sgd(model.parameters()), []
    for x, y in gpt_batches():
        optimizer.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    merged = _merged(results)
    assert merged.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    for rank, value in results.items():
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank
    assert any(not torch.equal(t, gpt_layers().state_dict()[n]) for n, t in merged.items())


def _preempted(fabric: Fabric) -> tuple:
    model = make_model()
    model, optimizer = fabric.setup(model, sgd(model.parameters()))
    try:
        for step in range(400):
            if fabric.global_rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # one rank of two gets the signal
            model(make_batches()[step % STEPS])
            optimizer.step()
    except Preempted as stopped:
        steps = fabric.strategy.pipeline.steps
        fabric.strategy.teardown()
        return stopped.code, steps, signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    return ("not stopped",)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_one_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = launch(
        monkeypatch, tmp_path, 2, _preempted, loss_fn=MSE, balance=[3, 3],
        preempt_signals=("SIGUSR1",),
    )  # fmt: skip
    assert results[0] == results[1]  # the same step on every rank
    code, steps, handler_given_back = results[0]
    assert code == 128 + signal.SIGUSR1 and 3 < steps < 400 and handler_given_back


def _save(fabric: Fabric, path: str) -> list[float]:
    model = make_model()
    model, optimizer = fabric.setup(model, sgd(model.parameters()))
    losses = [model(batch).item() for batch in make_batches()[:2]]
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2, "seen": {"a": 1}})
    fabric.strategy.teardown()
    return losses


def _resume(fabric: Fabric, path: str) -> dict:
    model = make_model()
    model, optimizer = fabric.setup(model, sgd(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    losses = [model(batch).item() for batch in make_batches()[2:]]
    result = {"losses": losses, "step": state["step"], "remainder": remainder}
    result["state"] = fabric.strategy.pipeline.state_dict()["model"]
    fabric.strategy.teardown()
    return result


@pytest.mark.slow
def test_save_on_two_ranks_then_load_on_three_equals_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "run.ckpt")
    common = {"loss_fn": MSE, "microbatches": M}
    launch(monkeypatch, tmp_path / "a", 2, _save, path, balance=[3, 3], **common)
    _, halfway = one_device(make_batches()[:2])
    whole = pl_pipedream.consolidate_checkpoint(path)  # the project's sharded format
    for name, tensor in halfway.items():
        assert torch.allclose(whole[name], tensor, rtol=0, atol=1e-6), name
    results = launch(monkeypatch, tmp_path / "b", 3, _resume, path, balance=[2, 2, 2], **common)
    losses, weights = one_device(make_batches())  # momentum came along too
    for rank, value in results.items():
        assert value["step"] == 2 and value["remainder"] == {"seen": {"a": 1}}, rank
        assert value["losses"] == pytest.approx(losses[2:], abs=1e-6), rank
    merged = _merged(results)
    for name, tensor in weights.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def _refusals(fabric: Fabric, path: str) -> dict[str, str]:
    model = make_model()
    model, optimizer = fabric.setup(model, sgd(model.parameters()))
    batch = make_batches()[0]
    found: dict[str, str] = {}

    def refused(name: str, call: Any) -> None:
        try:
            call()
        except (RuntimeError, ValueError, KeyError) as error:
            found[name] = str(error)

    refused("step first", optimizer.step)
    loss = model(batch)
    refused("backward other", lambda: fabric.backward(loss * 2))
    fabric.backward(loss)  # the training call's loss: accepted
    refused("clip norm", lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0))
    refused("clip value", lambda: fabric.clip_gradients(model, optimizer, clip_val=0.5))
    optimizer.step()
    model(batch)
    refused("accumulate", lambda: model(batch))
    refused("save without model", lambda: fabric.save(path, {"step": 1}))
    refused("load nothing", lambda: fabric.load(path))
    refused("no sync", lambda: fabric.no_backward_sync(model).__enter__())
    again = make_model()
    refused("setup twice", lambda: fabric.setup(again, sgd(again.parameters())))
    fabric.strategy.teardown()
    return found


@pytest.mark.slow
def test_what_a_pipeline_cannot_do_is_refused_naming_the_alternative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "x.ckpt")
    results = launch(monkeypatch, tmp_path, 2, _refusals, path, loss_fn=MSE, balance=[3, 3])
    assert results[0] == results[1]
    found = results[0]
    assert found["step first"].startswith(
        "optimizer.step() under the pipeline confirms the update the training call before it "
        "applied inside the schedule, one step per call (training calls since the last step: 0)"
    )
    assert "(tensor: a tensor of shape [])" in found["backward other"]
    assert found["backward other"].startswith(
        "fabric.backward under the pipeline takes the loss the training call returned"
    )
    assert "(max_norm: 1.0)" in found["clip norm"]
    assert (
        "clip inside the schedule: PipeDreamFabricStrategy(clip_grad_norm=1.0)"
        in found["clip norm"]
    )
    assert 'gradient_clip_algorithm="value"' in found["clip value"]
    assert "(training calls since the last step: 1)" in found["accumulate"]
    assert "PipeDreamFabricStrategy(microbatches=...)" in found["accumulate"]
    assert "(state keys: ['step'])" in found["save without model"]
    assert "(state: NoneType)" in found["load nothing"]
    assert found["no sync"].startswith("fabric.no_backward_sync accumulates gradients")
    assert "(fabric.setup: called before)" in found["setup twice"]


# ----- one process: the string, and the refusals at setup before any process group -------------


def test_the_string_pipedream_finds_the_strategy_with_each_start_method() -> None:
    assert "pipedream" in STRATEGY_REGISTRY
    for name, method in (("pipedream", "popen"), ("pipedream_spawn", "spawn")):
        fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
        assert isinstance(fabric.strategy, PipeDreamFabricStrategy)
        assert fabric.strategy._start_method == method
        assert fabric.strategy.distributed_sampler_kwargs is None  # every rank the same batches


@pytest.mark.slow  # a fresh interpreter importing Lightning
def test_importing_the_package_first_registers_both_front_ends_when_lightning_loads() -> None:
    code = (
        "import sys, pl_pipedream; assert 'lightning' not in sys.modules; "
        "from lightning.fabric import Fabric; "
        "kw = dict(strategy='pipedream', accelerator='cpu', devices=2); "
        "print(type(Fabric(**kw).strategy).__name__); "
        "from lightning.pytorch import Trainer; "
        "print(type(Trainer(**kw).strategy).__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["PipeDreamFabricStrategy", "PipeDreamStrategy"]


@pytest.mark.parametrize(
    ("strategy", "fabric", "message"),
    [
        (
            {},
            {},
            "the pipeline needs its loss function and its layout on the strategy (loss_fn: "
            "NoneType, balance: None, plan: None, example_input: None); write Fabric(strategy="
            "PipeDreamFabricStrategy(loss_fn=nn.functional.cross_entropy, balance=[2, 2]), ...)",
        ),
        (
            {"loss_fn": MSE},
            {},
            "the pipeline needs its loss function and its layout on the strategy (loss_fn: "
            "function, balance: None, plan: None, example_input: None)",
        ),
        (
            {"loss_fn": MSE, "balance": [3, 3]},
            {"precision": "64-true"},
            'the pipeline under Fabric trains in "32-true", "bf16-mixed" or "16-mixed" '
            'precision (precision: 64-true); write Fabric(strategy="pipedream", '
            'precision="bf16-mixed")',
        ),
    ],
    ids=["no loss", "no layout", "64-true"],
)
def test_setup_refuses_a_missing_loss_or_layout_and_another_precision(
    strategy: dict, fabric: dict, message: str
) -> None:
    built = Fabric(
        strategy=PipeDreamFabricStrategy(**strategy), accelerator="cpu", devices=2, **fabric
    )
    model = make_model()
    with pytest.raises(ValueError) as error:
        built.strategy.setup_module_and_optimizers(model, [sgd(model.parameters())])
    assert str(error.value).startswith(message)


def test_setting_up_the_model_or_the_optimizer_alone_is_refused() -> None:
    strategy = Fabric(strategy="pipedream", accelerator="cpu", devices=2).strategy
    model = make_model()
    with pytest.raises(ValueError, match=r"\(optimizers: 0\); write model, optimizer = fabric"):
        strategy.setup_module(model)
    with pytest.raises(ValueError, match=r"\(optimizer: SGD alone\); write model, optimizer"):
        strategy.setup_optimizer(sgd(model.parameters()))
    with pytest.raises(RuntimeError, match=r"the pipeline is built by fabric.setup"):
        strategy.pipeline  # noqa: B018


@pytest.mark.slow
def test_the_example_runs_with_fabric_launching_its_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)
    example = str(ROOT / "examples" / "fabric_pipeline.py")
    done = subprocess.run(
        [sys.executable, example], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    final = [line for line in done.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and float(final[0].split()[-1]) < 2.0, done.stdout
    assert pl_pipedream.consolidate_checkpoint(tmp_path / "lightning_logs" / "fabric_pipeline.ckpt")


def test_chunks_per_rank_reaches_the_engine_and_a_bad_one_is_refused_at_once() -> None:
    strategy = PipeDreamFabricStrategy(MSE, sync="interleaved", chunks_per_rank=3)
    assert strategy.engine_arguments["chunks_per_rank"] == 3
    assert "chunks_per_rank" not in PipeDreamFabricStrategy(MSE, sync="zbv").engine_arguments
    with pytest.raises(ValueError, match=r"use PipeDreamFabricStrategy\(sync='interleaved', c"):
        PipeDreamFabricStrategy(MSE, sync="flush", chunks_per_rank=2)


def test_the_replan_options_reach_the_engine_and_bad_ones_are_refused_at_once() -> None:
    strategy = PipeDreamFabricStrategy(MSE, balance=[3, 3], replan="auto", replan_every=7)
    assert strategy.engine_arguments["replan"] == "auto"
    assert strategy.engine_arguments["replan_every"] == 7
    assert "replan_threshold" not in strategy.engine_arguments  # Pipeline's default: 0.05
    with pytest.raises(ValueError, match=r"^replan must be one of off, auto \(replan: 'on'\)"):
        PipeDreamFabricStrategy(MSE, balance=[3, 3], replan="on")


def _train_slowed(fabric: Fabric) -> dict:
    """The README loop on 8 batches; every layer costs 10 ms, rank 1's 60 more from batch 2."""
    from tests.engine.test_replanning import Sleep
    from tests.engine.test_replanning import make_batches as eight_batches

    model = make_model()
    optimizer = sgd(model.parameters())
    fabric_model, optimizer = fabric.setup(model, optimizer)
    sleeps, losses = [Sleep(model, 0.01)], []
    for step, batch in enumerate(eight_batches()):
        if step == 2 and fabric.global_rank == 1:
            sleeps.append(Sleep(model, 0.06))
        loss = fabric_model(batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for sleep in sleeps:
        sleep.handle.remove()
    pipeline = fabric.strategy.pipeline
    result = {"losses": losses, "state": pipeline.state_dict()["model"], "plan": pipeline.plan}
    result["current"] = fabric.strategy._module.stage is pipeline.module
    fabric.strategy.teardown()
    return result


@pytest.mark.slow
def test_a_slowed_rank_moves_the_plan_and_flush_still_equals_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.engine.test_replanning import make_batches as eight_batches

    results = launch(
        monkeypatch, tmp_path, 2, _train_slowed, loss_fn=MSE, microbatches=M, balance=[3, 3],
        replan="auto", replan_every=2, replan_threshold=0.5,
    )  # fmt: skip
    losses, weights = one_device(eight_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    for rank, value in results.items():
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank
        assert len(value["plan"].stage_of_rank(1).nodes) < 3, value["plan"].render()
        assert value["current"], rank  # the Fabric module holds the stage after the move
