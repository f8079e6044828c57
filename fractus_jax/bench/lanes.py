"""The lane reader's speed: ids/s of the trainer's batches read from a set of shards
against the same ids in one file (docs/performance.md, The lane reader).

    python -m fractus_jax.bench lanes [--shards 110] [--ids-per-shard 1000000]
        [--batch 16] [--seq 128] [--steps 200] [--features] [--dir DIR] [--json]

Writes the shards and the one file (this package's sources as Atom ids, 2 bytes an id) into
--dir (default a temporary folder, removed after), then times `LaneReader.read` over
consecutive steps of each, the training stream cut as the trainer cuts it (the last
`--val-fraction` held out). `--features` adds the Atom packet features (`chunk_features`),
which the atom_1b step also reads. One process reads all of its rows: on 8 GPUs each
process serves its devices' rows, so the figure to compare with is a whole run's ids/s
divided by its processes.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from fractus_jax.atom.corpus import open_corpus
from fractus_jax.atom.features import FEATURE_CONTEXT
from fractus_jax.atom.stream import encode
from fractus_jax.lanes import LaneReader
from fractus_jax.train.data import chunk_features
from fractus_jax.train.prepare import split_corpus
from fractus_jax.urls import local_path


def sample_text_ids() -> np.ndarray:
    """Real text and code as Atom ids: this package's own sources (about 0.7 M ids), so
    the packet features see a real density of packets."""
    root = Path(__file__).resolve().parents[1]
    return encode("".join(p.read_text("utf-8") for p in sorted(root.rglob("*.py")))).astype("<u2")


def write_corpora(root: Path, shards: int, ids_per_shard: int, seed: int = 0) -> tuple[Path, Path]:
    """(a directory of `shards` .u16 shards, one .u16 file of the same ids): the sample text
    from a random place for each shard, repeated to length."""
    rng = np.random.default_rng(seed)
    text = sample_text_ids()
    shard_dir = root / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    one = root / "one.u16"
    with open(one, "wb") as f:
        for k in range(shards):
            start = int(rng.integers(0, text.size))
            ids = np.resize(np.roll(text, -start), ids_per_shard)
            ids.tofile(shard_dir / f"part-{k:06d}.u16")
            f.write(ids.tobytes())
    return shard_dir, one


def time_reader(path: Path, batch: int, seq: int, steps: int, features: bool,
                val_fraction: float) -> dict:
    corpus = open_corpus(path)
    train, _ = split_corpus(corpus, val_fraction)
    reader = LaneReader(train.ids, batch, seq)
    left = FEATURE_CONTEXT if features else 0
    pos, n = 0, 0
    reader.read(pos, left=left)   # the first read maps the pages of every lane's start
    t0 = time.perf_counter()
    for _ in range(steps):
        chunks, pos, context = reader.read(pos, left=left)
        if features:
            chunk_features(chunks, context)
        n += chunks.shape[0] * chunks.shape[1] * (chunks.shape[2] - 1)
    seconds = time.perf_counter() - t0
    return {"path": str(path), "ids_per_s": n / seconds, "seconds": seconds, "ids": n}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.bench lanes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=110)
    p.add_argument("--ids-per-shard", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=16, help="lanes (atom_1b: 16)")
    p.add_argument("--seq", type=int, default=128, help="ids a chunk (atom_1b: 128)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--val-fraction", type=float, default=0.001)
    p.add_argument("--features", action="store_true", help="also compute the Atom packet features")
    p.add_argument("--dir", default=None, type=local_path, help="write the corpora here (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.shards, args.ids_per_shard, args.batch, args.seq, args.steps) < 1:
        print("error: --shards, --ids-per-shard, --batch, --seq and --steps must be positive")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp)
        shard_dir, one = write_corpora(root, args.shards, args.ids_per_shard)
        rows = {name: time_reader(path, args.batch, args.seq, args.steps, args.features, args.val_fraction)
                for name, path in (("one file", one), (f"{args.shards} shards", shard_dir))}
    out = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "features": args.features,
           "shards": args.shards, "ids_per_shard": args.ids_per_shard,
           "rows": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"lane reader: {args.batch} lanes x {args.seq} ids, {args.steps} steps"
          f"{', with packet features' if args.features else ''}; {args.shards * args.ids_per_shard} ids")
    for name, r in rows.items():
        print(f"  {name:>12}: {r['ids_per_s'] / 1e6:8.2f} M ids/s")
    one_s, sh_s = (r["ids_per_s"] for r in rows.values())
    print(f"  shards / one file: {sh_s / one_s:.2f}")
    return 0
