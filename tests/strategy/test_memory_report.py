"""Memory per stage: the limit the planner gets, the plan it then picks, and what a fit reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan, PlanError, Stage
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.schedule.memory import stage_bytes as mode_bytes
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.memory_report import (
    StageMemory,
    estimate,
    parse_memory,
    plan_within,
    render,
)
from tests.runtime import oracle
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model
from tests.schedule.test_memory import LAYOUTS, built_counts
from tests.strategy import frames_script, memory_script, tied_script
from tests.strategy.launched import launched

MiB = 2**20


def test_memory_sizes_parse_and_bad_ones_are_refused() -> None:
    assert parse_memory(None) is None
    assert parse_memory(1024) == 1024
    assert parse_memory("8GiB") == 8 * 2**30
    assert parse_memory("512 MB") == 512e6
    assert parse_memory("3kib") == 3072
    for bad in ("lots", "8 parsecs", 0, "-1GiB"):
        with pytest.raises(ValueError, match="memory must be"):
            parse_memory(bad)


def profile() -> Profile:
    """Four equal layers, the second with large weights: the best split by time is 2-2, but
    its first stage stashes ceil(1 / 1) x (weights + activations) = 43 MiB. Every layer outputs
    1 MiB: on two stages each holds 3 MiB of frames (two messages in flight, one receive
    posted ahead; ``schedule.memory.frame_bytes``)."""
    return Profile.chain(
        [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [MiB] * 4, [MiB, 40 * MiB, MiB, MiB]
    )


def make(memory: float | None) -> Plan:
    return make_plan(profile(), Topology.flat(2, 1e12), straight=True, memory=memory)


ASYNC = (SyncMode.ASYNC, 4)  # plan_within's sync and microbatches


def stage_bytes(plan: Plan, stage: Stage, recompute: bool = False) -> float:
    """What a stage of ``plan`` needs in ``async`` with 4 microbatches per batch."""
    return mode_bytes(plan, SyncMode.ASYNC, 4, stage.index, recompute)


def test_a_memory_limit_makes_the_planner_pick_another_plan() -> None:
    free = make(None)
    first = free.stages[0]
    assert first.nodes == ("layer0", "layer1") and first.activation_bytes == 2 * MiB
    assert estimate(free, first, SyncMode.ASYNC, 4, False)[3] == 46 * MiB  # the planner's figure
    # two versions, two minibatches in flight, 3 MiB of frames
    assert stage_bytes(free, first) == 2 * 43 * MiB + 3 * MiB
    limited = plan_within(make, 50 * MiB, 47 * MiB, *ASYNC)
    assert [s.nodes for s in limited.stages] == [("layer0",), ("layer1", "layer2", "layer3")]
    assert [stage_bytes(limited, s) for s in limited.stages] == [7 * MiB, 48 * MiB]


def test_no_plan_fits_names_the_smallest_memory_that_does() -> None:
    with pytest.raises(PipelineSetupError, match="the smallest that fits") as caught:
        plan_within(make, 10 * MiB, 47 * MiB, *ASYNC)
    message = str(caught.value)
    assert "recompute=True" in message and "more devices" in message
    need = float(message.split("the smallest that fits: ")[1].split(" bytes")[0])
    # the best split's largest stage: layers 1-3, weights and activations of one minibatch,
    # and its frames
    assert 48 * MiB <= need <= 48 * MiB * 1.002
    assert plan_within(make, need, 47 * MiB, *ASYNC).num_stages == 2
    with pytest.raises(PipelineSetupError):
        plan_within(make, need * 0.995, 47 * MiB, *ASYNC)  # and a little less does not fit
    with pytest.raises(PlanError):  # no limit, no search: the planner's own error
        plan_within(
            lambda m: make_plan(profile(), Topology.flat(9, 1e12), True, m), None, 1, *ASYNC
        )


def test_with_recompute_a_plan_fits_where_none_did() -> None:
    """Activations dominate: without recomputation the best any split does is 63 MiB (layer 0,
    then layers 1-3) and 60 MiB of frames (20 MiB messages); with it the first stage of the
    2-2 split keeps its two minibatches' inputs and one replay's activations, 44 MiB, and the
    same frames."""

    def make_wide(memory: float | None) -> Plan:
        wide = Profile.chain([1.0] * 4, [2.0] * 4, [20 * MiB] * 4, [MiB] * 4)
        return make_plan(wide, Topology.flat(2, 1e12), straight=True, memory=memory)

    with pytest.raises(PipelineSetupError, match="recompute=True") as caught:
        plan_within(make_wide, 110 * MiB, 84 * MiB, *ASYNC)
    need = float(str(caught.value).split("the smallest that fits: ")[1].split(" bytes")[0])
    assert 123 * MiB <= need <= 123 * MiB * 1.002
    recomputed = plan_within(make_wide, 110 * MiB, 84 * MiB, *ASYNC, recompute=True)
    assert [len(s.nodes) for s in recomputed.stages] == [2, 2]
    assert [stage_bytes(recomputed, s, True) for s in recomputed.stages] == [104 * MiB, 102 * MiB]


def test_vertical_sync_is_refused_a_plan_that_async_fits() -> None:
    """Under ``vertical_sync`` the last stage keeps the input stage's versions too: layers 1-3
    (42 MiB of weights) twice, 87 MiB, where ``async`` keeps them once, 45 MiB (3 MiB of frames
    each). The 2-2 split then fits best, at 2 x 41 + 2 x 2 + 3 = 89 MiB."""
    fitted = plan_within(make, 50 * MiB, 47 * MiB, SyncMode.ASYNC, 4)
    assert [len(s.nodes) for s in fitted.stages] == [1, 3]
    with pytest.raises(PipelineSetupError, match="sync: vertical_sync") as caught:
        plan_within(make, 50 * MiB, 47 * MiB, SyncMode.VERTICAL_SYNC, 4)
    need = float(str(caught.value).split("the smallest that fits: ")[1].split(" bytes")[0])
    assert 89 * MiB <= need <= 89 * MiB * 1.002
    kept = plan_within(make, need, 47 * MiB, SyncMode.VERTICAL_SYNC, 4)
    assert [len(s.nodes) for s in kept.stages] == [2, 2]


def sized(replicas: list[int]) -> Plan:
    """A pipeline of ``replicas`` whose every stage has 1 byte of weights and of activations."""
    plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
    ones = {"parameter_bytes": 1.0, "activation_bytes": 1.0}
    return Plan(tuple(Stage(**{**s.__dict__, **ones}) for s in plan.stages))


@pytest.mark.parametrize("sync", list(SyncMode), ids=str)
def test_the_reported_counts_are_those_the_built_schedule_keeps(sync: SyncMode) -> None:
    """The estimate's versions (stashed / weights + 1) and minibatches in flight (activations /
    activation bytes) per stage equal the most any rank of the stage holds in the schedule."""
    for replicas in LAYOUTS:
        plan = sized(replicas)
        for microbatches in (1, 2, 4, 6, 12):
            try:
                built = built_counts(plan, sync, microbatches)
            except ValueError:  # counts the mode cannot serve
                continue
            reported = []
            for stage in plan.stages:
                weights, stashed, activations, _ = estimate(plan, stage, sync, microbatches, False)
                reported.append((int(stashed / weights) + 1, int(activations)))
            assert reported == built, (replicas, microbatches)


def test_the_estimate_follows_the_paper_rule_per_mode() -> None:
    plan = make(None)
    first = plan.stages[0]  # warm-up 1: two versions and two minibatches in flight
    w, a = first.parameter_bytes, first.activation_bytes
    assert estimate(plan, first, SyncMode.ASYNC, 4, False)[:3] == (w, w, 2 * a)
    assert estimate(plan, first, SyncMode.TWO_BW, 4, False)[:3] == (w, w, 2 * a)
    assert estimate(plan, first, SyncMode.FLUSH, 1, False)[:3] == (w, 0, a)
    assert estimate(plan, first, SyncMode.GPIPE, 8, False)[:3] == (w, 0, 8 * a)
    # recompute: inputs in flight (none profiled for the first stage) plus one replay
    assert estimate(plan, first, SyncMode.ASYNC, 4, True)[2] == a
    last = plan.stages[1]  # keeps its graph: its loss is the user's training_step
    assert estimate(plan, last, SyncMode.ASYNC, 4, True) == estimate(
        plan, last, SyncMode.ASYNC, 4, False
    )
    unprofiled = Plan.from_balance([2, 2])
    assert estimate(unprofiled, unprofiled.stages[0], SyncMode.ASYNC, 4, False) == (None,) * 4
    row = StageMemory(0, 0, MiB, 2 * MiB, 3 * MiB, 4 * MiB, None, MiB, MiB, MiB, None)
    table = render([row])
    assert "10.000" in table and "3.000" in table and "memory per stage" in table


def launch(tmp_path: Path, *args: str) -> dict[int, tuple[str, object]]:
    """``memory_script``'s ``main`` on 2 ranks forked from this process (``launched``)."""
    return launched(2, memory_script.main, ["--out", str(tmp_path), *args], tmp_path)


def succeeded(results: dict[int, tuple[str, object]]) -> None:
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"


def weights(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for r in (0, 1) for k, v in torch.load(out / f"rank{r}.pt").items()}


@pytest.mark.slow
def test_a_fit_with_recompute_equals_the_oracle_and_reports_less_activation_memory(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    configs = ["async:0:0", "async:1:0", "flush:1:0", "async:0:1", "async:1:1"]
    succeeded(launch(tmp_path, "--configs", *configs))
    printed = capfd.readouterr()
    plan, m = Plan.from_balance([3, 3]), 2
    for sync in ("async", "flush"):
        expected = oracle.train(
            make_model(), plan, sync, make_batches(m), m, loss_fn, OPTIMIZERS["sgd"]
        )
        got = weights(tmp_path / f"{sync}-1-0")
        for key, tensor in expected.items():
            assert (got[f"net.{key}"] - tensor).abs().max().item() <= 1e-6, (sync, key)
    plain, recomputed = weights(tmp_path / "async-0-1"), weights(tmp_path / "async-1-1")
    for key, tensor in plain.items():  # dropout: the replay drew the same numbers
        assert torch.equal(tensor, recomputed[key]), key
    reports = {}
    for config in ("async-0-0", "async-1-0"):
        rows = json.loads((tmp_path / config / "report.json").read_text())["rows"]
        reports[config] = {row["rank"]: StageMemory(**row) for row in rows}
    for rank in (0, 1):
        row = reports["async-0-0"][rank]
        params = sum(p.numel() * 4 for p in list(make_model().parameters()))
        assert row.stage == rank and row.weights > 0 and row.activations > 0
        assert row.optimizer == row.weights  # SGD's momentum: one buffer per weight
        assert 0 < row.weights < params
    # stage 0 keeps two minibatches in flight; with recompute only their inputs
    assert reports["async-1-0"][0].activations < reports["async-0-0"][0].activations
    assert reports["async-0-0"][0].stashed > 0  # async stashes a second version
    assert "PipeDream memory per stage" in printed.out + printed.err


@pytest.mark.slow
def test_an_automatic_plan_that_cannot_fit_stops_at_setup_naming_the_memory(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    results = launch(tmp_path, "--memory", "64", "--devices", "2", "--configs", "async:0:0")
    assert any(status == "error" for status, _ in results.values()), results
    printed = capfd.readouterr()
    text = "".join(str(value) for _, value in results.values()) + printed.out + printed.err
    assert "no pipeline fits the memory per device (memory: 64 bytes" in text, text[-3000:]
    need = float(text.split("the smallest that fits: ")[1].split(" bytes")[0])
    assert math.isfinite(need) and need > 64
    succeeded(launch(tmp_path, "--memory", str(int(need) + 1), "--devices", "2"))
    report = json.loads((tmp_path / "async-1-0" / "report.json").read_text())
    for stage in report["plan"]["stages"]:
        assert stage["activation_bytes"] > 0  # a profiled plan: the estimate is filled in
    assert all(row["estimate_weights"] is not None for row in report["rows"])


@pytest.mark.slow
def test_recompute_with_tied_parameters_equals_the_run_without(tmp_path: Path) -> None:
    """The tied parameter's version of a minibatch is kept with its weights for the replay
    (``tied_script``'s fits on ranks forked from this process)."""
    configs = ["async:sgd", "flush:sgd"]
    for flag, folder in (((), "plain"), (("--recompute",), "recomputed")):
        argv = ["--balance", "1", "3", "--configs", *configs, "--out", str(tmp_path / folder)]
        succeeded(launched(2, tied_script.main, [*argv, *flag], tmp_path))
    for config in ("async-sgd", "flush-sgd"):
        plain = torch.load(tmp_path / "plain" / config / "weights.pt")
        recomputed = torch.load(tmp_path / "recomputed" / config / "weights.pt")
        assert sorted(plain) == sorted(recomputed)
        for key, tensor in plain.items():
            assert (tensor - recomputed[key]).abs().max().item() <= 1e-6, (config, key)


@pytest.mark.slow
def test_the_reported_frames_are_those_the_channel_held(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Three ranks over gloo, 32 KiB activations: each rank's channel held, at its peak, the
    estimate's frames (the schedule's messages in flight per link, one receive posted per
    link) to within 5 % (measured: 3.2-4.0 %): a frame adds its 512-byte header and 512 bytes
    of room to the 32 KiB it carries, and a link's first message comes after a 512-byte
    notice of its size."""
    argv = ["--out", str(tmp_path), "--devices", "3", "--syncs", "async", "flush"]
    succeeded(launched(3, frames_script.main, argv, tmp_path))
    printed = capfd.readouterr()
    for sync in ("async", "flush"):
        rows = [StageMemory(**r) for r in json.loads((tmp_path / f"{sync}.json").read_text())]
        assert [r.rank for r in rows] == [0, 1, 2]
        for row in rows:
            pairs = (
                (row.frames_sent, row.estimate_frames_sent),
                (row.frames_received, row.estimate_frames_received),
            )
            for measured, estimated in pairs:
                assert estimated is not None and estimated > 0, (sync, row)
                assert estimated <= measured <= 1.05 * estimated, (sync, row)
    assert "frames" in printed.out + printed.err  # the printed table's column
