"""`python -m fractus_jax.bench SUBCOMMAND [ARGS]`: a dispatcher over the subcommand modules.

Each entry of SUBCOMMANDS names a module of this package with a `main(argv) -> int`; the
module is imported only when its subcommand runs (so `attention` does not pay for what a
`train` benchmark imports, and the reverse). To add a subcommand, add its module and one
line here.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS = {
    "attention": ("fractus_jax.bench.attention",
                  "fwd+bwd milliseconds of the linear-attention kernels at the 1B shapes"),
    "train": ("fractus_jax.bench.train",
              "the trainer's step: ids/s, analytic FLOPs per id, MFU against a measured peak"),
    "lanes": ("fractus_jax.bench.lanes",
              "the lane reader's ids/s from a set of shards against one file"),
    "store": ("fractus_jax.bench.store",
              "a checkpoint saved, uploaded to s3:// or gs://, pulled and restored: MB/s of each leg"),
    "profile": ("fractus_jax.bench.profile",
                "where the trainer's step spends its time: op time by component, pass, kind"),
}


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<12} {text}" for name, (_, text) in SUBCOMMANDS.items())
    p = argparse.ArgumentParser(
        prog="python -m fractus_jax.bench",
        description="Benchmarks of the fractus-jax engine.",
        epilog=f"subcommands:\n{listing}\n\n"
               "`python -m fractus_jax.bench SUBCOMMAND -h` for its options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=sorted(SUBCOMMANDS), metavar="SUBCOMMAND",
                   help="one of: " + ", ".join(sorted(SUBCOMMANDS)))
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = _parser().parse_args(argv[:1])   # only the subcommand: its options are its own
    module = importlib.import_module(SUBCOMMANDS[ns.command][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
