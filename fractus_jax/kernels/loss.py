"""Next-id cross-entropy against a tied output matrix, by blocks of positions.

The (B, C, V) logits are never held whole: each block of rows computes its logits,
log-sum-exp and target logit under `jax.checkpoint`, so the backward recomputes one
block's logits at a time instead of storing them all. For V = 50257 at B·C = 2048 that
is 400 MB of float32 not kept per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _block_ce_sum(h_NxD, W_VxD, targets_N, weight_N):
    acc_dtype = jnp.float64 if h_NxD.dtype == jnp.float64 else jnp.float32
    logits = jnp.einsum("nd,vd->nv", h_NxD, W_VxD.astype(h_NxD.dtype)).astype(acc_dtype)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_N[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - target_logit) * weight_N)


def chunked_cross_entropy(h_BxCxD, W_VxD, targets_BxC, chunk: int = 1024, weights_BxC=None):
    """Mean (or weighted mean) cross-entropy of softmax(h·Wᵀ) against targets."""
    d_model = h_BxCxD.shape[-1]
    h = h_BxCxD.reshape(-1, d_model)
    t = targets_BxC.reshape(-1).astype(jnp.int32)
    w = (jnp.ones(t.shape, jnp.float32) if weights_BxC is None
         else weights_BxC.reshape(-1).astype(jnp.float32))
    if h.dtype == jnp.float64:
        w = w.astype(jnp.float64)
    n = h.shape[0]
    chunk = max(1, min(chunk, n))
    n_blocks = -(-n // chunk)
    pad = n_blocks * chunk - n
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        t = jnp.pad(t, (0, pad))
        w = jnp.pad(w, (0, pad))  # padded rows weigh nothing
    block_fn = jax.checkpoint(_block_ce_sum)

    def body(total, xs):
        h_b, t_b, w_b = xs
        return total + block_fn(h_b, W_VxD, t_b, w_b), None

    xs = (h.reshape(n_blocks, chunk, d_model), t.reshape(n_blocks, chunk), w.reshape(n_blocks, chunk))
    total, _ = jax.lax.scan(body, jnp.zeros((), w.dtype), xs)
    return total / jnp.maximum(w.sum(), 1.0)
