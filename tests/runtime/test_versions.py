"""Weight versions: snapshots in their own tensors, and a dropped snapshot's tensors reused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.runtime.versions import VersionError, WeightVersions


def _step(module: nn.Module, versions: WeightVersions) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    versions.mark_stepped()


def _pointers(snapshot: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in snapshot.items()}


def test_a_snapshot_keeps_its_values_while_the_live_weights_change() -> None:
    module = nn.Linear(3, 2)
    versions = WeightVersions(module)
    before = module.weight.detach().clone()
    snapshot = versions.get(0)
    _step(module, versions)
    assert torch.equal(snapshot["weight"], before)
    assert not torch.equal(module.weight, before)
    assert snapshot["weight"].is_leaf and snapshot["weight"].requires_grad


def test_a_released_snapshot_is_reused_for_a_later_version() -> None:
    module = nn.Linear(3, 2)
    versions = WeightVersions(module)
    first = _pointers(versions.get(0))
    _step(module, versions)
    versions.release([0])
    second = versions.get(1)
    assert _pointers(second) == first
    assert torch.equal(second["weight"], module.weight)
    assert torch.equal(second["bias"], module.bias)
    assert versions.count == 1 and versions.peak_count == 1


def test_kept_snapshots_never_share_tensors() -> None:
    module = nn.Linear(3, 2)
    versions = WeightVersions(module)
    zero = versions.get(0)
    _step(module, versions)
    one = versions.get(1)
    assert set(_pointers(zero).values()).isdisjoint(_pointers(one).values())
    assert not torch.equal(zero["weight"], one["weight"])
    assert versions.peak_count == 2
    assert versions.peak_bytes == 2 * sum(p.numel() * 4 for p in module.parameters())


def test_spares_count_as_held_memory_until_reset() -> None:
    module = nn.Linear(3, 2)
    versions = WeightVersions(module)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    versions.get(0)
    versions.release([0])
    assert versions.count == 0 and versions.nbytes == 0
    assert versions.held_bytes == size
    versions.reset(0)
    assert versions.held_bytes == 0
    _step(module, versions)
    with pytest.raises(VersionError, match="no copy of version 5 was kept"):
        versions.get(5)
