"""python -m fractus_jax.train --config NAME --workdir DIR [--set key=value ...]"""
from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Optional

import jax

from fractus_jax import hostmem
from fractus_jax.atom.corpus import CorpusError
from fractus_jax.lanes import LaneError
from fractus_jax.train import config, loop, peers, policy, rundir, store
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.errors import TrainError
from fractus_jax.train.heldout import carry_schedule
from fractus_jax.train.rundir import METRICS
from fractus_jax.train.tboard import DIRNAME as TENSORBOARD
from fractus_jax.urls import local_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fractus_jax.train", description=__doc__)
    p.add_argument("--config", required=True, help="a config name (fractus_jax/configs/NAME.py), or a path to a config file")
    p.add_argument("--workdir", required=True, type=store.workdir_arg,
                   help="run directory: checkpoints, manifest, metrics; a local path, s3://BUCKET/PATH or "
                        "gs://BUCKET/PATH (trained in a local stage, each commit uploaded)")
    p.add_argument("--stage", type=local_path, metavar="DIR",
                   help="with an s3:// or gs:// --workdir: the local directory the run is trained in (default: "
                        "FRACTUS_CACHE/stage/SCHEME/BUCKET/PATH); the store stays the truth")
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
    dist.add_argument("--peer-timeout", type=float, default=peers.PEER_TIMEOUT_SECONDS, metavar="SECONDS",
                      help=f"a process silent this long is taken for dead, and every other one ends "
                           f"within this + {peers.lost_bound_seconds(0):.0f} s (default "
                           f"{peers.PEER_TIMEOUT_SECONDS:.0f}; at least {peers.MIN_PEER_TIMEOUT_SECONDS:.0f})")
    dist.add_argument("--local-devices", type=int,
                      help="CPU only: devices per process (tests and rehearsals on one machine)")
    args = p.parse_args(argv)
    if args.stage and not store.scheme_of(args.workdir):
        p.error("--stage goes with an s3:// or gs:// --workdir (a local run directory is its own stage)")
    if args.peer_timeout < peers.MIN_PEER_TIMEOUT_SECONDS:
        p.error(f"--peer-timeout {args.peer_timeout:g} is under {peers.MIN_PEER_TIMEOUT_SECONDS:g} s "
                "(five heartbeats): a late heartbeat would read as a death")
    return args


def init_distributed(args) -> None:
    """Before any JAX computation: join the other processes of a multi-host run."""
    if args.local_devices:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.distributed or args.coordinator:
        kwargs = {k: v for k, v in (("coordinator_address", args.coordinator),
                                    ("num_processes", args.num_processes),
                                    ("process_id", args.process_id)) if v is not None}
        # the service's own abort on a lost heartbeat comes after the watchdog's end (peers.py)
        jax.distributed.initialize(heartbeat_timeout_seconds=peers.service_heartbeat_timeout_seconds(args.peer_timeout),
                                   **kwargs)


def start_watchdog(args, argv):
    """In a multi-process run: the watchdog that ends this process when another one dies
    (peers.py); None in a one-process run."""
    if jax.process_count() == 1:
        return None
    index, count = jax.process_index(), jax.process_count()   # not asked of JAX again once a peer is gone
    dog = peers.Watchdog(policy.runtime_client(), index, count,
                         lambda process, seconds: peer_lost_line(args, argv, process, seconds, index, count),
                         timeout=args.peer_timeout,
                         failed=lambda process, line: peer_failed_line(argv, process, line, index, count),
                         before_exit=store.let_leases_go).start()
    dog.hold_aborts()
    return dog


def peer_lost_line(args, argv, process: int, seconds: float, index: int, count: int) -> str:
    """The last line of process `index` when process `process` died: who, the last
    committed step, the command."""
    workdir = Path(args.workdir)
    who = f"process {process}" + (" (it holds the coordination service)" if process == 0 else "")
    try:
        manifest = rundir.read_manifest(workdir)
    except Exception as e:   # noqa: BLE001 - the line names what it can
        manifest, where = None, f"unknown ({e})"
    else:
        where = "none yet"
    if manifest is not None:
        step = int(manifest["step"])
        where = f"{step} ({workdir / manifest.get('checkpoint', f'checkpoints/{step}')})"
    command = shlex.join(["python", "-m", "fractus_jax.train", *argv])
    return (f"error: {who} stopped answering (silent for {seconds:.0f} s); this process {index} "
            f"stops too (exit {peers.EXIT_PEER_LOST}). Last committed step: {where}. Resume them all by "
            f"starting all {count} processes again with their same commands; this one's: {command}")


def peer_failed_line(argv, process: int, line: str, index: int, count: int) -> str:
    """The last line of process `index` when process `process` stopped on the error `line`."""
    command = shlex.join(["python", "-m", "fractus_jax.train", *argv])
    return (f"error: process {process} stopped: {line.removeprefix('error: ')}. This process {index} stops too "
            f"(exit {peers.EXIT_PEER_FAILED}); once that is fixed, start all {count} processes again with their "
            f"same commands; this one's: {command}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    init_distributed(args)
    watchdog = start_watchdog(args, argv)
    try:
        code, error = train(args, argv)
    except BaseException as e:
        if watchdog is not None:   # a peer's death ends the process in `fail`, by the watchdog's line
            watchdog.fail(f"{type(e).__name__}: {e} (its traceback in that process's log)", 1, print_traceback=True)
        raise
    if watchdog is not None:
        if code == 0:
            watchdog.finish()
        else:
            watchdog.fail(error, code)   # the others end now, naming it; so does this process
    return code


def train(args, argv) -> tuple[int, Optional[str]]:
    """(exit status, the error line printed when it is not 0)."""
    user_errors = (config.ConfigError, TrainError, CorpusError, rundir.CheckpointError, LaneError)
    lead = jax.process_index() == 0
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    mirror = None
    try:
        cfg = config.apply_overrides(config.load_config(args.config), args.overrides)
        if store.scheme_of(args.workdir):   # the store's run, pulled into its stage
            mirror = store.open_mirror(args.workdir, args.stage, log=log,
                                       deadline=policy.parse_deadline(cfg.deadline))
            args.stage = str(mirror.stage)
        plan = prepare_lib.prepare(cfg, local_dir(args), progress=not args.no_progress,
                                   explicit=config.override_fields(args.overrides),
                                   checked=mirror.checked if mirror is not None else frozenset(),
                                   absent=mirror.left_out if mirror is not None else None)
        # The run is about to train: the allocator's note now (not on a refused run).
        note = hostmem.cpu_training_note(jax.default_backend())
        if note and lead:
            print(note, file=sys.stderr)
        last = loop.run(plan, progress=not args.no_progress, log=log, mirror=mirror)
    except user_errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, f"error: {e}"
    finally:
        if mirror is not None:
            mirror.close(quiet=True)   # closed by the run already, unless it never started
    if last and lead:
        print(f"step {last['step']}: ce_tf {last['ce_tf']:.4f} ema_tf {last['ema_tf']:.4f} "
              f"{last['ids_per_s_tf']:.0f} ids/s", file=sys.stderr)
        line = held_out_line(plan, last)
        if line:
            print(line, file=sys.stderr)
    if lead:
        print(outputs_summary(args, argv, plan.cfg, rundir.read_manifest(local_dir(args))), file=sys.stderr)
    return 0, None


def local_dir(args) -> Path:
    """The directory the run is trained in: --workdir, or the stage of a URL's."""
    return Path(args.stage if store.scheme_of(args.workdir) else args.workdir)


def held_out_line(plan, last: dict):
    """The held-out score of the last step, where it was evaluated."""
    if "val_ce" not in last:
        return None
    cfg = plan.cfg
    n = min(cfg.val_ids, plan.val.n_ids)
    where = (str(plan.val.path) if cfg.val_corpus else
             f"the {plan.val.n_ids} ids held out at the end of {Path(plan.corpus.path).name}")
    figures = lambda ce, bpb: f"val_ce {last[ce]:.4f}" + (  # noqa: E731
        "" if last.get(bpb) is None else f" val_bpb {last[bpb]:.4f} bits/byte")
    schedule = carry_schedule(cfg)
    line = (f"held-out ({n} ids of {where}, {cfg.val_lanes} lanes): {figures('val_ce', 'val_bpb')}, "
            f"the carry as trained ({schedule.describe()})")
    if not schedule.never and "val_ce_warm" in last:
        line += f"; carry streamed along each lane: {figures('val_ce_warm', 'val_bpb_warm')}"
    if not schedule.every_chunk:
        line += f"; from a zero carry at every chunk: {figures('val_ce_no_carry', 'val_bpb_no_carry')}"
    return line


def _script(name: str) -> str:
    """scripts/NAME as the user can type it: relative to the working directory when inside it."""
    path = Path(__file__).resolve().parents[2] / "scripts" / name
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def outputs_summary(args, argv, cfg, manifest) -> str:
    """Where a finished (or stopped) run's outputs are, and the commands that use them."""
    workdir = local_dir(args)
    url = str(args.workdir).rstrip("/") if store.scheme_of(args.workdir) else None
    q = shlex.quote
    lines = [f"run directory: {args.workdir}" + (f" (trained in {workdir})" if url else "")]
    if manifest is None:
        lines.append("  no checkpoint yet")
    else:
        step = int(manifest["step"])
        where = manifest.get("checkpoint", f"checkpoints/{step}")
        # a run on object storage: the store holds what was committed, the stage a copy
        lines.append(f"  last checkpoint: step {step} ({url}/{where})" if url else
                     f"  last checkpoint: step {step} ({workdir / where})")
    lines.append(f"  metrics: {url}/{METRICS} (the stage's copy: {workdir / METRICS})" if url else
                 f"  metrics: {workdir / METRICS}")
    done = manifest is not None and int(manifest["step"]) >= cfg.max_steps
    lines.append("next:")
    if done:   # the same command resumes; at max_steps it has nothing left to do
        more = _without_max_steps(argv) + ["--set", f"max_steps={2 * cfg.max_steps if cfg.max_steps else 100}"]
        lines.append(f"  train further: {shlex.join(['python', '-m', 'fractus_jax.train', *more])}")
    else:
        lines.append(f"  resume (the same command): {shlex.join(['python', '-m', 'fractus_jax.train', *argv])}")
    if manifest is not None:
        # a carry reset at every step trained the window function (docs/generation.md)
        window = f" --mode window --window {cfg.trained_window()}" if cfg.trained_window() else ""
        run = q(str(args.workdir))   # the URL of a run on object storage: they read it too
        lines.append(f"  generate: python -m fractus_jax.generate --ckpt {run} --prompt 'def main('{window}")
        held = cfg.val_fraction or cfg.val_corpus
        lines.append(f"  evaluate: python -m fractus_jax.eval --ckpt {run}"
                     + ("" if held else " --corpus HELD_OUT.u16"))
        lines.append(f"  export: python -m fractus_jax.convert export --ckpt {run} "
                     f"--out {q(str(workdir / 'model.pt'))}" + _needs("torch", "torch"))
    lines.append(f"  plot: python {q(_script('plot_metrics.py'))} {q(str(workdir))}" + _needs("matplotlib", "plot"))
    if cfg.tensorboard:
        viewer = "" if importlib.util.find_spec("tensorboard") is not None else "   (first: pip install tensorboard)"
        lines.append(f"  watch: tensorboard --logdir {q(str(workdir / TENSORBOARD))}" + viewer)
    return "\n".join(lines)


def _needs(module: str, extra: str) -> str:
    """A reminder of the extra to install, where its module is missing."""
    if importlib.util.find_spec(module) is not None:
        return ""
    return f"   (first: pip install -e \".[{extra}]\")"


def _without_max_steps(argv: list[str]) -> list[str]:
    """argv less its --set max_steps=... overrides (the summary proposes a new one)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        value = argv[i + 1] if a == "--set" and i + 1 < len(argv) else (a[6:] if a.startswith("--set=") else None)
        if value is not None and value.split("=", 1)[0].strip() in ("max_steps", "MAX_STEPS"):
            i += 2 if a == "--set" else 1
            continue
        out.append(a)
        i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
