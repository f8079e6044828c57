#!/usr/bin/env python3
"""Draw a run's metrics.jsonl into a PNG: training CE (and held-out CE where logged), the
probes on their own panels (their CE runs on another scale), throughput and load balance.

    python scripts/plot_metrics.py RUN_DIR [--out FILE.png]

Needs matplotlib: pip install -e ".[plot]".
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PLOT_INSTALL = 'pip install -e ".[plot]" (or pip install matplotlib)'

def load(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise SystemExit(f"error: {path}:{n} is not JSON")
    return rows


# Panels, top to bottom; a panel with none of its keys in the log is left out.
# (key, label, style) per axis; "right" keys go on a second y axis of the same panel.
TRAINING_CE = [("ce_tf", "ce_tf (training batch)", "-"), ("ema_tf", "ema_tf", "-"),
               ("ce_ss", "ce_ss (scheduled sampling)", "."), ("val_ce", "val_ce (held-out)", "o-")]
TRAINING_RIGHT = [("val_bpb", "val_bpb (held-out, bits/byte)", "s--")]
PROBE_CE = [("probe_ce", "probe_ce (teacher-forced)", "o-"), ("ar_ce", "ar_ce (free-running, 32 ids)", "o-")]
PROBE_RATES = [("probe_echo", "probe_echo", "o-"), ("ar_match", "ar_match", "o-")]
PROBE_SPEECH = [("speech_unique_ids", "speech unique ids", "^--"), ("speech_unique_bytes", "speech unique bytes", "v--")]
# The probes at step 0 are logged as init_*: drawn as the first point of probe_*.
INIT_OF = {"probe_ce": "init_ce", "probe_echo": "init_echo"}


def series(rows: list[dict], key: str):
    """(steps, values) of a scalar key; probe_* starts with its init_* at step 0."""
    keys = (INIT_OF[key], key) if key in INIT_OF else (key,)
    pts = [(r["step"], r[k]) for r in rows for k in keys
           if "step" in r and isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw(ax, rows, keys) -> bool:
    drawn = False
    for key, label, style in keys:
        x, y = series(rows, key)
        if x:
            ax.plot(x, y, style, label=label, markersize=4)
            drawn = True
    return drawn


def _legend(*axes):
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        axes[0].legend(handles, labels, fontsize=8, loc="best")


def _has(rows, keys) -> bool:
    return any(series(rows, key)[0] for key, _, _ in keys)


def plot(rows: list[dict], out: Path, title: str) -> dict[str, list[str]]:
    """Write the PNG; returns each panel's legend (the series drawn on it), top to bottom."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = ["training"]
    if _has(rows, PROBE_CE):
        panels.append("probe_ce")
    if _has(rows, PROBE_RATES):
        panels.append("probe_rates")
    if _has(rows, PROBE_SPEECH):
        panels.append("speech")
    panels += ["speed", "balance"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels) + 1), sharex=True, squeeze=False)
    axes = dict(zip(panels, axes[:, 0]))

    ax = axes["training"]
    _draw(ax, rows, TRAINING_CE)
    ax.set_ylabel("training CE (nats)")
    right = ax.twinx() if _has(rows, TRAINING_RIGHT) else None
    if right is not None:
        _draw(right, rows, TRAINING_RIGHT)
        right.set_ylabel("bits / byte")
    _legend(*([ax] + ([right] if right is not None else [])))

    if "probe_ce" in axes:
        # ar_ce (feeding back its own guesses) runs far above the teacher-forced CE: a log
        # axis keeps both readable; the star marks the value at init.
        ax = axes["probe_ce"]
        _draw(ax, rows, PROBE_CE)
        x, y = series(rows, "init_ce")
        if x:
            ax.plot(x, y, "*", color="black", markersize=9, label="init_ce (step 0)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("probe CE (nats, log)")
        _legend(ax)

    if "probe_rates" in axes:
        ax = axes["probe_rates"]
        _draw(ax, rows, PROBE_RATES)
        ax.set_ylabel("probe fraction")
        ax.set_ylim(-0.02, 1.02)
        _legend(ax)

    if "speech" in axes:
        ax = axes["speech"]
        _draw(ax, rows, PROBE_SPEECH)
        ax.set_ylabel("speech gate (of 40 ids)")
        ax.set_ylim(bottom=0)
        ax.yaxis.get_major_locator().set_params(integer=True)
        _legend(ax)

    ax = axes["speed"]
    _draw(ax, rows, [("ids_per_s_tf", "ids_per_s_tf", "-"), ("ids_per_s_wall", "ids_per_s_wall", "-")])
    ax.set_ylabel("ids / s")
    _legend(ax)

    ax = axes["balance"]
    _draw(ax, rows, [("lb", "lb (sum over blocks)", "-"), ("keep_rate", "capacity keep rate", "-")])
    ax.set_ylabel("load balance")
    ax.set_xlabel("step")
    _legend(ax)

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return {name: [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []
            for name, ax in axes.items()}


def _local(value: str) -> Path:
    """A path of this machine: a URL (a run on object storage) is refused, not collapsed to
    "s3:/..." (plot its stage, which the run's end-of-run lines name)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value):   # fractus_jax.urls.URL (this script imports nothing of the package)
        raise argparse.ArgumentTypeError(f"{value!r} is a URL: give a local path (a run on object storage: "
                                         "its stage, which the run's last lines name)")
    return Path(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=_local)
    p.add_argument("--out", type=_local, default=None, help="default: RUN_DIR/metrics.png")
    args = p.parse_args(argv)
    path = args.run_dir / "metrics.jsonl" if args.run_dir.is_dir() else args.run_dir
    if not path.exists():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    rows = load(path)
    if not rows:
        print(f"error: {path} holds no metrics", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print(f"error: plotting needs matplotlib, which is not installed: {PLOT_INSTALL}", file=sys.stderr)
        return 2
    out = args.out or path.with_name("metrics.png")
    plot(rows, out, str(args.run_dir))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
