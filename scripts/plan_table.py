#!/usr/bin/env python3
"""The docs/sharding.md memory table: `python -m fractus_jax.plan` for each batch, remat and
device count, each in its own process (the fake device count is fixed per process).

    python scripts/plan_table.py [--config atom_1b] [--batches 8 16 32] [--devices 1 8]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from fractus_jax.train.memory import GIB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="atom_1b")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    print("| devices | batch | remat | params+opt GiB/dev | temp GiB/dev | total GiB/dev |")
    print("|---|---|---|---|---|---|")
    for devices in args.devices:
        for batch in args.batches:
            for remat in ("true", "false"):
                cmd = [sys.executable, "-m", "fractus_jax.plan", "--config", args.config, "--devices", str(devices),
                       "--json", f"--set=batch_size={batch}", f"--set=execution.remat={remat}",
                       *[f"--set={o}" for o in args.overrides]]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"| {devices} | {batch} | {remat} | failed: {out.stderr.strip()[-200:]} | | |")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                d = r["per_device"]
                state = (r["params_bytes_per_device"] + r["opt_state_bytes_per_device"]) / GIB
                print(f"| {devices} | {batch} | {remat} | {state:.2f} | {d['temp_bytes'] / GIB:.2f} | "
                      f"{d['total_bytes'] / GIB:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
