"""Lanes over a memory-mapped corpus (docs/spec.md §6).

With batch B the corpus is cut into B equal lanes; row b always reads lane b, so its
carried state continues its own text. `pos` (the manifest's start_token_next) is the
offset inside every lane. A step reads `accum` consecutive chunks of C inputs plus one
target past them: lane[pos : pos + accum·C + 1]. When a lane has no room left for a
step, every lane starts again at 0 (an epoch). `global_batch` builds the step's input as
a global array whose shards each read only their own lanes, so on several hosts a
process never reads another process's rows.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from fractus_jax.atom.features import atom_features
from fractus_jax.atom.ids import FEAT_DIM


class DataError(ValueError):
    """The corpus cannot serve this batch shape."""


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
            raise DataError(
                f"{source} has {self.n_ids} ids: {batch_size} lanes of {self.lane_len} ids cannot "
                f"serve {accum}×{seq_len}+1 ids per step; use a larger corpus or a smaller batch/seq")

    def position(self, pos: int) -> int:
        """Where a step asked to start at pos really starts (0 after the end of a lane)."""
        if pos < 0:
            raise DataError(f"lane offset must be >= 0, got {pos}")
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


def chunk_features(chunks: np.ndarray, context: Optional[np.ndarray]) -> np.ndarray:
    """Atom packet features (accum, rows, C, FEAT_DIM) of each chunk's inputs."""
    inputs = chunks[..., :-1]
    return np.stack([atom_features(inputs[a], left=None if context is None else context[a])
                     for a in range(inputs.shape[0])])


def global_batch(reader: LaneReader, pos: int, shardings: dict, feature_context: int = 0) -> dict:
    """The step's batch as global arrays; each addressable shard reads its own rows."""
    A, B, C = reader.accum, reader.batch_size, reader.seq_len

    def ids_shard(index):
        return reader.read(pos, rows=index[1])[0][index[0]]

    batch = {"ids": jax.make_array_from_callback((A, B, C + 1), shardings["ids"], ids_shard)}
    if "feats" in shardings:
        def feats_shard(index):
            chunks, _, context = reader.read(pos, left=feature_context, rows=index[1])
            return chunk_features(chunks, context)[index[0]]
        batch["feats"] = jax.make_array_from_callback((A, B, C, FEAT_DIM), shardings["feats"], feats_shard)
    return batch
