"""TensorBoard event files beside the metrics log: DIR/tensorboard/events.out.tfevents.*

What they hold: every record of metrics.jsonl as one event at the record's step, each
numeric field a scalar under the field's own name (losses, lr, grad_norm, keep_rate, ids/s,
the held-out figures, the probes); a flat list of numbers (the probes' lb_per_block,
keep_rate_per_block, alive_experts) one scalar per element, `lb_per_block/0`, ... Text,
nested lists and non-finite values (null in the log) stay in the log alone. Each event is
written and flushed with its line, so a kill loses no more of the curves than of the log.

The log is the truth. On resume from step S (from the newest checkpoint or, after a
fall-back, an older one) the log has just been cut to S; the event files are then made to
hold exactly its records, once each, in order:
  - the longest run of events, from the first file on, that matches the log's records is
    kept; the first event that does not (a step past S written by the earlier life, a torn
    write) and everything after it are cut: its file truncated there, later files removed;
  - the log's records the files lack after that point (lost in a crash, logged while
    tensorboardX was missing or tensorboard=false, a grown run's copied history) are written
    again, at the head of the new life's file, with their old wall times where known.
Each life writes a file of its own (its name sorts after the earlier ones: TensorBoard reads
a directory's files in name order). It opens with a run-start (START) event at its first step (S+1
on resume: TensorBoard's purge_step): a TensorBoard left running over the earlier life drops
the events past S it had read (it purges at every START of a run but the first, which is
why a fresh run writes one too). Every step of the cut is safe to interrupt: the next start
finds a prefix of the log's records, and the rest follows.

The writer: tensorboardX's event protobufs (Event, Summary, the run-start record) and its record framing
(masked CRC-32C), written here synchronously. Its SummaryWriter queues events to a
background thread that flushes every two minutes: a kill loses what is queued, and a write
error ends that thread, after which its queue fills and blocks the training loop for good.
"""
from __future__ import annotations

import datetime
import math
import os
import re
import socket
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np

DIRNAME = "tensorboard"
PREFIX = "events.out.tfevents."
FILE_VERSION = "brain.Event:2"
INSTALL = "pip install -e \".[tensorboard]\""

Log = Callable[[str], None]


def library():
    """tensorboardX's protobufs and record checksum; (None, why) where it does not load."""
    try:
        from tensorboardX.proto import event_pb2, summary_pb2
        from tensorboardX.record_writer import masked_crc32c
    except ImportError as e:
        if (e.name or "tensorboardX").split(".")[0] == "tensorboardX":
            return None, "is not installed"
        return None, f"does not load ({_first_line(e)})"   # protobuf missing, say
    except Exception as e:   # noqa: BLE001 - a broken install (a protobuf it does not fit) ends no run
        return None, f"does not load ({_first_line(e)})"
    return SimpleNamespace(Event=event_pb2.Event, Summary=summary_pb2.Summary,
                           crc=masked_crc32c), None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _f32(x: float) -> float:
    """x as a TensorBoard scalar holds it (float32)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def scalars(record: dict) -> dict[str, float]:
    """The scalars of one metrics record, tag -> value as float32: its finite numbers but the
    step, and the elements of its flat lists of numbers (`name/i`)."""
    out = {}
    for k, v in record.items():
        if k == "step":
            continue
        if _number(v):
            out[k] = _f32(v)
        elif isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/{i}": _f32(x) for i, x in enumerate(v) if _number(x)})
    return out


def _step(record: dict) -> Optional[int]:
    s = record.get("step")
    return int(s) if isinstance(s, (int, float)) and math.isfinite(s) else None


# ----------------------------------------------------------------------------- the files

def event_files(directory) -> list[Path]:
    """The event files of a directory in the order TensorBoard reads them (by name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and PREFIX in p.name)


def read_events(path, pb) -> tuple[list, int]:
    """([(offset, event), ...], the offset where the readable records end): the records of a
    TFRecord file up to the first one that is cut short or fails its checksums."""
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos + 12 <= len(data):
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        end = pos + 12 + n + 4
        if struct.unpack("<I", data[pos + 8:pos + 12])[0] != pb.crc(header) or end > len(data):
            break
        payload = data[pos + 12:pos + 12 + n]
        if struct.unpack("<I", data[end - 4:end])[0] != pb.crc(payload):
            break
        try:
            event = pb.Event.FromString(payload)
        except Exception:   # noqa: BLE001 - a record that does not parse ends the readable part
            break
        out.append((pos, event))
        pos = end
    return out, pos


class EventFile:
    """One event file, appended record by record, each flushed (no fsync: as metrics.jsonl)."""

    def __init__(self, path, pb):
        self.path, self.pb = Path(path), pb
        self._file = open(self.path, "xb")   # never another life's file

    def write(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", self.pb.crc(header)) + data
                         + struct.pack("<I", self.pb.crc(data)))
        self._file.flush()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()


def new_file_name(directory) -> str:
    """events.out.tfevents.<seconds>.<host>, its seconds later than every existing file's:
    the new file sorts last however fast lives follow each other."""
    sec = int(time.time())
    for p in event_files(directory):
        m = re.search(re.escape(PREFIX) + r"(\d+)", p.name)
        if m:
            sec = max(sec, int(m.group(1)) + 1)
    return f"{PREFIX}{sec:010d}.{socket.gethostname()}"


def set_aside(directory, log: Log) -> Optional[Path]:
    """A fresh run never adds to an older run's curves: a tensorboard/ found beside no
    checkpoint is renamed to tensorboard.old-<time>/ (as metrics.jsonl)."""
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    dst = directory.with_name(f"{directory.name}.old-{stamp}")
    n = 1
    while dst.exists():
        n += 1
        dst = directory.with_name(f"{directory.name}.old-{stamp}-{n}")
    os.replace(directory, dst)
    log(f"note: {directory} held the curves of an earlier run that left no checkpoint; moved it to {dst.name}")
    return dst


def catch_up(directory, records: list[dict], pb) -> list[tuple[float, int, dict]]:
    """Cut the event files to the longest run of events that matches `records` (the log as
    resumed) and return what the files lack after it: (wall time, step, scalars) to write."""
    expected = []
    for r in records:
        step, values = _step(r), scalars(r)
        if step is not None and values:
            expected.append((step, values))
    i, cut, walls, last_wall = 0, None, {}, None
    files = event_files(directory)
    for fi, path in enumerate(files):
        events, readable = read_events(path, pb)
        for offset, event in events:
            if not event.HasField("summary"):   # the file version, a START: kept where they lie
                continue
            got = {v.tag: v.simple_value for v in event.summary.value}
            if cut is None and i < len(expected) and (event.step, got) == expected[i]:
                i += 1
                last_wall = event.wall_time
                continue
            if cut is None:
                cut = (fi, offset)
            walls.setdefault(event.step, event.wall_time)
        if cut is None and readable < path.stat().st_size:
            cut = (fi, readable)
    if cut is not None:
        fi, offset = cut
        for path in reversed(files[fi + 1:]):
            path.unlink()
        if offset == 0:
            files[fi].unlink()
        else:
            os.truncate(files[fi], offset)
    out, wall = [], last_wall if last_wall is not None else time.time()
    for step, values in expected[i:]:
        wall = walls.get(step, wall)
        out.append((wall, step, values))
    return out


class TensorBoardLog:
    """The event files of a run: set aside (fresh) or caught up with the log (resumed: see
    the module's docstring), then one new file for this life."""

    def __init__(self, directory, resume_step: Optional[int], records: list[dict], pb, log: Log):
        self.directory, self.pb = Path(directory), pb
        self.path = self.directory
        if resume_step is None:
            set_aside(self.directory, log)
            backlog = []
        else:
            backlog = catch_up(self.directory, records, pb)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / new_file_name(self.directory)
        self._file = EventFile(self.path, pb)
        now = time.time()
        first = 0 if resume_step is None else resume_step + 1
        self._file.write(pb.Event(wall_time=now, step=first, file_version=FILE_VERSION))
        # TensorBoard purges at each START of a run but its first: every life writes one
        self._file.write(pb.Event(wall_time=now, step=first, session_log={"status": "START"}))
        for wall, step, values in backlog:
            self._write(wall, step, values)

    def _write(self, wall: float, step: int, values: dict) -> None:
        summary = self.pb.Summary(value=[self.pb.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._file.write(self.pb.Event(wall_time=wall, step=step, summary=summary))

    def write(self, record: dict) -> None:
        step, values = _step(record), scalars(record)
        if step is not None and values:
            self._write(time.time(), step, values)

    def close(self) -> None:
        self._file.close()


def missing_note(why: str) -> str:
    return (f"note: tensorboardX {why}: no TensorBoard event files this run ({INSTALL} adds them, "
            "and the next start writes the whole history; tensorboard=false silences this)")
