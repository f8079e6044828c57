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
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.dtypes import accum_dtype
from fractus_jax.kernels import kuramoto as kur_k
from fractus_jax.kernels import mixed
from fractus_jax.kernels import moe as moe_k
from fractus_jax.kernels import select
from fractus_jax.kernels import streams

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


def decay_logits(cfg: EngineConfig) -> np.ndarray:
    """attn.decay_logit at init: logit(γ_l) of carry_decay for every head, (L, H)."""
    g_L = np.asarray(cfg.carry_decay, np.float64)
    return np.repeat((np.log(g_L) - np.log1p(-g_L))[:, None], cfg.n_heads, axis=1)


def carry_decay(p, cfg: EngineConfig):
    """The blocks' carry decay: None (the running sum), the config's γ_l per level, or the
    learned γ = sigmoid(decay_logit) per level and head, (L, H)."""
    return jax.nn.sigmoid(p["decay_logit"]) if cfg.learn_carry_decay else cfg.carry_decay


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
    if cfg.learn_carry_decay:
        attn["decay_logit"] = jnp.asarray(decay_logits(cfg), dtype)
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

def _dtypes(params: Params, ex: Execution):
    """(accumulation dtype, matmul dtype): float64 params run float64 throughout."""
    acc = accum_dtype(params["observe"].dtype)
    return acc, (acc if acc == jnp.float64 else jnp.dtype(ex.compute_dtype))


@jax.named_scope("attention")
def _attention(p, x_BxCxD, S_BxHxdxd, z_BxHxd, reset_BxC, cfg: EngineConfig, ex: Execution, forms: select.Forms,
               mm_dtype):
    """Causal linear attention at every level l (features elu1(· + ω_l), carry decay γ_l when
    cfg.carry_decay is set, learned per head with cfg.learn_carry_decay), mixed by softmax(level_logits), with the carried (S, z) the
    levels' mean (docs/spec.md §3.1)."""
    B, C, D = x_BxCxD.shape
    acc = S_BxHxdxd.dtype
    w_Dx3xD, omega_L = p["w_qkv"].transpose(1, 0, 2), jax.lax.stop_gradient(p["level_offsets"])
    qf, kf, v_BxHxCxd = forms.qkv_features(x_BxCxD.astype(acc), w_Dx3xD, p["b_qkv"], omega_L, cfg.n_heads, mm_dtype)
    mix_L = jax.nn.softmax(p["level_logits"])
    a_BxHxCxd, S, z = forms.level_attention(qf, kf, v_BxHxCxd, S_BxHxdxd, z_BxHxd, reset_BxC, mix_L,
                                            ex.attn_block_size, forms.linear_attention, carry_decay(p, cfg))
    a_BxCxD = a_BxHxCxd.transpose(0, 2, 1, 3).reshape(B, C, D)
    return mixed.einsum("bcd,de->bce", a_BxCxD, p["w_out"], mm_dtype, acc) + p["b_out"], S, z


@jax.named_scope("kuramoto")
def _phases(p, y_BxCxD, cfg: EngineConfig, forms: select.Forms):
    """The oscillators' phases after RK4 from the position's base phase (docs/spec.md §3.2)."""
    if cfg.is_atom:
        base_BxC = jnp.einsum("bcd,d->bc", y_BxCxD, p["phase_proj"]["weight"][0]) + p["phase_proj"]["bias"][0]
    else:
        base_BxC = kur_k.mean_phase_encoding(y_BxCxD)
    theta0_BxCxN = kur_k.initial_phases(base_BxC, cfg.n_oscillators)
    return kur_k.integrate(theta0_BxCxN, p["omega"], p["coupling_u"], p["coupling_lambda"],
                           n_steps=cfg.kuramoto_steps, dt=cfg.kuramoto_dt, damping=cfg.kuramoto_damping,
                           sin_cos=forms.sin_cos)


@jax.named_scope("moe")
def _moe(p, x_BxCxD, theta_BxCxN, cfg: EngineConfig, ex: Execution, forms: select.Forms, mm_dtype):
    """Phase-routed top-k of the low-rank experts (docs/spec.md §3.3-3.4): (y, routing stats)."""
    B, C, D = x_BxCxD.shape
    E, K = cfg.n_experts, cfg.top_k
    psi = theta_BxCxN if cfg.is_atom else jnp.broadcast_to(theta_BxCxN[:, -1:], theta_BxCxN.shape)
    g_BxCxE = moe_k.gates(moe_k.mean_phase(psi, forms.sin_cos), jax.lax.stop_gradient(p["expert_phases"]),
                          cfg.moe_kappa / cfg.gate_temperature, forms.sin_cos)
    idx, w = moe_k.top_k_route(g_BxCxE, K)
    if cfg.capacity_factor is None:           # groups only keep tokens on their device
        n_groups = ex.moe_shards if B % ex.moe_shards == 0 else 1
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
        y = moe_k.moe_dropless(x_GxTxD, idx_GxTxK, w_GxTxK, factors, ex.moe_block_rows)
        kept = jnp.ones(idx_GxTxK.shape, bool)
    else:
        capacity = moe_k.expert_capacity(T, E, K, cfg.capacity_factor)
        y, kept = moe_k.moe_capacity(x_GxTxD, idx_GxTxK, w_GxTxK, factors, capacity)
    hits = jnp.einsum("tk,tke->e", kept.reshape(-1, K).astype(jnp.float32),
                      jax.nn.one_hot(idx.reshape(-1, K), E, dtype=jnp.float32))
    stats = (kept.mean(dtype=jnp.float32), hits, g_BxCxE.reshape(-1, E).mean(0), idx)
    return y.reshape(B, C, D).astype(x_BxCxD.dtype), stats


def block_forward(p, h_BxCxD, carry, reset_BxC, cfg: EngineConfig, ex: Execution, mm_dtype,
                  forms: select.Forms | None = None):
    """One block on a chunk: (h, (S, z, phase)) → (h, (S, z, phase), stats)."""
    forms = forms or select.forms(ex.kernels)
    S, z, _ = carry

    def norm(x, q):
        with jax.named_scope("layernorm"):
            return forms.layer_norm(x, q, cfg.ln_eps)

    a, S, z = _attention(p["attn"], norm(h_BxCxD, p["norm_attn"]), S, z, reset_BxC, cfg, ex, forms, mm_dtype)
    h = h_BxCxD + a
    theta = _phases(p["kuramoto"], norm(h, p["norm_kur"]), cfg, forms)
    m, stats = _moe(p["moe"], norm(h, p["norm_moe"]), theta, cfg, ex, forms, mm_dtype)
    return h + m, (S, z, theta[:, -1]), stats


@jax.named_scope("embed")
def embed(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats=None):
    """observe[ids] + atom features at boundary ids + the thought at position 0; reset mask."""
    acc = accum_dtype(params["observe"].dtype)
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


def _forward_rows(params: Params, state: State, ids_BxC, feats, cfg: EngineConfig, ex: Execution):
    """Embedding and every layer: (h, new_state, per-layer routing stats)."""
    acc, mm_dtype = _dtypes(params, ex)
    forms = select.forms(ex.kernels)
    h, reset = embed(params, state, ids_BxC, cfg, feats)

    def layer(h, xs):
        p, S, z, phase = xs
        h, (S, z, phase), stats = block_forward(p, h, (S, z, phase), reset, cfg, ex, mm_dtype, forms)
        return h, (S, z, phase, stats)

    if ex.remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
    carry_in = (state["S"].astype(acc), state["z"].astype(acc), state["phase"].astype(acc))
    h, (S, z, phase, stats) = jax.lax.scan(layer, h, (params["blocks"], *carry_in), unroll=ex.scan_unroll)
    return h, {"thought": h[:, -1], "S": S, "z": z, "phase": phase}, stats


# Row streams (Execution.row_streams, one device): the rows run as independent slices, joined
# only by the load balance, whose P_e is the mean of the streams' (equal row counts: the
# mean over every token). Per output: rows concatenated on an axis, or a sum or mean over
# the streams; the stats are (keep rate, expert hits, gate mean, expert choices).
_STREAM_IN_AXES = (None, STATE_ROW_AXIS, 0, 0)
_STREAM_OUT_AXES = (0, STATE_ROW_AXIS, ("mean", "sum", "mean", 1))


def as_arrays(tree):
    """Every leaf as a jax.Array: host arrays (numpy leaves from the converter, lists) are
    placed on the device; tracers and device arrays pass through unchanged."""
    return jax.tree.map(jnp.asarray, tree)


def forward_hidden(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats=None,
                   carry_grad: bool = False, ex: Execution = Execution()):
    """The chunk forward up to the last hidden state: (h (B, C, D), Aux, new_state).

    The new state is detached (no gradient flows through it into the next chunk, as the
    PyTorch engine's `.detach()`) unless carry_grad: the trainer's bptt_chunks
    differentiates through it. Takes host arrays as well as device arrays, with or without jit.
    `ex` says how it is computed (kernels, dtype, remat, blocks), not what.
    With ex.row_streams = n the rows run as n independent slices (their own embedding,
    layers and state), joined only by the load balance, whose P_e is the mean of the
    streams' (equal row counts: the mean over every token)."""
    params, state, ids_BxC, feats = as_arrays((params, state, ids_BxC, feats))
    forward = functools.partial(_forward_rows, cfg=cfg, ex=ex)
    n = ex.row_streams
    if n > 1:
        B = ids_BxC.shape[0]
        if B % n or cfg.moe_group_rows == 0 or (B // n) % cfg.moe_group_rows:
            raise ValueError(f"batch {B} does not split into {n} row streams of whole MoE dispatch "
                             f"groups (moe_group_rows={cfg.moe_group_rows}; 0 makes the batch one group)")
        forward = streams.in_row_streams(forward, n, _STREAM_IN_AXES, _STREAM_OUT_AXES)
    h, new_state, (keep, hits, gate_mean, idx) = forward(params, state, ids_BxC, feats)
    if not carry_grad:
        new_state = jax.lax.stop_gradient(new_state)
    lb = moe_k.load_balance_of_means(gate_mean)                    # (layers,)
    aux = Aux(lb=lb.sum(), lb_per_layer=lb, keep_rate=keep, expert_hits=hits, gate_mean=gate_mean,
              expert_idx=idx)
    return h, aux, new_state


def logits_from_hidden(params: Params, h_BxCxD):
    return jnp.einsum("bcd,vd->bcv", h_BxCxD, params["observe"].astype(h_BxCxD.dtype))


def forward_chunk(params: Params, state: State, ids_BxC, cfg: EngineConfig, feats=None,
                  ex: Execution = Execution()):
    """(logits (B, C, V), lb, new_state): the engine on one chunk, jit-able with cfg and ex static."""
    h, aux, new_state = forward_hidden(params, state, ids_BxC, cfg, feats, ex=ex)
    return logits_from_hidden(params, h), aux.lb, new_state


def confidence(params: Params, h_BxD):
    """sigmoid(confidence_head(h)): the decode step's confidence, (B,)."""
    p = params["confidence_head"]
    return jax.nn.sigmoid(h_BxD @ p["weight"][0].astype(h_BxD.dtype) + p["bias"][0])
