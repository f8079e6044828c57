"""`python -m fractus_jax.bench attention`: fwd+bwd milliseconds of the linear-attention kernels.

The shapes are the 1B engine's (config.atom_1b / parent_1b): B rows × 20 heads × 2 levels =
G = 40·B head-levels, C = 128 positions, dH = 64, float32, with a nonzero carry (S0, z0)
entering and the carry after the chunk computed. Each timed call does what the engine's
attention does around the kernel, forward and backward:

    qf_l = elu1(q + ω_l), kf_l = elu1(k + ω_l) per level l (v and the carry repeated per level)
    y, S, z = kernel(qf, kf, v, S0, z0, reset)
    loss = Σ y ⊙ probe          (probe random: every output matters)
    → loss, ∂loss/∂(q, k, v), and the level-mean carry (S, z)

Implementations:
  chunkwise        the engine's kernel, `linear_attention`, at the default block size (64),
                   in the engine's plain form: the levels a leading axis of one call, the
                   carry the mean over it (model._attention with execution.kernels="plain")
  chunkwise_cpu    the same in the engine's CPU forms (kernels/cpu.py): one call per
                   level, the carry a sum of slices, one block without a block axis
  chunkwise_b32    chunkwise at block size 32
  chunkwise_b128   chunkwise at block size 128 (one block per chunk)
  chunkwise_b128_cpu  chunkwise_cpu at block size 128
  position_scan    `linear_attention_reference`, a lax.scan over positions
  torch_einsum     the PyTorch parent kind of kernel (`reference.functional.einsum_attention`,
                   a (C, dH, dH) cumulative state per head), backward by autograd
  torch_loop       `reference.functional.loop_attention`, a Python loop over positions
                   (slow; only when asked for with --impl torch_loop)

JAX kernels get the reset mask as an input (all False here), as in the engine, so no mask
is constant-folded away; the PyTorch kernels have no resets. Every implementation reports
its loss on the same inputs, a cross-check that they compute the same thing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import config
from fractus_jax.bench import timing
from fractus_jax.kernels import attention as A
from fractus_jax.model import level_offsets

_1B = config.atom_1b()
HEADS, LEVELS, D_HEAD = _1B.n_heads, _1B.n_levels, _1B.d_head     # 20, 2, 64
CHUNK = 128                                                          # positions per chunk
ENGINE_BLOCK = config.Execution().attn_block_size                      # the engine's default, 64
DEFAULT = "chunkwise"
# name -> (block size, None for the position scan; the CPU forms or the plain ones)
JAX_IMPLS = {"chunkwise": (ENGINE_BLOCK, False), "chunkwise_cpu": (ENGINE_BLOCK, True),
             "chunkwise_b32": (32, False), "chunkwise_b128": (128, False), "chunkwise_b128_cpu": (128, True),
             "position_scan": (None, False)}
TORCH_IMPLS = ("torch_einsum", "torch_loop")
IMPLS = tuple(JAX_IMPLS) + TORCH_IMPLS
DEFAULT_IMPLS = tuple(i for i in IMPLS if i != "torch_loop")
BASELINE = "torch_einsum"


def make_inputs(batch: int, seed: int = 0, heads: int = HEADS, levels: int = LEVELS,
                chunk: int = CHUNK, d_head: int = D_HEAD) -> dict:
    """Random float32 inputs (numpy), fixed by the seed: q, k, v (B, H, C, dH), a carry
    S0 (B, H, dH, dH), z0 > 0 (B, H, dH), the level offsets and the loss probe."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s, dtype=np.float32)
    B, H, C, d = batch, heads, chunk, d_head
    return {
        "q": f32(B, H, C, d), "k": f32(B, H, C, d), "v": f32(B, H, C, d),
        "S0": f32(B, H, d, d), "z0": np.abs(f32(B, H, d)) + 1.0,
        "reset": np.zeros((B, C), bool),
        "offsets": level_offsets(levels).astype(np.float32),
        "probe": f32(B, levels, H, C, d),
    }


# ----------------------------------------------------------------------------- JAX

def _jax_step(impl: str):
    """loss, grads (q, k, v) and the level-mean carry, as one function of the inputs."""
    block, cpu = JAX_IMPLS[impl]
    kernel = (A.linear_attention_reference if block is None
              else lambda *a: A.linear_attention(*a, block_size=block, one_block_axis=not cpu))

    def loss(q, k, v, S0, z0, reset, offsets, probe):
        L = offsets.shape[0]
        if cpu:
            # kernels/cpu.level_attention: one call per level, the carry a sum of slices.
            outs = [kernel(A.elu1(q + offsets[l]), A.elu1(k + offsets[l]), v, S0, z0, reset[:, None, :])
                    for l in range(L)]
            y = jnp.stack([o[0] for o in outs], axis=1)                       # (B, L, H, C, dH)
            carry = (sum(o[1] for o in outs) / L, sum(o[2] for o in outs) / L)
        else:
            # The plain form: a leading level axis, the carry the mean over it.
            omega = offsets[:, None, None, None, None]
            qf, kf = A.elu1(q + omega), A.elu1(k + omega)                     # (L, B, H, C, dH)
            S0l, z0l = jnp.broadcast_to(S0, (L, *S0.shape)), jnp.broadcast_to(z0, (L, *z0.shape))
            y, S, z = kernel(qf, kf, jnp.broadcast_to(v, qf.shape), S0l, z0l, reset[:, None, :])
            y, carry = jnp.moveaxis(y, 0, 1), (S.mean(0), z.mean(0))
        return jnp.sum(y * probe), carry

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def time_jax_impl(impl: str, inputs: dict, repeats: int, warmup: int = 1):
    names = ("q", "k", "v", "S0", "z0", "reset", "offsets", "probe")
    args = [jnp.asarray(inputs[n]) for n in names]
    step = jax.jit(_jax_step(impl)).lower(*args).compile()
    (value, _), _ = step(*args)        # the loss cross-checks the implementations
    ms = timing.time_jax(step, *args, repeats=repeats, warmup=warmup)
    return ms, float(value), _executed_flops(impl, step)


def _executed_flops(impl: str, compiled):
    """XLA's count of the compiled program's FLOPs, for the loop-free (chunkwise) programs:
    XLA counts a loop's body once, so a scan's count would mean nothing."""
    if JAX_IMPLS[impl][0] is None:
        return None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) if cost and cost.get("flops") else None


# ----------------------------------------------------------------------------- PyTorch

def time_torch_impl(impl: str, inputs: dict, repeats: int, warmup: int = 1):
    import torch

    from fractus_jax.reference import functional as Fn

    t = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in inputs.items()}
    q, k, v = (t[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    B, H, C, d = q.shape
    L = t["offsets"].shape[0]
    off = t["offsets"].view(1, L, 1, 1, 1)
    probe = t["probe"].reshape(B * L, H, C, d)
    S0 = t["S0"][:, None].expand(B, L, H, d, d).reshape(B * L, H, d, d)
    z0 = t["z0"][:, None].expand(B, L, H, d).reshape(B * L, H, d)

    def step():
        for x in (q, k, v):
            x.grad = None
        qf = Fn.elu1(q[:, None] + off).reshape(B * L, H, C, d)
        kf = Fn.elu1(k[:, None] + off).reshape(B * L, H, C, d)
        vl = v[:, None].expand(B, L, H, C, d).reshape(B * L, H, C, d)
        if impl == "torch_einsum":
            y, S, z = Fn.einsum_attention(qf, kf, vl, S0, z0)
        else:
            y, S, z = Fn.loop_attention(qf, kf, vl, S0, z0)
        loss = (y * probe).sum()
        loss.backward()
        carry = (S.detach().view(B, L, H, d, d).mean(1), z.detach().view(B, L, H, d).mean(1))
        return loss.detach(), carry

    ms = timing.time_torch(step, repeats=repeats, warmup=warmup)
    return ms, float(step()[0]), None


# ----------------------------------------------------------------------------- CLI

def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run(batch: int, impls: Sequence[str] = DEFAULT_IMPLS, repeats: int = 10, warmup: int = 1,
        seed: int = 0, log=None) -> dict:
    """Time each implementation; returns the result dict that --json prints. Progress goes
    to `log` (default: stderr)."""
    if log is None:
        log = lambda line: print(line, file=sys.stderr, flush=True)
    cores = timing.cpu_cores()
    have_torch = any(i in TORCH_IMPLS for i in impls) and _torch_available()
    torch_threads = None
    if have_torch:
        # The same number of cores as XLA's CPU thread pool (one per core it may run on).
        import torch
        torch.set_num_threads(cores)
        torch_threads = torch.get_num_threads()
    inputs = make_inputs(batch, seed)
    ms, losses, flops, skipped = {}, {}, {}, []
    for impl in impls:
        if impl in TORCH_IMPLS and not have_torch:
            skipped.append(impl)
            log(f"  {impl}: skipped (torch is not installed)")
            continue
        timer = time_torch_impl if impl in TORCH_IMPLS else time_jax_impl
        ms[impl], losses[impl], f = timer(impl, inputs, repeats, warmup)
        if f:
            flops[impl] = f
        log(f"  {impl}: {ms[impl]:.2f} ms")
    base = ms.get(BASELINE)
    peak = timing.measure_peak(jax.default_backend())["peak"] if flops else None
    return {
        "gflop": {i: f / 1e9 for i, f in flops.items()},
        "flops_per_s": {i: f / (ms[i] / 1e3) for i, f in flops.items()},
        "peak_flops_per_s": peak,
        "ms": ms,
        "default": DEFAULT,
        "batch": batch,
        "shape": {"G": batch * HEADS * LEVELS, "batch": batch, "heads": HEADS, "levels": LEVELS,
                  "C": CHUNK, "dH": D_HEAD, "dtype": "float32", "engine_block_size": ENGINE_BLOCK},
        "speedup_vs_torch_einsum": ({i: base / m for i, m in ms.items()} if base else {}),
        "loss": losses,
        "skipped": skipped,
        "repeats": repeats,
        "device": jax.devices()[0].device_kind,
        "jax_cores": cores,
        "torch_threads": torch_threads,
        "jax_version": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "torch_version": (__import__("torch").__version__ if have_torch else None),
    }


def format_table(result: dict) -> str:
    s = result["shape"]
    torch_note = (f"torch threads {result['torch_threads']}" if result["torch_threads"]
                  else "torch not run")
    lines = [(f"linear attention fwd+bwd with carry: B={result['batch']} (G={s['G']} head-levels), "
              f"C={s['C']}, dH={s['dH']}, {s['dtype']}; median of {result['repeats']} runs"),
             f"device {result['device']}: JAX on {result['jax_cores']} cores, {torch_note}",
             f"{'impl':<16}{'ms':>12}{'x vs torch_einsum':>20}{'GFLOP':>8}{'% of peak':>11}{'loss':>16}"]
    peak = result["peak_flops_per_s"]
    for impl, ms in result["ms"].items():
        sp = result["speedup_vs_torch_einsum"].get(impl)
        gflop = result["gflop"].get(impl)
        share = (f"{100 * result['flops_per_s'][impl] / peak:.0f}%" if gflop and peak else "-")
        tag = " (default)" if impl == result["default"] else ""
        lines.append(f"{impl:<16}{ms:>12.2f}{(f'{sp:.1f}' if sp else '-'):>20}"
                     f"{(f'{gflop:.2f}' if gflop else '-'):>8}{share:>11}"
                     f"{result['loss'][impl]:>16.6g}{tag}")
    if peak:
        lines.append(f"GFLOP: XLA's count of the compiled program (loop-free programs only); "
                     f"peak: the best 2048x2048 matmul, {peak / 1e9:.0f} GFLOP/s")
    for impl in result["skipped"]:
        lines.append(f"{impl:<16}{'skipped (torch not installed)':>32}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.bench attention",
                                description=__doc__.split("\n\n")[0],
                                epilog="implementations: " + ", ".join(IMPLS))
    p.add_argument("--batch", type=int, required=True, help="rows B (G = 40·B head-levels)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per implementation (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    p.add_argument("--impl", action="append", choices=IMPLS, metavar="NAME",
                   help="an implementation to time (repeatable); default: "
                        + ", ".join(DEFAULT_IMPLS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true",
                   help="end with one line holding the result as a JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or args.warmup < 0:
        print("error: --batch and --repeats must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    impls = list(dict.fromkeys(args.impl)) if args.impl else list(DEFAULT_IMPLS)
    result = run(args.batch, impls, repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    print(format_table(result))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0
