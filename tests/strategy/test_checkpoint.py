"""Sharded checkpoints: one shard per stage plus ``pipeline.json``, read back and merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pl_pipedream.planner.plan import Plan
from pl_pipedream.strategy.checkpoint import (
    CheckpointError,
    check_layout,
    consolidate_checkpoint,
    is_sharded,
    merge_states,
    merged_checkpoint,
    optimizer_states,
    read_shards,
    remove,
    save,
    write_description,
    write_shard,
)
from pl_pipedream.strategy.stage import PipelineSetupError

PLAN = Plan.from_balance([2, 1], replicas=[2, 1])  # stage 0 on ranks 0 and 1, stage 1 on rank 2


def shard(stage: int) -> dict:
    """A Lightning checkpoint dict as ``stage`` sees it."""
    state = {f"net.{stage}.weight": torch.full((2,), float(stage)), "scale": torch.ones(1)}
    if stage == 1:
        state["scale"] = torch.zeros(1)  # every rank has the state outside the pipeline
    return {
        "epoch": 3 + stage,
        "state_dict": state,
        "optimizer_states": [{"stage": stage}],
    }


def write(path: Path) -> None:
    for stage in PLAN.stages:
        write_shard(path, stage.index, shard(stage.index))
    write_description(path, "async", 4, PLAN)


def test_shards_and_the_description_round_trip(tmp_path: Path) -> None:
    write(tmp_path / "run.ckpt")
    meta, shards = read_shards(tmp_path / "run.ckpt")
    assert meta["sync"] == "async" and meta["microbatches"] == 4
    assert meta["shards"] == ["stage-00.pt", "stage-01.pt"]
    assert Plan.from_dict(meta["plan"]) == PLAN
    assert [s["epoch"] for s in shards] == [3, 4]
    assert torch.equal(shards[1]["state_dict"]["net.1.weight"], torch.ones(2))


def test_save_writes_a_shard_per_stage_from_its_first_replica(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    for rank in range(PLAN.num_workers):
        stage = PLAN.stage_of_rank(rank)
        save(path, shard(stage.index), rank, stage, PLAN, "flush", 2)
        if rank == 1:  # the second replica of stage 0 writes nothing
            assert sorted(p.name for p in path.iterdir()) == ["pipeline.json", "stage-00.pt"]
    assert sorted(p.name for p in path.iterdir()) == ["pipeline.json", "stage-00.pt", "stage-01.pt"]
    assert read_shards(path)[0]["sync"] == "flush"


def test_merge_states_keeps_a_names_first_occurrence() -> None:
    first = {"a": torch.zeros(1), "shared": torch.zeros(1)}
    second = {"b": torch.ones(1), "shared": torch.ones(1)}
    merged = merge_states([first, second])
    assert list(merged) == ["a", "shared", "b"]
    assert merged["shared"] is first["shared"]


def test_merged_checkpoint_takes_every_stages_weights_and_the_rest_from_stage_zero() -> None:
    merged = merged_checkpoint([shard(0), shard(1)])
    assert merged["epoch"] == 3
    assert sorted(merged["state_dict"]) == ["net.0.weight", "net.1.weight", "scale"]
    assert torch.equal(merged["state_dict"]["scale"], torch.ones(1))


def test_consolidate_checkpoint_gives_the_full_state_dict(tmp_path: Path) -> None:
    write(tmp_path / "run.ckpt")
    state = consolidate_checkpoint(tmp_path / "run.ckpt")
    assert sorted(state) == ["net.0.weight", "net.1.weight", "scale"]
    assert torch.equal(state["scale"], torch.ones(1))  # stage 0's copy


def test_optimizer_states_are_the_stages_own_under_the_saved_layout(tmp_path: Path) -> None:
    write(tmp_path / "run.ckpt")
    saved = read_shards(tmp_path / "run.ckpt")
    assert optimizer_states(saved, PLAN, 1) == [{"stage": 1}]
    with pytest.raises(PipelineSetupError, match="resumes only under the plan that saved it"):
        optimizer_states(saved, Plan.from_balance([2, 1]), 1)


def test_check_layout_accepts_the_same_layers_and_replicas() -> None:
    check_layout(Plan.from_balance([3, 3]), Plan.from_dict(Plan.from_balance([3, 3]).to_dict()))


def test_check_layout_names_both_layouts_and_the_fix() -> None:
    with pytest.raises(PipelineSetupError) as error:
        check_layout(Plan.from_balance([3, 3]), Plan.from_balance([2, 4]))
    assert (
        "a checkpoint resumes only under the plan that saved it (saved: 1-1 with layers "
        "[['0', '1', '2'], ['3', '4', '5']], now: 1-1 with layers [['0', '1'], ['2', '3', '4', "
        "'5']]); resume with PipeDreamStrategy(plan=...) from the checkpoint's pipeline.json"
    ) in str(error.value)
    with pytest.raises(PipelineSetupError, match=r"saved: 2-1 .* now: 1-1"):
        check_layout(PLAN, Plan.from_balance([2, 1]))


def test_a_path_without_a_description_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "missing.ckpt"
    with pytest.raises(CheckpointError) as error:
        read_shards(path)
    assert f"pipeline.json and one shard per stage (path: {path}); pass the path" in str(
        error.value
    )


def test_a_missing_shard_names_the_file_and_the_stage(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    (path / "stage-01.pt").unlink()
    missing = path / "stage-01.pt"
    with pytest.raises(CheckpointError) as error:
        read_shards(path)
    assert f"needs every stage's shard (missing: {missing}, stage 1)" in str(error.value)


def test_is_sharded_needs_the_description(tmp_path: Path) -> None:
    write(tmp_path / "run.ckpt")
    assert is_sharded(tmp_path / "run.ckpt")
    (tmp_path / "empty").mkdir()
    torch.save({}, tmp_path / "plain.ckpt")
    assert not is_sharded(tmp_path / "empty")
    assert not is_sharded(tmp_path / "plain.ckpt")
    assert not is_sharded(tmp_path / "missing")


def test_remove_deletes_a_checkpoint_directory(tmp_path: Path) -> None:
    write(tmp_path / "run.ckpt")
    remove(tmp_path / "run.ckpt")
    assert not (tmp_path / "run.ckpt").exists()
    remove(tmp_path / "run.ckpt")  # already gone: nothing to do
