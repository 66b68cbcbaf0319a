"""Sharded checkpoints: one shard per stage plus ``pipeline.json``, read back, checked and merged;
saved atomically by the strategy (the multi-process tests at the end)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from pl_pipedream.planner.plan import Plan
from pl_pipedream.strategy.atomic import retired_dir
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
        "global_step": 7,
        "state_dict": state,
        "optimizer_states": [{"stage": stage}],
    }


def write(path: Path, step: int = 7) -> list[dict]:
    """A complete checkpoint at ``step``; the shards' records."""
    records = []
    for stage in PLAN.stages:
        records.append(write_shard(path, stage.index, {**shard(stage.index), "global_step": step}))
    write_description(path, "async", 4, PLAN, records, step)
    return records


def test_shards_and_the_description_round_trip(tmp_path: Path) -> None:
    write(tmp_path / "run.ckpt")
    meta, shards = read_shards(tmp_path / "run.ckpt")
    assert meta["sync"] == "async" and meta["microbatches"] == 4
    assert [record["file"] for record in meta["shards"]] == ["stage-00.pt", "stage-01.pt"]
    assert Plan.from_dict(meta["plan"]) == PLAN
    assert [s["epoch"] for s in shards] == [3, 4]
    assert torch.equal(shards[1]["state_dict"]["net.1.weight"], torch.ones(2))


def test_the_description_records_every_shards_size_and_sha256(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    meta, _ = read_shards(path)
    assert meta["step"] == 7
    for record in meta["shards"]:
        data = (path / record["file"]).read_bytes()
        assert record["size"] == len(data)
        assert record["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_shard_cut_short_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    records = write(path)
    shard_file = path / "stage-01.pt"
    shard_file.write_bytes(shard_file.read_bytes()[:100])
    with pytest.raises(CheckpointError) as error:
        read_shards(path)
    assert (
        f"a shard must have the size pipeline.json records ({shard_file}: 100 bytes, "
        f"recorded: {records[1]['size']}); the file was cut short"
    ) in str(error.value)


def test_a_shard_of_the_right_size_but_other_bytes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    shard_file = path / "stage-00.pt"
    data = bytearray(shard_file.read_bytes())
    data[-30] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"must have the sha256 pipeline.json records \("):
        read_shards(path)
    with pytest.raises(CheckpointError) as error:
        consolidate_checkpoint(path)
    assert str(shard_file) in str(error.value)


def test_a_shard_from_another_save_is_refused(tmp_path: Path) -> None:
    """A directory mixing two saves: a shard of step 5 next to the description of step 7."""
    path, other = tmp_path / "run.ckpt", tmp_path / "old.ckpt"
    write(path, step=7)
    write(other, step=5)
    shutil.copy(other / "stage-01.pt", path / "stage-01.pt")
    with pytest.raises(CheckpointError, match=r"stage-01.pt: .* recorded: .*the file was"):
        read_shards(path)
    # Described as step 7 but holding step 5's shards with their true records: the step is wrong.
    meta = json.loads((other / "pipeline.json").read_text())
    meta["step"] = 7
    (other / "pipeline.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as error:
        read_shards(other)
    assert (
        f"every shard must come from the step pipeline.json records ({other / 'stage-00.pt'}: "
        "step 5, recorded: 7); the directory mixes two saves"
    ) in str(error.value)


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


def test_a_description_without_records_still_loads(tmp_path: Path) -> None:
    """Checkpoints saved before the records list only the shards' file names."""
    path = tmp_path / "run.ckpt"
    write(path)
    meta = json.loads((path / "pipeline.json").read_text())
    meta["shards"] = [record["file"] for record in meta["shards"]]
    del meta["step"]
    (path / "pipeline.json").write_text(json.dumps(meta))
    assert sorted(consolidate_checkpoint(path)) == ["net.0.weight", "net.1.weight", "scale"]


def test_a_checkpoint_left_aside_by_an_interrupted_publish_is_named(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    write(path)
    aside = retired_dir(path, "abc")
    path.rename(aside)
    with pytest.raises(CheckpointError) as error:
        read_shards(path)
    assert f"left the previous checkpoint at {aside}: rename it to {path}" in str(error.value)
