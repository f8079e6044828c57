"""What a run shows and logs per step: the metrics record (EMAs, step time, throughput) and
the progress bar."""
from __future__ import annotations

import math
import sys
from typing import Optional

EMA_DECAY = 0.99


def progress_bar(total, initial, enabled, desc=None):
    if not enabled:
        return None
    from tqdm import tqdm   # loaded only when a bar is shown
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr, desc=desc)


def bar_compiled(bar, n, seconds) -> None:
    """The first step after a compilation is done: the bar's clock, rate and ETA restart
    here (a rate that counted the compilation would promise an hour for a minute's run);
    its description keeps the compilation's seconds."""
    bar.reset(total=bar.total)
    bar.n = bar.last_print_n = bar.initial = n
    bar.set_description_str(f"compiled in {seconds:.0f}s", refresh=False)


class StepMeter:
    """The logged record of each step: the step's own metrics, the EMAs of the CE (which
    the checkpoints carry: `ema`), the throughput and the step time. The first step of a
    program includes its compilation (minutes at 1B): it would inflate the step time that
    the deadline margin reserves, so the estimate (`step_seconds`) starts after it."""

    def __init__(self, ids_per_step: int, ema: Optional[dict] = None):
        self.ids_per_step = ids_per_step
        self.ema = {"ema_tf": None, "ema_ss": None}
        self.ema.update({k: (ema or {}).get(k) for k in self.ema})
        self.step_seconds: Optional[float] = None
        self.compiling = True

    def compiles(self) -> None:
        """A new program (a growth): its first step includes the compilation again."""
        self.compiling = True

    def record(self, step: int, m: dict, dt: float) -> tuple[dict, bool]:
        """(the record of step `step` from its host metrics m, whether it included a compilation)."""
        compiled_now = self.compiling
        dt = max(dt, 1e-9)
        if self.compiling:
            self.compiling = False
        else:
            self.step_seconds = dt if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * dt
        ema = self.ema
        if math.isfinite(m["ce_tf"]):   # a NaN would stay in the EMA for good
            ema["ema_tf"] = m["ce_tf"] if ema["ema_tf"] is None else EMA_DECAY * ema["ema_tf"] + (1 - EMA_DECAY) * m["ce_tf"]
        if m["ss_ran"] and math.isfinite(m["ce_ss"]):
            ema["ema_ss"] = m["ce_ss"] if ema["ema_ss"] is None else EMA_DECAY * ema["ema_ss"] + (1 - EMA_DECAY) * m["ce_ss"]
        m = dict(m)
        m.update(step=step, ema_tf=ema["ema_tf"], ids_per_s_tf=self.ids_per_step / dt,
                 ids_per_s_wall=self.ids_per_step * (1 + m["ss_ran"]) / dt, step_s=dt)
        if not m["ss_ran"]:
            m.pop("ce_ss")
        else:
            m["ema_ss"] = ema["ema_ss"]
        return m, compiled_now


def show(bar, m: dict, compiled_now: bool, capacity_factor, lead: bool, log) -> None:
    """A step's record on the bar, or the compilation's time in the log when there is no bar."""
    dt = m["step_s"]
    if bar is not None and compiled_now:
        bar_compiled(bar, m["step"], dt)
    elif bar is not None:
        bar.update(m["step"] - bar.n)
    elif compiled_now and lead:
        log(f"step {m['step']} took {dt:.0f}s, the compilation included")
    if bar is not None:
        keep = "" if capacity_factor is None else f" keep {m['keep_rate']:.2f}"
        bar.set_postfix_str(f"ce {m['ce_tf']:.3f} ema {m['ema_tf']:.3f}{keep} {m['ids_per_s_tf']:.0f} ids/s",
                            refresh=False)


def held_out_line(m: dict) -> str:
    """A step's held-out figures, as the progress shows them: bits per byte where the
    vocabulary has bytes, else CE per id; the carry as trained, streamed, and fresh."""
    unit = "bpb" if m.get("val_bpb") is not None else "ce"
    fig = lambda suffix: m.get(f"val_{unit}{suffix}")   # noqa: E731
    line = f"step {m['step']}: held-out val_{unit} {fig(''):.4f} (the carry as trained)"
    extra = [f"{name} {fig(suffix):.4f}" for name, suffix in (("warm", "_warm"), ("fresh", "_no_carry"))
             if fig(suffix) is not None]
    return line + (", " + ", ".join(extra) if extra else "")
