"""Point-to-point messages between pipeline ranks over torch.distributed.

A message and its frame are ``runtime.frames``; this module moves frames between ranks.

A receive must name its size in advance. Both ends of a link (one peer, one tag, one direction)
remember the link's frame size, and the receiver posts a receive of that size. A message that
fits travels padded to it, unless it needs less than half of it, ``ROOM`` aside (the header says
what the frame holds); otherwise the sender first fills a frame of the old size with a notice of
the new one, what the message needs plus ``ROOM`` bytes: the losses that ride with a batch's
gradients grow by one per microbatch, and would otherwise cost a notice, a second frame, per
message. So shapes
that vary (a smaller last batch, sequences of several lengths) settle at one size, and training
that repeats its shapes sends every message after the first as one transfer; ``expect`` can post
the next receive early, letting the bytes move while this rank computes. A receive posted early
and never matched (training stopped) stays posted: give each run of a pipeline its own process
group. NCCL runs a peer's operations in order on one CUDA stream, where a receive posted early
would hold up a later send to that peer, so under NCCL receives are posted when awaited. NCCL also
ignores tags: between two ranks, messages match in the order they were sent, which holds because
training, evaluation and prediction messages never overlap (evaluation starts after a drain).

A gloo send reports itself complete only once it is waited for, however long ago its bytes
left, so the channel cannot poll for finished sends: it keeps each message's frames (a resize
notice travels with its message) until ``flush``, or, with a bound for the link
(``pending_per_link``, else ``max_pending``), waits for the link's oldest message once more
than that many are under way. A pipeline bounds each link by the messages its schedule can
have sent and not yet received (``schedule.memory.frames_in_flight``): the oldest beyond that
has surely been received, so the wait finds it done and only frees its frames. A gloo link so
holds exactly its bound of sent frames once the run has sent that many, a send costs the same
at the run's ten-thousandth step as at its first, and ``peak_sent_bytes`` and
``peak_received_bytes`` (the receives posted ahead) say what the frames took.

Under gloo a send and a receive are posted on the process group itself
(``ProcessGroup.send``/``recv``, what ``dist.isend``/``irecv`` end in), its ranks in the group
looked up once per peer: the wrappers' checks of the group and the tensor cost about as much as
the post, per message. Sends are non-blocking; receives block with a deadline and raise
``PeerError`` naming the peer rank and what was awaited instead of hanging. gloo on CPU, NCCL
on GPU (frames on the rank's device; a GPU rank whose group is gloo gets the tensors moved to
its device). On a GPU the host never waits for the compute stream here: a frame's header and
scalars go in through pinned memory and come out on a side stream once the receive has completed
(``runtime.streams``).
"""

from __future__ import annotations

import collections
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pl_pipedream.runtime import ranks
from pl_pipedream.runtime.frames import (
    HEADER_BYTES,
    RESIZE,
    Layouts,
    Message,
    PeerError,
    notice,
    pack,
    read_header,
    unpack,
)
from pl_pipedream.runtime.streams import SideStreams

__all__ = ["ROOM", "Channel", "Link", "PeerError"]  # PeerError: raised here, declared in frames

ROOM = HEADER_BYTES  # bytes a resized link's frames keep beyond the message that resized it

Link = tuple[int, int]  # (peer rank, tag): one direction of messages between two ranks
# A message under way: its works, peer, what it is, and its frames (held until it has left)
_Sent = tuple[list[dist.Work], int, str, list[torch.Tensor]]


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
        self.pending_per_link: dict[Link, int] = {}  # a link's own bound, before max_pending
        self.sent_bytes = self.received_bytes = 0  # frames held now: sent, posted to receive
        self.peak_sent_bytes = self.peak_received_bytes = 0
        self._pending: dict[Link, collections.deque[_Sent]] = {}
        self._posted: dict[Link, tuple[dist.Work, torch.Tensor]] = {}
        self._send_sizes: dict[Link, int] = {}
        self._recv_sizes: dict[Link, int] = {}
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        # "nccl", or a backend per device type ("cpu:gloo,cuda:nccl"): frames on the GPU
        self._nccl = "nccl" in str(backend) and device.type == "cuda"
        self._wire = device if self._nccl else torch.device("cpu")
        self._side = SideStreams()  # reads of received frames (on a GPU)
        self._layouts = Layouts()  # a link's messages repeat their shapes
        self._direct = _direct_group(group) if not self._nccl else None
        self._group_ranks: dict[int, int] = {}  # a peer's rank in ``_direct``

    def send(self, message: Message, peer: int, tag: int, what: str) -> None:
        """Start sending ``message`` to ``peer``; ``flush`` or a later send completes it."""
        self._reap((peer, tag), room=1)  # before packing: the link holds its bound at most
        size = self._send_sizes.get((peer, tag), HEADER_BYTES)
        layout = self._layouts.of(message)
        needed = layout.needed
        frames = []
        if not (size - ROOM) // 2 < needed <= size:  # less than half of its own size
            frames.append(notice(size, needed + ROOM, self._wire))
            self._send_sizes[(peer, tag)] = size = needed + ROOM
        frames.append(pack(message, layout, size, self._wire))
        works = [self._isend(frame, peer, tag, what) for frame in frames]
        self._pending.setdefault((peer, tag), collections.deque()).append(
            (works, peer, what, frames)
        )
        self._count_sent(_nbytes(frames))

    @property
    def sends_under_way(self) -> int:
        """The sends started and not yet known to be done (their frames are held)."""
        return sum(len(works) for sent in self._pending.values() for works, *_ in sent)

    def bound(self, link: Link) -> int | None:
        """The most messages ``link`` keeps under way (None: until ``flush``)."""
        return self.pending_per_link.get(link, self.max_pending)

    def _count_sent(self, change: int) -> None:
        self.sent_bytes += change
        self.peak_sent_bytes = max(self.peak_sent_bytes, self.sent_bytes)

    def _count_received(self, change: int) -> None:
        self.received_bytes += change
        self.peak_received_bytes = max(self.peak_received_bytes, self.received_bytes)

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
        if self._direct is not None:
            work = self._direct.recv([frame], self._group_rank(peer), tag)
        else:
            work = _started(dist.irecv(frame, peer, group=self.group, tag=tag), peer)
        self._count_received(size)
        return work, frame

    def recv(self, peer: int, tag: int, what: str) -> Message:
        """Receive one message from ``peer``; raise ``PeerError`` after the deadline."""
        while True:
            posted = self._posted.pop((peer, tag), None)
            if posted is None:
                try:
                    posted = self._post(peer, tag)
                except RuntimeError as error:
                    raise self._error("receive", what, peer, error) from None
            work, frame = posted
            self._wait(work, peer, what)
            self._count_received(-frame.nbytes)  # the message's now, or a notice
            header = read_header(frame, self._side)
            if header[0] != RESIZE:
                return self._on_device(unpack(frame, header, self._side, self._layouts))
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
                self._finish(sent.popleft())
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
            self.sent_bytes = self.received_bytes = 0
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    def _isend(self, frame: torch.Tensor, peer: int, tag: int, what: str) -> dist.Work:
        try:
            if self._direct is not None:
                return self._direct.send([frame], self._group_rank(peer), tag)
            return _started(dist.isend(frame, peer, group=self.group, tag=tag), peer)
        except RuntimeError as error:
            raise self._error("send", what, peer, error) from None

    def _group_rank(self, peer: int) -> int:
        found = self._group_ranks.get(peer)
        if found is None:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None  # the default group exists while a channel does
            found = self._group_ranks[peer] = dist.get_group_rank(group, peer)
        return found

    def _reap(self, link: Link, room: int = 0) -> None:
        """Free the frames of the link's messages that are done: under NCCL those that report
        completion; under gloo, whose sends report it only when waited for, the oldest beyond
        the link's ``bound`` less ``room`` (waited for, see the module docstring)."""
        sent = self._pending.get(link)
        if not sent:
            return
        if self._nccl:
            while sent and all(work.is_completed() for work in sent[0][0]):
                self._count_sent(-_nbytes(sent.popleft()[3]))
            return
        bound = self.bound(link)
        if bound is not None:
            while sent and len(sent) > max(1, bound) - room:
                self._finish(sent.popleft())

    def _finish(self, message: _Sent) -> None:
        """Wait until a message's frames have left, and stop counting them."""
        works, peer, what, frames = message
        for work in works:
            self._wait(work, peer, what, sending=True)
        self._count_sent(-_nbytes(frames))

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
            raise self._error(verb, what, peer, error, waited) from None

    def _error(
        self, verb: str, what: str, peer: int, cause: BaseException, waited: float | None = None
    ) -> PeerError:
        """The failed ``verb`` in the user's terms (``ranks.peer_failure``); ``waited`` is None
        when the operation failed as it was posted."""
        start = (
            f"{self.describe} could not {verb} {what} {'to' if verb == 'send' else 'from'} "
            f"{ranks.describe(peer)}"
        )
        text = ranks.peer_failure(start, ranks.describe(peer), cause, waited, self.timeout)
        return PeerError(text)


def _direct_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group to post on directly: ``group`` (or the default one) when this rank is
    in it; None (post through ``dist.isend``/``irecv``) otherwise or without one."""
    if not dist.is_initialized():
        return None
    chosen = group if group is not None else dist.group.WORLD
    if chosen is None or dist.get_rank(chosen) < 0:
        return None
    return chosen


def _started(work: dist.Work | None, peer: int) -> dist.Work:
    """A send's or receive's work; torch gives None to a rank outside the group."""
    if work is None:
        raise RuntimeError(f"this rank is not in the process group of its peer (peer: {peer})")
    return work


def _nbytes(frames: list[torch.Tensor]) -> int:
    return sum(frame.nbytes for frame in frames)
