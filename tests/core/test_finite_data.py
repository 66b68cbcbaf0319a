"""core.finite_data: per microbatch, whether a batch's data were finite."""

from __future__ import annotations

import pytest
import torch

from pl_pipedream.core.finite_data import FiniteData


def test_the_data_notes_find_the_first_non_finite_microbatch() -> None:
    notes = FiniteData()
    x, y = torch.ones(4, 3), torch.arange(4)  # integer targets: always finite
    notes.note(0, (x, y), 2)
    bad = x.clone()
    bad[3, 1] = float("inf")
    notes.note(1, {"x": bad, "y": y, "w": torch.ones(4, 2, 2)}, 2)
    notes.note(2, (y, "no tensor"), 2)
    assert notes.first_bad(through=0) is None
    assert notes.first_bad(through=2) == (1, 1)
    notes.forget_through(1)
    assert notes.first_bad(through=2) is None


def test_a_batch_without_floating_tensors_has_no_note_to_read() -> None:
    notes = FiniteData()
    notes.note(0, (torch.arange(4), torch.arange(4)), 4)
    assert notes.first_bad(through=0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_every_nan_and_inf_is_found_wherever_it_sits(dtype: torch.dtype) -> None:
    """The note (each microbatch's smallest and largest value) tells a microbatch with a NaN or
    an inf in any position from a finite one, as ``torch.isfinite`` does."""
    for position in range(6):
        for bad in (float("nan"), float("inf"), -float("inf")):
            notes = FiniteData()
            x = torch.tensor([[1e4, -3.0, 2.0], [0.5, -1e4, 7.0]] * 2, dtype=dtype)
            x.view(-1)[position + 6] = bad  # microbatch 1 of 2 (rows 2 and 3)
            notes.note(
                0, {"x": x, "empty": torch.zeros(4, 0), "c": torch.ones(4, dtype=torch.cfloat)}, 2
            )
            assert notes.first_bad(through=0) == (0, 1)
    notes = FiniteData()
    c = torch.ones(4, dtype=torch.cfloat)
    c[0] = complex(0, float("nan"))
    notes.note(0, (torch.ones(4, 2, dtype=dtype), c), 2)
    assert notes.first_bad(through=0) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_microbatch_is_noted_by_one_reduction_without_a_dim(dtype: torch.dtype) -> None:
    """With one microbatch per batch a note is the whole tensor's smallest and largest value
    (``aminmax()``, a third of ``aminmax(dim=1)``'s cost on small tensors)."""
    for position in range(6):
        for bad in (float("nan"), float("inf"), -float("inf")):
            notes = FiniteData()
            x = torch.tensor([[1e4, -3.0, 2.0], [0.5, -1e4, 7.0]], dtype=dtype)
            x.view(-1)[position] = bad
            notes.note(3, (x, torch.ones(2, 1)), 1)
            assert notes._notes[3][0].dim() == 0
            assert notes.first_bad(through=3) == (3, 0)
    notes = FiniteData()
    notes.note(0, (torch.randn(2, 3, dtype=dtype), torch.arange(2)), 1)
    assert notes.first_bad(through=0) is None


def test_a_note_takes_no_elementwise_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noting a batch costs one reduction per tensor; whether it was finite is worked out only
    when a non-finite loss asks (``first_bad``)."""
    notes = FiniteData()
    x = torch.randn(8, 4)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "isfinite", lambda *a: pytest.fail("isfinite ran at the note"))
        notes.note(0, (x, x.double()), 4)
    assert notes.first_bad(through=0) is None
