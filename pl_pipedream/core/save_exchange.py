"""The messages of one save among its writers: the staging token, each shard's record, the
outcome of the publish.

A sharded save (``core.checkpoint.save``) is written by each stage's first replica and published
by rank 0. The writers talk point to point on the default process group, with a deadline, so that
a writer that died is named in every other writer's error, and nothing is published without every
shard on disk.
"""

from __future__ import annotations

import os
import pickle
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.core.errors import CheckpointError
from pl_pipedream.runtime.channel import PeerError
from pl_pipedream.runtime.ranks import backend_detail
from pl_pipedream.runtime.tags import Tag

__all__ = ["SaveExchange"]


class SaveExchange:
    """The messages of one save among its writers (each stage's first replica), point to point
    on the default process group so that a writer that died is named: rank 0 (the lead) sends
    every other writer the staging token, each writer sends the lead its shard's record once
    the shard is on disk, and the lead answers with the outcome of the publish."""

    def __init__(self, rank: int, writers: list[int], timeout: float, path: Path) -> None:
        self.rank = rank
        self.lead = writers[0]
        self.others = [w for w in writers if w != self.lead]
        self.timeout = timeout
        self.path = path
        self.start = time.monotonic()

    @property
    def leads(self) -> bool:
        return self.rank == self.lead

    def token(self) -> str:
        """The staging token, made by the lead and agreed by every writer."""
        if self.leads:
            token = f"{secrets.token_hex(4)}-{os.getpid()}"
            for peer in self.others:
                self._send(token, peer)
            return token
        return self._recv(self.lead, "the staging token")

    def records(self, record: dict[str, Any], stages: dict[int, int]) -> list[dict[str, Any]]:
        """On the lead: every stage's shard record, in stage order (``stages``: stage of each
        writer). Elsewhere: send ``record``; nothing comes back."""
        if not self.leads:
            self._send(record, self.lead)
            return []
        received = {stages[self.rank]: record}
        for peer in self.others:
            try:
                received[stages[peer]] = self._recv(peer, f"stage {stages[peer]}'s shard record")
            except PeerError as error:
                self._tell_others(str(error), peer)
                raise
        return [received[stage] for stage in sorted(received)]

    def _tell_others(self, error: str, failed: int) -> None:
        """Send ``error`` as the outcome to every writer but ``failed``, so that each names the
        writer that failed instead of the lead that stops next; best effort: another writer may
        have stopped too."""
        for peer in self.others:
            if peer != failed:
                try:
                    self._send(error, peer)
                except PeerError:
                    pass

    def outcome(self, error: str | None = None) -> None:
        """The lead tells the others whether the checkpoint was published; they raise if not."""
        if self.leads:
            for peer in self.others:
                self._send(error, peer)
            return
        error = self._recv(self.lead, "the outcome of the publish")
        if error is not None:
            raise CheckpointError(error)

    def _send(self, obj: Any, peer: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for tensor in (size, data):
            self._wait(dist.isend(tensor, peer, tag=Tag.SAVE), peer, "send to")

    def _recv(self, peer: int, what: str) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.irecv(size, peer, tag=Tag.SAVE), peer, f"receive {what} from")
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(dist.irecv(data, peer, tag=Tag.SAVE), peer, f"receive {what} from")
        return pickle.loads(data.numpy().tobytes())

    def _wait(self, work: Any, peer: int, what: str) -> None:
        start = time.monotonic()
        try:
            if work.wait(timedelta(seconds=self.timeout)):
                return
            detail = "no answer"
        except RuntimeError as error:
            detail = backend_detail(error)
        raise PeerError(
            f"every writer of a checkpoint must finish its part before the checkpoint is "
            f"published (rank {self.rank} could not {what} rank {peer}: {detail} after "
            f"{time.monotonic() - start:.1f} s of waiting, timeout {self.timeout:g} s; path: "
            f"{self.path}); rank {peer} has probably failed: look for its error above. Nothing "
            f"was published: a checkpoint already at {self.path} is intact"
        )
