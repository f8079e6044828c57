"""Warnings read off a run's logged metrics: what the console says while a run lives, and the
stop after too many skipped steps."""
from __future__ import annotations

import collections
from typing import Optional

from fractus_jax.train.errors import StalledError

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


class SkipWatch:
    """Steps skipped in a row (their gradient norm not finite: the update was not applied).
    A warning at the first of a run of them and at each doubling (rate-limited), a note
    when one trains again, a stop after `limit` in a row (0: never)."""

    def __init__(self, limit: int, lr: float, log):
        self.limit, self.lr, self.log = limit, lr, log
        self.count = 0
        self.first = None

    def observe(self, step: int, skipped: float, last_good) -> None:
        """last_good: a function, called only to word the stop (it lets a save in flight finish)."""
        if not skipped:
            if self.count:
                self.log(f"note: step {step} trained again after {self.count} skipped step"
                         f"{'s' if self.count > 1 else ''}")
            self.count = 0
            return
        self.count += 1
        if self.count == 1:
            self.first = step
        if self.limit and self.count >= self.limit:
            last, since = last_good(), self.first - 1   # the weights are those of step first-1
            if last is None:
                where = "There is no checkpoint"
            elif last >= since:
                where = (f"The checkpoints from step {since} on (the last: step {last}) hold these weights, and "
                         "resuming from them repeats this: move them out of checkpoints/ to resume from an earlier one")
            else:
                where = f"The last checkpoint, step {last}, is from before the first skipped step"
            raise StalledError(
                f"steps {self.first}-{step}: {self.count} steps in a row were skipped (the gradient norm is not "
                f"finite: the weights have likely diverged, lr={self.lr:g}); stopped. {where}. A lower lr or a "
                "longer warmup may help (max_skipped_steps sets this limit)")
        if self.count & (self.count - 1) == 0:   # 1, 2, 4, 8, ...
            limit = f"the run stops at {self.limit}" if self.limit else "no limit set"
            self.log(f"warning: step {step} was skipped: the gradient norm is not finite "
                     f"({self.count} in a row; {limit})")
