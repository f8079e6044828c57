"""The engine's kernels in forms tuned for XLA:CPU: each computes its plain form's function
(kernels/plain.py, same signature) in a way XLA:CPU runs faster. Each is tested against
its plain form in float64, values and gradients (tests/test_kernels.py), and measured
against it in docs/performance.md ("CPU-tuned forms").

    sin_cos          one reduction and two polynomials in multiply-adds (kernels/trig.py)
    layer_norm       the textbook backward written out
    qkv_features     projection, heads and feature maps with their backward written out;
                     the levels as a tuple, not a stacked axis
    linear_attention a chunk of one block gets no block axis
    level_attention  one attention call per level: no stacked copies of v and the carry
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fractus_jax.kernels import attention as attn_k
from fractus_jax.kernels import plain
from fractus_jax.kernels import trig

sin_cos = trig.sincos


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def layer_norm(x, p, eps):
    """plain.layer_norm with its backward written out (custom_vjp, reverse mode only): it
    kept XLA:CPU from fusing each layer's residual gradient into its neighbours' and
    recomputing it there."""
    return plain.layer_norm(x, p, eps)


def _layer_norm_fwd(x, p, eps):
    xhat, rstd = plain.normalized(x, eps)
    return xhat * p["weight"] + p["bias"], (xhat, rstd, p["weight"])


def _layer_norm_bwd(eps, residuals, dy):
    xhat, rstd, weight = residuals
    g = dy * weight
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(dy.ndim - 1))
    return dx, {"weight": (dy * xhat).sum(rows), "bias": dy.sum(rows)}


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def features_by_level(x_BxCxD, w_Dx3xD, b_3xD, omega_L, n_heads, mm_dtype):
    """((qf_l), (kf_l), v): plain.qkv_features with the levels as tuples."""
    q, k, v = plain.qkv_heads(x_BxCxD, w_Dx3xD, b_3xD, n_heads, mm_dtype)
    levels = range(omega_L.shape[0])
    return (tuple(attn_k.elu1(q + omega_L[l]) for l in levels),
            tuple(attn_k.elu1(k + omega_L[l]) for l in levels), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def qkv_features(x_BxCxD, w_Dx3xD, b_3xD, omega_L, n_heads, mm_dtype):
    """`features_by_level` with its backward written out (custom_vjp): autodiff's form let
    XLA:CPU fuse the levels' gradients, the elu1 derivative (max/min with their tie rule,
    recomputed from qkv), the heads transposes and the pads of the three slices into one
    large loop per layer. Here the feature derivative is read off the saved output,
    elu1'(u) = min(elu1(u), 1), and the three gradients are concatenated, not padded and
    added. ω gets no gradient: level_offsets is a buffer."""
    return features_by_level(x_BxCxD, w_Dx3xD, b_3xD, omega_L, n_heads, mm_dtype)


def _qkv_features_fwd(x_BxCxD, w_Dx3xD, b_3xD, omega_L, n_heads, mm_dtype):
    out = features_by_level(x_BxCxD, w_Dx3xD, b_3xD, omega_L, n_heads, mm_dtype)
    qf, kf, _ = out
    return out, (x_BxCxD, w_Dx3xD, b_3xD, qf, kf, omega_L)


def _qkv_features_bwd(n_heads, mm_dtype, residuals, cotangents):
    x_BxCxD, w_Dx3xD, b_3xD, qf, kf, omega_L = residuals
    dqf, dkf, dv = cotangents
    B, C, D = x_BxCxD.shape
    dq = sum(d * jnp.minimum(f, 1.0) for d, f in zip(dqf, qf))
    dk = sum(d * jnp.minimum(f, 1.0) for d, f in zip(dkf, kf))
    # One stack-and-transpose out of the heads layout: XLA fuses it (with the feature
    # derivatives) into one loop, where three transposes and a concatenation were four.
    d_BxCx3D = jnp.stack([dq, dk, dv], 2).transpose(0, 3, 2, 1, 4).reshape(B, C, 3 * D)
    d_mm = d_BxCx3D.astype(mm_dtype)
    w = w_Dx3xD.reshape(D, 3 * D).astype(mm_dtype)
    dx = (d_mm @ w.T).astype(x_BxCxD.dtype)
    # float32 sums (and float32 partial sums across devices) for the weight's gradient
    dw = jnp.einsum("bcd,bce->de", x_BxCxD.astype(mm_dtype), d_mm,
                    preferred_element_type=jnp.promote_types(mm_dtype, jnp.float32)).astype(w_Dx3xD.dtype)
    db = d_BxCx3D.sum((0, 1)).reshape(3, D)
    return dx, dw.reshape(D, 3, D), db.astype(b_3xD.dtype), jnp.zeros_like(omega_L)


qkv_features.defvjp(_qkv_features_fwd, _qkv_features_bwd)


def linear_attention(qf, kf, v, S0, z0, reset, block_size, decay=None):
    """plain.linear_attention, a chunk of one block without a block axis (XLA:CPU chose
    slow layouts around a size-1 axis)."""
    return attn_k.linear_attention(qf, kf, v, S0, z0, reset, block_size=block_size, one_block_axis=False,
                                   decay=decay)


def level_attention(qf, kf, v, S_BxHxdxd, z_BxHxd, reset_BxC, mix_L, block_size, linear_attention, decay_L=None):
    """plain.level_attention as one kernel call per level: no stacked copies of v and the
    carry, and the carry's level mean a sum of slices, not a reduction over a level axis."""
    n_levels = len(qf)
    a, S_sum, z_sum = 0.0, 0.0, 0.0
    for l in range(n_levels):
        y, S_l, z_l = linear_attention(qf[l], kf[l], v, S_BxHxdxd, z_BxHxd, reset_BxC[:, None, :], block_size,
                                       decay=plain.level_decay(decay_L, S_BxHxdxd.dtype, l))
        a, S_sum, z_sum = a + mix_L[l] * y, S_sum + S_l, z_sum + z_l
    return a, S_sum / n_levels, z_sum / n_levels

