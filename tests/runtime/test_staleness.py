"""Weight prediction, the learning-rate warm-up per delay and the learning rate per delay: the
formulas, the checks, and the pipeline over gloo against the single-process oracle (which
implements the three rules itself)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.staleness import (
    DelayScaledUpdate,
    WarmedUpdate,
    carry_counts,
    check_corrections,
    corrected_update,
    delay_lr_factor,
    delay_of,
    predict,
    stage_delay,
    warmup_factor,
)
from pl_pipedream.schedule.modes import SyncMode
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import (
    OPTIMIZERS,
    loss_fn,
    make_batches,
    make_model,
    optimizer_update,
)

WARMUP = 2  # lr_warmup_per_delay of the runs below: ramps of 2 to 6 updates within 5 batches
ANNEAL = 4  # delay_lr_updates of the runs below: every stage applies 10 to 20 updates
CORRECTIONS = {  # (weight_prediction, lr_warmup_per_delay, delay_lr_updates): the optimizers
    "prediction": ((True, 0, None), ("sgd",)),
    "warm-up": ((False, WARMUP, None), ("sgd",)),
    "both": ((True, WARMUP, None), ("sgd", "adam")),
    "lr per delay": ((False, 0, 0), ("sgd", "adamw")),
    "prediction, lr per delay annealed": ((True, 0, ANNEAL), ("sgd", "adamw")),
    "all three": ((True, WARMUP, ANNEAL), ("sgd", "adamw")),
}
OPTIMIZERS = {**OPTIMIZERS, "adamw": lambda params: torch.optim.AdamW(params, lr=0.01)}
TOLERANCE = 1e-6
PLANS = {  # plan, microbatches
    "2 stages": (Plan.from_balance([3, 3]), 2),
    "3 stages": (Plan.from_balance([2, 2, 2]), 3),
    "2-1 replicated": (Plan.from_balance([3, 3], replicas=[2, 1]), 4),
    "4 stages": (Plan.from_balance([1, 2, 2, 1]), 4),
}
BY_WORLD = {2: ["2 stages"], 3: ["3 stages", "2-1 replicated"], 4: ["4 stages"]}


# ----- the formulas ---------------------------------------------------------------------------


def _sgd_history(steps: int = 3):  # type: ignore[no-untyped-def]
    """A layer's weights after each of ``steps`` SGD momentum updates, and the last buffer."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    history = [{n: p.detach().clone() for n, p in layer.named_parameters()}]
    for k in range(steps):
        layer.zero_grad()
        (layer(torch.randn(5, 4, generator=torch.Generator().manual_seed(k))) ** 2).sum().backward()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in layer.named_parameters()})
    buffers = {n: optimizer.state[p]["momentum_buffer"] for n, p in layer.named_parameters()}
    return history, buffers


@pytest.mark.parametrize("d", [1, 2, 3])
def test_prediction_is_the_momentum_step_taken_d_more_times(d: int) -> None:
    # SGD with momentum: W_v = W_(v-1) - lr buf_v, so W_v + d (W_v - W_(v-1)) = W_v - d lr buf_v
    history, buffers = _sgd_history()
    current = {n: w.clone().requires_grad_(True) for n, w in history[-1].items()}
    previous = {n: w.clone().requires_grad_(True) for n, w in history[-2].items()}
    for name, guess in (
        ("runtime", predict(current, previous, d)),
        ("oracle", oracle._extrapolate(current, previous, d)),
    ):
        for key, weight in guess.items():
            expected = history[-1][key] - d * 0.1 * buffers[key]
            assert weight.requires_grad and weight.is_leaf, (name, key)
            assert torch.allclose(weight, expected, atol=1e-6), (name, key, d)


def test_a_frozen_parameter_is_not_predicted() -> None:
    frozen = torch.ones(2)
    got = predict({"w": frozen}, {"w": torch.zeros(2)}, 3)
    assert got["w"] is frozen


def test_delays_and_warm_up_factors() -> None:
    assert [delay_of(i, max(0, i - 2)) for i in range(5)] == [0, 1, 2, 2, 2]
    assert delay_of(7, 2, replicas=2) == 1  # 3 updates precede minibatch 7's, it runs on 2
    straight = Plan.from_balance([1, 1, 1])
    assert [stage_delay(straight, SyncMode.ASYNC, s) for s in range(3)] == [2, 1, 0]
    assert [stage_delay(straight, SyncMode.VERTICAL_SYNC, s) for s in range(3)] == [2, 2, 2]
    assert [stage_delay(straight, SyncMode.FLUSH, s) for s in range(3)] == [0, 0, 0]
    replicated = Plan.from_balance([3, 3], replicas=[2, 1])  # w_0 = 1 on 2 replicas
    assert [stage_delay(replicated, SyncMode.VERTICAL_SYNC, s) for s in range(2)] == [1, 2]
    assert [warmup_factor(u, 4) for u in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert warmup_factor(1, 0) == 1.0


def test_a_warmed_update_scales_the_learning_rate_and_puts_it_back() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    seen = []

    def inner(gradients, storage):  # type: ignore[no-untyped-def]
        seen.append(optimizer.param_groups[0]["lr"])
        return 0

    warmed = WarmedUpdate(inner, lambda: [optimizer], steps=4)
    for _ in range(6):
        warmed({}, {})
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert optimizer.param_groups[0]["lr"] == 0.4


def test_learning_rate_per_delay_factors() -> None:
    # tau 4: lr / 4 on the first update, annealed geometrically to lr by the (T + 1)-th
    assert [delay_lr_factor(u, 4, 2) for u in (1, 2, 3, 9)] == pytest.approx([0.25, 0.5, 1, 1])
    assert [delay_lr_factor(u, 4, 0) for u in (1, 100)] == [0.25, 0.25]
    assert [delay_lr_factor(1, d, 0) for d in (0, 1, 2)] == [1.0, 1.0, 0.5]
    # the oracle's rule, written on its own, gives the same factors
    for delay, updates in ((3, 0), (3, 5), (2, 1), (0, 3)):
        for u in range(1, 9):
            ours = delay_lr_factor(u, delay, updates)
            theirs = oracle._delay_scale(max(1, delay), u - 1, updates)
            assert ours == pytest.approx(theirs), (delay, updates, u)


def _recording(optimizer):  # type: ignore[no-untyped-def]
    seen: list[float] = []

    def inner(gradients, storage):  # type: ignore[no-untyped-def]
        seen.append(optimizer.param_groups[0]["lr"])
        return 0

    return inner, seen


def test_a_delay_scaled_update_scales_the_learning_rate_and_puts_it_back() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    inner, seen = _recording(optimizer)
    scaled = DelayScaledUpdate(inner, lambda: [optimizer], delay=2, updates=2)
    for _ in range(4):
        scaled({}, {})
    assert seen == pytest.approx([0.2, 0.4 / 2**0.5, 0.4, 0.4])
    assert optimizer.param_groups[0]["lr"] == 0.4


def test_the_warm_up_and_the_learning_rate_per_delay_multiply() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    inner, seen = _recording(optimizer)
    plan = Plan.from_balance([1, 1, 1])  # async: stage 0 is 2 updates stale
    update = corrected_update(inner, lambda: [optimizer], plan, SyncMode.ASYNC, 0, 2, 0)
    for _ in range(6):
        update({}, {})
    warm = [warmup_factor(u, 4) for u in range(1, 7)]
    assert seen == pytest.approx([0.4 * w / 2 for w in warm])
    assert optimizer.param_groups[0]["lr"] == 0.4
    # a re-planned pipeline's wrappers go on from the updates counted
    again = corrected_update(inner, lambda: [optimizer], plan, SyncMode.ASYNC, 0, 2, 0)
    carry_counts(again, update)
    assert isinstance(again, WarmedUpdate) and isinstance(again.update, DelayScaledUpdate)
    assert again.count == again.update.count == 6
    # neither asked, or a stage without delay: the update itself, or factors of 1
    assert corrected_update(inner, lambda: [optimizer], plan, SyncMode.ASYNC, 0) is inner
    last = corrected_update(inner, lambda: [optimizer], plan, SyncMode.ASYNC, 2, 2, 0)
    seen.clear()
    last({}, {})
    assert seen == [0.4]


@pytest.mark.parametrize("sync", ["flush", "gpipe", "2bw"])
def test_the_corrections_are_refused_where_their_rule_does_not_apply(sync: str) -> None:
    mode = SyncMode.parse(sync)
    check_corrections(mode, False, 0)  # nothing asked: nothing to refuse
    with pytest.raises(ValueError, match=r"weight_prediction=True.*sync='async'"):
        check_corrections(mode, True, 0)
    with pytest.raises(ValueError, match=r"lr_warmup_per_delay=3.*sync='async'"):
        check_corrections(mode, False, 3)
    with pytest.raises(ValueError, match=r"delay_lr_updates=0.*sync='async'"):
        check_corrections(mode, False, 0, delay_lr_updates=0)


def test_the_corrections_are_refused_with_tied_parameters_and_bad_values() -> None:
    with pytest.raises(ValueError, match=r"tied parameters.*tied: wte.weight"):
        check_corrections(SyncMode.ASYNC, True, 0, ["wte.weight"])
    with pytest.raises(ValueError, match=r"non-negative integer.*-1"):
        check_corrections(SyncMode.VERTICAL_SYNC, False, -1)
    check_corrections(SyncMode.VERTICAL_SYNC, True, 2)
    for bad in (-1, 1.5, True, "off"):
        with pytest.raises(ValueError, match=r"delay_lr_updates must be None.*pass None"):
            check_corrections(SyncMode.ASYNC, False, 0, delay_lr_updates=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tied parameters.*delay_lr_updates=10"):
        check_corrections(SyncMode.ASYNC, False, 0, ["wte.weight"], delay_lr_updates=10)
    check_corrections(SyncMode.ASYNC, False, 0, delay_lr_updates=0)
    check_corrections(SyncMode.VERTICAL_SYNC, True, 2, delay_lr_updates=100)


def test_the_oracle_tells_the_corrections_apart() -> None:
    """Guards the comparison below: each correction changes the weights."""
    plan, m = PLANS["3 stages"]
    results = {
        label: oracle.train(
            make_model(), plan, "async", make_batches(m), m, loss_fn, OPTIMIZERS["sgd"], *flags
        )
        for label, (flags, _) in {"none": ((False, 0, None), ()), **CORRECTIONS}.items()
    }
    for a in results:
        for b in results:
            if a < b:
                diff = max((results[a][k] - results[b][k]).abs().max().item() for k in results[a])
                assert diff > 1e-4, (a, b)


# ----- the pipeline against the oracle --------------------------------------------------------


def _train(rank: int, plan: Plan, sync: str, m: int, optimizer: str, flags) -> dict:  # type: ignore[no-untyped-def]
    """The runner's Lightning-sized steps (segments, lookahead, a drain at the end), as the
    strategy drives them."""
    prediction, per_delay, delay_lr_updates = flags
    model = make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    params = list(module.parameters())
    opt = OPTIMIZERS[optimizer](params) if params else None  # the last stage may have none
    apply = corrected_update(
        optimizer_update(module, opt),
        lambda: [opt] if opt else [],
        plan,
        SyncMode(sync),
        stage.index,
        per_delay,
        delay_lr_updates,
    )
    runner = PipelineRunner.create(
        plan, SyncMode(sync), m, module, rank, apply, torch.device("cpu"), 60.0,
        weight_prediction=prediction,
    )  # fmt: skip
    batches = make_batches(m)
    try:
        for t, (x, y) in enumerate(batches):
            xs, ys = x.chunk(m), y.chunk(m)
            runner.train_batch(
                lambda j, xs=xs: xs[j],
                lambda out, j, ys=ys: loss_fn(out, ys[j]),
                drain=t == len(batches) - 1,
            )
    finally:
        runner.close()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _cases(labels: list[str]):  # type: ignore[no-untyped-def]
    for label in labels:
        for sync in oracle.PER_MINIBATCH:
            for name, (flags, optimizers) in CORRECTIONS.items():
                for optimizer in optimizers:
                    yield label, sync, name, optimizer, flags


def _all_cases(rank: int, world: int, labels: list[str]) -> dict:
    out = {}
    for label, sync, name, optimizer, flags in _cases(labels):
        plan, m = PLANS[label]
        if rank < plan.num_workers:
            out[label, sync, name, optimizer] = _train(rank, plan, sync, m, optimizer, flags)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(BY_WORLD))
def test_the_corrected_pipeline_equals_the_oracle(world: int) -> None:
    labels = BY_WORLD[world]
    results = run(world, _all_cases, labels, timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    for label, sync, name, optimizer, flags in _cases(labels):
        plan, m = PLANS[label]
        expected = oracle.train(
            make_model(), plan, sync, make_batches(m), m, loss_fn, OPTIMIZERS[optimizer], *flags
        )
        for rank in range(plan.num_workers):
            got = results[rank][1][label, sync, name, optimizer]
            for key, tensor in got.items():
                diff = (tensor - expected[key]).abs().max().item()
                assert diff <= TOLERANCE, (
                    f"{label} {sync} {name}/{optimizer} rank {rank} {key}: {diff}"
                )
