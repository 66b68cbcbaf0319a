"""Point-to-point messages between pipeline ranks over torch.distributed.

A message is a list of tensors whose shapes and dtypes may change from one minibatch to the next,
plus, on the way back to the first stage, the losses its sender knows of the batch of the
minibatch whose gradients it carries (each an index and a value, two float64 scalars in the
frame; ``runtime.losses``) with the values logged beside each (a minibatch, a key's index and a
value, three float64 scalars each; the keys, opaque strings, travel once per frame as JSON), on
the way forward the fingerprint of the microbatch's data that stage 0 fed in (one more float64
scalar), which every later stage compares with its own microbatch's, and, when what crosses the
boundary is more than one tensor, its structure (bytes that ``runtime.boundary`` writes and
reads). It travels as one *frame*, a byte tensor: a fixed-size int64 header that says how many
of each the frame holds and describes the tensors (and whether each asks for a gradient), then
each tensor's bytes, then the scalars, then the structure, then the keys. One transfer per
message matters: a gloo send moves no data until its receive is posted, so every extra transfer
is one more round trip between the ranks.

A receive must name its size in advance. Both ends of a link (one peer, one tag, one direction)
remember the link's frame size, and the receiver posts a receive of that size. A message that
fits travels padded to it, unless it needs less than half (the header says what the frame holds);
otherwise the sender first fills a frame of the old size with a notice of the new one. So shapes
that vary (a smaller last batch, sequences of several lengths) settle at one size, and training
that repeats its shapes sends every message after the first as one transfer; ``expect`` can post
the next receive early, letting the bytes move while this rank computes. A receive posted early
and never matched (training stopped) stays posted: give each run of a pipeline its own process
group. NCCL runs a peer's operations in order on one CUDA stream, where a receive posted early
would hold up a later send to that peer, so under NCCL receives are posted when awaited. NCCL also
ignores tags: between two ranks, messages match in the order they were sent, which holds because
training, evaluation and prediction messages never overlap (evaluation starts after a drain).

A gloo send reports itself complete only once it is waited for, however long ago its bytes
left, so the channel cannot poll for finished sends: it keeps each send until ``flush``, or,
with ``max_pending`` set, waits for a link's oldest send once more than ``max_pending`` sends
on that link are under way. A pipeline sets that bound above what its schedule can leave
unreceived (the peer posts its receives ahead, ``expect``), so that wait finds the send done
and only frees its frame: the frames held stay bounded over a run without a drain, and a send
costs the same at the run's ten-thousandth step as at its first.

Sends are non-blocking; receives block with a deadline and raise ``PeerError`` naming the peer
rank and what was awaited instead of hanging. gloo on CPU, NCCL on GPU (frames on the rank's
device; a GPU rank whose group is gloo gets the tensors moved to its device). On a GPU the host
never waits for the compute stream here: a frame's header and scalars go in through pinned memory
and come out on a side stream once the receive has completed (``runtime.streams``).
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from pl_pipedream.runtime import ranks
from pl_pipedream.runtime.streams import SideStreams, read_done, upload

__all__ = ["SUPPORTED_DTYPES", "Channel", "Link", "Message", "MinibatchLoss", "PeerError"]

HEADER_SIZE = 64  # int64 values
HEADER_BYTES = HEADER_SIZE * 8
MAX_DIMS = 8
ALIGNMENT = 64  # bytes; every tensor in a frame starts at a multiple of this
DATA, RESIZE = 1, 2  # the first header value: a message, or the size of the link's next frame
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
SUPPORTED_DTYPES = frozenset(_DTYPES)
REQUIRES_GRAD = 256  # added to a tensor's dtype code: the receiver's view asks for a gradient
Link = tuple[int, int]  # (peer rank, tag): one direction of messages between two ranks
_Sent = tuple[dist.Work, int, str, torch.Tensor]  # a send under way: work, peer, what, frame


class PeerError(RuntimeError):
    """A message did not arrive (or could not leave) in time: the peer is named."""


class MinibatchLoss(NamedTuple):
    """The training loss of one minibatch, as the last stage computed it, and what else its
    loss function logged: (key, value) pairs, the keys opaque to the runtime."""

    minibatch: int
    value: float
    logged: tuple[tuple[str, float], ...] = ()


@dataclass
class Message:
    """The tensors crossing one stage boundary, the losses that ride back with gradients, the
    fingerprint of the data stage 0 fed in that rides forward with activations, and the
    structure the tensors sit in (``None``: the message is one tensor, or plain tensors). A
    tensor that requires grad arrives as a view that requires grad."""

    tensors: list[torch.Tensor]
    losses: tuple[MinibatchLoss, ...] = ()
    fingerprint: float | None = None
    structure: bytes | None = None


class _Layout(NamedTuple):
    """Where a message goes in a frame: the tensors' byte offsets, where the scalars start, the
    bytes the frame needs, the header, the scalars and the keys (UTF-8 JSON, or empty)."""

    offsets: list[int]
    end: int
    needed: int
    header: list[int]
    scalars: list[float]
    keys: bytes


def _scalars(message: Message) -> tuple[list[float], list[str], int]:
    """What the frame carries after the tensors: each loss's minibatch and value, then each
    logged value's minibatch, key index and value, then the fingerprint, if any; the keys
    in the order of their indices, and how many logged values there are."""
    values = [x for loss in message.losses for x in (float(loss.minibatch), loss.value)]
    keys: dict[str, int] = {}
    count = 0
    for loss in message.losses:
        for key, value in loss.logged:
            index = keys.setdefault(key, len(keys))
            values += [float(loss.minibatch), float(index), value]
            count += 1
    if message.fingerprint is not None:
        values.append(message.fingerprint)
    return values, list(keys), count


def _header(message: Message, logged: int = 0, keys: int = 0) -> list[int]:
    structure = -1 if message.structure is None else len(message.structure)
    fingerprint = int(message.fingerprint is not None)
    losses = len(message.losses)
    values = [DATA, len(message.tensors), losses, logged, fingerprint, structure, keys]
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
        code = _CODES[tensor.dtype] + (REQUIRES_GRAD if tensor.requires_grad else 0)
        values += [code, tensor.dim(), *tensor.shape]
    if len(values) > HEADER_SIZE:
        raise PeerError(
            f"a pipeline message describes at most {HEADER_SIZE} header values (needed: "
            f"{len(values)}); send fewer or flatter tensors between stages"
        )
    return values + [0] * (HEADER_SIZE - len(values))


def _layout(specs: list[tuple[torch.dtype, list[int]]]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a frame, and where the scalars start."""
    offsets, position = [], HEADER_BYTES
    for dtype, shape in specs:
        offsets.append(position)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        position += -(-nbytes // ALIGNMENT) * ALIGNMENT
    return offsets, position


def _view(frame: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return frame[offset : offset + nbytes].view(dtype).view(shape)


def _layout_of(message: Message) -> _Layout:
    """Where ``message``'s tensors, scalars and keys go in a frame, and the bytes it needs."""
    offsets, end = _layout([(t.dtype, list(t.shape)) for t in message.tensors])
    scalars, keys, logged = _scalars(message)
    blob = json.dumps(keys).encode() if keys else b""
    header = _header(message, logged, len(blob))
    structure = 0 if message.structure is None else len(message.structure)
    needed = end + 8 * len(scalars) + structure + len(blob)
    # whole 8-byte words: views of any dtype load back
    return _Layout(offsets, end, -(-needed // 8) * 8, header, scalars, blob)


def _pack(message: Message, layout: _Layout, size: int, device: torch.device) -> torch.Tensor:
    """A frame of ``size`` bytes holding the header, every tensor, the scalars, the structure
    and the keys."""
    offsets, end = layout.offsets, layout.end
    frame = torch.empty(size, dtype=torch.uint8, device=device)
    upload(frame[:HEADER_BYTES].view(torch.int64), torch.tensor(layout.header))
    for tensor, offset in zip(message.tensors, offsets, strict=True):
        _view(frame, offset, tensor.dtype, list(tensor.shape)).copy_(tensor.detach())
    position = end + 8 * len(layout.scalars)
    if layout.scalars:
        scalars = torch.tensor(layout.scalars, dtype=torch.float64)
        upload(frame[end:position].view(torch.float64), scalars)
    for blob in (message.structure, layout.keys):
        if blob:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            upload(frame[position : position + len(blob)], data)
            position += len(blob)
    return frame


def _notice(size: int, new_size: int, device: torch.device) -> torch.Tensor:
    """A frame of ``size`` bytes that only says the link's next frame has ``new_size``."""
    frame = torch.zeros(size, dtype=torch.uint8)
    frame[:16].view(torch.int64).copy_(torch.tensor([RESIZE, new_size]))
    return frame.to(device)


def _unpack(frame: torch.Tensor, header: list[int], side: SideStreams | None = None) -> Message:
    """The message in ``frame``; its tensors are views of the frame's bytes."""
    count, num_losses, num_logged, fingerprinted, structure_bytes, key_bytes = header[1:7]
    specs, grads = [], []
    position = 7
    for _ in range(count):
        code, ndim = header[position], header[position + 1]
        specs.append((_DTYPES[code % REQUIRES_GRAD], header[position + 2 : position + 2 + ndim]))
        grads.append(code >= REQUIRES_GRAD)
        position += 2 + ndim
    offsets, end = _layout(specs)
    tensors = [_view(frame, o, d, s) for o, (d, s) in zip(offsets, specs, strict=True)]
    for tensor, grad in zip(tensors, grads, strict=True):
        if grad:
            tensor.requires_grad_(True)
    num_scalars = 2 * num_losses + 3 * num_logged + fingerprinted
    scalars_end = end + 8 * num_scalars
    structure = None
    if structure_bytes >= 0:
        structure = (
            read_done(frame[scalars_end : scalars_end + structure_bytes], side).numpy().tobytes()
        )
    if not num_scalars:
        return Message(tensors, structure=structure)
    scalars = read_done(frame[end:scalars_end].view(torch.float64), side).tolist()
    fingerprint = scalars.pop() if fingerprinted else None
    pairs = scalars[: 2 * num_losses]
    losses = [
        MinibatchLoss(int(i), value) for i, value in zip(pairs[::2], pairs[1::2], strict=True)
    ]
    if num_logged:
        start = scalars_end + max(structure_bytes, 0)
        keys = json.loads(read_done(frame[start : start + key_bytes], side).numpy().tobytes())
        losses = _with_logged(losses, scalars[2 * num_losses :], keys)
    return Message(tensors, tuple(losses), fingerprint, structure)


def _with_logged(
    losses: list[MinibatchLoss], triples: list[float], keys: list[str]
) -> list[MinibatchLoss]:
    """``losses`` with the logged values of ``triples`` (minibatch, key index, value)."""
    logged: dict[int, list[tuple[str, float]]] = {}
    for i, key, value in zip(triples[::3], triples[1::3], triples[2::3], strict=True):
        logged.setdefault(int(i), []).append((keys[int(key)], value))
    return [loss._replace(logged=tuple(logged.get(loss.minibatch, ()))) for loss in losses]


class Channel:
    """Tagged point-to-point messages for one rank, with deadlines.

    ``describe`` names this rank in errors (``"rank 1 (stage 1)"``). Frames travel on the CPU
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
        self.describe = describe or ranks.describe(rank)
        self.group = group
        self.max_pending: int | None = None  # per link; None: kept until ``flush`` (gloo)
        self._pending: dict[Link, collections.deque[_Sent]] = {}
        self._posted: dict[Link, tuple[dist.Work, torch.Tensor]] = {}
        self._send_sizes: dict[Link, int] = {}
        self._recv_sizes: dict[Link, int] = {}
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        # "nccl", or a backend per device type ("cpu:gloo,cuda:nccl"): frames on the GPU
        self._nccl = "nccl" in str(backend) and device.type == "cuda"
        self._wire = device if self._nccl else torch.device("cpu")
        self._side = SideStreams()  # reads of received frames (on a GPU)

    def send(self, message: Message, peer: int, tag: int, what: str) -> None:
        """Start sending ``message`` to ``peer``; ``flush`` or a later send completes it."""
        size = self._send_sizes.get((peer, tag), HEADER_BYTES)
        layout = _layout_of(message)
        needed = layout.needed
        if not size // 2 < needed <= size:
            self._isend(_notice(size, needed, self._wire), peer, tag, what)
            self._send_sizes[(peer, tag)] = size = needed
        self._isend(_pack(message, layout, size, self._wire), peer, tag, what)
        self._reap((peer, tag))

    @property
    def sends_under_way(self) -> int:
        """The sends started and not yet known to be done (their frames are held)."""
        return sum(len(sent) for sent in self._pending.values())

    def expect(self, peer: int, tag: int) -> None:
        """Post the receive of the next message from ``peer`` on ``tag`` now, so that its bytes
        can arrive while this rank computes. A no-op if that receive is already posted."""
        if self._nccl or (peer, tag) in self._posted:
            return
        try:
            self._posted[(peer, tag)] = self._post(peer, tag)
        except RuntimeError:  # the peer is gone: the receive, if awaited, fails naming it
            return

    def _post(self, peer: int, tag: int) -> tuple[dist.Work, torch.Tensor]:
        size = self._recv_sizes.get((peer, tag), HEADER_BYTES)
        frame = torch.empty(size, dtype=torch.uint8, device=self._wire)
        return _started(dist.irecv(frame, peer, group=self.group, tag=tag), peer), frame

    def recv(self, peer: int, tag: int, what: str) -> Message:
        """Receive one message from ``peer``; raise ``PeerError`` after the deadline."""
        while True:
            posted = self._posted.pop((peer, tag), None)
            if posted is None:
                try:
                    posted = self._post(peer, tag)
                except RuntimeError as error:
                    raise self._error("receive", what, peer, error) from error
            work, frame = posted
            self._wait(work, peer, what)
            header = read_done(frame[:HEADER_BYTES].view(torch.int64), self._side).tolist()
            if header[0] != RESIZE:
                return self._on_device(_unpack(frame, header, self._side))
            self._recv_sizes[(peer, tag)] = header[1]

    def _on_device(self, message: Message) -> Message:
        """Frames that travelled on the CPU (gloo) for a rank on a GPU: the tensors move to the
        device, as leaves (their gradients are what travels back)."""
        if self._wire == self.device or self.device.type == "cpu":
            return message
        message.tensors = [
            t.detach().to(self.device).requires_grad_(t.requires_grad) for t in message.tensors
        ]
        return message

    def flush(self) -> None:
        """Wait until every message this rank started sending has left."""
        for sent in self._pending.values():
            while sent:
                work, peer, what, _ = sent.popleft()
                self._wait(work, peer, what, sending=True)
        self._pending.clear()

    def close(self, flush: bool = True) -> None:
        """Flush (unless training failed: a peer that stopped would never take the messages),
        then destroy the channel's process group, made for this channel alone, and with it any
        receive posted early that no message matched."""
        try:
            if flush:
                self.flush()
        finally:
            self._pending.clear()
            self._posted.clear()
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    def _isend(self, frame: torch.Tensor, peer: int, tag: int, what: str) -> None:
        try:
            work = _started(dist.isend(frame, peer, group=self.group, tag=tag), peer)
        except RuntimeError as error:
            raise self._error("send", what, peer, error) from error
        self._pending.setdefault((peer, tag), collections.deque()).append((work, peer, what, frame))

    def _reap(self, link: Link) -> None:
        """Free the frames of the link's sends that are done: under NCCL those that report
        completion; under gloo, whose sends report it only when waited for, the oldest beyond
        ``max_pending`` (waited for, see the module docstring)."""
        sent = self._pending.get(link)
        if not sent:
            return
        if self._nccl:
            while sent and sent[0][0].is_completed():
                sent.popleft()
        elif self.max_pending is not None:
            while len(sent) > self.max_pending:
                work, peer, what, _ = sent.popleft()
                self._wait(work, peer, what, sending=True)

    def _wait(self, work: dist.Work, peer: int, what: str, sending: bool = False) -> None:
        start = time.monotonic()
        try:
            if self._nccl:
                deadline = start + self.timeout
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise RuntimeError("timed out")
                    time.sleep(1e-4)
            elif not work.wait(timedelta(seconds=self.timeout)):
                raise RuntimeError("timed out")
        except RuntimeError as error:
            waited = time.monotonic() - start
            verb = "send" if sending else "receive"
            raise self._error(verb, what, peer, error, waited) from error

    def _error(
        self, verb: str, what: str, peer: int, cause: BaseException, waited: float | None = None
    ) -> PeerError:
        """What happened, in the user's terms: the deadline passed (the peer may be slow or
        stuck), or the peer's connection closed before it (the peer has stopped: its own error
        is the one to read). ``waited`` is None when the operation failed as it was posted."""
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        start = (
            f"{self.describe} could not {verb} {what} {'to' if verb == 'send' else 'from'} "
            f"{ranks.describe(peer)}"
        )
        if waited is not None and waited >= 0.95 * self.timeout:
            return PeerError(
                f"{start} within {self.timeout:g} s ({detail}); rank {peer} has probably failed "
                f"or stopped: look for its error above, or raise the timeout "
                f"(PipeDreamStrategy(timeout=...)) if its stage is just slow"
            )
        after = "as it was posted" if waited is None else f"after {waited:.1f} s of waiting"
        return PeerError(
            f"{start}: the connection was closed by rank {peer} {after} ({detail}); rank "
            f"{peer} has stopped: look for its error above (or in its log)"
        )


def _started(work: dist.Work | None, peer: int) -> dist.Work:
    """A send's or receive's work; torch gives None to a rank outside the group."""
    if work is None:
        raise RuntimeError(f"this rank is not in the process group of its peer (peer: {peer})")
    return work
