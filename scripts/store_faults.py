"""How long a store that fails silently holds one of the run's transfers: a local server
(moto for s3://, fake-gcs-server for gs://, as the tests run them) behind the tests' relay,
the fault set as the transfer starts, the store clients' own tries (AWS_MAX_ATTEMPTS unset;
gcsfs's six). Prints the seconds until the transfer failed, and why (docs/training.md,
Object storage). Needs the dev extra: pip install -e ".[dev]".

    python scripts/store_faults.py --scheme s3 --fault deaf [--op put] [--mib 200] [--give-up 1800]

  --fault stall  the store takes the connection and what is sent, and answers nothing
  --fault deaf   the store reads a connection's first MiB and no more, the connection open

With --op upload, the transfer is a run's upload of a step (a file of --mib MiB) as the
trainer makes it, tried again as it fails (store.TRY_WAITS), and the fault is lifted after
--down seconds: it prints each try's line and when the step was committed.

    python scripts/store_faults.py --scheme s3 --fault cut --op upload --down 90
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gcs_testing import GCSServer  # noqa: E402
from s3_testing import Relay, S3Server  # noqa: E402

from fractus_jax.train import store  # noqa: E402


def behind_a_relay(scheme: str):
    """A local server, the relay in front of it that sets the faults, and a run's URL in a new
    bucket there; the store clients pointed at the relay with their default tries."""
    server = S3Server() if scheme == "s3" else GCSServer()
    try:
        relay = Relay(server.port)
        os.environ.update(server.env(relay.endpoint))
        for name in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):   # the clients' default tries
            os.environ.pop(name, None)
        return server, relay, f"{scheme}://{server.bucket('faults')}/run"
    except BaseException:
        server.close()
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=("s3", "gs"), required=True)
    ap.add_argument("--fault", choices=("stall", "deaf", "cut"), required=True,
                    help="cut: the store refuses connections and drops the open ones")
    ap.add_argument("--op", choices=("put", "get", "upload"), default="put")
    ap.add_argument("--mib", type=int, default=200, help="the file's size")
    ap.add_argument("--down", type=float, default=90.0, help="--op upload: the fault is lifted after this long")
    ap.add_argument("--give-up", type=float, default=1800.0, help="stop waiting after this many seconds")
    args = ap.parse_args(argv)
    if args.op == "upload":
        return upload(args)
    if args.fault == "cut":
        ap.error("--fault cut needs --op upload (a cut fails a single transfer at once)")

    server, relay, url = behind_a_relay(args.scheme)
    try:
        work = Path(tempfile.mkdtemp())
        local = work / "file"
        local.write_bytes(os.urandom(args.mib << 20))
        if args.op == "get":
            store.Store(url).put([local], ["file"])
        box = {}

        def transfer():
            s = store.Store(url)
            started = time.monotonic()
            try:
                s.put([local], ["file"]) if args.op == "put" else s.get(["file"], [work / "back"])
                box["done"] = time.monotonic() - started
            except Exception as e:   # noqa: BLE001 - what the run's error line would say
                box["failed"] = (time.monotonic() - started, store.failure_words(e))

        relay.stall() if args.fault == "stall" else relay.deaf(1 << 20)
        thread = threading.Thread(target=transfer, daemon=True)
        thread.start()
        thread.join(args.give_up)
        if "failed" in box:
            print(f"{args.scheme} {args.op}, {args.fault}: failed after {box['failed'][0]:.0f} s: {box['failed'][1]}")
        elif "done" in box:
            print(f"{args.scheme} {args.op}, {args.fault}: done after {box['done']:.0f} s (the fault did not hold it)")
        else:
            print(f"{args.scheme} {args.op}, {args.fault}: still waiting after {args.give_up:.0f} s")
    finally:
        server.close()
    os._exit(0)   # the transfer's thread may still wait on the relay


def upload(args) -> int:
    """A run's upload of a step through a fault lifted after args.down seconds."""
    server, relay, url = behind_a_relay(args.scheme)
    try:
        stage = Path(tempfile.mkdtemp()) / "stage"
        started = time.monotonic()
        say = lambda line: print(f"{time.monotonic() - started:6.1f} s  {line}", flush=True)  # noqa: E731
        mirror = store.Mirror(url, stage, say).open()
        step = stage / store.CHECKPOINTS / "1"
        step.mkdir(parents=True)
        (step / "file").write_bytes(os.urandom(args.mib << 20))
        real = store.Store.put

        def faulted(self, local, remote, transfer=None):   # as the step's files start
            if not getattr(faulted, "done", False):
                faulted.done = True
                {"cut": relay.cut, "stall": relay.stall, "deaf": lambda: relay.deaf(1 << 20)}[args.fault]()
                say(f"the store {args.fault}: lifted in {args.down:g} s")
                threading.Timer(args.down, lift).start()
            return real(self, local, remote, transfer)

        def lift():
            {"cut": relay.restore, "stall": lambda: relay.stall(False), "deaf": lambda: relay.deaf(None)}[args.fault]()
            say("the store is back")

        store.Store.put = faulted
        started = time.monotonic()
        mirror.push(1)
        try:
            mirror.settle()
            say(f"step 1 committed: {store.Store(url).exists(store.CHECKPOINTS, '1', store.COMMITTED)}")
        except Exception as e:   # noqa: BLE001 - the run's error line
            say(f"error: {e}")
        mirror.close(quiet=True)
    finally:
        server.close()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
