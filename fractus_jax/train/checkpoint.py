"""Run directories: Orbax checkpoints plus a human-readable manifest.

    DIR/checkpoints/<step>/{params, opt_state, extra, meta}   (Orbax, committed atomically)
    DIR/manifest.json                                          (rewritten after each commit)
    DIR/metrics.jsonl

Orbax writes a step into a temporary directory and renames it when complete, so a crash
mid-write leaves the previous step intact (a new manager ignores the leftover). The
manifest is written after the commit, by rename too, so it never names a step that is not
on disk. Parameters, optimizer moments and the rest are separate items: inference and
conversion restore only what they need.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from fractus_jax.config import EngineConfig
from fractus_jax.train.config import TrainConfig

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
ITEMS = ("params", "opt_state", "extra", "meta")
COMMIT_GUESS_SECONDS = 30.0   # a save's time to commit, until one is measured


class CheckpointError(ValueError):
    """A run directory that cannot be used as asked."""


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(workdir) -> Optional[dict]:
    path = Path(workdir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None


def _manager(workdir, keep: int = 3, read_only: bool = False, asynchronous: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           enable_async_checkpointing=asynchronous, read_only=read_only)
    return ocp.CheckpointManager(Path(workdir).resolve() / CHECKPOINTS, options=options, item_names=ITEMS)


class RunCheckpointer:
    """Saves and restores a trainer's state in a run directory.

    With `asynchronous=True`, `save` returns once the arrays are copied off the devices
    and Orbax writes them in the background while training goes on; the manifest that
    names the step is written only when `poll` (or `wait`) sees the write committed.
    """

    def __init__(self, workdir, keep: int = 3, read_only: bool = False, asynchronous: bool = False):
        self.workdir = Path(workdir)
        self.manager = _manager(workdir, keep, read_only, asynchronous)
        self._pending_manifest = None
        self._save_started = 0.0
        # Seconds from a save's start to its commit (an upper bound when seen by poll);
        # a guess until one is measured. The trainer's deadline margin uses it.
        self.commit_seconds = COMMIT_GUESS_SECONDS

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, state, meta: dict, block: bool = True) -> None:
        self.wait()   # one write at a time: the previous manifest first
        step = int(meta["step"])
        extra = {k: state[k] for k in ("carry", "step", "skipped")}
        # Started before manager.save: its copy off the devices is part of what a save costs.
        self._save_started = time.time()
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            extra=ocp.args.StandardSave(extra),
            meta=ocp.args.JsonSave(meta)), force=True)
        self._pending_manifest = meta
        if block:
            self.wait()

    def save_seconds(self) -> float:
        """A blocking save's expected seconds from now: the last commit time, twice that while a
        background save is still being written (a save waits for it first)."""
        return self.commit_seconds * (1 if self._pending_manifest is None else 2)

    def poll(self) -> None:
        """Write the manifest of a background save that has committed."""
        if self._pending_manifest is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the last save is committed, then write its manifest."""
        if self._pending_manifest is None:
            return
        self.manager.wait_until_finished()
        self.commit_seconds = time.time() - self._save_started
        meta, self._pending_manifest = self._pending_manifest, None
        if jax.process_index() == 0:
            manifest = dict(meta, checkpoint=f"{CHECKPOINTS}/{meta['step']}", format=FORMAT_VERSION,
                            time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
            write_json_atomic(self.workdir / MANIFEST, manifest)

    def _existing_step(self, step: Optional[int]) -> int:
        """step, or the latest one when None; refused when the directory does not hold it."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.workdir} holds no checkpoint")
        if step not in self.manager.all_steps():
            raise CheckpointError(f"{self.workdir} has no checkpoint at step {step} "
                                  f"(steps: {sorted(self.manager.all_steps())})")
        return step

    def read_meta(self, step: Optional[int] = None) -> tuple[int, dict]:
        """(step, the meta saved with it), without reading any array; the latest step when None."""
        step = self._existing_step(step)
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return step, dict(restored["meta"])

    def restore(self, abstract_state, step: Optional[int] = None, items=("params", "opt_state", "extra")):
        """Restore into the shapes/dtypes/shardings of `abstract_state` (ShapeDtypeStructs)."""
        step = self._existing_step(step)
        extra_abstract = {k: abstract_state[k] for k in ("carry", "step", "skipped")}
        wanted = {"params": abstract_state["params"], "opt_state": abstract_state["opt_state"],
                  "extra": extra_abstract}
        args = {k: ocp.args.StandardRestore(wanted[k]) for k in items}
        args["meta"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        state = {k: restored[k] for k in items if k != "extra"}
        if "extra" in items:
            state.update(restored["extra"])
        return state, restored["meta"]

    def close(self) -> None:
        self.wait()
        self.manager.close()


def resolve_checkpoint(ckpt) -> tuple[Path, Optional[int]]:
    """A run directory (its latest step) or DIR/checkpoints/<step> → (run dir, step or None)."""
    path = Path(ckpt)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run directory or checkpoint")
    if (path / MANIFEST).is_file():
        return path, None
    run_dir = path.parent.parent
    if path.parent.name == CHECKPOINTS and path.name.isdigit() and (run_dir / MANIFEST).is_file():
        return run_dir, int(path.name)
    raise CheckpointError(f"{path} is neither a run directory (no {MANIFEST}) "
                          f"nor a step directory DIR/{CHECKPOINTS}/<step>")


def abstract_with_shardings(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def read_step(run_dir, step: Optional[int] = None) -> tuple[int, dict, TrainConfig]:
    """(step, the meta saved with it, its TrainConfig); the latest step when step is None.

    The config is the one saved with that step, i.e. the shapes its arrays have: a run grown
    in place (`grow_at`) holds steps of two shapes, and its manifest describes only the
    latest. Checkpoints whose meta holds no config take the manifest's (set into meta too).
    """
    ck = RunCheckpointer(run_dir, read_only=True)
    try:
        step, meta = ck.read_meta(step)
    finally:
        ck.close()
    if "config" not in meta:
        manifest = read_manifest(run_dir)
        if manifest is None or "config" not in manifest:
            raise CheckpointError(f"{run_dir}: step {step} records no config and there is no manifest with one")
        meta["config"] = manifest["config"]
    return step, meta, TrainConfig.from_dict(meta["config"])


def one_device_abstract(cfg: TrainConfig):
    """The abstract train state of cfg (ShapeDtypeStructs) on the first device."""
    from fractus_jax.train import state as train_state

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        train_state.abstract_train_state(cfg))


def restore_one_device(run_dir, step: int, cfg: TrainConfig, items=("params", "opt_state", "extra")):
    """(state, meta) of one step on the first device, in the shapes of cfg (that step's config:
    `read_step`)."""
    ckpt = RunCheckpointer(run_dir, read_only=True)
    try:
        return ckpt.restore(one_device_abstract(cfg), step, items=items)
    finally:
        ckpt.close()


def load_for_inference(run_dir, step: Optional[int] = None):
    """(params, EngineConfig) of a run directory's latest (or given) checkpoint, on one device."""
    if read_manifest(run_dir) is None:
        raise CheckpointError(f"{run_dir} is not a run directory (no {MANIFEST})")
    step, _, cfg = read_step(run_dir, step)
    state, _ = restore_one_device(run_dir, step, cfg, items=("params",))
    return state["params"], cfg.model


def engine_config_of(manifest: dict) -> EngineConfig:
    return EngineConfig.from_dict(manifest["config"]["model"])
