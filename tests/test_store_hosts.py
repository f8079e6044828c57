"""Two processes that share no local directory train a run on object storage (moto's S3
server; fake-gcs-server's Google Cloud Storage), save it and resume it on new stages, as on a
new pod: each process uploads its own shards, process 0 commits, and the run ends bit for
bit where the same run on a shared disk ends. One process then resumes it, and two resume
that process's step."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from fractus_jax.train import peers, store
from engine_testing import SUBPROCESS_XLA_FLAGS
from gcs_testing import GCSServer
from s3_testing import Relay, S3Server, child_env, set_env
from test_multihost_faults import ROOT, RUN, STRAIGHT, ended, launch, restore_state, start

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["s3", "gs"])
def served(request):
    """(a server, its scheme): each kind of store."""
    server = {"s3": S3Server, "gs": GCSServer}[request.param]()
    yield server, request.param
    server.close()


def stages(root, pod):
    """Each process's --stage on its own root: nothing local is shared."""
    return {i: ("--stage", str(root / f"{pod}-host{i}")) for i in range(2)}


def same_as_on_a_shared_disk(server, url, shared, step, tmp_path, monkeypatch) -> dict:
    """The store's run equals, bit for bit, `shared` (the same commands run on one shared
    disk), both at `step`; returns the store's step's record."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    set_env(monkeypatch, server.env())
    (a, meta_a), (b, meta_b) = restore_state(store.readable(url, log=lambda m: None)), restore_state(shared)
    assert meta_a["step"] == meta_b["step"] == step and meta_a["start_token_next"] == meta_b["start_token_next"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    return meta_a


def test_two_processes_without_a_shared_disk_train_save_and_resume(served, corpus_file, tmp_path, monkeypatch):
    server, scheme = served
    bucket = server.bucket("hosts")
    url = f"{scheme}://{bucket}/run"
    env = child_env(server.env())

    # Pod A trains to step 4 (saves at 2 and 4): each process stages its own part.
    errs = launch(url, corpus_file, ["max_steps=4", "save_every=2"], each=stages(tmp_path, "a"), env=env)
    keys = server.keys(bucket, "run/")
    committed = sorted(int(k.split("/")[2]) for k in keys if k.endswith("/" + store.COMMITTED))
    assert committed == [2, 4], keys
    assert "run/lease.json" not in keys and "run/metrics.jsonl" in keys
    record = json.loads(server.read(bucket, "run/checkpoints/4/committed.json"))["files"]
    own = [{n for n in record if n.startswith(f"params/array_metadatas/process_{i}")} for i in range(2)]
    assert all(own), sorted(record)   # both processes' shards are in the store's step
    parts = [set(store._step_files(tmp_path / f"a-host{i}" / f"process-{i}" / "checkpoints" / "4")) for i in range(2)]
    assert parts[0] != parts[1] and not parts[0] >= set(record) - {"checksums.json"}, parts   # neither holds it all
    assert all(p <= set(record) for p in parts)

    # Pod B: process 0 on its old stage (its part of step 4 there), process 1 on a new one;
    # the same command resumes at step 4 and trains to 6.
    each = {0: stages(tmp_path, "a")[0], 1: stages(tmp_path, "b")[1]}
    errs = launch(url, corpus_file, STRAIGHT, each=each, env=env)
    for i, err in enumerate(errs):
        assert f"process-{i} at step 4, lane offset" in err, err[-3000:]
    assert "files are here already" in errs[0], errs[0][-3000:]
    # Neither pulls step 4 whole: each fetched its files but the chunk files it lacks, then at
    # the restore those its devices' shards read (Orbax writes a replicated array's chunks
    # from every process holding it, so each reads some of the other's).
    for i, err in enumerate(errs):
        assert "step 4's shards (" in err and "are fetched at the restore, each process those it reads" in err, err
    read = [re.search(r"step 4: this process's shards read (\d+) of the (\d+) chunk files not here", err)
            for err in errs]
    assert all(read), errs
    for m, err in zip(read, errs):   # the rows of the carry on the other's devices among those left
        needed, left = map(int, m.groups())
        assert 0 < needed < left and len(re.findall(r"pulling step 4 \(", err)) == 2, err[-3000:]

    # The same run on one shared disk, never interrupted.
    shared = tmp_path / "shared"
    launch(shared, corpus_file, STRAIGHT, env=env)
    same_as_on_a_shared_disk(server, url, shared, 6, tmp_path, monkeypatch)

    # Pod C has one host: one process resumes the two's step 6 and saves step 8 (one
    # process's layout); then two processes, on new stages, resume from that to step 10.
    one = subprocess.run(
        [sys.executable, "-m", "fractus_jax.train", "--no-progress", "--config", "tiny", "--workdir", url,
         "--stage", str(tmp_path / "c-host0"), "--local-devices", "8",
         *[f"--set={o}" for o in [f"corpus={corpus_file}", *RUN, "max_steps=8", "save_every=2"]]],
        cwd=ROOT, env={**env, "XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "JAX_ENABLE_COMPILATION_CACHE": "false"},
        capture_output=True, text=True, timeout=400)
    assert one.returncode == 0 and "at step 6, lane offset" in one.stderr, one.stderr[-3000:]
    errs = launch(url, corpus_file, ["max_steps=10", "save_every=2"], each=stages(tmp_path, "d"), env=env)
    for i, err in enumerate(errs):
        assert f"process-{i} at step 8, lane offset" in err, err[-3000:]
    keys = server.keys(bucket, "run/")
    assert max(int(k.split("/")[2]) for k in keys if k.endswith("/" + store.COMMITTED)) == 10, keys


def test_two_processes_resume_a_step_onto_another_mesh_fetching_what_they_read(corpus_file, tmp_path, monkeypatch):
    """Two processes save step 2 on a mesh of data=2 x fsdp=4 and resume it on fsdp=8, the
    axis now spanning both hosts: each fetches the chunk files its new shards read (found
    from the sharding it restores to, not the one saved), and step 4 is bit for bit the
    step the same two processes reach on one shared disk."""
    server = S3Server()
    try:
        url = f"s3://{server.bucket('mesh')}/run"
        env = child_env(server.env())
        first, moved = ["max_steps=2", "save_every=2"], ["max_steps=4", "save_every=2", "mesh.data=1", "mesh.fsdp=8"]
        launch(url, corpus_file, first, each=stages(tmp_path, "a"), env=env)
        errs = launch(url, corpus_file, moved, each=stages(tmp_path, "b"), env=env)
        for i, err in enumerate(errs):
            assert f"process-{i} at step 2, lane offset" in err, err[-3000:]
            m = re.search(r"step 2: this process's shards read (\d+) of the (\d+) chunk files not here", err)
            assert m and 0 < int(m[1]) < int(m[2]), err[-3000:]
        shared = tmp_path / "shared"
        launch(shared, corpus_file, first, env=env)
        launch(shared, corpus_file, moved, env=env)
        assert same_as_on_a_shared_disk(server, url, shared, 4, tmp_path, monkeypatch)["config"]["mesh"]["fsdp"] == 8
    finally:
        server.close()


def test_a_shard_only_one_process_reads_fails_the_step_on_both(corpus_file, tmp_path, monkeypatch):
    """A chunk file of step 4 that only process 1 reads (a row of the carry on its devices)
    differs in the store from its checksum: both processes reject step 4, not process 1
    alone (which would leave them training from different steps), and resume from step 2."""
    server = S3Server()
    try:
        url = f"s3://{server.bucket('hosts')}/run"
        env = child_env(server.env())
        launch(url, corpus_file, ["max_steps=4", "save_every=2"], each=stages(tmp_path, "a"), env=env)
        set_env(monkeypatch, server.env())
        run = store.Store(url)
        files = store.store_steps(run)[4]["files"]
        theirs = sorted(n for n in files if n.startswith("extra/carry.S/") and store.CHUNK.match(n.rsplit("/", 1)[1])
                        and n.split("/")[2].split(".")[1] == "7")   # the carry's last row: process 1's devices
        assert len(theirs) == 1, sorted(files)
        data = run.read("checkpoints/4/" + theirs[0])
        run.write(bytes(b ^ 0xFF for b in data), "checkpoints/4/" + theirs[0])   # its size, not its bytes

        errs = launch(url, corpus_file, ["max_steps=6", "save_every=2"], each=stages(tmp_path, "b"), env=env)
        for i, err in enumerate(errs):
            assert f"process-{i} at step 2, lane offset" in err, err[-3000:]
            assert "warning: step 4: could not be restored; falling back to step 2" in err, err[-3000:]
            assert f"({'' if i == 1 else 'process 1: '}extra failed its checksum ({theirs[0][6:]} differs))" in err, err
        keys = server.keys("hosts", "run/")
        assert any(k.startswith("run/rejected/4/") for k in keys) and "run/checkpoints/6/committed.json" in keys
    finally:
        server.close()


def wait_for(what, seconds, procs, logs):
    """Until what() is true, the two processes running; their stderr in the failure."""
    t0 = time.time()
    while not what():
        assert time.time() - t0 < seconds and all(p.poll() is None for p in procs), "\n".join(
            f"process {i}: ...{(logs / f'err{i}.txt').read_text()[-3000:]}" for i in range(2))
        time.sleep(0.2)


@pytest.mark.parametrize("down", ["a while", "past the tries"])
def test_two_processes_through_a_store_down_inside_an_upload_lose_nothing(down, corpus_file, tmp_path, monkeypatch):
    """The store is cut as process 1 sends its files of step 4.
    - For a while: it is back once each process has said that its upload of step 4 failed
      (process 0 waiting for process 1's files, or sending its own); both try again while
      training goes on, and process 0 commits step 4 once every file is in the store.
    - Past the tries (TRIES_SECONDS 3 s): both processes stop with exit 2, each naming step 2
      as the step the store holds (process 1 too, which commits nothing itself), and the same
      command on new stages, the store back, resumes from it.
    Either way the run ends at step 6 bit for bit as on a shared disk."""
    server = S3Server()
    try:
        relay = Relay(server.port)
        url = f"s3://{server.bucket('hosts')}/run"
        env = child_env(server.env(relay.endpoint))
        marker = tmp_path / "held"
        tries = {"tries_seconds": 3.0} if down == "past the tries" else {}
        procs = start(url, corpus_file, STRAIGHT, hooks={0: tries, 1: {"held_at": (4, str(marker)), **tries}},
                      logs=tmp_path, each=stages(tmp_path, "a"), env=env)
        wait_for(marker.exists, 400, procs, tmp_path)
        relay.cut()
        Path(f"{marker}.go").touch()

        def keys():
            return server.keys("hosts", "run/")

        def committed():
            return sorted(int(k.split("/")[2]) for k in keys() if k.endswith("/" + store.COMMITTED))

        def failed(i):
            return f"warning: the upload of step 4 to {url} failed (" in (tmp_path / f"err{i}.txt").read_text()

        if down == "a while":
            wait_for(lambda: failed(0) and failed(1), 200, procs, tmp_path)
            relay.restore()
            codes, errs = ended(procs, tmp_path)
            assert codes == [0, 0], [e[-3000:] for e in errs]
            for err in errs:
                assert re.search(rf"note: step 4 is uploaded to {re.escape(url)} \(try [2-9]\)", err), err[-3000:]
        else:
            codes, errs = ended(procs, tmp_path)
            assert codes == [2, 2], [e[-3000:] for e in errs]
            for err in errs:
                last = err.rstrip("\n").splitlines()[-1]
                assert last.startswith("error: ") and "cannot upload step 4 to " in last, err[-3000:]
                assert last.endswith(f"; {url} holds step 2 (the same command resumes from it)"), last
            assert committed() == [2]
            relay.restore()
            errs = launch(url, corpus_file, STRAIGHT, each=stages(tmp_path, "b"), env=env)
            for i, err in enumerate(errs):
                assert f"process-{i} at step 2, lane offset" in err, err[-3000:]
        assert committed() == [2, 4, 6] and "run/lease.json" not in keys(), keys()
        steps = [json.loads(line)["step"] for line in server.read("hosts", "run/metrics.jsonl").decode().splitlines()]
        assert steps == [1, 2, 3, 4, 5, 6], steps

        shared = tmp_path / "shared"
        launch(shared, corpus_file, STRAIGHT, env=child_env(server.env()))
        same_as_on_a_shared_disk(server, url, shared, 6, tmp_path, monkeypatch)
    finally:
        server.close()


def test_process_1_s_upload_tried_again_holds_both_processes_saves_and_training_goes_on(corpus_file, tmp_path,
                                                                                         monkeypatch):
    """Process 1 alone reaches the store through a relay, cut as it sends its files of step 4:
    its upload fails and is tried again, process 0's own upload waits for those files. The
    saves due meanwhile (every 4 steps) are held on both processes, agreed through the
    coordination service from process 1's word, and training goes on; once the relay is back
    the held save is made, and the run ends at step 24 bit for bit as on a shared disk."""
    server = S3Server()
    try:
        relay = Relay(server.port)
        url = f"s3://{server.bucket('hosts')}/run"
        run = ["max_steps=24", "save_every=4"]
        sent, paused = tmp_path / "sent", tmp_path / "paused"
        procs = start(url, corpus_file, run, logs=tmp_path, each=stages(tmp_path, "a"),
                      env=child_env(server.env()),
                      hooks={0: {"paused_uploading": str(paused)},
                             1: {"held_at": (4, str(sent)), "env": {"AWS_ENDPOINT_URL": relay.endpoint}}})
        # Process 1's files of step 4 wait to be sent, process 0 at its next step: cut, and
        # process 0 goes on once process 1's upload has failed.
        wait_for(lambda: sent.exists() and paused.exists(), 400, procs, tmp_path)
        relay.cut()
        Path(f"{sent}.go").touch()
        failed = f"warning: the upload of step 4 to {url} failed ("
        wait_for(lambda: failed in (tmp_path / "err1.txt").read_text(), 200, procs, tmp_path)
        Path(f"{paused}.go").touch()
        held = re.compile(rf"note: step \d+ is not saved yet: the upload of step 4 to {re.escape(url)} is being "
                          "tried again; training goes on")
        wait_for(lambda: held.search((tmp_path / "err0.txt").read_text()), 200, procs, tmp_path)
        relay.restore()
        codes, errs = ended(procs, tmp_path)
        assert codes == [0, 0], [e[-3000:] for e in errs]
        assert re.search(rf"note: step 4 is uploaded to {re.escape(url)} \(try [2-9]\)", errs[1]), errs[1][-3000:]
        keys = server.keys("hosts", "run/")
        committed = sorted(int(k.split("/")[2]) for k in keys if k.endswith("/" + store.COMMITTED))
        assert committed[-1] == 24 and "run/lease.json" not in keys, keys
        steps = [json.loads(line)["step"] for line in server.read("hosts", "run/metrics.jsonl").decode().splitlines()]
        assert steps == list(range(1, 25)), steps

        shared = tmp_path / "shared"
        launch(shared, corpus_file, run, env=child_env(server.env()))
        same_as_on_a_shared_disk(server, url, shared, 24, tmp_path, monkeypatch)
    finally:
        server.close()


@pytest.mark.parametrize("how", ["error", "kill"])
def test_a_process_ended_by_its_watchdog_lets_the_lease_go(how, corpus_file, tmp_path):
    """Process 0, which holds the run's lease, is ended by its watchdog (no `finally` of the
    run): process 1's host lacks the corpus and it stops on that error (process 0: exit 2),
    or process 1 is killed (kill -9) after a committed step (process 0: exit 3). Process 0
    lets the lease go first, so that the run, started again on another pod, is taken at once
    rather than after the lease lapses (LEASE_SECONDS)."""
    server = S3Server()
    try:
        url = f"s3://{server.bucket('ended')}/run"
        each = stages(tmp_path, "a")
        if how == "error":
            each[1] = (*each[1], "--set", f"corpus={tmp_path / 'missing.u16'}")
            overrides, args = ["max_steps=4"], ()
        else:
            overrides = ["max_steps=100000", "save_every=2"]
            args = ("--peer-timeout", str(peers.MIN_PEER_TIMEOUT_SECONDS))
        procs = start(url, corpus_file, overrides, logs=tmp_path, each=each, args=args, env=child_env(server.env()))
        if how == "kill":
            t0 = time.time()
            while "run/checkpoints/2/committed.json" not in server.keys("ended", "run/"):
                assert time.time() - t0 < 400 and all(p.poll() is None for p in procs), \
                    (tmp_path / "err0.txt").read_text()[-3000:] + (tmp_path / "err1.txt").read_text()[-3000:]
                time.sleep(0.5)
            procs[1].kill()
        codes, errs = ended(procs, tmp_path)
        if how == "error":
            assert codes == [2, 2], errs
            assert errs[0].rstrip("\n").splitlines()[-1].startswith("error: process 1 stopped: "), errs[0][-3000:]
        else:
            assert codes[0] == peers.EXIT_PEER_LOST, errs[0][-3000:]
            assert errs[0].rstrip("\n").splitlines()[-1].startswith("error: process 1 stopped answering"), errs[0]
        keys = server.keys("ended", "run/")
        assert "run/lease.json" not in keys, keys
    finally:
        server.close()
