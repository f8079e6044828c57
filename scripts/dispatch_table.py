"""Held-out CE of each MoE dispatch choice after the same training (docs/performance.md).

    python scripts/dispatch_table.py --config smoke [--steps N] [--set KEY=VALUE ...] [--json]

For each choice (dropless, cf = 4, cf = 1.25) the config trains from scratch, with the
same seed, data and steps, into a temporary run directory. Then the same held-out ids are
scored: the corpus's last LANES × CHUNKS × seq_len ids (the end of the last lane, which
training never reaches in a short run: the script checks it), in LANES lanes whose carry
flows from chunk to chunk, from a zero carry. Each model is scored twice: as trained (its
own dispatch) and with exact routing (what the PyTorch engine computes from its export).
Bits per byte divide the total nats by ln 2 and by the byte ids (0-255) among the targets.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import model
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import plan as plan_lib

CHOICES = {"dropless": None, "cf=4": 4.0, "cf=1.25": 1.25}
LANES, CHUNKS = 8, 4


def held_out(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """(CHUNKS, LANES, seq_len + 1): the corpus's last ids as lanes of chunks with targets."""
    span = CHUNKS * seq_len + 1
    tail = np.asarray(ids[len(ids) - LANES * span:], np.int32).reshape(LANES, span)
    return np.stack([tail[:, c * seq_len:(c + 1) * seq_len + 1] for c in range(CHUNKS)])


@jax.jit
def _nats(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def score(params, engine, chunks) -> dict:
    forward = jax.jit(model.forward_chunk, static_argnums=3)
    state = model.init_state(engine, chunks.shape[1])
    nats, n_bytes, n_ids = 0.0, 0, 0
    for chunk in chunks:
        logits, _, state = forward(params, state, jnp.asarray(chunk[:, :-1]), engine)
        targets = chunk[:, 1:]
        nats += float(_nats(logits, jnp.asarray(targets)).sum())
        n_ids += targets.size
        n_bytes += int((targets < 256).sum())
    return {"ce": nats / n_ids, "bpb": nats / math.log(2) / n_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/dispatch_table.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smoke")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's max_steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        base = cfg_lib.apply_overrides(cfg_lib.load_config(args.config), args.overrides)
    except cfg_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps = args.steps or base.max_steps
    base = dataclasses.replace(base, max_steps=steps, save_every=steps, probe_every=0, log_every=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cf in CHOICES.items():
            cfg = dataclasses.replace(base, model=base.model.replace(capacity_factor=cf))
            plan = plan_lib.prepare(cfg, Path(tmp) / name, progress=False)
            chunks = held_out(plan.corpus.ids, cfg.seq_len)
            lane = plan.corpus.n_ids // cfg.batch_size
            if plan.start_pos + steps * cfg.accum * cfg.seq_len + 1 > lane - LANES * (CHUNKS * cfg.seq_len + 1):
                print("error: the held-out tail is inside the ids training reads; use fewer steps", file=sys.stderr)
                return 2
            print(f"{name}: training {steps} steps of {args.config}", file=sys.stderr)
            loop.run(plan, progress=False, log=lambda m: None)
            params, _ = ckpt_lib.load_for_inference(Path(tmp) / name)
            metrics = [json.loads(ln) for ln in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()
                       if ln.strip()]
            trained = [m for m in metrics if "ids_per_s_tf" in m][1:]   # after the compiling step
            own = score(params, cfg.model.replace(row_streams=1, moe_shards=1), chunks)
            exact = score(params, cfg.model.replace(row_streams=1, moe_shards=1, capacity_factor=None), chunks)
            rows.append({"dispatch": name, "capacity_factor": cf, "steps": steps,
                         "keep_rate": statistics.mean(m["keep_rate"] for m in trained),
                         "train_ce_last": trained[-1]["ce_tf"],
                         "ids_per_s": statistics.median(m["ids_per_s_tf"] for m in trained),
                         "heldout_ce": own["ce"], "heldout_bpb": own["bpb"],
                         "heldout_ce_exact": exact["ce"], "heldout_bpb_exact": exact["bpb"]})
    print(f"{args.config}, {steps} steps, held-out: the corpus's last {LANES} x {CHUNKS} x {base.seq_len} ids")
    print("| dispatch | keep_rate | train CE (last step) | held-out CE (as trained) | held-out bpb | "
          "held-out CE (exact routing) | ids/s (median step) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dispatch']} | {r['keep_rate']:.3f} | {r['train_ce_last']:.3f} | {r['heldout_ce']:.3f} | "
              f"{r['heldout_bpb']:.3f} | {r['heldout_ce_exact']:.3f} | {r['ids_per_s']:.0f} |")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
