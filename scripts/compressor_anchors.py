"""General-purpose compressors on a run's held-out bytes: the anchors of the carry study
(docs/notes/2026-12-03-carry-decay.md).

    python scripts/compressor_anchors.py [--config smoke] [--set KEY=VALUE ...] [--json]

The held-out bytes are the payload bytes (ids 0-255; the ids above, boundaries and BOS,
carry no byte) of the config's held-out part: the last val_fraction of its corpus. Two
slices are compressed, each on its own, so a compressor sees the held-out text alone and
nothing of the training text:
  - "scored": the first val_ids held-out ids, the slice the trainer's val_bpb scores;
  - "held out": the whole held-out part.
Bits per byte = 8 · compressed size / payload bytes, for zlib level 9, bz2 level 9 and xz
(lzma preset 9 | extreme), Python's standard-library modules, nothing else.
"""
from __future__ import annotations

import argparse
import bz2
import json
import lzma
import sys
import zlib

import numpy as np

from fractus_jax.atom import stream
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.errors import TrainError
from fractus_jax.train.heldout import val_slice

COMPRESSORS = {
    "zlib -9": lambda b: zlib.compress(b, 9),
    "bz2 -9": lambda b: bz2.compress(b, 9),
    "xz -9e": lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME),
}


def anchors(data: bytes) -> dict:
    """{compressor: bits per byte} of `data`, compressed alone."""
    return {name: 8.0 * len(fn(data)) / len(data) for name, fn in COMPRESSORS.items()}


def held_out_bytes(cfg) -> dict:
    """{"scored": bytes of the first val_ids held-out ids, "held out": bytes of the whole part}."""
    corpus = prepare_lib.open_training_corpus(cfg, progress=False)
    _, val = prepare_lib.split_corpus(corpus, cfg.val_fraction)
    if cfg.val_corpus:
        val = prepare_lib.open_val_corpus(cfg)
    if val is None:
        raise cfg_lib.ConfigError("the config holds nothing out: set val_fraction or val_corpus")
    return {"scored": stream.decode_bytes(np.asarray(val_slice(cfg, val))),
            "held out": stream.decode_bytes(np.asarray(val.ids[:]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/compressor_anchors.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smoke")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    try:
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config(args.config), args.overrides)
        slices = held_out_bytes(cfg)
    except (cfg_lib.ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {name: {"bytes": len(data), "bpb": anchors(data)} for name, data in slices.items()}
    if args.json:
        print(json.dumps(out))
        return 0
    print("| slice | bytes | " + " | ".join(COMPRESSORS) + " |")
    print("|---|---|" + "---|" * len(COMPRESSORS))
    for name, row in out.items():
        print(f"| {name} | {row['bytes']} | " + " | ".join(f"{row['bpb'][c]:.3f}" for c in COMPRESSORS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
