"""Grow the body of a run without changing what it computes (docs/growth.md).

Three things grow, each by appending along one axis, so every old value keeps its index
and sits in the leading corner of the grown array:

  * depth (`add_layers`): new blocks go AFTER the last one. Their attention output
    projection (w_out, b_out) and every expert's output factor U2 and bias b2 are zero,
    so the block adds exactly zero to the residual stream (it is the identity on h);
    everything else is initialised as docs/spec.md §2, and the zero tensors get gradients at once
    (d/dw_out = aᵀ·dh, d/dU2 ∝ u·V2), the others from the next step on.
  * experts (`add_experts`): new experts go after the last one, in every existing layer,
    with U2 = 0 and b2 = 0 and the other factors as docs/spec.md §2 (so U2 learns from the first
    routed token and the rest follows), at a phase a quarter of the mean spacing (2π/E)
    after the busiest experts (or the middle of the widest gap when no hits are known).
  * expert rank (`siren_rank`): U1, V2 get new random columns (docs/spec.md §2 at the new rank),
    V1 and U2 new zero columns: x·V1 gains zeros (U1's new columns see nothing) and the
    new U2 columns write nothing (V2's new columns go nowhere); d/dV1_new ∝ U1_new and
    d/dU2_new ∝ u·V2_new are not zero.

Depth and rank growth leave the logits of any chunk, with the carried state, unchanged
(float32 rounding at most). Expert growth cannot: top-k may now pick a new (zero) expert
for tokens near its phase; `compare_probe` measures how many and by how much.

Optimizer moments (AdamW mu/nu, SGD trace) and the carried state are extended with zeros
(`grow_like`); the counters (AdamW count, step) stay. All array work is jnp on whatever
arrays come in, so it can be jitted with the grown run's out_shardings.

This module is the engine's side of growth and depends on the engine and its config
only. A train state (its TrainConfig, optimizer, mesh and growth record) grows in
`fractus_jax.train.growth`, a run directory in `fractus_jax.grow.run`;
`python -m fractus_jax.grow` is the command line on top of both.
"""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import model, sharding
from fractus_jax.config import WEIGHT_FIELDS, EngineConfig

# Of the fields that decide the weights' shapes (WEIGHT_FIELDS, as the trainer's resume check) only these may change.
GROWABLE = ("n_layers", "n_experts", "siren_rank")
FACTORS = ("U1", "V1", "U2", "V2")


class GrowthError(ValueError):
    """A growth that is refused (nothing is written)."""


@dataclasses.dataclass(frozen=True)
class GrowthSpec:
    """What to add. Field names match the trainer's `grow.*` overrides."""
    add_layers: int = 0
    add_experts: int = 0
    siren_rank: Optional[int] = None   # the new expert rank; None keeps it

    def target(self, m: EngineConfig) -> EngineConfig:
        """The grown engine config (unchecked: `check_growth` refuses what cannot be)."""
        return dataclasses.replace(m, n_layers=m.n_layers + self.add_layers,
                                   n_experts=m.n_experts + self.add_experts,
                                   siren_rank=m.siren_rank if self.siren_rank is None else self.siren_rank)

    @classmethod
    def between(cls, old: EngineConfig, new: EngineConfig) -> "GrowthSpec":
        return cls(new.n_layers - old.n_layers, new.n_experts - old.n_experts,
                   None if new.siren_rank == old.siren_rank else new.siren_rank)


# ----------------------------------------------------------------------------- checks

def sharding_problems(old: EngineConfig, new: EngineConfig, mesh_axes: Mapping[str, int]) -> list[str]:
    """Splits a mesh of these axis sizes ({"data": d, "fsdp": f}) made of the old shapes
    that the grown shapes would not allow (no devices needed)."""
    stub = types.SimpleNamespace(shape=dict(mesh_axes))   # what `sharding.unsharded_dims` reads of a mesh
    shapes = lambda m: jax.eval_shape(lambda: model.init_params(m, jax.random.PRNGKey(0)))  # noqa: E731
    before = {p.split(":")[0] for p in sharding.unsharded_dims(shapes(old), stub)}
    return [p for p in sharding.unsharded_dims(shapes(new), stub) if p.split(":")[0] not in before]


def check_growth(old: EngineConfig, new: EngineConfig, mesh_axes: Optional[Mapping[str, int]] = None) -> None:
    """Raise GrowthError unless `new` is `old` grown in depth, experts or rank only (and,
    given the mesh's axis sizes, split by that mesh as `old` is)."""
    if new.vocab_size != old.vocab_size:
        raise GrowthError(f"vocab_size {old.vocab_size} -> {new.vocab_size}: the vocabulary does not grow "
                          "(the Atom alphabet is closed); only n_layers, n_experts and siren_rank do")
    shrunk = [f"{k} {getattr(old, k)} -> {getattr(new, k)}" for k in GROWABLE if getattr(new, k) < getattr(old, k)]
    if shrunk:
        raise GrowthError(f"growth cannot shrink: {', '.join(shrunk)}")
    other = [f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}" for k in WEIGHT_FIELDS
             if k not in GROWABLE and getattr(new, k) != getattr(old, k)]
    if other:
        raise GrowthError(f"only n_layers, n_experts and siren_rank can grow; this changes {', '.join(other)}")
    if all(getattr(new, k) == getattr(old, k) for k in GROWABLE):
        raise GrowthError("nothing to grow: give --add-layers, --add-experts or a larger --siren-rank")
    bad = sharding_problems(old, new, mesh_axes) if mesh_axes else []
    if bad:
        sizes = ", ".join(f"{k}={v}" for k, v in mesh_axes.items())
        raise GrowthError(f"the run's mesh ({sizes}) could not split the grown tensors as it splits the "
                          f"current ones: {'; '.join(bad)}. Choose a growth the fsdp axis divides "
                          f"(n_experts a multiple of {mesh_axes.get('fsdp', 1)})")


def target_engine(old: EngineConfig, growth: Union[GrowthSpec, EngineConfig],
                  mesh_axes: Optional[Mapping[str, int]] = None) -> EngineConfig:
    """The grown engine config (a GrowthSpec applied, or the grown config itself), checked."""
    if isinstance(growth, GrowthSpec):
        for name in ("add_layers", "add_experts"):
            if getattr(growth, name) < 0:
                raise GrowthError(f"growth cannot shrink: {name}={getattr(growth, name)}")
        new = growth.target(old)
    else:
        new = growth
    try:
        new = dataclasses.replace(new)   # re-run EngineConfig's own checks
    except ValueError as e:
        raise GrowthError(str(e)) from None
    check_growth(old, new, mesh_axes)
    return new


# ----------------------------------------------------------------------------- expert phases

def _widest_gap_middle(phases) -> float:
    p = np.sort(np.mod(np.asarray(phases, np.float64), 2 * math.pi))
    gaps = np.diff(np.concatenate([p, [p[0] + 2 * math.pi]]))
    i = int(np.argmax(gaps))
    return float(np.mod(p[i] + gaps[i] / 2, 2 * math.pi))


def new_expert_phases(phases_LxE, n_add: int, hits_LxE=None) -> np.ndarray:
    """Phases (L, n_add) for new experts, per layer.

    The k-th new expert of a layer goes a quarter of the mean spacing (2π/E) after the
    layer's k-th busiest expert (hits, descending; experts with no hits attract none);
    when hits are unknown, or there are more new experts than busy ones, it goes to the
    middle of the widest gap between the phases placed so far.
    """
    phases = np.asarray(phases_LxE, np.float64)
    L, E = phases.shape
    quarter = 2 * math.pi / E / 4
    out = np.zeros((L, n_add), np.float64)
    for layer in range(L):
        placed = list(phases[layer])
        busy = []
        if hits_LxE is not None:
            h = np.asarray(hits_LxE, np.float64)[layer]
            busy = [int(e) for e in np.argsort(-h, kind="stable") if h[e] > 0]
        for k in range(n_add):
            p = np.mod(phases[layer, busy[k]] + quarter, 2 * math.pi) if k < len(busy) else _widest_gap_middle(placed)
            out[layer, k] = p
            placed.append(p)
    return out


def expert_phases_for(params, old: EngineConfig, new: EngineConfig, hits_LxE=None) -> Optional[np.ndarray]:
    """The phases (L_old, E_new − E_old) of the new experts of the existing layers, from
    the concrete parameters (None when no experts are added)."""
    n_add = new.n_experts - old.n_experts
    if not n_add:
        return None
    return new_expert_phases(np.asarray(jax.device_get(params["blocks"]["moe"]["expert_phases"])), n_add, hits_LxE)


def routing_demand(expert_idx_LxBxCxK, n_experts: int) -> np.ndarray:
    """Assignments per expert and layer (before capacity): (L, E) counts."""
    idx = np.asarray(expert_idx_LxBxCxK)
    return np.stack([np.bincount(idx[l].reshape(-1), minlength=n_experts) for l in range(idx.shape[0])])


# ----------------------------------------------------------------------------- arrays

def embed_leading(old, new):
    """`new` with `old` written into its leading corner (old's shape ≤ new's on every axis)."""
    if tuple(old.shape) == tuple(new.shape):
        return jnp.asarray(old, new.dtype)
    if len(old.shape) != len(new.shape) or any(o > n for o, n in zip(old.shape, new.shape)):
        raise GrowthError(f"internal: cannot grow shape {tuple(old.shape)} into {tuple(new.shape)}")
    return jnp.asarray(new).at[tuple(slice(0, s) for s in old.shape)].set(jnp.asarray(old, new.dtype))


def _dict_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def grow_like(old_tree, template, params=None):
    """Every leaf of `template` (zeros where new) with the old leaf in its leading corner.

    With `params` (the grown parameters), a leaf whose shape changes must mirror a
    parameter: its dict-key path ends like a parameter's path and has that parameter's
    grown shape (as `train.state._like_params` shards moments). Counters keep their value.
    """
    table = None
    if params is not None:
        table = {_dict_keys(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}

    def pick(path, new, old):
        if table is not None and tuple(old.shape) != tuple(new.shape):
            keys = _dict_keys(path)
            if not any(table.get(keys[i:]) == tuple(new.shape) for i in range(len(keys))):
                raise GrowthError(f"internal: state leaf {jax.tree_util.keystr(path)} changes shape "
                                  f"{tuple(old.shape)} -> {tuple(new.shape)} but mirrors no parameter")
        return embed_leading(old, new)

    if jax.tree.structure(old_tree) != jax.tree.structure(template):
        raise GrowthError("internal: the grown state's tree differs from the old one's")
    return jax.tree_util.tree_map_with_path(pick, template, old_tree)


def grow_params(params, old: EngineConfig, new: EngineConfig, key, new_phases=None):
    """The grown parameter tree (see the module docstring for what each new entry holds).

    `new_phases` (L_old, E_new − E_old) places the new experts of the existing layers;
    the new layers take the Farey phases of the grown expert count (a fresh block's).
    """
    L, E, r = old.n_layers, old.n_experts, old.siren_rank
    fresh = model.init_params(new, key, dtype=params["observe"].dtype)
    attn, moe = dict(fresh["blocks"]["attn"]), dict(fresh["blocks"]["moe"])
    # New blocks: nothing reaches the residual stream.
    attn["w_out"] = attn["w_out"].at[L:].set(0)
    attn["b_out"] = attn["b_out"].at[L:].set(0)
    for name in ("U2", "b2"):
        moe[name] = moe[name].at[L:].set(0).at[:, E:].set(0)   # new layers; new experts of old layers
    # New rank columns of the existing experts: V1 and U2 zero, U1 and V2 random.
    moe["V1"] = moe["V1"].at[:L, :E, :, r:].set(0)
    moe["U2"] = moe["U2"].at[:L, :E, :, r:].set(0)
    if new.n_experts > E:
        if new_phases is None:
            raise GrowthError("internal: new experts need phases (new_expert_phases)")
        moe["expert_phases"] = moe["expert_phases"].at[:L, E:].set(jnp.asarray(new_phases, moe["expert_phases"].dtype))
    fresh["blocks"] = {**fresh["blocks"], "attn": attn, "moe": moe}
    return grow_like(params, fresh)


def grow_carry(carry, new: EngineConfig):
    """The carried state with zero entries for the new layers."""
    batch = carry["thought"].shape[0]
    return grow_like(carry, model.init_state(new, batch, dtype=carry["thought"].dtype))


# ----------------------------------------------------------------------------- what changed

def _probe_fn():
    def run(params, carry, ids, cfg):
        h, aux, _ = model.forward_hidden(params, carry, ids, cfg)
        return model.logits_from_hidden(params, h), aux.expert_idx
    return jax.jit(run, static_argnums=3)


_PROBE = _probe_fn()


def probe(params, carry, ids, m: EngineConfig):
    """(logits (B, C, V), chosen experts (L, B, C, K)) of the exact engine (no capacity)."""
    logits, idx = _PROBE(params, carry, jnp.asarray(ids, jnp.int32), m.for_inference())
    return np.asarray(logits), np.asarray(idx)


def compare_probe(old_out, new_out, rtol: float = 1e-4) -> dict:
    """What growth did to a probe chunk: rerouted tokens and the logit change.

    A token is rerouted when its set of chosen experts changed in any of the old layers.
    Its logits "changed" when they moved by more than rtol·max(1, max |logit|).
    """
    (lo, io), (ln, in_) = old_out, new_out
    L = io.shape[0]
    pairs_o, pairs_n = np.sort(io, -1), np.sort(in_[:L], -1)
    per_layer = np.any(pairs_o != pairs_n, -1)                     # (L, B, C)
    rerouted = per_layer.any(0)
    delta = np.abs(ln.astype(np.float64) - lo.astype(np.float64)).max(-1)   # (B, C)
    tol = rtol * max(1.0, float(np.abs(lo).max()))
    return {"tokens": int(rerouted.size),
            "rerouted_fraction": float(rerouted.mean()),
            "rerouted_fraction_per_layer": [float(x) for x in per_layer.reshape(L, -1).mean(1)],
            "max_logit_change": float(delta.max()),
            "changed_fraction": float((delta > tol).mean()),
            "rerouted_mask": rerouted, "changed_mask": delta > tol}
