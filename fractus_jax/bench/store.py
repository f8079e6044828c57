"""A checkpoint's way to object storage and back, beside the disk's: MB/s of each leg
(docs/performance.md, Object storage).

    python -m fractus_jax.bench store --url s3://BUCKET/PATH [--gb 1.0] [--stage DIR] [--json]

Builds a state of --gb GB of float32 random weights (random: the disk and the network see
bytes that do not compress), then times, through the trainer's own code:
  save     the blocking save into a stage on this disk (`RunCheckpointer.save`: Orbax's write,
           the checksums read back, the manifest);
  upload   the step pushed to the URL (`store.Mirror.push`, as after each commit of a run);
  pull     the step pulled into a second, empty stage (what a new pod does at its start);
  restore  the step read back from the second stage into arrays.
The URL is a run directory of its own: its objects are left there, and its lease is taken
and released like a trainer's. The credentials and the endpoint are the usual variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import store
from fractus_jax.train.rundir import CheckpointError
from fractus_jax.urls import local_path

PARTS = 8   # the weights in this many arrays, as a model's are in several


def weights(gb: float, seed: int = 0) -> dict:
    """{"w0".."w7": float32 arrays} of gb GB in all, random."""
    n = int(gb * 1e9 / 4 / PARTS)
    rng = np.random.default_rng(seed)
    return {f"w{i}": jnp.asarray(rng.standard_normal(n, dtype=np.float32)) for i in range(PARTS)}


def state_of(params: dict) -> dict:
    """A train state's items around `params` (the carry, step and counters as scalars)."""
    return {"params": params, "opt_state": {"count": jnp.asarray(1, jnp.int32)}, "carry": jnp.zeros((), jnp.float32),
            "step": jnp.asarray(1, jnp.int32), "skipped": jnp.asarray(0, jnp.int32)}


def measure(url: str, gb: float, stage: Path, log=print) -> dict:
    state = state_of(weights(gb))
    nbytes = ckpt_lib.save_bytes(state)[1]
    out = {"url": url, "bytes": nbytes}
    a, b = stage / "a", stage / "b"
    mirror = store.open_mirror(url, a, log=log)
    try:
        if mirror.committed is not None:
            raise CheckpointError(f"{url} holds a run already (step {mirror.committed}): give a new path")
        ck = ckpt_lib.RunCheckpointer(a, keep=1, log=log)
        t = time.time()
        ck.save(state, {"step": 1}, block=True)
        out["save_s"] = time.time() - t
        ck.close()
        t = time.time()
        mirror.push(1)
        mirror.settle()
        out["upload_s"] = time.time() - t
    finally:
        mirror.close()
    t = time.time()
    mirror = store.open_mirror(url, b, log=log)
    out["pull_s"] = time.time() - t
    try:
        ck = ckpt_lib.RunCheckpointer(b, read_only=True)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        t = time.time()
        restored, _ = ck.restore(abstract, 1)
        jax.block_until_ready(restored)
        out["restore_s"] = time.time() - t
        ck.close()
        same = all(np.array_equal(np.asarray(restored["params"][k]), np.asarray(v)) for k, v in state["params"].items())
    finally:
        mirror.close()
    if not same:
        raise CheckpointError(f"{url}: the state pulled back differs from the one saved")
    for leg in ("save", "upload", "pull", "restore"):
        out[f"{leg}_mb_per_s"] = nbytes / 1e6 / out[f"{leg}_s"]
    return out


def table(r: dict) -> str:
    rows = [f"{r['bytes'] / 1e9:.2f} GB state, {r['url']}",
            "| leg | seconds | MB/s |", "|---|---|---|"]
    for leg, words in (("save", "save to this disk (write + checksums)"), ("upload", "upload to the store"),
                       ("pull", "pull into an empty stage"), ("restore", "restore from the disk")):
        rows.append(f"| {words} | {r[f'{leg}_s']:.1f} | {r[f'{leg}_mb_per_s']:.0f} |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.bench store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, type=store.workdir_arg,
                   help="s3://BUCKET/PATH or gs://BUCKET/PATH (a run directory of its own)")
    p.add_argument("--gb", type=float, default=1.0, help="the state's size in GB (default 1)")
    p.add_argument("--stage", type=local_path, help="the two stages' parent (default: a temporary folder, removed after)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args(argv)
    if not store.scheme_of(args.url):
        p.error(f"--url {args.url!r}: give an s3:// or gs:// URL")
    if not args.gb > 0:
        p.error(f"--gb {args.gb:g}: give a size above 0")
    parent = Path(args.stage or tempfile.mkdtemp(prefix="fractus-bench-store-"))
    try:
        r = measure(args.url, args.gb, parent)
    except CheckpointError as e:
        print(f"error: {e}")
        return 2
    finally:
        if args.stage is None:
            shutil.rmtree(parent, ignore_errors=True)
    print(table(r))
    if args.json:
        print(json.dumps(r))
    return 0
