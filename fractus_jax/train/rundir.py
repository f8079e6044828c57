"""A run directory's own files: the lock, the manifest, the metrics log, the leftovers of a crash.

    DIR/.lock                  one writer at a time: fcntl.flock, held while a process writes DIR
    DIR/manifest.json          derived from the newest good checkpoint's meta; repaired on resume
    DIR/metrics.jsonl          one JSON object per line; torn lines are dropped on resume
    DIR/metrics.old-<t>.jsonl  the log of an earlier run that left no checkpoint, set aside
    DIR/tensorboard/           the log's records as TensorBoard event files (`tboard.py`)
    DIR/rejected/<step>        checkpoints that failed verification, moved aside (never deleted)

The checkpoints' arrays and their checksums are `checkpoint.py`'s. Everything here is plain
files and no JAX, so that the lock is cheap to take and to test.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from fractus_jax.train import tboard

LOCK = ".lock"
MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
REJECTED = "rejected"
ORBAX_TMP = ".orbax-checkpoint-tmp"   # Orbax's name for a step (or item) not yet committed
STAGED = "staged.json"                # a stage's record of the run on object storage it stages
RUN_MARKS = (LOCK, MANIFEST, STAGED)     # a directory holding one of these is a run directory
FORMAT_VERSION = 1

Log = Callable[[str], None]


class CheckpointError(ValueError):
    """A run directory that cannot be used as asked."""


class RunDirBusy(CheckpointError):
    """Another process holds the run directory's lock."""


class RunDirIOError(CheckpointError):
    """A read or write of the run directory failed (disk full, permission, a damaged file)."""


def cache_dir() -> Path:
    """What this machine keeps between runs (FRACTUS_CACHE, or ~/.cache/fractus_jax): the
    embedded corpus, the stages and the read cache of runs on object storage."""
    return Path(os.environ.get("FRACTUS_CACHE", Path.home() / ".cache" / "fractus_jax"))


def reason(e: BaseException) -> str:
    """One line about an exception: the OS's words for an OSError, else its type and first line."""
    if isinstance(e, OSError) and e.strerror:
        name = errno.errorcode.get(e.errno, "")
        return f"{e.strerror}" + (f" ({name})" if name else "")
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    first = first if len(first) <= 300 else first[:297] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def last_good_words(step: Optional[int]) -> str:
    if step is None:
        return "there is no checkpoint yet"
    return f"the last good checkpoint is step {step} (the same command resumes from it)"


def io_error(what: str, path, e: BaseException, last_good: Optional[int]) -> RunDirIOError:
    """`{what} {path}: {why}; the last good checkpoint is step N` as the error to raise."""
    return RunDirIOError(f"{what} {path}: {reason(e)}; {last_good_words(last_good)}")


def finite_json(obj: Any) -> Any:
    """obj with every non-finite float replaced by None: JSON has no NaN or Infinity."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_text_atomic(path: Path, text: str) -> None:
    """Write by rename: a reader (or a crash) sees the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(finite_json(obj), indent=2, sort_keys=True, allow_nan=False))


# ----------------------------------------------------------------------------- the lock

class RunLock:
    """An exclusive `fcntl.flock` on DIR/.lock. The kernel drops it when the process ends,
    however it ends (kill -9 included), so a stale lock cannot outlive its holder. The file
    holds the holder's pid for the refusal message; it stays when the lock is released."""

    def __init__(self, workdir):
        self.workdir = Path(workdir)
        self.path = self.workdir / LOCK
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise io_error("cannot create the lock", self.path, e, None) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"pid {holder}" if holder else "another process"
                raise RunDirBusy(f"{self.workdir} is in use by {who} (one process writes a run directory "
                                 "at a time; wait for it to end or stop it)") from None
            raise io_error("cannot lock", self.path, e, None) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass   # the pid is for messages only
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_pid(fd: int) -> Optional[int]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


# ----------------------------------------------------------------------------- leftovers

def remove_leftovers(workdir, log: Log) -> list[Path]:
    """Remove what an interrupted write leaves: Orbax's uncommitted step directories
    (`<step>.orbax-checkpoint-tmp-<t>`, invisible to Orbax but never cleaned by it unless the
    same step is saved again) and our own `*.tmp` files. Only the lock holder may call this:
    another writer's save in progress looks the same."""
    workdir = Path(workdir)
    removed = []
    ck = workdir / CHECKPOINTS
    if ck.is_dir():
        for p in sorted(ck.iterdir()):
            inner = list(p.iterdir()) if p.is_dir() and p.name.isdigit() else []
            for q in [p, *inner]:
                if ORBAX_TMP in q.name or q.name.endswith(".json.tmp"):
                    shutil.rmtree(q) if q.is_dir() else q.unlink()
                    removed.append(q)
    for name in (MANIFEST, METRICS):
        tmp = workdir / (name + ".tmp")
        if tmp.exists():
            tmp.unlink()
            removed.append(tmp)
    for p in removed:
        log(f"note: removed {p}, left by a write that did not finish")
    return removed


def move_aside(src: Path, dst_dir: Path) -> Path:
    """Move src into dst_dir under its own name, or NAME-2, NAME-3, ... where that is taken."""
    dst = dst_dir / src.name
    n = 1
    while dst.exists():
        n += 1
        dst = dst_dir / f"{src.name}-{n}"
    dst_dir.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)
    return dst


def set_aside_steps(workdir, steps: Iterable[int], log: Log) -> list[Path]:
    """Move rejected step directories to DIR/rejected/ (kept for inspection, out of Orbax's sight,
    so that the run can save those step numbers again)."""
    workdir = Path(workdir)
    moved = []
    for step in steps:
        src = workdir / CHECKPOINTS / str(step)
        if not src.exists():
            continue
        try:
            moved.append(move_aside(src, workdir / REJECTED))
        except OSError as e:
            raise io_error("cannot move a rejected checkpoint aside:", src, e, None) from None
    if moved:
        log(f"note: moved the rejected checkpoint{'s' if len(moved) > 1 else ''} to "
            f"{', '.join(str(p) for p in moved)} (delete {'them' if len(moved) > 1 else 'it'} when done)")
    return moved


def runs_around(parts: Sequence[str]) -> Iterator[int]:
    """Where a path (its parts) would lie in a run's checkpoints: each i, innermost first,
    whose parts[:i] would be a run holding parts[i] == CHECKPOINTS (a run started in
    RUN/checkpoints, or in one of its steps, would write among that run's steps)."""
    return (i for i in range(len(parts) - 1, 0, -1) if parts[i] == CHECKPOINTS)


def nested_run_error(where: str, run: str, checkpoints: str, url: bool = False) -> CheckpointError:
    """The refusal of a run directory (a URL's run) `where` inside `run`'s checkpoints."""
    this, other = ("a run", "a URL") if url else ("a run directory", "a path")
    return CheckpointError(f"{where} lies in the checkpoints directory of the run {run}: {this} there would write "
                           f"among that run's steps; give {other} outside {checkpoints}")


def check_not_in_run(workdir) -> None:
    """CheckpointError where workdir is, or lies inside, another run's checkpoints directory
    (its parent holding one of RUN_MARKS)."""
    path = Path(workdir).resolve()
    for i in runs_around(path.parts):
        run = Path(*path.parts[:i])
        if any((run / n).exists() for n in RUN_MARKS):
            raise nested_run_error(str(workdir), str(run), str(run / CHECKPOINTS))


# ----------------------------------------------------------------------------- manifest

def staged_url(run_dir) -> Optional[str]:
    """The URL of the run on object storage a directory stages (its STAGED record), or None."""
    try:
        return json.loads((Path(run_dir) / STAGED).read_text())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def missing_step_words(run_dir, step: int) -> str:
    """What to add where a directory lacks a step: a stage holds only its newest steps, the
    run's others being in the store."""
    url = staged_url(run_dir)
    if url is None:
        return ""
    return f"; {run_dir} is the stage of {url}, which holds the run's older steps: --ckpt {url} --step {step}"


def read_manifest(workdir) -> Optional[dict]:
    path = Path(workdir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:
        raise io_error("cannot read", path, e, None) from None


def manifest_of(meta: dict) -> dict:
    """The manifest that names a checkpoint: its meta, where it is, when."""
    return dict(meta, checkpoint=f"{CHECKPOINTS}/{meta['step']}", format=FORMAT_VERSION,
                time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def write_manifest(workdir, meta: dict) -> None:
    write_json_atomic(Path(workdir) / MANIFEST, manifest_of(meta))


def repair_manifest(workdir, meta: dict, log: Log) -> bool:
    """Rewrite the manifest from the meta of the step the run resumes from when it does not
    name that step (it lags after a crash between a commit and its manifest, or is missing,
    damaged, or names a step that was rejected). True when it was rewritten."""
    path = Path(workdir) / MANIFEST
    try:
        current = read_manifest(workdir)
        was = "missing" if current is None else f"named step {current.get('step')}"
    except CheckpointError:
        current, was = None, "damaged"
    if current is not None and current.get("step") == meta["step"]:
        return False
    write_manifest(workdir, meta)
    log(f"note: repaired {path}: it was {was}, the newest good checkpoint is step {meta['step']}")
    return True


# ----------------------------------------------------------------------------- metrics

def read_metrics(path, log: Optional[Log] = None) -> list[tuple[str, dict]]:
    """(line, record) of every line that parses as a JSON object; a line that does not (a torn
    write) is dropped, with a warning when log is given."""
    path = Path(path)
    if not path.exists():
        return []
    good, bad = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            good.append((line, record))
        else:
            bad.append(n)
    if bad and log is not None:
        lines = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        log(f"warning: {path}: dropped {len(bad)} line{'s' if len(bad) > 1 else ''} that "
            f"{'do' if len(bad) > 1 else 'does'} not parse (line {lines}; a write cut short)")
    return good


def _step_of(record: dict) -> float:
    s = record.get("step", 0)
    return s if isinstance(s, (int, float)) else math.inf


def _metrics_until(path, last_step: int, log: Log) -> str:
    """The readable lines of a metrics log up to last_step (torn lines and later steps dropped)."""
    return "".join(line + "\n" for line, record in read_metrics(path, log) if _step_of(record) <= last_step)


def truncate_metrics(path, last_step: int, log: Log) -> list[dict]:
    """On resume: keep the lines up to the restored step (lines past it were logged after the
    last save), drop torn lines; rewritten atomically, only when something changes. The
    records kept."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    kept = [(line, record) for line, record in read_metrics(path, log) if _step_of(record) <= last_step]
    text = "".join(line + "\n" for line, _ in kept)
    if text.encode() != raw:
        write_text_atomic(path, text)
    return [record for _, record in kept]


def copy_metrics(src, dst, last_step: int, log: Log) -> None:
    """The history of src up to last_step into dst (a grown run keeps its plots)."""
    if Path(src).exists():
        write_text_atomic(Path(dst), _metrics_until(src, last_step, log))


def set_aside_metrics(path, log: Log) -> Optional[Path]:
    """A fresh run never appends to an older run's log: a metrics.jsonl found beside no
    checkpoint is renamed to metrics.old-<time>.jsonl."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    dst = path.with_name(f"metrics.old-{stamp}.jsonl")
    n = 1
    while dst.exists():
        n += 1
        dst = path.with_name(f"metrics.old-{stamp}-{n}.jsonl")
    os.replace(path, dst)
    log(f"note: {path} held the log of an earlier run that left no checkpoint; moved it to {dst.name}")
    return dst


class MetricsLog:
    """The append-only metrics.jsonl of a run: started fresh (an older log set aside) or
    truncated to the resumed step; each record is one line, non-finite values as null."""

    def __init__(self, path, resume_step: Optional[int], log: Log,
                 last_good: Callable[[], Optional[int]] = lambda: None):
        self.path = Path(path)
        self._last_good = last_good
        self.kept: list[dict] = []   # the records of a resumed log, up to the resumed step
        try:
            if resume_step is None:
                set_aside_metrics(self.path, log)
            else:
                self.kept = truncate_metrics(self.path, resume_step, log)
            self._file = open(self.path, "a")
        except OSError as e:
            raise io_error("cannot write", self.path, e, resume_step) from None

    def write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(finite_json(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise io_error("cannot write", self.path, e, self._last_good()) from None

    def close(self) -> None:
        if self._file is None:
            return
        f, self._file = self._file, None
        try:
            f.close()
        except OSError as e:
            raise io_error("cannot write", self.path, e, self._last_good()) from None


class TensorBoardEvents:
    """The run's TensorBoard event files (`tboard.TensorBoardLog`), caught up with the log;
    a write that fails is the run's error, like one of the log's."""

    def __init__(self, directory, resume_step: Optional[int], records: list[dict], log: Log,
                 last_good: Callable[[], Optional[int]] = lambda: None):
        self.directory = Path(directory)
        self._last_good = last_good
        try:
            self._log = tboard.TensorBoardLog(self.directory, resume_step, records, log)
        except OSError as e:
            raise io_error("cannot write", getattr(e, "filename", None) or self.directory, e, resume_step) from None
        self.path = self._log.path

    def write(self, record: dict) -> None:
        try:
            self._log.write(record)
        except OSError as e:
            raise io_error("cannot write", self.path, e, self._last_good()) from None

    def close(self) -> None:
        try:
            self._log.close()
        except OSError as e:
            raise io_error("cannot write", self.path, e, self._last_good()) from None


# ----------------------------------------------------------------------------- the directory

class RunDir:
    """A run directory opened for writing: created, locked, cleaned of a crash's leftovers.

    `lead` is the process that writes the files (process 0 of a multi-host run: the others
    take no lock and touch nothing here, unless each has a stage of its own: a multi-process
    run on object storage, whose every process keeps its stage as process 0 does, while the
    logs stay process 0's). Each record goes to the metrics log and, with
    `tensorboard`, to the event files. `close` closes what the run registered (its metrics
    log, event files and checkpointer, whose close commits a save in flight, then the mirror
    of a run on object storage, which uploads it) and releases the lock.
    """

    def __init__(self, workdir, lead: bool = True, log: Log = print, tensorboard: bool = False, mirror=None):
        self.workdir = Path(workdir)
        self.mirror = mirror       # a run on object storage: `store.Mirror`, closed last
        self.lead = lead
        self.own = lead or (mirror is not None and mirror.parts)   # this process keeps the directory
        self.log = log
        self.tensorboard_on = tensorboard
        # a staged run's lock is its mirror's, taken before the pull filled the stage
        self.lock = mirror.lock if mirror is not None else RunLock(self.workdir)
        self.metrics: Optional[MetricsLog] = None
        self.tensorboard: Optional[TensorBoardEvents] = None
        self.checkpointer = None   # anything with close() and last_good

    def open(self) -> "RunDir":
        if self.workdir.exists() and not self.workdir.is_dir():
            raise CheckpointError(f"{self.workdir} exists and is not a directory")
        check_not_in_run(self.workdir)
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise io_error("cannot create", self.workdir, e, None) from None
        if self.own:
            self.lock.acquire()
            try:
                remove_leftovers(self.workdir, self.log)
            except OSError as e:
                self.lock.release()
                raise io_error("cannot clean up", self.workdir, e, None) from None
        return self

    def last_good(self) -> Optional[int]:
        """The newest good checkpoint, a save in flight let finish first (for error messages:
        what the next run resumes from)."""
        if self.checkpointer is None:
            return None
        try:
            self.checkpointer.wait()
        except Exception:   # noqa: BLE001 - reported by whoever finds it
            pass
        return getattr(self.checkpointer, "last_good", None)

    def start_metrics(self, resume_step: Optional[int]) -> Optional[MetricsLog]:
        if self.lead:
            self.metrics = MetricsLog(self.workdir / METRICS, resume_step, self.log, self.last_good)
            if self.tensorboard_on:
                self.tensorboard = TensorBoardEvents(self.workdir / tboard.DIRNAME, resume_step,
                                                     self.metrics.kept, self.log, self.last_good)
            self.metrics.kept = []
        return self.metrics

    def write_metrics(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def resumed(self, meta: dict, rejected: Iterable[tuple[int, str]] = ()) -> None:
        """After the restore of meta's step: rejected newer steps moved aside, the manifest
        repaired, the log cut to the step."""
        if not self.own:
            return
        step = int(meta["step"])
        try:
            set_aside_steps(self.workdir, sorted({s for s, _ in rejected if s > step}, reverse=True), self.log)
            repair_manifest(self.workdir, meta, self.log)
        except OSError as e:
            raise io_error("cannot write", self.workdir / MANIFEST, e, step) from None
        if self.mirror is not None:
            self.mirror.resumed()   # the store's copies of the rejected steps moved aside too
        self.start_metrics(step)

    def close(self, quiet: bool = False) -> None:
        """Close everything; with quiet (an error is already on its way) a second failure is
        logged instead of raised."""
        first = None
        for thing in (self.metrics, self.tensorboard, self.checkpointer):
            if thing is None:
                continue
            try:
                thing.close()
            except Exception as e:   # noqa: BLE001 - the first one is raised below
                if quiet:
                    self.log(f"warning: while stopping: {e}")
                elif first is None:
                    first = e
        self.metrics = self.tensorboard = self.checkpointer = None
        if self.mirror is not None:
            try:
                self.mirror.close(quiet=quiet)
            except Exception as e:   # noqa: BLE001 - raised below, unless another came first
                first = first or e
        self.lock.release()
        if first is not None:
            raise first


