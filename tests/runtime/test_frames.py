"""A message's frame: the header, the tensors, the losses, what was logged, the fingerprint."""

from __future__ import annotations

import pytest
import torch

from pl_pipedream.runtime.frames import (
    HEADER_BYTES,
    SUPPORTED_DTYPES,
    Layouts,
    Message,
    MinibatchLoss,
    PeerError,
    header_of,
    layout_of,
    pack,
    read_header,
    unpack,
)


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(PeerError, match="complex64"):
        header_of(Message([torch.zeros(2, dtype=torch.complex64)]))


@pytest.mark.parametrize(
    "losses",
    [
        (),
        (MinibatchLoss(3, 0.25),),
        (MinibatchLoss(2, 0.5), MinibatchLoss(3, 0.25)),
        (MinibatchLoss(2, 0.5, (("a", 1.0), ("b", 2.5))), MinibatchLoss(3, 0.25, (("b", 1e-9),))),
    ],
)
@pytest.mark.parametrize("fingerprint", [None, -1.5e300])
@pytest.mark.parametrize("structure", [None, b"\x01\x02\x03"])
def test_a_frame_carries_the_losses_what_was_logged_and_the_data_fingerprint(  # type: ignore[no-untyped-def]
    losses, fingerprint, structure
) -> None:
    message = Message([torch.arange(3.0)], losses, fingerprint, structure)
    layout = layout_of(message)
    frame = pack(message, layout, layout[2], torch.device("cpu"))
    back = unpack(frame, frame[:HEADER_BYTES].view(torch.int64).tolist())
    assert (back.losses, back.fingerprint, back.structure) == (losses, fingerprint, structure)
    assert back.tensors[0].tolist() == [0.0, 1.0, 2.0]


def _messages() -> list[Message]:
    """Messages whose kinds repeat and change: shapes, dtypes, gradient flags, losses, what was
    logged, the fingerprint and the structure."""
    x = torch.arange(6.0).reshape(2, 3)
    logged = (MinibatchLoss(2, 0.5, (("a", 1.0),)), MinibatchLoss(3, 0.25, (("bb", 2.0),)))
    return [
        Message([x]),
        Message([x + 1]),
        Message([torch.ones(2, 3, requires_grad=True) * 2]),
        Message([x[:1].detach(), torch.tensor([1, 2], dtype=torch.int32)], fingerprint=0.5),
        Message([x.t().detach()], (MinibatchLoss(0, 1.5),)),
        Message([x.detach()], (MinibatchLoss(0, 1.5), MinibatchLoss(1, 2.5))),
        Message([x.detach()], logged),
        Message([x.detach()], logged[:1], structure=b"\x01\x02"),
        Message([x.detach() * 3]),
        Message([torch.zeros(0, 3), torch.tensor(True)], fingerprint=-1.0),
    ]


def test_kept_layouts_write_and_read_the_frames_fresh_ones_do() -> None:
    """A channel keeps each kind of message's layout (``Layouts``): its layouts and headers are
    the ones worked out afresh, a repeated kind reuses its header, and the reading of a header
    seen before gives the same message."""
    layouts, cpu = Layouts(keep=4), torch.device("cpu")  # 4: the kept ones are dropped too
    headers = []
    for message in _messages() * 2:
        kept, fresh = layouts.of(message), layout_of(message)
        assert kept[:6] == fresh[:6]
        frame = pack(message, kept, kept.needed + 64, cpu)
        other = pack(message, fresh, fresh.needed + 64, cpu)
        assert torch.equal(frame[:HEADER_BYTES], other[:HEADER_BYTES])
        header = frame[:HEADER_BYTES].view(torch.int64).tolist()
        back, again = unpack(frame, header, layouts=layouts), unpack(frame, header)
        for got in (back, again):
            assert [t.tolist() for t in got.tensors] == [t.tolist() for t in message.tensors]
            assert [t.requires_grad for t in got.tensors] == [
                t.requires_grad for t in message.tensors
            ]
            assert (got.losses, got.fingerprint, got.structure) == (
                message.losses,
                message.fingerprint,
                message.structure,
            )
        headers.append(kept.header_tensor)
    assert headers[1] is headers[0]  # the same kind: its header kept, not rebuilt


def test_a_host_frame_is_written_and_read_through_numpy_in_a_few_tensor_operations() -> None:
    """On the host (gloo) a frame's header, scalars and tensors of NumPy's dtypes are written
    and read through a NumPy view: a message of one tensor with a fingerprint costs 4 tensor
    operations to pack where slicing, viewing and copying cost 13; every dtype goes back alike."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", str(func))
            if name not in ("__get__", "dim", "numel"):
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    cpu, layouts = torch.device("cpu"), Layouts()
    message = Message([torch.randn(8, 16, requires_grad=True)], fingerprint=2.5)
    layout = layouts.of(message)
    with Count() as count:
        frame = pack(message, layout, layout.needed, cpu)
    assert len(count.ops) <= 4, count.ops
    assert read_header(frame) == layout.header
    with Count() as count:
        back = unpack(frame, read_header(frame), layouts=layouts)
    assert len(count.ops) <= 6, count.ops
    assert back.fingerprint == 2.5 and torch.equal(back.tensors[0], message.tensors[0].detach())
    for dtype in sorted(SUPPORTED_DTYPES, key=str):
        tensors = [torch.arange(6).reshape(2, 3).to(dtype), torch.tensor(1).to(dtype)]
        sent = Message(tensors, (MinibatchLoss(1, -0.5),), structure=b"\x07")
        layout = layouts.of(sent)
        got = unpack(frame := pack(sent, layout, layout.needed, cpu), read_header(frame))
        assert [t.dtype for t in got.tensors] == [dtype, dtype]
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, tensors, strict=True))
        assert (got.losses, got.structure) == (sent.losses, b"\x07")
