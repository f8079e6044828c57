"""Move a run between JAX and PyTorch (docs/convert.md).

    python -m fractus_jax.convert export --ckpt DIR_OR_STEP --out FILE.pt|FILE.safetensors [--opt] [--hub]
    python -m fractus_jax.convert import --pt FILE --out DIR --config NAME [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import sys

from fractus_jax.convert.state_dicts import ConversionError
from fractus_jax.train.config import ConfigError
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import store
from fractus_jax.train.rundir import CheckpointError
from fractus_jax.urls import local_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fractus_jax.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="a run directory's checkpoint → PyTorch files")
    e.add_argument("--ckpt", required=True, metavar="DIR_OR_STEP", type=store.workdir_arg,
                   help="a run directory (its latest checkpoint) or DIR/checkpoints/<step>")
    e.add_argument("--out", required=True, metavar="FILE", type=local_path,
                   help="FILE.pt (torch.save), FILE.bin, or FILE.safetensors")
    e.add_argument("--opt", action="store_true",
                   help="also write the optimizer moments as a PyTorch optimizer state dict (<stem>.opt)")
    e.add_argument("--hub", action="store_true",
                   help="the model hub's names: <stem>.bin for a .pt, <stem>.opt.bin for the moments")
    i = sub.add_parser("import", help="a PyTorch checkpoint → a new run directory the trainer resumes")
    i.add_argument("--pt", required=True, metavar="FILE", type=local_path, help=".pt, .bin, .pth or .safetensors")
    i.add_argument("--out", required=True, metavar="DIR", type=store.workdir_arg,
                   help="the new run directory, or an s3:// or gs:// URL that holds no run")
    i.add_argument("--config", required=True, help="a config name (fractus_jax/configs/NAME.py) or a path: the run's TrainConfig")
    i.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, as for the trainer")
    i.add_argument("--opt", dest="opt_file", metavar="FILE", type=local_path,
                   help="the optimizer file (default: <stem>.opt or <stem>.opt.bin beside --pt)")
    i.add_argument("--no-opt", action="store_true", help="ignore any optimizer file: fresh moments")
    i.add_argument("--fresh-carry", action="store_true", help="start from a zero carry even if the batch matches")
    i.add_argument("--trust-pickle", action="store_true",
                   help="let torch.load run arbitrary pickled objects (only for files you trust)")
    return p.parse_args(argv)


# The PyTorch side of the conversion: the `torch` extra of pyproject.toml.
TORCH_MODULES = ("torch", "safetensors")
TORCH_INSTALL = 'pip install torch==2.13.0 && pip install -e ".[torch]"'


def missing_torch(e: ModuleNotFoundError) -> bool:
    return (e.name or "").split(".")[0] in TORCH_MODULES


def torch_missing_message(e: ModuleNotFoundError, command: str) -> str:
    return (f"{command} needs {e.name}, which is not installed: {TORCH_INSTALL} "
            "(the pinned torch is a CPU build; see README.md)")


def main(argv=None) -> int:
    args = parse_args(argv)
    warn = lambda msg: print(f"warning: {msg}", file=sys.stderr)  # noqa: E731
    try:
        from fractus_jax.convert import run   # needs torch: a missing one is answered below
        if args.command == "export":
            ckpt = store.readable(args.ckpt, log=lambda m: print(m, file=sys.stderr),
                                  items=None if args.opt else ckpt_lib.WEIGHTS_ITEMS)
            for path in run.export_run(ckpt, args.out, opt=args.opt, hub=args.hub, log=warn):
                print(path)
        else:
            with store.new_run(args.out, log=lambda m: print(m, file=sys.stderr)) as out:
                meta = run.import_checkpoint(args.pt, out, args.config, args.overrides, opt_file=args.opt_file,
                                             no_opt=args.no_opt, fresh_carry=args.fresh_carry,
                                             trust_pickle=args.trust_pickle, log=warn)
            print(f"{args.out}: step {meta['step']}, lane offset {meta['start_token_next']}, "
                  f"batch {meta['batch_size']}, carry {meta['carry']}")
    except (ConversionError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if not missing_torch(e):
            raise
        print(f"error: {torch_missing_message(e, 'convert ' + args.command)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
