"""A bigram count baseline for the held-out score (docs/training.md, Carry resets).

`fit` counts every adjacent pair (a, b) of an id stream; `score` reads held-out ids in the
lanes and chunks `fractus_jax.scoring` scores and gives p(b | a) = (n(a, b) + alpha) /
(n(a) + alpha·V), add-alpha smoothing over the V ids of the vocabulary (alpha 1: add-one).
Each target's previous id is the id before it in its lane, as the engine's input there
is. Bits per byte use eval's denominator: total nats / ln 2 / the byte ids (0-255) among
the targets. A run's baseline (fitted on the ids its lanes read, scored on its held-out
slice) is `fractus_jax.train.heldout.bigram_baseline`; the command line is
``python -m fractus_jax.eval.bigram``.
"""
from __future__ import annotations

import numpy as np

from fractus_jax.lanes import lane_pairs
from fractus_jax.scoring import bits_per_byte, count_bytes

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
