"""The 320-d Atom packet features (docs/spec.md §5; layout in docs/atom.md).

One vector per boundary position, computed from the packet that boundary closes
and a rolling sketch of the packets before it in the same document. Pure numpy,
deterministic (fixed hashes, no randomness), every value in [-1, 1], and cheap
(a few vectorised passes; no Python loop over positions).

``atom_features(ids)`` gives an array ``ids.shape + (320,)`` (float32) that is
zero everywhere except at boundary ids 259-265: the engine's ``feats`` input.
"""
from __future__ import annotations

import numpy as np

from fractus_jax.atom.ids import BOS, BOUNDARY_FIRST, BOUNDARY_LAST, FEAT_DIM, MAX_SPAN, N_BOUNDARIES, PAD
from fractus_jax.atom.stream import CLASS  # first-byte class (the spec's five)

SKETCH = 128  # hashed byte unigram + bigram buckets
CONTEXT_PACKETS = 8  # the rolling context: mean sketch of up to 8 earlier packets
HISTORY = 4  # kinds and lengths of the 4 previous packets
PERIODS = (8.0, 64.0, 512.0, 4096.0)  # packet index in the document, sin / cos
# Ids before a chunk that its packet features look at (`atom_features(ids, left=...)`): the
# trainer and held-out scoring both pass this many, so a chunk's first packets see the same
# context wherever it is read.
FEATURE_CONTEXT = 64

# Offsets of each field in the 320-d vector.
F_KIND = 0  # 7: one-hot boundary kind (259..265)
F_LEN = 7  # 1: payload bytes / 32
F_CLASSES = 8  # 8: fractions of payload bytes by class
F_SKETCH = 16  # 128: the packet's hashed byte sketch, L2-normalised
F_CONTEXT = F_SKETCH + SKETCH  # 128: mean sketch of the previous packets
F_PREV_KIND = F_CONTEXT + SKETCH  # 28: one-hot kinds of the 4 previous packets
F_PREV_LEN = F_PREV_KIND + HISTORY * N_BOUNDARIES  # 4: their lengths / 32
F_POSITION = F_PREV_LEN + HISTORY  # 8: sin, cos of the packet index per period
F_FLAGS = F_POSITION + 2 * len(PERIODS)  # 8: first-byte class one-hot (5),
#                                           capitalised, all caps, non-ASCII
assert F_FLAGS + 8 == FEAT_DIM

# Byte classes for the fraction field: newline, whitespace, punctuation, digit,
# upper, lower, UTF-8 lead (>= 0xC0), UTF-8 continuation / other high byte.
_BCLASS = np.full(256, 2, np.int64)
_BCLASS[0x0A] = 0
_BCLASS[[0x20, 0x09, 0x0D, 0x0B, 0x0C]] = 1
_BCLASS[0x30:0x3A] = 3
_BCLASS[0x41:0x5B] = 4
_BCLASS[0x61:0x7B] = 5
_BCLASS[0xC0:] = 6
_BCLASS[0x80:0xC0] = 7


def _hash(x: np.ndarray, salt: int) -> np.ndarray:
    """A fixed integer hash (murmur3 finaliser) onto SKETCH buckets."""
    h = (x.astype(np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    return (h % np.uint64(SKETCH)).astype(np.int64)


_UNI = _hash(np.arange(256), 1)
_BI = _hash(np.arange(257 * 256), 2).reshape(257, 256)  # row 256: packet start


def packet_features(ids) -> tuple:
    """Features of every packet in a 1-D id sequence.

    Returns ``(positions, feats)``: the indices of the boundary ids (259-265) in
    ``ids`` and a float32 array (len(positions), 320). A packet is the run of
    byte ids (0-255) just before its boundary id; BOS, EOS and PAD end a run
    without making a packet, and BOS starts a new document (the context and the
    packet index restart)."""
    x = np.asarray(ids).reshape(-1).astype(np.int64)
    br = x >= PAD  # breaks: every non-byte id
    q = np.flatnonzero(br)  # break positions
    isb = (x[q] >= BOUNDARY_FIRST) & (x[q] <= BOUNDARY_LAST)
    out = np.zeros((int(isb.sum()), FEAT_DIM), np.float32)
    if out.shape[0] == 0:
        return q[isb], out
    nq = q.size
    byte = np.flatnonzero(~br)
    bi = (np.cumsum(br) - br)[byte]  # the break each byte precedes
    tail = bi < nq  # bytes after the last break make no packet
    byte, bi = byte[tail], bi[tail]
    b = x[byte]
    length = np.bincount(bi, minlength=nq)
    cls = np.bincount(bi * 8 + _BCLASS[b], minlength=nq * 8).reshape(nq, 8)
    # The sketch: unigrams, and bigrams with the previous byte of the same packet.
    first = np.ones(b.size, bool)
    first[1:] = bi[1:] != bi[:-1]
    prev = np.where(first, 256, np.concatenate([[256], b[:-1]]))
    sk = np.bincount(bi * SKETCH + _UNI[b], minlength=nq * SKETCH)
    sk += np.bincount(bi * SKETCH + _BI[prev, b], minlength=nq * SKETCH)
    sk = sk.reshape(nq, SKETCH).astype(np.float64)
    sk /= np.maximum(np.sqrt((sk * sk).sum(1, keepdims=True)), 1.0)
    fb = np.full(nq, -1, np.int64)  # first byte of each packet
    fb[bi[first]] = b[first]
    # Keep the packets (boundary breaks); documents start at BOS.
    doc = np.cumsum(x[q] == BOS)[isb]
    kind = x[q][isb] - BOUNDARY_FIRST
    length, cls, sk, fb = length[isb], cls[isb], sk[isb], fb[isb]
    upper, lower = cls[:, 4], cls[:, 5]  # ASCII upper / lower case bytes
    high = cls[:, 6] + cls[:, 7]  # bytes >= 0x80
    n = kind.size
    k = np.arange(n)
    doc_first = np.searchsorted(doc, doc)  # index of the document's first packet
    ordinal = k - doc_first

    out[k, F_KIND + kind] = 1.0
    out[:, F_LEN] = np.minimum(length, MAX_SPAN) / MAX_SPAN
    out[:, F_CLASSES:F_CLASSES + 8] = cls / np.maximum(length, 1)[:, None]
    out[:, F_SKETCH:F_SKETCH + SKETCH] = sk
    # The mean sketch of the up to CONTEXT_PACKETS packets before, summed nearest first: a
    # packet's value depends on its own document's packets only, whatever else `ids` holds.
    ctx = np.zeros((n, SKETCH))
    for d in range(1, CONTEXT_PACKETS + 1):
        ok = ordinal >= d
        ctx[ok] += sk[k[ok] - d]
    ctx /= np.maximum(np.minimum(ordinal, CONTEXT_PACKETS), 1)[:, None]
    out[:, F_CONTEXT:F_CONTEXT + SKETCH] = np.clip(ctx, 0.0, 1.0)
    for h in range(1, HISTORY + 1):
        ok = ordinal >= h
        out[k[ok], F_PREV_KIND + (h - 1) * N_BOUNDARIES + kind[k[ok] - h]] = 1.0
        out[k[ok], F_PREV_LEN + h - 1] = np.minimum(length[k[ok] - h], MAX_SPAN) / MAX_SPAN
    for i, p in enumerate(PERIODS):
        ang = 2 * np.pi * ordinal / p
        out[:, F_POSITION + 2 * i] = np.sin(ang)
        out[:, F_POSITION + 2 * i + 1] = np.cos(ang)
    has = fb >= 0
    out[k[has], F_FLAGS + CLASS[fb[has]].astype(np.int64)] = 1.0
    out[:, F_FLAGS + 5] = has & (_BCLASS[np.maximum(fb, 0)] == 4)
    out[:, F_FLAGS + 6] = (upper >= 2) & (lower == 0)
    out[:, F_FLAGS + 7] = high > 0
    return q[isb], out


def atom_features(ids, left=None) -> np.ndarray:
    """Features aligned with ``ids`` (shape (..., C)): float32 ``(..., C, 320)``,
    zero except at positions holding a boundary id (259-265).

    Each row is independent. ``left`` (shape (..., K)), if given, holds the ids
    just before each row: they extend the first packet and the context of the
    row but get no features of their own (a training chunk can pass the ids
    before it so that its first packets see the same context as in the corpus)."""
    x = np.asarray(ids)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    lrows = None
    if left is not None:
        lf = np.asarray(left)
        lrows = lf.reshape(-1, lf.shape[-1])
        if lrows.shape[0] != rows.shape[0]:
            raise ValueError(f"left has {lrows.shape[0]} rows, ids has {rows.shape[0]}")
    # All rows in one pass: each row (its left ids first) behind a BOS, which ends the row
    # before it without a packet and starts a document, so no row sees another's packets.
    n_rows, n_cols = rows.shape
    off = 1 + (0 if lrows is None else lrows.shape[1])
    seq = np.empty((n_rows, off + n_cols), np.int64)
    seq[:, 0] = BOS
    if lrows is not None:
        seq[:, 1:off] = lrows
    seq[:, off:] = rows
    pos, f = packet_features(seq.reshape(-1))
    row, col = np.divmod(pos, off + n_cols)
    keep = col >= off
    out = np.zeros(rows.shape + (FEAT_DIM,), np.float32)
    out[row[keep], col[keep] - off] = f[keep]
    return out.reshape(x.shape + (FEAT_DIM,))
