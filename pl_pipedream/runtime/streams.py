"""CUDA streams for a stage: host-to-device copies ahead of use, reads that do not wait for compute.

On a GPU, work is queued on streams and the host runs ahead of the device; anything that makes the
host wait for the *compute* stream (a blocking copy from pageable memory, ``.item()``/``tolist()``
of a tensor the compute stream is still producing) stops the host from queueing the next kernels,
and the stage idles between actions. Three helpers keep the compute stream (the current stream)
free of such waits; on a CPU device each does what the plain code did, so nothing changes there.

Ordering rules (every helper keeps them):

* ``Ahead`` (``prefetch``): the copy of a value's tensors to the device is queued on a side stream
  of the device, from pinned host memory, ``non_blocking``; an event is recorded after it. ``take``
  makes the current stream wait for that event (the host does not wait) and calls
  ``record_stream`` on every copied tensor, so the caching allocator does not give its memory to
  another tensor while the current stream may still read it. A copy therefore starts when
  ``prefetch`` is called and overlaps whatever the compute stream runs until ``take``.
* ``upload``: a small host tensor (a frame's header, its scalars) goes into a device tensor
  through pinned memory, ``non_blocking``, on the current stream: it is ordered after the work
  queued before it and before anything queued after it (a send of the frame), and the host does
  not wait. The pinned buffer stays reserved until the copy has run (the caching host allocator
  records the copy's event).
* ``read_done``: a device tensor whose producer is known to have *finished* (a receive whose work
  reports completion) is read to the host on a side stream, so the read waits only for itself,
  not for the compute queued on the current stream. Do not use it on a tensor the current stream
  may still be writing.
* ``read_later``: a loss the host needs only later (to send it back, to log it) is copied to
  pinned memory with an event after the forward that computes it; the host waits for that event
  when it reads the number, not at the end of the forward, so the backward is queued first.
* ``settle``: wait for the device (only for measuring: a timeline's action times, a profile).

The side streams belong to whoever copies on them (``SideStreams``: an executor's prefetches, a
channel's reads), one per device, made on first use; none is kept at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from pl_pipedream.trees import map_tensors

__all__ = [
    "Ahead",
    "HostValue",
    "SideStreams",
    "prefetch",
    "read_later",
    "prefetch_each",
    "read_done",
    "settle",
    "upload",
]


class SideStreams:
    """The side stream of each CUDA device its owner copies on, made on first use and kept.

    Called without one, ``prefetch`` and ``read_done`` use a fresh ``SideStreams``: a stream
    from torch's pool for that one call.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def on(self, device: torch.device) -> Any:
        """The side stream of the CUDA ``device``."""
        device = _indexed(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Ahead:
    """A value whose tensors are being copied to a device; ``take`` returns it, usable on the
    current stream."""

    def __init__(
        self, value: Any, event: Any = None, copies: tuple[torch.Tensor, ...] = ()
    ) -> None:
        self._value = value
        self._event = event
        self._copies = copies

    def take(self) -> Any:
        if self._event is not None:
            current = torch.cuda.current_stream(self._copies[0].device)
            current.wait_event(self._event)
            for tensor in self._copies:
                tensor.record_stream(current)
            self._event = None
        return self._value


def prefetch(value: Any, device: torch.device, side: SideStreams | None = None) -> Ahead:
    """Start copying the tensors of ``value`` (any structure, ``trees.map_tensors``) to
    ``device``. On CUDA, host tensors are copied on the device's side stream from pinned memory;
    tensors already on the device are kept. Elsewhere the copy is ``tensor.to(device)``, now."""
    if device.type != "cuda":
        return Ahead(map_tensors(lambda t: t.to(device), value))
    device = _indexed(device)
    stream = (side or SideStreams()).on(device)
    copies: list[torch.Tensor] = []

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":  # on the device already, or another GPU: in order
            return tensor.to(device)
        # A host tensor depends on no device work: the side stream need not wait for any.
        source = tensor if tensor.is_pinned() else tensor.pin_memory()
        with torch.cuda.stream(stream):  # the copy's memory belongs to the side stream
            moved = source.to(device, non_blocking=True)
        copies.append(moved)
        return moved

    moved = map_tensors(copy, value)
    if not copies:
        return Ahead(moved)
    event = torch.cuda.Event()
    event.record(stream)
    return Ahead(moved, event, tuple(copies))


def prefetch_each(
    keys: Iterable[int],
    value_of: Callable[[int], Any],
    device: torch.device,
    side: SideStreams | None = None,
) -> dict[int, Ahead]:
    """On CUDA, start copying ``value_of(k)`` for every key (a stage's inputs for each forward of
    the actions it has loaded: each forward then waits only for its own copy); elsewhere none,
    and the caller moves each value as it uses it, as before."""
    if device.type != "cuda":
        return {}
    side = side or SideStreams()
    return {key: prefetch(value_of(key), device, side) for key in keys}


def upload(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the host tensor ``source`` into ``target`` without the host waiting when ``target``
    is on a GPU (through pinned memory, ordered on the current stream); a plain copy otherwise."""
    if target.device.type == "cuda" and source.device.type == "cpu":
        target.copy_(source.pin_memory(), non_blocking=True)
    else:
        target.copy_(source)


def read_done(tensor: torch.Tensor, side: SideStreams | None = None) -> torch.Tensor:
    """A host copy of ``tensor``, whose producer has finished: on CUDA read on the side stream
    (waiting for that read alone, not for the compute stream's queue); elsewhere ``.cpu()``."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    stream = (side or SideStreams()).on(tensor.device)
    with torch.cuda.stream(stream):
        host = tensor.to("cpu")  # a blocking copy: synchronises the side stream only
    return host


class HostValue:
    """The value of a 0-d device tensor on its way to the host: copied to pinned memory after the
    work that computes it, the host not waiting; ``float()`` waits for that copy alone (work
    queued after it, a backward pass, keeps the GPU busy meanwhile)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor.detach(), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensor.device))

    def __float__(self) -> float:
        self._event.synchronize()
        return float(self._host)


def read_later(tensor: torch.Tensor) -> float | HostValue:
    """``float(tensor)``, now on CPU; on a GPU a ``HostValue`` to read when the number is needed."""
    return HostValue(tensor) if tensor.device.type == "cuda" else float(tensor.detach())


def settle(device: torch.device) -> None:
    """Wait until the device has run everything queued (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
