"""Lanes: how a stream of ids is read, by the trainer and by held-out scoring (docs/spec.md §6).

With B lanes the stream is cut into B equal lanes; row b always reads lane b, so its
carried state continues its own text. `pos` (the manifest's start_token_next) is the
offset inside every lane. A step reads `accum` consecutive chunks of C inputs plus one
target past them: lane[pos : pos + accum·C + 1]. When a lane has no room left for a
step, every lane starts again at 0 (an epoch). Held-out scoring reads its lanes the same
way with accum 1, chunk after chunk from the lane's start (`lane_layout`, `read_chunk`);
the bigram's pairs are the same targets with the id before each.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class LaneError(ValueError):
    """A stream that cannot be read in these lanes (too short for the batch or the chunk)."""


class LaneReader:
    def __init__(self, ids, batch_size: int, seq_len: int, accum: int = 1,
                 rows: Optional[Sequence[int]] = None, source: str = "corpus"):
        self.ids = ids
        self.batch_size, self.seq_len, self.accum = batch_size, seq_len, accum
        self.n_ids = len(ids)
        self.lane_len = self.n_ids // batch_size
        self.span = accum * seq_len
        self.rows = list(range(batch_size)) if rows is None else list(rows)
        if self.lane_len < self.span + 1:
            raise LaneError(
                f"{source} has {self.n_ids} ids: {batch_size} lanes of {self.lane_len} ids cannot "
                f"serve {accum}×{seq_len}+1 ids per step; use a larger corpus or a smaller batch/seq")

    def position(self, pos: int) -> int:
        """Where a step asked to start at pos really starts (0 after the end of a lane)."""
        if pos < 0:
            raise LaneError(f"lane offset must be >= 0, got {pos}")
        return 0 if pos + self.span + 1 > self.lane_len else pos

    def read(self, pos: int, left: int = 0, rows=None) -> tuple[np.ndarray, int, Optional[np.ndarray]]:
        """(ids (accum, rows, C + 1) int32, the next step's offset, context).

        `rows` (a slice or indices into this reader's rows; default all) lets each device
        shard read only its own lanes. With left > 0 and room in the lane, context
        (accum, rows, left) holds the ids just before each chunk (for packet features
        that see the text before the chunk)."""
        pos = self.position(pos)
        lanes = self.rows if rows is None else (self.rows[rows] if isinstance(rows, slice)
                                                 else [self.rows[i] for i in rows])
        before = left if pos >= left else 0
        out = np.empty((len(lanes), before + self.span + 1), np.int32)
        for i, b in enumerate(lanes):
            start = b * self.lane_len + pos - before
            out[i] = self.ids[start:start + before + self.span + 1]
        C = self.seq_len
        chunks = np.stack([out[:, before + a * C:before + a * C + C + 1] for a in range(self.accum)])
        context = None
        if left and (before or self.accum > 1):
            starts = [before + a * C - left for a in range(self.accum)]
            if min(starts) >= 0:
                context = np.stack([out[:, s:s + left] for s in starts])
        return chunks, pos + self.span, context


def lane_layout(n_ids: int, lanes: int, chunk: int) -> tuple[int, int]:
    """(lane length, chunks per lane) of n_ids cut into `lanes` lanes read in chunks of
    `chunk` inputs plus the target past them (LaneReader with accum 1)."""
    if lanes < 1 or chunk < 1:
        raise LaneError(f"lanes and chunk must be >= 1, got {lanes} and {chunk}")
    lane_len = n_ids // lanes
    n_chunks = (lane_len - 1) // chunk if lane_len else 0
    if n_chunks < 1:
        raise LaneError(f"{n_ids} ids make {lanes} lanes of {lane_len} ids: too few for one chunk of "
                        f"{chunk}+1 ids per lane (use more ids, fewer lanes or a shorter chunk)")
    return lane_len, n_chunks


def lane_targets(ids, lanes: int, chunk: int) -> np.ndarray:
    """Every target the lanes score, (lanes, n_chunks·chunk): each lane's ids past its first."""
    lane_len, n_chunks = lane_layout(len(ids), lanes, chunk)
    return np.stack([np.asarray(ids[b * lane_len + 1:b * lane_len + 1 + n_chunks * chunk])
                     for b in range(lanes)])


def read_chunk(ids, lanes: int, lane_len: int, chunk: int, k: int, context: int = 0):
    """Chunk k of every lane, (lanes, chunk + 1) int32, and with context > 0 the `context`
    ids before it in its lane (lanes, context), or None when the lane has not that many."""
    start = k * chunk
    rows = np.stack([np.asarray(ids[b * lane_len + start:b * lane_len + start + chunk + 1], np.int32)
                     for b in range(lanes)])
    left = None
    if context and start >= context:
        left = np.stack([np.asarray(ids[b * lane_len + start - context:b * lane_len + start], np.int32)
                         for b in range(lanes)])
    return rows, left


def lane_pairs(ids, lanes: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(previous ids, targets), each (lanes, n_chunks·chunk): every target the eval lanes
    score (lane_targets) and the id just before it in its lane."""
    lane_len, n_chunks = lane_layout(len(ids), lanes, chunk)
    span = n_chunks * chunk
    rows = np.stack([np.asarray(ids[b * lane_len:b * lane_len + span + 1], np.int64) for b in range(lanes)])
    return rows[:, :-1], rows[:, 1:]
