"""Next-id cross-entropy against a tied output matrix, by blocks of positions.

The (B, C, V) logits are never held whole: each block of rows computes its logits,
log-sum-exp and target logit under `jax.checkpoint`, so the backward recomputes one
block's logits at a time instead of storing them all. For V = 50257 at B·C = 2048 that
is 400 MB of float32 not kept per step. Sampling from those logits (scheduled sampling)
walks the same blocks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fractus_jax.dtypes import accum_dtype

CE_BLOCK = 1024  # positions per block by default (TrainConfig.ce_chunk, held-out scoring)


def _block_terms(h_NxD, W_VxD, targets_N, weight_N, repeat_N):
    logits = jnp.einsum("nd,vd->nv", h_NxD, W_VxD.astype(h_NxD.dtype)).astype(accum_dtype(h_NxD.dtype))
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_N[:, None], axis=-1)[:, 0]
    # Probability given to repeating the current input id: the anti-repeat term.
    repeat_logit = jnp.take_along_axis(logits, repeat_N[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - target_logit) * weight_N), jnp.sum(jnp.exp(repeat_logit - lse) * weight_N)


def _blocks(n: int, chunk: int):
    chunk = max(1, min(chunk, n))
    n_blocks = -(-n // chunk)
    return chunk, n_blocks, n_blocks * chunk - n


def cross_entropy_terms(h_BxCxD, W_VxD, targets_BxC, chunk: int = CE_BLOCK, weights_BxC=None,
                        repeat_ids_BxC=None):
    """(mean CE, mean probability of repeating repeat_ids) of softmax(h·Wᵀ), weighted means."""
    d_model = h_BxCxD.shape[-1]
    h = h_BxCxD.reshape(-1, d_model)
    t = targets_BxC.reshape(-1).astype(jnp.int32)
    rep = t if repeat_ids_BxC is None else repeat_ids_BxC.reshape(-1).astype(jnp.int32)
    acc = accum_dtype(h.dtype)
    w = jnp.ones(t.shape, acc) if weights_BxC is None else weights_BxC.reshape(-1).astype(acc)
    chunk, n_blocks, pad = _blocks(h.shape[0], chunk)
    if pad:  # padded rows weigh nothing
        h = jnp.pad(h, ((0, pad), (0, 0)))
        t, rep, w = (jnp.pad(a, (0, pad)) for a in (t, rep, w))
    block_fn = jax.checkpoint(_block_terms)

    def body(totals, xs):
        ce, rp = block_fn(xs[0], W_VxD, *xs[1:])
        return (totals[0] + ce, totals[1] + rp), None

    xs = (h.reshape(n_blocks, chunk, d_model), t.reshape(n_blocks, chunk), w.reshape(n_blocks, chunk),
          rep.reshape(n_blocks, chunk))
    (ce, rp), _ = jax.lax.scan(body, (jnp.zeros((), acc), jnp.zeros((), acc)), xs)
    denom = jnp.maximum(w.sum(), 1.0)
    return ce / denom, rp / denom


def chunked_cross_entropy(h_BxCxD, W_VxD, targets_BxC, chunk: int = CE_BLOCK, weights_BxC=None):
    """Mean (or weighted mean) cross-entropy of softmax(h·Wᵀ) against targets."""
    return cross_entropy_terms(h_BxCxD, W_VxD, targets_BxC, chunk, weights_BxC)[0]


def sample_from_hidden(h_BxCxD, W_VxD, key, temperature: float, chunk: int = CE_BLOCK):
    """One id per position from softmax(h·Wᵀ / temperature) (Gumbel-max), block by block."""
    B, C, d_model = h_BxCxD.shape
    h = jax.lax.stop_gradient(h_BxCxD).reshape(-1, d_model)
    chunk, n_blocks, pad = _blocks(h.shape[0], chunk)
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(n_blocks, chunk, d_model)
    W = jax.lax.stop_gradient(W_VxD)

    def body(_, xs):
        i, h_b = xs
        logits = jnp.einsum("nd,vd->nv", h_b, W.astype(h_b.dtype)).astype(jnp.float32)
        gumbel = jax.random.gumbel(jax.random.fold_in(key, i), logits.shape, jnp.float32)
        return None, jnp.argmax(logits / temperature + gumbel, axis=-1).astype(jnp.int32)

    _, ids = jax.lax.scan(body, None, (jnp.arange(n_blocks), h))
    return ids.reshape(-1)[: B * C].reshape(B, C)
