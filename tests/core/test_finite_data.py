"""core.finite_data: per microbatch, whether a batch's data were finite."""

from __future__ import annotations

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
