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

import jax

from fractus_jax.train import config as cfg_lib
from fractus_jax.train.config import MeshConfig, resolve_for_mesh
from fractus_jax.train.memory import GIB, plan_memory

# The command line of fractus_jax.train.memory; this module's docstring is its --help text.


def _fake_devices(n: int) -> None:
    """N host devices on a CPU machine: set before the first array makes jax pick its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


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
    result = plan_memory(cfg)
    d = result["per_device"]
    print(f"{args.config}: batch {cfg.batch_size} x seq {cfg.seq_len} x accum {cfg.accum}, {cfg.optimizer}, "
          f"remat {cfg.execution.remat}, {cfg.execution.compute_dtype}, mesh data={cfg.mesh.data} fsdp={cfg.mesh.fsdp}")
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
