"""``reproduce.epochs``: epoch times of DP, PipeDream and GPipe checked against hand arithmetic."""

from __future__ import annotations

import pytest

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.reproduce.epochs import bubble, epochs, scale_profile

# Two layers of 10 ms (forward 4 + backward 6) and 5 ms, 1e8 and 2e8 parameter bytes, a 1e6-byte
# activation between them; 2 workers at 1e9 bytes/s, and an epoch of 1000 samples of batch 10.
TINY = Profile.chain([4.0, 2.0], [6.0, 3.0], [1e6, 1e3], [1e8, 2e8])
FLAT = Topology.from_lists([2], [1e9])


def test_an_epoch_by_hand_on_a_two_stage_split() -> None:
    result = plan(TINY, FLAT, straight=True)  # straight: two stages, one worker each
    assert result.num_stages == 2
    # Data parallel by hand: compute 15 ms over 2 workers, plus the ring all-reduce of 3e8
    # bytes charged as 4 (n - 1) / n * bytes / bandwidth = 0.6 s, also over 2 workers.
    dp_minibatch = (0.015 + 4 * 1 / 2 * 3e8 / 1e9) / 2
    # Pipeline: the slowest stage is layer 0's 10 ms (its output's transfer: 2 * 1e6 / 1e9 = 2 ms).
    stage = 0.010
    run = epochs(result, samples=1000, batch=10, microbatches=4)
    assert run.minibatches == 100
    assert run.data_parallel == pytest.approx(100 * dp_minibatch)
    assert run.pipedream == pytest.approx((100 + 1) * stage)
    # GPipe: 25 flushes of 4 microbatches, each (4 + 2 - 1) stage times.
    assert run.gpipe == pytest.approx(25 * 5 * stage)
    assert run.pipedream_speedup == pytest.approx(100 * dp_minibatch / (101 * stage))
    assert run.to_dict()["gpipe_bubble"] == pytest.approx(1 / 5)


def test_gpipe_defaults_to_four_microbatches_per_stage_and_rounds_flushes_up() -> None:
    result = plan(TINY, FLAT, straight=True)
    run = epochs(result, samples=1001, batch=10)  # 101 minibatches, 8 per flush: 13 flushes
    assert (run.minibatches, run.microbatches) == (101, 8)
    assert run.gpipe == pytest.approx(13 * (8 + 1) * 0.010)
    assert bubble(4, 12) == pytest.approx(3 / 15)


def test_scaling_a_one_sample_profile() -> None:
    scaled = scale_profile(TINY, batch=64, speed_factor=128.0)
    first = scaled.nodes[0]
    assert (first.forward_ms, first.backward_ms) == (2.0, 3.0)  # x 64 / 128
    assert first.activation_bytes == (64e6,)
    assert first.parameter_bytes == 1e8  # parameters do not grow with the batch
    assert scaled.batch_size == 64
    with pytest.raises(ValueError, match=r"speed factor: 0"):
        scale_profile(TINY, 64, 0.0)


def test_a_bad_epoch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(samples: 0, batch: 10\)"):
        epochs(plan(TINY, FLAT), samples=0, batch=10)
