"""Point-to-point messages between pipeline ranks over torch.distributed.

A message is a list of tensors whose shapes and dtypes may change from one minibatch to the next,
plus a few float64 scalars riding along (the loss on its way back to the first stage). It goes
out as a fixed-size int64 header that describes the tensors, then each tensor. Sends are
non-blocking; receives block with a deadline and raise ``PeerError`` naming the peer rank and
what was awaited instead of hanging. gloo on CPU, NCCL on GPU (tensors on the rank's device).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Channel", "Message", "PeerError"]

HEADER_SIZE = 64
MAX_DIMS = 8
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


class PeerError(RuntimeError):
    """A message did not arrive (or could not leave) in time: the peer is named."""


@dataclass
class Message:
    """Tensors plus float scalars (metadata such as the loss)."""

    tensors: list[torch.Tensor]
    scalars: list[float] = field(default_factory=list)


def _header(message: Message) -> torch.Tensor:
    values = [len(message.tensors), len(message.scalars)]
    for tensor in message.tensors:
        if tensor.dtype not in _CODES:
            raise PeerError(
                f"pipeline messages carry {', '.join(str(d) for d in _DTYPES)} tensors "
                f"(dtype: {tensor.dtype}); convert the stage's output"
            )
        if tensor.dim() > MAX_DIMS:
            raise PeerError(
                f"pipeline messages carry tensors of at most {MAX_DIMS} dimensions "
                f"(shape: {tuple(tensor.shape)}); reshape the stage's output"
            )
        values += [_CODES[tensor.dtype], tensor.dim(), *tensor.shape]
    if len(values) > HEADER_SIZE:
        raise PeerError(
            f"a pipeline message describes at most {HEADER_SIZE} header values (needed: "
            f"{len(values)}); send fewer or flatter tensors between stages"
        )
    return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)


def _parse(header: torch.Tensor) -> tuple[list[tuple[torch.dtype, list[int]]], int]:
    values = header.tolist()
    count, num_scalars = values[0], values[1]
    specs = []
    position = 2
    for _ in range(count):
        dtype, ndim = _DTYPES[values[position]], values[position + 1]
        specs.append((dtype, values[position + 2 : position + 2 + ndim]))
        position += 2 + ndim
    return specs, num_scalars


class Channel:
    """Tagged point-to-point messages for one rank, with deadlines.

    ``describe`` names this rank in errors (``"rank 1 (stage 1)"``). Headers travel on the CPU
    for gloo and on ``device`` for NCCL.
    """

    def __init__(
        self,
        rank: int,
        device: torch.device,
        timeout: float = 300.0,
        describe: str | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.describe = describe or f"rank {rank}"
        self.group = group
        self._pending: list[tuple[dist.Work, int, str, list[torch.Tensor]]] = []
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        self._nccl = backend == "nccl"

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device) if self._nccl else tensor.cpu()

    def send(self, message: Message, peer: int, tag: int, what: str) -> None:
        """Start sending ``message`` to ``peer``; ``flush`` or a later send completes it."""
        parts = [self._wire(_header(message))]
        parts += [self._wire(t.detach()).contiguous() for t in message.tensors]
        if message.scalars:
            parts.append(self._wire(torch.tensor(message.scalars, dtype=torch.float64)))
        for part in parts:
            try:
                work = dist.isend(part, peer, group=self.group, tag=tag)
            except RuntimeError as error:
                raise self._error("send", what, peer, error) from error
            self._pending.append((work, peer, what, [part]))
        self._reap()

    def recv(self, peer: int, tag: int, what: str) -> Message:
        """Receive one message from ``peer``; raise ``PeerError`` after the deadline."""
        header = self._wire(torch.zeros(HEADER_SIZE, dtype=torch.int64))
        self._wait(dist.irecv(header, peer, group=self.group, tag=tag), peer, what)
        specs, num_scalars = _parse(header.cpu())
        tensors = []
        for dtype, shape in specs:
            buffer = self._wire(torch.empty(shape, dtype=dtype))
            self._wait(dist.irecv(buffer, peer, group=self.group, tag=tag), peer, what)
            tensors.append(buffer)
        scalars: list[float] = []
        if num_scalars:
            buffer = self._wire(torch.empty(num_scalars, dtype=torch.float64))
            self._wait(dist.irecv(buffer, peer, group=self.group, tag=tag), peer, what)
            scalars = buffer.cpu().tolist()
        return Message(tensors, scalars)

    def flush(self) -> None:
        """Wait until every message this rank started sending has left."""
        while self._pending:
            work, peer, what, _ = self._pending.pop(0)
            self._wait(work, peer, what, sending=True)

    def _reap(self) -> None:
        """Forget sends that already completed, so buffers do not pile up."""
        self._pending = [p for p in self._pending if not p[0].is_completed()]

    def _wait(self, work: dist.Work, peer: int, what: str, sending: bool = False) -> None:
        try:
            if self._nccl:
                deadline = time.monotonic() + self.timeout
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise RuntimeError("timed out")
                    time.sleep(1e-4)
            elif not work.wait(timedelta(seconds=self.timeout)):
                raise RuntimeError("timed out")
        except RuntimeError as error:
            raise self._error("send" if sending else "receive", what, peer, error) from error

    def _error(self, verb: str, what: str, peer: int, cause: BaseException) -> PeerError:
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return PeerError(
            f"{self.describe} could not {verb} {what} {'to' if verb == 'send' else 'from'} "
            f"rank {peer} within {self.timeout:g} s ({detail}); rank {peer} has probably failed "
            f"or stopped: look for its error above, or raise the timeout "
            f"(PipeDreamStrategy(timeout=...)) if its stage is just slow"
        )
