"""Warnings read off a run's logged metrics: what the console says while a run lives."""
from __future__ import annotations

import collections
from typing import Optional

KEEP_RATE_FLOOR = 0.95   # a capacity that drops more than 5% of assignments is a different function
KEEP_RATE_WINDOW = 20    # logged steps the keep rate is averaged over
KEEP_RATE_REPEAT = 1000  # steps between two warnings of the same run


class KeepRateWatch:
    """Warns when the MoE capacity drops more than 5% of expert assignments.

    The PyTorch engine runs every assignment; a capacity factor drops the ones that find
    their expert full, so the run trains another function. `update(step, keep_rate)`
    returns the warning, at most once per KEEP_RATE_REPEAT steps, when the mean keep rate
    of the last KEEP_RATE_WINDOW logged steps is below KEEP_RATE_FLOOR.
    """

    def __init__(self, capacity_factor: Optional[float]):
        self.capacity_factor = capacity_factor
        self.recent = collections.deque(maxlen=KEEP_RATE_WINDOW)
        self.warned_at: Optional[int] = None

    def update(self, step: int, keep_rate: float) -> Optional[str]:
        if self.capacity_factor is None:
            return None
        self.recent.append(keep_rate)
        mean = sum(self.recent) / len(self.recent)
        if len(self.recent) < min(KEEP_RATE_WINDOW, 5) or mean >= KEEP_RATE_FLOOR:
            return None
        if self.warned_at is not None and step - self.warned_at < KEEP_RATE_REPEAT:
            return None
        self.warned_at = step
        return (f"warning: step {step}: the MoE capacity drops {100 * (1 - mean):.0f}% of expert assignments "
                f"(keep_rate {mean:.3f} over the last {len(self.recent)} logged steps), so this run trains "
                f"another function than the PyTorch engine; model.capacity_factor={self.capacity_factor:g} "
                f"is the cause: model.capacity_factor=none keeps every assignment")
