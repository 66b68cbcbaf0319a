"""Weight versions of one stage, each in its own tensors (weight stashing, SOSP'19 3.3).

The optimizer owns the stage's live parameters and updates them in place. A forward pass never
runs on them directly: it runs functionally on a snapshot, a detached copy of the live values
taken while the live version is the one the schedule asks for. The backward pass of the same
minibatch reuses that snapshot, so autograd never sees a tensor change under it, and a snapshot
is dropped as soon as the schedule no longer names its version. Buffers (BatchNorm running
statistics) are not versioned: they live in the module and every forward updates them.

A dropped snapshot's tensors are kept for the next one: copying into them costs the same as a
fresh copy, without asking the allocator for (and the kernel to fault in) a stage's worth of new
memory every minibatch. The spares never outnumber the peak of live snapshots, and ``reset``
frees them.
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
    it after each optimizer step. ``release_after`` maps a version to the index of the last
    action that uses it, so ``release(index)`` frees what is no longer needed.
    """

    def __init__(self, module: nn.Module, describe: str = "this stage") -> None:
        self.module = module
        self.describe = describe
        self.names = [name for name, _ in module.named_parameters()]
        self.live_version = 0
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._spares: list[dict[str, torch.Tensor]] = []
        self.peak_count = 0
        self.peak_bytes = 0

    def live(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """The parameters of ``version``, snapshotting the live ones if they are that version."""
        snapshot = self._snapshots.get(version)
        if snapshot is not None:
            return snapshot
        if version != self.live_version:
            raise VersionError(
                f"{self.describe} needs weight version {version}, but its live weights are "
                f"version {self.live_version} and no copy of version {version} was kept "
                f"(kept: {sorted(self._snapshots)}); the schedule and the updates disagree"
            )
        snapshot = self._copy_live()
        self._snapshots[version] = snapshot
        self._track()
        return snapshot

    def _copy_live(self) -> dict[str, torch.Tensor]:
        """The live values in a spare snapshot's tensors, or in new ones."""
        live = self.module.named_parameters()
        if self._spares:
            snapshot = self._spares.pop()
            with torch.no_grad():
                for name, param in live:
                    snapshot[name].copy_(param).requires_grad_(param.requires_grad)
            return snapshot
        return {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in live}

    def mark_stepped(self) -> None:
        self.live_version += 1

    def reset(self, version: int = 0) -> None:
        """Forget every snapshot and call the live weights ``version`` (after a drain)."""
        self._snapshots.clear()
        self._spares.clear()
        self.live_version = version

    def release(self, versions: Iterable[int]) -> None:
        for version in versions:
            snapshot = self._snapshots.pop(version, None)
            if snapshot is not None:
                self._spares.append(snapshot)

    def kept(self) -> list[int]:
        return sorted(self._snapshots)

    @property
    def count(self) -> int:
        return len(self._snapshots)

    @property
    def nbytes(self) -> int:
        return _bytes(self._snapshots.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of every snapshot tensor this stage holds, kept or spare."""
        return self.nbytes + _bytes(self._spares)

    def _track(self) -> None:
        self.peak_count = max(self.peak_count, self.count)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)


def _bytes(snapshots: Iterable[dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for snap in snapshots for t in snap.values())
