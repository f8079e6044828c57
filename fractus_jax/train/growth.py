"""The trainer's side of growth: grow in place at `grow_at`, and resume grown runs.

A run grown at step s (in place, or by `python -m fractus_jax.grow`) keeps its original
command line: its manifest's `growth` records say which model shape the command line's
shape became, so a resume takes the grown shape from the manifest instead of refusing.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Optional

import jax
import numpy as np

from fractus_jax.config import WEIGHT_FIELDS
from fractus_jax.train.config import TrainConfig


def grown_model_for(cfg: TrainConfig, manifest: dict) -> Optional[TrainConfig]:
    """cfg with the manifest's grown model when its growth records lead from cfg's model
    shape to the manifest's; None when they do not explain the difference."""
    from fractus_jax import grow as grow_lib

    records = manifest.get("growth") or []
    old_model = manifest.get("config", {}).get("model", {})
    if not records:
        return None
    first = records[0].get("from", {})
    if any(getattr(cfg.model, k) != v for k, v in first.items()):
        return None
    others = [k for k in WEIGHT_FIELDS if k not in grow_lib.GROWABLE]
    if any(old_model.get(k) != getattr(cfg.model, k) for k in others):
        return None
    grown = cfg.model.replace(**{k: old_model[k] for k in grow_lib.GROWABLE})
    return dataclasses.replace(cfg, model=grown)


def already_grown(records: list, grow_at: int) -> bool:
    return any(r.get("at_step") == grow_at and r.get("in_place") for r in records)


def grow_in_place(state, cfg: TrainConfig, mesh, step: int, hits=None):
    """(grown state on the mesh, grown TrainConfig, growth record). Raises GrowthError."""
    from fractus_jax import grow as grow_lib
    from fractus_jax.train import state as state_lib

    spec = grow_lib.GrowthSpec(cfg.grow.add_layers, cfg.grow.add_experts, cfg.grow.siren_rank)
    new_cfg = grow_lib.target_config(cfg, spec)
    n_add = new_cfg.model.n_experts - cfg.model.n_experts
    new_phases = None
    if n_add:
        old_phases = np.asarray(jax.device_get(state["params"]["blocks"]["moe"]["expert_phases"]))
        new_phases = grow_lib.new_expert_phases(old_phases, n_add, hits)
    shardings = state_lib.train_state_shardings(new_cfg, mesh)
    grow = jax.jit(grow_lib.grow_state_arrays, static_argnums=(1, 2), out_shardings=shardings)
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step)
    grown = grow(state, cfg, new_cfg, key, new_phases)
    record = {"at_step": step, "in_place": True,
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "add_layers": spec.add_layers, "add_experts": spec.add_experts, "siren_rank": new_cfg.model.siren_rank,
              "from": {k: getattr(cfg.model, k) for k in grow_lib.GROWABLE},
              "to": {k: getattr(new_cfg.model, k) for k in grow_lib.GROWABLE},
              "hits_source": ("probe" if hits is not None else "none") if n_add else None,
              "capacity_per_expert": grow_lib.capacity_change(cfg, new_cfg)}
    return grown, new_cfg, record
