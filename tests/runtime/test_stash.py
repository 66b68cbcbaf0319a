"""The weight stash: a snapshot shares the live storage until an update moves the live weights
to a new tensor, and a dropped snapshot's tensors are reused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.runtime import update
from pl_pipedream.runtime.stash import VersionError, WeightStash


def _step(module: nn.Module, versions: WeightStash) -> None:
    """An in-place update that first moves the parameters a kept snapshot shares."""
    params = dict(module.named_parameters())
    storage = versions.storage_for_update(params)
    update.move_storage({params[n]: t for n, t in storage.items()})
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    versions.mark_stepped(storage)


def _pointers(snapshot: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in snapshot.items()}


def _size(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_a_snapshot_shares_the_live_storage_and_costs_no_memory() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    snapshot = versions.get(0)
    assert _pointers(snapshot) == {n: p.data_ptr() for n, p in module.named_parameters()}
    assert snapshot["weight"].is_leaf and snapshot["weight"].requires_grad
    assert snapshot["weight"] is not module.weight
    assert versions.count == 1 and versions.nbytes == 0


def test_a_snapshot_keeps_its_values_while_the_live_weights_change() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    before = module.weight.detach().clone()
    snapshot = versions.get(0)
    _step(module, versions)
    assert torch.equal(snapshot["weight"], before)
    assert torch.equal(module.weight, before + 1)
    assert versions.nbytes == _size(module) == versions.peak_bytes


def test_storage_for_update_names_only_the_parameters_a_kept_snapshot_shares() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    assert versions.storage_for_update(["weight", "bias"]) == {}
    versions.get(0)
    fresh = versions.storage_for_update(["weight"])
    assert list(fresh) == ["weight"] and fresh["weight"].shape == module.weight.shape
    assert fresh["weight"].data_ptr() != module.weight.data_ptr()


def test_a_released_snapshot_is_reused_for_a_later_update() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    old = _pointers(versions.get(0))
    _step(module, versions)  # the live weights move; version 0 keeps the old storage
    versions.get(1)
    versions.release([0])
    assert versions.held_bytes == _size(module)  # the old storage is a spare now
    assert _pointers(versions.storage_for_update(["weight", "bias"])) == old
    assert versions.count == 1 and versions.peak_count == 2


def test_releasing_a_snapshot_of_the_live_version_keeps_no_spare() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    versions.get(0)
    versions.release([0])
    assert versions.count == 0 and versions.held_bytes == 0


def test_kept_snapshots_never_share_tensors() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    zero = versions.get(0)
    _step(module, versions)
    one = versions.get(1)
    assert set(_pointers(zero).values()).isdisjoint(_pointers(one).values())
    assert not torch.equal(zero["weight"], one["weight"])
    assert versions.peak_count == 2


def test_reset_forgets_snapshots_and_spares() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module)
    versions.get(0)
    _step(module, versions)
    versions.release([0])
    assert versions.held_bytes == _size(module)
    versions.reset(0)
    assert versions.held_bytes == 0
    _step(module, versions)
    with pytest.raises(VersionError, match="no copy of version 5 was kept"):
        versions.get(5)


def _sgd_update(module: nn.Module, versions: WeightStash, optimizer, with_grad: bool) -> None:  # type: ignore[no-untyped-def]
    """One SGD update through runtime.update; without a gradient nothing changes or moves."""
    params = dict(module.named_parameters())
    for param in params.values():
        param.grad = torch.ones_like(param) if with_grad else None
    names = list(params) if with_grad else []
    storage = versions.storage_for_update(names)
    update.step(optimizer, {params[n]: t for n, t in storage.items()})
    versions.mark_stepped(storage)


def test_a_storage_two_versions_share_is_no_spare_while_one_of_them_is_kept() -> None:
    module = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    versions = WeightStash(module)
    versions.get(0)
    _sgd_update(module, versions, optimizer, with_grad=True)  # version 1 in new storage
    versions.get(1)
    _sgd_update(module, versions, optimizer, with_grad=False)  # version 2 = version 1's storage
    two = versions.get(2)
    values = {name: tensor.clone() for name, tensor in two.items()}
    _sgd_update(module, versions, optimizer, with_grad=True)
    versions.release([0, 1])
    versions.get(3)
    _sgd_update(module, versions, optimizer, with_grad=True)
    for name, tensor in two.items():
        assert torch.equal(tensor, values[name]), name
    versions.release([2])
    pointers = [t.data_ptr() for spares in versions._spares.values() for t in spares]
    assert len(pointers) == len(set(pointers))


def test_an_in_place_change_of_shared_weights_is_an_error_not_a_silent_one() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module, "rank 0 (stage 0)")
    versions.get(0)
    with torch.no_grad():
        module.weight.clamp_(-0.1, 0.1)
    with pytest.raises(VersionError, match=r"rank 0 \(stage 0\), parameter: weight\)"):
        versions.storage_for_update(["weight", "bias"])


def test_an_update_that_writes_the_shared_storage_is_refused() -> None:
    module = nn.Linear(3, 2)
    versions = WeightStash(module, "rank 1 (stage 1)")
    versions.get(0)
    storage = versions.storage_for_update(["weight"])
    with torch.no_grad():
        module.weight.add_(1.0)  # in place, into the storage version 0 shares
    with pytest.raises(VersionError, match=r"rank 1 \(stage 1\), parameter: weight\)"):
        versions.mark_stepped(storage)
