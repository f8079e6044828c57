"""The step loop: state from the plan, then steps, with the saves, probes, held-out scores and
logs that follow them.

The plan (`prepare.prepare`) has checked everything a user can get wrong; the run directory
(`rundir.RunDir`, `checkpoint.RunCheckpointer`) holds the files; the stop and save policy
(`policy`) decides, the same on every process, when to save by time and when to stop.
Inside the loop the host never waits on the device except to read step n−1's metrics after
dispatching step n.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from fractus_jax import sharding
from fractus_jax.atom.features import FEATURE_CONTEXT
from fractus_jax.config import WEIGHT_FIELDS
from fractus_jax.lanes import LaneReader
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import growth as growth_lib
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import policy as policy_lib
from fractus_jax.train import probes as probes_lib
from fractus_jax.train import progress as progress_lib
from fractus_jax.train import rundir
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import TrainConfig
from fractus_jax.train.data import global_batch
from fractus_jax.train.heldout import HeldOut
from fractus_jax.train.prepare import Plan
from fractus_jax.train.step import batch_shardings, jit_train_step
from fractus_jax.train.watch import KeepRateWatch, SkipWatch



@dataclasses.dataclass(frozen=True)
class AfterStep:
    """What follows a step: decided from its count and the policy's agreed decision."""
    probe: bool            # run the probes
    eval: bool             # score the held-out slice
    save: bool             # save a checkpoint
    final: bool            # the run ends here (max_steps or a stop): the save blocks
    stop: Optional[str]    # why the run stops after this step
    held: bool = False     # a save due, held while an upload is tried again: owed to the next step

    @property
    def read_now(self) -> bool:
        """Read the step's metrics now (not after dispatching the next one)."""
        return self.probe or self.eval or self.save

    def write(self, step: int, log_every: int) -> bool:
        """Whether the step's record goes to the metrics log."""
        return step % log_every == 0 or self.probe or self.eval or self.final


def after_step(cfg: TrainConfig, step: int, decision: policy_lib.Decision, probing: bool,
               scoring: bool, owed: bool = False) -> AfterStep:
    """Saves every save_every steps, by time (the decision) and at the end of the run (at
    max_steps or a stop); probes every probe_every steps; held-out scores every eval_every
    steps and at max_steps. A save due while the decision holds saves (an upload tried
    again) is owed: made at the first step after the hold (`owed`), or at the end."""
    final = bool(decision.stop) or step == cfg.max_steps
    due = step % cfg.save_every == 0 or decision.save or owed
    held = due and not final and decision.hold_saves is not None
    return AfterStep(probe=probing and step % cfg.probe_every == 0,
                     eval=scoring and (step % cfg.eval_every == 0 or step == cfg.max_steps),
                     save=final or (due and not held), final=final, stop=decision.stop, held=held)


def run(plan: Plan, progress: bool = True, log=print, mirror=None) -> dict:
    """Train from the plan to cfg.max_steps (or a stop); returns the last logged metrics.

    The run directory is held for the run (`rundir.RunDir`: a second writer is refused) and
    closed however the run ends: a save in flight commits, the lock is released. With a
    `store.Mirror` (plan.workdir its stage), each committed step goes to the store and the
    mirror is closed with the run."""
    rd = rundir.RunDir(plan.workdir, lead=jax.process_index() == 0, log=log,
                       tensorboard=plan.cfg.tensorboard, mirror=mirror).open()
    try:
        last = _Trainer(plan, rd, progress, log).train()
    except BaseException:
        rd.close(quiet=True)
        raise
    rd.close()
    return last


def run_quietly(cfg: TrainConfig, workdir) -> list[dict]:
    """Train cfg into workdir with no bar and no log lines (one row of a script's table);
    the records of its metrics log."""
    run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=lambda m: None)
    return [m for _, m in rundir.read_metrics(Path(workdir) / rundir.METRICS)]


def restore(plan: Plan, ckpt, rd: rundir.RunDir, abstract, log):
    """(plan, state, meta) of the newest step, from the plan's down, that restores and is
    finite; the run directory then matches it: rejected newer steps moved aside, the
    manifest repaired, the metrics log cut to it."""
    cfg = plan.cfg

    def usable(meta):
        old = meta.get("config")
        if old is None:
            return None
        if any(old.get("model", {}).get(k) != getattr(cfg.model, k) for k in WEIGHT_FIELDS) or any(
                meta.get(k, old.get(k)) != getattr(cfg, k) for k in ("batch_size", "seq_len", "accum")):
            return "has another shape (a step from before a growth in place)"
        return None

    step, state, meta, rejected = ckpt.restore_good(abstract, plan.resume_step, plan.rejected, usable)
    if plan.note and step == plan.resume_step:
        log(plan.note)
    for line in ckpt_lib.rejection_warnings(rejected, step):
        log(line)
    rd.resumed(meta, rejected)
    ckpt.reload()
    if jax.process_count() > 1:   # every process sees the rejected steps gone before saving
        from jax.experimental import multihost_utils   # multi-process runs only
        multihost_utils.sync_global_devices("fractus_jax resume: run directory ready")
    pos = cfg.start_token if cfg.start_token is not None else int(meta["start_token_next"])
    # the lanes and passes of the step restored (an older one than planned read less, maybe)
    train, held = prepare_lib.resumed_parts(meta, plan.corpus, cfg.val_fraction)
    plan = dataclasses.replace(plan, resume_step=step, start_pos=pos, manifest=meta, train=train,
                               val=plan.val if cfg.val_corpus else held,
                               passes=prepare_lib.recorded_passes(meta, train, cfg))
    return plan, state, meta


class _Trainer:
    """One run's moving parts: the state, the compiled step, where the lanes are, the
    pending step's metrics and the watches. `train()` steps to max_steps or a stop."""

    def __init__(self, plan: Plan, rd: rundir.RunDir, progress: bool, log):
        cfg = plan.cfg
        self.cfg, self.rd, self.log = cfg, rd, log
        deadline = policy_lib.parse_deadline(cfg.deadline)
        if rd.mirror is not None:
            rd.mirror.deadline = deadline   # its uploads are not tried again past it
        self.mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
        abstract = state_lib.abstract_train_state(cfg)
        shardings = state_lib.train_state_shardings(cfg, self.mesh, abstract)
        self.ckpt = ckpt_lib.RunCheckpointer(plan.workdir, keep=cfg.keep_checkpoints, asynchronous=True, log=log,
                                             mirror=rd.mirror)
        rd.checkpointer = self.ckpt
        self.growth = list((plan.manifest or {}).get("growth") or [])
        meta = None
        for line in plan.notes:
            log(line)
        if plan.resume_step is not None:
            plan, self.state, meta = restore(plan, self.ckpt, rd, ckpt_lib.abstract_with_shardings(abstract, shardings), log)
            self.growth = list(meta.get("growth") or self.growth)
            log(f"resumed {plan.workdir} at step {plan.resume_step}, lane offset {plan.start_pos}")
            note = prepare_lib.schedule_change_note(meta.get("config") or {}, cfg, plan.resume_step)
            if note:
                log(note)
        else:
            rd.start_metrics(None)
            self.state = self._fresh_state(shardings, plan.init_from or cfg.init_from)
        self.ckpt.expect(self.state)   # the deadline margin's save, until one is timed
        self.plan = plan
        self.passes = [dict(p) for p in plan.passes]   # the last: the pass the lanes are in
        self.meter = progress_lib.StepMeter(cfg.batch_size * cfg.seq_len * cfg.accum, meta)
        self.reader = LaneReader(plan.train.ids, cfg.batch_size, cfg.seq_len, cfg.accum)
        self.batch_shard = batch_shardings(cfg, self.mesh)
        self.step_fn, self.prober, self.held_out = self._build(cfg, shardings)
        self.last_hits = None   # expert hits of the latest probe: where grown experts go
        self.step, self.pos = int(plan.resume_step or 0), plan.start_pos
        self.lead = jax.process_index() == 0   # one process writes the log and shows progress
        self.skips = SkipWatch(cfg.max_skipped_steps, cfg.lr, log)
        self.drops = KeepRateWatch(cfg.model.capacity_factor)
        compile_note = "compiling the train step" + (" and the probes" if self.prober is not None else "")
        more = self.step < cfg.max_steps
        self.bar = progress_lib.progress_bar(cfg.max_steps, self.step, progress and self.lead,
                                             compile_note if more else None)
        if self.bar is None and self.lead and more:
            log(f"{compile_note}...")
        self.policy = policy_lib.StopSavePolicy(cfg.save_every_minutes, deadline, policy_lib.exchange_for_run())
        self.pending = None   # (step, device metrics) of the step in flight
        self.owed = False     # a save due was held (an upload tried again): made at the first step after
        self.last = {}
        self.t_prev = time.time()

    def _fresh_state(self, shardings, init_from: Optional[str]):
        cfg = self.cfg
        if not init_from:
            return state_lib.create_train_state(cfg, self.mesh, jax.random.PRNGKey(cfg.seed), shardings)[0]
        params, _ = ckpt_lib.load_for_inference(init_from, params_shardings=shardings["params"])
        self.log(f"weights from {cfg.init_from}; fresh optimizer moments (warmup advised)")
        return state_lib.state_around(cfg, params, shardings)

    def _build(self, cfg: TrainConfig, shardings):
        """The compiled step, the prober and the held-out scorer of a config (again after a growth)."""
        return (jit_train_step(cfg, shardings, self.batch_shard),
                probes_lib.Prober(cfg, self.probe_part()) if cfg.probe_every else None,
                HeldOut(cfg, self.plan.val) if cfg.eval_every else None)

    def probe_part(self):
        """The probes read the extent of the run's first pass: the same rows at every pass."""
        return self.plan.train.head(self.passes[0]["n_ids"])

    def new_pass(self) -> None:
        """The lanes wrap: the next pass's lanes are cut over the training stream as the corpus
        holds it now (grown by appending since the last cut: longer lanes). Every process of a
        multi-process run cuts over the corpus as it opened it (their reads of a file that
        grows would not agree), so growth enters there at the first pass after a start."""
        old = self.plan.train
        train = prepare_lib.next_pass_part(old, self.cfg.model.vocab_size, self.log, reopen=jax.process_count() == 1)
        number = self.passes[-1]["pass"] + 1
        if train.n_ids != old.n_ids:
            self.reader = LaneReader(train.ids, self.cfg.batch_size, self.cfg.seq_len, self.cfg.accum)
            self.log(f"note: pass {number} from step {self.step + 1}: the lanes are cut over {train.n_ids} ids "
                     f"(the last pass: {old.n_ids}; {train.path} holds {train.corpus.n_ids})")
        self.plan = dataclasses.replace(self.plan, corpus=train.corpus, train=train)
        self.passes.append(prepare_lib.pass_record(number, self.step + 1, train))
        self.pos = 0

    def meta(self) -> dict:
        """What a checkpoint of the current step records besides its arrays (the manifest's facts)."""
        cfg, plan = self.cfg, self.plan
        meta = {"step": self.step, "start_token_next": self.pos, "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len, "accum": cfg.accum, "corpus": plan.corpus.identity(),
                "train_ids": plan.train.n_ids, "passes": self.passes, "config": cfg.to_dict(),
                "growth": self.growth, **self.meter.ema}
        if plan.val is not None:
            meta["held_out"] = plan.val.describe()
        return meta

    def save(self, final: bool = False) -> None:
        """Periodic saves write in the background; the last one (end, signal, deadline) blocks."""
        self.ckpt.save(self.state, self.meta(), block=final)
        self.policy.saved()
        self.owed = False   # a save held before is made (a growth's)

    def read_pending(self) -> dict:
        """The record of the step in flight: its metrics read from the device (waiting for it),
        shown, watched."""
        step, device_metrics = self.pending
        self.pending = None
        host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        m, compiled_now = self.meter.record(step, host, time.time() - self.t_prev)
        progress_lib.show(self.bar, m, compiled_now, self.cfg.model.capacity_factor, self.lead, self.log)
        self.last = m
        self.skips.observe(step, m["skipped"], self.rd.last_good)
        drop_warning = self.drops.update(step, m["keep_rate"])
        if drop_warning and self.lead:
            (self.bar.write if self.bar is not None else self.log)(drop_warning)
        self.t_prev = time.time()
        return m

    def grow_due(self) -> bool:
        cfg = self.cfg
        return bool(cfg.grow_at) and self.step >= cfg.grow_at and not growth_lib.already_grown(self.growth, cfg.grow_at)

    def grow(self) -> None:
        """Grow in place (grow_at): the run as it was is saved first, then the grown step compiles."""
        if self.pending is not None:
            self.rd.write_metrics(self.read_pending())
        if self.ckpt.latest_step() != self.step:
            self.save(final=True)
        self.state, self.cfg, record = growth_lib.grow_in_place(self.state, self.cfg, self.mesh, self.step,
                                                                self.last_hits)
        self.ckpt.expect(self.state)   # the grown state's saves take longer
        self.growth.append(record)
        self.step_fn, self.prober, self.held_out = self._build(
            self.cfg, state_lib.train_state_shardings(self.cfg, self.mesh))
        self.meter.compiles()
        if self.bar is not None:
            self.bar.set_description_str("compiling the grown step")
        self.log(f"grew at step {self.step}: {record['from']} -> {record['to']}")
        self.t_prev = time.time()

    def probe_initial(self) -> None:
        init_probe = self.prober.run(self.state["params"], initial=True)
        self.last_hits = np.asarray(init_probe["expert_hits"])
        self.rd.write_metrics({"step": 0, **init_probe})

    def advance(self, signal: Optional[str]) -> AfterStep:
        """Dispatch one step, read the one before, and do what follows this one."""
        cfg = self.cfg
        if self.pos > 0 and self.reader.position(self.pos) == 0:
            self.new_pass()
        batch = global_batch(self.reader, self.pos, self.batch_shard, FEATURE_CONTEXT)
        pos_next = self.reader.position(self.pos) + self.reader.span
        self.state, device_metrics = self.step_fn(self.state, batch)
        self.step, self.pos = self.step + 1, pos_next
        if self.pending is not None:   # step n is dispatched: now read step n−1
            m = self.read_pending()
            if m["step"] % cfg.log_every == 0:
                self.rd.write_metrics(m)
        self.pending = (self.step, device_metrics)
        self.ckpt.check_upload()
        # Time, signals and the save in flight: decided by process 0, the same everywhere.
        agreed = self.policy.at_step(self.step, signal, self.ckpt, self.meter.step_seconds)
        after = after_step(cfg, self.step, agreed, self.prober is not None, self.held_out is not None, self.owed)
        if after.held and not self.owed and self.lead:
            self.log(f"note: step {self.step} is not saved yet: the upload of step {agreed.hold_saves} to "
                     f"{self.rd.mirror.url} is being tried again; training goes on, and the save is made once "
                     "that upload is through")
        self.owed = after.held
        if after.read_now:
            m = self.read_pending()
            if after.probe:
                m.update(self.prober.run(self.state["params"]))
                self.last_hits = np.asarray(m["expert_hits"])
            if after.eval:
                m.update(self.held_out.run(self.state["params"]))
                if self.lead:
                    (self.bar.write if self.bar is not None else self.log)(progress_lib.held_out_line(m))
            if after.write(m["step"], cfg.log_every):
                self.rd.write_metrics(m)
            if after.save:
                self.save(final=after.final)
            self.t_prev = time.time()
        return after

    def train(self) -> dict:
        stop_reason = None
        with policy_lib.StopFlag() as flag:
            if self.prober is not None and self.step == 0:
                self.probe_initial()
            while self.step < self.cfg.max_steps:
                if self.grow_due():
                    self.grow()
                stop_reason = self.advance(flag.signal).stop
                if stop_reason:
                    break
        if self.bar is not None:
            self.bar.close()
        self.ckpt.close()
        self.policy.close()
        if stop_reason:
            self.log(f"stopped at step {self.step} ({stop_reason}); saved, lane offset {self.pos}")
        return self.last
