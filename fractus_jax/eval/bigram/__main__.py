"""A bigram count baseline for the held-out score (docs/training.md, Carry resets).

    python -m fractus_jax.eval.bigram [--config smoke] [--set KEY=VALUE ...] [--alpha A] [--json]

Counts every adjacent pair (a, b) of the ids the run's lanes read (the corpus before its
held-out end), then scores the trainer's held-out slice (the first val_ids ids of the
held-out part, in val_lanes lanes, chunks of seq_len: the targets `fractus_jax.scoring`
scores) with p(b | a) = (n(a, b) + alpha) / (n(a) + alpha·V), add-alpha smoothing over
the V ids of the vocabulary (alpha 1: add-one). Each target's previous id is the id
before it in its lane, as the engine's input there is. Bits per byte use eval's
denominator: total nats / ln 2 / the byte ids (0-255) among the targets.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

from fractus_jax.train import config as cfg_lib
from fractus_jax.train.errors import TrainError
from fractus_jax.train.heldout import bigram_baseline


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.eval.bigram", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smoke", help="the run's config (its corpus, val_* fields, seq_len)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--alpha", type=float, default=1.0, help="add-alpha smoothing (default 1: add-one)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    try:
        if not (args.alpha > 0 and math.isfinite(args.alpha)):
            raise cfg_lib.ConfigError(f"--alpha must be > 0 and finite, got {args.alpha}")
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config(args.config), args.set)
        if not (cfg.val_fraction or cfg.val_corpus):
            raise cfg_lib.ConfigError("the config holds nothing out: set val_fraction or val_corpus")
        out = bigram_baseline(cfg, args.alpha, progress=not args.json)
    except (cfg_lib.ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(f"bigram (add-{args.alpha:g}) fitted on {out['train_ids']} ids: held-out ce {out['ce']:.4f} nats/id, "
              f"{out['bpb']:.4f} bits/byte ({out['n_ids']} ids, {out['n_bytes']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
