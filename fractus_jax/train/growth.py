"""Growth of a train state, and the trainer's side of it: grow in place at `grow_at`,
and resume grown runs.

`fractus_jax.growth` grows the engine's arrays (parameters, moments, carried state); this
module grows a whole train state (its TrainConfig, optimizer state, mesh shardings) and
writes the growth record, once for both the trainer's in-place growth and
`python -m fractus_jax.grow`.

A run grown at step s (in place, or by `python -m fractus_jax.grow`) keeps its original
command line: its manifest's `growth` records say which model shape the command line's
shape became, so a resume takes the grown shape from the manifest instead of refusing.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Optional, Union

import jax

from fractus_jax import growth as engine_growth
from fractus_jax.config import WEIGHT_FIELDS, EngineConfig
from fractus_jax.growth import GrowthSpec
from fractus_jax.kernels import moe as moe_k
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import MeshConfig, TrainConfig

def mesh_axes(mesh: MeshConfig) -> dict[str, int]:
    return {"data": mesh.data, "fsdp": mesh.fsdp}


def spec_of(cfg: TrainConfig) -> GrowthSpec:
    """What the trainer's `grow_at` adds (cfg.grow)."""
    return GrowthSpec(cfg.grow.add_layers, cfg.grow.add_experts, cfg.grow.siren_rank)


def target_config(cfg: TrainConfig, growth: Union[GrowthSpec, EngineConfig]) -> TrainConfig:
    """The grown run's TrainConfig (the model grown, the rest as it was), checked against
    the run's mesh too (GrowthError)."""
    return dataclasses.replace(cfg, model=engine_growth.target_engine(cfg.model, growth, mesh_axes(cfg.mesh)))


def capacity_change(cfg: TrainConfig, new_cfg: TrainConfig) -> Optional[dict]:
    """Per-expert capacity of one dispatch group, before and after (None without capacity)."""
    if cfg.model.capacity_factor is None:
        return None
    rows = cfg.model.moe_group_rows or cfg.batch_size
    T = rows * cfg.seq_len
    cap = lambda m: moe_k.expert_capacity(T, m.n_experts, m.top_k, m.capacity_factor)  # noqa: E731
    return {"group_tokens": T, "before": cap(cfg.model), "after": cap(new_cfg.model)}


def grow_state_arrays(state, cfg: TrainConfig, new_cfg: TrainConfig, key, new_phases=None):
    """The train state {params, opt_state, carry, step, skipped} grown to new_cfg's model.

    Pure jnp (jit-able with static cfg, new_cfg); `new_phases` must be given when experts
    grow (`grow.expert_phases_for`, computed outside on concrete hits).
    """
    params = engine_growth.grow_params(state["params"], cfg.model, new_cfg.model, key, new_phases)
    template = state_lib.make_optimizer(new_cfg, params).init(params)
    opt_state = engine_growth.grow_like(state["opt_state"], template, params)
    carry = engine_growth.grow_carry(state["carry"], new_cfg.model)
    return {**state, "params": params, "opt_state": opt_state, "carry": carry}


def grow_train_state(state, cfg: TrainConfig, growth: Union[GrowthSpec, EngineConfig], *, key,
                     hits=None, new_phases=None, mesh=None):
    """(grown state, grown TrainConfig). Checks first (GrowthError); `hits` (L, E) place
    the new experts (None: widest gaps); `new_phases` overrides the placement. On a device
    mesh the grown arrays land on the grown run's shardings; without one, wherever jit
    puts them (one device for single-device input)."""
    new_cfg = target_config(cfg, growth)
    if new_phases is None:
        new_phases = engine_growth.expert_phases_for(state["params"], cfg.model, new_cfg.model, hits)
    out = None if mesh is None else state_lib.train_state_shardings(new_cfg, mesh)
    grow = jax.jit(grow_state_arrays, static_argnums=(1, 2), out_shardings=out)   # one program, not one per op
    return grow(state, cfg, new_cfg, key, new_phases), new_cfg


def growth_record(cfg: TrainConfig, new_cfg: TrainConfig, step: int, hits_source: Optional[str], **more) -> dict:
    """The manifest's record of one growth (`growth` list), with `more` fields added."""
    spec = GrowthSpec.between(cfg.model, new_cfg.model)
    return {"at_step": step, **more,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "add_layers": spec.add_layers, "add_experts": spec.add_experts, "siren_rank": new_cfg.model.siren_rank,
            "from": {k: getattr(cfg.model, k) for k in engine_growth.GROWABLE},
            "to": {k: getattr(new_cfg.model, k) for k in engine_growth.GROWABLE},
            "hits_source": hits_source if spec.add_experts else None,
            "capacity_per_expert": capacity_change(cfg, new_cfg)}


def grown_model_for(cfg: TrainConfig, manifest: dict) -> Optional[TrainConfig]:
    """cfg with the manifest's grown model when its growth records lead from cfg's model
    shape to the manifest's; None when they do not explain the difference."""
    records = manifest.get("growth") or []
    old_model = manifest.get("config", {}).get("model", {})
    if not records:
        return None
    first = records[0].get("from", {})
    if any(getattr(cfg.model, k) != v for k, v in first.items()):
        return None
    others = [k for k in WEIGHT_FIELDS if k not in engine_growth.GROWABLE]
    if any(old_model.get(k) != getattr(cfg.model, k) for k in others):
        return None
    grown = cfg.model.replace(**{k: old_model[k] for k in engine_growth.GROWABLE})
    return dataclasses.replace(cfg, model=grown)


def already_grown(records: list, grow_at: int) -> bool:
    return any(r.get("at_step") == grow_at and r.get("in_place") for r in records)


def grow_in_place(state, cfg: TrainConfig, mesh, step: int, hits=None):
    """(grown state on the mesh, grown TrainConfig, growth record). Raises GrowthError."""
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step)
    grown, new_cfg = grow_train_state(state, cfg, spec_of(cfg), key=key, hits=hits, mesh=mesh)
    record = growth_record(cfg, new_cfg, step, "probe" if hits is not None else "none", in_place=True)
    return grown, new_cfg, record
