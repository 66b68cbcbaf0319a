"""Weight versions of one stage, each in its own tensors (weight stashing, SOSP'19 3.3).

The optimizer owns the stage's live parameters. A forward pass whose weights must outlive the
next update runs functionally on a snapshot of its version, and the backward pass of the same
minibatch reuses that snapshot, so autograd never sees a tensor change under it; a snapshot is
dropped as soon as the schedule no longer names its version. Buffers (BatchNorm running
statistics) are not versioned: they live in the module and every forward updates them.

A snapshot of the live version costs nothing when it is taken: its tensors share the live
parameters' storage. The copy, if any, is left to the update that would change them:
``fresh(names)`` hands the update one tensor per shared parameter to hold the new values, and
the update makes it the parameter's storage (``runtime.update``), so the snapshot keeps the old
storage untouched. An update with an out-of-place form (plain SGD) writes its result straight
into that tensor and no weights are ever copied; any other optimizer first copies the live
values into it and steps in place there.

A dropped snapshot's tensors are kept as spares for the next ``fresh``: reusing them costs
nothing, where new memory would cost the allocator (and the kernel, in page faults) a stage's
worth every minibatch. ``reset`` frees them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["VersionError", "WeightVersions"]


class VersionError(RuntimeError):
    """The schedule asked for a weight version this stage cannot provide."""


class WeightVersions:
    """Snapshots of a module's parameters keyed by version (number of updates applied).

    ``live_version`` counts the updates applied to the live parameters; ``mark_stepped`` raises
    it after each optimizer step. ``count`` is the number of versions a forward pass still
    holds (the live one included when it has a snapshot); ``nbytes`` the memory they take
    beyond the live parameters.
    """

    def __init__(self, module: nn.Module, describe: str = "this stage") -> None:
        self.module = module
        self.describe = describe
        self.live_version = 0
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._spares: dict[str, list[torch.Tensor]] = {}
        self.peak_count = 0
        self.peak_bytes = 0

    def live(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

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
        snapshot = {
            name: p.data.requires_grad_(p.requires_grad)
            for name, p in self.module.named_parameters()
        }
        self._snapshots[version] = snapshot
        self._track()
        return snapshot

    def fresh(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """For each parameter of ``names`` whose storage a kept snapshot shares, a tensor of its
        shape to hold the values of the next update (a spare, else new memory). The update must
        make it the parameter's storage instead of writing into the shared one."""
        live = dict(self.module.named_parameters())
        shared = {t.data_ptr() for snap in self._snapshots.values() for t in snap.values()}
        out = {}
        for name in names:
            param = live[name]
            if param.data_ptr() in shared:
                spares = self._spares.get(name)
                out[name] = spares.pop() if spares else torch.empty_like(param.detach())
        return out

    def mark_stepped(self) -> None:
        self.live_version += 1
        self._track()

    def reset(self, version: int = 0) -> None:
        """Forget every snapshot and call the live weights ``version`` (after a drain)."""
        self._snapshots.clear()
        self._spares.clear()
        self.live_version = version

    def release(self, versions: Iterable[int]) -> None:
        live = {name: p.data_ptr() for name, p in self.module.named_parameters()}
        for version in versions:
            snapshot = self._snapshots.pop(version, None)
            for name, tensor in (snapshot or {}).items():
                if tensor.data_ptr() != live[name]:
                    self._spares.setdefault(name, []).append(tensor.detach().requires_grad_(False))

    def kept(self) -> list[int]:
        return sorted(self._snapshots)

    @property
    def count(self) -> int:
        return len(self._snapshots)

    @property
    def nbytes(self) -> int:
        """Bytes of the kept snapshots that do not share the live parameters' storage."""
        live = {p.data_ptr() for p in self.module.parameters()}
        return sum(
            _size(t)
            for snap in self._snapshots.values()
            for t in snap.values()
            if t.data_ptr() not in live
        )

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
