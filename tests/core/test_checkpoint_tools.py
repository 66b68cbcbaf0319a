"""``core.checkpoint_tools``: inspect, to-torch and from-torch over the format's own functions;
a checkpoint saved by a real 2-stage Trainer run at the end (multi-process)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pl_pipedream.core.atomic import leftovers
from pl_pipedream.core.checkpoint import consolidate_checkpoint, read_shards
from pl_pipedream.core.checkpoint_tools import (
    describe,
    from_torch,
    read_state_dict,
    require_checkpoint,
    to_lightning_file,
    to_torch,
)
from pl_pipedream.core.errors import CheckpointError
from tests.core.test_checkpoint import write


def every_dtype() -> dict[str, torch.Tensor]:
    """A state dict of several dtypes and shapes, NaN and -0.0 included (bit-for-bit checks)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 3, generator=generator)
    weight[0, 0], weight[0, 1] = float("nan"), -0.0
    return {
        "net.0.weight": weight,
        "net.0.bias": torch.randn(5, generator=generator, dtype=torch.float64),
        "net.1.running_mean": torch.randn(4, generator=generator).to(torch.bfloat16),
        "net.1.num_batches_tracked": torch.tensor(7),
        "scale": torch.ones(()),
    }


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and bytes(a[n].contiguous().flatten().view(torch.uint8).numpy())
        == bytes(b[n].contiguous().flatten().view(torch.uint8).numpy())
        for n in a
    )


# ----- inspect ------------------------------------------------------------------------------------


def test_describe_names_the_step_plan_shards_and_every_name(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    records = write(path, step=7)
    text = describe(path)
    assert "step          7" in text
    assert "sync          async" in text
    assert "microbatches  4" in text
    assert "configuration        2-1 on 3 workers" in text  # the saving plan, replicas
    assert "0,1" in text and "0-1" in text  # stage 0's layers and its two ranks
    for stage, record in enumerate(records):
        assert f"stage {stage:<3} {record['file']:<14} {record['size']:>14,} bytes" in text
        assert record["sha256"][:16] in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if "net." in line}
    assert rows["net.0.weight"] == ["[2]", "float32", "0"]
    assert rows["net.1.weight"] == ["[2]", "float32", "1"]
    scale = next(line for line in text.splitlines() if line.strip().startswith("scale "))
    assert scale.split()[1:] == ["[1]", "float32", "0,1"]  # held by both stages
    assert "names (3, 20 bytes)" in text
    assert "optimizer_states" in text.splitlines()[-1]


def test_describe_checks_the_shards_sha256_first(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    shard = path / "stage-01.pt"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="must have the sha256"):
        describe(path)


# ----- to-torch -----------------------------------------------------------------------------------


def test_to_torch_writes_what_consolidate_checkpoint_returns(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    out = tmp_path / "weights.pt"
    returned = to_torch(path, out)
    written = torch.load(out, weights_only=True)
    assert same_bits(written, consolidate_checkpoint(path))
    assert same_bits(returned, written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt", "weights.pt"]


def test_to_torch_into_a_missing_directory_names_it(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    with pytest.raises(CheckpointError, match="no directory .*; create it first"):
        to_torch(path, tmp_path / "nowhere" / "weights.pt")


def test_to_lightning_file_into_a_missing_directory_names_it_and_writes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.ckpt"
    write(path)
    with pytest.raises(CheckpointError, match=r"^to-lightning writes into an existing directory"):
        to_lightning_file(path, tmp_path / "nowhere" / "one.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]


# ----- from-torch ---------------------------------------------------------------------------------


def test_from_torch_round_trips_bit_for_bit_through_the_checked_format(tmp_path: Path) -> None:
    state = every_dtype()
    torch.save(state, tmp_path / "plain.pt")
    out = tmp_path / "run.ckpt"
    plan = from_torch(tmp_path / "plain.pt", out, layers=3)
    meta, shards = read_shards(out)  # every shard checked against its sha256 record
    assert same_bits(consolidate_checkpoint(out), state)
    assert [list(s.nodes) for s in plan.stages] == [["0", "1", "2"]]
    assert meta["plan"]["stages"][0]["ranks"] == [0] and meta["step"] == 0
    assert (meta["sync"], meta["microbatches"]) == ("flush", 1)
    record = meta["shards"][0]
    data = (out / "stage-00.pt").read_bytes()
    assert {key: record[key] for key in ("file", "size", "sha256")} == {
        "file": "stage-00.pt",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert record["shapes"] == {name: list(tensor.shape) for name, tensor in state.items()}
    (checkpoint,) = shards
    assert checkpoint["global_step"] == 0 and checkpoint["epoch"] == 0
    assert checkpoint["optimizer_states"] == [] and checkpoint["lr_schedulers"] == []
    assert checkpoint["pytorch-lightning_version"].count(".") >= 2
    assert leftovers(out) == []  # published: no staging directory left beside it
    back = tmp_path / "back.pt"
    to_torch(out, back)
    assert same_bits(torch.load(back, weights_only=True), state)
    assert "configuration        1 on 1 workers" in describe(out)


def test_from_torch_takes_a_lightning_checkpoints_state_dict(tmp_path: Path) -> None:
    state = every_dtype()
    lightning = {"epoch": 4, "global_step": 90, "state_dict": state, "optimizer_states": [{}]}
    torch.save(lightning, tmp_path / "model.ckpt")
    from_torch(tmp_path / "model.ckpt", tmp_path / "run.ckpt")
    assert same_bits(consolidate_checkpoint(tmp_path / "run.ckpt"), state)
    _, (checkpoint,) = read_shards(tmp_path / "run.ckpt")
    assert checkpoint["global_step"] == 0 and checkpoint["optimizer_states"] == []


def test_from_torch_reads_a_legacy_torch_save_file(tmp_path: Path) -> None:
    state = every_dtype()
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    from_torch(tmp_path / "old.pt", tmp_path / "run.ckpt")
    assert same_bits(consolidate_checkpoint(tmp_path / "run.ckpt"), state)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([torch.ones(1)], r"names mapped to tensors \(input: .* holds list\)"),
        ({}, r"holds dict \(empty\)"),
        ({"w": torch.ones(1), "step": 3}, r"entry 'step': int\); save one with torch.save"),
    ],
)
def test_from_torch_refuses_what_is_not_a_state_dict(
    tmp_path: Path, content: object, message: str
) -> None:
    torch.save(content, tmp_path / "in.pt")
    with pytest.raises(CheckpointError, match=message):
        from_torch(tmp_path / "in.pt", tmp_path / "run.ckpt")
    assert not (tmp_path / "run.ckpt").exists()


def test_from_torch_refuses_a_file_torch_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "in.pt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="a file written by torch.save .*; pass a state"):
        read_state_dict(tmp_path / "in.pt")


def test_from_torch_refuses_a_missing_input_and_a_pipeline_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no such file\); pass a state dict saved with"):
        from_torch(tmp_path / "missing.pt", tmp_path / "run.ckpt")
    write(tmp_path / "saved.ckpt")
    with pytest.raises(CheckpointError, match="already a PipeDream checkpoint.*to-torch"):
        from_torch(tmp_path / "saved.ckpt", tmp_path / "run.ckpt")


def test_from_torch_never_replaces_an_existing_output(tmp_path: Path) -> None:
    torch.save(every_dtype(), tmp_path / "plain.pt")
    write(tmp_path / "run.ckpt")
    before = (tmp_path / "run.ckpt" / "pipeline.json").read_bytes()
    with pytest.raises(CheckpointError, match="already exists\\); remove it or choose another"):
        from_torch(tmp_path / "plain.pt", tmp_path / "run.ckpt")
    assert (tmp_path / "run.ckpt" / "pipeline.json").read_bytes() == before


# ----- paths that are not a checkpoint ------------------------------------------------------------


def test_a_file_is_not_a_checkpoint_and_from_torch_is_named(tmp_path: Path) -> None:
    torch.save(every_dtype(), tmp_path / "plain.pt")
    for call in (describe, require_checkpoint, lambda p: to_torch(p, tmp_path / "o.pt")):
        with pytest.raises(CheckpointError) as error:
            call(tmp_path / "plain.pt")
        assert "not a file (path: " in str(error.value)
        assert f"'pl-pipedream checkpoint from-torch {tmp_path / 'plain.pt'} OUT'" in str(
            error.value
        )


def test_a_missing_path_or_a_directory_without_description_names_save_checkpoint(
    tmp_path: Path,
) -> None:
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "nothing" / "run.ckpt", tmp_path / "empty", tmp_path / "none"):
        with pytest.raises(CheckpointError, match="pass the path given to trainer.save_checkpoint"):
            describe(path)


# ----- a checkpoint saved by a real 2-stage Trainer run -------------------------------------------

SCRIPT = Path(__file__).parents[1] / "strategy" / "checkpoint_script.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint_script.py``: 2 ranks, ``flush``, balance [3, 3], 2 microbatches, Adam, one
    epoch; ``ckpts/last.ckpt`` and rank 0's ``consolidate_checkpoint`` of it in ``weights.pt``."""
    out = tmp_path_factory.mktemp("saved")
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--epochs", "1", "--timeout", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.mark.slow
def test_inspect_describes_a_checkpoint_saved_by_two_stages(saved: Path) -> None:
    path = saved / "ckpts" / "last.ckpt"
    text = describe(path)
    meta = json.loads((path / "pipeline.json").read_text())
    assert f"step          {meta['step']}" in text and meta["step"] > 0
    assert "sync          flush" in text and "microbatches  2" in text
    assert "configuration        1-1 on 2 workers" in text
    assert "0,1,2" in text and "3,4,5" in text  # balance [3, 3]
    for stage, record in enumerate(meta["shards"]):
        assert f"stage {stage:<3} stage-0{stage}.pt" in text
        assert f"{(path / record['file']).stat().st_size:,} bytes" in text
    weights = torch.load(saved / "weights.pt", weights_only=True)
    _, shards = read_shards(path)
    for name, tensor in weights.items():
        (line,) = [ln for ln in text.splitlines() if ln.split()[:1] == [name]]
        stage = next(s for s, shard in enumerate(shards) if name in shard["state_dict"])
        shape, dtype = str(list(tensor.shape)).replace(" ", ""), str(tensor.dtype)[6:]
        assert line.split()[-2:] == [dtype, str(stage)]
        assert "".join(line.split()[1:-2]) == shape
    assert {0, 1} == {s for s, shard in enumerate(shards) if shard["state_dict"]}


@pytest.mark.slow
def test_to_torch_and_from_torch_round_trip_a_two_stage_checkpoint(
    saved: Path, tmp_path: Path
) -> None:
    path = saved / "ckpts" / "last.ckpt"
    to_torch(path, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert same_bits(plain, torch.load(saved / "weights.pt", weights_only=True))
    from_torch(tmp_path / "plain.pt", tmp_path / "one.ckpt", layers=6)
    assert same_bits(consolidate_checkpoint(tmp_path / "one.ckpt"), plain)
    text = describe(tmp_path / "one.ckpt")
    assert "configuration        1 on 1 workers" in text and "0..5 (6)" in text


def test_a_from_torch_shard_is_a_lightning_checkpoint_one_device_resumes_from(
    tmp_path: Path,
) -> None:
    """``stage-00.pt`` is Lightning's own checkpoint dict: a one-device fit resumes from it at
    step 0 with the file's weights and a fresh optimizer (Lightning's checks pass)."""
    from lightning.pytorch import Callback

    from tests.strategy.test_lightning_features import Net, loader, trainer

    torch.manual_seed(3)
    state = {n: t.clone() for n, t in Net().state_dict().items()}
    torch.save(state, tmp_path / "plain.pt")
    from_torch(tmp_path / "plain.pt", tmp_path / "run.ckpt", layers=6)
    seen: dict[str, object] = {}

    class Look(Callback):
        def on_train_start(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            seen["state"] = {n: t.clone() for n, t in module.state_dict().items()}
            seen["step"] = trainer.global_step
            seen["optimizer"] = trainer.optimizers[0].state_dict()["state"]

    torch.manual_seed(4)  # other initial weights: the checkpoint's must replace them
    shard = tmp_path / "run.ckpt" / "stage-00.pt"
    run = trainer(devices=1, max_steps=1, callbacks=[Look()], enable_checkpointing=False)
    run.fit(Net(), loader(2), ckpt_path=shard)
    assert same_bits(seen["state"], state)  # type: ignore[arg-type]
    assert seen["step"] == 0 and seen["optimizer"] == {}
