"""What a stage's passes take and leave (``runtime.feed``): a ``Feed`` is a frozen value whose
optional callbacks default to none, and an ``InFlight`` starts with nothing but its version,
weights, inputs and outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pl_pipedream.runtime.feed import Feed, InFlight


def test_a_feed_is_frozen_and_checks_nothing_unless_given() -> None:
    feed = Feed(lambda i: torch.ones(1) * i, lambda output, i: output.sum())
    assert feed.fingerprint is None and feed.logged is None
    assert feed.loss(feed.inputs(3), 3).item() == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        feed.inputs = lambda i: None  # type: ignore[misc]


def test_a_forward_leaves_only_what_it_was_given() -> None:
    weight = torch.ones(2)
    flight = InFlight(4, {"0.weight": weight}, [], [weight * 2])
    assert (flight.version, flight.params["0.weight"] is weight) == (4, True)
    assert flight.loss is None and flight.replay is None and flight.held is None
    assert not flight.predicted and flight.structure is None and flight.fingerprint is None
