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

A frame is written and read here; ``runtime.channel`` moves frames between ranks. A link's
messages repeat their shapes from step to step, so a channel keeps the layout of each kind of
message it sends and reads (``Layouts``): the offsets and the header are worked out once per
shape, and each message costs only its copies. A frame on the host (gloo) has its header and
scalars written and read through a NumPy view of its bytes, and its tensors copied through one
where NumPy has their dtype: a NumPy assignment costs a fraction of a tensor operation's
dispatch, which a small message pays several times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pl_pipedream.runtime.streams import SideStreams, read_done, upload

__all__ = [
    "HEADER_BYTES",
    "RESIZE",
    "SUPPORTED_DTYPES",
    "Layout",
    "Layouts",
    "Message",
    "MinibatchLoss",
    "PeerError",
    "header_of",
    "layout_of",
    "notice",
    "pack",
    "read_header",
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
_NUMPY = {  # the dtypes a host frame's tensors are copied through NumPy as
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


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
    bytes the frame needs, the header, the scalars and the keys (UTF-8 JSON, or empty), and the
    header as an int64 tensor when one is kept (``Layouts``)."""

    offsets: list[int]
    end: int
    needed: int
    header: list[int]
    scalars: list[float]
    keys: bytes
    header_tensor: torch.Tensor | None = None


class _Reading(NamedTuple):
    """What a header says of its frame: each tensor's offset, bytes, dtype, shape and whether
    it asks for a gradient, then where the scalars start."""

    tensors: list[tuple[int, int, torch.dtype, list[int], bool]]
    end: int


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


def layout_of(message: Message) -> Layout:
    """Where ``message``'s tensors, scalars and keys go in a frame, and the bytes it needs."""
    return Layouts(keep=0).of(message)


def _needed(message: Message, end: int, scalars: list[float], blob: bytes) -> int:
    structure = 0 if message.structure is None else len(message.structure)
    needed = end + 8 * len(scalars) + structure + len(blob)
    return -(-needed // 8) * 8  # whole 8-byte words: views of any dtype load back


class Layouts:
    """The layouts of one channel's frames, kept per kind of message: what a header says
    depends only on the tensors' dtypes, shapes and gradient flags and on how many scalars,
    logged values, structure and key bytes ride along, so a message of a kind seen before
    reuses its offsets and its header (as a tensor, ready to copy), and a header seen before
    its reading. At most ``keep`` of each (shapes that never settle: they are worked out
    afresh once ``keep`` are held; ``keep=0`` keeps none)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._sent: dict[tuple, tuple[list[int], int, list[int], torch.Tensor]] = {}
        self._read: dict[tuple[int, ...], _Reading] = {}

    def of(self, message: Message) -> Layout:
        """``message``'s layout (as ``layout_of``), its shape part kept for the next one."""
        scalars, keys, logged = _scalars(message)
        blob = json.dumps(keys).encode() if keys else b""
        kind = (
            tuple((t.dtype, t.shape, t.requires_grad) for t in message.tensors),
            len(message.losses),
            logged,
            len(blob),
            message.fingerprint is None,
            None if message.structure is None else len(message.structure),
        )
        shape = self._sent.get(kind)
        if shape is None:
            offsets, end = _layout([(t.dtype, list(t.shape)) for t in message.tensors])
            header = header_of(message, logged, len(blob))
            shape = (offsets, end, header, torch.tensor(header, dtype=torch.int64))
            _keep(self._sent, kind, shape, self.keep)
        offsets, end, header, header_tensor = shape
        needed = _needed(message, end, scalars, blob)
        return Layout(offsets, end, needed, header, scalars, blob, header_tensor)

    def reading(self, header: list[int]) -> _Reading:
        """What ``header`` says of the tensors in its frame, and where its scalars start."""
        key = tuple(header)
        found = self._read.get(key)
        if found is None:
            found = _reading(header)
            _keep(self._read, key, found, self.keep)
        return found


def _keep(kept: dict, key: object, value: object, keep: int) -> None:
    if keep <= 0:
        return
    if len(kept) >= keep:
        kept.clear()
    kept[key] = value


def _reading(header: list[int]) -> _Reading:
    specs, grads = [], []
    position = 7
    for _ in range(header[1]):
        code, ndim = header[position], header[position + 1]
        specs.append((_DTYPES[code % REQUIRES_GRAD], header[position + 2 : position + 2 + ndim]))
        grads.append(code >= REQUIRES_GRAD)
        position += 2 + ndim
    offsets, end = _layout(specs)
    tensors = [
        (offset, torch.Size(shape).numel() * dtype.itemsize, dtype, shape, grad)
        for offset, (dtype, shape), grad in zip(offsets, specs, grads, strict=True)
    ]
    return _Reading(tensors, end)


def pack(message: Message, layout: Layout, size: int, device: torch.device) -> torch.Tensor:
    """A frame of ``size`` bytes holding the header, every tensor, the scalars, the structure
    and the keys."""
    offsets, end = layout.offsets, layout.end
    frame = torch.empty(size, dtype=torch.uint8, device=device)
    if frame.device.type == "cpu":
        _pack_host(frame.numpy(), message, layout)
        return frame
    header = layout.header_tensor
    if header is None:
        header = torch.tensor(layout.header, dtype=torch.int64)
    upload(frame[:HEADER_BYTES].view(torch.int64), header)
    for tensor, offset in zip(message.tensors, offsets, strict=True):
        view = frame[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach())
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


def _pack_host(frame: np.ndarray, message: Message, layout: Layout) -> None:
    """``pack`` into a host frame's bytes."""
    frame[:HEADER_BYTES].view(np.int64)[:] = layout.header
    for tensor, offset in zip(message.tensors, layout.offsets, strict=True):
        kind = _NUMPY.get(tensor.dtype)
        if kind is None or tensor.device.type != "cpu":  # bfloat16, or a GPU rank's tensor
            view = torch.from_numpy(frame[offset : offset + tensor.nbytes]).view(tensor.dtype)
            view.view(tensor.shape).copy_(tensor.detach())
        else:
            target: np.ndarray = (
                frame[offset : offset + tensor.nbytes].view(kind).reshape(tensor.shape)
            )
            np.copyto(target, tensor.detach().numpy())
    position = layout.end + 8 * len(layout.scalars)
    frame[layout.end : position].view(np.float64)[:] = layout.scalars
    for blob in (message.structure, layout.keys):
        if blob:
            frame[position : position + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            position += len(blob)


def read_header(frame: torch.Tensor, side: SideStreams | None = None) -> list[int]:
    """The header of a frame that has arrived."""
    if frame.device.type == "cpu":
        return frame.numpy()[:HEADER_BYTES].view(np.int64).tolist()
    return read_done(frame[:HEADER_BYTES].view(torch.int64), side).tolist()


def notice(size: int, new_size: int, device: torch.device) -> torch.Tensor:
    """A frame of ``size`` bytes that only says the link's next frame has ``new_size``."""
    frame = torch.zeros(size, dtype=torch.uint8)
    frame[:16].view(torch.int64).copy_(torch.tensor([RESIZE, new_size]))
    return frame.to(device)


def unpack(
    frame: torch.Tensor,
    header: list[int],
    side: SideStreams | None = None,
    layouts: Layouts | None = None,
) -> Message:
    """The message in ``frame``; its tensors are views of the frame's bytes. ``layouts`` keeps
    the reading of each header (a link's headers repeat)."""
    num_losses, num_logged, fingerprinted, structure_bytes, key_bytes = header[2:7]
    reading = _reading(header) if layouts is None else layouts.reading(header)
    end = reading.end
    tensors = []
    for offset, nbytes, dtype, shape, grad in reading.tensors:
        tensor = frame[offset : offset + nbytes].view(dtype).view(shape)
        tensors.append(tensor.requires_grad_(True) if grad else tensor)
    num_scalars = 2 * num_losses + 3 * num_logged + fingerprinted
    scalars_end = end + 8 * num_scalars
    host = frame.numpy() if frame.device.type == "cpu" else None
    structure = None
    if structure_bytes >= 0:
        stop = scalars_end + structure_bytes
        if host is not None:
            structure = host[scalars_end:stop].tobytes()
        else:
            structure = read_done(frame[scalars_end:stop], side).numpy().tobytes()
    if not num_scalars:
        return Message(tensors, structure=structure)
    if host is not None:
        scalars = host[end:scalars_end].view(np.float64).tolist()
    else:
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
