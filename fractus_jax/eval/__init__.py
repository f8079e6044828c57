"""Held-out scoring: CE per id and bits per byte of an engine on an id stream.

The stream is read the way the trainer reads its corpus (docs/spec.md §6): cut into B
equal lanes, row b reads lane b chunk after chunk, and the carried thought flows from
each chunk to the next (a BOS inside a chunk resets its row inside the engine, exact to
the position). Each chunk is scored twice from the same inputs: with the carry streamed
from the chunk before (`ce`), and from a zero carry (`ce_no_carry`), so the value of the
continuous thought is the difference of two numbers.

Bits per byte = total nats / ln 2 / the number of byte ids (0-255) among the targets:
boundary and special ids cost nats but carry no bytes of text, so the figure compares
across tokenisers (an Atom stream and a GPT-2 stream of the same text share the
denominator). It is defined for Atom streams (vocab 266); other vocabularies get none.

Routing is exact (``capacity_factor=None``, as in generation): no token loses its
experts to another row. One jitted function scores a chunk; it compiles once per shape.
The command line is ``python -m fractus_jax.eval`` (docs/training.md, Held-out evaluation).
Nothing here depends on the trainer, which calls `Scorer` for its own held-out split.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import model
from fractus_jax.atom.features import atom_features
from fractus_jax.atom.ids import PAD
from fractus_jax.atom.ids import VOCAB as ATOM_VOCAB
from fractus_jax.config import EngineConfig
from fractus_jax.kernels.loss import cross_entropy_terms

FEATURE_CONTEXT = 64   # ids before a chunk that its packet features see (the trainer's)
CE_BLOCK = 1024        # positions per cross-entropy block: the (B, C, V) logits are never whole
ROW_AXIS = {"thought": 0, "S": 1, "z": 1, "phase": 1}   # the lane axis of each carried-state array


class EvalError(ValueError):
    """An id stream that cannot be scored as asked (too short for the lanes, ...)."""


@dataclasses.dataclass(frozen=True)
class Score:
    """Totals of one scored stream; the per-id and per-byte figures derive from them."""
    nats: float                 # summed next-id CE, the carry streamed across chunks
    nats_no_carry: float        # the same targets, the carry reset at every chunk
    n_ids: int                  # targets scored: lanes · n_chunks · chunk
    n_bytes: Optional[int]      # byte ids (0-255) among them; None outside the Atom vocab
    lanes: int
    chunk: int
    n_chunks: int               # chunks per lane

    @property
    def ce(self) -> float:
        return self.nats / self.n_ids

    @property
    def ce_no_carry(self) -> float:
        return self.nats_no_carry / self.n_ids

    @property
    def bpb(self) -> Optional[float]:
        return bits_per_byte(self.nats, self.n_bytes)

    @property
    def bpb_no_carry(self) -> Optional[float]:
        return bits_per_byte(self.nats_no_carry, self.n_bytes)

    def to_json(self) -> dict:
        return {"ce": self.ce, "bpb": self.bpb, "ce_no_carry": self.ce_no_carry,
                "bpb_no_carry": self.bpb_no_carry, "n_ids": self.n_ids, "n_bytes": self.n_bytes,
                "nats": self.nats, "nats_no_carry": self.nats_no_carry, "lanes": self.lanes,
                "chunk": self.chunk, "n_chunks": self.n_chunks}


def bits_per_byte(nats: float, n_bytes: Optional[int]) -> Optional[float]:
    """nats / ln 2 / n_bytes; None where there are no bytes to divide by."""
    if not n_bytes:
        return None
    return nats / math.log(2) / n_bytes


def count_bytes(ids) -> int:
    """How many ids are bytes of text (0-255): the bits-per-byte denominator. A character
    of k UTF-8 bytes counts k (é 2, 日 3); BOS, EOS and boundaries count nothing."""
    a = np.asarray(ids)
    return int(np.count_nonzero((a >= 0) & (a < PAD)))


def lane_layout(n_ids: int, lanes: int, chunk: int) -> tuple[int, int]:
    """(lane length, chunks per lane) of n_ids cut into `lanes` lanes read in chunks of
    `chunk` inputs plus the target past them (the trainer's LaneReader with accum 1)."""
    if lanes < 1 or chunk < 1:
        raise EvalError(f"lanes and chunk must be >= 1, got {lanes} and {chunk}")
    lane_len = n_ids // lanes
    n_chunks = (lane_len - 1) // chunk if lane_len else 0
    if n_chunks < 1:
        raise EvalError(f"{n_ids} ids make {lanes} lanes of {lane_len} ids: too few for one chunk of "
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


def scoring_config(cfg: EngineConfig) -> EngineConfig:
    """The engine as scoring runs it: exact routing on one device, one row stream (the
    function the weights define; execution settings only)."""
    return cfg.replace(capacity_factor=None, moe_shards=1, row_streams=1)


def _nats(params, h, targets, block):
    n = targets.size
    ce, _ = cross_entropy_terms(h.astype(jnp.float32), params["observe"], targets, block)
    return ce * n


@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def score_chunk(params, carry, ids_Bx1pC, feats, cfg: EngineConfig, block: int = CE_BLOCK):
    """(nats with the carry, nats from a zero carry, the carry after the chunk) of one
    chunk (B, C + 1): inputs [:, :-1], targets [:, 1:]; float32 sums."""
    inputs, targets = ids_Bx1pC[:, :-1], ids_Bx1pC[:, 1:]
    B = inputs.shape[0]
    # One forward of 2B rows: the B lanes with their carry, then the same B from a zero
    # carry (rows are independent under exact routing; one program compiles in half the time).
    fresh = model.init_state(cfg, B)
    both = {k: jnp.concatenate([carry[k], fresh[k].astype(carry[k].dtype)], axis=ROW_AXIS[k]) for k in carry}
    twice = lambda x: None if x is None else jnp.concatenate([x, x], axis=0)  # noqa: E731
    h, _, after = model.forward_hidden(params, both, twice(inputs), cfg, twice(feats))
    carry = {k: jax.lax.slice_in_dim(v, 0, B, axis=ROW_AXIS[k]) for k, v in after.items()}
    return _nats(params, h[:B], targets, block), _nats(params, h[B:], targets, block), carry


class Scorer:
    """Scores id streams with one engine config, lane count and chunk length.

    `feats` feeds the Atom packet features of each chunk (and of the FEATURE_CONTEXT ids
    before it), as a run trained with `feats` saw them."""

    def __init__(self, cfg: EngineConfig, lanes: int, chunk: int, feats: bool = False):
        self.cfg = scoring_config(cfg)
        self.lanes, self.chunk = int(lanes), int(chunk)
        self.feats = bool(feats) and self.cfg.is_atom
        self.atom = self.cfg.vocab_size == ATOM_VOCAB

    def layout(self, n_ids: int) -> tuple[int, int]:
        return lane_layout(n_ids, self.lanes, self.chunk)

    def score(self, params, ids, progress: bool = False, desc: Optional[str] = None) -> Score:
        """The Score of `ids` (a 1-D array or memory map: only the chunks are read)."""
        lane_len, n_chunks = self.layout(len(ids))
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=n_chunks, unit="chunk", desc=f"{desc + ': ' if desc else ''}compiling",
                       file=sys.stderr, dynamic_ncols=True, delay=1.0, leave=False)
        carry = model.init_state(self.cfg, self.lanes)
        nats = nats0 = 0.0
        n_bytes = 0
        pending = None
        try:
            for k in range(n_chunks):
                rows, left = read_chunk(ids, self.lanes, lane_len, self.chunk, k,
                                        FEATURE_CONTEXT if self.feats else 0)
                feats = None
                if self.feats:
                    feats = jnp.asarray(atom_features(rows[:, :-1], left=left))
                n_bytes += count_bytes(rows[:, 1:])
                a, b, carry = score_chunk(params, carry, jnp.asarray(rows), feats, self.cfg)
                if pending is not None:   # chunk k is dispatched: now read chunk k−1
                    nats, nats0 = nats + float(pending[0]), nats0 + float(pending[1])
                    if bar is not None and k == 1:   # the compilation is done: the rate starts here
                        bar.reset(total=n_chunks)
                        bar.n = bar.last_print_n = bar.initial = 1
                        bar.set_description_str(desc, refresh=False)
                    elif bar is not None:
                        bar.update(1)
                pending = (a, b)
            nats, nats0 = nats + float(pending[0]), nats0 + float(pending[1])
        finally:
            if bar is not None:
                bar.close()
        return Score(nats=nats, nats_no_carry=nats0, n_ids=self.lanes * n_chunks * self.chunk,
                     n_bytes=n_bytes if self.atom else None, lanes=self.lanes, chunk=self.chunk,
                     n_chunks=n_chunks)


def score(params, cfg: EngineConfig, ids, lanes: int, chunk: int, feats: bool = False,
          progress: bool = False) -> Score:
    """One call: `Scorer(cfg, lanes, chunk, feats).score(params, ids)`."""
    return Scorer(cfg, lanes, chunk, feats).score(params, ids, progress=progress)
