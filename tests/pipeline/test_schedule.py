"""Warm-up, cosine decay and the floor of the learning-rate schedule."""

import math

import pytest

from dohnuts.pipeline.schedule import lr_factor, warmup_steps


def test_recipe_schedule_warms_up_decays_to_the_floor_at_the_horizon_and_stays():
    steps, cap, floor = 3600, 2400, 0.1
    warm = warmup_steps(steps, cap, 0.03)
    assert warm == 72  # int(0.03 * min(3600, 2400))
    assert lr_factor(0, steps, cap, 0.03, floor) == pytest.approx(1 / 72)
    assert lr_factor(71, steps, cap, 0.03, floor) == pytest.approx(1.0)
    middle = 72 + (2400 - 72) // 2
    cosine = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert lr_factor(middle, steps, cap, 0.03, floor) == pytest.approx(cosine)
    assert lr_factor(2399, steps, cap, 0.03, floor) == pytest.approx(floor, abs=1e-5)
    assert lr_factor(2400, steps, cap, 0.03, floor) == floor
    assert lr_factor(3599, steps, cap, 0.03, floor) == floor


def test_short_runs_warm_up_for_at_least_one_update_and_decrease_monotonically():
    values = [lr_factor(u, 10, 2400, 0.03, 0.1) for u in range(10)]
    assert values[0] == 1.0  # max(1, int(0.3)) = 1 warm-up update
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-1] > 0.1
