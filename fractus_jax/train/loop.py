"""The training loop: checks first, then state, then steps, saves and logs.

Everything a user can get wrong is checked before anything is written (`prepare`), so a
refused run leaves the disk as it was. Inside the loop the host never waits on the device
except to read step n−1's metrics after dispatching step n.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
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
from fractus_jax.config import WEIGHT_FIELDS
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import growth as growth_lib
from fractus_jax.train import probes as probes_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import TrainConfig
from fractus_jax.train.data import DataError, LaneReader, global_batch
from fractus_jax.train.step import batch_shardings, jit_train_step

METRICS = "metrics.jsonl"
EMA_DECAY = 0.99
FEATURE_CONTEXT = 64  # ids before a chunk that its packet features may look at


class TrainError(ValueError):
    """A refusal: the run cannot start as asked; nothing was written."""




@dataclasses.dataclass
class Plan:
    cfg: TrainConfig
    workdir: Path
    corpus: object
    resume_step: Optional[int]
    start_pos: int
    manifest: Optional[dict]


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
    from fractus_jax.atom import corpus as corpus_lib

    path = cfg.corpus
    if not path:
        if cfg.model.vocab_size != 266:
            raise TrainError("no corpus set: the embedded default corpus is an Atom (266-id) stream, "
                             f"this model's vocab is {cfg.model.vocab_size}; pass --set corpus=FILE")
        path = corpus_lib.build_default_corpus(cache_dir(), progress=progress)
    try:
        corpus = corpus_lib.open_corpus(path)
        corpus.validate(vocab=cfg.model.vocab_size)
    except corpus_lib.CorpusError as e:
        raise TrainError(str(e)) from None
    return corpus


def resolve_for_mesh(cfg: TrainConfig) -> TrainConfig:
    """moe_group_rows=0 means one MoE dispatch group per device: capacity is counted over
    each device's own tokens, so dispatch never crosses devices."""
    n = cfg.mesh.data * cfg.mesh.fsdp
    if cfg.model.moe_group_rows == 0 and n > 1:
        return dataclasses.replace(cfg, model=cfg.model.replace(moe_group_rows=cfg.batch_size // n))
    return cfg


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
        from fractus_jax import grow as grow_lib
        try:
            grow_lib.target_config(cfg, grow_lib.GrowthSpec(cfg.grow.add_layers, cfg.grow.add_experts,
                                                            cfg.grow.siren_rank))
        except grow_lib.GrowthError as e:
            raise TrainError(f"grow_at={cfg.grow_at}: {e}") from None
    rows = cfg.model.moe_group_rows
    if rows and (cfg.batch_size // n) % rows:
        raise TrainError(f"model.moe_group_rows={rows} does not divide the {cfg.batch_size // n} rows per device")
    streams = cfg.model.row_streams
    if streams > 1 and n > 1:
        raise TrainError(f"model.row_streams={streams} is for one device: a mesh of {n} devices "
                         "already runs its rows apart (set model.row_streams=1)")
    if streams > 1 and (rows == 0 or cfg.batch_size % (streams * rows)):
        raise TrainError(f"batch_size {cfg.batch_size} does not split into model.row_streams={streams} "
                         f"streams of whole MoE dispatch groups (model.moe_group_rows={rows}; "
                         "0 makes the batch one group)")
    if workdir.exists() and not workdir.is_dir():
        raise TrainError(f"workdir {workdir} exists and is not a directory")
    manifest = ckpt_lib.read_manifest(workdir) if workdir.exists() else None
    if manifest is not None:
        cfg = growth_lib.grown_model_for(cfg, manifest) or cfg
        _check_resume(cfg, workdir, manifest)
    corpus = open_training_corpus(cfg, progress)
    try:
        LaneReader(corpus.ids, cfg.batch_size, cfg.seq_len, cfg.accum, source=str(corpus.path))
    except DataError as e:
        raise TrainError(str(e)) from None
    if manifest is None:
        return Plan(cfg, workdir, corpus, None, cfg.start_token or 0, None)

    if manifest.get("corpus", {}).get("n_ids") not in (None, corpus.n_ids):
        raise TrainError(f"{workdir}: the checkpoint's corpus had {manifest['corpus']['n_ids']} ids, "
                         f"{corpus.path} has {corpus.n_ids}; the lane offsets would not mean the same text")
    pos = cfg.start_token if cfg.start_token is not None else int(manifest["start_token_next"])
    return Plan(cfg, workdir, corpus, int(manifest["step"]), pos, manifest)


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
    if cfg.start_token == 0:
        raise TrainError(f"{workdir} has a checkpoint at step {manifest['step']}: start_token=0 would restart "
                         f"the data; drop it to resume at {manifest['start_token_next']}")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop log lines past the restored step (written after the last save before a crash)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= last_step]
    if len(keep) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, path)


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


def _progress_bar(total, initial, enabled):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


def run(plan: Plan, progress: bool = True, log=print) -> dict:
    """Train from the plan to cfg.max_steps (or a stop); returns the last logged metrics."""
    cfg, workdir = plan.cfg, plan.workdir
    deadline = parse_deadline(cfg.deadline)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    abstract = state_lib.abstract_train_state(cfg)
    shardings = state_lib.train_state_shardings(cfg, mesh, abstract)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_lib.RunCheckpointer(workdir, keep=cfg.keep_checkpoints, asynchronous=True)
    ema = {"ema_tf": None, "ema_ss": None}
    growth = list((plan.manifest or {}).get("growth") or [])
    if plan.resume_step is not None:
        state, meta = ckpt.restore(ckpt_lib.abstract_with_shardings(abstract, shardings), plan.resume_step)
        ema.update({k: meta.get(k) for k in ema})
        growth = list(meta.get("growth") or growth)
        if jax.process_index() == 0:
            _truncate_metrics(workdir / METRICS, plan.resume_step)
        log(f"resumed {workdir} at step {plan.resume_step}, lane offset {plan.start_pos}")
    else:
        state, _ = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(cfg.seed))
        if cfg.init_from:
            params, _ = ckpt_lib.load_for_inference(cfg.init_from)
            state = state_lib.with_params(cfg, state, jax.device_put(params, shardings["params"]))
            log(f"weights from {cfg.init_from}; fresh optimizer moments (warmup advised)")
    reader = LaneReader(plan.corpus.ids, cfg.batch_size, cfg.seq_len, cfg.accum)
    batch_shard = batch_shardings(cfg, mesh)

    def build(cfg):
        """The compiled step and the prober of a config (again after a growth)."""
        shardings = state_lib.train_state_shardings(cfg, mesh)
        return (jit_train_step(cfg, shardings, batch_shard),
                probes_lib.Prober(cfg, plan.corpus) if cfg.probe_every else None)

    step_fn, prober = build(cfg)
    last_hits = None   # expert hits of the latest probe: where grown experts go

    step = int(plan.resume_step or 0)
    pos = plan.start_pos
    ids_per_step = cfg.batch_size * cfg.seq_len * cfg.accum
    lead = jax.process_index() == 0   # one process writes the log and shows progress
    metrics_file = open(workdir / METRICS, "a") if lead else None
    bar = _progress_bar(cfg.max_steps, step, progress and lead)
    last_save = time.time()
    step_seconds = None
    # The first step of a program includes its compilation (minutes at 1B): it would inflate
    # the step time that the deadline margin reserves, so the estimate starts after it.
    compiling = True
    pending = None  # (step, device metrics, dispatch time) of the step in flight
    last = {}

    def meta_now(step_done, pos_next):
        return {"step": step_done, "start_token_next": pos_next, "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len, "accum": cfg.accum, "corpus": plan.corpus.identity(),
                "config": cfg.to_dict(), "growth": growth, **ema}

    def save(step_done, pos_next, final=False):
        """Periodic saves write in the background; the last one (end, signal, deadline) blocks."""
        nonlocal last_save
        ckpt.save(state, meta_now(step_done, pos_next), block=final)
        last_save = time.time()

    def record(done_step, device_metrics, t_dispatch, t_prev):
        nonlocal step_seconds, last, compiling
        m = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        now = time.time()
        dt = max(now - t_prev, 1e-9)
        if compiling:
            compiling = False
        else:
            step_seconds = dt if step_seconds is None else 0.9 * step_seconds + 0.1 * dt
        ema["ema_tf"] = m["ce_tf"] if ema["ema_tf"] is None else EMA_DECAY * ema["ema_tf"] + (1 - EMA_DECAY) * m["ce_tf"]
        if m["ss_ran"]:
            ema["ema_ss"] = m["ce_ss"] if ema["ema_ss"] is None else EMA_DECAY * ema["ema_ss"] + (1 - EMA_DECAY) * m["ce_ss"]
        m.update(step=done_step, ema_tf=ema["ema_tf"], ids_per_s_tf=ids_per_step / dt,
                 ids_per_s_wall=ids_per_step * (1 + m["ss_ran"]) / dt, step_s=dt)
        if not m["ss_ran"]:
            m.pop("ce_ss")
        else:
            m["ema_ss"] = ema["ema_ss"]
        if bar is not None:
            bar.update(done_step - bar.n)
            bar.set_postfix_str(f"ce {m['ce_tf']:.3f} ema {ema['ema_tf']:.3f} {m['ids_per_s_tf']:.0f} ids/s", refresh=False)
        last = m
        return m

    def write_metrics(m):
        if metrics_file is None:
            return
        metrics_file.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                       for k, v in m.items()}) + "\n")
        metrics_file.flush()

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
                step_fn, prober = build(cfg)
                compiling = True
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
            ckpt.poll()
            probe_now = prober is not None and step % cfg.probe_every == 0
            save_now = step % cfg.save_every == 0 or (
                cfg.save_every_minutes > 0 and time.time() - last_save >= 60 * cfg.save_every_minutes)
            if stop.signal:
                stop_reason = f"{stop.signal} received"
            elif deadline is not None and time.time() + 2 * (step_seconds or 0) + 1.5 * ckpt.save_seconds() >= deadline:
                stop_reason = "deadline near"
            if probe_now or save_now or stop_reason or step == cfg.max_steps:
                m = record(*pending, t_prev)
                t_prev, pending = time.time(), None
                if probe_now:
                    m.update(prober.run(state["params"]))
                    last_hits = np.asarray(m["expert_hits"])
                if m["step"] % cfg.log_every == 0 or probe_now or stop_reason or step == cfg.max_steps:
                    write_metrics(m)
                if save_now or stop_reason or step == cfg.max_steps:
                    save(step, pos, final=bool(stop_reason) or step == cfg.max_steps)
                t_prev = time.time()
            if stop_reason:
                break
    if bar is not None:
        bar.close()
    if metrics_file is not None:
        metrics_file.close()
    ckpt.close()
    if stop_reason:
        log(f"stopped at step {step} ({stop_reason}); saved, lane offset {pos}")
    return last
