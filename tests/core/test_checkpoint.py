"""Sharded checkpoints: one shard per stage plus ``pipeline.json``, read back, checked and merged;
saved atomically by the strategy (the multi-process test at the end: ``checkpoint_script.py`` on
two ranks forked from this process, one of them killed mid-save)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from pl_pipedream.core.atomic import leftovers, retired_dir
from pl_pipedream.core.checkpoint import (
    consolidate_checkpoint,
    is_sharded,
    merge_states,
    merged_checkpoint,
    read_shards,
    remove,
    write_description,
    write_shard,
)
from pl_pipedream.core.errors import CheckpointError
from pl_pipedream.planner.plan import Plan
from tests.runtime import launched
from tests.runtime.launched import Launch, Rank
from tests.runtime.test_executor import NUM_BATCHES
from tests.strategy import checkpoint_script

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


STEPS = NUM_BATCHES  # per epoch


def script_rank(rank: int, argv: list[str]) -> None:
    checkpoint_script.main(argv)


def start(out: Path, *extra: str) -> Launch:
    """``checkpoint_script.py``'s two ranks (flush, ``timeout=20``), forked from this process
    as a launcher starts them; their output goes beside ``out``."""
    argv = ["--out", str(out), "--timeout", "20", *extra]
    return launched.start(2, script_rank, argv, folder=out.parent / f"{out.name}-ranks")


def failure(ranks: list[Rank]) -> str:
    return "\n".join(f"rank {r} ({end.code}): {end.stderr[-2000:]}" for r, end in enumerate(ranks))


def checkpoints(directory: Path) -> dict[str, int]:
    """Every entry of ``directory`` (hidden ones too) and the step its checkpoint records."""
    return {p.name: read_shards(p)[0]["step"] for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_resumes_bit_exactly(
    tmp_path: Path,
) -> None:
    """Rank 1 stops halfway through writing its shard of ``last.ckpt`` at the end of epoch 1
    and is killed: rank 0 stops naming it within the timeout, ``last.ckpt`` still holds epoch
    0, and training on from it gives the uninterrupted run's weights, bit for bit. Both runs
    keep the checkpoints ``save_top_k=2`` and ``save_last`` ask for, and nothing else."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    straight.mkdir()
    crashed.mkdir()
    expected = {
        f"epoch=1-step={2 * STEPS}.ckpt": 2 * STEPS,
        f"epoch=2-step={3 * STEPS}.ckpt": 3 * STEPS,
        "last.ckpt": 3 * STEPS,
    }
    ranks = start(crashed, "--block")
    blocked = crashed / "blocked"
    deadline = time.monotonic() + 90
    while not blocked.is_file() and ranks.all_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert blocked.is_file(), failure(ranks.wait(5))
    os.kill(int(blocked.read_text()), signal.SIGKILL)
    killed = time.monotonic()
    ends = ranks.wait(60)
    assert ends[1].code == -signal.SIGKILL, failure(ends)
    assert ends[0].code != 0 and time.monotonic() - killed < 20, failure(ends)
    assert "could not receive stage 1's shard record from rank 1" in ends[0].stderr, failure(ends)
    last = crashed / "ckpts" / "last.ckpt"
    assert read_shards(last)[0]["step"] == STEPS  # the previous save, whole
    assert leftovers(last), "the kill did not interrupt a save of last.ckpt"

    # ckpt_path="last": ModelCheckpoint looks for "last" in its directory's names, and the
    # staging directory left by the kill has none. The uninterrupted run follows in the same
    # launch, into "straight".
    ends = start(crashed, "--resume", "last", "--straight-out", str(straight)).wait(200)
    assert [end.code for end in ends] == [0, 0], failure(ends)
    assert checkpoints(straight / "ckpts") == expected
    # The crashed run's complete epoch-1 checkpoint keeps its name and the resumed run's gets a
    # version suffix (Lightning does so for any existing file); the leftovers are gone.
    assert checkpoints(crashed / "ckpts") == {
        **expected,
        f"epoch=1-step={2 * STEPS}-v1.ckpt": 2 * STEPS,
    }
    want, got = torch.load(straight / "weights.pt"), torch.load(crashed / "weights.pt")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
