"""The held-out score of a run: CE per id and bits per byte (docs/training.md).

    python -m fractus_jax.eval --ckpt RUN_DIR|RUN_DIR/checkpoints/STEP [--step N]
        [--corpus FILE] [--ids N] [--lanes B] [--chunk C] [--json] [--no-progress]

--corpus is an id file like the trainer's (.u16, .i16, .npy, int32 .bin); make one from
text the run did not train on with `python -m fractus_jax.atom build --src TEXT --out
FILE.u16`. Without --corpus, the part the run held out (its val_fraction's end of the
corpus, or its val_corpus). The ids are cut into B lanes (default: the run's batch_size)
read in chunks of C (default: its seq_len). `ce` streams the carry from chunk to chunk
and restarts it on the run's carry_reset_every / carry_reset_prob, as in training;
`ce_warm` streams it along the whole lane, never restarted; `ce_no_carry` scores each
chunk from a zero carry.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from fractus_jax.atom import corpus as corpus_lib
from fractus_jax.atom.corpus import CorpusError
from fractus_jax.lanes import LaneError
from fractus_jax.scoring import Scorer
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import store
from fractus_jax.train.heldout import carry_schedule
from fractus_jax.train.rundir import CheckpointError
from fractus_jax.urls import local_path

BUILD_HINT = "make one from text with: python -m fractus_jax.atom build --src TEXT_FILE --out HELD_OUT.u16"


class _UserError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="DIR_OR_STEP", type=store.workdir_arg,
                   help="a run directory (its newest good checkpoint) or DIR/checkpoints/<step>")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest good one)")
    p.add_argument("--corpus", default=None, metavar="FILE", type=local_path,
                   help="held-out id file (default: the part the run held out)")
    p.add_argument("--ids", type=int, default=None, metavar="N", help="score the first N ids (default: all)")
    p.add_argument("--lanes", type=int, default=None, metavar="B", help="lanes (default: the run's batch_size)")
    p.add_argument("--chunk", type=int, default=None, metavar="C", help="chunk length (default: the run's seq_len)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def held_out_ids(run, meta: dict, cfg, corpus: Optional[str]):
    """(ids, a description) of what to score: --corpus, else the run's held-out part. run: the
    run as its messages name it."""
    vocab = cfg.model.vocab_size
    if corpus:
        c = corpus_lib.open_corpus(corpus)
        c.validate(vocab=vocab)
        return c.ids, str(c.path)
    if cfg.val_corpus:
        c = corpus_lib.open_corpus(cfg.val_corpus)
        c.validate(vocab=vocab)
        return c.ids, f"{c.path} (the run's val_corpus)"
    if cfg.val_fraction:
        path = (meta.get("corpus") or {}).get("path") or cfg.corpus
        if not path:
            raise _UserError(f"{run}: the run records no corpus path; pass --corpus FILE")
        c = corpus_lib.open_corpus(path)
        why = c.prefix_change(meta.get("corpus") or {})
        if why is not None:
            raise _UserError(f"{why}: the run's held-out part is not the same text there; pass --corpus FILE")
        # the held-out range fixed at the run's start (text appended since is not in it)
        held = meta.get("held_out") or {}
        start = int(held.get("start", meta.get("train_ids", c.n_ids - int(c.n_ids * cfg.val_fraction))))
        ids = c.ids[start:start + int(held["n_ids"])] if "n_ids" in held else c.ids[start:]
        c.validate(vocab=vocab)
        return ids, f"the {len(ids)} ids held out at the end of {c.path} (val_fraction={cfg.val_fraction:g})"
    raise _UserError(f"{run}: the run held out no part of its corpus (no val_fraction, no val_corpus): "
                     f"pass --corpus FILE, an id file it did not train on ({BUILD_HINT})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    def fail(msg):
        print(f"error: {msg}", file=sys.stderr)
        return 2

    given = args.ckpt
    try:
        args.ckpt = store.readable(args.ckpt, args.step, log=lambda m: print(m, file=sys.stderr),
                                   items=ckpt_lib.WEIGHTS_ITEMS)
    except CheckpointError as e:
        return fail(str(e))
    if not os.path.exists(args.ckpt):
        return fail(f"checkpoint directory not found: {args.ckpt}{ckpt_lib.missing_step_words(args.ckpt)}")
    for name in ("ids", "lanes", "chunk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return fail(f"--{name} must be >= 1, got {value}")
    try:
        run_dir, named = ckpt_lib.resolve_checkpoint(args.ckpt)
        run = given if store.scheme_of(given) else run_dir   # a URL's run named as the URL, not its read cache
        if named is not None and args.step is not None and args.step != named:
            raise _UserError(f"{given} is the checkpoint of step {named}, and step {args.step} was asked for")
        step, meta, cfg = ckpt_lib.read_step(run_dir, named if args.step is None else args.step,
                                             items=ckpt_lib.WEIGHTS_ITEMS)
        ids, source = held_out_ids(run, meta, cfg, args.corpus)
        if args.ids is not None:
            ids = ids[:args.ids]
        lanes = args.lanes or cfg.batch_size
        chunk = args.chunk or cfg.seq_len
        scorer = Scorer(cfg.model, lanes, chunk, feats=cfg.feats, schedule=carry_schedule(cfg),
                        ex=cfg.execution)
        scorer.layout(len(ids))   # too few ids: refused before any array is read
        state, _ = ckpt_lib.restore_one_device(run_dir, step, cfg, items=("params",))
        result = scorer.score(state["params"], ids, progress=not args.no_progress, desc=f"step {step}")
    except (_UserError, LaneError, CorpusError, CheckpointError, OSError) as e:
        return fail(str(e) or type(e).__name__)
    out = {**result.to_json(), "step": step, "ckpt": str(run), "corpus": source}
    if args.json:
        print(json.dumps(out))
        return 0
    bpb = lambda v: "" if v is None else f", {v:.4f} bits/byte"  # noqa: E731
    print(f"{run} step {step} on {source}")
    print(f"  {result.n_ids} ids ({result.lanes} lanes x {result.n_chunks} chunks of {result.chunk})"
          + ("" if result.n_bytes is None else f", {result.n_bytes} bytes"))
    if not (result.schedule.never or result.schedule.every_chunk):
        print(f"  carry as trained ({result.schedule.describe()}): "
              f"ce {result.ce:.4f} nats/id{bpb(result.bpb)}")
    trained = lambda same: " (as trained)" if same else ""  # noqa: E731
    print(f"  carry streamed along the lane{trained(result.schedule.never)}: "
          f"ce {result.ce_warm:.4f} nats/id{bpb(result.bpb_warm)}")
    print(f"  carry reset at every chunk{trained(result.schedule.every_chunk)}: "
          f"ce {result.ce_no_carry:.4f} nats/id{bpb(result.bpb_no_carry)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
