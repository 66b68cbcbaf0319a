"""A message's frame: the header, the tensors, the losses, what was logged, the fingerprint."""

from __future__ import annotations

import pytest
import torch

from pl_pipedream.runtime.frames import (
    HEADER_BYTES,
    Message,
    MinibatchLoss,
    PeerError,
    header_of,
    layout_of,
    pack,
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
