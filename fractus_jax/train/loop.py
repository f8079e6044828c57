"""The training loop: checks first, then state, then steps, saves and logs.

Everything a user can get wrong is checked before anything is written (`prepare`), so a
refused run leaves the disk as it was. Inside the loop the host never waits on the device
except to read step n−1's metrics after dispatching step n.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from fractus_jax import sharding
from fractus_jax.atom import corpus as corpus_lib
from fractus_jax.atom.ids import VOCAB as ATOM_VOCAB
from fractus_jax.config import WEIGHT_FIELDS
from fractus_jax.grow import GrowthError
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import growth as growth_lib
from fractus_jax.train import policy as policy_lib
from fractus_jax.train import probes as probes_lib
from fractus_jax.train import rundir
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import TrainConfig, resolve_for_mesh
from fractus_jax.train.data import DataError, LaneReader, global_batch
from fractus_jax.train.step import batch_shardings, jit_train_step
from fractus_jax.train.watch import KeepRateWatch

METRICS = rundir.METRICS
EMA_DECAY = 0.99
FEATURE_CONTEXT = 64  # ids before a chunk that its packet features may look at


class TrainError(ValueError):
    """A refusal: the run cannot start as asked; nothing was written."""


class StalledError(TrainError):
    """The run stopped: too many steps in a row were skipped (their gradient norm not finite)."""




@dataclasses.dataclass
class CorpusPart:
    """Ids [start, start + n_ids) of a corpus: what the lanes read, or the held-out part."""
    corpus: object
    start: int
    n_ids: int

    @property
    def ids(self):
        return self.corpus.ids[self.start:self.start + self.n_ids]

    @property
    def path(self):
        return self.corpus.path

    def describe(self) -> dict:
        return {"path": str(Path(self.corpus.path).resolve()), "start": self.start, "n_ids": self.n_ids}


def split_corpus(corpus, val_fraction: float) -> tuple[CorpusPart, Optional[CorpusPart]]:
    """(the part the lanes read, the part held out from its end or None): the last
    floor(val_fraction · n_ids) ids are held out."""
    n_val = int(corpus.n_ids * val_fraction)
    train = CorpusPart(corpus, 0, corpus.n_ids - n_val)
    return train, (CorpusPart(corpus, train.n_ids, n_val) if n_val else None)


@dataclasses.dataclass
class Plan:
    cfg: TrainConfig
    workdir: Path
    corpus: object
    resume_step: Optional[int]
    start_pos: int
    manifest: Optional[dict]   # the meta of the step to resume from (the manifest's facts)
    rejected: list = dataclasses.field(default_factory=list)   # (step, why) of newer steps that failed
    note: Optional[str] = None   # about the step to resume from (no checksums to check)
    train: Optional[CorpusPart] = None   # what the lanes read (the whole corpus without val_fraction)
    val: Optional[CorpusPart] = None     # the held-out part (val_fraction's tail or val_corpus)

    def __post_init__(self):
        if self.train is None:
            self.train = CorpusPart(self.corpus, 0, self.corpus.n_ids)


def cache_dir() -> Path:
    return Path(os.environ.get("FRACTUS_CACHE", Path.home() / ".cache" / "fractus_jax"))


def parse_deadline(text: str) -> Optional[float]:
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise TrainError(f"deadline {text!r} is neither unix seconds nor an ISO time (2026-12-01T18:00)") from None
    if t.tzinfo is None:
        t = t.astimezone()  # local time
    return t.timestamp()


def open_training_corpus(cfg: TrainConfig, progress: bool = True):
    path = cfg.corpus
    if not path:
        if cfg.model.vocab_size != ATOM_VOCAB:
            raise TrainError("no corpus set: the embedded default corpus is an Atom (266-id) stream, "
                             f"this model's vocab is {cfg.model.vocab_size}; pass --set corpus=FILE")
        path = corpus_lib.build_default_corpus(cache_dir(), progress=progress)
    try:
        corpus = corpus_lib.open_corpus(path)
        corpus.validate(vocab=cfg.model.vocab_size)
    except corpus_lib.CorpusError as e:
        raise TrainError(str(e)) from None
    return corpus


def prepare(cfg: TrainConfig, workdir, progress: bool = True) -> Plan:
    """Every check a user can fail, before anything is written to workdir."""
    workdir = Path(workdir)
    n = cfg.mesh.data * cfg.mesh.fsdp
    if n > jax.device_count():
        raise TrainError(f"mesh data={cfg.mesh.data} x fsdp={cfg.mesh.fsdp} needs {n} devices, "
                         f"{jax.device_count()} available")
    if cfg.batch_size % n:
        raise TrainError(f"batch_size {cfg.batch_size} is not divisible by the mesh's {n} devices "
                         f"(data={cfg.mesh.data} x fsdp={cfg.mesh.fsdp})")
    cfg = resolve_for_mesh(cfg)
    if cfg.grow_at:
        try:
            growth_lib.target_config(cfg, growth_lib.spec_of(cfg))
        except GrowthError as e:
            raise TrainError(f"grow_at={cfg.grow_at}: {e}") from None
    rows = cfg.model.moe_group_rows
    if cfg.model.capacity_factor is not None and (cfg.batch_size // n) % (rows or cfg.batch_size):
        raise TrainError(f"model.moe_group_rows={rows} ({rows or cfg.batch_size} rows per capacity group) does not "
                         f"divide the {cfg.batch_size // n} rows each of the {n} devices holds: a group would "
                         f"span devices (set model.moe_group_rows to a divisor of {cfg.batch_size // n})")
    streams = cfg.model.row_streams
    if streams > 1 and n > 1:
        raise TrainError(f"model.row_streams={streams} is for one device: a mesh of {n} devices "
                         "already runs its rows apart (set model.row_streams=1)")
    if streams > 1 and (rows == 0 or cfg.batch_size % (streams * rows)):
        raise TrainError(f"batch_size {cfg.batch_size} does not split into model.row_streams={streams} "
                         f"streams of whole MoE dispatch groups (model.moe_group_rows={rows}; "
                         "0 makes the batch one group)")
    for problem in cfg.conflicts():
        raise TrainError(problem)
    if workdir.exists() and not workdir.is_dir():
        raise TrainError(f"workdir {workdir} exists and is not a directory")
    manifest, rejected, note = _resume_point(workdir)
    if manifest is not None:
        cfg = growth_lib.grown_model_for(cfg, manifest) or cfg
        _check_resume(cfg, workdir, manifest)
    corpus = open_training_corpus(cfg, progress)
    train, val = split_corpus(corpus, cfg.val_fraction)
    source = str(corpus.path) if val is None else f"the first {train.n_ids} ids (1 - val_fraction) of {corpus.path}"
    try:
        LaneReader(train.ids, cfg.batch_size, cfg.seq_len, cfg.accum, source=source)
    except DataError as e:
        raise TrainError(str(e)) from None
    if cfg.val_corpus:
        val = open_val_corpus(cfg)
    if cfg.eval_every:
        check_val_slice(cfg, val)
    if manifest is None:
        return Plan(cfg, workdir, corpus, None, cfg.start_token or 0, None, train=train, val=val)

    if manifest.get("corpus", {}).get("n_ids") not in (None, corpus.n_ids):
        raise TrainError(f"{workdir}: the checkpoint's corpus had {manifest['corpus']['n_ids']} ids, "
                         f"{corpus.path} has {corpus.n_ids}; the lane offsets would not mean the same text")
    pos = cfg.start_token if cfg.start_token is not None else int(manifest["start_token_next"])
    return Plan(cfg, workdir, corpus, int(manifest["step"]), pos, manifest, rejected, note, train=train, val=val)


def open_val_corpus(cfg: TrainConfig) -> CorpusPart:
    from fractus_jax.atom import corpus as corpus_lib

    try:
        corpus = corpus_lib.open_corpus(cfg.val_corpus)
        corpus.validate(vocab=cfg.model.vocab_size)
    except corpus_lib.CorpusError as e:
        raise TrainError(f"val_corpus: {e}") from None
    return CorpusPart(corpus, 0, corpus.n_ids)


def val_slice(cfg: TrainConfig, val: CorpusPart):
    """The fixed held-out ids the trainer scores: the first val_ids of the held-out part."""
    return val.ids[:cfg.val_ids]


def check_val_slice(cfg: TrainConfig, val: Optional[CorpusPart]) -> None:
    from fractus_jax.eval import EvalError, lane_layout

    if val is None:   # val_fraction so small that no id is held out
        raise TrainError(f"val_fraction={cfg.val_fraction:g} of {cfg.corpus or 'the corpus'} holds out no id")
    n = min(cfg.val_ids, val.n_ids)
    try:
        lane_layout(n, cfg.val_lanes, cfg.seq_len)
    except EvalError as e:
        raise TrainError(f"the held-out slice ({n} ids of {val.path}, val_lanes={cfg.val_lanes}, "
                         f"chunks of seq_len={cfg.seq_len}): {e}") from None


def _resume_point(workdir: Path):
    """(meta, rejected, note) of the step a run in workdir resumes from: the newest committed
    step whose files match their checksums and whose meta reads, whatever the manifest says
    (it may lag a crash, or be gone). (None, [], None) for a fresh run. Reads only."""
    if not workdir.exists():
        return None, [], None
    try:
        step, meta, rejected, note = ckpt_lib.newest_good_step(workdir)
    except OSError as e:
        raise TrainError(f"cannot read the checkpoints of {workdir}: {rundir.reason(e)}") from None
    if step is None:
        if rejected:
            raise TrainError(ckpt_lib.no_good_step_message(workdir, rejected))
        if (workdir / rundir.MANIFEST).exists():
            raise TrainError(f"{workdir / rundir.MANIFEST} names a checkpoint, but {workdir / rundir.CHECKPOINTS} "
                             "holds none; move the manifest away to start afresh in this directory")
        return None, [], None
    if "config" not in meta:   # older checkpoints: the config is the manifest's
        try:
            meta["config"] = (rundir.read_manifest(workdir) or {})["config"]
        except (KeyError, rundir.CheckpointError):
            raise TrainError(f"{workdir}: step {step} records no config and there is no manifest with one") from None
    return meta, rejected, note


def _check_resume(cfg: TrainConfig, workdir: Path, manifest: dict) -> None:
    old = manifest.get("config", {})
    old_model = old.get("model", {})
    if old_model.get("vocab_size") != cfg.model.vocab_size:
        raise TrainError(f"{workdir}: the checkpoint's vocab is {old_model.get('vocab_size')}, "
                         f"the config's is {cfg.model.vocab_size}")
    changed = [f"{k}: checkpoint {old_model.get(k)!r}, config {getattr(cfg.model, k)!r}"
               for k in WEIGHT_FIELDS if old_model.get(k) != getattr(cfg.model, k)]
    if changed:
        raise TrainError(f"{workdir}: the model differs from the checkpoint's ({'; '.join(changed)})")
    for key in ("batch_size", "seq_len", "accum"):
        if manifest.get(key, old.get(key)) != getattr(cfg, key):
            raise TrainError(f"{workdir}: {key} was {manifest.get(key, old.get(key))} and is now "
                             f"{getattr(cfg, key)}; the lanes would change (keep {key}={manifest.get(key)})")
    # A run from before held-out splits records none: it held out nothing.
    was = float(old.get("val_fraction", 0.0))
    if was != cfg.val_fraction:
        before = " (a run from before held-out splits)" if "val_fraction" not in old else ""
        raise TrainError(f"{workdir}: val_fraction was {was:g}{before} and is now {cfg.val_fraction:g}; the lanes "
                         f"would change (keep val_fraction={was:g}, with eval_every=0 or a held-out "
                         "file to score: val_corpus=FILE)")
    if cfg.start_token == 0:
        raise TrainError(f"{workdir} has a checkpoint at step {manifest['step']}: start_token=0 would restart "
                         f"the data; drop it to resume at {manifest['start_token_next']}")


class _SkipWatch:
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


class _StopFlag:
    """SIGTERM/SIGINT: finish the current step, save, exit 0. A second SIGINT interrupts."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


SCHEDULE_FIELDS = ("lr", "warmup_steps", "lr_schedule", "lr_floor", "decay_steps")


def schedule_change_note(old_config: dict, cfg: TrainConfig, step: int) -> Optional[str]:
    """A note when the learning-rate schedule differs from the checkpoint's: the run goes on
    from its step on the new curve (the same fields continue the same curve exactly)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in SCHEDULE_FIELDS}
    changed = [f"{k} {old_config.get(k, defaults[k])} -> {getattr(cfg, k)}" for k in SCHEDULE_FIELDS
               if old_config.get(k, defaults[k]) != getattr(cfg, k)]
    if not changed:
        return None
    return (f"note: the learning-rate schedule differs from the checkpoint's ({', '.join(changed)}); "
            f"from step {step} the run follows the new one")


class HeldOut:
    """The trainer's held-out score: the fixed slice (`val_slice`) in val_lanes lanes,
    chunks of seq_len, the carry flowing from a zero start, scored by fractus_jax.eval
    (exact routing), so `python -m fractus_jax.eval --ids val_ids --lanes val_lanes`
    on a checkpoint gives the value logged at its step."""

    def __init__(self, cfg: TrainConfig, val: CorpusPart):
        from fractus_jax.eval import Scorer

        self.ids = np.asarray(val_slice(cfg, val), np.int32)
        self.scorer = Scorer(cfg.model, cfg.val_lanes, cfg.seq_len, feats=cfg.feats)

    def run(self, params) -> dict:
        s = self.scorer.score(params, self.ids)
        out = {"val_ce": s.ce, "val_ce_no_carry": s.ce_no_carry}
        if s.n_bytes:
            out.update(val_bpb=s.bpb, val_bpb_no_carry=s.bpb_no_carry)
        return out


def _progress_bar(total, initial, enabled, desc=None):
    if not enabled:
        return None
    from tqdm import tqdm   # loaded only when a bar is shown
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr, desc=desc)


def _bar_compiled(bar, n, seconds) -> None:
    """The first step after a compilation is done: the bar's clock, rate and ETA restart
    here (a rate that counted the compilation would promise an hour for a minute's run);
    its description keeps the compilation's seconds."""
    bar.reset(total=bar.total)
    bar.n = bar.last_print_n = bar.initial = n
    bar.set_description_str(f"compiled in {seconds:.0f}s", refresh=False)


def run(plan: Plan, progress: bool = True, log=print) -> dict:
    """Train from the plan to cfg.max_steps (or a stop); returns the last logged metrics.

    The run directory is held for the run (`rundir.RunDir`: a second writer is refused) and
    closed however the run ends: a save in flight commits, the lock is released."""
    rd = rundir.RunDir(plan.workdir, lead=jax.process_index() == 0, log=log).open()
    try:
        last = _train(plan, rd, progress, log)
    except BaseException:
        rd.close(quiet=True)
        raise
    rd.close()
    return last


def _restore(plan: Plan, ckpt, rd: rundir.RunDir, abstract, log):
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
    return dataclasses.replace(plan, resume_step=step, start_pos=pos, manifest=meta), state, meta


def _train(plan: Plan, rd: rundir.RunDir, progress: bool, log) -> dict:
    cfg, workdir = plan.cfg, plan.workdir
    deadline = parse_deadline(cfg.deadline)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    abstract = state_lib.abstract_train_state(cfg)
    shardings = state_lib.train_state_shardings(cfg, mesh, abstract)
    ckpt = ckpt_lib.RunCheckpointer(workdir, keep=cfg.keep_checkpoints, asynchronous=True, log=log)
    rd.checkpointer = ckpt
    ema = {"ema_tf": None, "ema_ss": None}
    growth = list((plan.manifest or {}).get("growth") or [])
    if plan.resume_step is not None:
        plan, state, meta = _restore(plan, ckpt, rd, ckpt_lib.abstract_with_shardings(abstract, shardings), log)
        ema.update({k: meta.get(k) for k in ema})
        growth = list(meta.get("growth") or growth)
        log(f"resumed {workdir} at step {plan.resume_step}, lane offset {plan.start_pos}")
        note = schedule_change_note(meta.get("config") or {}, cfg, plan.resume_step)
        if note:
            log(note)
    else:
        rd.start_metrics(None)
        state, _ = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(cfg.seed))
        if cfg.init_from:
            params, _ = ckpt_lib.load_for_inference(cfg.init_from)
            state = state_lib.with_params(cfg, state, jax.device_put(params, shardings["params"]))
            log(f"weights from {cfg.init_from}; fresh optimizer moments (warmup advised)")
    reader = LaneReader(plan.train.ids, cfg.batch_size, cfg.seq_len, cfg.accum)
    batch_shard = batch_shardings(cfg, mesh)

    def build(cfg):
        """The compiled step, the prober and the held-out scorer of a config (again after a growth)."""
        shardings = state_lib.train_state_shardings(cfg, mesh)
        return (jit_train_step(cfg, shardings, batch_shard),
                probes_lib.Prober(cfg, plan.train) if cfg.probe_every else None,
                HeldOut(cfg, plan.val) if cfg.eval_every else None)

    step_fn, prober, held_out = build(cfg)
    last_hits = None   # expert hits of the latest probe: where grown experts go

    step = int(plan.resume_step or 0)
    pos = plan.start_pos
    ids_per_step = cfg.batch_size * cfg.seq_len * cfg.accum
    lead = jax.process_index() == 0   # one process writes the log and shows progress
    skips = _SkipWatch(cfg.max_skipped_steps, cfg.lr, log)
    drops = KeepRateWatch(cfg.model.capacity_factor)
    compile_note = "compiling the train step" + (" and the probes" if prober is not None else "")
    bar = _progress_bar(cfg.max_steps, step, progress and lead, compile_note if step < cfg.max_steps else None)
    if bar is None and lead and step < cfg.max_steps:
        log(f"{compile_note}...")
    policy = policy_lib.StopSavePolicy(cfg.save_every_minutes, deadline, policy_lib.exchange_for_run())
    step_seconds = None
    # The first step of a program includes its compilation (minutes at 1B): it would inflate
    # the step time that the deadline margin reserves, so the estimate starts after it.
    compiling = True
    pending = None  # (step, device metrics, dispatch time) of the step in flight
    last = {}

    def meta_now(step_done, pos_next):
        meta = {"step": step_done, "start_token_next": pos_next, "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len, "accum": cfg.accum, "corpus": plan.corpus.identity(),
                "train_ids": plan.train.n_ids, "config": cfg.to_dict(), "growth": growth, **ema}
        if plan.val is not None:
            meta["held_out"] = plan.val.describe()
        return meta

    def save(step_done, pos_next, final=False):
        """Periodic saves write in the background; the last one (end, signal, deadline) blocks."""
        ckpt.save(state, meta_now(step_done, pos_next), block=final)
        policy.saved()

    def record(done_step, device_metrics, t_dispatch, t_prev):
        nonlocal step_seconds, last, compiling
        compiled_now = compiling   # this step waited for the compilation
        m = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        now = time.time()
        dt = max(now - t_prev, 1e-9)
        if compiling:
            compiling = False
        else:
            step_seconds = dt if step_seconds is None else 0.9 * step_seconds + 0.1 * dt
        if math.isfinite(m["ce_tf"]):   # a NaN would stay in the EMA for good
            ema["ema_tf"] = m["ce_tf"] if ema["ema_tf"] is None else EMA_DECAY * ema["ema_tf"] + (1 - EMA_DECAY) * m["ce_tf"]
        if m["ss_ran"] and math.isfinite(m["ce_ss"]):
            ema["ema_ss"] = m["ce_ss"] if ema["ema_ss"] is None else EMA_DECAY * ema["ema_ss"] + (1 - EMA_DECAY) * m["ce_ss"]
        m.update(step=done_step, ema_tf=ema["ema_tf"], ids_per_s_tf=ids_per_step / dt,
                 ids_per_s_wall=ids_per_step * (1 + m["ss_ran"]) / dt, step_s=dt)
        if not m["ss_ran"]:
            m.pop("ce_ss")
        else:
            m["ema_ss"] = ema["ema_ss"]
        if bar is not None and compiled_now:
            _bar_compiled(bar, done_step, dt)
        elif bar is not None:
            bar.update(done_step - bar.n)
        elif compiled_now and lead:
            log(f"step {done_step} took {dt:.0f}s, the compilation included")
        if bar is not None:
            keep = "" if cfg.model.capacity_factor is None else f" keep {m['keep_rate']:.2f}"
            bar.set_postfix_str(f"ce {m['ce_tf']:.3f} ema {ema['ema_tf']:.3f}{keep} {m['ids_per_s_tf']:.0f} ids/s",
                                refresh=False)
        last = m
        skips.observe(done_step, m["skipped"], rd.last_good)
        drop_warning = drops.update(done_step, m["keep_rate"])
        if drop_warning and lead:
            (bar.write if bar is not None else log)(drop_warning)
        return m

    def write_metrics(m):
        rd.write_metrics(m)   # non-finite values as null

    stop_reason = None
    t_prev = time.time()
    with _StopFlag() as stop:
        if prober is not None and step == 0:
            init_probe = prober.run(state["params"], initial=True)
            last_hits = np.asarray(init_probe["expert_hits"])
            write_metrics({"step": 0, **init_probe})
        while step < cfg.max_steps:
            if cfg.grow_at and step >= cfg.grow_at and not growth_lib.already_grown(growth, cfg.grow_at):
                if pending is not None:
                    m = record(*pending, t_prev)
                    pending = None
                    write_metrics(m)
                if ckpt.latest_step() != step:
                    save(step, pos, final=True)   # the run as it was, before growing
                state, cfg, grow_record = growth_lib.grow_in_place(state, cfg, mesh, step, last_hits)
                growth.append(grow_record)
                step_fn, prober, held_out = build(cfg)
                compiling = True
                if bar is not None:
                    bar.set_description_str("compiling the grown step")
                log(f"grew at step {step}: {grow_record['from']} -> {grow_record['to']}")
                t_prev = time.time()
            batch = global_batch(reader, pos, batch_shard, FEATURE_CONTEXT)
            pos_next = reader.position(pos) + reader.span
            state, device_metrics = step_fn(state, batch)
            step, pos = step + 1, pos_next
            if pending is not None:   # step n is dispatched: now read step n−1
                m = record(*pending, t_prev)
                t_prev = time.time()
                if m["step"] % cfg.log_every == 0:
                    write_metrics(m)
            pending = (step, device_metrics, time.time())
            # Time, signals and the save in flight: decided by process 0, the same everywhere.
            agreed = policy.at_step(step, stop.signal, ckpt, step_seconds)
            probe_now = prober is not None and step % cfg.probe_every == 0
            eval_now = held_out is not None and (step % cfg.eval_every == 0 or step == cfg.max_steps)
            save_now = step % cfg.save_every == 0 or agreed.save
            stop_reason = agreed.stop
            if probe_now or eval_now or save_now or stop_reason or step == cfg.max_steps:
                m = record(*pending, t_prev)
                t_prev, pending = time.time(), None
                if probe_now:
                    m.update(prober.run(state["params"]))
                    last_hits = np.asarray(m["expert_hits"])
                if eval_now:
                    m.update(held_out.run(state["params"]))
                if m["step"] % cfg.log_every == 0 or probe_now or eval_now or stop_reason or step == cfg.max_steps:
                    write_metrics(m)
                if save_now or stop_reason or step == cfg.max_steps:
                    save(step, pos, final=bool(stop_reason) or step == cfg.max_steps)
                t_prev = time.time()
            if stop_reason:
                break
    if bar is not None:
        bar.close()
    ckpt.close()
    policy.close()
    if stop_reason:
        log(f"stopped at step {step} ({stop_reason}); saved, lane offset {pos}")
    return last
