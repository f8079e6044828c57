"""Run directories: Orbax checkpoints, their checksums, and a human-readable manifest.

    DIR/checkpoints/<step>/{params, opt_state, extra, meta}   (Orbax, committed atomically)
    DIR/checkpoints/<step>/checksums.json                     (written after the commit)
    DIR/manifest.json                                          (rewritten after each commit)
    DIR/metrics.jsonl

Orbax writes a step into a temporary directory and renames it when complete, so a crash
mid-write leaves the previous step intact (a new manager ignores the leftover; the trainer
removes it at start). After the commit, `checksums.json` records the sha256 of every file of
each item and whether the saved weights and moments were finite; then the manifest is
written, by rename too. The committed steps are the truth: a resume takes the newest step
whose files match their checksums, whose meta reads and whose restored arrays are finite
(`newest_good_step`, `restore_good`), and the manifest is repaired from it. Parameters,
optimizer moments and the rest are separate items: inference and conversion restore only
what they need. The lock, the manifest's files and the metrics log are `rundir.py`'s.

A run on object storage trained by several processes (`store.Mirror.parts`) has no directory
they all see: each writes its own shards into its own stage (Orbax without a primary host,
each array as zarr chunk files rather than OCDBT, whose files Orbax merges in one shared
directory), and the checksums record the union of every process's files, exchanged after
the commit. Orbax restores either layout.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from fractus_jax.train import policy, rundir
from fractus_jax.train import state as train_state
from fractus_jax.train.config import ConfigError, TrainConfig
from fractus_jax.train.rundir import CHECKPOINTS, MANIFEST, CheckpointError, read_manifest, write_json_atomic

ITEMS = ("params", "opt_state", "extra", "meta")
RECENT_COMMITS = 5            # the deadline margin reserves the slowest of this many last saves
CHECKSUMS = "checksums.json"
CHECKED_FINITE = ("params", "opt_state")
# The items a reader of the weights alone needs (eval, generate, an export without the
# moments): a step read from object storage is fetched, and checked, for them only.
WEIGHTS_ITEMS = ("params", "extra", "meta")

# A save not yet timed is sized by its state (`first_save_seconds`): the bytes this process
# writes at SAVE_WRITE_BYTES_PER_SECOND, plus the whole step read back for its checksums
# (process 0 hashes every file) at CHECKSUM_READ_BYTES_PER_SECOND, and never less than
# FIRST_SAVE_FLOOR_SECONDS. The rates are those of a slow pod disk, not of a fast one: a
# deadline guessed long costs a few minutes of a run, one guessed short loses what the
# last save left out. atom_1b on one host (11.9 GB: weights, AdamW moments, carry): 143 s.
SAVE_WRITE_BYTES_PER_SECOND = 100e6
CHECKSUM_READ_BYTES_PER_SECOND = 500e6
FIRST_SAVE_FLOOR_SECONDS = 2.0
# A run on object storage whose save waits this long for the upload before it (the store takes
# a step more slowly than the run saves) is told so, with what lets training go on.
UPLOAD_WAIT_WARN_SECONDS = 10.0


def save_bytes(state) -> tuple[int, int]:
    """(bytes this process writes, bytes of the whole step) of a train state's saved arrays
    (params, opt_state, carry, step, skipped). Of a jax array this process writes the shards
    it holds as replica 0, as Orbax has it; an abstract state (jax.eval_shape, nothing
    allocated) counts whole, as one process's."""
    written = whole = 0
    for leaf in jax.tree_util.tree_leaves(state):
        size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        whole += size
        if isinstance(leaf, jax.Array):
            written += sum(s.data.nbytes for s in leaf.addressable_shards if s.replica_id == 0)
        else:
            written += size
    return written, whole


def first_save_seconds(state) -> float:
    """The seconds a save of `state` is expected to take before one is timed: the rule above."""
    written, whole = save_bytes(state)
    return max(FIRST_SAVE_FLOOR_SECONDS,
               written / SAVE_WRITE_BYTES_PER_SECOND + whole / CHECKSUM_READ_BYTES_PER_SECOND)


class CommitTimes:
    """The last RECENT_COMMITS saves' seconds to commit. `seconds()` is the slowest of them
    (one slow write, a loaded disk, is the one a deadline must allow for), or `guess` (the
    state's `first_save_seconds`) before any is measured."""

    def __init__(self, guess: float = FIRST_SAVE_FLOOR_SECONDS):
        self.guess = guess
        self.recent = collections.deque(maxlen=RECENT_COMMITS)

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)

    def seconds(self) -> float:
        return max(self.recent) if self.recent else self.guess


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


# ----------------------------------------------------------------------------- integrity

def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def item_checksums(item_dir: Path) -> dict:
    """{relative path: sha256} of every file of one item of a committed step."""
    return {str(p.relative_to(item_dir)): _file_sha256(p)
            for p in sorted(item_dir.rglob("*")) if p.is_file()}


def write_checksums(step_dir: Path, finite: dict, items: Optional[dict] = None) -> None:
    """The step's record, after its commit: each item's files and their sha256 (read back at
    about 1.7 GB/s here; `items` when known already), and whether params and opt_state were
    finite when saved."""
    record = {"format": 1, "algorithm": "sha256 of each file",
              "items": items if items is not None else {item: item_checksums(step_dir / item) for item in ITEMS},
              "finite": {k: bool(v) for k, v in finite.items()}}
    write_json_atomic(step_dir / CHECKSUMS, record)


def gather_step_files(step_dir: Path, key: str) -> dict[str, tuple[int, str, int]]:
    """{path in the step: (size, sha256, the lowest process holding it)} of every process's
    files of a step each process saved into its own directory. Every process calls it with
    the same key (one per save) and gets the same answer, through the coordination service's
    key-value store: no device collective, whose first use gives up when the processes come
    to it far apart (one still finishing its save)."""
    mine = {str(p.relative_to(step_dir)): [p.stat().st_size, _file_sha256(p)]
            for p in sorted(step_dir.rglob("*")) if p.is_file()}
    union: dict[str, tuple[int, str, int]] = {}
    for process, files in enumerate(policy.gather_json(key, mine, jax.process_index(), jax.process_count())):
        for name, (size, sha) in files.items():
            union.setdefault(name, (int(size), sha, process))
    return union


def unmatched(files_dir: Path, names, record: Optional[dict]) -> set[str]:
    """Those of a step's files ("item/path", under files_dir) whose sha256 is not the one its
    checksums record (`read_checksums`) gives, or that the record does not name."""
    items = (record or {}).get("items") or {}
    bad = set()
    for name in names:
        item, _, path = name.partition("/")
        digest = items.get(item, {}).get(path)
        if digest is None or _file_sha256(files_dir / name) != digest:
            bad.add(name)
    return bad


def check_some(step_dir: Path, names) -> Optional[str]:
    """Why some of a step's files ("item/path") do not match its checksums.json, or None."""
    bad = sorted(unmatched(step_dir, names, read_checksums(step_dir)))
    if bad:
        item, _, path = bad[0].partition("/")
        return f"{item} failed its checksum ({path} differs)"
    return None


def read_checksums(step_dir: Path) -> Optional[dict]:
    try:
        record = json.loads((step_dir / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("items"), dict) else None


# The items of steps this process has just checked against their checksums, each step under
# a read lock that no other command removes it under (a read cache's step, `store.readable`):
# the next check_files of the step takes them as checked rather than hash them again (4 GB of
# weights for atom_1b). {resolved step dir: items}, each used once.
_verified: dict[str, frozenset] = {}


def verified(step_dir: Path, items) -> None:
    """The next check_files of step_dir (and only the next) takes these items as checked;
    no items: none (this process is about to check it itself)."""
    _verified[str(Path(step_dir).resolve())] = frozenset(items)


def check_files(step_dir: Path, items=None, absent=frozenset()) -> tuple[str, Optional[str]]:
    """("ok" | "unchecked" | "bad", why): a step's files against its checksums.json; of the
    items named only (a reader that fetched those alone), or of every item. absent: files
    ("item/path") the directory may lack (a process's pull of a step in part: the shards
    other processes read), checked where it holds them. Items this process has just checked
    (`verified`) are not hashed again.
    "unchecked": no (readable) record, as for a save cut before it wrote one or an older run."""
    done = _verified.pop(str(Path(step_dir).resolve()), frozenset())
    record = read_checksums(step_dir)
    if record is None:
        return "unchecked", None
    for item, files in record["items"].items():
        if (items is not None and item not in items) or item in done:
            continue
        item_dir = step_dir / item
        if not item_dir.is_dir():
            return "bad", f"{item} is missing"
        have = {str(p.relative_to(item_dir)) for p in item_dir.rglob("*") if p.is_file()}
        for name, digest in files.items():
            if f"{item}/{name}" in absent and name not in have:
                continue
            try:
                ok = _file_sha256(item_dir / name) == digest
            except OSError as e:
                return "bad", f"{item} could not be read ({name}: {rundir.reason(e)})"
            if not ok:
                return "bad", f"{item} failed its checksum ({name} differs)"
        extra = sorted(have - set(files))
        if extra:
            return "bad", f"{item} failed its checksum ({extra[0]} was not saved with it)"
    return "ok", None


def saved_non_finite(step_dir: Path) -> Optional[str]:
    """Why a step's checksums.json says it was saved holding NaN or Inf, or None."""
    finite = (read_checksums(step_dir) or {}).get("finite") or {}
    bad = sorted(k for k, ok in finite.items() if not ok)
    return f"{' and '.join(bad)} held NaN or Inf when saved" if bad else None


@jax.jit
def _finite_flags(tree):
    return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]


def non_finite(tree) -> dict[str, list[str]]:
    """{item: [paths of leaves holding NaN or Inf]} of {item: subtree} (float leaves only)."""
    picked = {item: {_dotted(path): leaf
                     for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]
                     if jnp.issubdtype(leaf.dtype, jnp.inexact)}
              for item, sub in tree.items()}
    flags = jax.device_get(_finite_flags(picked))
    # jax.tree.leaves orders dict keys sorted: so do the names
    names = [(item, name) for item in sorted(picked) for name in sorted(picked[item])]
    out: dict[str, list[str]] = {}
    for (item, name), ok in zip(names, flags):
        if not bool(ok):
            out.setdefault(item, []).append(name)
    return out


def _dotted(path) -> str:
    """blocks.moe.V1 for a tree path (dict keys, sequence indices, attribute names)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _leaf_list(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class _NoticeFilter(logging.Filter):
    """Drops Orbax's warnings that restate a choice the caller made on purpose; other absl
    messages pass."""

    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


# logged for every manager built to read, which every load does
_READ_ONLY_NOTICE = _NoticeFilter("Given directory is read only")
# logged nine times per save without a primary host and without OCDBT (each process its own part)
_PARTS_NOTICE = _NoticeFilter("Global object size logging disabled", "[process=%s][thread=%s] Skipping merge of OCDBT")


def _manager(workdir, keep: int = 3, read_only: bool = False, asynchronous: bool = False,
             parts: bool = False) -> ocp.CheckpointManager:
    directory = Path(workdir).resolve() / CHECKPOINTS
    if parts:   # each process its own directory: no primary host, no OCDBT (see the module's words)
        logging.getLogger("absl").addFilter(_PARTS_NOTICE)
        each = ocp.options.MultiprocessingOptions(primary_host=None)
        handlers = {item: ocp.StandardCheckpointHandler(use_ocdbt=False, multiprocessing_options=each)
                    for item in ITEMS if item != "meta"}
        handlers["meta"] = ocp.JsonCheckpointHandler(multiprocessing_options=each)
        # the step's directories made before the save returns: made in the background, a
        # process's item could be written before its directory existed (seen under load)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, multiprocessing_options=each, enable_async_checkpointing=asynchronous,
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))
        return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    if read_only:
        logging.getLogger("absl").addFilter(_READ_ONLY_NOTICE)   # once: a filter is added once
        # The values Orbax would force for a read-only manager, given up front: it logs a
        # warning for every option it has to change.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=False, save_interval_steps=0,
                                               enable_async_checkpointing=False, read_only=True)
    else:
        # Retention is RunCheckpointer._prune's: Orbax would delete the newest good step.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                               enable_async_checkpointing=asynchronous)
    return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


class RunCheckpointer:
    """Saves and restores a trainer's state in a run directory.

    With `asynchronous=True`, `save` returns once the arrays are copied off the devices
    and Orbax writes them in the background while training goes on; the checksums and the
    manifest that names the step are written only when `poll` (or `wait`) sees the write
    committed. Retention is done here, not by Orbax: the newest `keep` steps stay, and so
    does the newest good step (finite when saved, or restored and checked) whatever newer
    steps there are. I/O failures raise `rundir.RunDirIOError` naming the path and the last
    good step.
    """

    def __init__(self, workdir, keep: int = 3, read_only: bool = False, asynchronous: bool = False,
                 log: Optional[Callable[[str], None]] = None, mirror=None):
        self.workdir = Path(workdir)
        self.keep = keep
        # A run on object storage (`store.Mirror`): each committed step is pushed to the store.
        self.mirror = mirror
        # several processes, each with its own stage: each saves its own part of a step
        self.parts = mirror is not None and mirror.parts
        self._gathers = 0   # saves whose files the processes exchanged (each its own key)
        self.read_only = read_only
        self.log = log or _stderr
        try:
            self.manager = _manager(workdir, keep, read_only, asynchronous, self.parts)
        except Exception as e:   # noqa: BLE001 - Orbax and the OS raise many kinds
            raise rundir.io_error("cannot open the checkpoints of", self.workdir, e, None) from None
        self._pending = None      # (meta, finite flags) of the save being written
        self._save_started = 0.0
        self._good: dict[int, bool] = {}   # step -> finite, for the steps saved or restored here
        self._closed = False
        # The newest step known committed and good: named by error messages.
        self.last_good: Optional[int] = None
        # Seconds from a save's start to its commit (an upper bound when seen by poll) of the
        # last saves; the trainer's deadline margin uses the slowest.
        self.commits = CommitTimes()

    @property
    def _pending_manifest(self):
        return None if self._pending is None else self._pending[0]

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def reload(self) -> None:
        """See the steps on disk again (after steps were moved aside)."""
        self.manager.reload()

    def step_dir(self, step: int) -> Path:
        return self.workdir / CHECKPOINTS / str(step)

    def save(self, state, meta: dict, block: bool = True) -> None:
        step = int(meta["step"])
        self.wait(saving=step)   # one write at a time: the previous manifest first
        if step in self.manager.all_steps():
            # Committed already (the state a run resumed from, or saved before a growth): the
            # same step of a deterministic run is the same state.
            return
        meta = rundir.finite_json(meta)
        extra = {k: state[k] for k in ("carry", "step", "skipped")}
        bad = non_finite({k: state[k] for k in CHECKED_FINITE})
        for item, leaves in bad.items():
            self.log(f"warning: step {step}: {item} holds NaN or Inf ({_leaf_list(leaves)}); saved, but not "
                     "kept in place of the last good checkpoint, and a resume skips it")
        # Started before manager.save: its copy off the devices is part of what a save costs.
        self._save_started = time.time()
        try:
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(state["params"]),
                opt_state=ocp.args.StandardSave(state["opt_state"]),
                extra=ocp.args.StandardSave(extra),
                meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:   # noqa: BLE001 - OSError, tensorstore's ValueError, ...
            raise rundir.io_error(f"cannot save step {step} to", self.workdir / CHECKPOINTS, e,
                                  self.last_good) from None
        self._pending = (meta, {k: k not in bad for k in CHECKED_FINITE})
        if block:
            self.wait()

    def expect(self, state) -> None:
        """Saves will be of `state` (at a start, after a growth): until one of it is timed, the
        deadline margin reserves its `first_save_seconds`; times of another state's saves go.
        A disk without room for the steps they will hold is warned of now, not at a save."""
        self.commits = CommitTimes(first_save_seconds(state))
        written, whole = save_bytes(state)
        if self.mirror is not None:
            self.mirror.expect(whole)
        if self.parts or jax.process_index() == 0:   # a shared disk: process 0's word
            self._check_room(written if self.parts else whole)

    def _check_room(self, step_bytes: int) -> None:
        """Warn when the disk has less room than the saves to come may fill: the step being
        written and the steps retention keeps beside it (`keep`; a stage, the step saved
        last), less the steps the directory holds already, each of about `step_bytes` (the
        state's arrays: Orbax's files add a little to them, its compression may take more off;
        atom_1b's 11.9 GB state was 7.8 GB on disk at step 2)."""
        holds = (1 if self.mirror is not None else self.keep) + 1
        more = max(1, holds - len(self.manager.all_steps()))
        try:
            free = shutil.disk_usage(self.workdir).free
        except OSError:
            return   # the first save says what is wrong with the directory
        if free >= more * step_bytes:
            return
        kept = "the stage keeps the step saved last" if self.mirror is not None else f"keep_checkpoints={self.keep}"
        self.log(f"warning: {self.workdir}'s disk has {free / 1e9:.1f} GB free, and this run's saves may fill "
                 f"{more * step_bytes / 1e9:.1f} GB more there ({more} more step{'s' * (more > 1)} of about "
                 f"{step_bytes / 1e9:.1f} GB: {kept}, and a save writes the next beside it); a save that finds "
                 "the disk full stops the run, its last good step kept")

    def save_seconds(self) -> float:
        """A blocking save's expected seconds from now: the slowest of the last commit times,
        twice that while a background save is still being written or finished (a save waits
        for it first); for a run on object storage, with the uploads to the store after it:
        its own, the unfinished save's, and the one in flight."""
        seconds = self.commits.seconds() * (1 if self._pending is None else 2)
        if self.mirror is None:
            return seconds
        return seconds + self.mirror.push_seconds(owed=1 + (self._pending is not None))

    def uploading(self) -> Optional[int]:
        """A run on object storage: the step whose upload is in flight (a save finished now
        would wait for it)."""
        return None if self.mirror is None else self.mirror.uploading

    def uploading_again(self) -> Optional[int]:
        """A run on object storage: the step whose upload failed and waits to be tried again."""
        return None if self.mirror is None else self.mirror.trying_again

    def check_upload(self) -> None:
        """A run on object storage: raise now what made an upload fail once its tries ended."""
        if self.mirror is not None:
            self.mirror.check()

    def committed(self) -> bool:
        """A background save is being finished by nobody and has committed (this process's view)."""
        return self._pending is not None and not self.manager.is_saving_in_progress()

    def poll(self) -> None:
        """Finish a background save that has committed (checksums, retention, manifest).
        Retention deletes steps collectively: a multi-process run finishes a save when
        process 0 sees it committed (`policy`), not by each process's own view."""
        if self.committed():
            self.wait()

    def wait(self, saving: Optional[int] = None) -> None:
        """Block until the last save is committed, then record its checksums, drop the steps
        retention lets go, and write its manifest (when it is good). saving: the step whose
        save waits (a run on object storage says when the upload before kept it long)."""
        if self._pending is None:
            return
        (meta, finite), self._pending = self._pending, None
        step = int(meta["step"])
        try:
            self.manager.wait_until_finished()
        except Exception as e:   # noqa: BLE001
            raise rundir.io_error(f"cannot save step {step} to", self.workdir / CHECKPOINTS, e,
                                  self.last_good) from None
        good = all(finite.values())
        self._good[step] = good
        if good:   # committed: a resume takes it, checksums or not
            self.last_good = step
        if self.mirror is not None:
            # the previous step's upload reads the stage's steps and manifest: it ends before
            # retention or this step's manifest changes them
            uploading, started = self.mirror.uploading, time.time()
            self.mirror.settle()
            waited = time.time() - started
            if saving is not None and uploading is not None and waited > UPLOAD_WAIT_WARN_SECONDS:
                self.log(f"warning: the save of step {saving} waited {waited:.0f} s for the upload of step "
                         f"{uploading} to {self.mirror.url}, and training with it: the store takes a step more "
                         "slowly than the run saves; saving less often (a larger save_every) lets training go on")
        lead = jax.process_index() == 0
        parts = None
        try:
            if self.parts:   # every process's files, recorded in each stage
                self._gathers += 1
                union = gather_step_files(self.step_dir(step), f"fractus_jax/step_files/{step}/{self._gathers}")
                write_checksums(self.step_dir(step), finite, {
                    item: {n[len(item) + 1:]: sha for n, (_, sha, _) in union.items() if n.startswith(item + "/")}
                    for item in ITEMS})
                parts = {n: (size, owner) for n, (size, _, owner) in union.items()}
                parts[CHECKSUMS] = ((self.step_dir(step) / CHECKSUMS).stat().st_size, 0)
            elif lead:
                write_checksums(self.step_dir(step), finite)
            try:
                self._prune(step)
            except Exception as e:   # noqa: BLE001 - an old step that stays is no loss
                self.log(f"warning: cannot delete old checkpoints in {self.workdir / CHECKPOINTS} "
                         f"({rundir.reason(e)})")
            if lead and good:
                rundir.write_manifest(self.workdir, meta)
        except OSError as e:
            raise rundir.io_error(f"cannot finish step {step} in", self.workdir, e, self.last_good) from None
        # The whole save: the copy off the devices, the write, the checksums, the manifest.
        self.commits.add(time.time() - self._save_started)
        if self.mirror is not None:
            self.mirror.push(step, parts)   # in the background; the next save waits for it

    def _is_good(self, step: int) -> bool:
        if step not in self._good:
            record = read_checksums(self.step_dir(step)) or {}
            finite = record.get("finite") or {}
            self._good[step] = bool(finite) and all(finite.values())
        return self._good[step]

    def _prune(self, saved: int) -> None:
        """Keep the newest `keep` steps and the newest good one; delete the others. A staged
        run's stage holds only the step just saved and the newest good one: every older step
        of the run is in the store (uploaded, the upload settled, or pulled from it), and
        stays there alone (`store.Mirror.deferred`), fetched if a resume needs it."""
        if not self.keep or self.keep < 1:
            return
        # A staged run's committed steps that the stage does not hold count as the run's too:
        # each is older than the newest good step the stage holds.
        deferred = set(self.mirror.deferred) if self.mirror is not None else set()
        steps = sorted(set(self.manager.all_steps()) | deferred)
        keep = set(steps[-self.keep:])
        good = [s for s in steps if s not in deferred and self._is_good(s)]
        if good:
            keep.add(good[-1])
        staged = {saved, *good[-1:]}
        for s in steps:
            if s in deferred:
                if s not in keep:
                    self.mirror.let_go(s)   # the store's copy goes after this step's commit
            elif s not in keep or (self.mirror is not None and s not in staged):
                self.manager.delete(s)
                self._good.pop(s, None)
                if s in keep:
                    self.mirror.defer(s)

    def _existing_step(self, step: Optional[int]) -> int:
        """step, or the latest one when None; refused when the directory does not hold it."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.workdir} holds no checkpoint")
        if step not in self.manager.all_steps():
            raise CheckpointError(f"{self.workdir} has no checkpoint at step {step} "
                                  f"(steps: {sorted(self.manager.all_steps())})"
                                  + rundir.missing_step_words(self.workdir, step))
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
        if self.parts:   # a step pulled in part: the files this process's shards read
            self.mirror.fill(step, {f"{k}/{name}": leaf for k in items for name, leaf in zip(
                jax.tree.leaves(ocp.tree.get_param_names(wanted[k], include_empty_nodes=False)),
                jax.tree.leaves(wanted[k]))})
        args = {k: ocp.args.StandardRestore(wanted[k]) for k in items}
        args["meta"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        state = {k: restored[k] for k in items if k != "extra"}
        if "extra" in items:
            state.update(restored["extra"])
        return state, restored["meta"]

    def restore_good(self, abstract_state, step: int, rejected=(), usable=None):
        """(step, state, meta, rejected) of the newest step from `step` down that restores and is
        finite; each step that is not joins `rejected` as (step, why). `usable(meta)` returns why
        an older step cannot stand in (another shape), or None. Raises CheckpointError, having
        changed nothing, when no step is left."""
        rejected = list(rejected)
        while step is not None:
            why = None
            try:
                state, meta = self.restore(abstract_state, step)
            except rundir.RunDirIOError:   # the store or the disk failed, not the step: nothing rejected
                raise
            except Exception as e:   # noqa: BLE001 - a damaged file fails in many ways
                why = f"could not be restored ({rundir.reason(e)})"
            else:
                bad = non_finite({k: state[k] for k in CHECKED_FINITE})
                if bad:
                    item = next(iter(bad))
                    why = f"{item} holds NaN or Inf ({_leaf_list(bad[item])})"
                else:
                    self._good[step] = True
                    self.last_good = step
                    self._record_missing_checksums(step)
                    return step, state, dict(meta), rejected
            rejected.append((step, why))
            below = step
            try:
                step, meta, more, _ = newest_good_step(self.workdir, below=below)
                if step is None and self.mirror is not None and self.mirror.fetch_deferred():
                    self.reload()   # the older steps the stage had left in the store, now here
                    step, meta, more, _ = newest_good_step(self.workdir, below=below)
            except CheckpointError as e:   # the cause first (in a multi-process run, a failure of this process alone)
                raise type(e)(f"step {below} {why}, and then: {e}") from None
            rejected += more
            if step is not None and usable is not None and usable(meta):
                raise CheckpointError(no_good_step_message(self.workdir, rejected, f"step {step} {usable(meta)}"))
        raise CheckpointError(no_good_step_message(self.workdir, rejected))

    def _record_missing_checksums(self, step: int) -> None:
        """A step restored and found finite that has no checksums (cut before it wrote them)
        gets them now, so that a later change to its files is caught."""
        step_dir = self.step_dir(step)
        if jax.process_index() != 0 or self.read_only or read_checksums(step_dir) is not None:
            return
        try:
            write_checksums(step_dir, {k: True for k in CHECKED_FINITE})
        except OSError as e:
            self.log(f"warning: cannot record the checksums of step {step} ({rundir.reason(e)})")

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self.manager.close()


def rejection_warnings(rejected, step: int) -> list[str]:
    """`warning: step N: <what failed>; falling back to step M (<detail>)` for each rejected step."""
    out = []
    for s, why in rejected:
        what, sep, detail = why.partition(" (")
        out.append(f"warning: step {s}: {what}; falling back to step {step}" + (f" ({detail}" if sep else ""))
    return out


def no_good_step_message(workdir, rejected, stop: Optional[str] = None) -> str:
    detail = "; ".join(f"step {s}: {why}" for s, why in rejected)
    return (f"{workdir}: no checkpoint can be resumed ({detail}{'; ' + stop if stop else ''}). Nothing was "
            f"changed; move {Path(workdir) / CHECKPOINTS} away to start afresh")


def newest_good_step(workdir, below: Optional[int] = None, items=None, checked=frozenset(), absent=None):
    """(step, meta, rejected, note) of the newest committed step (below `below`) whose files
    (of `items`, or all) match their checksums and whose meta reads, without reading any array.
    rejected: the (step, why) of newer steps that do not; note: set when the step has no
    checksums to check. (None, None, rejected, None) when no step qualifies. Nothing is
    written. checked: steps whose files this process has just checked against their checksums
    (a pull into a stage it locks), not hashed again. absent: {step: its files the stage may
    lack} (a step pulled in part, `check_files`)."""
    workdir = Path(workdir)
    rejected = []
    if not (workdir / CHECKPOINTS).is_dir():
        return None, None, rejected, None
    ck = RunCheckpointer(workdir, read_only=True)
    try:
        for step in sorted(ck.manager.all_steps(), reverse=True):
            if below is not None and step >= below:
                continue
            if step in checked:
                status, why = ("ok" if read_checksums(ck.step_dir(step)) is not None else "unchecked"), None
            else:
                status, why = check_files(ck.step_dir(step), items, (absent or {}).get(step, frozenset()))
            if status == "bad":
                rejected.append((step, why))
                continue
            try:
                _, meta = ck.read_meta(step)
            except Exception as e:   # noqa: BLE001
                rejected.append((step, f"meta could not be read ({rundir.reason(e)})"))
                continue
            if meta.get("step", step) != step:
                rejected.append((step, "meta is incomplete"))
                continue
            note = None
            if status == "unchecked":
                note = (f"note: step {step} has no checksums (saved before they were recorded, or the save was "
                        "cut before it wrote them): its arrays are checked for finite values only")
            return step, meta, rejected, note
    finally:
        ck.close()
    return None, None, rejected, None


def missing_step_words(path) -> str:
    """What to add where DIR/checkpoints/<step> is not there: where the step is, when DIR is
    a stage of a run on object storage; "" otherwise."""
    path = Path(path)
    if path.parent.name == CHECKPOINTS and path.name.isdigit():
        return rundir.missing_step_words(path.parent.parent, int(path.name))
    return ""


def resolve_checkpoint(ckpt) -> tuple[Path, Optional[int]]:
    """A run directory (its newest good step) or DIR/checkpoints/<step> → (run dir, step or None)."""
    path = Path(ckpt)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run directory or checkpoint{missing_step_words(path)}")
    if (path / MANIFEST).is_file() or (path / CHECKPOINTS).is_dir():
        return path, None
    run_dir = path.parent.parent
    if path.parent.name == CHECKPOINTS and path.name.isdigit():
        return run_dir, int(path.name)
    raise CheckpointError(f"{path} is neither a run directory (no {MANIFEST}, no {CHECKPOINTS}/) "
                          f"nor a step directory DIR/{CHECKPOINTS}/<step>")


def abstract_with_shardings(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def read_step(run_dir, step: Optional[int] = None, items=None) -> tuple[int, dict, TrainConfig]:
    """(step, the meta saved with it, its TrainConfig); the newest good step (`newest_good_step`,
    with a warning for each newer one that fails its checks) when step is None. items: the
    items the caller reads, the only ones checked (`check_files`); None: all.

    The config is the one saved with that step, i.e. the shapes its arrays have: a run grown
    in place (`grow_at`) holds steps of two shapes, and its manifest describes only the
    latest. Checkpoints whose meta holds no config take the manifest's (set into meta too).
    """
    if step is None:
        step, meta, rejected, _ = newest_good_step(run_dir, items=items)
        if step is None:
            if rejected:
                raise CheckpointError(no_good_step_message(run_dir, rejected))
            raise CheckpointError(f"{run_dir} holds no checkpoint")
        for line in rejection_warnings(rejected, step):
            _stderr(line)
    else:
        status, why = check_files(Path(run_dir) / CHECKPOINTS / str(step), items)
        if status == "bad":
            raise CheckpointError(f"{run_dir}: step {step}: {why}")
        ck = RunCheckpointer(run_dir, read_only=True)
        try:
            step, meta = ck.read_meta(step)
        except CheckpointError:
            raise
        except Exception as e:   # noqa: BLE001
            raise CheckpointError(f"{run_dir}: step {step}: meta could not be read ({rundir.reason(e)})") from None
        finally:
            ck.close()
    if "config" not in meta:
        manifest = read_manifest(run_dir)
        if manifest is None or "config" not in manifest:
            raise CheckpointError(f"{run_dir}: step {step} records no config and there is no manifest with one")
        meta["config"] = manifest["config"]
    where = Path(run_dir) / CHECKPOINTS / str(step)
    try:   # a config saved by another version: its unknown keys warned about, its missing defaults noted
        cfg = TrainConfig.from_dict(meta["config"], log=lambda msg: _stderr(f"{where}: {msg}"))
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return step, meta, cfg


def one_device_abstract(cfg: TrainConfig):
    """The abstract train state of cfg (ShapeDtypeStructs) on the first device."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        train_state.abstract_train_state(cfg))


def restore_one_device(run_dir, step: int, cfg: TrainConfig, items=("params", "opt_state", "extra"),
                       abstract=None):
    """(state, meta) of one step on the first device, in the shapes of cfg (that step's config:
    `read_step`), or into `abstract` (ShapeDtypeStructs with their shardings) when given."""
    ckpt = RunCheckpointer(run_dir, read_only=True)
    try:
        return ckpt.restore(one_device_abstract(cfg) if abstract is None else abstract, step, items=items)
    except CheckpointError:
        raise
    except Exception as e:   # noqa: BLE001 - a damaged or unreadable file fails in many ways
        raise CheckpointError(f"{Path(run_dir) / CHECKPOINTS / str(step)} could not be restored "
                              f"({rundir.reason(e)})") from None
    finally:
        ckpt.close()


def checkpoint_config(ckpt, step: Optional[int] = None, items=None) -> tuple[Path, int, TrainConfig]:
    """(run directory, step, that step's TrainConfig) of a run directory's latest (or given)
    checkpoint. `ckpt` is a run directory or one of its step directories
    (`resolve_checkpoint`, as for export and grow); a step directory with a different `step`
    is refused. items: as for `read_step`."""
    run_dir, named = resolve_checkpoint(ckpt)
    if named is not None and step is not None and step != named:
        raise CheckpointError(f"{ckpt} is the checkpoint of step {named}, and step {step} was asked for")
    step, _, cfg = read_step(run_dir, named if step is None else step, items=items)
    return run_dir, step, cfg


def load_for_inference(ckpt, step: Optional[int] = None, params_shardings=None):
    """(params, EngineConfig) of a checkpoint (`checkpoint_config`), on the first device, or
    restored straight into `params_shardings` (the shardings of a parameter tree of the same
    engine: each device reads its own shards, and nothing passes through one device)."""
    run_dir, step, cfg = checkpoint_config(ckpt, step, items=WEIGHTS_ITEMS)
    abstract = None
    if params_shardings is not None:
        abstract = train_state.abstract_train_state(cfg)
        abstract["params"] = abstract_with_shardings(abstract["params"], params_shardings)
    state, _ = restore_one_device(run_dir, step, cfg, items=("params",), abstract=abstract)
    return state["params"], cfg.model
