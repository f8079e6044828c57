"""Analytic model FLOPs: the useful work per id, the numerator of MFU.

Forward, per id, with D = d_model, H·dH = D, L attention levels, K of E experts active:

    per block   8·D²                    q, k, v and output projections (2·D·4D)
              + 4·L·D·dH                the recurrence per level and head: S += k⊗v,
                                        y = q·S (2·dH² each), as the recurrence defines it
              + 4·K·r·(D + F)           K low-rank experts: x·V1, ·U1ᵀ, u·V2, ·U2ᵀ
              + 2·D                     phase projection (atom) / mean (parent)
              + N·(8·r_k + 12)·4·steps  the Kuramoto field, 4 RK4 evaluations per step
    head        2·D·V                   tied output logits

A training step costs 3× the forward (the backward is twice the forward), counted over
the teacher-forced pass only. Work that is not useful is not counted: the (c×c) masked
products of the chunkwise attention beyond the recurrence, empty capacity slots, dropped
assignments' compute, recomputation under remat. MFU is therefore a lower bound on how
busy the machine is.
"""
from __future__ import annotations

from fractus_jax.config import EngineConfig


def forward_flops_per_id(cfg: EngineConfig) -> float:
    D, dH, L = cfg.d_model, cfg.d_head, cfg.n_levels
    attention = 8 * D * D + 4 * L * D * dH
    experts = 4 * cfg.top_k * cfg.siren_rank * (D + cfg.expert_d_ff)
    kuramoto = 2 * D + cfg.n_oscillators * (8 * cfg.coupling_rank + 12) * 4 * cfg.kuramoto_steps
    return cfg.n_layers * (attention + experts + kuramoto) + 2 * D * cfg.vocab_size


def train_flops_per_id(cfg: EngineConfig) -> float:
    return 3.0 * forward_flops_per_id(cfg)
