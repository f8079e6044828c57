"""Plan a run's memory before renting the machine: compile the real train step ahead of
time on abstract arrays (nothing is allocated) and report per-device bytes and FLOPs.

    python -m fractus_jax.plan --config atom_1b --devices 8 [--set key=value ...] [--json]

On a CPU machine `--devices N` fakes N host devices. Without a mesh in the config or
the overrides, the N devices form one fsdp axis. The last line with --json is one JSON
object: {"per_device": {argument_bytes, output_bytes, alias_bytes, temp_bytes,
total_bytes}, "flops_per_step" (analytic model FLOPs of the whole step), "ids_per_step",
...}; total = argument + output − alias + temp (XLA's CPU peak figure leaves temp out).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

GIB = 1024 ** 3


def _fake_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def plan(cfg) -> dict:
    """Compile cfg's train step for its mesh on abstract arrays; memory and cost."""
    import jax
    import numpy as np

    from fractus_jax import sharding
    from fractus_jax.bench.flops import train_flops_per_id
    from fractus_jax.train import checkpoint as ckpt_lib
    from fractus_jax.train import state as state_lib
    from fractus_jax.train.step import abstract_batch, batch_shardings, jit_train_step

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
                   "optimizer": cfg.optimizer, "remat": cfg.model.remat, "dtype": cfg.model.compute_dtype,
                   "mesh": dataclasses.asdict(cfg.mesh), "moe_group_rows": cfg.model.moe_group_rows},
        "devices": n_devices,
        "per_device": per_device,
        "params_bytes_per_device": shard_bytes(abstract["params"], shardings["params"]),
        "opt_state_bytes_per_device": shard_bytes(abstract["opt_state"], shardings["opt_state"]),
        "unsharded": sharding.unsharded_dims(abstract["params"], mesh),
        # XLA's count sees each loop body once (layer scan, block scan): kept for reference;
        # flops_per_step is the analytic model count of fractus_jax/bench/flops.py.
        "xla_flops_per_step_per_device": float(cost.get("flops", float("nan"))) if cost else None,
        "flops_per_step": train_flops_per_id(cfg.model) * cfg.batch_size * cfg.seq_len * cfg.accum,
        "ids_per_step": cfg.batch_size * cfg.seq_len * cfg.accum,
        "backend": jax.default_backend(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.devices < 1:
        print("error: --devices must be >= 1", file=sys.stderr)
        return 2
    _fake_devices(args.devices)
    import jax

    from fractus_jax.train import config as cfg_lib
    from fractus_jax.train.config import MeshConfig
    from fractus_jax.train.config import resolve_for_mesh

    try:
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config(args.config), args.overrides)
    except cfg_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.mesh.data * cfg.mesh.fsdp == 1 and args.devices > 1:
        cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1, fsdp=args.devices))
    n = cfg.mesh.data * cfg.mesh.fsdp
    if n != args.devices or n > jax.device_count():
        print(f"error: mesh data={cfg.mesh.data} x fsdp={cfg.mesh.fsdp} = {n} devices, --devices {args.devices}, "
              f"{jax.device_count()} available", file=sys.stderr)
        return 2
    if cfg.batch_size % n:
        print(f"error: batch_size {cfg.batch_size} is not divisible by {n} devices", file=sys.stderr)
        return 2
    cfg = resolve_for_mesh(cfg)
    result = plan(cfg)
    d = result["per_device"]
    print(f"{args.config}: batch {cfg.batch_size} x seq {cfg.seq_len} x accum {cfg.accum}, {cfg.optimizer}, "
          f"remat {cfg.model.remat}, {cfg.model.compute_dtype}, mesh data={cfg.mesh.data} fsdp={cfg.mesh.fsdp}")
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes"):
        print(f"  {key:<16} {d[key] / GIB:8.2f} GiB per device")
    print(f"  params {result['params_bytes_per_device'] / GIB:.2f} GiB, optimizer state "
          f"{result['opt_state_bytes_per_device'] / GIB:.2f} GiB per device")
    print(f"  {result['flops_per_step'] / 1e12:.2f} TFLOP per step (analytic model FLOPs, all devices), "
          f"{result['ids_per_step']} ids per step")
    for line in result["unsharded"]:
        print(f"  replicated: {line}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
