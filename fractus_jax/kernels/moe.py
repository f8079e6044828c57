"""Phase-routed mixture of low-rank experts (docs/spec.md §3.3, §3.4).

Routing: the mean phase of a token's oscillators picks experts by von Mises gates around
each expert's fixed (Farey) phase; the top-k gates, renormalised, weight the experts.

Two ways to run the experts, tied together by the tests:
  * `moe_exact`: every expert on every token, combined with zero weight where not chosen.
    E/K times the useful work: the definition, kept to test against.
  * `moe_capacity`: the fast path. Each expert has `capacity` slots per group of T tokens;
    assignments fill them first choices of all tokens before second choices, tokens are
    gathered by index into a fixed (E, capacity, D) buffer (no one-hot dispatch einsum:
    its cost grows with T²), the four low-rank einsums run on the buffer,
    and outputs are gathered back. An assignment that finds its expert full contributes 0.

Expert factors (a dict): U1 (E,F,r), V1 (E,D,r), U2 (E,D,r), V2 (E,F,r), scale1, scale2
(E,1,1), b1 (E,F), b2 (E,D).
"""
from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax.kernels import mixed
from fractus_jax.kernels import plain

_GATE_FLOOR = 1e-10


def farey_phases(n_experts: int) -> np.ndarray:
    """Angles 2π·p/q of the Farey sequence of order 2E, spread over E experts (float64)."""
    n = 2 * n_experts
    # The standard next-term recurrence: a/b, c/d -> (k·c − a)/(k·d − b), k = ⌊(n+b)/d⌋.
    a, b, c, d = 0, 1, 1, n
    seq = [Fraction(0, 1)]
    while c <= n:
        seq.append(Fraction(c, d))
        k = (n + b) // d
        a, b, c, d = c, d, k * c - a, k * d - b
    m = len(seq)
    picks = [seq[min(i * m // n_experts, m - 1)] for i in range(n_experts)]
    return np.array([2.0 * math.pi * float(f) for f in picks], dtype=np.float64)


def mean_phase(psi, sin_cos=plain.sin_cos):
    """θ̄ = atan2(Σ sin ψ, Σ cos ψ) over the oscillator axis."""
    sin, cos = sin_cos(psi)
    return jnp.arctan2(sin.sum(-1), cos.sum(-1))


def gates(theta_bar, expert_phases, kappa_eff: float, sin_cos=plain.sin_cos):
    """Normalised von Mises gates (..., E); uniform where the sum is ≤ 1e-10."""
    g = jnp.exp(kappa_eff * sin_cos(theta_bar[..., None] - expert_phases)[1])
    total = g.sum(-1, keepdims=True)
    ok = total > _GATE_FLOOR
    uniform = jnp.full_like(g, 1.0 / g.shape[-1])
    return jnp.where(ok, g / jnp.where(ok, total, 1.0), uniform)


def top_k_route(g, top_k: int):
    """Top-k experts by gate and their weights renormalised to sum 1."""
    g_top, idx = jax.lax.top_k(g, top_k)
    total = g_top.sum(-1, keepdims=True)
    ok = total > _GATE_FLOOR
    w = jnp.where(ok, g_top / jnp.where(ok, total, 1.0), 1.0 / top_k)
    return idx, w


def load_balance(g):
    """E·Σ_e (P_e − 1/E)², P_e the mean gate over every token of g (..., E)."""
    return load_balance_of_means(g.reshape(-1, g.shape[-1]).mean(0))


def load_balance_of_means(P):
    """The load balance from the mean gates P (..., E): E·Σ_e (P_e − 1/E)² over the last axis."""
    n_experts = P.shape[-1]
    return n_experts * jnp.sum((P - 1.0 / n_experts) ** 2, -1)


def gelu_tanh(u):
    return 0.5 * u * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u ** 3)))


def rows_down(x_ExNxA, w_ExAxR, out_dtype=None):
    """x[e] · w[e]: each expert's rows onto its rank-r factor, (E, N, r), in the rows'
    dtype with float32 sums (kernels/mixed.py; the factor's gradient float32 too)."""
    return mixed.einsum("ena,ear->enr", x_ExNxA, w_ExAxR, x_ExNxA.dtype, out_dtype)


def rows_up(h_ExNxR, w_ExAxR, out_dtype=None):
    """h[e] · w[e]ᵀ: each expert's rank-r rows back up through its factor, (E, N, A)."""
    return mixed.einsum("enr,ear->ena", h_ExNxR, w_ExAxR, h_ExNxR.dtype, out_dtype)


def experts_apply(x_ExNxD, f):
    """Each expert e on its own rows x[e]: the four low-rank products (rows_down, rows_up).

    The scales multiply the (F, r) and (D, r) factors rather than the (rows, F) and
    (rows, D) products (equal up to rounding): a pass over the small factors instead of
    over every row, forward and backward (scale's gradient is then a sum over F·r, not
    over rows·F).
    """
    U1 = f["scale1"] * f["U1"]
    U2 = f["scale2"] * f["U2"]
    dt = x_ExNxD.dtype
    if dt == f["U1"].dtype:   # the factors in the rows' dtype (float32, float64): the plain products
        h = rows_down(x_ExNxD, f["V1"])
        u = gelu_tanh(rows_up(h, U1) + f["b1"][:, None, :])
        h = rows_down(u, f["V2"])
        return rows_up(h, U2) + f["b2"][:, None, :]
    # Rows in a low-precision dtype (bfloat16), factors float32: each product rounds its
    # operands to the rows' dtype and sums in float32; the biases and gelu run in float32,
    # so that every factor's gradient, biases included, is a float32 sum over the rows.
    acc = f["U1"].dtype
    h = rows_down(x_ExNxD, f["V1"])
    u = gelu_tanh(rows_up(h, U1, acc) + f["b1"][:, None, :]).astype(dt)
    h = rows_down(u, f["V2"])
    return (rows_up(h, U2, acc) + f["b2"][:, None, :]).astype(dt)


def moe_exact(x_TxD, idx_TxK, w_TxK, f):
    """Every expert on every token; the combine weight is zero where not chosen."""
    n_experts = f["b2"].shape[0]
    combine_TxE = jnp.einsum("tk,tke->te", w_TxK, jax.nn.one_hot(idx_TxK, n_experts, dtype=w_TxK.dtype))
    x_ExTxD = jnp.broadcast_to(x_TxD, (n_experts,) + x_TxD.shape)
    out_ExTxD = experts_apply(x_ExTxD, f)
    return jnp.einsum("te,etd->td", combine_TxE.astype(out_ExTxD.dtype), out_ExTxD)


def dropless_blocks(n_tokens: int, n_experts: int, top_k: int, block: int) -> int:
    """Blocks of `block` rows that hold every assignment of T tokens with each expert's
    rows padded to whole blocks: Σ_e ⌈c_e/b⌉ ≤ ⌊(T·K + E·(b − 1)) / b⌋ for any counts c_e."""
    return (n_tokens * top_k + n_experts * (block - 1)) // block


def _dropless_dispatch(idx_TxK, n_experts: int, block: int):
    """Slots of one group's assignments, each expert's rows in whole blocks of `block`:
    (slot_A, token_of_slot, expert_of_block), assignments token-major (t·K + k)."""
    n_tokens, top_k = idx_TxK.shape
    n_blocks = dropless_blocks(n_tokens, n_experts, top_k, block)
    expert_A = idx_TxK.reshape(-1)
    token_A = jnp.repeat(jnp.arange(n_tokens, dtype=jnp.int32), top_k)
    onehot_AxE = jax.nn.one_hot(expert_A, n_experts, dtype=jnp.int32)
    rank_A = jnp.sum(jnp.cumsum(onehot_AxE, axis=0) * onehot_AxE, axis=-1) - 1
    blocks_E = (onehot_AxE.sum(0) + block - 1) // block
    end_E = jnp.cumsum(blocks_E)                                      # in blocks
    slot_A = (end_E - blocks_E)[expert_A] * block + rank_A
    n_slots = n_blocks * block
    token_of_slot = jnp.full((n_slots,), n_tokens, jnp.int32).at[slot_A].set(token_A)
    # Blocks past the last expert's hold only empty slots; any expert serves them.
    expert_of_block = jnp.minimum(
        jnp.searchsorted(end_E, jnp.arange(n_blocks, dtype=end_E.dtype), side="right"), n_experts - 1)
    return slot_A, token_of_slot, expert_of_block


def moe_dropless(x_TxD, idx_TxK, w_TxK, f, block: int):
    """Every assignment to its expert, no capacity: y (T, D), or (G, T, D) per group.

    The assignments are laid out expert by expert, each expert's rows padded to whole
    blocks of `block` rows; every block takes its expert's factors (a gather of
    (blocks, A, r) weights) and the four low-rank products run block by block. Rows
    ≤ T·K + E·(b − 1) per group: the work of the chosen experts plus at most one partial
    block per expert. Empty slots read a zero row and are never read back, so their
    cotangent, and their share of every gradient, is zero.
    """
    if x_TxD.ndim == 2:
        return moe_dropless(x_TxD[None], idx_TxK[None], w_TxK[None], f, block)[0]
    n_groups, n_tokens, top_k = idx_TxK.shape
    n_experts, d_model = f["b2"].shape
    slot_A, token_of_slot, expert_of_block = jax.vmap(
        lambda i: _dropless_dispatch(i, n_experts, block))(idx_TxK)
    n_blocks = expert_of_block.shape[-1]
    x_pad = jnp.concatenate([x_TxD, jnp.zeros((n_groups, 1, d_model), x_TxD.dtype)], axis=1)
    x_NxbxD = jnp.take_along_axis(x_pad, token_of_slot[..., None], axis=1).reshape(
        n_groups * n_blocks, block, d_model)
    expert_N = expert_of_block.reshape(-1)
    f_N = {k: f[k][expert_N] for k in ("U1", "V1", "U2", "V2", "scale1", "scale2", "b1", "b2")}
    out = experts_apply(x_NxbxD, f_N).reshape(n_groups, n_blocks * block, d_model)
    out_GxTxKxD = jnp.take_along_axis(out, slot_A[..., None], axis=1).reshape(
        n_groups, n_tokens, top_k, d_model)
    return jnp.einsum("gtk,gtkd->gtd", w_TxK.astype(out.dtype), out_GxTxKxD)


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor) -> int:
    """ceil(cf·T·K/E), at most T (an expert cannot receive a token twice); None means T."""
    if capacity_factor is None:
        return n_tokens
    cap = math.ceil(capacity_factor * n_tokens * top_k / n_experts)
    return max(1, min(cap, n_tokens))


def _dispatch(idx_TxK, n_experts: int, capacity: int):
    """Slots of one group's assignments: (slot_A, token_of_slot, kept_A), fill order first
    choices of all tokens (token order) before second choices."""
    n_tokens, top_k = idx_TxK.shape
    expert_A = idx_TxK.T.reshape(-1)                                   # (K·T,)
    token_A = jnp.tile(jnp.arange(n_tokens, dtype=jnp.int32), top_k)
    onehot_AxE = jax.nn.one_hot(expert_A, n_experts, dtype=jnp.int32)
    slot_in_expert_A = jnp.sum(jnp.cumsum(onehot_AxE, axis=0) * onehot_AxE, axis=-1) - 1
    kept_A = slot_in_expert_A < capacity
    n_slots = n_experts * capacity
    # Dropped assignments all point at one extra dump slot, past the real ones; empty
    # slots read token index T, a zero row past the real tokens.
    slot_A = jnp.where(kept_A, expert_A * capacity + slot_in_expert_A, n_slots)
    token_of_slot = jnp.full((n_slots + 1,), n_tokens, jnp.int32).at[slot_A].set(token_A)[:n_slots]
    return slot_A, token_of_slot, kept_A


def moe_capacity(x_TxD, idx_TxK, w_TxK, f, capacity: int):
    """Index dispatch into (E, capacity, D); returns (y (T, D), kept (T, K) bool).

    Also takes a leading group axis, (G, T, ·): capacity is counted per group, and all
    groups' slots run through the experts as one (E, G·capacity, D) buffer, so the expert
    einsums keep the expert axis leading (a vmap over groups would put the group axis in
    front and cost a layout transpose per einsum in the backward).

    The gathers keep the group axis, which a multi-device mesh shards.
    """
    if x_TxD.ndim == 2:
        y, kept = moe_capacity(x_TxD[None], idx_TxK[None], w_TxK[None], f, capacity)
        return y[0], kept[0]
    n_groups, n_tokens, top_k = idx_TxK.shape
    n_experts, d_model = f["b2"].shape
    slot_A, token_of_slot, kept_A = jax.vmap(lambda i: _dispatch(i, n_experts, capacity))(idx_TxK)
    x_pad = jnp.concatenate([x_TxD, jnp.zeros((n_groups, 1, d_model), x_TxD.dtype)], axis=1)
    x_GxExCxD = jnp.take_along_axis(x_pad, token_of_slot[..., None], axis=1).reshape(
        n_groups, n_experts, capacity, d_model)
    x_ExNxD = x_GxExCxD.transpose(1, 0, 2, 3).reshape(n_experts, n_groups * capacity, d_model)
    out = experts_apply(x_ExNxD, f).reshape(n_experts, n_groups, capacity, d_model)
    out = out.transpose(1, 0, 2, 3).reshape(n_groups, n_experts * capacity, d_model)
    out_pad = jnp.concatenate([out, jnp.zeros((n_groups, 1, d_model), out.dtype)], axis=1)
    out_GxKTxD = jnp.take_along_axis(out_pad, slot_A[..., None], axis=1)
    out_GxKxTxD = out_GxKTxD.reshape(n_groups, top_k, n_tokens, d_model)
    kept_GxKxT = kept_A.reshape(n_groups, top_k, n_tokens)
    weight = jnp.where(kept_GxKxT, w_TxK.transpose(0, 2, 1), 0.0).astype(out.dtype)
    y_GxTxD = jnp.einsum("gkt,gktd->gtd", weight, out_GxKxTxD)
    return y_GxTxD, kept_GxKxT.transpose(0, 2, 1)
