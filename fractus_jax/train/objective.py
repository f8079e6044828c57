"""The training loss of one chunk: ce_weight · mean next-id CE + lb_coef · the load-balance
term (+ repeat_coef · the mean probability of repeating the input id).

`step` differentiates it (through `accumulate`); `reach` reads off it which parameters it
reaches, and `state` freezes the others in the optimizer. It sits below all three.
"""
from __future__ import annotations

import jax

from fractus_jax import model
from fractus_jax.kernels.loss import cross_entropy_terms
from fractus_jax.train.config import TrainConfig

# The TrainConfig fields `train_loss` reads (besides `model` and `execution`): configs equal in these share
# one `reach` analysis.
LOSS_FIELDS = ("batch_size", "seq_len", "lb_coef", "repeat_coef", "ce_chunk", "bptt_chunks")


def train_loss(params, carry, inputs_BxC, targets_BxC, feats, cfg: TrainConfig, ce_weight: float,
               carry_grad: bool = False):
    """(loss, (ce, lb, keep_rate, repeat_prob, new_carry, hidden)) of one chunk."""
    h, aux, new_carry = model.forward_hidden(params, carry, inputs_BxC, cfg.model, feats, carry_grad=carry_grad,
                                                ex=cfg.execution)
    with jax.named_scope("loss"):
        ce, repeat = cross_entropy_terms(h, params["observe"], targets_BxC, cfg.ce_chunk,
                                         repeat_ids_BxC=inputs_BxC)
    loss = ce_weight * ce + cfg.lb_coef * aux.lb
    if cfg.repeat_coef:
        loss = loss + cfg.repeat_coef * repeat
    return loss, (ce, aux.lb, aux.keep_rate.mean(), repeat, new_carry, h)
