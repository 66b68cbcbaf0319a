"""The point-to-point channel over gloo: changing shapes and dtypes, scalars, deadlines."""

from __future__ import annotations

import pytest
import torch

from pl_pipedream.runtime.channel import Channel, Message, PeerError
from tests.runtime.distributed import run


def _exchange(rank: int, world: int) -> list:
    channel = Channel(rank, torch.device("cpu"), timeout=30.0, describe=f"rank {rank}")
    got = []
    if rank == 0:
        for step in range(3):
            tensors = [torch.full((step + 1, 2), float(step)), torch.arange(step + 2)]
            channel.send(Message(tensors, [step * 0.5]), 1, tag=1, what="activations")
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
                    message.scalars,
                )
            )
        channel.send(
            Message([torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)]), 0, tag=2, what="gradients"
        )
        channel.flush()
    return got


def test_messages_keep_shapes_dtypes_and_scalars() -> None:
    results = run(2, _exchange)
    assert results[0] == ("ok", [[[1, 2], [3, 4]]])
    status, got = results[1]
    assert status == "ok"
    assert got == [
        ([(1, 2), (2,)], ["torch.float32", "torch.int64"], [0.0]),
        ([(2, 2), (3,)], ["torch.float32", "torch.int64"], [0.5]),
        ([(3, 2), (4,)], ["torch.float32", "torch.int64"], [1.0]),
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
    return "done"


def test_a_missing_message_raises_naming_the_peer() -> None:
    results = run(2, _wait_forever)
    status, text = results[1]
    assert status == "ok"
    assert (
        "rank 1 (stage 1) could not receive activations of minibatch 3 from rank 0 within 1 s"
        in text
    )


def test_unsupported_dtype_is_refused() -> None:
    from pl_pipedream.runtime.channel import _header

    with pytest.raises(PeerError, match="complex64"):
        _header(Message([torch.zeros(2, dtype=torch.complex64)]))
