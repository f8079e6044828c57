"""The Fractus engine: parameters, carried state and the chunk forward (docs/spec.md §2-4).

Parameters are a nested dict whose leaves mirror the PyTorch state-dict names
(fractus_jax/convert/names.py declares the map); the blocks' tensors are stacked along a
leading layer axis so the layers run as one `lax.scan` (compile time flat in depth).
Two leaves are buffers, not trainable: `level_offsets` and `expert_phases`; the forward
stops their gradient and `trainable_mask` tells the optimizer to leave them alone.

The carried state is a dict of float32 (float64 with float64 params) arrays:
    thought (B, D), S (layers, B, H, dH, dH), z (layers, B, H, dH), phase (layers, B, N).
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax.atom import ids as atom_ids
from fractus_jax.config import EngineConfig
from fractus_jax.dtypes import accum_dtype
from fractus_jax.kernels import attention as attn_k
from fractus_jax.kernels import kuramoto as kur_k
from fractus_jax.kernels import mixed
from fractus_jax.kernels import moe as moe_k
from fractus_jax.kernels import select

BOUNDARY_IDS = (atom_ids.BOUNDARY_FIRST, atom_ids.BOUNDARY_LAST)  # atom features enter at boundary ids, inclusive range (docs/spec.md §5)
BUFFER_NAMES = ("level_offsets", "expert_phases")
GOLDEN = (1.0 + math.sqrt(5.0)) / 2.0

Params = dict[str, Any]
State = dict[str, jax.Array]


class Aux(NamedTuple):
    """What a forward knows besides its output, per layer where it has a layer axis."""
    lb: jax.Array              # scalar, the sum over layers
    lb_per_layer: jax.Array    # (layers,)
    keep_rate: jax.Array       # (layers,) kept assignments / (tokens · K)
    expert_hits: jax.Array     # (layers, E) kept assignments per expert
    gate_mean: jax.Array       # (layers, E) P_e
    expert_idx: jax.Array      # (layers, B, C, K) the chosen experts, best first


# ----------------------------------------------------------------------------- init

def _uniform(key, shape, bound, dtype):
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def level_offsets(n_levels: int) -> np.ndarray:
    return np.array([(GOLDEN ** 2) ** (-l) for l in range(n_levels)], dtype=np.float64)


def _init_block(cfg: EngineConfig, key, dtype) -> Params:
    D, N, E, F, r = cfg.d_model, cfg.n_oscillators, cfg.n_experts, cfg.expert_d_ff, cfg.siren_rank
    keys = iter(jax.random.split(key, 10))
    omega_bound = 0.2 if cfg.is_atom else 0.05
    attn = {
        "w_qkv": _uniform(next(keys), (3, D, D), math.sqrt(2.0 / (D + D)), dtype),
        "b_qkv": jnp.zeros((3, D), dtype),
        "w_out": _uniform(next(keys), (D, D), math.sqrt(2.0 / (D + D)), dtype),
        "b_out": jnp.zeros((D,), dtype),
        "level_logits": jnp.zeros((cfg.n_levels,), dtype),
        "level_offsets": jnp.asarray(level_offsets(cfg.n_levels), dtype),
    }
    kuramoto = {
        "omega": _uniform(next(keys), (N,), omega_bound, dtype),
        "coupling_u": _uniform(next(keys), (N, cfg.coupling_rank), 1.0, dtype),
        "coupling_lambda": jax.random.uniform(next(keys), (cfg.coupling_rank,), dtype, 0.01, 0.51),
    }
    phase_key = next(keys)
    if cfg.is_atom:
        kuramoto["phase_proj"] = {
            "weight": jax.random.normal(phase_key, (1, D), dtype) / math.sqrt(D),
            "bias": jnp.zeros((1,), dtype),
        }
    moe = {
        "U1": _uniform(next(keys), (E, F, r), math.sqrt(2.0 / (F + r)), dtype),
        "V1": _uniform(next(keys), (E, D, r), math.sqrt(2.0 / (D + r)), dtype),
        "U2": _uniform(next(keys), (E, D, r), math.sqrt(2.0 / (D + r)), dtype),
        "V2": _uniform(next(keys), (E, F, r), math.sqrt(2.0 / (F + r)), dtype),
        "scale1": jnp.ones((E, 1, 1), dtype),
        "scale2": jnp.ones((E, 1, 1), dtype),
        "b1": jnp.zeros((E, F), dtype),
        "b2": jnp.zeros((E, D), dtype),
        "expert_phases": jnp.asarray(moe_k.farey_phases(E), dtype),
    }
    norm = lambda: {"weight": jnp.ones((D,), dtype), "bias": jnp.zeros((D,), dtype)}  # noqa: E731
    return {"attn": attn, "norm_attn": norm(), "kuramoto": kuramoto, "norm_kur": norm(),
            "moe": moe, "norm_moe": norm()}


def init_params(cfg: EngineConfig, key, dtype=jnp.float32) -> Params:
    """Fresh parameters as docs/spec.md §2 initialises them, blocks stacked on a leading axis."""
    D = cfg.d_model
    k_obs, k_blocks, k_conf, k_sal = jax.random.split(key, 4)
    embed_std = 0.02 if cfg.is_atom else 1.0
    head_bound = 1.0 / math.sqrt(D)

    def head(k):
        kw, kb = jax.random.split(k)
        return {"weight": _uniform(kw, (1, D), head_bound, dtype), "bias": _uniform(kb, (1,), head_bound, dtype)}

    params = {
        "observe": embed_std * jax.random.normal(k_obs, (cfg.vocab_size, D), dtype),
        "blocks": jax.vmap(lambda k: _init_block(cfg, k, dtype))(jax.random.split(k_blocks, cfg.n_layers)),
        "confidence_head": head(k_conf),
        "salience_head": head(k_sal),
    }
    if cfg.is_atom:
        params["atom_feat"] = {"weight": jnp.zeros((D, cfg.atom_feat_dim), dtype), "bias": jnp.zeros((D,), dtype)}
    return params


def trainable_mask(params: Params):
    """True for trainable leaves, False for the buffers (same tree structure)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in BUFFER_NAMES, params)


def count_params(cfg: EngineConfig) -> int:
    """Trainable parameters (the tied output head counted once); no allocation."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    mask = trainable_mask(shapes)
    return int(sum(int(np.prod(s.shape)) for s, m in
                   zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(mask)) if m))


# The carried state's logical axes, leaf by leaf (the leading ones; the rest are None):
# "batch" is the row axis, "layers" the stacked blocks. sharding.py maps them to the mesh;
# STATE_ROW_AXIS is where each leaf keeps its rows (lanes).
STATE_AXES = {"thought": ("batch", None), "S": ("layers", "batch"), "z": ("layers", "batch"),
              "phase": ("layers", "batch")}
STATE_ROW_AXIS = {name: axes.index("batch") for name, axes in STATE_AXES.items()}


def init_state(cfg: EngineConfig, batch_size: int, dtype=jnp.float32) -> State:
    """The zero carry of a stream start."""
    L, B, H, dH = cfg.n_layers, batch_size, cfg.n_heads, cfg.d_head
    return {
        "thought": jnp.zeros((B, cfg.d_model), dtype),
        "S": jnp.zeros((L, B, H, dH, dH), dtype),
        "z": jnp.zeros((L, B, H, dH), dtype),
        "phase": jnp.zeros((L, B, cfg.n_oscillators), dtype),
    }


def reset_state_rows(state: State, rows_B) -> State:
    """The carry with the rows where rows_B (B,) is true replaced by `init_state`'s (zeros),
    the others untouched: what a BOS at a chunk's first position does to its row (the
    attention state S, z and the thought start from zero; the carried phase is not read
    by the next chunk, docs/spec.md §4)."""
    rows_B = jnp.asarray(rows_B, bool)

    def one(name, a):
        shape = [1] * a.ndim
        shape[STATE_ROW_AXIS[name]] = a.shape[STATE_ROW_AXIS[name]]
        return jnp.where(rows_B.reshape(shape), jnp.zeros((), a.dtype), a)

    return {k: one(k, v) for k, v in state.items()}


# ----------------------------------------------------------------------------- forward

def _dtypes(params: Params, cfg: EngineConfig):
    """(accumulation dtype, matmul dtype): float64 params run float64 throughout."""
    acc = accum_dtype(params["observe"].dtype)
    return acc, (acc if acc == jnp.float64 else jnp.dtype(cfg.compute_dtype))


def _normalized(x, eps):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = jax.lax.rsqrt(jnp.square(xc).mean(-1, keepdims=True) + eps)
    return xc * rstd, rstd


def layer_norm(x, p, eps, cpu_tuned: bool = False):
    """LayerNorm over the last axis. cpu_tuned (the CPU form "layer_norm",
    kernels/select.py): the same with the textbook backward written out (custom_vjp, reverse
    mode only), which kept XLA:CPU from fusing each layer's residual gradient into its
    neighbours' and recomputing it there."""
    with jax.named_scope("layernorm"):
        if cpu_tuned:
            return _layer_norm(x, p, eps)
        xhat, _ = _normalized(x, eps)
        return xhat * p["weight"] + p["bias"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _layer_norm(x, p, eps):
    xhat, _ = _normalized(x, eps)
    return xhat * p["weight"] + p["bias"]


def _layer_norm_fwd(x, p, eps):
    xhat, rstd = _normalized(x, eps)
    return xhat * p["weight"] + p["bias"], (xhat, rstd, p["weight"])


def _layer_norm_bwd(eps, residuals, dy):
    xhat, rstd, weight = residuals
    g = dy * weight
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(dy.ndim - 1))
    return dx, {"weight": (dy * xhat).sum(rows), "bias": dy.sum(rows)}


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _heads(t_BxCxD, n_heads):
    B, C, D = t_BxCxD.shape
    return t_BxCxD.reshape(B, C, n_heads, D // n_heads).transpose(0, 2, 1, 3)


def _project_qkv(x_BxCxD, w_Dx3xD, b_3xD, mm_dtype):
    B, C, D = x_BxCxD.shape
    # One (D, 3D) matmul rather than three: w[:, j] is (D_in, D_out).
    w = w_Dx3xD.reshape(D, 3 * D)
    if jnp.dtype(mm_dtype) == w.dtype:
        return (x_BxCxD.astype(mm_dtype) @ w).astype(x_BxCxD.dtype) + b_3xD.reshape(3 * D)
    return mixed.einsum("bcd,de->bce", x_BxCxD, w, mm_dtype, x_BxCxD.dtype) + b_3xD.reshape(3 * D)


def _qkv_heads(x_BxCxD, w_Dx3xD, b_3xD, n_heads, mm_dtype):
    """q, k, v (B, H, C, dH): the projection split into heads."""
    qkv = _project_qkv(x_BxCxD, w_Dx3xD, b_3xD, mm_dtype)
    D = x_BxCxD.shape[-1]
    return tuple(_heads(qkv[..., j * D:(j + 1) * D], n_heads) for j in range(3))


def _features_impl(x_BxCxD, w_Dx3xD, b_3xD, offsets, n_heads, mm_dtype):
    q, k, v = _qkv_heads(x_BxCxD, w_Dx3xD, b_3xD, n_heads, mm_dtype)
    levels = range(offsets.shape[0])
    return (tuple(attn_k.elu1(q + offsets[l]) for l in levels),
            tuple(attn_k.elu1(k + offsets[l]) for l in levels), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def qkv_features(x_BxCxD, w_Dx3xD, b_3xD, offsets, n_heads, mm_dtype):
    """((qf_l), (kf_l), v): the projection, split into heads (B, H, C, dH), and the feature
    maps elu1(q + ω_l), elu1(k + ω_l) of every level l. The CPU form "qkv_features"
    (kernels/select.py) of `_attention`'s plain features.

    The backward is written out (custom_vjp): autodiff's form let XLA:CPU fuse the two
    levels' gradients, the elu1 derivative (max/min with their tie rule, recomputed from
    qkv), the heads transposes and the pads of the three slices into one large loop per
    layer. Here the feature derivative is read off the saved output, elu1'(u) =
    min(elu1(u), 1), and the three gradients are concatenated, not padded and added. ω gets
    no gradient: level_offsets is a buffer.
    """
    return _features_impl(x_BxCxD, w_Dx3xD, b_3xD, offsets, n_heads, mm_dtype)


def _qkv_features_fwd(x_BxCxD, w_Dx3xD, b_3xD, offsets, n_heads, mm_dtype):
    out = _features_impl(x_BxCxD, w_Dx3xD, b_3xD, offsets, n_heads, mm_dtype)
    qf, kf, _ = out
    return out, (x_BxCxD, w_Dx3xD, b_3xD, qf, kf, offsets)


def _qkv_features_bwd(n_heads, mm_dtype, residuals, cotangents):
    x_BxCxD, w_Dx3xD, b_3xD, qf, kf, offsets = residuals
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
    return dx, dw.reshape(D, 3, D), db.astype(b_3xD.dtype), jnp.zeros_like(offsets)


qkv_features.defvjp(_qkv_features_fwd, _qkv_features_bwd)


@jax.named_scope("attention")
def _attention(p, x_BxCxD, S_BxHxdxd, z_BxHxd, reset_BxC, cfg: EngineConfig, mm_dtype):
    B, C, D = x_BxCxD.shape
    H, dH, Lv = cfg.n_heads, cfg.d_head, cfg.n_levels
    acc = S_BxHxdxd.dtype
    x, w_Dx3xD, offsets = x_BxCxD.astype(acc), p["w_qkv"].transpose(1, 0, 2), jax.lax.stop_gradient(p["level_offsets"])
    if select.cpu_tuned(cfg.kernels, "qkv_features"):
        qf, kf, v = qkv_features(x, w_Dx3xD, p["b_qkv"], offsets, H, mm_dtype)   # per level
    else:
        q, k, v = _qkv_heads(x, w_Dx3xD, p["b_qkv"], H, mm_dtype)               # (B, H, C, dH)
        omega = offsets[:, None, None, None, None]
        qf, kf = attn_k.elu1(q + omega), attn_k.elu1(k + omega)                  # (Lv, B, H, C, dH)
    mix = jax.nn.softmax(p["level_logits"])
    one_block = select.cpu_tuned(cfg.kernels, "one_block")
    if select.cpu_tuned(cfg.kernels, "level_slices"):
        # The CPU form: one kernel call per level, no stacked copies of v and the carry, and
        # the carry's level mean a sum of slices, not a reduction over a level axis.
        a, S_sum, z_sum = 0.0, 0.0, 0.0
        for l in range(Lv):
            y, S_l, z_l = attn_k.linear_attention(qf[l], kf[l], v, S_BxHxdxd, z_BxHxd, reset_BxC[:, None, :],
                                                  block_size=cfg.attn_block_size, cpu_tuned=one_block)
            a, S_sum, z_sum = a + mix[l] * y, S_sum + S_l, z_sum + z_l
        new_S, new_z = S_sum / Lv, z_sum / Lv
    else:
        if isinstance(qf, tuple):                    # the features came per level
            qf, kf = jnp.stack(qf), jnp.stack(kf)
        y, S_l, z_l = attn_k.linear_attention(qf, kf, jnp.broadcast_to(v, qf.shape), S_BxHxdxd, z_BxHxd,
                                              reset_BxC[:, None, :], block_size=cfg.attn_block_size,
                                              cpu_tuned=one_block)
        a = jnp.einsum("l,lbhcd->bhcd", mix, y)
        new_S, new_z = S_l.mean(0), z_l.mean(0)
    a = a.transpose(0, 2, 1, 3).reshape(B, C, H * dH)
    out = mixed.einsum("bcd,de->bce", a, p["w_out"], mm_dtype, acc)
    return out + p["b_out"], new_S, new_z


@jax.named_scope("kuramoto")
def _phases(p, y_BxCxD, cfg: EngineConfig):
    if cfg.is_atom:
        base = jnp.einsum("bcd,d->bc", y_BxCxD, p["phase_proj"]["weight"][0]) + p["phase_proj"]["bias"][0]
    else:
        base = kur_k.mean_phase_encoding(y_BxCxD)
    theta0 = kur_k.initial_phases(base, cfg.n_oscillators)
    return kur_k.integrate(theta0, p["omega"], p["coupling_u"], p["coupling_lambda"],
                           n_steps=cfg.kuramoto_steps, dt=cfg.kuramoto_dt, damping=cfg.kuramoto_damping,
                           cpu_tuned=select.cpu_tuned(cfg.kernels, "sincos"))


@jax.named_scope("moe")
def _moe(p, x_BxCxD, theta_BxCxN, cfg: EngineConfig, mm_dtype):
    B, C, D = x_BxCxD.shape
    E, K = cfg.n_experts, cfg.top_k
    psi = theta_BxCxN if cfg.is_atom else jnp.broadcast_to(theta_BxCxN[:, -1:], theta_BxCxN.shape)
    trig_cpu = select.cpu_tuned(cfg.kernels, "sincos")
    g = moe_k.gates(moe_k.mean_phase(psi, trig_cpu), jax.lax.stop_gradient(p["expert_phases"]),
                    cfg.moe_kappa / cfg.gate_temperature, trig_cpu)           # (B, C, E)
    idx, w = moe_k.top_k_route(g, K)
    if cfg.capacity_factor is None:           # groups only keep tokens on their device
        n_groups = cfg.moe_shards if B % cfg.moe_shards == 0 else 1
    else:
        rows = cfg.moe_group_rows or B
        if B % rows:
            raise ValueError(f"batch {B} is not a multiple of moe_group_rows={rows}")
        n_groups = B // rows
    T = B // n_groups * C
    # The factors stay float32 (kernels/moe.py rounds them to the rows' dtype where they
    # multiply, keeping their gradients' sums float32).
    factors = dict(p)
    x_GxTxD = x_BxCxD.reshape(n_groups, T, D).astype(mm_dtype)
    idx_GxTxK, w_GxTxK = idx.reshape(n_groups, T, K), w.reshape(n_groups, T, K).astype(mm_dtype)
    if cfg.capacity_factor is None:
        y = moe_k.moe_dropless(x_GxTxD, idx_GxTxK, w_GxTxK, factors, cfg.moe_block_rows)
        kept = jnp.ones(idx_GxTxK.shape, bool)
    else:
        capacity = moe_k.expert_capacity(T, E, K, cfg.capacity_factor)
        y, kept = moe_k.moe_capacity(x_GxTxD, idx_GxTxK, w_GxTxK, factors, capacity)
    hits = jnp.einsum("tk,tke->e", kept.reshape(-1, K).astype(jnp.float32),
                      jax.nn.one_hot(idx.reshape(-1, K), E, dtype=jnp.float32))
    stats = (kept.mean(dtype=jnp.float32), hits, g.reshape(-1, E).mean(0), idx)
    return y.reshape(B, C, D).astype(x_BxCxD.dtype), stats


def block_forward(p, h_BxCxD, carry, reset_BxC, cfg: EngineConfig, mm_dtype):
    """One block on a chunk: (h, (S, z, phase)) → (h, (S, z, phase), stats)."""
    S, z, _ = carry
    ln_cpu = select.cpu_tuned(cfg.kernels, "layer_norm")
    a, S, z = _attention(p["attn"], layer_norm(h_BxCxD, p["norm_attn"], cfg.ln_eps, ln_cpu), S, z,
                         reset_BxC, cfg, mm_dtype)
    h = h_BxCxD + a
    theta = _phases(p["kuramoto"], layer_norm(h, p["norm_kur"], cfg.ln_eps, ln_cpu), cfg)
    m, stats = _moe(p["moe"], layer_norm(h, p["norm_moe"], cfg.ln_eps, ln_cpu), theta, cfg, mm_dtype)
    return h + m, (S, z, theta[:, -1]), stats


@jax.named_scope("embed")
def embed(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats=None):
    """observe[ids] + atom features at boundary ids + the thought at position 0; reset mask."""
    acc, _ = _dtypes(params, cfg)
    h = params["observe"][ids_BxC].astype(acc)
    if feats is not None:
        if not cfg.is_atom:
            raise ValueError("atom features given to a parent-variant engine")
        f = jnp.einsum("bcf,df->bcd", feats.astype(acc), params["atom_feat"]["weight"]) + params["atom_feat"]["bias"]
        at_boundary = (ids_BxC >= BOUNDARY_IDS[0]) & (ids_BxC <= BOUNDARY_IDS[1])
        h = h + jnp.where(at_boundary[..., None], f, 0.0)
    if cfg.bos_id is None:
        reset = jnp.zeros(ids_BxC.shape, bool)
    else:
        reset = ids_BxC == cfg.bos_id
    thought = jnp.where(reset[:, :1], 0.0, state["thought"].astype(acc))
    h = h.at[:, 0].add(thought)
    return h, reset


def _stream_forward(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats):
    """Embedding and every layer for one slice of rows: (h, new_state, per-layer stats)."""
    acc, mm_dtype = _dtypes(params, cfg)
    h, reset = embed(params, state, ids_BxC, cfg, feats)

    def layer(h, xs):
        p, S, z, phase = xs
        h, (S, z, phase), stats = block_forward(p, h, (S, z, phase), reset, cfg, mm_dtype)
        return h, (S, z, phase, stats)

    if cfg.remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
    carry_in = (state["S"].astype(acc), state["z"].astype(acc), state["phase"].astype(acc))
    h, (S, z, phase, stats) = jax.lax.scan(layer, h, (params["blocks"], *carry_in), unroll=cfg.scan_unroll)
    return h, {"thought": h[:, -1], "S": S, "z": z, "phase": phase}, stats


def as_arrays(tree):
    """Every leaf as a jax.Array: host arrays (numpy leaves from the converter, lists) are
    placed on the device; tracers and device arrays pass through unchanged."""
    return jax.tree.map(jnp.asarray, tree)


def forward_hidden(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats=None,
                   carry_grad: bool = False):
    """The chunk forward up to the last hidden state: (h (B, C, D), Aux, new_state).

    The new state is detached (no gradient flows through it into the next chunk, as the
    PyTorch engine's `.detach()`) unless carry_grad: the trainer's bptt_chunks
    differentiates through it. Takes host arrays as well as device arrays, with or without jit.
    With cfg.row_streams = n the rows run as n independent slices (their own embedding,
    layers and state), joined only by the load balance, whose P_e is the mean of the
    streams' (equal row counts: the mean over every token)."""
    params, state, ids_BxC, feats = as_arrays((params, state, ids_BxC, feats))
    B = ids_BxC.shape[0]
    n = cfg.row_streams
    rows = B // n
    if n > 1 and (B % n or cfg.moe_group_rows == 0 or rows % cfg.moe_group_rows):
        raise ValueError(f"batch {B} does not split into {n} row streams of whole MoE dispatch "
                         f"groups (moe_group_rows={cfg.moe_group_rows}; 0 makes the batch one group)")
    outs = []
    for i in range(n):
        part = slice(i * rows, (i + 1) * rows)
        st = {k: jax.lax.slice_in_dim(v, i * rows, (i + 1) * rows, axis=STATE_ROW_AXIS[k])
              for k, v in state.items()}
        outs.append(_stream_forward(params, st, ids_BxC[part], cfg, None if feats is None else feats[part]))
    if n == 1:
        h, new_state, (keep, hits, gate_mean, idx) = outs[0]
    else:
        h = jnp.concatenate([o[0] for o in outs], 0)
        new_state = {k: jnp.concatenate([o[1][k] for o in outs], STATE_ROW_AXIS[k]) for k in state}
        keep = sum(o[2][0] for o in outs) / n
        hits = sum(o[2][1] for o in outs)
        gate_mean = sum(o[2][2] for o in outs) / n
        idx = jnp.concatenate([o[2][3] for o in outs], 1)
    if not carry_grad:
        new_state = jax.lax.stop_gradient(new_state)
    lb = moe_k.load_balance_of_means(gate_mean)                    # (layers,)
    aux = Aux(lb=lb.sum(), lb_per_layer=lb, keep_rate=keep, expert_hits=hits, gate_mean=gate_mean,
              expert_idx=idx)
    return h, aux, new_state


def logits_from_hidden(params: Params, h_BxCxD):
    return jnp.einsum("bcd,vd->bcv", h_BxCxD, params["observe"].astype(h_BxCxD.dtype))


def forward_chunk(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats=None):
    """(logits (B, C, V), lb, new_state): the engine on one chunk, jit-able with cfg static."""
    h, aux, new_state = forward_hidden(params, state, ids_BxC, cfg, feats)
    return logits_from_hidden(params, h), aux.lb, new_state


def confidence(params: Params, h_BxD):
    """sigmoid(confidence_head(h)): the decode step's confidence, (B,)."""
    p = params["confidence_head"]
    return jax.nn.sigmoid(h_BxD @ p["weight"][0].astype(h_BxD.dtype) + p["bias"][0])
