#!/usr/bin/env python3
"""Draw CE, throughput and load balance from a run's metrics.jsonl into a PNG.

    python scripts/plot_metrics.py RUN_DIR [--out FILE.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise SystemExit(f"error: {path}:{n} is not JSON")
    return rows


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for key, style in (("ce_tf", "-"), ("ema_tf", "-"), ("ce_ss", "."), ("ar_ce", "o")):
        x, y = series(key)
        if x:
            axes[0].plot(x, y, style, label=key)
    axes[0].set_ylabel("cross-entropy (nats)")
    axes[0].legend()
    for key in ("ids_per_s_tf", "ids_per_s_wall"):
        x, y = series(key)
        if x:
            axes[1].plot(x, y, label=key)
    axes[1].set_ylabel("ids / s")
    axes[1].legend()
    x, y = series("lb")
    if x:
        axes[2].plot(x, y, label="lb (sum over blocks)")
    x, y = series("keep_rate")
    if x:
        axes[2].plot(x, y, label="capacity keep rate")
    axes[2].set_ylabel("load balance")
    axes[2].set_xlabel("step")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/metrics.png")
    args = p.parse_args(argv)
    path = args.run_dir / "metrics.jsonl" if args.run_dir.is_dir() else args.run_dir
    if not path.exists():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    rows = load(path)
    if not rows:
        print(f"error: {path} holds no metrics", file=sys.stderr)
        return 2
    out = args.out or path.with_name("metrics.png")
    plot(rows, out, str(args.run_dir))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
