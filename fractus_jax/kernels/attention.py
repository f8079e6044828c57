"""Causal linear attention with a carried state (S, z) and per-row document resets.

Both kernels take already feature-mapped queries and keys (strictly positive), values,
the carry entering the chunk and a reset mask, over any leading batch axes `...`:

    qf, kf, v : (..., C, dH)     S0 : (..., dH, dH)     z0 : (..., dH)     reset : (..., C)

and return the outputs (..., C, dH) with the state after the last position. A reset at t
means the state entering t is zero. The recurrence (docs/spec.md §3.1 step 4) is inclusive:

    S_t = γ·[not reset_t]·S_{t-1} + kf_t ⊗ v_t,   z_t likewise,   y_t = qf_t·S_t / (qf_t·z_t)

γ is the carry's decay (EngineConfig.carry_decay): absent, γ = 1 and the state is the
parent's running sum; given, one γ in (0, 1] per batch slice (the engine passes one per level).

`linear_attention_reference` is that recurrence written as a scan over positions: the
executable definition, kept to test against. `linear_attention` is the fast form used by the
engine: positions are cut into blocks of c; inside a block the causal, same-segment
interactions are one masked (c×c) product, weighted γ^(j−i) under decay; each block's own
contribution to the state (ΔS = Σ γ^(e−i) k vᵀ over its last segment, e the block's last
position) is one product, and the state entering every block comes from a
`lax.associative_scan` over blocks with the gate γ^c·[no reset in the block]. Everything is batched over the
blocks (no sequential loop in the forward or the backward). It holds one dH×dH state per
block, C/c of them, never one per position as the reference's backward does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax.dtypes import accum_dtype

_DEN_FLOOR = 1e-10  # below this |den| the output is defined as 0 (docs/spec.md §3.1)
_DEN_EPS = 1e-20


def _safe_divide(num, den):
    ok = jnp.abs(den) > _DEN_FLOOR
    # Double where: the masked branch must not produce inf/nan gradients.
    den_safe = jnp.where(ok, den + _DEN_EPS, 1.0)
    return jnp.where(ok[..., None], num / den_safe[..., None], 0.0)


_state_dtype = accum_dtype


def _log_decay(decay, batch, dt):
    """log γ with one axis per batch axis (γ given for the leading ones, broadcast over the
    rest), or None without decay."""
    if decay is None:
        return None
    lg = jnp.log(jnp.asarray(decay, dt))
    nb = len(batch)
    if lg.ndim > nb:
        raise ValueError(f"decay {lg.shape} has more axes than the batch axes {tuple(batch)}")
    lg = lg.reshape(lg.shape + (1,) * (nb - lg.ndim))
    if np.broadcast_shapes(lg.shape, tuple(batch)) != tuple(batch):
        raise ValueError(f"decay {lg.shape} does not broadcast to the batch axes {tuple(batch)}")
    return lg


def linear_attention_reference(qf, kf, v, S0, z0, reset, decay=None):
    """Scan over positions: the recurrence exactly as written (float32 or float64)."""
    dt = _state_dtype(qf.dtype)
    qf, kf, v = (a.astype(dt) for a in (qf, kf, v))
    S0, z0 = S0.astype(dt), z0.astype(dt)
    lg = _log_decay(decay, qf.shape[:-2], dt)
    gamma = 1.0 if lg is None else jnp.exp(lg)

    def step(carry, xs):
        S, z = carry
        q_t, k_t, v_t, r_t = xs
        keep = (~r_t).astype(dt) * gamma
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


def _combine_blocks(earlier, later):
    """The associative operator of block states: (g1, S1, z1)∘(g2, S2, z2) =
    (g1·g2, g2·S1 + S2, g2·z1 + z2), g ∈ {0, 1} the gate "no reset in this block"."""
    g1, S1, z1 = earlier
    g2, S2, z2 = later
    return g1 * g2, g2 * S1 + S2, g2[..., 0] * z1 + z2


def linear_attention(qf, kf, v, S0, z0, reset, block_size: int = 64, one_block_axis: bool = True, decay=None):
    """Chunkwise form: masked products inside blocks, block states combined by a scan.
    one_block_axis=False: a chunk of one block gets no block axis (kernels/cpu.py's form).
    decay: γ for the leading batch axes (broadcast over the rest), or None (γ = 1, the
    parent's running sum, computed without any decay factor)."""
    dt = _state_dtype(qf.dtype)
    qf, kf, v = (a.astype(dt) for a in (qf, kf, v))
    *batch, C, dH = qf.shape
    nb = len(batch)
    S0 = jnp.broadcast_to(S0.astype(dt), (*batch, dH, dH))
    z0 = jnp.broadcast_to(z0.astype(dt), (*batch, dH))
    reset = jnp.asarray(reset)
    if np.broadcast_shapes(reset.shape, (*batch, C)) != (*batch, C):
        raise ValueError(f"reset {reset.shape} does not broadcast to {(*batch, C)}")
    # The masks stay at the reset's own shape (the engine passes one row of resets for every
    # level and head): they broadcast into the products instead of being built per head.
    reset = reset.reshape((1,) * (nb + 1 - reset.ndim) + reset.shape)
    c = min(block_size, C)
    n_blocks = -(-C // c)
    pad = n_blocks * c - C
    if pad:
        # Padded positions come after every real one, so causality keeps them out of the
        # real outputs; padding kf with zeros keeps them out of the final state.
        widths = [(0, 0)] * nb + [(0, pad), (0, 0)]
        qf, kf, v = (jnp.pad(a, widths) for a in (qf, kf, v))
        reset = jnp.pad(reset, [(0, 0)] * nb + [(0, pad)])

    # Blocks are an axis before the positions: a reshape, no transpose. The CPU form gives
    # one block no block axis (XLA:CPU chose slow layouts around a size-1 axis there).
    blocked = n_blocks > 1 or one_block_axis
    q, k = qf, kf
    if blocked:
        q, k, v = (a.reshape(*batch, n_blocks, c, dH) for a in (q, k, v))
        reset = reset.reshape(*reset.shape[:-1], n_blocks, c)
    seg = jnp.cumsum(reset.astype(jnp.int32), axis=-1)                    # (..., [n,] c)
    # Inside a block, i contributes to j when i <= j and no reset lies in (i, j].
    causal = jnp.tril(jnp.ones((c, c), bool))
    mask = ((seg[..., :, None] == seg[..., None, :]) & causal).astype(dt)   # (..., [n,] c_j, c_i)
    # from_carry: no reset in [block start, j], so the state entering the block reaches j;
    # in_last_seg: positions whose k, v survive to the block's end.
    from_carry = (seg == 0).astype(dt)
    in_last_seg = (seg == seg[..., -1:]).astype(dt)
    block_gate = from_carry[..., -1]                                    # (..., [n]) no reset in the block
    lg = _log_decay(decay, batch, dt)
    if lg is not None:
        # Under decay each term is weighted by γ to the number of steps it crosses: i → j
        # inside a block γ^(j−i); the state entering the block to j γ^(j+1); i to its block's
        # last real position e γ^(e−i); the block's gate γ^(e+1). The last block's e stops at
        # the chunk's last real position (padding must not decay the final state).
        pos = np.arange(c)
        ends = np.full(n_blocks, c - 1)
        ends[-1] = C - 1 - (n_blocks - 1) * c
        lag = np.maximum(pos[:, None] - pos[None, :], 0)                   # (c_j, c_i)
        to_end = ends[:, None] - pos[None, :]                               # (n, c_i)
        if not blocked:
            to_end, ends = to_end[0], ends[0]
        else:
            lag, pos = lag[None], pos[None]

        def decay_pow(n):
            return jnp.exp(lg.reshape(lg.shape + (1,) * np.ndim(n)) * n)

        mask = mask * decay_pow(lag)
        from_carry = from_carry * decay_pow(pos + 1)
        in_last_seg = in_last_seg * decay_pow(np.maximum(to_end, 0)) * (to_end >= 0)
        block_gate = block_gate * decay_pow(ends + 1)

    scores = jnp.einsum("...jd,...id->...ji", q, k) * mask
    num = jnp.einsum("...ji,...ie->...je", scores, v)
    den = scores.sum(-1)

    # What each block adds to a zero state, then the state after each block by the recurrence
    # S_b = g_b·S_{b-1} + ΔS_b (g_b = 0 when block b holds a reset), as an associative scan.
    k_last = k * in_last_seg[..., None]
    gate = block_gate[..., None, None]                                  # (..., [n,] 1, 1)
    if blocked:
        # The states entering blocks 1..n-1 need the ΔS of blocks 0..n-2 only; the last
        # block's ΔS reaches the final state alone. Kept apart, it drops out of the backward
        # when the final state gets no gradient (the engine detaches its carry), instead of
        # being differentiated with a zero cotangent.
        if n_blocks > 1:
            head = (Ellipsis, slice(None, -1), slice(None), slice(None))
            dS = jnp.einsum("...id,...ie->...de", k_last[head], v[head])   # (..., n-1, dH, dH)
            dz = k_last[head].sum(-2)                                      # (..., n-1, dH)
            g, S_zero, z_zero = jax.lax.associative_scan(
                _combine_blocks, (gate[..., :-1, :, :], dS, dz), axis=nb)
            S_enter = S_zero + g * S0[..., None, :, :]                    # entering blocks 1..n-1
            z_enter = z_zero + g[..., 0] * z0[..., None, :]
            S_in = jnp.concatenate([S0[..., None, :, :], S_enter], axis=nb)
            z_in = jnp.concatenate([z0[..., None, :], z_enter], axis=nb)
            S_last, z_last = S_enter[..., -1, :, :], z_enter[..., -1, :]   # entering the last block
        else:
            S_in, z_in = S0[..., None, :, :], z0[..., None, :]
            S_last, z_last = S0, z0
        k_end, v_end, g_end = k_last[..., -1, :, :], v[..., -1, :, :], gate[..., -1, :, :]
        S_out = jnp.einsum("...id,...ie->...de", k_end, v_end) + g_end * S_last
        z_out = k_end.sum(-2) + g_end[..., 0] * z_last
    else:
        S_in, z_in = S0, z0
        S_out = jnp.einsum("...id,...ie->...de", k_last, v) + gate * S0
        z_out = k_last.sum(-2) + gate[..., 0] * z0

    num = num + from_carry[..., None] * jnp.einsum("...jd,...de->...je", q, S_in)
    den = den + from_carry * jnp.einsum("...jd,...d->...j", q, z_in)
    y = _safe_divide(num, den).reshape(*batch, n_blocks * c, dH)
    return y[..., :C, :], S_out, z_out


def elu1(u):
    """ELU(α=1) plus one: strictly positive, the feature map of docs/spec.md §3.1.

    Branchless: max(u, 0) + exp(min(u, 0)) is u + 1 above 0 and exp(u) below, and its
    derivative at 0 is ½ + ½·1 = 1 (JAX splits ties), as ELU's.
    """
    return jnp.maximum(u, 0.0) + jnp.exp(jnp.minimum(u, 0.0))
