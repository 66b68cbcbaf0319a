"""benchmarks/engine_step_cost.py, tiny: one run of the engine on two ranks gives rank 0's wall
and both ranks' CPU milliseconds per step."""

from __future__ import annotations

import engine_step_cost
import pytest


@pytest.mark.slow
def test_one_run_times_the_steps_after_the_warm_up() -> None:
    wall, cpu0, cpu1 = engine_step_cost.run("flush", steps=12, warmup=2)
    assert wall > 0 and cpu0 > 0 and cpu1 > 0
