"""The step's batch from the lanes (fractus_jax.lanes, docs/spec.md §6).

`global_batch` builds the step's input as a global array whose shards each read only
their own lanes, so on several hosts a process never reads another process's rows;
`chunk_features` gives the Atom packet features of each chunk.
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from fractus_jax.atom.features import atom_features
from fractus_jax.atom.ids import FEAT_DIM
from fractus_jax.lanes import LaneReader


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
