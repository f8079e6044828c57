"""Reading TensorBoard event files back in the tests (tensorboardX's Event protobuf, no JAX)."""
import json
import math
import struct
from pathlib import Path

import numpy as np


def read_event_files(directory):
    """[(file name, [Event, ...]), ...] of a directory's event files in name order (TensorBoard's
    reading order), read with a TFRecord reader of its own: 8-byte length, 4-byte length
    checksum, the record, 4-byte checksum, each checksum checked."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out = []
    for path in sorted(p for p in Path(directory).iterdir() if "tfevents" in p.name):
        data, pos, events = path.read_bytes(), 0, []
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + n]
            assert struct.unpack("<II", data[pos + 8:pos + 12] + data[pos + 12 + n:pos + 16 + n]) == (
                masked_crc32c(data[pos:pos + 8]), masked_crc32c(record)), (path, pos)
            events.append(Event.FromString(record))
            pos += 12 + n + 4
        assert pos == len(data), path
        out.append((path.name, events))
    return out


def curves(directory):
    """tag -> [(step, value), ...] of every scalar in the event files, in reading order."""
    out = {}
    for _, events in read_event_files(directory):
        for e in events:
            for v in e.summary.value:
                out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def assert_curves_are_the_log(workdir):
    """The event files of a run hold each finite number of each metrics.jsonl record, as
    float32, at the record's step, once, and nothing else; the tags (their steps) returned."""
    want = {}
    for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for k, v in record.items():
            items = [(k, v)] if not isinstance(v, list) else [
                (f"{k}/{i}", x) for i, x in enumerate(v) if all(not isinstance(y, list) for y in v)]
            for tag, x in items:
                if k != "step" and isinstance(x, (int, float)) and math.isfinite(x):
                    want.setdefault(tag, []).append((record["step"], float(np.float32(x))))
    got = curves(Path(workdir) / "tensorboard")
    assert got == want
    return {tag: [s for s, _ in points] for tag, points in got.items()}
