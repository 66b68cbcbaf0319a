"""``Pipeline`` over gloo: flush equals one device, async equals the oracle (training, then
evaluation and predictions on every rank), state round-trips, a launch outside any process group
is refused, and the example runs under torchrun."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pl_pipedream
from pl_pipedream import Pipeline
from pl_pipedream.core.errors import TrainingDiverged
from pl_pipedream.core.preemption import Preempted
from pl_pipedream.engine.group import TORCHRUN
from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.distributed import run

ROOT = Path(__file__).resolve().parents[2]
M = 2  # microbatches per batch
STEPS = 4


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return build_model()


def build_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3), nn.Identity()
    )


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2 * M, 6, generator=generator), torch.randn(2 * M, 3, generator=generator))
        for _ in range(STEPS)
    ]


def sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def one_device(
    batches: list, model: nn.Module | None = None, make_optimizer: Any = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain PyTorch loop the flushed pipeline must equal (``make_model()`` and SGD unless
    given)."""
    model = make_model() if model is None else model
    optimizer = (make_optimizer or sgd)(model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # the mean of equal microbatches' means
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int, sync: str, balance: list[int]) -> dict:
    pipeline = Pipeline(
        make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=M, balance=balance
    )
    losses = [pipeline.train_step(batch).item() for batch in make_batches()]
    x, y = make_batches()[0]
    evaluated = pipeline.eval_step((x, y))  # drains
    predicted = pipeline.predict_step(x)
    state = pipeline.state_dict()
    after = pipeline.train_step(make_batches()[0]).item()  # moves the weights on
    pipeline.load_state_dict(state)
    restored = pipeline.state_dict()
    pipeline.close()
    pipeline.close()  # a second close has nothing left to give back
    with pytest.raises(RuntimeError, match=r"the pipeline is closed \(rank \d \(stage \d\)\)"):
        pipeline.train_step(make_batches()[0])
    return {
        "losses": losses,
        "state": state,
        "restored": restored,
        "after": after,
        "evaluated": evaluated,
        "predicted": predicted,
    }


def _check_forward_only(results: dict, weights: dict[str, torch.Tensor]) -> None:
    """Every rank's ``eval_step`` and ``predict_step`` equal the final model's, on one device."""
    model = make_model()
    model.load_state_dict(weights)
    x, y = make_batches()[0]
    with torch.no_grad():
        output = model(x)
    for rank, (_, value) in results.items():
        assert torch.allclose(value["predicted"], output, rtol=0, atol=1e-6), rank
        expected = nn.functional.mse_loss(output, y)
        assert torch.allclose(value["evaluated"], expected, rtol=0, atol=1e-6), rank


def _merged(results: dict) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for status, value in results.values():
        assert status == "ok", value
        weights.update(value["state"]["model"])
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["flush", "zero_bubble"])
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]], ids=["2 ranks", "3 ranks"])
def test_flush_equals_one_device(balance: list[int], sync: str) -> None:
    """``zero_bubble`` too: its split backward (input half sent at once, weight half later on
    the forward's weights) trains exactly as one device does, as flush does."""
    _check_equals_one_device(run(len(balance), _train, sync, balance, timeout=120.0))


def _check_equals_one_device(results: dict) -> None:
    """Every rank's training, evaluation, predictions and state round trip (``_train``) equal
    one device's."""
    losses, weights = one_device(make_batches())
    merged = _merged(results)
    assert merged.keys() == weights.keys()
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    _check_forward_only(results, weights)
    for rank, (_, value) in results.items():
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank  # the same on every rank
        assert value["state"]["steps"] == STEPS
        for name, tensor in value["state"]["model"].items():
            assert torch.equal(value["restored"]["model"][name], tensor), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "balance"),
    [("interleaved", [2, 1, 2, 1]), ("zbv", [2, 1, 2, 1]), ("zbv", [1] * 6)],
    ids=["interleaved 2 ranks", "zbv 2 ranks", "zbv 3 ranks"],
)
def test_the_chunked_modes_equal_one_device(sync: str, balance: list[int]) -> None:
    """Several stages per rank (``runtime.chunks``): each rank's stages run its one action list,
    a V's turn is handed over in memory, the rank's optimizer steps once per batch; training,
    evaluation, predictions and the state round trip equal one device."""
    _check_equals_one_device(run(len(balance) // 2, _train, sync, balance, timeout=120.0))


def _train_planned(rank: int, world: int) -> dict:
    inputs = make_batches()[0][0]
    example = inputs[: len(inputs) // M]  # one microbatch of the first layer's input
    with Pipeline(
        make_model(), nn.functional.mse_loss, sgd, microbatches=M, example_input=example
    ) as pipeline:
        losses = [pipeline.train_step(batch).item() for batch in make_batches()]
        return {"losses": losses, "state": pipeline.state_dict(), "plan": pipeline.plan}


@pytest.mark.slow
def test_without_a_layout_it_plans_from_an_example_and_flush_equals_one_device() -> None:
    """Profiled on rank 0 and planned for 2 processes (``core.planning``): every rank runs the
    same plan, whatever it is, and trains as one device does."""
    results = run(2, _train_planned, timeout=120.0)
    losses, weights = one_device(make_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    plans = [value["plan"] for _, value in results.values()]
    assert plans[0] == plans[1] and plans[0].num_workers == 2
    assert [s.nodes for s in plans[0].stages][0][0] == "0"  # layer indices, as balance= gives
    for _, value in results.values():
        assert value["losses"] == pytest.approx(losses, abs=1e-6)


def _train_chunks_planned(rank: int, world: int, sync: str, chunks: int | None) -> dict:
    inputs = make_batches()[0][0]
    with Pipeline(
        make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=M,
        example_input=inputs[: len(inputs) // M], chunks_per_rank=chunks,
    ) as pipeline:  # fmt: skip
        losses = [pipeline.train_step(batch).item() for batch in make_batches()]
        return {"losses": losses, "state": pipeline.state_dict(), "plan": pipeline.plan}


@pytest.mark.slow
@pytest.mark.parametrize(("sync", "chunks"), [("zbv", None), ("interleaved", 3)])
def test_without_a_layout_the_chunked_modes_plan_their_chunks_and_equal_one_device(
    sync: str, chunks: int | None
) -> None:
    """Rank 0 profiles and cuts 2 x chunks_per_rank stages placed as the mode runs them
    (``planner.chunk_plan``); every rank trains as one device does."""
    results = run(2, _train_chunks_planned, sync, chunks, timeout=120.0)
    losses, weights = one_device(make_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    plans = [value["plan"] for _, value in results.values()]
    assert plans[0] == plans[1] and plans[0].num_stages == 2 * (chunks or 2)
    assert plans[0].placement == ("v" if sync == "zbv" else "interleaved")
    for _, value in results.values():
        assert value["losses"] == pytest.approx(losses, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]], ids=["2 ranks", "3 ranks"])
def test_async_equals_the_oracle(balance: list[int]) -> None:
    results = run(len(balance), _train, "async", balance, timeout=120.0)
    plan = Plan.from_balance(balance)
    batches = make_batches()
    expected = oracle.train(make_model(), plan, "async", batches, M, nn.functional.mse_loss, sgd)
    merged = _merged(results)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    _check_forward_only(results, expected)
    logged = [value["losses"] for _, value in results.values()]
    assert all(_same(losses, logged[0]) for losses in logged)  # the same on every rank
    assert math.isnan(logged[0][0]) and not math.isnan(logged[0][-1])  # lags while filling


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["vertical_sync", "2bw", "gpipe"])
def test_the_other_modes_equal_the_oracle_on_two_ranks(sync: str) -> None:
    results = run(2, _train, sync, [3, 3], timeout=120.0)
    plan = Plan.from_balance([3, 3])
    expected = oracle.train(
        make_model(), plan, sync, make_batches(), M, nn.functional.mse_loss, sgd
    )
    merged = _merged(results)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def _plan_for_three(rank: int, world: int) -> str:
    try:
        Pipeline(make_model(), nn.functional.mse_loss, sgd, balance=[2, 2, 2])
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_a_plan_for_another_world_size_is_refused() -> None:
    results = run(2, _plan_for_three, timeout=60.0)
    assert results[0] == results[1]
    assert results[0][1].startswith(
        "the plan must have one worker per process of the group (plan's workers: 3, world "
        "size: 2); launch 3 processes (torchrun --nproc_per_node 3)"
    )


@pytest.mark.slow
def test_the_example_runs_under_torchrun() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in TORCHRUN:
        env.pop(name, None)
    torchrun = str(Path(sys.executable).parent / "torchrun")  # installed with torch
    example = str(ROOT / "examples" / "plain_pipeline.py")
    command = [torchrun, "--standalone", "--nproc_per_node", "2", example]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    final = [line for line in done.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and float(final[0].split()[-1]) < 2.0, done.stdout


def tied_model() -> nn.Sequential:
    """The last layer's weight is the first layer's: one parameter on two stages."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last)


def tied_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=generator), torch.randn(4, 4, generator=generator))] * 3


def _train_layout(
    rank: int, world: int, kind: str, sync: str = "flush"
) -> tuple[list[float], dict]:
    if kind == "replicated":
        plan = Plan.from_balance([3, 3], replicas=[2, 1])
        pipeline = Pipeline(
            make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=M, plan=plan
        )
        batches = make_batches()
    elif kind == "recompute":
        pipeline = Pipeline(
            make_model(),
            nn.functional.mse_loss,
            sgd,
            sync=sync,
            microbatches=M,
            balance=[3, 3],
            recompute=True,
        )
        batches = make_batches()
    else:
        pipeline = Pipeline(
            tied_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=M, balance=[2, 3]
        )
        batches = tied_batches()
    losses = [pipeline.train_step(batch).item() for batch in batches]
    state = pipeline.state_dict()
    pipeline.close()
    return losses, state["model"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicated", "tied"])
def test_flush_with_a_replicated_stage_or_a_tie_equals_one_device(kind: str) -> None:
    _check_layout(kind, "flush")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicated", "tied", "recompute"])
def test_zero_bubble_with_a_replicated_stage_a_tie_or_recompute_equals_one_device(
    kind: str,
) -> None:
    _check_layout(kind, "zero_bubble")


def _check_layout(kind: str, sync: str) -> None:
    results = run(3 if kind == "replicated" else 2, _train_layout, kind, sync, timeout=120.0)
    if kind == "tied":
        losses, weights = one_device(tied_batches(), tied_model())
    else:
        losses, weights = one_device(make_batches())
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", value
        assert value[0] == pytest.approx(losses, abs=1e-6), rank
        merged.update(value[1])
    assert merged.keys() == weights.keys()
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name


def _train_built_empty(rank: int, world: int, pretrained: str | None) -> dict:
    torch.manual_seed(0)  # before the block: the record replays from the generator's state there
    with pl_pipedream.empty_build() as build:
        layers = build_model()
    assert all(p.is_meta for p in layers.parameters())
    given = {"pretrained": pretrained} if pretrained else {"empty_build": build}
    with Pipeline(
        layers, nn.functional.mse_loss, sgd, microbatches=M, balance=[3, 3], **given
    ) as pipeline:
        others = [
            p.is_meta
            for i, layer in enumerate(layers)
            for p in layer.parameters()
            if str(i) not in pipeline.local.stage.nodes
        ]
        losses = [pipeline.train_step(batch).item() for batch in make_batches()]
        return {"losses": losses, "state": pipeline.state_dict(), "others": others}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["empty_build", "pretrained"])
def test_a_model_built_empty_creates_only_each_ranks_stage(source: str, tmp_path: Path) -> None:
    """Built on ``meta`` under ``pl_pipedream.empty_build()``, each rank creates only its
    stage: from the build's record (the values of the whole build with the same seed) or from
    pretrained weights (each rank reads its stage's); flush then trains as one device does."""
    path = None
    if source == "pretrained":
        path = str(tmp_path / "weights.pt")
        torch.save(make_model().state_dict(), path)
    results = run(2, _train_built_empty, path, timeout=120.0)
    losses, weights = one_device(make_batches())
    merged = _merged(results)
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    for _, value in results.values():
        assert value["others"] and all(value["others"])  # the other stage never created here
        assert value["losses"] == pytest.approx(losses, abs=1e-6)


def _diverge_then_preempt(rank: int, world: int) -> dict:
    """Three pipelines in turn: a learning rate that blows up, NaN in the data, a signal."""
    found: dict = {}
    blows_up = lambda params: torch.optim.SGD(params, lr=1e6)  # noqa: E731
    for name, optimizer, poison in (("diverged", blows_up, False), ("bad data", sgd, True)):
        with Pipeline(make_model(), nn.functional.mse_loss, optimizer, balance=[3, 3]) as p:
            try:
                for step, (x, y) in enumerate(make_batches() * 5):
                    if poison and step == 2:
                        x = x.clone()
                        x[1, 0] = float("nan")
                    p.train_step((x, y))
            except TrainingDiverged as error:
                found[name] = (type(error).__name__, p.steps, str(error))
    signals = ("SIGUSR1",)
    with Pipeline(
        make_model(), nn.functional.mse_loss, sgd, balance=[3, 3], preempt_signals=signals
    ) as p:
        try:
            for step in range(400):
                if rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)  # one rank of two gets the signal
                p.train_step(make_batches()[step % STEPS])
        except Preempted as stopped:
            found["preempted"] = (stopped.code, p.steps, p.runner is not None and p.runner.drained)
    found["handler"] = signal.getsignal(signal.SIGUSR1)
    return found


@pytest.mark.slow
def test_divergence_and_preemption_stop_every_rank_at_one_step() -> None:
    results = run(2, _diverge_then_preempt, timeout=120.0)
    values = []
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        values.append(value)
    assert values[0] == values[1]  # the same error, at the same step, on every rank
    kind, _, message = values[0]["diverged"]
    assert kind == "TrainingDiverged"
    assert message.startswith("training diverged: the training loss is not finite")
    assert 'Pipeline(divergence="warn"|"off") trains on regardless' in message
    assert "PipeDreamStrategy" not in message and "Trainer(" not in message
    assert "or clip gradients (Pipeline(..., clip_grad_norm=1.0))" in message  # flush clips too
    kind, steps, message = values[0]["bad data"]
    assert (kind, steps) == ("BadData", 3)  # flush: the loss of the poisoned batch, at once
    assert "batch of the fit: 2, microbatch: 0" in message
    code, steps, drained = values[0]["preempted"]
    assert code == 128 + signal.SIGUSR1 and drained and 3 < steps < 400
    assert values[0]["handler"] == signal.SIG_DFL  # given back by close


def gpt_layers() -> nn.Sequential:
    """The project's GPT (``models/gpt.py``) as plain layers: embedding, two blocks, the head
    whose weight is the embedding's (a tie across the first and last stage)."""
    from pl_pipedream.models.gpt import CharGPT  # the example model (a LightningModule)

    torch.manual_seed(0)
    return CharGPT([8], 11, width=16, heads=2, blocks=2, optimizer="sgd").configure_pipeline()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


def gpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 11, (4, 9), generator=generator) for _ in range(3)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train_gpt(
    rank: int, world: int, balance: list[int], clip: float | None
) -> tuple[list[float], dict]:
    with Pipeline(
        gpt_layers(), gpt_loss, sgd, microbatches=M, balance=balance, clip_grad_norm=clip
    ) as pipeline:
        losses = [pipeline.train_step(batch).item() for batch in gpt_batches()]
        return losses, pipeline.state_dict()["model"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("balance", "clip"), [([2, 2], None), ([1, 2, 1], 0.05)], ids=["2 ranks", "3 ranks clipped"]
)
def test_the_gpt_example_with_its_tied_embedding_trains_as_on_one_device(
    balance: list[int], clip: float | None
) -> None:
    """Clipped: by the norm over every stage, the tied embedding counted once, as
    ``clip_grad_norm_`` over the whole model clips it on one device."""
    results = run(len(balance), _train_gpt, balance, clip, timeout=120.0)
    model = gpt_layers()
    optimizer, losses, norms = sgd(model.parameters()), [], []
    for x, y in gpt_batches():
        optimizer.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        losses.append(loss.item())
    assert all(norm > 2 * clip for norm in norms) if clip else True  # clipping engaged
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value[0] == pytest.approx(losses, abs=1e-6), rank
        merged.update(value[1])
    assert merged.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def adam(params):  # type: ignore[no-untyped-def]
    return torch.optim.Adam(params, lr=0.01)


def _train_with_built_adam(rank: int, world: int, path: str) -> dict:
    model = make_model()
    built = adam(model.parameters())  # over the whole model, as Fabric and Accelerate hand it
    with Pipeline(model, nn.functional.mse_loss, built, microbatches=M, balance=[3, 3]) as p:
        losses = [p.train_step(batch).item() for batch in make_batches()]
        kept = {id(q) for g in built.param_groups for q in g["params"]}
        p.save(path)
        return {
            "losses": losses,
            "model": p.state_dict()["model"],
            "kept_only_the_stage": kept == {id(q) for q in p.module.parameters()},
        }


@pytest.mark.slow
def test_an_optimizer_built_over_the_whole_model_is_cut_to_each_stage(tmp_path: Path) -> None:
    results = run(2, _train_with_built_adam, str(tmp_path / "adam.ckpt"), timeout=120.0)
    losses, weights = one_device(make_batches(), make_optimizer=adam)
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["kept_only_the_stage"] and value["losses"] == pytest.approx(losses, abs=1e-6)
        merged.update(value["model"])
    for name, tensor in weights.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def _train_corrected_and_traced(rank: int, world: int, folder: str) -> dict:
    """async on [3, 3] with the lr warm-up per delay, a trace and the memory report."""
    path = Path(folder) / "trace.json"
    options = {"sync": "async", "microbatches": M, "balance": [3, 3], "timeline": path}
    pipeline = Pipeline(make_model(), nn.functional.mse_loss, sgd, lr_warmup_per_delay=2, **options)
    for batch in make_batches():
        pipeline.train_step(batch)
    rows = pipeline.memory_report()
    state = pipeline.state_dict()
    pipeline.close()
    return {"state": state, "rows": rows, "bubbles": pipeline.bubbles, "trace": path.exists()}


def test_the_warm_up_per_delay_the_trace_and_the_memory_report_run_on_pipeline(
    tmp_path: Path,
) -> None:
    """Options every front end shares, on ``Pipeline``: the warm-up equals the oracle's rule, rank
    0 writes the trace with each rank's bubble, every rank gets every rank's memory row."""
    results = run(2, _train_corrected_and_traced, str(tmp_path), timeout=120.0)
    expected = oracle.train(
        make_model(), Plan.from_balance([3, 3]), "async", make_batches(), M,
        nn.functional.mse_loss, sgd, lr_warmup_per_delay=2,
    )  # fmt: skip
    merged = _merged(results)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    first, second = results[0][1], results[1][1]
    assert first["trace"] and sorted(first["bubbles"]) == [0, 1] and second["bubbles"] == {}
    assert [row.rank for row in first["rows"]] == [0, 1] == [row.rank for row in second["rows"]]
    assert all(row.weights > 0 for row in first["rows"])
