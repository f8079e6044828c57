"""The trainer's held-out score (docs/training.md, Held-out evaluation)."""
from __future__ import annotations

import numpy as np

from fractus_jax.eval import Scorer
from fractus_jax.train.config import TrainConfig


def val_slice(cfg: TrainConfig, val):
    """The fixed held-out ids the trainer scores: the first val_ids of the held-out part."""
    return val.ids[:cfg.val_ids]


class HeldOut:
    """The trainer's held-out score: the fixed slice (`val_slice`) in val_lanes lanes,
    chunks of seq_len, the carry flowing from a zero start, scored by fractus_jax.eval
    (exact routing), so `python -m fractus_jax.eval --ids val_ids --lanes val_lanes`
    on a checkpoint gives the value logged at its step."""

    def __init__(self, cfg: TrainConfig, val):
        self.ids = np.asarray(val_slice(cfg, val), np.int32)
        self.scorer = Scorer(cfg.model, cfg.val_lanes, cfg.seq_len, feats=cfg.feats)

    def run(self, params) -> dict:
        s = self.scorer.score(params, self.ids)
        out = {"val_ce": s.ce, "val_ce_no_carry": s.ce_no_carry}
        if s.n_bytes:
            out.update(val_bpb=s.bpb, val_bpb_no_carry=s.bpb_no_carry)
        return out
