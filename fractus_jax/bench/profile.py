"""`python -m fractus_jax.bench profile --config NAME [--set k=v ...] [--steps N] [--json]`

Where the trainer's step spends its time. The step (`bench train`'s: the trainer's jitted
step, state donated) is compiled once, run a few times, then run `--steps` times under
`jax.profiler.trace`; every XLA operation the trace shows is matched to its instruction in
the compiled program, whose metadata names the JAX source of the operation. Op times are
summed per step by:

  component   the named scope the operation came from (model.py and train/step.py name
              embed, attention, kuramoto, moe, layernorm, loss and optimizer); "other" is
              what lies outside them (the residual adds, the gradient plumbing of the
              layer loop, the metrics)
  pass        forward, or backward (JAX's transpose of the forward)
  kind        from the compiled program's opcode (a fusion: a matmul when it wraps a dot,
              else its root's): matmul (dot), data movement (transpose, copy, concatenate,
              pad, slice, gather, scatter, dynamic-update-slice, ...), elementwise
              (everything else: fused arithmetic, reductions)

and it reports how busy the host's threads were: op time per thread over the traced span.
Sums are op times: two threads running at once count twice, so the total can exceed the
wall time. With --json the last line is one JSON object.

`--trace DIR` keeps the raw `jax.profiler` trace of the traced steps in
DIR/plugins/profile/<time>/: <host>.xplane.pb, which `tensorboard --logdir DIR` shows in its
Profile tab (pip install tensorboard tensorboard-plugin-profile), and <host>.trace.json.gz,
which Perfetto (ui.perfetto.dev) or chrome://tracing open.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import sys
import tempfile

import jax

from fractus_jax import hostmem
from fractus_jax.bench.train import build_step, step_config, step_parser

KINDS = ("matmul", "data movement", "elementwise")
COMPONENTS = ("embed", "attention", "kuramoto", "moe", "layernorm", "loss", "optimizer")
_MOVEMENT = {"transpose", "copy", "concatenate", "pad", "slice", "dynamic_slice",
             "dynamic_update_slice", "gather", "scatter", "reshape", "broadcast_in_dim",
             "rev", "select_and_scatter_add"}
_SCOPE = re.compile(r"(?:^|[/(])(" + "|".join(COMPONENTS) + r")(?=[/)]|$)")


def classify(op_name: str) -> tuple[str, str, str]:
    """(component, pass, kind) of an operation from its metadata op_name, e.g.
    'jit(step)/transpose(jvp())/while/body/closed_call/moe/enf,efr->enr/dot_general'."""
    scopes = _SCOPE.findall(op_name)
    component = scopes[-1] if scopes else "other"   # the innermost scope
    pass_ = "backward" if "transpose(" in op_name else "forward"
    primitive = op_name.rsplit("/", 1)[-1]
    kind = ("matmul" if primitive == "dot_general" else
            "data movement" if primitive in _MOVEMENT else "elementwise")
    return component, pass_, kind


_HLO_MOVEMENT = {"transpose", "copy", "concatenate", "pad", "slice", "dynamic-slice",
                 "dynamic-update-slice", "gather", "scatter", "reshape", "broadcast", "reverse",
                 "bitcast", "select-and-scatter"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\(")


def instruction_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> kind, from the compiled module's own opcodes: a fusion is a
    matmul when its computation holds a dot (XLA:CPU's library fusions wrap one), else the
    kind of its root. The op_name's last word can mislead: the dots that transpose a
    dot_general in the backward carry JAX's "transpose" as their primitive."""
    opcode, calls, roots, has_dot = {}, {}, {}, set()
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            computation = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, op = m.groups()
        opcode[name] = op
        if op in ("dot", "convolution"):
            has_dot.add(computation)
        if line.lstrip().startswith("ROOT"):
            roots[computation] = op
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if op == "fusion" and called:
            calls[name] = called.group(1)

    def kind(op):
        return ("matmul" if op in ("dot", "convolution") else
                "data movement" if op in _HLO_MOVEMENT else "elementwise")

    out = {}
    for name, op in opcode.items():
        if op == "fusion" and name in calls:
            body = calls[name]
            out[name] = "matmul" if body in has_dot else kind(roots.get(body, ""))
        else:
            out[name] = kind(op)
    return out


def instruction_sources(hlo_text: str) -> dict[str, str]:
    """Instruction name -> op_name metadata ('' where none) of a compiled HLO module."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
        if m:
            md = re.search(r'op_name="([^"]*)"', line)
            out[m.group(1)] = md.group(1) if md else ""
    return out


def _leaves(ops: list[dict]) -> list[dict]:
    """Drop the events that contain others on their thread: control flow (a while loop,
    a conditional, a call) spans its body's operations, which are counted themselves."""
    containers = set()
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        open_ = []                       # indices of events still open, outermost first
        for i in idx:
            start = ops[i]["ts"]
            while open_ and ops[open_[-1]]["ts"] + ops[open_[-1]]["dur"] <= start:
                open_.pop()
            if open_:
                containers.add(open_[-1])
            open_.append(i)
    return [e for i, e in enumerate(ops) if i not in containers]


def summarize(events: list[dict], sources: dict[str, str], n_steps: int, top: int = 15,
              kinds: dict[str, str] | None = None) -> dict:
    """Per-step op times (ms) by component/pass/kind, thread use and the top operations,
    from trace events (Chrome trace format: ph, name, ts, dur in µs, tid). `kinds`
    (instruction_kinds) overrides the kind read from an op_name."""
    kinds = kinds or {}
    def instruction(e):
        # CPU traces name the event by the instruction; GPU traces name the kernel and carry
        # the instruction in args.hlo_op (not yet checked on a GPU).
        name = e.get("name")
        return name if name in sources else (e.get("args") or {}).get("hlo_op")

    ops = []
    for e in events:
        if e.get("ph") == "X" and instruction(e) in sources:
            ops.append({**e, "name": instruction(e)})
    ops = _leaves(ops)
    if not ops:
        raise RuntimeError("the trace holds no operation of the compiled step")

    def per(us):   # µs over the traced steps -> ms per step
        return us / 1e3 / n_steps

    by_component = collections.defaultdict(lambda: collections.Counter())
    by_kind = collections.Counter()
    component_kind = collections.defaultdict(lambda: collections.Counter())
    by_op = collections.Counter()
    threads = collections.Counter()
    for e in ops:
        component, pass_, kind = classify(sources[e["name"]])
        kind = kinds.get(e["name"], kind)
        by_component[component][pass_] += e["dur"]
        by_kind[kind] += e["dur"]
        component_kind[component][kind] += e["dur"]
        by_op[e["name"]] += e["dur"]
        threads[e["tid"]] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
    total = sum(by_kind.values())
    return {
        "steps": n_steps,
        "op_ms_per_step": per(total),
        "span_ms_per_step": per(span),
        "components": {c: {"forward": per(v["forward"]), "backward": per(v["backward"]),
                           **{k: per(component_kind[c][k]) for k in KINDS}}
                       for c, v in sorted(by_component.items(), key=lambda kv: -sum(kv[1].values()))},
        "kinds": {k: per(v) for k, v in by_kind.most_common()},
        "threads_busy": sorted((v / span for v in threads.values() if v / span > 0.01), reverse=True),
        "top_ops": [{"name": n, "ms": per(v), "source": sources[n]} for n, v in by_op.most_common(top)],
    }


def format_table(r: dict) -> str:
    total = r["op_ms_per_step"]
    busy = ", ".join(f"{100 * b:.0f}%" for b in r["threads_busy"])
    lines = [(f"op time {total:.1f} ms per step over a span of {r['span_ms_per_step']:.1f} ms "
              f"({r['steps']} traced steps); threads busy {busy}"),
             (f"{'component':<12}{'forward ms':>12}{'backward ms':>13}{'share':>8}"
              f"{'matmul':>9}{'movement':>10}{'elementw.':>11}")]
    for c, v in r["components"].items():
        lines.append(f"{c:<12}{v['forward']:>12.1f}{v['backward']:>13.1f}"
                     f"{100 * (v['forward'] + v['backward']) / total:>7.1f}%"
                     f"{v['matmul']:>9.1f}{v['data movement']:>10.1f}{v['elementwise']:>11.1f}")
    lines.append("by kind: " + ", ".join(f"{k} {v:.1f} ms ({100 * v / total:.0f}%)" for k, v in r["kinds"].items()))
    lines.append("top operations (ms per step, source):")
    for op in r["top_ops"]:
        lines.append(f"  {op['ms']:7.2f}  {op['name'][:32]:<32} {op['source'][-80:]}")
    return "\n".join(lines)


def profile_step(cfg, steps: int = 3, warmup: int = 2, trace_dir: str | None = None, top: int = 15) -> dict:
    """Trace `steps` runs of the compiled step after `warmup` runs; the summary dict."""
    step, state, batches = build_step(cfg, steps + warmup)
    compiled = step.lower(state, batches[0]).compile()
    hlo = compiled.as_text()
    sources = instruction_sources(hlo)
    for b in batches[:warmup]:
        state, _ = compiled(state, b)
    jax.block_until_ready(state)
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="fractus_profile_")
    with jax.profiler.trace(trace_dir):
        for b in batches[warmup:]:
            state, _ = compiled(state, b)
            jax.block_until_ready(state)
    files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
    if not files:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    out = summarize(events, sources, steps, top, instruction_kinds(hlo))
    if set(out["components"]) == {"other"}:
        # Persistent compilation cache keys ignore metadata: an executable cached from the
        # same program before its scopes were named carries none.
        print("warning: the compiled step carries no named scopes; if JAX_COMPILATION_CACHE_DIR "
              "is set, an executable cached by an older version was reused (clear the cache)",
              file=sys.stderr)
    out.update(trace=files[-1], backend=jax.default_backend(), devices=cfg.mesh.data * cfg.mesh.fsdp,
               allocator=hostmem.allocator())
    return out


def main(argv=None) -> int:
    p = step_parser("python -m fractus_jax.bench profile", __doc__, 3, "traced steps")
    p.add_argument("--top", type=int, default=15, help="operations listed")
    p.add_argument("--trace", "--trace-dir", dest="trace_dir", metavar="DIR", default=None,
                   help="keep the jax.profiler trace in DIR (tensorboard --logdir DIR, or Perfetto)")
    args = p.parse_args(argv)
    cfg = step_config(args)
    r = profile_step(cfg, args.steps, args.warmup, args.trace_dir, args.top)
    print(f"{args.config} on {r['devices']} device(s), {r['backend']}, host malloc {r['allocator']}")
    print(format_table(r))
    if args.trace_dir:
        print(f"trace: {r['trace']} (Perfetto: ui.perfetto.dev); tensorboard --logdir {args.trace_dir} "
              "shows it in its Profile tab (pip install tensorboard tensorboard-plugin-profile)")
    if args.json:
        print(json.dumps(r))
    return 0
