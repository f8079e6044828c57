"""Grow a run's body: more layers, more experts, a larger expert rank (docs/growth.md).

    python -m fractus_jax.grow --ckpt DIR_OR_STEP --out NEW_DIR [--add-layers N] [--add-experts N]
                               [--siren-rank R] [--set model.FIELD=VALUE ...] [--hits auto|probe|metrics|none]

Writes a run directory the trainer resumes from (with the grown shape given as --set
model.FIELD=VALUE, printed at the end). The last line is the growth record as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

from fractus_jax.atom.corpus import CorpusError
from fractus_jax.grow import run as grow_run
from fractus_jax.growth import GrowthError, GrowthSpec
from fractus_jax.train import store
from fractus_jax.train.rundir import CheckpointError, read_manifest
from fractus_jax.urls import local_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fractus_jax.grow", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="DIR_OR_STEP", type=store.workdir_arg,
                   help="a run directory (its latest checkpoint) or DIR/checkpoints/<step>")
    p.add_argument("--out", required=True, metavar="DIR", type=store.workdir_arg,
                   help="the new run directory (absent or empty), or an s3:// or gs:// URL that holds no run")
    p.add_argument("--add-layers", type=int, default=0, metavar="N", help="blocks appended after the last one")
    p.add_argument("--add-experts", type=int, default=0, metavar="N", help="experts added to every layer")
    p.add_argument("--siren-rank", type=int, default=None, metavar="R", help="the new expert rank (>= the current)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="model.FIELD=VALUE",
                   help="change the source's engine config first (a shape field set here is growth too)")
    p.add_argument("--hits", default="auto", choices=("auto", "probe", "metrics", "none"),
                   help="where the busiest experts come from: the probe chunk's routing (auto, when the "
                        "corpus is readable), the last logged probe expert_hits, or none (widest gaps)")
    p.add_argument("--probe-rows", type=int, default=8, metavar="N",
                   help="rows of the next batch on which the change is measured (default 8)")
    p.add_argument("--corpus", metavar="FILE", type=local_path, help="the corpus, if it moved since training")
    p.add_argument("--seed", type=int, default=0, help="seed of the new tensors (folded with the step)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warn = lambda msg: print(f"warning: {msg}", file=sys.stderr)  # noqa: E731
    try:
        spec = GrowthSpec(args.add_layers, args.add_experts, args.siren_rank)
        ckpt = store.readable(args.ckpt, log=lambda m: print(m, file=sys.stderr))
        with store.new_run(args.out, log=lambda m: print(m, file=sys.stderr)) as out:
            record = grow_run.grow_run(ckpt, out, spec, args.overrides, hits=args.hits,
                                       probe_rows=args.probe_rows, corpus=args.corpus, seed=args.seed, log=warn)
            growth = read_manifest(out)["growth"]
    except (GrowthError, CheckpointError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    frm, to = record["from"], record["to"]
    print(f"{args.out}: step {record['at_step']}, " + ", ".join(
        f"{k} {frm[k]} -> {to[k]}" for k in to if to[k] != frm[k]))
    print(f"probe ({record['probe']}): {record['rerouted_fraction']:.2%} of {record['tokens']} tokens rerouted, "
          f"max logit change {record['max_logit_change']:.3g}, changed {record['changed_fraction']:.2%}")
    cap = record.get("capacity_per_expert")
    if cap and cap["before"] != cap["after"]:
        print(f"capacity per expert per group of {cap['group_tokens']} tokens: {cap['before']} -> {cap['after']}")
    print("resume with the run's trainer command plus: " + " ".join(f"--set {o}" for o in grow_run.resume_overrides(growth)))
    print(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
