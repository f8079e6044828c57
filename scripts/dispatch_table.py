"""Held-out score and speed of each MoE dispatch choice after the same training
(docs/performance.md, MoE dispatch).

    python scripts/dispatch_table.py --config smoke [--steps N] [--seeds 0 1 2] [--set KEY=VALUE ...] [--json]

For each choice (dropless, cf = 4, cf = 1.25) and each seed the config trains from scratch,
with the same data and steps, into a temporary run directory, and the trainer scores its
held-out slice at the last step (docs/training.md, Held-out evaluation): exact routing,
what the PyTorch engine computes from the export, the carry flowing along each lane. A
config that holds nothing out gets the smoke config's held-out part: the last 1% of the
corpus, its first 4096 ids in 4 lanes. ids/s is the median training step after the first
(compiling) one, as the trainer logs it; a bigram count model of the same training ids
closes the table. With several seeds a cell is the mean over them, and the held-out bpb
also shows the lowest and highest.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train.errors import TrainError
from fractus_jax.train.heldout import bigram_baseline

CHOICES = {"dropless": "none", "cf = 4": "4", "cf = 1.25": "1.25"}
HELD_OUT = ["val_fraction=0.01", "val_ids=4096", "val_lanes=4"]   # smoke's held-out part


def run_choice(base: cfg_lib.TrainConfig, capacity: str, seed: int, workdir: Path) -> dict:
    steps = base.max_steps
    cfg = cfg_lib.apply_overrides(base, [f"model.capacity_factor={capacity}", f"seed={seed}", f"eval_every={steps}",
                                         f"save_every={steps}", "probe_every=0", "log_every=1"])
    lines = loop.run_quietly(cfg, workdir)
    trained = [m for m in lines if "ids_per_s_tf" in m][1:]   # after the compiling step
    last = [m for m in lines if "val_bpb" in m][-1]
    return {"steps": last["step"], "keep_rate": statistics.mean(m["keep_rate"] for m in trained),
            "train_ce_last": trained[-1]["ce_tf"], "ids_per_s": statistics.median(m["ids_per_s_tf"] for m in trained),
            "val_ce": last["val_ce"], "val_bpb": last["val_bpb"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/dispatch_table.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smoke")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's max_steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one training per choice and seed (default: 0)")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = p.parse_args(argv)
    try:
        base = cfg_lib.load_config(args.config)
        if not (base.val_fraction or base.val_corpus):
            base = cfg_lib.apply_overrides(base, HELD_OUT)
        base = cfg_lib.apply_overrides(base, args.overrides)
        if args.steps is not None:
            if args.steps < 2:
                raise cfg_lib.ConfigError(f"--steps must be >= 2 (the first step compiles), got {args.steps}")
            base = cfg_lib.apply_overrides(base, [f"max_steps={args.steps}"])
        if not (base.val_fraction or base.val_corpus):
            raise cfg_lib.ConfigError("the config holds nothing out: set val_fraction or val_corpus")
        base_line = bigram_baseline(base)
    except (cfg_lib.ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, capacity in CHOICES.items():
            for seed in args.seeds:
                print(f"{name}, seed {seed}: training {base.max_steps} steps of {args.config}", file=sys.stderr)
                r = run_choice(base, capacity, seed, Path(tmp) / str(len(runs)))
                runs.append({"dispatch": name, "capacity_factor": capacity, "seed": seed, **r})
                print(f"  keep_rate {r['keep_rate']:.3f}, val_bpb {r['val_bpb']:.4f}, {r['ids_per_s']:.0f} ids/s",
                      file=sys.stderr)
    seeds = ", ".join(map(str, args.seeds))
    print(f"{args.config}, {base.max_steps} steps, seeds {seeds}; held out: the first {base.val_ids} held-out ids "
          f"in {base.val_lanes} lanes of {base.seq_len}-id chunks, exact routing")
    print("| dispatch | keep_rate | train CE (last step) | held-out CE | held-out bpb (lowest–highest) | "
          "ids/s (median step) |")
    print("|---|---|---|---|---|---|")
    for name in CHOICES:
        rs = [r for r in runs if r["dispatch"] == name]
        mean = {k: statistics.mean(r[k] for r in rs) for k in ("keep_rate", "train_ce_last", "val_ce", "val_bpb",
                                                                 "ids_per_s")}
        spread = f" ({min(r['val_bpb'] for r in rs):.3f}–{max(r['val_bpb'] for r in rs):.3f})" if len(rs) > 1 else ""
        print(f"| {name} | {mean['keep_rate']:.3f} | {mean['train_ce_last']:.3f} | {mean['val_ce']:.3f} | "
              f"{mean['val_bpb']:.3f}{spread} | {mean['ids_per_s']:.0f} |")
    print(f"| bigram counts (add-one) of the training ids | | | {base_line['ce']:.3f} | {base_line['bpb']:.3f} | |")
    if args.json:
        print(json.dumps({"runs": runs, "bigram": base_line}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
