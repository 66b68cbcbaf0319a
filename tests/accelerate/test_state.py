"""``accelerator.save_state`` / ``load_state`` save and restore the pipeline through
Accelerate's hooks, in the sharded format: resumed (under another plan), training equals the
uninterrupted run and one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream.accelerate import prepare_pipeline
from pl_pipedream.accelerate.state import PIPELINE
from pl_pipedream.core.checkpoint import is_sharded
from tests.accelerate.ranks import accelerator_on
from tests.engine.test_pipeline import M, make_batches, make_model, one_device, sgd
from tests.runtime.distributed import run


def _save_then_resume(rank: int, world: int, path: str) -> dict:
    accelerator = accelerator_on(rank, world)
    batches = make_batches()
    model = make_model()
    pipeline = prepare_pipeline(
        accelerator,
        model,
        sgd(model.parameters()),
        nn.functional.mse_loss,
        microbatches=M,
        balance=[3, 3],
    )
    for batch in batches[:2]:
        pipeline.train_step(batch)
    accelerator.save_state(path)
    uninterrupted = [pipeline.train_step(batch).item() for batch in batches[2:]]
    pipeline.close()  # its hooks now do nothing
    model = make_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # not the saved weights: the load must bring them
    resumed = prepare_pipeline(
        accelerator,
        model,
        sgd(model.parameters()),
        nn.functional.mse_loss,
        microbatches=M,
        balance=[2, 4],  # another plan over the same layers
    )
    accelerator.load_state(path)
    steps = resumed.steps
    losses = [resumed.train_step(batch).item() for batch in batches[2:]]
    state = resumed.state_dict()["model"]
    resumed.close()
    return {"uninterrupted": uninterrupted, "resumed": losses, "steps": steps, "model": state}


@pytest.mark.slow
def test_load_state_resumes_the_pipeline_as_the_uninterrupted_run(tmp_path: Path) -> None:
    path = tmp_path / "state"
    results = run(2, _save_then_resume, str(path), timeout=120.0)
    losses, weights = one_device(make_batches())
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["steps"] == 2
        assert value["resumed"] == value["uninterrupted"]
        assert value["resumed"] == pytest.approx(losses[2:], abs=1e-6), rank
        merged.update(value["model"])
    assert merged.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name
    assert is_sharded(path / PIPELINE)  # the project's format, beside Accelerate's own files
    assert (path / "random_states_0.pkl").is_file() and (path / "random_states_1.pkl").is_file()
