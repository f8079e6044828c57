"""python -m fractus_jax.train --config NAME --workdir DIR [--set key=value ...]"""
from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fractus_jax.train", description=__doc__)
    p.add_argument("--config", required=True, help="configs/NAME.py, or a path to a config file")
    p.add_argument("--workdir", required=True, help="run directory: checkpoints, manifest, metrics")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (dotted: model.variant=parent) or a PyTorch trainer name (BATCH=16)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    dist = p.add_argument_group("several hosts (jax.distributed)")
    dist.add_argument("--distributed", action="store_true",
                      help="call jax.distributed.initialize; without the flags below it reads the "
                           "cluster's environment (SLURM, Open MPI, ...) or JAX_COORDINATOR_ADDRESS etc.")
    dist.add_argument("--coordinator", help="host:port of process 0")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    dist.add_argument("--local-devices", type=int,
                      help="CPU only: devices per process (tests and rehearsals on one machine)")
    return p.parse_args(argv)


def init_distributed(args) -> None:
    """Before any JAX computation: join the other processes of a multi-host run."""
    import jax

    if args.local_devices:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.distributed or args.coordinator:
        kwargs = {k: v for k, v in (("coordinator_address", args.coordinator),
                                    ("num_processes", args.num_processes),
                                    ("process_id", args.process_id)) if v is not None}
        jax.distributed.initialize(**kwargs)


def main(argv=None) -> int:
    args = parse_args(argv)
    from fractus_jax.atom.corpus import CorpusError
    from fractus_jax.train import checkpoint, config, data, loop

    user_errors = (config.ConfigError, loop.TrainError, CorpusError, checkpoint.CheckpointError, data.DataError)
    init_distributed(args)
    import jax

    from fractus_jax import hostmem
    note = hostmem.cpu_training_note(jax.default_backend())
    if note and jax.process_index() == 0:
        print(note, file=sys.stderr)
    try:
        cfg = config.apply_overrides(config.load_config(args.config), args.overrides)
        plan = loop.prepare(cfg, args.workdir, progress=not args.no_progress)
        last = loop.run(plan, progress=not args.no_progress,
                        log=lambda msg: print(msg, file=sys.stderr))
    except user_errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if last:
        print(f"step {last['step']}: ce_tf {last['ce_tf']:.4f} ema_tf {last['ema_tf']:.4f} "
              f"{last['ids_per_s_tf']:.0f} ids/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
