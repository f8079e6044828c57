"""Held-out bits per byte of carry-reset schedules and recipes beside a bigram baseline
(docs/training.md, Carry resets).

    python scripts/carry_table.py [--config smoke] [--table 64x16|8x128] [--rows SUBSTRING ...]
        [--set KEY=VALUE ...] [--json]
    python scripts/carry_table.py --config bench_small --table study [--minutes 10] [--rows ...]

Each row trains the config from scratch (same seed, same lanes) into a temporary run
directory with the row's overrides, then reads the trainer's held-out score at its last
step, each of the val_lanes lanes read chunk after chunk from a zero carry: val_bpb with
the carry restarted on the row's schedule (as it trained), val_bpb_warm with the carry
streamed along the whole lane, val_bpb_no_carry with every chunk from the initial carry. The bigram row (fractus_jax.bigram, add-one) is fitted on the ids the
lanes read and scores the same targets with the same denominator. --table picks the
lanes' shape (batch_size x seq_len, set on the config before anything else) and its rows.
Rows set every field they vary, so the table does not depend on the config's current
defaults. --rows keeps the rows whose label contains one of the substrings.

The study table (--table study, bench_small's body on the embedded corpus) gives every row
the same wall time instead of the same steps: each trains under `deadline` = its start +
--minutes (9) (compiling included, so a row that compiles longer trains less) and is then scored
from its last checkpoint on 65536 held-out ids in 4 lanes of 16384 (the carry warmed along
each lane over 1024 chunks), with the speech gate (unique ids and bytes among 40 greedy ids,
decoded as the row trained: a window of accum·seq_len ids when every step started from a
fresh carry, else the carry streamed) and the median ids/s of its logged steps. Run it on
one core with nothing else on it for the wall times to compare:
    taskset -c 1 python scripts/carry_table.py --config bench_small --table study --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fractus_jax.config import decay_ladder
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import probes as probes_lib
from fractus_jax.train.errors import TrainError
from fractus_jax.train.heldout import HeldOut, bigram_baseline

CONSTANT = ["lr_schedule=constant", "decay_steps=0", "lr_floor=0"]
RECIPE_60 = ["lr=3e-3", "warmup_steps=10", "max_steps=60", *CONSTANT]     # smoke's recipe before resets
NO_RESET = ["carry_reset_every=0", "carry_reset_prob=0"]
RUNNING_SUM = ["model.learn_carry_decay=false", "model.carry_decay=none"]   # the parent's carry (smoke's own
# is a learned decay)
EVERY_STEP = ["carry_reset_every=1", "carry_reset_prob=0"]
LR_6E3 = ["lr=6e-3", "warmup_steps=10", *CONSTANT]
FIGURES = ("val_ce", "val_bpb", "val_ce_warm", "val_bpb_warm", "val_ce_no_carry", "val_bpb_no_carry")

# The study's recipe: AdamW at a constant rate after a short warmup (a deadline ends each row
# at a step nobody knows in advance, so no decay), 1% held out, 65536 held-out ids in 4 lanes.
STUDY = ["optimizer=adamw", "lr=3e-3", "warmup_steps=50", *CONSTANT, "weight_decay=0.01", "max_steps=1000000",
         "val_fraction=0.01", "val_ids=65536", "val_lanes=4", "eval_every=0", "probe_every=0", "log_every=25",
         "save_every=1000000"]


def bptt(k: int) -> list[str]:
    """k chunks of each lane a step, the gradient through the carry across them."""
    return [f"accum={k}", f"bptt_chunks={k}"]


def cosine(steps: int) -> list[str]:
    """The rate decayed by a cosine from lr to a tenth of the study's lr over `steps` after warmup
    (sized to the steps a row's budget allows, so the rate reaches its floor near the deadline)."""
    return ["lr_schedule=cosine", f"decay_steps={steps}", "lr_floor=3e-4"]


def ladder(horizon: float) -> list[str]:
    """A fixed carry decay: a golden-ratio ladder of horizons from `horizon` ids (2 levels); a
    row that learns it sets model.learn_carry_decay=true after."""
    return ["model.learn_carry_decay=false",
            "model.carry_decay=" + ",".join(f"{g:.6g}" for g in decay_ladder(horizon, 2))]


# Each table: the lanes' shape (set on the base, so the bigram scores the same targets) and its rows.
TABLES = {
    # smoke's shape: 64 lanes of 16-id chunks
    "64x16": (["batch_size=64", "seq_len=16", *RUNNING_SUM, *bptt(1)], [
        ("no reset, lr 6e-3, 300 steps", [*LR_6E3, "max_steps=300", *NO_RESET]),
        ("reset every 4 steps, lr 6e-3, 300 steps", [*LR_6E3, "max_steps=300", "carry_reset_every=4",
                                                     "carry_reset_prob=0"]),
        ("reset p=0.25, lr 6e-3, 300 steps", [*LR_6E3, "max_steps=300", "carry_reset_every=0",
                                              "carry_reset_prob=0.25"]),
        ("reset every step, lr 6e-3, 100 steps", [*LR_6E3, "max_steps=100", *EVERY_STEP]),
        ("reset every step, lr 6e-3, 200 steps (smoke)", [*LR_6E3, "max_steps=200", *EVERY_STEP]),
        ("reset every step, lr 6e-3, 300 steps", [*LR_6E3, "max_steps=300", *EVERY_STEP]),
    ]),
    # smoke's former shape: 8 lanes of 128-id chunks
    "8x128": (["batch_size=8", "seq_len=128", *RUNNING_SUM, *bptt(1)], [
        ("no reset, lr 3e-3, 60 steps", RECIPE_60 + NO_RESET),
        ("reset every 4 steps, lr 3e-3, 60 steps", RECIPE_60 + ["carry_reset_every=4", "carry_reset_prob=0"]),
        ("reset p=0.25, lr 3e-3, 60 steps", RECIPE_60 + ["carry_reset_every=0", "carry_reset_prob=0.25"]),
        ("reset p=0.5, lr 3e-3, 60 steps", RECIPE_60 + ["carry_reset_every=0", "carry_reset_prob=0.5"]),
        ("reset every step, lr 3e-3, 60 steps", RECIPE_60 + EVERY_STEP),
        ("reset every step, lr 6e-3, 60 steps", [*LR_6E3, "max_steps=60", *EVERY_STEP]),
        ("reset every step, lr 3e-3, 100 steps", ["lr=3e-3", "warmup_steps=10", "max_steps=100", *CONSTANT,
                                                  *EVERY_STEP]),
        ("reset every step, lr 6e-3, 100 steps", [*LR_6E3, "max_steps=100", *EVERY_STEP]),
        ("no reset, lr 6e-3, 100 steps", [*LR_6E3, "max_steps=100", *NO_RESET]),
    ]),
    # bench_small's body on smoke's lanes (64 of 16-id chunks: 8 lanes of 128 read a few
    # files' worth, and a 10-minute row of them scored 5.3 bits per byte, the bigram 3.9),
    # equal wall time per row (--minutes)
    "study": (["batch_size=64", "seq_len=16", *STUDY, *RUNNING_SUM], [
        ("carry streamed, K=1", [*bptt(1), *NO_RESET]),
        ("reset every step, K=1", [*bptt(1), *EVERY_STEP]),
        ("K=4, reset every 4 chunks", [*bptt(4), *EVERY_STEP]),
        ("K=8, reset every 8 chunks", [*bptt(8), *EVERY_STEP]),
        ("reset p=0.25, K=1", [*bptt(1), "carry_reset_every=0", "carry_reset_prob=0.25"]),
        ("K=4, carry streamed", [*bptt(4), *NO_RESET]),
    ]),
    # smoke's body on smoke's lanes, equal wall time per row (--minutes 20): the carry that
    # forgets (model.carry_decay, a golden-ratio ladder of horizons) against the restart recipe
    "carry": (["batch_size=64", "seq_len=16", *STUDY], [
        ("restart every chunk, K=1 (smoke's former recipe)", [*bptt(1), *EVERY_STEP, *RUNNING_SUM]),
        ("carry streamed, K=1 (the PyTorch trainers')", [*bptt(1), *NO_RESET, *RUNNING_SUM]),
        ("decay ladder h=10, streamed, K=1", [*bptt(1), *NO_RESET, *ladder(10)]),
        ("decay ladder h=10, streamed, K=4", [*bptt(4), *NO_RESET, *ladder(10)]),
        ("decay ladder h=10, 64-id chunks, streamed, K=1", ["batch_size=16", "seq_len=64", *bptt(1), *NO_RESET,
                                                             *ladder(10)]),
        ("decay ladder h=32, streamed, K=4", [*bptt(4), *NO_RESET, *ladder(32)]),
        ("decay ladder h=4, streamed, K=4", [*bptt(4), *NO_RESET, *ladder(4)]),
        ("running sum, streamed, K=4", [*bptt(4), *NO_RESET, *RUNNING_SUM]),
        ("learned decay from ladder h=10, streamed, K=4", [*bptt(4), *NO_RESET, *ladder(10),
                                                           "model.learn_carry_decay=true"]),
        ("learned decay from ladder h=10, 32-id chunks, streamed, K=4", [
            "batch_size=32", "seq_len=32", *bptt(4), *NO_RESET, *ladder(10), "model.learn_carry_decay=true"]),
        ("learned decay from ladder h=10, 64-id chunks, streamed, K=4", [
            "batch_size=16", "seq_len=64", *bptt(4), *NO_RESET, *ladder(10), "model.learn_carry_decay=true"]),
        ("learned decay from ladder h=10, 32-id chunks, streamed, K=8", [
            "batch_size=32", "seq_len=32", *bptt(8), *NO_RESET, *ladder(10), "model.learn_carry_decay=true"]),
        # the best row's recipe with the rate decayed to the budget's end: 4820 steps in 20
        # minutes and 15430 in 60 at the constant rate, on one core
        ("cosine over 4750 steps (20 minutes), learned decay h=10, 32-id chunks, K=4", [
            "batch_size=32", "seq_len=32", *bptt(4), *NO_RESET, *ladder(10), "model.learn_carry_decay=true",
            *cosine(4750)]),
        ("cosine over 15300 steps (60 minutes), learned decay h=10, 32-id chunks, K=4", [
            "batch_size=32", "seq_len=32", *bptt(4), *NO_RESET, *ladder(10), "model.learn_carry_decay=true",
            *cosine(15300)]),
    ]),
}
TIMED = {"study", "carry"}   # tables whose rows get equal wall time (--minutes), not their own steps


def row_dir_name(label: str) -> str:
    """A row's label as a directory name: letters, digits and = kept, the rest one underscore."""
    return "_".join("".join(ch if ch.isalnum() or ch == "=" else " " for ch in label).split())


def run_row(base: cfg_lib.TrainConfig, overrides: list[str], workdir: Path) -> dict:
    cfg = cfg_lib.apply_overrides(base, overrides)
    cfg = cfg_lib.apply_overrides(cfg, [f"eval_every={cfg.max_steps}", f"save_every={cfg.max_steps}",
                                        "probe_every=0", f"log_every={cfg.max_steps}"])
    last = [m for m in loop.run_quietly(cfg, workdir) if "val_bpb" in m][-1]
    return {"steps": last["step"], **{k: last[k] for k in FIGURES}}


def run_timed_row(base: cfg_lib.TrainConfig, overrides: list[str], workdir: Path, minutes: float) -> dict:
    """Train until a deadline `minutes` from now, then score the last checkpoint held out
    and run the speech gate."""
    cfg = cfg_lib.apply_overrides(base, overrides)
    cfg = cfg_lib.apply_overrides(cfg, [f"deadline={time.time() + 60 * minutes:.0f}"])
    records = loop.run_quietly(cfg, workdir)
    params, _ = ckpt_lib.load_for_inference(workdir)
    train, val = prepare_lib.split_corpus(prepare_lib.open_training_corpus(cfg, progress=False), cfg.val_fraction)
    held = HeldOut(cfg, val).run(params)
    prober = probes_lib.Prober(cfg, train)
    speech = prober.run(params)
    rates = [m["ids_per_s_tf"] for m in records if "ids_per_s_tf" in m]
    return {"steps": max(m["step"] for m in records if "step" in m),
            "ids_per_step": cfg.batch_size * cfg.seq_len * cfg.accum,
            **{k: held[k] for k in FIGURES},
            "speech_unique_ids": speech["speech_unique_ids"], "speech_unique_bytes": speech["speech_unique_bytes"],
            "speech_text": speech["speech_text"], "speech_mode": prober.speech_mode,
            "ids_per_s": statistics.median(rates) if rates else None}


def print_timed(args, base, base_line, out) -> None:
    print(f"{args.config} body, {base.batch_size} lanes of {base.seq_len}-id chunks, {args.minutes:g} minutes a row: "
          f"held-out bits per byte on the first {base.val_ids} held-out ids in {base.val_lanes} lanes "
          f"({base_line['n_ids']} targets, {base_line['n_bytes']} bytes)")
    print("| row | steps | ids/s | bpb, as trained | bpb, warmed on the lane | bpb, fresh every chunk "
          "| speech: unique ids / bytes (decode) |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        mode = r["speech_mode"]["mode"] + (f" {r['speech_mode']['window']}" if r["speech_mode"].get("window") else "")
        print(f"| {r['row']} | {r['steps']} | {r['ids_per_s']:.0f} | {r['val_bpb']:.3f} | {r['val_bpb_warm']:.3f} "
              f"| {r['val_bpb_no_carry']:.3f} | {r['speech_unique_ids']} / {r['speech_unique_bytes']} ({mode}) |")
    b = f"{base_line['bpb']:.3f}"
    print(f"| bigram counts (add-one) of the training ids | | | {b} | {b} | {b} | |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/carry_table.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smoke")
    p.add_argument("--table", choices=sorted(TABLES), default="64x16",
                   help="the lanes' shape and its rows (default: 64x16, smoke's)")
    p.add_argument("--rows", nargs="*", default=None, metavar="SUBSTRING", help="only the rows whose label has one")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="applied to every row before its own overrides")
    p.add_argument("--minutes", type=float, default=9.0,
                   help="the wall time of each row of a timed table (study), compiling included")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep each row's run directory under DIR (named by the row's label), to score, "
                        "decode or plot it later; by default they are temporary. A row whose directory "
                        "holds a run resumes it: a timed row then trains --minutes more")
    args = p.parse_args(argv)
    try:
        shape, table = TABLES[args.table]
        base = cfg_lib.apply_overrides(cfg_lib.load_config(args.config), shape + args.overrides)
        if not (base.val_fraction or base.val_corpus):
            raise cfg_lib.ConfigError(f"{args.config} holds nothing out: set val_fraction or val_corpus")
        rows = [(label, o) for label, o in table if args.rows is None or any(s in label for s in args.rows)]
        base_line = bigram_baseline(base)
    except (cfg_lib.ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, overrides) in enumerate(rows):
            print(f"{label}: training ({' '.join(overrides)})", file=sys.stderr, flush=True)
            workdir = Path(tmp) / str(i) if args.keep is None else args.keep / row_dir_name(label)
            if args.table in TIMED:
                r = run_timed_row(base, overrides, workdir, args.minutes)
            else:
                r = run_row(base, overrides, workdir)
            out.append({"row": label, "overrides": overrides, **r})
            print(f"  val_bpb {r['val_bpb']:.4f} as trained, {r['val_bpb_warm']:.4f} warmed along the lane, "
                  f"{r['val_bpb_no_carry']:.4f} from a fresh carry" +
                  (f"; {r['steps']} steps, {r['ids_per_s']:.0f} ids/s, speech {r['speech_unique_ids']} ids / "
                   f"{r['speech_unique_bytes']} bytes: {r['speech_text']!r}" if args.table in TIMED else ""),
                  file=sys.stderr, flush=True)
            if args.json:
                print(json.dumps({"row": out[-1]}), file=sys.stderr, flush=True)
    if args.table in TIMED:
        print_timed(args, base, base_line, out)
        if args.json:
            print(json.dumps({"rows": out, "bigram": base_line}))
        return 0
    print(f"{args.config}: held-out bits per byte, the first {base.val_ids} held-out ids in {base.val_lanes} lanes "
          f"of {base.seq_len}-id chunks ({base_line['n_ids']} targets, {base_line['n_bytes']} bytes)")
    print("| schedule, recipe | steps | bpb, carry as trained | bpb, carry warmed on the lane "
          "| bpb, fresh carry every chunk |")
    print("|---|---|---|---|---|")
    for r in out:
        print(f"| {r['row']} | {r['steps']} | {r['val_bpb']:.3f} | {r['val_bpb_warm']:.3f} "
              f"| {r['val_bpb_no_carry']:.3f} |")
    b = f"{base_line['bpb']:.3f}"
    print(f"| bigram counts (add-one) of the training ids | | {b} | {b} | {b} |")
    if args.json:
        print(json.dumps({"rows": out, "bigram": base_line}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
