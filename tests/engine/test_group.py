"""Joining the group a ``Pipeline`` runs in: outside any group and without torchrun's variables
the constructor refuses, naming both ways to start; the device follows the group's backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream import Pipeline
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.engine.group import TORCHRUN, default_device
from tests.engine.test_pipeline import make_model, sgd
from tests.runtime.distributed import one_rank_group


def test_outside_a_process_group_names_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    for name in TORCHRUN:
        monkeypatch.setenv(name, "0")  # set, then removed: monkeypatch restores either way
        monkeypatch.delenv(name)
    with pytest.raises(
        PipelineSetupError,
        match=r"a Pipeline runs in a process group \(none joined, and torchrun's variables are "
        r"not set: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE\); start the script with torchrun",
    ):
        Pipeline(make_model(), nn.functional.mse_loss, sgd, balance=[6])


def test_a_gloo_group_runs_on_the_cpu() -> None:
    with one_rank_group():
        assert default_device() == torch.device("cpu")
