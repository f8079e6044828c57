"""The step loop's own decisions, without training: what follows a step (probe, held-out
score, save, log line) and the record each step logs."""
import math

import pytest

from fractus_jax.train import config as cfg_lib
from fractus_jax.train.loop import after_step
from fractus_jax.train.policy import Decision
from fractus_jax.train.progress import StepMeter


def cfg(*overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), list(overrides))


def test_saves_every_save_every_steps_by_time_and_at_the_end():
    c = cfg("max_steps=10", "save_every=4", "log_every=3")
    saved = [s for s in range(1, 11) if after_step(c, s, Decision(), False, False).save]
    assert saved == [4, 8, 10]
    final = [s for s in range(1, 11) if after_step(c, s, Decision(), False, False).final]
    assert final == [10]
    timed = after_step(c, 5, Decision(save=True), False, False)
    assert timed.save and not timed.final and timed.read_now and not timed.write(5, c.log_every)


def test_a_save_due_while_an_upload_is_tried_again_is_owed_to_the_first_step_after():
    c = cfg("max_steps=10", "save_every=4")
    held = Decision(hold_saves=4)
    saves, owed = [], False
    for step in range(1, 11):
        after = after_step(c, step, held if 5 <= step <= 8 else Decision(), False, False, owed)
        assert not (after.held and after.save) and after.read_now == after.save   # a held save reads nothing now
        saves, owed = saves + [step] * after.save, after.held
        assert owed == (step == 8)   # step 8's save, held, is made at step 9
    assert saves == [4, 9, 10]
    # a run's last save is made however the saves are held, and the owed one with it
    last = after_step(c, 10, held, False, False, owed=True)
    assert last.save and last.final and not last.held
    assert after_step(c, 6, Decision(stop="deadline near", hold_saves=4), False, False).save


def test_a_stop_saves_blocking_and_writes_the_step():
    c = cfg("max_steps=10", "save_every=4", "log_every=3")
    after = after_step(c, 5, Decision(stop="SIGTERM received"), False, False)
    assert after.save and after.final and after.stop == "SIGTERM received"
    assert after.write(5, c.log_every) and after.read_now


def test_probes_and_held_out_scores_follow_their_intervals():
    c = cfg("max_steps=9", "save_every=100", "probe_every=3", "eval_every=4", "val_fraction=0.1", "log_every=5")
    probed = [s for s in range(1, 10) if after_step(c, s, Decision(), True, True).probe]
    scored = [s for s in range(1, 10) if after_step(c, s, Decision(), True, True).eval]
    assert probed == [3, 6, 9] and scored == [4, 8, 9]   # and at max_steps
    assert not any(after_step(c, s, Decision(), False, False).probe or after_step(c, s, Decision(), False, False).eval
                   for s in range(1, 10))
    # a probed or scored step is read at once and logged, whatever log_every says
    assert after_step(c, 3, Decision(), True, True).write(3, c.log_every)
    plain = after_step(c, 2, Decision(), True, True)
    assert not plain.read_now and not plain.write(2, c.log_every) and plain.write(5, c.log_every)


def metrics(ce_tf, ss_ran=0.0, ce_ss=float("nan")):
    return {"ce_tf": ce_tf, "ss_ran": ss_ran, "ce_ss": ce_ss, "skipped": 0.0}


def test_the_step_time_estimate_leaves_out_the_compilation():
    meter = StepMeter(ids_per_step=64)
    m, compiled = meter.record(1, metrics(5.0), 40.0)
    assert compiled and meter.step_seconds is None and m["step_s"] == 40.0
    m, compiled = meter.record(2, metrics(4.0), 2.0)
    assert not compiled and meter.step_seconds == 2.0 and m["ids_per_s_tf"] == 32.0
    meter.compiles()   # a grown step compiles again
    assert meter.record(3, metrics(4.0), 30.0)[1] and meter.step_seconds == 2.0


def test_the_emas_skip_non_finite_values_and_continue_a_checkpoints():
    meter = StepMeter(ids_per_step=64, ema={"ema_tf": 2.0, "ema_ss": None, "other": 1})
    assert meter.ema == {"ema_tf": 2.0, "ema_ss": None}
    m, _ = meter.record(7, metrics(float("nan")), 1.0)
    assert m["ema_tf"] == 2.0 and "ce_ss" not in m and "ema_ss" not in m
    m, _ = meter.record(8, metrics(3.0, ss_ran=1.0, ce_ss=4.0), 1.0)
    assert m["ema_tf"] == pytest.approx(0.99 * 2.0 + 0.01 * 3.0) and m["ema_ss"] == 4.0
    assert m["ids_per_s_wall"] == 2 * m["ids_per_s_tf"] and math.isfinite(m["ema_tf"])
