"""A pipeline message and its frame, the one byte tensor it travels as.

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

A frame is written and read here; ``runtime.channel`` moves frames between ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pl_pipedream.runtime.streams import SideStreams, read_done, upload

__all__ = [
    "HEADER_BYTES",
    "RESIZE",
    "SUPPORTED_DTYPES",
    "Layout",
    "Message",
    "MinibatchLoss",
    "PeerError",
    "header_of",
    "layout_of",
    "notice",
    "pack",
    "unpack",
]

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


class Layout(NamedTuple):
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


def header_of(message: Message, logged: int = 0, keys: int = 0) -> list[int]:
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


def layout_of(message: Message) -> Layout:
    """Where ``message``'s tensors, scalars and keys go in a frame, and the bytes it needs."""
    offsets, end = _layout([(t.dtype, list(t.shape)) for t in message.tensors])
    scalars, keys, logged = _scalars(message)
    blob = json.dumps(keys).encode() if keys else b""
    header = header_of(message, logged, len(blob))
    structure = 0 if message.structure is None else len(message.structure)
    needed = end + 8 * len(scalars) + structure + len(blob)
    # whole 8-byte words: views of any dtype load back
    return Layout(offsets, end, -(-needed // 8) * 8, header, scalars, blob)


def pack(message: Message, layout: Layout, size: int, device: torch.device) -> torch.Tensor:
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


def notice(size: int, new_size: int, device: torch.device) -> torch.Tensor:
    """A frame of ``size`` bytes that only says the link's next frame has ``new_size``."""
    frame = torch.zeros(size, dtype=torch.uint8)
    frame[:16].view(torch.int64).copy_(torch.tensor([RESIZE, new_size]))
    return frame.to(device)


def unpack(frame: torch.Tensor, header: list[int], side: SideStreams | None = None) -> Message:
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
