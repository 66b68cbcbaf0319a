"""``Pipeline.save`` / ``load``: the sharded format, consolidated for one device, resumed under
another plan; equal to one device's uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream import Pipeline, consolidate_checkpoint
from pl_pipedream.core.errors import CheckpointError
from tests.engine.test_pipeline import M, make_batches, make_model, one_device, sgd
from tests.runtime.distributed import run

pytestmark = pytest.mark.slow


def _save(rank: int, world: int, path: str) -> list[float]:
    with Pipeline(make_model(), nn.functional.mse_loss, sgd, microbatches=M, balance=[3, 3]) as p:
        losses = [p.train_step(batch).item() for batch in make_batches()[:2]]
        p.save(path, extra={"epoch": 1, "note": "halfway"})  # the caller's own state
    return losses


def _resume(rank: int, world: int, path: str) -> dict:
    with Pipeline(
        make_model(), nn.functional.mse_loss, sgd, microbatches=M, balance=[2, 2, 2]
    ) as p:
        try:
            p.load(path + "-nowhere")
        except CheckpointError as error:
            refused = str(error)
        extra = p.load(path)
        steps = p.steps
        losses = [p.train_step(batch).item() for batch in make_batches()[2:]]
        return {
            "losses": losses,
            "steps": steps,
            "extra": extra,
            "state": p.state_dict(),
            "refused": refused,
        }


def test_a_checkpoint_saved_on_two_stages_resumes_on_three_as_one_device(tmp_path: Path) -> None:
    path = str(tmp_path / "run.ckpt")
    saved = run(2, _save, path, timeout=120.0)
    assert all(status == "ok" for status, _ in saved.values()), saved
    _, halfway = one_device(make_batches()[:2])
    whole = consolidate_checkpoint(path)
    assert whole.keys() == halfway.keys()
    for name, tensor in halfway.items():
        assert torch.allclose(whole[name], tensor, rtol=0, atol=1e-6), name
    resumed = run(3, _resume, path, timeout=120.0)
    losses, weights = one_device(make_batches())  # momentum state must have come along
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in resumed.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["steps"] == 2
        assert value["extra"] == {"epoch": 1, "note": "halfway"}  # on every rank
        assert value["losses"] == pytest.approx(losses[2:], abs=1e-6), rank
        assert value["refused"].startswith("Pipeline.load reads the directory Pipeline.save")
        merged.update(value["state"]["model"])
    for name, tensor in weights.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
