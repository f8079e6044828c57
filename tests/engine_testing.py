"""Shared helpers for the engine tests."""
import jax


def move_off_init(params, key, scale=0.3):
    """Random LayerNorm weights/biases and nonzero level logits / expert biases.

    Fresh-init LayerNorm biases are exactly zero, which makes the parent's mean-phase
    encoding pure rounding noise (docs/spec.md §3.2 trap) and hides bugs in the bias paths; the
    kuramoto bias is shifted well away from zero mean.
    """
    blocks = dict(params["blocks"])
    keys = iter(jax.random.split(key, 16))
    for norm in ("norm_attn", "norm_kur", "norm_moe"):
        w, b = blocks[norm]["weight"], blocks[norm]["bias"]
        blocks[norm] = {"weight": w + scale * jax.random.normal(next(keys), w.shape, w.dtype),
                        "bias": scale * jax.random.normal(next(keys), b.shape, b.dtype)
                        + (0.5 if norm == "norm_kur" else 0.0)}
    attn = dict(blocks["attn"])
    attn["level_logits"] = jax.random.normal(next(keys), attn["level_logits"].shape, attn["level_logits"].dtype)
    attn["b_qkv"] = 0.1 * jax.random.normal(next(keys), attn["b_qkv"].shape, attn["b_qkv"].dtype)
    blocks["attn"] = attn
    moe = dict(blocks["moe"])
    moe["b1"] = 0.1 * jax.random.normal(next(keys), moe["b1"].shape, moe["b1"].dtype)
    moe["b2"] = 0.1 * jax.random.normal(next(keys), moe["b2"].shape, moe["b2"].dtype)
    blocks["moe"] = moe
    out = dict(params)
    out["blocks"] = blocks
    if "atom_feat" in params:
        w = params["atom_feat"]["weight"]
        out["atom_feat"] = {"weight": 0.05 * jax.random.normal(next(keys), w.shape, w.dtype),
                            "bias": params["atom_feat"]["bias"]}
    return out


# ----------------------------------------------------------------------------- TensorBoard event files

def read_event_files(directory):
    """[(file name, [Event, ...]), ...] of a directory's event files in name order (TensorBoard's
    reading order), read with a TFRecord reader of its own: 8-byte length, 4-byte length
    checksum, the record, 4-byte checksum (the checksums are not checked here)."""
    import struct
    from pathlib import Path

    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(p for p in Path(directory).iterdir() if "tfevents" in p.name):
        data, pos, events = path.read_bytes(), 0, []
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
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
    import json
    import math
    from pathlib import Path

    import numpy as np

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
