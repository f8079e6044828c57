"""Held-out scoring: CE per id and bits per byte of an engine on an id stream.

The stream is read the way the trainer reads its corpus (docs/spec.md §6): cut into B
equal lanes, row b reads lane b chunk after chunk, and the carried thought flows from
each chunk to the next (a BOS inside a chunk resets its row inside the engine, exact to
the position). Each chunk is scored three ways from the same inputs:

- `ce`: the carry as the run trained it, restarted from the initial carry on the run's
  schedule (`CarrySchedule`: every N chunks, each lane with probability p) and streamed
  across the other chunks; a run with no schedule streams it along the whole lane;
- `ce_warm`: the carry streamed along the whole lane, never restarted;
- `ce_no_carry`: every chunk from the initial carry;

so the value of the continuous thought, and of a longer one than the run trained with,
are differences of these numbers.

Bits per byte = total nats / ln 2 / the number of byte ids (0-255) among the targets:
boundary and special ids cost nats but carry no bytes of text, so the figure compares
across tokenisers (an Atom stream and a GPT-2 stream of the same text share the
denominator). It is defined for Atom streams (vocab 266); other vocabularies get none.

Routing is exact (``capacity_factor=None``, as in generation): no token loses its
experts to another row. One jitted function scores a chunk; it compiles once per shape.
The lanes are read as `fractus_jax.lanes` lays them out. The command line is ``python -m
fractus_jax.eval`` (docs/training.md, Held-out evaluation). Nothing here depends on the
trainer, which calls `Scorer` for its own held-out split.
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
from fractus_jax.atom.features import FEATURE_CONTEXT, atom_features
from fractus_jax.atom.ids import PAD
from fractus_jax.atom.ids import VOCAB as ATOM_VOCAB
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.kernels.loss import CE_BLOCK, cross_entropy_terms
from fractus_jax.lanes import lane_layout, read_chunk

RESET_SEED = 0         # the draws of a probabilistic carry schedule: the same lanes every time


@dataclasses.dataclass(frozen=True)
class CarrySchedule:
    """When the scored carry restarts from the initial carry, as the trainer's
    carry_reset_every / carry_reset_prob restart it (docs/spec.md §6). A trainer step reads
    `span` consecutive chunks of each lane (its `accum`) and restarts only before the first:
    every lane at the steps whose index is a multiple of `every` (> 0), and each lane at
    each step with probability `prob`, drawn from RESET_SEED (the same lanes at every
    scoring, so values compare across steps)."""
    every: int = 0
    prob: float = 0.0
    span: int = 1

    @property
    def never(self) -> bool:
        """The carry streams along the whole lane: the schedule is `ce_warm`'s."""
        return not self.every and not self.prob

    @property
    def every_chunk(self) -> bool:
        """Every chunk starts from the initial carry: the schedule is `ce_no_carry`'s."""
        return self.span == 1 and (self.every == 1 or self.prob >= 1.0)

    def describe(self) -> str:
        unit = "chunk" if self.span == 1 else f"{self.span} chunks"
        parts = ([(f"at every {unit}" if self.every == 1 else f"every {self.every * self.span} chunks")]
                 if self.every else []) + \
                ([f"each lane with probability {self.prob:g} every {unit}"] if self.prob else [])
        return "never restarted" if self.never else "restarted " + " and ".join(parts)

    def resets(self, n_chunks: int, lanes: int) -> np.ndarray:
        """(n_chunks, lanes) bool: the lanes whose carry restarts at each chunk."""
        n_steps = -(-n_chunks // self.span)
        k = np.arange(n_steps)[:, None]
        rows = np.zeros((n_steps, lanes), bool)
        if self.every:
            rows |= (k % self.every == 0)
        if self.prob:
            rows |= np.random.default_rng(RESET_SEED).random((n_steps, lanes)) < self.prob
        out = np.zeros((n_steps * self.span, lanes), bool)
        out[::self.span] = rows
        return out[:n_chunks]


@dataclasses.dataclass(frozen=True)
class Score:
    """Totals of one scored stream; the per-id and per-byte figures derive from them."""
    nats: float                 # summed next-id CE, the carry as the run trained it (`schedule`)
    nats_warm: float            # the same targets, the carry streamed along the whole lane
    nats_no_carry: float        # the same targets, the carry reset at every chunk
    n_ids: int                  # targets scored: lanes · n_chunks · chunk
    n_bytes: Optional[int]      # byte ids (0-255) among them; None outside the Atom vocab
    lanes: int
    chunk: int
    n_chunks: int               # chunks per lane
    schedule: CarrySchedule = CarrySchedule()

    @property
    def ce(self) -> float:
        return self.nats / self.n_ids

    @property
    def ce_warm(self) -> float:
        return self.nats_warm / self.n_ids

    @property
    def ce_no_carry(self) -> float:
        return self.nats_no_carry / self.n_ids

    @property
    def bpb(self) -> Optional[float]:
        return bits_per_byte(self.nats, self.n_bytes)

    @property
    def bpb_warm(self) -> Optional[float]:
        return bits_per_byte(self.nats_warm, self.n_bytes)

    @property
    def bpb_no_carry(self) -> Optional[float]:
        return bits_per_byte(self.nats_no_carry, self.n_bytes)

    def to_json(self) -> dict:
        return {"ce": self.ce, "bpb": self.bpb, "ce_warm": self.ce_warm, "bpb_warm": self.bpb_warm,
                "ce_no_carry": self.ce_no_carry, "bpb_no_carry": self.bpb_no_carry,
                "n_ids": self.n_ids, "n_bytes": self.n_bytes, "nats": self.nats, "nats_warm": self.nats_warm,
                "nats_no_carry": self.nats_no_carry, "lanes": self.lanes, "chunk": self.chunk,
                "n_chunks": self.n_chunks, "carry_reset_every": self.schedule.every,
                "carry_reset_prob": self.schedule.prob,
                "chunks_per_step": self.schedule.span}


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


def _nats(params, h, targets, block):
    n = targets.size
    ce, _ = cross_entropy_terms(h.astype(jnp.float32), params["observe"], targets, block)
    return ce * n


@functools.partial(jax.jit, static_argnames=("cfg", "block", "ex"))
def score_chunk(params, carry, restart_R, ids_Bx1pC, feats, cfg: EngineConfig, block: int = CE_BLOCK,
                ex: Execution = Execution()):
    """One chunk (B, C + 1) of B lanes, inputs [:, :-1], targets [:, 1:], scored for each
    carried stream and from a zero carry: (nats (S + 1,), the streams' carry after it).

    carry holds S streams of the B lanes, stream after stream along each array's row axis
    (R = S·B rows); restart_R marks the rows that restart from the initial carry at this
    chunk. nats[s] is stream s's, nats[S] the zero carry's; float32 sums."""
    inputs, targets = ids_Bx1pC[:, :-1], ids_Bx1pC[:, 1:]
    B = inputs.shape[0]
    R = restart_R.shape[0]
    S = R // B
    # One forward of (S + 1)·B rows: the streams, then the same B lanes from a zero carry
    # (rows are independent under exact routing; one program compiles in a fraction of the time).
    carry = model.reset_state_rows(carry, restart_R)
    fresh = model.init_state(cfg, B)
    rows = {k: jnp.concatenate([carry[k], fresh[k].astype(carry[k].dtype)], axis=model.STATE_ROW_AXIS[k])
            for k in carry}
    repeat = lambda x: None if x is None else jnp.concatenate([x] * (S + 1), axis=0)  # noqa: E731
    h, _, after = model.forward_hidden(params, rows, repeat(inputs), cfg, repeat(feats), ex=ex)
    carry = {k: jax.lax.slice_in_dim(v, 0, R, axis=model.STATE_ROW_AXIS[k]) for k, v in after.items()}
    nats = jnp.stack([_nats(params, h[s * B:(s + 1) * B], targets, block) for s in range(S + 1)])
    return nats, carry


class Scorer:
    """Scores id streams with one engine config, lane count, chunk length and carry schedule.

    `feats` feeds the Atom packet features of each chunk (and of the FEATURE_CONTEXT ids
    before it), as a run trained with `feats` saw them. `schedule`: the run's carry
    restarts (`CarrySchedule`; none by default: `ce` is then `ce_warm`). `ex`: how the
    engine is computed (a run's own execution settings, or the defaults)."""

    def __init__(self, cfg: EngineConfig, lanes: int, chunk: int, feats: bool = False,
                 schedule: CarrySchedule = CarrySchedule(), ex: Execution = Execution()):
        self.cfg, self.ex = cfg.for_inference(), ex.for_inference()
        self.lanes, self.chunk = int(lanes), int(chunk)
        self.feats = bool(feats) and self.cfg.is_atom
        self.atom = self.cfg.vocab_size == ATOM_VOCAB
        self.schedule = schedule

    def layout(self, n_ids: int) -> tuple[int, int]:
        return lane_layout(n_ids, self.lanes, self.chunk)

    def score(self, params, ids, progress: bool = False, desc: Optional[str] = None) -> Score:
        """The Score of `ids` (a 1-D array or memory map: only the chunks are read)."""
        lane_len, n_chunks = self.layout(len(ids))
        B, sched = self.lanes, self.schedule
        # The streams carried from chunk to chunk: the warm one, and the run's schedule's when
        # it is neither the warm one nor the zero carry's.
        own_stream = not sched.never and not sched.every_chunk
        restarts = np.zeros((n_chunks, B * (1 + own_stream)), bool)
        if own_stream:
            restarts[:, B:] = sched.resets(n_chunks, B)
        bar = None

        def new_bar(initial, description):
            from tqdm import tqdm   # loaded only when a bar is shown
            return tqdm(total=n_chunks, initial=initial, unit="chunk", desc=description, file=sys.stderr,
                        dynamic_ncols=True, delay=1.0, leave=False)

        if progress:
            bar = new_bar(0, f"{desc + ': ' if desc else ''}compiling")
        carry = model.init_state(self.cfg, restarts.shape[1])
        total = np.zeros(2 + own_stream)
        n_bytes = 0
        pending = None
        try:
            for k in range(n_chunks):
                rows, left = read_chunk(ids, B, lane_len, self.chunk, k, FEATURE_CONTEXT if self.feats else 0)
                feats = None
                if self.feats:
                    feats = jnp.asarray(atom_features(rows[:, :-1], left=left))
                n_bytes += count_bytes(rows[:, 1:])
                nats, carry = score_chunk(params, carry, jnp.asarray(restarts[k]), jnp.asarray(rows), feats, self.cfg,
                                         ex=self.ex)
                if pending is not None:   # chunk k is dispatched: now read chunk k−1
                    total += np.asarray(pending, np.float64)
                    if bar is not None and k == 1:   # the compilation is done: a bar whose rate starts here
                        bar.close()
                        bar = new_bar(1, desc)
                    elif bar is not None:
                        bar.update(1)
                pending = nats
            total += np.asarray(pending, np.float64)
        finally:
            if bar is not None:
                bar.close()
        warm, no_carry = float(total[0]), float(total[-1])
        trained = float(total[1]) if own_stream else no_carry if sched.every_chunk else warm
        return Score(nats=trained, nats_warm=warm, nats_no_carry=no_carry, n_ids=B * n_chunks * self.chunk,
                     n_bytes=n_bytes if self.atom else None, lanes=B, chunk=self.chunk, n_chunks=n_chunks,
                     schedule=sched)


def score(params, cfg: EngineConfig, ids, lanes: int, chunk: int, feats: bool = False,
          progress: bool = False, schedule: CarrySchedule = CarrySchedule(), ex: Execution = Execution()) -> Score:
    """One call: `Scorer(cfg, lanes, chunk, feats, schedule, ex).score(params, ids)`."""
    return Scorer(cfg, lanes, chunk, feats, schedule, ex).score(params, ids, progress=progress)
