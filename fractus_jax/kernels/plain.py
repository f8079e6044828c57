"""The engine's kernels in their plain forms: the math as docs/spec.md writes it,
differentiated by autodiff. This is what a GPU or TPU runs; kernels/cpu.py holds the same
functions in forms XLA:CPU runs faster, and kernels/select.py picks one set per forward.

Shapes: B rows, C positions, D = H·dH features, L attention levels (the feature-map
offsets ω_l).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fractus_jax.kernels import attention as attn_k
from fractus_jax.kernels import mixed


def sin_cos(x):
    """(sin x, cos x)."""
    return jnp.sin(x), jnp.cos(x)


def normalized(x, eps):
    """(x − mean) · rstd over the last axis, and rstd."""
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = jax.lax.rsqrt(jnp.square(xc).mean(-1, keepdims=True) + eps)
    return xc * rstd, rstd


def layer_norm(x, p, eps):
    """LayerNorm over the last axis with p = {"weight", "bias"}."""
    xhat, _ = normalized(x, eps)
    return xhat * p["weight"] + p["bias"]


def heads(t_BxCxD, n_heads):
    """(B, C, D) → (B, H, C, dH)."""
    B, C, D = t_BxCxD.shape
    return t_BxCxD.reshape(B, C, n_heads, D // n_heads).transpose(0, 2, 1, 3)


def project_qkv(x_BxCxD, w_Dx3xD, b_3xD, mm_dtype):
    """x·[W_q W_k W_v] + b as one (D, 3D) matmul in `mm_dtype` with float32 sums: (B, C, 3D)."""
    B, C, D = x_BxCxD.shape
    w = w_Dx3xD.reshape(D, 3 * D)
    if jnp.dtype(mm_dtype) == w.dtype:
        return (x_BxCxD.astype(mm_dtype) @ w).astype(x_BxCxD.dtype) + b_3xD.reshape(3 * D)
    return mixed.einsum("bcd,de->bce", x_BxCxD, w, mm_dtype, x_BxCxD.dtype) + b_3xD.reshape(3 * D)


def qkv_heads(x_BxCxD, w_Dx3xD, b_3xD, n_heads, mm_dtype):
    """q, k, v (B, H, C, dH): the projection split into heads."""
    qkv = project_qkv(x_BxCxD, w_Dx3xD, b_3xD, mm_dtype)
    D = x_BxCxD.shape[-1]
    return tuple(heads(qkv[..., j * D:(j + 1) * D], n_heads) for j in range(3))


def qkv_features(x_BxCxD, w_Dx3xD, b_3xD, omega_L, n_heads, mm_dtype):
    """(qf, kf, v): the feature maps elu1(q + ω_l), elu1(k + ω_l) of every level,
    (L, B, H, C, dH), and v (B, H, C, dH)."""
    q, k, v = qkv_heads(x_BxCxD, w_Dx3xD, b_3xD, n_heads, mm_dtype)
    omega = omega_L[:, None, None, None, None]
    return attn_k.elu1(q + omega), attn_k.elu1(k + omega), v


def linear_attention(qf, kf, v, S0, z0, reset, block_size, decay=None):
    """The chunkwise causal linear attention with a carried (S, z) (kernels/attention.py)."""
    return attn_k.linear_attention(qf, kf, v, S0, z0, reset, block_size=block_size, decay=decay)


def level_decay(decay_L, dtype, level=None):
    """decay_L ((L,) or (L, H)) as the decay of the kernel's leading axes: (L, 1, H) for
    every level's (L, B, H) slices, or level `level`'s (1, H) for its (B, H) slices."""
    if decay_L is None:
        return None
    if level is not None and isinstance(decay_L, tuple):
        return decay_L[level]            # the config's constant γ_l
    d = jnp.asarray(decay_L, dtype)
    if level is not None:
        d = d[level]
        return d[None] if d.ndim == 1 else d
    return d[:, None] if d.ndim == 2 else d


def level_attention(qf, kf, v, S_BxHxdxd, z_BxHxd, reset_BxC, mix_L, block_size, linear_attention, decay_L=None):
    """Σ_l mix_l · attention of level l, and the levels' mean new (S, z). qf and kf hold
    the levels on their first axis (an array, or a sequence of arrays); every level reads
    the same v and the same carried state. decay_L: the carry decay, None, γ_l per level
    (L,) or per level and head (L, H)."""
    qf, kf = jnp.stack(qf), jnp.stack(kf)
    y, S_L, z_L = linear_attention(qf, kf, jnp.broadcast_to(v, qf.shape), S_BxHxdxd, z_BxHxd,
                                   reset_BxC[:, None, :], block_size, decay=level_decay(decay_L, S_BxHxdxd.dtype))
    return jnp.einsum("l,lbhcd->bhcd", mix_L, y), S_L.mean(0), z_L.mean(0)

