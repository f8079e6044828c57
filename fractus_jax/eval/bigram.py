"""A bigram count baseline for the held-out score (docs/training.md, Carry resets).

    python -m fractus_jax.eval.bigram [--config smoke] [--set KEY=VALUE ...] [--alpha A] [--json]

Counts every adjacent pair (a, b) of the ids the run's lanes read (the corpus before its
held-out end), then scores the trainer's held-out slice (the first val_ids ids of the
held-out part, in val_lanes lanes, chunks of seq_len: the targets `fractus_jax.eval`
scores) with p(b | a) = (n(a, b) + alpha) / (n(a) + alpha·V), add-alpha smoothing over
the V ids of the vocabulary (alpha 1: add-one). Each target's previous id is the id
before it in its lane, as the engine's input there is. Bits per byte use eval's
denominator: total nats / ln 2 / the byte ids (0-255) among the targets.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

import numpy as np

from fractus_jax.eval import bits_per_byte, count_bytes, lane_layout
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import heldout
from fractus_jax.train import plan as plan_lib
from fractus_jax.train.errors import TrainError

BLOCK = 1 << 22   # ids counted per pass: the pair codes of one block are int64


def fit(ids, vocab: int, block: int = BLOCK) -> np.ndarray:
    """(V, V) int64 counts: [a, b] is how often b follows a in `ids` (an array or memory map,
    read in blocks; a pair across two blocks is counted once)."""
    counts = np.zeros(vocab * vocab, np.int64)
    n = len(ids)
    for start in range(0, max(n - 1, 0), block):
        part = np.asarray(ids[start:min(start + block + 1, n)], np.int64)
        if part.size < 2:
            break
        if part.min() < 0 or part.max() >= vocab:
            raise ValueError(f"an id outside [0, {vocab}) at ids[{start}:{start + part.size}]")
        counts += np.bincount(part[:-1] * vocab + part[1:], minlength=vocab * vocab)
    return counts.reshape(vocab, vocab)


def lane_pairs(ids, lanes: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(previous ids, targets), each (lanes, n_chunks·chunk): every target the eval lanes
    score (fractus_jax.eval.lane_targets) and the id just before it in its lane."""
    lane_len, n_chunks = lane_layout(len(ids), lanes, chunk)
    span = n_chunks * chunk
    rows = np.stack([np.asarray(ids[b * lane_len:b * lane_len + span + 1], np.int64) for b in range(lanes)])
    return rows[:, :-1], rows[:, 1:]


def nats(counts: np.ndarray, prev, targets, alpha: float = 1.0) -> float:
    """Summed -ln p(target | prev) under add-alpha smoothing of `counts`."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    vocab = counts.shape[0]
    prev, targets = np.asarray(prev, np.int64).ravel(), np.asarray(targets, np.int64).ravel()
    num = counts[prev, targets] + alpha
    den = counts.sum(1)[prev] + alpha * vocab
    return float(-(np.log(num) - np.log(den)).sum())


def score(counts: np.ndarray, ids, lanes: int, chunk: int, alpha: float = 1.0) -> dict:
    """The bigram's held-out figures on `ids` read in `lanes` lanes of `chunk`-id chunks."""
    prev, targets = lane_pairs(ids, lanes, chunk)
    total = nats(counts, prev, targets, alpha)
    n_bytes = count_bytes(targets)
    return {"ce": total / targets.size, "bpb": bits_per_byte(total, n_bytes), "nats": total,
            "n_ids": int(targets.size), "n_bytes": n_bytes, "alpha": alpha}


def run_baseline(cfg, alpha: float = 1.0, progress: bool = False) -> dict:
    """Fit on the part of cfg's corpus the lanes read, score cfg's held-out slice."""
    corpus = plan_lib.open_training_corpus(cfg, progress=progress)
    train, val = plan_lib.split_corpus(corpus, cfg.val_fraction)
    if cfg.val_corpus:
        val = plan_lib.open_val_corpus(cfg)
    plan_lib.check_val_slice(cfg, val)
    counts = fit(train.ids, cfg.model.vocab_size)
    out = score(counts, np.asarray(heldout.val_slice(cfg, val)), cfg.val_lanes, cfg.seq_len, alpha)
    return {**out, "train_ids": train.n_ids}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.eval.bigram", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smoke", help="the run's config (its corpus, val_* fields, seq_len)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--alpha", type=float, default=1.0, help="add-alpha smoothing (default 1: add-one)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    try:
        if not (args.alpha > 0 and math.isfinite(args.alpha)):
            raise cfg_lib.ConfigError(f"--alpha must be > 0 and finite, got {args.alpha}")
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config(args.config), args.set)
        if not (cfg.val_fraction or cfg.val_corpus):
            raise cfg_lib.ConfigError("the config holds nothing out: set val_fraction or val_corpus")
        out = run_baseline(cfg, args.alpha, progress=not args.json)
    except (cfg_lib.ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(f"bigram (add-{args.alpha:g}) fitted on {out['train_ids']} ids: held-out ce {out['ce']:.4f} nats/id, "
              f"{out['bpb']:.4f} bits/byte ({out['n_ids']} ids, {out['n_bytes']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
