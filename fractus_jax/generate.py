"""Text generation with the Fractus engine: a Python API and ``python -m fractus_jax.generate``.

    python -m fractus_jax.generate --ckpt RUN_DIR|RUN_DIR/checkpoints/STEP --prompt "Bonjour, le" [--prompt ...]
        [--step N] [--max-new 40] [--mode step|window|chunk (default: as the run trained)] [--window W]
        [--temperature 0] [--top-k 0] [--seed 0] [--json]

Each prompt is encoded with ``atom.encode_open`` (docs/spec.md §5: BOS, its committed packets,
the unfinished tail's bytes), then `fractus_jax.decode.decode_ids` decodes inside one
jitted loop (see that module for the two modes). Several prompts run as ONE batch: they
are left-padded with PAD to the longest. The padding is invisible, not an approximation:
every encode_open prompt starts with BOS, which zeroes the state entering it, and routing
is exact here (``capacity_factor=None``: at inference no token may lose its experts to
another row or to a pad). So a batch gives each prompt exactly what it gets alone, at the
cost of one compile for the whole batch (tests/test_generate.py checks both claims).

``--json`` prints one JSON object as the last line (docs/generation.md lists the fields).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import atom
from fractus_jax.atom.ids import BOS, EOS, PAD, is_boundary
from fractus_jax.atom.ids import NAMES as ATOM_NAMES
from fractus_jax.atom.ids import VOCAB as ATOM_VOCAB
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.decode import MODES, check_decode_args, decode_ids, speech_counts
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import store
from fractus_jax.train.rundir import CheckpointError


class GenerateError(ValueError):
    """A user mistake (bad argument, unusable checkpoint): the CLI prints it, no traceback."""


@dataclasses.dataclass
class Generation:
    """One prompt's result. ``ids`` are the generated ids only (an EOS, if any, last)."""
    prompt: str
    prompt_ids: list
    text: str                 # decode(ids): ids >= 256 dropped, bytes UTF-8 decoded
    ids: list
    unique_ids: int           # distinct generated ids
    unique_bytes: int         # distinct byte values among generated ids < 256
    confidence: list          # per generated id: sigmoid(confidence_head(h_last))
    ms_per_id: float          # decode wall time / decode steps run (the batch's, shared)
    stopped_at_eos: bool
    mode: str
    window: Optional[int]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def no_text_note(ids, step: Optional[int] = None) -> Optional[str]:
    """Why generated ids show no text (none of them is a byte), or None when some are.

    An early model emits boundary ids (a packet's end) long before bytes: its text is
    empty, which the note says rather than leaving an empty line unexplained."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if any(i < 256 for i in ids):
        return None
    if not ids:
        return "no text: no id was generated"
    counts = collections.Counter(ids)
    what = ", ".join(f"{ATOM_NAMES.get(i, i)} ({i}) x{n}" for i, n in counts.most_common())
    boundaries = all(is_boundary(i) for i in ids)
    if len(ids) == 1:
        said = "the 1 id was " + ("a boundary" if boundaries else "a special id")
    else:
        said = f"the {len(ids)} ids were all " + ("boundaries" if boundaries else "special ids")
    early = f"a {step}-step model" if step is not None else "a model early in training"
    return (f"no text: {said} ({what}), no byte; {early} does not speak yet (the trainer's speech "
            "gate probe, speech_unique_bytes in metrics.jsonl, tracks when it starts: docs/training.md)")


def check_atom_engine(cfg: EngineConfig) -> None:
    if cfg.vocab_size != ATOM_VOCAB or cfg.bos_id != BOS:
        raise GenerateError(
            f"generate encodes text as Atom ids (vocab {ATOM_VOCAB}, BOS {BOS}); this engine has "
            f"vocab_size={cfg.vocab_size}, bos_id={cfg.bos_id}")


def encode_prompts(prompts: Sequence[str]) -> tuple[list, np.ndarray]:
    """encode_open each prompt; (per-prompt id arrays, (B, P) batch left-padded with PAD)."""
    encoded = [np.asarray(atom.encode_open(p), np.int32).reshape(-1) for p in prompts]
    for p, e in zip(prompts, encoded):
        if e.size == 0 or int(e[0]) != BOS:
            raise GenerateError(f"encode_open({p!r}) does not start with BOS")
    P = max(e.size for e in encoded)
    batch = np.full((len(encoded), P), PAD, np.int32)
    for b, e in enumerate(encoded):
        batch[b, P - e.size:] = e
    return encoded, batch


DEFAULT_WINDOW = 64   # window mode's width for a run that carried its state across steps


def generate(params, cfg: EngineConfig, prompts: Union[str, Sequence[str]], max_new: int = 40,
             mode: str = "step", window: int = DEFAULT_WINDOW, temperature: Optional[float] = None,
             top_k: int = 0, seed: int = 0, exact_routing: bool = True,
             ex: Execution = Execution()) -> list[Generation]:
    """Encode, batch (left-padded), decode and detokenize; one `Generation` per prompt.

    ``exact_routing`` (default) decodes with ``capacity_factor=None``; False keeps the
    config's capacity, under which rows and pads compete for expert slots. ``ex``: how the
    engine is computed (the CLI passes the run's own settings).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise GenerateError("no prompt given")
    check_atom_engine(cfg)
    if temperature is not None and float(temperature) == 0.0:
        temperature = None
    try:
        check_decode_args(cfg, max_new, mode, window, temperature, top_k)
    except ValueError as e:
        raise GenerateError(str(e)) from e
    cfg, ex = cfg.for_inference(exact=exact_routing), ex.for_inference()
    encoded, batch = encode_prompts(prompts)
    prompt_ids = jnp.asarray(batch)
    key = jax.random.PRNGKey(int(seed))
    static = dict(max_new=int(max_new), mode=mode, window=int(window),
                  temperature=None if temperature is None else float(temperature), top_k=int(top_k), ex=ex)
    compiled = decode_ids.lower(params, cfg, prompt_ids, key=key, **static).compile()
    t0 = time.perf_counter()
    ids, conf, n_valid = jax.block_until_ready(compiled(params, prompt_ids, key=key))
    wall_ms = 1e3 * (time.perf_counter() - t0)
    ids, conf, n_valid = np.asarray(ids), np.asarray(conf), np.asarray(n_valid)
    ms_per_id = wall_ms / max(1, int(n_valid.max()))
    out = []
    for b, (text, enc) in enumerate(zip(prompts, encoded)):
        n = int(n_valid[b])
        gen = ids[b, :n]
        u_ids, u_bytes = speech_counts(gen)
        out.append(Generation(
            prompt=text, prompt_ids=enc.tolist(), text=atom.decode(gen), ids=gen.tolist(),
            unique_ids=u_ids, unique_bytes=u_bytes, confidence=[float(c) for c in conf[b, :n]],
            ms_per_id=ms_per_id, stopped_at_eos=bool(n and gen[-1] == EOS), mode=mode,
            window=int(window) if mode in ("window", "chunk") else None))
    return out


# ----------------------------------------------------------------------------- CLI

def trained_settings(run_dir: str, step: Optional[int] = None) -> tuple[str, Optional[int], Execution]:
    """(mode, window, execution) of the run's checkpoint: the decoding that computes the
    function it trained (TrainConfig.trained_decoding: a window of accum·seq_len ids when
    every step started from the initial carry, chunks of seq_len carrying the state for an
    Atom run that streamed it, else step), and how the run computed its engine (dtype, kernels)."""
    run, named = ckpt_lib.resolve_checkpoint(run_dir)
    _, _, cfg = ckpt_lib.read_step(run, named if step is None else step, items=ckpt_lib.WEIGHTS_ITEMS)
    mode, window = cfg.trained_decoding()
    return mode, window, cfg.execution


def load_run(run_dir: str, step: Optional[int] = None):
    """(params, engine_cfg) of a trainer run directory or one of its step directories
    (DIR/checkpoints/<step>), via fractus_jax.train.checkpoint."""
    return ckpt_lib.load_for_inference(run_dir, step=step)


# The CLI's bound on --max-new: the output buffers are allocated for all of it up front, and a
# million ids at ~1 ms/id is already a quarter of an hour.
MAX_NEW_LIMIT = 1_000_000


def _max_new(text: str) -> int:
    """--max-new: a whole number (1e5 written as such is accepted) up to MAX_NEW_LIMIT."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value > MAX_NEW_LIMIT:
        raise argparse.ArgumentTypeError(f"{text} is above the limit of {MAX_NEW_LIMIT:,} ids per prompt")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fractus_jax.generate",
                                 description="Generate text with a trained Fractus engine (Atom ids).")
    ap.add_argument("--ckpt", required=True, metavar="DIR_OR_STEP", type=store.workdir_arg,
                    help="a run directory written by the trainer (its latest checkpoint) or DIR/checkpoints/<step>")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                    help="prompt text; repeat for a batch")
    ap.add_argument("--max-new", type=_max_new, default=40, metavar="N",
                    help=f"ids to generate at most (default 40, at most {MAX_NEW_LIMIT:,})")
    ap.add_argument("--mode", choices=MODES, default=None,
                    help="step: C=1 per id, state carried; window: re-run the last W ids from a zero state; "
                         "chunk: chunks of W ids, each from the carry the one before left (default: as the "
                         "run trained: window over accum·seq_len ids when every step started from the initial "
                         "carry, chunks of seq_len for an Atom run that streamed its carry, else step)")
    ap.add_argument("--window", type=int, default=None, metavar="W",
                    help="window width of --mode window, chunk length of --mode chunk (default: the run's "
                         "accum·seq_len or seq_len, else 64)")
    ap.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, metavar="K",
                    help="with --temperature > 0: sample among the K best (0: all)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return ap


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)   # a user mistake, as for the trainer and the converter


def _checkpoint_step(ckpt: str, step: Optional[int]) -> Optional[int]:
    """The step that --ckpt/--step load, as far as the directory names it (for the notes)."""
    if step is not None:
        return step
    path = os.path.normpath(ckpt)
    name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    if parent == "checkpoints" and name.isdigit():
        return int(name)
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.ckpt = store.readable(args.ckpt, args.step, log=lambda m: print(m, file=sys.stderr),
                                   items=ckpt_lib.WEIGHTS_ITEMS)
    except CheckpointError as e:
        _fail(str(e))
    if not os.path.isdir(args.ckpt):
        _fail(f"checkpoint directory not found: {args.ckpt}{ckpt_lib.missing_step_words(args.ckpt)}")
    if any(p == "" for p in args.prompt):
        _fail("empty prompt (--prompt needs some text)")
    # The decode arguments are checked once, by generate (check_decode_args): top_k's bound
    # is the loaded engine's vocab.
    try:
        params, cfg = load_run(args.ckpt, args.step)
        mode, window, ex = trained_settings(args.ckpt, args.step)
        if args.mode and args.mode != mode:
            mode, window = args.mode, None
        window = args.window if args.window is not None else (window or DEFAULT_WINDOW)
        results = generate(params, cfg, args.prompt, max_new=args.max_new, mode=mode,
                           window=window, temperature=args.temperature, top_k=args.top_k,
                           seed=args.seed, ex=ex)
    except (GenerateError, OSError, ValueError, KeyError) as e:
        _fail(str(e) or type(e).__name__)
    for r in results:
        if len(results) > 1:
            print(f"--- {r.prompt!r}")
        print(r.prompt + r.text)
        mean_conf = float(np.mean(r.confidence)) if r.confidence else float("nan")
        print(f"# {len(r.ids)} ids ({'EOS' if r.stopped_at_eos else 'max-new'}), unique ids {r.unique_ids}, "
              f"unique bytes {r.unique_bytes}, mean confidence {mean_conf:.3f}, {r.ms_per_id:.2f} ms/id")
        note = no_text_note(r.ids, _checkpoint_step(args.ckpt, args.step))
        if note:
            print(f"# {note}")
    if args.json:
        objs = [r.to_json() for r in results]
        print(json.dumps(objs[0] if len(objs) == 1 else {"results": objs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
