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
  - the log's records the files lack after that point (lost in a crash, logged with
    tensorboard=false, a grown run's copied history) are written
    again, at the head of the new life's file, with their old wall times where known.
Each life writes a file of its own (its name sorts after the earlier ones: TensorBoard reads
a directory's files in name order). It opens with a run-start (START) event at its first step (S+1
on resume: TensorBoard's purge_step): a TensorBoard left running over the earlier life drops
the events past S it had read (it purges at every START of a run but the first, which is
why a fresh run writes one too). Every step of the cut is safe to interrupt: the next start
finds a prefix of the log's records, and the rest follows.

The writer is this module: TensorBoard's record framing (a TFRecord: length, masked CRC-32C
of the length, the record, masked CRC-32C of the record) and the few protobuf fields of an
Event it writes and reads (wall_time, step, file_version, summary's tag/simple_value pairs,
the run-start record's status), encoded by hand, so a run needs no library for its curves
and starts without one's import. Each record is written synchronously and flushed: a kill
loses no queued events, and a write error is the run's error, like one of the log's.
Why not a library's writer, measured here: tensorboard's own (tensorboard 2.21,
`EventFileWriter`) would add tensorboard, grpcio, Markdown and tensorboard-data-server to
every install (`pip install --dry-run tensorboard`), for the viewer's sake, and it queues
events for a thread of its own, so a kill can lose the last ones; tensorboardX imports torch
with any of its modules (`from tensorboardX.record_writer import RecordWriter`: 1.1 s, torch
loaded). The cut on resume stays too: the run-start event's purge step hides a dead life's
steps from a TensorBoard that reads the directory, but any other reader of the files would
see them.
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
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

DIRNAME = "tensorboard"
PREFIX = "events.out.tfevents."
FILE_VERSION = "brain.Event:2"
Log = Callable[[str], None]


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


# ----------------------------------------------------------------------------- the records

def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1   # Castagnoli's polynomial, reflected
        table.append(c)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """A TFRecord's checksum: the CRC-32C of `data`, rotated right by 15 bits, plus 0xa282ead8."""
    crc, table = 0xFFFFFFFF, _CRC32C_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# The protobuf fields written and read (tensorboard's event.proto and summary.proto):
#   Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
#          summary = 5 (Summary), the run status = 7 (a message of one field)
#   Summary: value = 1 (repeated Value);  Value: tag = 1 (string), simple_value = 2 (float)
#   the run status: status = 1 (enum; START = 1)
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
START = 1


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1   # an int64 below zero as protobuf writes it: ten bytes
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _message(field: int, payload: bytes) -> bytes:
    return _key(field, _BYTES) + _varint(len(payload)) + payload


def _fields(data: bytes):
    """(field, wire type, value) of a message: an int for a varint, bytes for the rest;
    ValueError where it is cut short or uses a wire type these records never hold."""
    pos, n = 0, len(data)

    def varint():
        nonlocal pos
        out = shift = 0
        while True:
            if pos >= n or shift > 63:
                raise ValueError("a varint cut short")
            b = data[pos]
            pos += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    while pos < n:
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value = varint()
        elif wire in (_FIXED64, _FIXED32, _BYTES):
            size = 8 if wire == _FIXED64 else 4 if wire == _FIXED32 else varint()
            if pos + size > n:
                raise ValueError("a field cut short")
            value, pos = data[pos:pos + size], pos + size
        else:
            raise ValueError(f"wire type {wire}")
        yield field, wire, value


@dataclass(frozen=True)
class Event:
    """One TensorBoard event, of the kinds a run writes: the file version, a run's START, or
    a summary of scalars (tag -> value as float32)."""
    wall_time: float = 0.0
    step: int = 0
    file_version: Optional[str] = None
    summary: Optional[dict[str, float]] = None
    run_status: Optional[int] = None

    def encode(self) -> bytes:
        """The Event's protobuf bytes (proto3: wall_time and step left out at zero)."""
        out = b""
        if self.wall_time:
            out += _key(1, _FIXED64) + struct.pack("<d", self.wall_time)
        if self.step:
            out += _key(2, _VARINT) + _varint(self.step)
        if self.file_version is not None:
            out += _message(3, self.file_version.encode())
        if self.summary is not None:
            out += _message(5, b"".join(
                _message(1, _message(1, tag.encode()) + _key(2, _FIXED32) + struct.pack("<f", v))
                for tag, v in self.summary.items()))
        if self.run_status is not None:
            out += _message(7, _key(1, _VARINT) + _varint(self.run_status) if self.run_status else b"")
        return out

    @classmethod
    def decode(cls, data: bytes) -> "Event":
        """An Event from its protobuf bytes; fields this writer never sets are skipped, and
        ValueError where the bytes are not a message."""
        kw = {}
        for field, wire, value in _fields(data):
            if field == 1 and wire == _FIXED64:
                kw["wall_time"] = struct.unpack("<d", value)[0]
            elif field == 2 and wire == _VARINT:
                kw["step"] = value - (1 << 64) if value >> 63 else value
            elif field == 3 and wire == _BYTES:
                kw["file_version"] = value.decode("utf-8", "replace")
            elif field == 5 and wire == _BYTES:
                summary = kw.setdefault("summary", {})
                for f, w, v in _fields(value):
                    if f == 1 and w == _BYTES:
                        tag, simple = "", None
                        for vf, vw, vv in _fields(v):
                            if vf == 1 and vw == _BYTES:
                                tag = vv.decode("utf-8", "replace")
                            elif vf == 2 and vw == _FIXED32:
                                simple = struct.unpack("<f", vv)[0]
                        summary[tag] = simple
            elif field == 7 and wire == _BYTES:
                kw["run_status"] = next((v for f, w, v in _fields(value) if f == 1 and w == _VARINT), 0)
        return cls(**kw)


# ----------------------------------------------------------------------------- the files

def event_files(directory) -> list[Path]:
    """The event files of a directory in the order TensorBoard reads them (by name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and PREFIX in p.name)


def read_events(path) -> tuple[list[tuple[int, Event]], int]:
    """([(offset, event), ...], the offset where the readable records end): the records of a
    TFRecord file up to the first one that is cut short or fails its checksums."""
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos + 12 <= len(data):
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        end = pos + 12 + n + 4
        if struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(header) or end > len(data):
            break
        payload = data[pos + 12:pos + 12 + n]
        if struct.unpack("<I", data[end - 4:end])[0] != masked_crc32c(payload):
            break
        try:
            event = Event.decode(payload)
        except ValueError:   # a record that does not parse ends the readable part
            break
        out.append((pos, event))
        pos = end
    return out, pos


class EventFile:
    """One event file, appended record by record, each flushed (no fsync: as metrics.jsonl)."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = open(self.path, "xb")   # never another life's file

    def write(self, event: Event) -> None:
        data = event.encode()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                         + struct.pack("<I", masked_crc32c(data)))
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


def catch_up(directory, records: list[dict]) -> list[tuple[float, int, dict]]:
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
        events, readable = read_events(path)
        for offset, event in events:
            if event.summary is None:   # the file version, a START: kept where they lie
                continue
            if cut is None and i < len(expected) and (event.step, event.summary) == expected[i]:
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

    def __init__(self, directory, resume_step: Optional[int], records: list[dict], log: Log):
        self.directory = Path(directory)
        self.path = self.directory
        if resume_step is None:
            set_aside(self.directory, log)
            backlog = []
        else:
            backlog = catch_up(self.directory, records)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / new_file_name(self.directory)
        self._file = EventFile(self.path)
        now = time.time()
        first = 0 if resume_step is None else resume_step + 1
        self._file.write(Event(wall_time=now, step=first, file_version=FILE_VERSION))
        # TensorBoard purges at each START of a run but its first: every life writes one
        self._file.write(Event(wall_time=now, step=first, run_status=START))
        for wall, step, values in backlog:
            self._write(wall, step, values)

    def _write(self, wall: float, step: int, values: dict) -> None:
        self._file.write(Event(wall_time=wall, step=step, summary=values))

    def write(self, record: dict) -> None:
        step, values = _step(record), scalars(record)
        if step is not None and values:
            self._write(time.time(), step, values)

    def close(self) -> None:
        self._file.close()
