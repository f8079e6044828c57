"""Causal linear attention with a carried state (S, z) and per-row document resets.

Both kernels take already feature-mapped queries and keys (strictly positive), values,
the carry entering the chunk and a reset mask, over any leading batch axes `...`:

    qf, kf, v : (..., C, dH)     S0 : (..., dH, dH)     z0 : (..., dH)     reset : (..., C)

and return the outputs (..., C, dH) with the state after the last position. A reset at t
means the state entering t is zero. The recurrence (SPEC §3.1 step 4) is inclusive:

    S_t = [not reset_t]·S_{t-1} + kf_t ⊗ v_t,   z_t likewise,   y_t = qf_t·S_t / (qf_t·z_t)

`linear_attention_reference` is that recurrence written as a scan over positions: the
executable definition, kept to test against. `linear_attention` is the fast form used by the
engine: positions are cut into blocks; inside a block the causal, same-segment interactions
are one masked (c×c) product, and the state is carried from block to block by a `lax.scan`.
It never holds more than one dH×dH state per block (memory flat in C), unlike the reference,
whose backward keeps one per position.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_DEN_FLOOR = 1e-10  # below this |den| the output is defined as 0 (SPEC §3.1)
_DEN_EPS = 1e-20


def _safe_divide(num, den):
    ok = jnp.abs(den) > _DEN_FLOOR
    # Double where: the masked branch must not produce inf/nan gradients.
    den_safe = jnp.where(ok, den + _DEN_EPS, 1.0)
    return jnp.where(ok[..., None], num / den_safe[..., None], 0.0)


def _state_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def linear_attention_reference(qf, kf, v, S0, z0, reset):
    """Scan over positions: the recurrence exactly as written (float32 or float64)."""
    dt = _state_dtype(qf.dtype)
    qf, kf, v = (a.astype(dt) for a in (qf, kf, v))
    S0, z0 = S0.astype(dt), z0.astype(dt)

    def step(carry, xs):
        S, z = carry
        q_t, k_t, v_t, r_t = xs
        keep = (~r_t).astype(dt)
        S = keep[..., None, None] * S + k_t[..., :, None] * v_t[..., None, :]
        z = keep[..., None] * z + k_t
        num = jnp.einsum("...d,...de->...e", q_t, S)
        den = jnp.einsum("...d,...d->...", q_t, z)
        return (S, z), _safe_divide(num, den)

    # positions to the front for the scan
    xs = (jnp.moveaxis(qf, -2, 0), jnp.moveaxis(kf, -2, 0), jnp.moveaxis(v, -2, 0),
          jnp.moveaxis(reset, -1, 0))
    (S, z), y = jax.lax.scan(step, (S0, z0), xs)
    return jnp.moveaxis(y, 0, -2), S, z


def linear_attention(qf, kf, v, S0, z0, reset, block_size: int = 64):
    """Chunkwise form: masked products inside blocks, block states carried by a scan."""
    dt = _state_dtype(qf.dtype)
    qf, kf, v = (a.astype(dt) for a in (qf, kf, v))
    S0, z0 = S0.astype(dt), z0.astype(dt)
    reset = jnp.broadcast_to(reset, qf.shape[:-1])
    *batch, C, dH = qf.shape
    c = min(block_size, C)
    n_blocks = -(-C // c)
    pad = n_blocks * c - C
    if pad:
        # Padded positions come after every real one, so causality keeps them out of the
        # real outputs; padding kf with zeros keeps them out of the final state.
        widths = [(0, 0)] * len(batch) + [(0, pad), (0, 0)]
        qf, kf, v = (jnp.pad(a, widths) for a in (qf, kf, v))
        reset = jnp.pad(reset, [(0, 0)] * len(batch) + [(0, pad)])

    def to_blocks(a, trailing):
        a = a.reshape(*batch, n_blocks, c, *trailing)
        return jnp.moveaxis(a, len(batch), 0)

    q_blocks = to_blocks(qf, (dH,))
    k_blocks = to_blocks(kf, (dH,))
    v_blocks = to_blocks(v, (dH,))
    r_blocks = to_blocks(reset, ())

    causal = jnp.tril(jnp.ones((c, c), bool))

    def block_step(carry, xs):
        S, z = carry
        q_c, k_c, v_c, r_c = xs
        seg = jnp.cumsum(r_c.astype(jnp.int32), axis=-1)            # (..., c)
        # i contributes to j when i <= j and no reset lies in (i, j].
        same_seg = seg[..., :, None] == seg[..., None, :]            # (..., c_j, c_i)
        mask = (same_seg & causal).astype(dt)
        from_carry = (seg == 0).astype(dt)                            # no reset in [0, j]
        scores = jnp.einsum("...jd,...id->...ji", q_c, k_c) * mask
        num = jnp.einsum("...ji,...ie->...je", scores, v_c)
        num = num + from_carry[..., None] * jnp.einsum("...jd,...de->...je", q_c, S)
        den = scores.sum(-1) + from_carry * jnp.einsum("...jd,...d->...j", q_c, z)
        y = _safe_divide(num, den)
        # State after the block: the carry survives only without a reset in the block;
        # of the block's own positions, only the last segment's survive.
        in_last_seg = (seg == seg[..., -1:]).astype(dt)               # (..., c)
        k_last = k_c * in_last_seg[..., None]
        S_new = from_carry[..., -1, None, None] * S + jnp.einsum("...id,...ie->...de", k_last, v_c)
        z_new = from_carry[..., -1, None] * z + k_last.sum(-2)
        return (S_new, z_new), y

    (S, z), y = jax.lax.scan(block_step, (S0, z0), (q_blocks, k_blocks, v_blocks, r_blocks))
    y = jnp.moveaxis(y, 0, len(batch)).reshape(*batch, n_blocks * c, dH)
    return y[..., :C, :], S, z


def elu1(u):
    """ELU(α=1) plus one: strictly positive, the feature map of SPEC §3.1."""
    return jnp.where(u > 0, u + 1.0, jnp.exp(jnp.minimum(u, 0.0)))
