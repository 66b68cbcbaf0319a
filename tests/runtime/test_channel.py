"""The point-to-point channel over gloo: changing shapes and dtypes, the loss, deadlines."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from pl_pipedream.runtime.channel import Channel, PeerError
from pl_pipedream.runtime.frames import HEADER_BYTES, Message, MinibatchLoss
from tests.runtime.distributed import run

LOGGED = [(), (('["acc", true]', 0.75), ("n", 3.0)), (("n", -1e300),)]  # opaque keys, any float


def _exchange(rank: int, world: int) -> list:
    channel = Channel(rank, torch.device("cpu"), timeout=30.0, describe=f"rank {rank}")
    got = []
    if rank == 0:
        for step in range(3):
            tensors = [torch.full((step + 1, 2), float(step)), torch.arange(step + 2)]
            channel.send(
                Message(
                    tensors, tuple(MinibatchLoss(i, i * 0.5, LOGGED[i]) for i in range(step + 1))
                ),
                1,
                tag=1,
                what="activations",
            )
        channel.flush()
        reply = channel.recv(1, tag=2, what="gradients")
        got.append(reply.tensors[0].tolist())
    else:
        for _ in range(3):
            message = channel.recv(0, tag=1, what="activations")
            got.append(
                (
                    [tuple(t.shape) for t in message.tensors],
                    [str(t.dtype) for t in message.tensors],
                    message.losses,
                )
            )
        channel.send(
            Message([torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)]), 0, tag=2, what="gradients"
        )
        channel.flush()
    return got


@pytest.mark.slow
def test_messages_keep_shapes_dtypes_the_loss_and_what_was_logged() -> None:
    results = run(2, _exchange)
    assert results[0] == ("ok", [[[1, 2], [3, 4]]])
    status, got = results[1]
    assert status == "ok"
    losses = [MinibatchLoss(i, i * 0.5, LOGGED[i]) for i in range(3)]
    assert got == [
        ([(1, 2), (2,)], ["torch.float32", "torch.int64"], tuple(losses[:1])),
        ([(2, 2), (3,)], ["torch.float32", "torch.int64"], tuple(losses[:2])),
        ([(3, 2), (4,)], ["torch.float32", "torch.int64"], tuple(losses)),
    ]


def _wait_forever(rank: int, world: int) -> str:
    channel = Channel(
        rank, torch.device("cpu"), timeout=1.0, describe=f"rank {rank} (stage {rank})"
    )
    if rank == 1:
        try:
            channel.recv(0, tag=7, what="activations of minibatch 3")
        except PeerError as error:
            return str(error)
    time.sleep(2.5)  # alive past rank 1's deadline: a timeout, not a closed connection
    return "done"


@pytest.mark.slow
def test_a_missing_message_raises_naming_the_peer() -> None:
    results = run(2, _wait_forever)
    status, text = results[1]
    assert status == "ok"
    assert (
        "rank 1 (stage 1) could not receive activations of minibatch 3 from rank 0 within 1 s"
        in text
    )


# frames (a 512-byte header, tensors at 64-byte offsets, the loss as two float64): 1040, 1040,
# 592, 4176, 592, 592 bytes
SHAPES = [(40, 3), (40, 3), (2, 3), (300, 3), (2, 3), (3, 2)]


def _resizing_stream(rank: int, world: int) -> list:
    sent: list[str] = []
    original = Channel._isend

    def counted(self, frame, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append("frame")
        return original(self, frame, *args, **kwargs)

    Channel._isend = counted  # type: ignore[method-assign]  # this worker's transfers
    channel = Channel(rank, torch.device("cpu"), timeout=30.0)
    if rank == 0:
        counts = []
        for step, shape in enumerate(SHAPES):
            before = len(sent)
            loss = MinibatchLoss(step, step / 2)
            channel.send(Message([torch.full(shape, float(step))], (loss,)), 1, 1, "x")
            counts.append(len(sent) - before)
        channel.flush()
        return counts
    channel.expect(0, 1)  # posted before anything was sent, at the link's first size
    got = []
    for _ in SHAPES:
        message = channel.recv(0, 1, "x")
        channel.expect(0, 1)  # the next one, early; the last stays posted, unmatched
        tensor = message.tensors[0]
        got.append((tuple(tensor.shape), tensor.mean().item(), message.losses))
    return got


@pytest.mark.slow
def test_a_stream_resizes_and_repeated_sizes_cost_one_transfer() -> None:
    results = run(2, _resizing_stream)
    status, counts = results[0]
    assert status == "ok", counts
    # a frame that does not fit the link's size, or needs less than half of it, costs a
    # notice at the old size and then the frame; one that fits is padded to the link's size
    # (the third) or is just that size (the second and the last: another shape, the same bytes)
    assert counts == [2, 1, 1, 2, 2, 1]
    status, got = results[1]
    assert status == "ok", got
    expected = [
        (shape, float(step), (MinibatchLoss(step, step / 2),)) for step, shape in enumerate(SHAPES)
    ]
    assert got == expected


def _receive_left_posted(rank: int, world: int) -> list:
    """A receive posted and never matched goes with its channel's group: a later channel on a
    group of its own gets every message."""
    first = Channel(rank, torch.device("cpu"), timeout=30.0, group=dist.new_group([0, 1]))
    if rank == 1:
        first.expect(0, 1)
    first.close()
    second = Channel(rank, torch.device("cpu"), timeout=30.0, group=dist.new_group([0, 1]))
    if rank == 0:
        second.send(Message([torch.tensor([7.0])]), 1, 1, "x")
        second.close()
        return []
    value = second.recv(0, 1, "x").tensors[0].tolist()
    second.close()
    return value


@pytest.mark.slow
def test_a_receive_left_posted_does_not_take_a_later_channels_message() -> None:
    results = run(2, _receive_left_posted)
    assert results[0][0] == "ok", results[0]
    assert results[1] == ("ok", [7.0])


def _close_with_a_send_nobody_takes(rank: int, world: int) -> list:
    out: list = []
    for flush in (False, True):
        group = dist.new_group([0, 1])
        channel = Channel(rank, torch.device("cpu"), timeout=1.0, group=group)
        if rank == 0:
            channel.send(Message([torch.ones(1000)]), 1, 1, "the activations of minibatch 0")
            start = time.perf_counter()
            try:
                channel.close(flush=flush)
                out.append(("closed", flush))
            except PeerError as error:
                out.append(("raised", flush, "could not send" in str(error)))
            out.append(time.perf_counter() - start < 0.5 if not flush else channel.group is None)
        else:
            channel.close(flush=False)
        dist.barrier()
    return out


@pytest.mark.slow
def test_closing_after_a_failure_does_not_wait_for_sends() -> None:
    """A failed run closes without flushing: its peer may never receive. A flushing close still
    gives the process group back when the deadline passes."""
    results = run(2, _close_with_a_send_nobody_takes)
    assert results[1][0] == "ok", results[1]
    assert results[0] == ("ok", [("closed", False), True, ("raised", True, True), True])


def _expect_after_the_peer_left(rank: int, world: int) -> list:
    """Rank 1 returns at once and its process ends; rank 0 then posts a receive from it."""
    out: list = []
    if rank == 0:
        channel = Channel(rank, torch.device("cpu"), timeout=5.0, describe="rank 0 (stage 0)")
        time.sleep(3.0)
        channel.expect(1, 5)  # posted ahead for a message that never comes: no error here
        out.append("expected")
        try:
            channel.recv(1, 5, "the gradients of minibatch 9")
        except PeerError as error:
            out.append("rank 1" in str(error) and "minibatch 9" in str(error))
    return out


@pytest.mark.slow
def test_a_receive_posted_ahead_after_the_peer_left_fails_only_when_awaited() -> None:
    """The last step of a run may post a receive whose message never comes; a peer that has
    finished and closed its connection must not turn that into an error."""
    results = run(2, _expect_after_the_peer_left)
    assert results[0] == ("ok", ["expected", True]), results[0]


def _receive_from_a_peer_that_exits(rank: int, world: int) -> str:
    """Rank 0 returns after 1 s and its process ends; rank 1 waits with a 30 s deadline."""
    channel = Channel(
        rank, torch.device("cpu"), timeout=30.0, describe=f"rank {rank} (stage {rank})"
    )
    if rank == 0:
        time.sleep(1.0)
        return "left"
    start = time.perf_counter()
    try:
        channel.recv(0, tag=3, what="activations of minibatch 2")
    except PeerError as error:
        return f"{time.perf_counter() - start:.3f} {error}"
    return "received"


@pytest.mark.slow
def test_a_peer_that_exits_is_reported_as_a_closed_connection_not_a_timeout() -> None:
    """The error says what happened (the connection closed, after how long), not 'within 30 s'
    a few seconds after the peer died."""
    results = run(2, _receive_from_a_peer_that_exits)
    status, text = results[1]
    assert status == "ok", results[1]
    seconds, message = text.split(" ", 1)
    assert float(seconds) < 20.0, text
    assert "the connection was closed by rank 0 after" in message, message
    assert "within 30 s" not in message, message
    assert "activations of minibatch 2" in message, message


def _many_sends(rank: int, world: int, bound: int | None, per_link: bool = False) -> list:
    channel = Channel(rank, torch.device("cpu"), timeout=30.0)
    if per_link:  # the link's own bound wins over max_pending
        channel.pending_per_link, channel.max_pending = {(1, 1): bound}, 1
    else:
        channel.max_pending = bound
    if rank == 0:
        held = []
        for step in range(12):
            channel.send(Message([torch.full((5,), float(step))]), 1, 1, "x")
            held.append((channel.sends_under_way, channel.sent_bytes))
            dist.barrier()  # rank 1 has taken this message
        peak = channel.peak_sent_bytes
        channel.flush()
        return [held, peak, channel.sent_bytes]
    channel.expect(0, 1)
    got = []
    for _ in range(12):
        got.append(channel.recv(0, 1, "x").tensors[0][0].item())
        channel.expect(0, 1)
        dist.barrier()
    return got


@pytest.mark.slow
@pytest.mark.parametrize("bound", [None, 3])
def test_gloo_sends_are_kept_until_flushed_unless_bounded_per_link(bound: int | None) -> None:
    # A gloo send reports completion only when waited for: unbounded, every frame stays held
    # until flush (the 12 messages and the first one's resize notice); with max_pending 3, the
    # link never holds more than 3 messages (the first with its notice: 4 sends at most).
    results = run(2, _many_sends, bound, timeout=60.0)
    (status0, sent), (status1, got) = results[0], results[1]
    assert status0 == "ok" and status1 == "ok", (sent, got)
    assert got == [float(step) for step in range(12)]
    held, peak, after_flush = sent
    counts = [count for count, _ in held]
    assert counts == (list(range(2, 14)) if bound is None else [2, 3, 4] + [3] * 9)
    # the bytes held are the frames' own: a notice is one header, a message its padded frame
    frame = held[1][1] - held[0][1]
    assert held[-1][1] == (held[0][1] + 11 * frame if bound is None else 3 * frame)
    assert peak == max(nbytes for _, nbytes in held) and after_flush == 0


@pytest.mark.slow
def test_a_links_own_bound_wins_over_max_pending() -> None:
    results = run(2, _many_sends, 2, True, timeout=60.0)
    (status0, sent), (status1, got) = results[0], results[1]
    assert status0 == "ok" and status1 == "ok", (sent, got)
    assert [count for count, _ in sent[0]] == [2, 3] + [2] * 10


def _posted_bytes(rank: int, world: int) -> list:
    channel = Channel(rank, torch.device("cpu"), timeout=30.0)
    if rank == 0:
        for _ in range(3):
            channel.send(Message([torch.zeros(1000)]), 1, 1, "x")
        channel.flush()
        return []
    out = []
    for _ in range(3):
        channel.expect(0, 1)
        out.append(channel.received_bytes)
        channel.recv(0, 1, "x")
        channel.expect(0, 1)
        out.append(channel.received_bytes)
    return [out, channel.peak_received_bytes]


@pytest.mark.slow
def test_the_receives_posted_ahead_are_counted() -> None:
    """One receive posted ahead per link holds a frame of the link's size (the header's until
    the first resize notice)."""
    results = run(2, _posted_bytes, timeout=60.0)
    assert results[1][0] == "ok", results[1]
    out, peak = results[1][1]
    assert out[0] == HEADER_BYTES  # before the first message: the header's size
    size = out[1]
    assert size > 4000  # 1000 floats and the header
    assert out[2:] == [size] * 4 and peak == size


def _without_wrappers(rank: int, world: int) -> list:
    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("posted through the torch.distributed wrapper")

    dist.isend = dist.irecv = refused  # (in this worker's own process)
    channel = Channel(rank, torch.device("cpu"), timeout=30.0)
    if rank == 0:
        channel.send(Message([torch.arange(4.0)], fingerprint=0.5), 1, 3, "x")
        return channel.recv(1, 4, "y").tensors[0].tolist()
    channel.expect(0, 3)
    got = channel.recv(0, 3, "x")
    channel.send(Message([got.tensors[0] * 2]), 0, 4, "y")
    channel.flush()
    return [got.tensors[0].tolist(), got.fingerprint]


@pytest.mark.slow
def test_gloo_messages_are_posted_on_the_process_group_without_the_wrappers() -> None:
    """``dist.isend``/``irecv`` check the group and the tensor at every call (about as much as
    the post); the channel posts on the group itself."""
    results = run(2, _without_wrappers, timeout=60.0)
    assert results[0] == ("ok", [0.0, 2.0, 4.0, 6.0]), results
    assert results[1] == ("ok", [[0.0, 1.0, 2.0, 3.0], 0.5]), results
