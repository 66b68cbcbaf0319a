"""``prepare_pipeline`` over an Accelerator's gloo group: flush equals one device on 2 and 3
ranks, async equals the oracle, the project's GPT (tied embedding) trains as on one device, a
signal to one rank stops both, the example runs under ``accelerate launch``, and an Accelerator
the pipeline cannot run on is refused at setup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from torch import nn

from pl_pipedream.accelerate import prepare_pipeline
from pl_pipedream.accelerate.prepare import check_accelerator
from pl_pipedream.core.preemption import Preempted
from pl_pipedream.planner.plan import Plan
from tests.accelerate.ranks import accelerator_on
from tests.engine.test_pipeline import (
    STEPS,
    M,
    gpt_batches,
    gpt_layers,
    gpt_loss,
    make_batches,
    make_model,
    one_device,
    sgd,
)
from tests.runtime import oracle
from tests.runtime.distributed import run

ROOT = Path(__file__).resolve().parents[2]


def _train(rank: int, world: int, sync: str, balance: list[int] | None) -> dict:
    accelerator = accelerator_on(rank, world)
    model = make_model()
    optimizer = sgd(model.parameters())  # built over the whole model, as for prepare()
    inputs = make_batches()[0][0]
    layout = {"balance": balance} if balance else {"example_input": inputs[: len(inputs) // M]}
    pipeline = prepare_pipeline(
        accelerator, model, optimizer, nn.functional.mse_loss, sync=sync, microbatches=M, **layout
    )
    losses = [pipeline.train_step(batch).item() for batch in make_batches()]
    state = pipeline.state_dict()
    pipeline.close()
    return {"losses": losses, "model": state["model"], "device": str(pipeline.device)}


def _merged(results: dict) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["device"] == "cpu"
        weights.update(value["model"])
    return weights


@pytest.mark.slow
@pytest.mark.parametrize(
    "balance", [[3, 3], [2, 2, 2], None], ids=["2 ranks", "3 ranks", "planned from an example"]
)
def test_flush_equals_one_device(balance: list[int] | None) -> None:
    results = run(len(balance or [3, 3]), _train, "flush", balance, timeout=120.0)
    losses, weights = one_device(make_batches())
    merged = _merged(results)
    assert merged.keys() == weights.keys()
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    for rank, (_, value) in results.items():
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank  # on every rank


@pytest.mark.slow
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]], ids=["2 ranks", "3 ranks"])
def test_async_equals_the_oracle(balance: list[int]) -> None:
    results = run(len(balance), _train, "async", balance, timeout=120.0)
    plan = Plan.from_balance(balance)
    expected = oracle.train(
        make_model(), plan, "async", make_batches(), M, nn.functional.mse_loss, sgd
    )
    merged = _merged(results)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def _train_gpt(rank: int, world: int) -> tuple[list[float], dict]:
    accelerator = accelerator_on(rank, world)
    layers = gpt_layers()
    with prepare_pipeline(
        accelerator, layers, sgd(layers.parameters()), gpt_loss, microbatches=M, balance=[2, 2]
    ) as pipeline:
        losses = [pipeline.train_step(batch).item() for batch in gpt_batches()]
        return losses, pipeline.state_dict()["model"]


@pytest.mark.slow
def test_the_gpt_example_with_its_tied_embedding_trains_as_on_one_device() -> None:
    model = gpt_layers()  # first: the forked ranks inherit Lightning, imported by models.gpt
    results = run(2, _train_gpt, timeout=120.0)
    optimizer, losses = sgd(model.parameters()), []
    for x, y in gpt_batches():
        optimizer.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value[0] == pytest.approx(losses, abs=1e-6), rank
        merged.update(value[1])
    for name, tensor in model.state_dict().items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def _preempt(rank: int, world: int) -> tuple:
    accelerator = accelerator_on(rank, world)
    model = make_model()
    with prepare_pipeline(
        accelerator,
        model,
        sgd,
        nn.functional.mse_loss,
        balance=[3, 3],
        preempt_signals=("SIGUSR1",),
    ) as pipeline:
        try:
            for step in range(400):
                if rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)  # one rank of two gets the signal
                pipeline.train_step(make_batches()[step % STEPS])
        except Preempted as stopped:
            runner = pipeline.runner
            return stopped.code, pipeline.steps, runner is not None and runner.drained
    return ("not stopped",)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_one_step() -> None:
    results = run(2, _preempt, timeout=120.0)
    values = [value for _, value in results.values()]
    assert all(status == "ok" for status, _ in results.values()), results
    assert values[0] == values[1]
    code, steps, drained = values[0]
    assert code == 128 + signal.SIGUSR1 and drained and 3 < steps < 400


def _launch(*options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    launcher = str(Path(sys.executable).parent / "accelerate")  # installed with accelerate
    command = [
        launcher,
        "launch",
        *options,
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "examples" / "accelerate_pipeline.py"),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_the_example_runs_under_accelerate_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command docs/accelerate.md gives for CPUs: Accelerate's torchrun-style launcher
    with ACCELERATE_USE_CPU, two processes joined over gloo by Accelerate itself."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")  # for the launched processes
    done = _launch("--multi_gpu", "--main_process_port", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    final = [line for line in done.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and float(final[0].split()[-1]) < 2.0, done.stdout


@pytest.mark.slow
def test_accelerate_launch_cpu_starts_one_process_and_is_refused_naming_the_command() -> None:
    """accelerate 1.15's ``launch --cpu --num_processes 2`` runs the script once, without
    --mpirun_hostfile: the Accelerator is not distributed, and prepare_pipeline says so."""
    done = _launch("--cpu")
    assert done.returncode != 0
    assert "(distributed type: DistributedType.NO)" in done.stderr, done.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N" in done.stderr


def fake(kind: DistributedType = DistributedType.MULTI_CPU, steps: int = 1) -> SimpleNamespace:
    return SimpleNamespace(distributed_type=kind, gradient_accumulation_steps=steps)


def test_an_accelerator_without_a_multi_process_launch_is_refused() -> None:
    for kind in (DistributedType.NO, DistributedType.DEEPSPEED, DistributedType.FSDP):
        with pytest.raises(ValueError, match=r"one stage \(or replica\) each, without DeepSpeed"):
            check_accelerator(fake(kind))
    with pytest.raises(ValueError) as refused:
        check_accelerator(fake(DistributedType.NO))
    command = "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"
    assert command in str(refused.value)
    check_accelerator(fake(DistributedType.MULTI_GPU))  # NCCL: accepted


def test_gradient_accumulation_is_refused_naming_microbatches() -> None:
    with pytest.raises(
        ValueError,
        match=r"a pipeline already accumulates: .* \(gradient accumulation steps: 4\); use "
        r"Accelerator\(gradient_accumulation_steps=1\) .* microbatches=4 \* m\)",
    ):
        check_accelerator(fake(steps=4))


def _replanning(rank: int, world: int) -> dict:
    accelerator = accelerator_on(rank, world)
    model = make_model()
    pipeline = prepare_pipeline(
        accelerator,
        model,
        sgd(model.parameters()),
        nn.functional.mse_loss,
        microbatches=M,
        balance=[3, 3],
        replan="auto",
        replan_every=2,
        replan_threshold=100.0,  # checks, never moves
    )
    for batch in make_batches():
        pipeline.train_step(batch)
    replanner = pipeline.replanner
    recording = pipeline._running().executor.record_timeline
    pipeline.close()
    return {"mode": replanner.mode, "every": replanner.every, "recording": recording}


@pytest.mark.slow
def test_the_replan_options_reach_the_engine() -> None:
    results = run(2, _replanning, timeout=120.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value == {"mode": "auto", "every": 2, "recording": True}


def _slowed(rank: int, world: int) -> dict:
    """Every layer costs 10 ms, rank 1's 60 more from batch 2: the plan moves at step 4."""
    from tests.engine.test_replanning import Sleep
    from tests.engine.test_replanning import make_batches as eight_batches

    accelerator = accelerator_on(rank, world)
    model = make_model()
    pipeline = prepare_pipeline(
        accelerator, model, sgd(model.parameters()), nn.functional.mse_loss, microbatches=M,
        balance=[3, 3], replan="auto", replan_every=2, replan_threshold=0.5,
    )  # fmt: skip
    sleeps, losses = [Sleep(model, 0.01)], []
    for step, batch in enumerate(eight_batches()):
        if step == 2 and rank == 1:
            sleeps.append(Sleep(model, 0.06))
        losses.append(pipeline.train_step(batch).item())
    for sleep in sleeps:
        sleep.handle.remove()
    state, device = pipeline.state_dict()["model"], str(pipeline.device)
    result = {"losses": losses, "model": state, "plan": pipeline.plan, "device": device}
    pipeline.close()
    return result


@pytest.mark.slow
def test_a_slowed_rank_moves_the_plan_and_flush_still_equals_one_device() -> None:
    from tests.engine.test_replanning import make_batches as eight_batches

    results = run(2, _slowed, timeout=180.0)
    losses, weights = one_device(eight_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    for rank, (_, value) in results.items():
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank
        assert len(value["plan"].stage_of_rank(1).nodes) < 3, value["plan"].render()


def _planned_chunks(rank: int, world: int) -> dict:
    accelerator = accelerator_on(rank, world)
    model = make_model()
    inputs = make_batches()[0][0]
    pipeline = prepare_pipeline(
        accelerator, model, sgd(model.parameters()), nn.functional.mse_loss, microbatches=M,
        sync="interleaved", chunks_per_rank=3, example_input=inputs[: len(inputs) // M],
    )  # fmt: skip
    losses = [pipeline.train_step(batch).item() for batch in make_batches()]
    state, plan = pipeline.state_dict()["model"], pipeline.plan
    pipeline.close()
    return {"losses": losses, "model": state, "plan": plan}


@pytest.mark.slow
def test_chunks_per_rank_reaches_the_engine_and_a_planned_pipeline_equals_one_device() -> None:
    """One process: ``sync="interleaved", chunks_per_rank=3`` planned from the example gives
    its rank 3 stages (``planner.chunk_plan``), trained as one device."""
    status, value = run(1, _planned_chunks, timeout=120.0)[0]
    assert status == "ok", value
    assert value["plan"].num_stages == 3 and value["plan"].placement == "interleaved"
    losses, weights = one_device(make_batches())
    assert value["losses"] == pytest.approx(losses, abs=1e-6)
    for name, expected in weights.items():
        assert torch.allclose(value["model"][name], expected, rtol=0, atol=1e-6), name
