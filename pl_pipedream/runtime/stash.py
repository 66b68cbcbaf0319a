"""The weight stash: the weight versions a stage keeps for its backward passes (SOSP'19 3.3).

The optimizer owns the stage's live parameters. Every forward pass runs functionally on a
snapshot of its weight version, and the backward pass of the same minibatch reuses that
snapshot, so autograd never sees a tensor change under it; a snapshot is dropped as soon as the
schedule no longer names its version. Buffers (BatchNorm running statistics) are not
versioned: they live in the module and every forward updates them.

A snapshot of the live version costs nothing when it is taken: its tensors share the live
parameters' storage. The copy, if any, is left to the update that would change them:
``storage_for_update(names)`` hands the update one tensor per shared parameter to hold the new
values, and the update makes it the parameter's storage (``runtime.update``), so the snapshot
keeps the old storage untouched; ``mark_stepped`` checks that it did. An update with an
out-of-place form (plain SGD) writes its result straight into that tensor and no weights are ever
copied; any other optimizer first copies the live values into it and steps in place there. So
while a snapshot shares them, nothing but an update may write the live parameters:
``storage_for_update`` raises if one was changed in place meanwhile (the parameter's version
counter moved), rather than let a stashed version change under a backward pass.

A dropped snapshot's tensors are kept as spares for the next update: reusing them costs
nothing, where new memory would cost the allocator (and the kernel, in page faults) a stage's
worth every minibatch. ``reset`` frees them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pl_pipedream.runtime.functional import ParameterSlots
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["VersionError", "WeightStash"]


class VersionError(RuntimeError):
    """The schedule asked for a weight version this stage cannot provide."""


class WeightStash:
    """Snapshots of a module's parameters keyed by version (number of updates applied);
    the parameters named in ``exclude`` are left out (their versions are kept elsewhere).

    ``live_version`` counts the updates applied to the live parameters; ``mark_stepped`` raises
    it after each update. ``count`` is the number of versions kept for the actions
    ahead (the live one included when it has a snapshot); ``nbytes`` the memory they take
    beyond the live parameters.
    """

    def __init__(
        self, module: nn.Module, describe: str = "this stage", exclude: Iterable[str] = ()
    ) -> None:
        self.module = module
        self.describe = describe
        self.exclude = frozenset(exclude)  # versioned elsewhere (``runtime.tied_versions``)
        self.slots = ParameterSlots(module)  # its named_parameters(), found once
        self.live_version = 0
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._counters: dict[int, dict[str, int]] = {}  # live version counters at each snapshot
        self._spares: dict[str, list[torch.Tensor]] = {}
        self.peak_count = 0
        self.peak_bytes = 0

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """The parameters of ``version``; a snapshot of the live ones if they are that version."""
        snapshot = self._snapshots.get(version)
        if snapshot is not None:
            return snapshot
        if version != self.live_version:
            raise VersionError(
                f"{self.describe} needs weight version {version}, but its live weights are "
                f"version {self.live_version} and no copy of version {version} was kept "
                f"(kept: {sorted(self._snapshots)}); the schedule and the updates disagree"
            )
        # .data: the same storage under a version counter of its own, a leaf for autograd
        live = {n: p for n, p in self.slots.named() if n not in self.exclude}
        snapshot = {name: p.data.requires_grad_(p.requires_grad) for name, p in live.items()}
        self._snapshots[version] = snapshot
        self._counters[version] = {name: p._version for name, p in live.items()}
        self._track()
        return snapshot

    def storage_for_update(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """For each parameter of ``names`` whose storage a kept snapshot shares, a tensor of its
        shape to hold the values of the next update (a spare, else new memory). The update must
        make it the parameter's storage instead of writing into the shared one."""
        if not self._snapshots:
            return {}
        live = self.slots.by_name()
        shared = self._shared(live)
        out = {}
        for name in names:
            param = live[name]
            if param.data_ptr() in shared:
                spares = self._spares.get(name)
                out[name] = spares.pop() if spares else torch.empty_like(param.detach())
        return out

    def _shared(self, live: dict[str, nn.Parameter]) -> set[int]:
        """Storage addresses of the live parameters a kept snapshot shares; raises if one of
        them was written in place since that snapshot was taken."""
        shared = set()
        for version, snapshot in self._snapshots.items():
            for name, tensor in snapshot.items():
                param = live[name]
                if tensor.data_ptr() != param.data_ptr():
                    continue
                if param._version != self._counters[version][name]:
                    raise VersionError(
                        f"a parameter was changed in place while stashed weight version "
                        f"{version} shares it ({self.describe}, parameter: {name}); during "
                        "training only the optimizer may change the weights of a pipeline stage "
                        "in the asynchronous modes: change them between fits, or use "
                        f"sync='{SyncMode.FLUSH}'"
                    )
                shared.add(param.data_ptr())
        return shared

    def mark_stepped(self, storage: dict[str, torch.Tensor]) -> None:
        """Count one more update of the live weights. ``storage`` is what
        ``storage_for_update`` gave that update: each tensor must now hold its parameter, or a
        kept snapshot would have been overwritten."""
        live = self.slots.by_name() if storage else {}
        for name, tensor in storage.items():
            if live[name].data_ptr() != tensor.data_ptr():
                raise VersionError(
                    f"an update must leave the storage a kept weight version shares as it was and "
                    f"make the tensor it was given the parameter's storage ({self.describe}, "
                    f"parameter: {name}); apply updates with pl_pipedream.runtime.update.step"
                )
        self.live_version += 1
        self._track()

    def reset(self, version: int = 0) -> None:
        """Forget every snapshot and call the live weights ``version`` (after a drain)."""
        self._snapshots.clear()
        self._counters.clear()
        self._spares.clear()
        self.live_version = version

    def release(self, versions: Iterable[int]) -> None:
        """Drop the snapshots of ``versions``; a storage that neither the live parameters nor a
        kept snapshot use any more becomes a spare."""
        dropped = []
        for version in versions:
            if version in self._snapshots:
                dropped.append(self._snapshots.pop(version))
                del self._counters[version]
        if not dropped:
            return
        in_use = {p.data_ptr() for _, p in self.slots.named()}
        in_use |= {t.data_ptr() for snap in self._snapshots.values() for t in snap.values()}
        for snapshot in dropped:
            for name, tensor in snapshot.items():
                if tensor.data_ptr() not in in_use:
                    in_use.add(tensor.data_ptr())  # two dropped snapshots may share it
                    self._spares.setdefault(name, []).append(tensor.detach())

    def kept(self) -> list[int]:
        return sorted(self._snapshots)

    @property
    def count(self) -> int:
        return len(self._snapshots)

    @property
    def nbytes(self) -> int:
        """Bytes of the kept snapshots' storage apart from the live parameters'."""
        live = {p.data_ptr() for _, p in self.slots.named()}
        owned = {
            t.data_ptr(): _size(t)
            for snap in self._snapshots.values()
            for t in snap.values()
            if t.data_ptr() not in live
        }
        return sum(owned.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of every snapshot tensor this stage holds apart from the live ones, spares
        included."""
        return self.nbytes + sum(_size(t) for spares in self._spares.values() for t in spares)

    def _track(self) -> None:
        self.peak_count = max(self.peak_count, self.count)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
