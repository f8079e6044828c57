"""The trainer's held-out score (docs/training.md, Held-out evaluation)."""
from __future__ import annotations

import numpy as np

from fractus_jax import bigram
from fractus_jax.scoring import CarrySchedule, Scorer
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.config import TrainConfig


def val_slice(cfg: TrainConfig, val):
    """The fixed held-out ids the trainer scores: the first val_ids of the held-out part."""
    return val.ids[:cfg.val_ids]


def carry_schedule(cfg: TrainConfig) -> CarrySchedule:
    """The run's carry restarts, as scoring applies them to its held-out lanes: before the
    first of each step's accum chunks."""
    return CarrySchedule(every=cfg.carry_reset_every, prob=cfg.carry_reset_prob, span=cfg.accum)


class HeldOut:
    """The trainer's held-out score: the fixed slice (`val_slice`) in val_lanes lanes,
    chunks of seq_len, the carry from a zero start restarted on the run's schedule, scored
    by fractus_jax.eval (exact routing), so `python -m fractus_jax.eval --ids val_ids
    --lanes val_lanes` on a checkpoint gives the values logged at its step."""

    def __init__(self, cfg: TrainConfig, val):
        self.ids = np.asarray(val_slice(cfg, val), np.int32)
        self.scorer = Scorer(cfg.model, cfg.val_lanes, cfg.seq_len, feats=cfg.feats, schedule=carry_schedule(cfg),
                             ex=cfg.execution)

    def run(self, params) -> dict:
        s = self.scorer.score(params, self.ids)
        out = {"val_ce": s.ce, "val_ce_warm": s.ce_warm, "val_ce_no_carry": s.ce_no_carry}
        if s.n_bytes:
            out.update(val_bpb=s.bpb, val_bpb_warm=s.bpb_warm, val_bpb_no_carry=s.bpb_no_carry)
        return out


def bigram_baseline(cfg: TrainConfig, alpha: float = 1.0, progress: bool = False) -> dict:
    """The bigram count baseline of a run (fractus_jax.bigram): fitted on the part of
    cfg's corpus the lanes read, scored on cfg's held-out slice."""
    corpus = prepare_lib.open_training_corpus(cfg, progress=progress)
    train, val = prepare_lib.split_corpus(corpus, cfg.val_fraction)
    if cfg.val_corpus:
        val = prepare_lib.open_val_corpus(cfg)
    prepare_lib.check_val_slice(cfg, val)
    counts = bigram.fit(train.ids, cfg.model.vocab_size)
    out = bigram.score(counts, np.asarray(val_slice(cfg, val)), cfg.val_lanes, cfg.seq_len, alpha)
    return {**out, "train_ids": train.n_ids}
