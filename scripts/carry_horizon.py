"""Does the carried thought's value grow or fade with how long the engine has read?
(docs/notes/2026-12-03-carry-decay.md)

    python scripts/carry_horizon.py --run LABEL DIR [--run LABEL DIR ...] [--warm 0,1,16,256,4096]
        [--lanes 4] [--target-chunks 256] [--merge EARLIER.json ...] [--png FILE] [--json]

For each run directory (its latest checkpoint, its config's corpus, held-out part and
chunk length), the held-out part is cut into --lanes lanes of W + M chunks (W the longest
warm-up, M = --target-chunks). Every lane's last M chunks are the targets, scored the same
way for every warm-up length w: the carry starts from zero w chunks before them and
streams through the warm-up and the targets (w = 0: from zero at the first target chunk).
"fresh" scores each target chunk from the initial carry. All rows read the same text, so
the columns differ only by the carry they bring. A BOS in the text restarts its row's
carry inside the engine, as in training, so a warm-up never reaches across a document start.

Along the longest warm-up it also records the carried state (mean over layers and lanes):
|z| (the normaliser, L2 over its d_head entries), |S| (Frobenius) and the relative change
of S over one chunk, |S_k − S_{k−1}| / |S_{k−1}|: how much of the state the newest chunk is.
--png draws both (the plot extra: matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import model
from fractus_jax.atom.features import FEATURE_CONTEXT, atom_features
from fractus_jax.scoring import count_bytes, score_chunk
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.errors import TrainError
from fractus_jax.train.rundir import CheckpointError


@jax.jit
def _norms(before, after):
    """(|z|, |S|, |ΔS| / |S_before|) of each row, the mean over layers and heads (the last nan
    where the state was zero before the chunk)."""
    z = jnp.sqrt(jnp.sum(after["z"] ** 2, -1)).mean((0, 2))
    S = jnp.sqrt(jnp.sum(after["S"] ** 2, (-2, -1)))
    dS = jnp.sqrt(jnp.sum((after["S"] - before["S"]) ** 2, (-2, -1)))
    S_before = jnp.sqrt(jnp.sum(before["S"] ** 2, (-2, -1)))
    rel = jnp.where(S_before > 0, dS / jnp.where(S_before > 0, S_before, 1.0), jnp.nan)   # nan: from zero
    return z, S.mean((0, 2)), jnp.nanmean(rel, (0, 2))


def horizon(run_dir: Path, warms: list[int], lanes: int, target_chunks: int) -> dict:
    step, _, cfg = ckpt_lib.read_step(run_dir)
    params, engine = ckpt_lib.load_for_inference(run_dir, step)
    engine = engine.for_inference()
    ex = cfg.execution.for_inference()
    _, val = prepare_lib.split_corpus(prepare_lib.open_training_corpus(cfg, progress=False), cfg.val_fraction)
    if cfg.val_corpus:
        val = prepare_lib.open_val_corpus(cfg)
    if val is None:
        raise TrainError(f"{run_dir}: its config holds nothing out (val_fraction, val_corpus)")
    C, W, M = cfg.seq_len, max(warms), target_chunks
    lane_len = (W + M) * C + 1
    ids = np.asarray(val.ids[:lanes * lane_len], np.int32)
    if len(ids) < lanes * lane_len:
        raise TrainError(f"{run_dir}: the held-out part has {len(ids)} ids, {lanes} lanes of {W}+{M} chunks of "
                         f"{C} ids need {lanes * lane_len}: fewer lanes, warm-up or target chunks")
    S = len(warms)
    carry = model.init_state(engine, S * lanes)
    nats = np.zeros(S + 1)
    n_bytes = 0
    trace = {"chunk": [], "z": [], "S": [], "rel_dS": []}
    longest = warms.index(W)
    for k in range(W + M):
        rows = np.stack([ids[b * lane_len + k * C:b * lane_len + (k + 1) * C + 1] for b in range(lanes)])
        # stream s restarts from zero at every chunk up to and including W − w_s
        restart = np.repeat([k <= W - w for w in warms], lanes)
        feats = None
        if cfg.feats:
            left = (np.stack([ids[b * lane_len + k * C - FEATURE_CONTEXT:b * lane_len + k * C] for b in range(lanes)])
                    if k * C >= FEATURE_CONTEXT else None)
            feats = jnp.asarray(atom_features(rows[:, :-1], left=left))
        before = carry
        chunk_nats, carry = score_chunk(params, carry, jnp.asarray(restart), jnp.asarray(rows), feats, engine,
                                        ex=ex)
        if k >= W:
            nats += np.asarray(chunk_nats, np.float64)
            n_bytes += count_bytes(rows[:, 1:])
        if k + 1 in (2, 4, 8) or (k + 1) % 16 == 0:     # (after chunk 1 the state before it was zero)
            z, s_norm, rel = (np.nanmean(np.asarray(a).reshape(S, lanes)[longest]) for a in _norms(before, carry))
            for name, value in (("chunk", k + 1), ("z", z), ("S", s_norm), ("rel_dS", rel)):
                trace[name].append(float(value))
    bpb = [float(n / math.log(2) / n_bytes) for n in nats]
    return {"run": str(run_dir), "step": step, "seq_len": C, "carry_decay": engine.carry_decay,
            "lanes": lanes, "target_chunks": M, "n_bytes": n_bytes,
            "bpb": dict(zip([str(w) for w in warms], bpb[:S])), "bpb_fresh": bpb[S], "trace": trace}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, r in results.items():
        warms = [int(w) for w in r["bpb"]]
        x = [max(w, 0.5) for w in warms]
        line, = a.plot(x, list(r["bpb"].values()), "o-", label=label)
        a.axhline(r["bpb_fresh"], color=line.get_color(), ls=":", lw=1)
        ids = [c * r["seq_len"] for c in r["trace"]["chunk"]]
        b.plot(ids, r["trace"]["rel_dS"], label=label, color=line.get_color())
    a.set_xscale("log")
    a.set_xlabel("warm-up before the targets (chunks; 0 drawn at 0.5)")
    a.set_ylabel("held-out bits per byte (dotted: fresh every chunk)")
    a.legend(fontsize=8)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("ids read along the lane")
    b.set_ylabel("|S_k − S_k−1| / |S_k−1| (one chunk's share of the state)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/carry_horizon.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", default=[], nargs=2, metavar=("LABEL", "DIR"),
                   help="a run directory, labelled")
    p.add_argument("--warm", default="0,1,16,256,4096", help="warm-up lengths in chunks (comma-separated)")
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--target-chunks", type=int, default=256)
    p.add_argument("--png", type=Path, default=None, help="draw the figure to this PNG")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="FILE",
                   help="results of an earlier run of this script (its --json output) to table and draw "
                        "with these, in order before them")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = p.parse_args(argv)
    try:
        warms = sorted({int(w) for w in args.warm.split(",")})
        if warms[0] < 0 or args.lanes < 1 or args.target_chunks < 1:
            raise ValueError("warm-up lengths must be >= 0, --lanes and --target-chunks >= 1")
        runs = dict(args.run)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {}
    for path in args.merge:
        try:
            results.update(json.loads(path.read_text().strip().splitlines()[-1]))
        except (OSError, ValueError, IndexError) as e:
            print(f"error: {path}: not this script's --json output ({e})", file=sys.stderr)
            return 2
    if not results and not runs:
        print("error: nothing to score: give --run LABEL DIR (or --merge FILE)", file=sys.stderr)
        return 2
    for label, d in runs.items():
        try:
            results[label] = horizon(Path(d), warms, args.lanes, args.target_chunks)
        except (TrainError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        r = results[label]
        print(f"{label}: " + ", ".join(f"w={w} {v:.3f}" for w, v in r["bpb"].items()) +
              f", fresh {r['bpb_fresh']:.3f} bits per byte ({r['n_bytes']} bytes)", file=sys.stderr, flush=True)
    print("| run | " + " | ".join(f"warm {w}" for w in warms) + " | fresh every chunk |")
    print("|---|" + "---|" * (len(warms) + 1))
    for label, r in results.items():
        print(f"| {label} | " + " | ".join(f"{v:.3f}" for v in r["bpb"].values()) + f" | {r['bpb_fresh']:.3f} |")
    print()
    marks = [c for c in (16, 256, 1024, 4096) if any(c in r["trace"]["chunk"] for r in results.values())]
    print("| run | " + " | ".join(f"|z|, |S|, ΔS share after {c} chunks" for c in marks) + " |")
    print("|---|" + "---|" * len(marks))
    for label, r in results.items():
        t = r["trace"]
        # a run of longer chunks reads fewer of them: its trace stops earlier
        cells = [f"{t['z'][t['chunk'].index(c)]:.3g}, {t['S'][t['chunk'].index(c)]:.3g}, "
                 f"{t['rel_dS'][t['chunk'].index(c)]:.2g}" if c in t["chunk"] else "" for c in marks]
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.png:
        plot(results, args.png)
        print(f"figure: {args.png}", file=sys.stderr)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
