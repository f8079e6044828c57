"""A run's memory before renting the machine: compile the real train step ahead of time on
abstract arrays (nothing is allocated) and report per-device bytes and FLOPs.

`plan_memory(cfg)` gives {"per_device": {argument_bytes, output_bytes, alias_bytes,
temp_bytes, total_bytes}, "flops_per_step" (analytic model FLOPs of the whole step),
"ids_per_step", ...}; total = argument + output − alias + temp (XLA's CPU peak figure
leaves temp out). The command line is ``python -m fractus_jax.plan`` (docs/sharding.md).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from fractus_jax import sharding
from fractus_jax.flops import train_flops_per_id
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train.step import abstract_batch, batch_shardings, jit_train_step

GIB = 1024 ** 3   # the unit the reports print bytes in


def plan_memory(cfg) -> dict:
    """Compile cfg's train step for its mesh on abstract arrays; memory and cost."""
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    abstract = state_lib.abstract_train_state(cfg)
    shardings = state_lib.train_state_shardings(cfg, mesh, abstract)
    state_in = ckpt_lib.abstract_with_shardings(abstract, shardings)
    batch_shard = batch_shardings(cfg, mesh)
    batch_in = abstract_batch(cfg, batch_shard)
    compiled = jit_train_step(cfg, shardings, batch_shard).lower(state_in, batch_in).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    per_device = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
    }
    per_device["total_bytes"] = (per_device["argument_bytes"] + per_device["output_bytes"]
                                 - per_device["alias_bytes"] + per_device["temp_bytes"])
    n_devices = cfg.mesh.data * cfg.mesh.fsdp

    def shard_bytes(tree, shard_tree):
        total = 0
        for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shard_tree)):
            shape = s.shard_shape(leaf.shape)
            total += int(np.prod(shape)) * leaf.dtype.itemsize
        return total

    return {
        "config": {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "accum": cfg.accum,
                   "optimizer": cfg.optimizer, "remat": cfg.execution.remat, "dtype": cfg.execution.compute_dtype,
                   "mesh": dataclasses.asdict(cfg.mesh), "moe_group_rows": cfg.model.moe_group_rows},
        "devices": n_devices,
        "per_device": per_device,
        "params_bytes_per_device": shard_bytes(abstract["params"], shardings["params"]),
        "opt_state_bytes_per_device": shard_bytes(abstract["opt_state"], shardings["opt_state"]),
        "unsharded": sharding.unsharded_dims(abstract["params"], mesh),
        # XLA's count sees each loop body once (layer scan, block scan): kept for reference;
        # flops_per_step is the analytic model count of fractus_jax/flops.py.
        "xla_flops_per_step_per_device": float(cost.get("flops", float("nan"))) if cost else None,
        "flops_per_step": train_flops_per_id(cfg.model) * cfg.batch_size * cfg.seq_len * cfg.accum,
        "ids_per_step": cfg.batch_size * cfg.seq_len * cfg.accum,
        "backend": jax.default_backend(),
    }
