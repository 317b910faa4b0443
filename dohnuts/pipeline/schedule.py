"""Learning-rate schedule: linear warm-up, cosine decay to a floor at the horizon, floor after."""

from __future__ import annotations

import math


def horizon(steps: int, cap: int) -> int:
    return min(steps, cap)


def warmup_steps(steps: int, cap: int, fraction: float) -> int:
    return max(1, int(fraction * horizon(steps, cap)))


def lr_factor(update: int, steps: int, cap: int, warmup_fraction: float, floor: float) -> float:
    """Multiplier of the base learning rate for the update with 0-based index `update`.

    Warm-up is linear over `max(1, int(warmup_fraction * horizon))` updates (reaching 1.0 on
    its last one); then a cosine from 1.0 to `floor` at `horizon = min(steps, cap)`.
    """
    end = horizon(steps, cap)
    warm = warmup_steps(steps, cap, warmup_fraction)
    if update < warm:
        return (update + 1) / warm
    if update >= end:
        return floor
    progress = (update - warm) / max(1, end - warm)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
