"""Resuming a checkpoint into one rank's stage under another plan (``core.resume``), one
process: stages of one layout save, stages of another load; checkpoints keyed by position (the
first format) resume under their own layout only; wrong names and shapes are listed at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream.core.checkpoint import read_shards, to_lightning, write_description, write_shard
from pl_pipedream.core.errors import CheckpointError, PipelineSetupError
from pl_pipedream.core.resume import (
    Resume,
    check_layout,
    check_state_names,
    optimizer_states,
    shapes_of,
)
from pl_pipedream.planner.plan import Plan
from tests.core.test_named_state import adam, keep, model, trained

PLAN = Plan.from_balance([2, 1])


def save(path: Path, stages: list[list[int]], positional: bool = False) -> nn.Sequential:
    """A checkpoint of ``model()`` trained 3 steps, saved by one rank per stage (``stages``:
    each stage's layers) as ``Resume.state_of`` writes it; returns the module."""
    module = model()
    whole = trained(module)
    records = []
    for index, layers in enumerate(stages):
        optimizer = adam(module)
        optimizer.load_state_dict(whole.state_dict())
        resume = Resume()
        resume.record(module, [optimizer])
        keep(optimizer, [module[i] for i in layers])
        state = optimizer.state_dict() if positional else resume.state_of([optimizer], optimizer)
        weights = {k: v for k, v in module.state_dict().items() if int(k[0]) in layers}
        shard = {"global_step": 3, "state_dict": weights, "optimizer_states": [state]}
        records.append(write_shard(path, index, shard))
    plan = Plan.from_balance([len(layers) for layers in stages])
    write_description(path, "flush", 2, plan, records, 3)
    return module


def resumed(
    path: Path, layers: list[int], plan: Plan, stage: int
) -> tuple[Resume, torch.optim.Adam]:
    """A rank of ``plan`` holding ``layers`` resumes ``path``: the module cut (the other
    layers on ``meta``), then the optimizers over the whole module cut down to the stage."""
    module = model()
    resume = Resume()
    checkpoint = resume.read(path, dict)
    resume.check_model(module.state_dict(), checkpoint, strict=True)
    for index, layer in enumerate(module):
        if index not in layers:
            layer.to("meta")
    resume.load_stage(module)
    optimizer = adam(module)
    resume.check_plan(plan, stage)
    resume.record(module, [optimizer])
    keep(optimizer, [module[i] for i in layers])
    resume.load_optimizers(checkpoint, [optimizer])
    return resume, optimizer


def test_each_stage_of_another_plan_loads_the_state_of_the_names_it_holds(tmp_path: Path) -> None:
    save(tmp_path / "run.ckpt", [[0, 1], [2]])
    reference = model()
    whole = trained(reference)
    expected = {n: whole.state[p] for n, p in reference.named_parameters()}
    plan = Plan.from_balance([1, 1, 1])
    for stage in range(3):
        _, optimizer = resumed(tmp_path / "run.ckpt", [stage], plan, stage)
        assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.5]
        held = dict(optimizer.state_dict()["state"])
        assert len(held) == 2  # the stage's weight and bias
        for state in held.values():
            assert float(state["step"]) == 3.0
        weight = optimizer.param_groups[0]["params"][0]
        exp_avg = optimizer.state[weight]["exp_avg"]
        assert torch.equal(exp_avg, expected[f"{stage}.weight"]["exp_avg"])


def test_each_rank_reads_only_the_shards_holding_its_names(tmp_path: Path) -> None:
    """Stage 0's shard always (the loops, callbacks and schedulers); the others where they
    hold a name the stage needs."""
    save(tmp_path / "run.ckpt", [[0, 1], [2]])
    plan = Plan.from_balance([1, 1, 1])
    reads = [sorted(resumed(tmp_path / "run.ckpt", [s], plan, s)[0].shards) for s in range(3)]
    assert reads == [[0], [0], [0, 1]]


def test_a_stage_takes_the_saved_weights_of_its_names_only(tmp_path: Path) -> None:
    saved = save(tmp_path / "run.ckpt", [[0, 1], [2]])
    module, resume = model(), Resume()
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    resume.read(tmp_path / "run.ckpt", dict)
    module[0].to("meta")
    resume.load_stage(module)
    for name, tensor in module.state_dict().items():
        if not name.startswith("0."):
            assert torch.equal(tensor, saved.state_dict()[name]), name


def test_to_lightning_gives_one_devices_optimizer_state(tmp_path: Path) -> None:
    save(tmp_path / "run.ckpt", [[0], [1, 2]])
    converted = to_lightning(tmp_path / "run.ckpt")
    whole = trained(model()).state_dict()
    assert sorted(converted["state_dict"]) == sorted(model().state_dict())
    state = converted["optimizer_states"][0]
    assert state["param_groups"] == whole["param_groups"]
    for index, value in whole["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state["state"][index][key], value[key])


def test_one_devices_checkpoint_is_named_by_the_recorded_order(tmp_path: Path) -> None:
    whole = trained(model()).state_dict()
    resume, module = Resume(), model()
    optimizer = adam(module)
    resume.check_plan(PLAN, 1)
    resume.record(module, [optimizer])
    keep(optimizer, [module[2]])
    resume.load_optimizers({"optimizer_states": [whole]}, [optimizer])
    bias = optimizer.param_groups[1]["params"][0]
    assert torch.equal(optimizer.state[bias]["exp_avg_sq"], whole["state"][5]["exp_avg_sq"])


def test_a_checkpoint_keyed_by_position_resumes_under_its_own_plan_only(tmp_path: Path) -> None:
    save(tmp_path / "old.ckpt", [[0, 1], [2]], positional=True)
    resume, optimizer = resumed(tmp_path / "old.ckpt", [2], PLAN, 1)
    assert resume.keyed_by_position
    assert float(optimizer.state_dict()["state"][0]["step"]) == 3.0
    with pytest.raises(PipelineSetupError) as error:
        resumed(tmp_path / "old.ckpt", [2], Plan.from_balance([1, 1, 1]), 2)
    assert "whose optimizer state is keyed by position resumes only under the plan" in str(
        error.value
    )
    assert "Trainer(devices=2) and PipeDreamStrategy(plan=Plan.from_dict(" in str(error.value)
    with pytest.raises(CheckpointError, match="keyed by name"):
        to_lightning(tmp_path / "old.ckpt")


def test_optimizer_states_are_the_stages_own_under_the_saved_layout(tmp_path: Path) -> None:
    save(tmp_path / "old.ckpt", [[0, 1], [2]], positional=True)
    saved = read_shards(tmp_path / "old.ckpt")
    assert optimizer_states(saved, PLAN, 1) == saved[1][1]["optimizer_states"]
    with pytest.raises(PipelineSetupError, match="resumes only under the plan that saved it"):
        optimizer_states(saved, Plan.from_balance([1, 2]), 1)


def test_check_layout_accepts_the_same_layers_and_replicas() -> None:
    check_layout(Plan.from_balance([3, 3]), Plan.from_dict(Plan.from_balance([3, 3]).to_dict()))


def test_check_layout_names_both_layouts_and_the_fix() -> None:
    with pytest.raises(PipelineSetupError) as error:
        check_layout(Plan.from_balance([3, 3]), Plan.from_balance([2, 4]))
    assert (
        "a checkpoint whose optimizer state is keyed by position resumes only under the plan "
        "that saved it (saved: 1-1 with layers [['0', '1', '2'], ['3', '4', '5']], now: 1-1 "
        "with layers [['0', '1'], ['2', '3', '4', '5']]); resume it once with "
        "Trainer(devices=2) and PipeDreamStrategy(plan="
    ) in str(error.value)
    replicated = Plan.from_balance([2, 1], replicas=[2, 1])
    with pytest.raises(PipelineSetupError, match=r"saved: 2-1 .* now: 1-1"):
        check_layout(replicated, Plan.from_balance([2, 1]))


def test_wrong_names_and_shapes_are_listed_in_one_error() -> None:
    model_state = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4), "c": torch.zeros(1)}
    saved = {"a.weight": torch.zeros(3, 2), "c": torch.zeros(1), "d.bias": torch.zeros(1)}
    with pytest.raises(CheckpointError) as error:
        check_state_names(model_state, shapes_of(saved))
    assert (
        "a checkpoint resumes into the model that saved it: the same state names and shapes "
        "(missing: [b.weight]; unexpected: [d.bias]; shapes: [a.weight [3, 2] in the "
        "checkpoint, [2, 3] in the model]); resume with the model"
    ) in str(error.value)
    with pytest.raises(CheckpointError, match=r"shapes \(shapes: \[a.weight"):
        check_state_names(model_state, shapes_of(saved), strict=False)
    check_state_names(model_state, shapes_of(model_state))
