"""`python -m fractus_jax.bench train --config NAME [--set k=v ...] [--steps N] [--torch] [--json]`

Times the very step the trainer runs (`fractus_jax.train.step.jit_train_step`, state
donated, on the config's mesh) after compilation and warm-up, and reports ids/s, the
analytic model FLOPs per id (fractus_jax/flops.py), the achieved FLOP/s and
MFU = achieved / peak, where the peak is measured in the same run: a dense float32 matmul
on a CPU, a bfloat16 matmul on a GPU, timed 3 times before the steps and after every 5
timed steps. `mfu` divides the median step by the best matmul of the run; `mfu_paired` is
the median over those rounds of the same ratio within the round (the machine's phase of
the moment cancels). With `--torch`, the package's PyTorch reference
engine runs the PyTorch parent trainer's step on the same config and batch (chunk
forward + CE + lb, backward, SGD momentum 0.9) with the parent's einsum attention
kernel, and the ratio is reported. With --json the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import numpy as np

from fractus_jax import hostmem, sharding
from fractus_jax.bench import timing
from fractus_jax.config import split_fields
from fractus_jax.flops import train_flops_per_id
from fractus_jax.kernels import select
from fractus_jax.lanes import LaneReader
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import resolve_for_mesh
from fractus_jax.train.data import global_batch
from fractus_jax.train.step import batch_shardings, jit_train_step


def build_step(cfg, n_batches: int):
    """(step, state, batches): the trainer's jitted step (state donated), a fresh state on the
    config's mesh and `n_batches` global batches of random ids, as the trainer shards them."""
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    state, shardings = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(cfg.seed))
    batch_shard = batch_shardings(cfg, mesh)
    step = jit_train_step(cfg, shardings, batch_shard)
    span = cfg.batch_size * (cfg.accum * cfg.seq_len + 1) * (n_batches + 1)
    ids = np.random.default_rng(0).integers(0, min(256, cfg.model.vocab_size), span).astype(np.int32)
    reader = LaneReader(ids, cfg.batch_size, cfg.seq_len, cfg.accum)
    batches = [global_batch(reader, i * reader.span, batch_shard) for i in range(n_batches)]
    return step, state, batches


def time_jax_step(cfg, steps: int, warmup: int, after_step=None) -> dict:
    """Median step time and page faults over `steps` timed steps; `after_step(i)` runs
    after timed step i, outside the timing (bench train samples the matmul peak there)."""
    step, state, batches = build_step(cfg, steps + warmup + 1)
    t0 = time.perf_counter()
    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    for b in batches[1:warmup + 1]:
        state, metrics = step(state, b)
    jax.block_until_ready(metrics)
    times, faults = [], []
    for i, b in enumerate(batches[warmup + 1:]):
        f0, t0 = hostmem.minor_faults(), time.perf_counter()
        state, metrics = step(state, b)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        faults.append(hostmem.minor_faults() - f0)
        if after_step is not None:
            after_step(i)
    return {"ms_per_step": 1e3 * statistics.median(times), "step_s": times, "compile_s": compile_s,
            "ce_last": float(metrics["ce_tf"]), "page_faults_per_step": sorted(faults)[len(faults) // 2]}


def time_torch_step(cfg, steps: int) -> float:
    """Median ms of the PyTorch parent trainer's step on the reference engine."""
    import torch
    import torch.nn.functional as F

    from fractus_jax.reference import FractusEngine
    from fractus_jax.reference import functional as Fn

    def parent_kernel(qf, kf, v, S0, z0, reset=None):
        if reset is not None and bool(reset.any()):
            raise ValueError("the einsum kernel has no document resets")
        return Fn.einsum_attention(qf, kf, v, S0, z0)

    torch.manual_seed(0)
    engine = FractusEngine(**cfg.model.torch_kwargs())
    opt = torch.optim.SGD(engine.parameters(), lr=cfg.lr, momentum=0.9)
    B, C = cfg.batch_size, cfg.seq_len
    ids = torch.randint(0, min(256, cfg.model.vocab_size), (B, C + 1))
    loop_attention = Fn.loop_attention
    Fn.loop_attention = parent_kernel    # the parent engine's kernel, for this benchmark only
    try:
        def step():
            opt.zero_grad(set_to_none=True)
            logits, lb = engine(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(B * C, -1), ids[:, 1:].reshape(-1)) + cfg.lb_coef * lb
            loss.backward()
            torch.nn.utils.clip_grad_norm_(engine.parameters(), cfg.clip_norm)
            opt.step()
        return timing.time_torch(step, repeats=steps, warmup=1)
    finally:
        Fn.loop_attention = loop_attention


ROUND_STEPS = 5     # timed steps between two samples of the matmul peak
ROUND_PEAK_RUNS = 3


def _paired_mfu(step_s: list[float], peak_s: list[list[float]], step_flops: float, peak_flops: float):
    """The median over rounds of (the round's median step FLOP/s) / (its best matmul FLOP/s):
    each round's step and peak share the machine's phase of the moment."""
    ratios = []
    for r, samples in enumerate(peak_s):
        steps = step_s[r * ROUND_STEPS:(r + 1) * ROUND_STEPS]
        if steps and samples:
            ratios.append((step_flops / statistics.median(steps)) / (peak_flops / min(samples)))
    return statistics.median(ratios) if ratios else None


def run(cfg, steps: int = 10, warmup: int = 2, with_torch: bool = False) -> dict:
    backend = jax.default_backend()
    sample_peak, peak_flops, peak_kind = timing.peak_sampler(backend)
    # The peak is sampled between rounds of steps, not once before or after them: this
    # machine moves between fast and slow phases within seconds, and a peak taken in a
    # slow phase (or a step timed in one) moved the MFU by a third between runs.
    peak_s = [sample_peak(ROUND_PEAK_RUNS)]
    rounds: list[list[float]] = []

    def after_step(i):
        if (i + 1) % ROUND_STEPS == 0 or i + 1 == steps:
            rounds.append(sample_peak(ROUND_PEAK_RUNS))

    jax_res = time_jax_step(cfg, steps, warmup, after_step)
    peak_s += rounds
    every = sorted(t for r in peak_s for t in r)
    peak = {"peak": peak_flops / every[0], "median": peak_flops / every[len(every) // 2],
            "kind": f"{peak_kind}, best of {len(every)} sampled between the steps"}
    ids_per_step = cfg.batch_size * cfg.seq_len * cfg.accum
    ids_per_s = ids_per_step / (jax_res["ms_per_step"] / 1e3)
    flops_per_id = train_flops_per_id(cfg.model)
    n_dev = cfg.mesh.data * cfg.mesh.fsdp
    # CPU "devices" of one process share its cores (the 8 fake devices of the tests are
    # one host), so the peak there is the host's; accelerators each have their own.
    peak_units = jax.process_count() if backend == "cpu" else n_dev
    achieved = ids_per_s * flops_per_id
    out = {"ids_per_s": ids_per_s, "mfu": achieved / (peak["peak"] * peak_units), "flops_per_id": flops_per_id,
           "achieved_flops_per_s": achieved, "peak_flops_per_s": peak["peak"], "peak_units": peak_units,
           "peak_scope": "host" if backend == "cpu" else "device",
           "peak_median_flops_per_s": peak["median"], "peak_kind": peak["kind"],
           "ms_per_step": jax_res["ms_per_step"], "compile_s": jax_res["compile_s"],
           "ids_per_step": ids_per_step, "devices": n_dev, "backend": backend,
           "device_kind": jax.devices()[0].device_kind, "cores": timing.cpu_cores(),
           "allocator": hostmem.allocator(), "malloc_hugetlb": hostmem.hugetlb_tunable(),
           "page_faults_per_step": jax_res["page_faults_per_step"],
           # how the step is scheduled: row streams and the MoE dispatch groups they imply
           "row_streams": cfg.execution.row_streams, "moe_group_rows": cfg.model.moe_group_rows,
           # which forms the engine ran: "plain", or "cpu" (the CPU-tuned ones, kernels/select.py)
           "kernels": select.resolved(cfg.execution.kernels)}
    paired = _paired_mfu(jax_res["step_s"], rounds, ids_per_step * flops_per_id, peak_flops)
    out["mfu_paired"] = paired / peak_units if paired is not None else None
    if with_torch:
        import torch
        torch.set_num_threads(timing.cpu_cores())
        ms = time_torch_step(cfg, max(2, steps // 3))
        out["torch_ids_per_s"] = ids_per_step / (ms / 1e3)
        out["speedup_vs_torch"] = ids_per_s / out["torch_ids_per_s"]
        out["torch_threads"] = torch.get_num_threads()
    return out


def dispatch_choices(model) -> dict:
    """The MoE dispatch choices compared by `--dispatch`, as engine-config changes: the
    config's own first, then dropless (expert blocks), the capacity path at
    cf = E/K (the same routing, padded) and the dropping cf = 4 and 1.25. Choices that are
    one setting (cf = E/K = 4 where E/K is 4) are one entry, named by both, timed once."""
    choices = {"dropless": dict(capacity_factor=None),
               "cf=E/K": dict(capacity_factor=model.n_experts / model.top_k),
               "cf=4": dict(capacity_factor=4.0), "cf=1.25": dict(capacity_factor=1.25)}
    names: dict[tuple, list[str]] = {}
    for name, change in choices.items():
        names.setdefault(tuple(change.items()), []).append(name)
    choices = {" = ".join(same): dict(change) for change, same in names.items()}

    def is_own(change):
        return all(getattr(model, k) == v for k, v in change.items())
    own = next((k for k, v in choices.items() if is_own(v)), f"cf={model.capacity_factor}")
    return {f"{own} (config)": {}, **{k: v for k, v in choices.items() if not is_own(v)}}


def compare_dispatch(cfg, rounds: int = 4, steps: int = 3, warmup: int = 2) -> list[dict]:
    """Times the train step of each dispatch choice in this one process, round robin
    (`rounds` rounds of `steps` timed steps each), so that their ratios share the machine's
    phase: [{dispatch, capacity_factor, ms_per_step, ids_per_s, keep_rate, ratio}], ratio
    against the first (the config's own choice)."""
    return [{"dispatch": r.pop("name"), **r}
            for r in compare_models(cfg, dispatch_choices(cfg.model), rounds, steps, warmup)]


KERNEL_CHOICES = {"plain": dict(kernels="plain"), "cpu": dict(kernels="cpu")}


def compare_models(cfg, choices: dict, rounds: int = 4, steps: int = 3, warmup: int = 2) -> list[dict]:
    """Times the train step of each config change in `choices` ({name: changes of engine or
    execution fields}) in
    this one process, round robin (`rounds` rounds of `steps` timed steps each), so that
    their ratios share the machine's phase: [{name, capacity_factor, ms_per_step,
    ids_per_s, keep_rate, ratio}], ratio against the first."""
    runs = []
    for name, change in choices.items():
        to_model, to_execution = split_fields(change)
        c = dataclasses.replace(cfg, model=cfg.model.replace(**to_model),
                                execution=cfg.execution.replace(**to_execution))
        step, state, batches = build_step(c, 1 + warmup + rounds * steps)
        for b in batches[:1 + warmup]:
            state, metrics = step(state, b)
        jax.block_until_ready(metrics)
        runs.append({"name": name, "cf": c.model.capacity_factor, "step": step, "state": state, "batches": batches[1 + warmup:],
                     "times": [], "keep": []})
    for r in range(rounds):
        for run_ in runs:
            for b in run_["batches"][r * steps:(r + 1) * steps]:
                t0 = time.perf_counter()
                run_["state"], metrics = run_["step"](run_["state"], b)
                jax.block_until_ready(metrics)
                run_["times"].append(time.perf_counter() - t0)
                run_["keep"].append(float(metrics["keep_rate"]))
    ids_per_step = cfg.batch_size * cfg.seq_len * cfg.accum
    base = statistics.median(runs[0]["times"])
    return [{"name": r["name"], "capacity_factor": r["cf"],
             "ms_per_step": 1e3 * statistics.median(r["times"]),
             "ids_per_s": ids_per_step / statistics.median(r["times"]),
             "keep_rate": statistics.mean(r["keep"]), "ratio": statistics.median(r["times"]) / base}
            for r in runs]


def step_parser(prog: str, doc: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The options shared by the benchmarks of the train step (train, profile)."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="bench_small")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true")
    return p


def step_config(args):
    """The resolved config of `step_parser`'s arguments; a user's mistake exits 2, no traceback."""
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        raise SystemExit(2)
    try:
        return resolve_for_mesh(cfg_lib.apply_overrides(cfg_lib.load_config(args.config), args.overrides))
    except cfg_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv=None) -> int:
    p = step_parser("python -m fractus_jax.bench train", __doc__, 10, "timed steps (median)")
    p.add_argument("--torch", action="store_true", help="also time the PyTorch reference step")
    p.add_argument("--dispatch", action="store_true",
                   help="also time the other MoE dispatch choices (dropless, cf=E/K, cf=4, cf=1.25) "
                        "in this process, round robin")
    p.add_argument("--kernels", action="store_true",
                   help="also time the plain kernels against the CPU-tuned ones (execution.kernels=plain, cpu) "
                        "in this process, round robin")
    args = p.parse_args(argv)
    cfg = step_config(args)
    r = run(cfg, args.steps, args.warmup, args.torch)
    streams = f", {r['row_streams']} row streams" if r["row_streams"] > 1 else ""
    streams += f", {r['kernels']} kernels"
    print(f"{args.config} on {r['devices']} x {r['device_kind']} ({r['backend']}, {r['cores']} cores{streams}): "
          f"{r['ms_per_step']:.1f} ms/step, {r['ids_per_s']:.0f} ids/s (compile {r['compile_s']:.1f} s)")
    print(f"  {r['flops_per_id'] / 1e6:.2f} MFLOP/id (analytic, train), achieved "
          f"{r['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s, peak {r['peak_flops_per_s'] / 1e9:.1f} "
          f"GFLOP/s per {r['peak_scope']} x {r['peak_units']} ({r['peak_kind']}; median "
          f"{r['peak_median_flops_per_s'] / 1e9:.1f}), MFU {100 * r['mfu']:.1f}%"
          + (f" (paired by round: {100 * r['mfu_paired']:.1f}%)" if r["mfu_paired"] is not None else ""))
    pages = f" ({hostmem.HUGETLB_TUNABLE})" if r["malloc_hugetlb"] else ""
    print(f"  host malloc {r['allocator']}{pages}: {r['page_faults_per_step']:,} page faults per step (median)")
    note = hostmem.advice(r["page_faults_per_step"])
    if note:
        print("  " + note)
    if "torch_ids_per_s" in r:
        print(f"  PyTorch reference step: {r['torch_ids_per_s']:.0f} ids/s ({r['torch_threads']} threads); "
              f"JAX is {r['speedup_vs_torch']:.1f}x")
    if args.dispatch:
        r["dispatch"] = compare_dispatch(cfg, warmup=args.warmup)
        print("  MoE dispatch, round robin in this process (ratio: step time against the first):")
        for d in r["dispatch"]:
            print(f"    {d['dispatch']:<18} {d['ms_per_step']:8.1f} ms/step {d['ids_per_s']:8.0f} ids/s "
                  f"keep_rate {d['keep_rate']:.3f}  x{d['ratio']:.2f}")
    if args.kernels:
        r["kernel_forms"] = compare_models(cfg, KERNEL_CHOICES, warmup=args.warmup)
        print("  execution.kernels, round robin in this process (ratio: step time against plain):")
        for d in r["kernel_forms"]:
            print(f"    {d['name']:<18} {d['ms_per_step']:8.1f} ms/step {d['ids_per_s']:8.0f} ids/s  x{d['ratio']:.2f}")
    if args.json:
        print(json.dumps(r))
    return 0
