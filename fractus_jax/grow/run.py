"""Grow a run directory: read one checkpoint, check, grow, probe, write a new run directory
(`python -m fractus_jax.grow`; the engine's arrays grow in `fractus_jax.growth`, the train
state in `fractus_jax.train.growth`).

Everything a user can get wrong is checked before anything is written. The new run is
written under a temporary name beside --out, then moved into --out (checkpoints, the
metrics log, the manifest last) while --out is locked as a run directory.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from fractus_jax import growth as engine_growth
from fractus_jax.atom.corpus import CorpusError, open_corpus
from fractus_jax.growth import GrowthError, GrowthSpec
from fractus_jax.lanes import LaneError, LaneReader
from fractus_jax.model import STATE_ROW_AXIS
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import growth as growth_lib
from fractus_jax.train import rundir
from fractus_jax.train.config import ConfigError, TrainConfig, apply_overrides
from fractus_jax.train.prepare import resumed_parts

Log = Callable[[str], None]
HITS_SOURCES = ("auto", "probe", "metrics", "none")
METRICS = rundir.METRICS


def load_state(run_dir: Path, step: int, cfg: TrainConfig):
    """The whole train state of one step, on one device, in the shapes of cfg (that step's config)."""
    return ckpt_lib.restore_one_device(run_dir, step, cfg)[0]


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise GrowthError(f"--out {out} exists and is not a directory")
    if out.exists() and any(p.name != rundir.LOCK for p in out.iterdir()):
        raise GrowthError(f"--out {out} is not empty; grow into a new directory")


def target_from(cfg: TrainConfig, growth: GrowthSpec, overrides: Sequence[str]) -> TrainConfig:
    """--set model.FIELD=VALUE applies to the source config, then the growth spec; checked."""
    bad = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("model.")]
    if bad:
        raise GrowthError(f"--set takes model.FIELD=VALUE only (the grown engine), got {', '.join(bad)}")
    try:
        asked = apply_overrides(cfg, list(overrides)).model
    except ConfigError as e:
        raise GrowthError(str(e)) from None
    return growth_lib.target_config(cfg, growth.target(asked) if overrides else growth)


def probe_chunk(cfg: TrainConfig, meta: dict, rows: int, corpus_path=None, log: Log = print):
    """(ids (rows, seq_len), row indices, where they came from): the first rows of the batch
    the trainer reads next, or random byte ids when the corpus cannot be read."""
    rows = max(1, min(rows, cfg.batch_size))
    path = corpus_path or (meta.get("corpus") or {}).get("path") or cfg.corpus
    if path:
        try:
            corpus = open_corpus(path)
            if corpus_path is None:
                why = corpus.prefix_change(meta.get("corpus") or {})
                if why is not None:
                    raise CorpusError(why)
            # the lanes cover the part of the corpus that is not held out (train_ids)
            train, _ = resumed_parts(meta, corpus, cfg.val_fraction)
            reader = LaneReader(train.ids, cfg.batch_size, cfg.seq_len, cfg.accum)
            chunks = reader.read(int(meta.get("start_token_next", 0)))[0]
            return np.asarray(chunks[0, :rows, :-1], np.int32), f"next batch of {path}"
        except (CorpusError, LaneError, OSError) as e:
            log(f"the probe cannot read the corpus ({e}); it uses random byte ids instead")
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (rows, cfg.seq_len)).astype(np.int32), "random byte ids"


def metrics_hits(run_dir: Path, step: int, shape) -> Optional[np.ndarray]:
    """The last logged probe `expert_hits` at or before step, if its shape fits."""
    path = run_dir / METRICS
    if not path.exists():
        return None
    hits = None
    for _, m in rundir.read_metrics(path):
        if m.get("step", 0) <= step and "expert_hits" in m:
            hits = m["expert_hits"]
    if hits is None or np.asarray(hits).shape != tuple(shape):
        return None
    return np.asarray(hits, np.float64)


def _rows(carry, n):
    """The carry of the first n rows (lanes)."""
    return {k: v[(slice(None),) * STATE_ROW_AXIS[k] + (slice(0, n),)] for k, v in carry.items()}


def grow_run(ckpt, out, growth: GrowthSpec, overrides: Sequence[str] = (), hits: str = "auto",
             probe_rows: int = 8, corpus=None, seed: int = 0, log: Log = print) -> dict:
    """`python -m fractus_jax.grow`: returns the growth record written into the manifest."""
    if hits not in HITS_SOURCES:
        raise GrowthError(f"--hits must be one of {', '.join(HITS_SOURCES)}, got {hits!r}")
    out = Path(out)
    _check_out(out)
    run_dir, step = ckpt_lib.resolve_checkpoint(ckpt)
    if out.resolve() == run_dir.resolve():
        raise GrowthError("--out must be a new directory, not the run itself")
    step, meta, cfg = ckpt_lib.read_step(run_dir, step)   # the config its arrays have
    new_cfg = target_from(cfg, growth, overrides)
    spec = GrowthSpec.between(cfg.model, new_cfg.model)
    ids, probe_source = probe_chunk(cfg, meta, probe_rows, corpus, log)

    state = load_state(run_dir, step, cfg)
    old_out = engine_growth.probe(state["params"], _rows(state["carry"], len(ids)), ids, cfg.model)
    hit_counts, hits_source = None, "none"
    if spec.add_experts:
        if hits in ("auto", "probe") and (hits == "probe" or probe_source != "random byte ids"):
            hit_counts, hits_source = engine_growth.routing_demand(old_out[1], cfg.model.n_experts), "probe"
        elif hits in ("auto", "metrics"):
            hit_counts = metrics_hits(run_dir, step, (cfg.model.n_layers, cfg.model.n_experts))
            hits_source = "metrics" if hit_counts is not None else "none"
            if hit_counts is None and hits == "metrics":
                log(f"{run_dir / METRICS} holds no expert_hits for this shape: new experts go to the widest gaps")
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    grown, _ = growth_lib.grow_train_state(state, cfg, new_cfg.model, key=key, hits=hit_counts)
    new_out = engine_growth.probe(grown["params"], _rows(grown["carry"], len(ids)), ids, new_cfg.model)
    change = engine_growth.compare_probe(old_out, new_out)
    phases = np.asarray(grown["params"]["blocks"]["moe"]["expert_phases"])[:cfg.model.n_layers, cfg.model.n_experts:]
    record = growth_lib.growth_record(
        cfg, new_cfg, step, hits_source, source=str(run_dir.resolve()), seed=seed,
        probe=f"{probe_source}, {ids.shape[0]} rows x {ids.shape[1]}, carried state, no capacity",
        **{k: v for k, v in change.items() if not k.endswith("_mask")},
        new_expert_phases=np.round(phases, 6).tolist() if spec.add_experts else None)
    new_meta = {**meta, "config": new_cfg.to_dict(), "growth": [*meta.get("growth", []), record]}
    _write(out, grown, new_meta, run_dir, step, new_cfg, log)
    return record


def _write(out: Path, state, meta: dict, run_dir: Path, step: int, cfg: TrainConfig, log: Log = print) -> None:
    """Write the grown run beside out, then move it in (the manifest last), out locked all along."""
    created = not out.exists()
    out_dir = rundir.RunDir(out, log=log).open()   # a trainer started on out meanwhile is refused
    try:
        _check_out(out)   # still empty: nothing wrote it before the lock was taken
    except BaseException:
        out_dir.close(quiet=True)
        raise
    tmp = out.parent / f".{out.name}.growing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    moved = []
    try:
        tmp.mkdir()
        # the history up to the grown step, so plots continue
        rundir.copy_metrics(run_dir / METRICS, tmp / METRICS, step, log)
        writer = ckpt_lib.RunCheckpointer(tmp, keep=cfg.keep_checkpoints, log=log)
        try:
            writer.save(state, meta)
        finally:
            writer.close()
        for name in (rundir.CHECKPOINTS, METRICS, rundir.MANIFEST):
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
                moved.append(out / name)
        tmp.rmdir()
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for target in moved:
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        if created:
            (out / rundir.LOCK).unlink(missing_ok=True)
        out_dir.close(quiet=True)
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise rundir.io_error("cannot write", out, e, None) from None
        raise
    out_dir.close()


def resume_overrides(growth: list) -> list[str]:
    """The --set flags that make the run's original trainer command resume after its growths
    (the trainer compares the command line's model shape with the manifest's)."""
    first, last = growth[0]["from"], growth[-1]["to"]
    return [f"model.{k}={v}" for k, v in last.items() if v != first.get(k)]
