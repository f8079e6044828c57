"""A run directory on object storage (`fractus_jax/train/store.py`), against a real S3 API:
moto's server, started and stopped by these tests (s3_testing.py).

The trainer killed by SIGKILL inside an upload, then resumed from a fresh stage (as on a new
pod), ends bit for bit equal to a run never interrupted; a store cut in the middle of an
upload and back within the upload's tries costs the run nothing; one that stays down loses
nothing committed, the run says what failed, and the same command resumes; the lease admits
one writer; a missing bucket, a URL that cannot be served and a store without
conditional writes are refused before any step."""
import argparse
import collections
import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import botocore.exceptions
import jax
import numpy as np
import pytest
import torch

from fractus_jax.convert.__main__ import main as convert_cli
from fractus_jax.eval.__main__ import main as eval_cli
from fractus_jax.generate import main as generate_cli
from fractus_jax.grow.__main__ import main as grow_cli
from fractus_jax import urls
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import loop, policy, rundir, store
from fractus_jax.train import transfer as transfer_lib
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.__main__ import main as train_cli
from fractus_jax.train.__main__ import parse_args
from gcs_testing import GCSServer
from s3_testing import Relay, S3Server, child_env, set_env
from test_faults import ROOT, assert_same_state, metrics_steps, restore, strict, tiny


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.close()


@pytest.fixture(scope="module")
def gcs():
    server = GCSServer()
    yield server
    server.close()


@pytest.fixture()
def bucket(s3, monkeypatch, request):
    set_env(monkeypatch, s3.env())
    return s3.bucket(f"b{abs(hash(request.node.nodeid)) % 10**12}")


@pytest.fixture(params=["s3", "gs"])
def served(request, monkeypatch):
    """(the server, the URL of a new bucket's run) of each kind of store: S3 (moto), Google
    Cloud Storage (fake-gcs-server)."""
    server = request.getfixturevalue({"s3": "s3", "gs": "gcs"}[request.param])
    set_env(monkeypatch, server.env())
    if request.param == "gs":
        server.fail_fast(monkeypatch)
    name = server.bucket(f"b{abs(hash(request.node.nodeid)) % 10**12}")
    return server, f"{request.param}://{name}/run"


def train_url(cfg, url, stage, watch=None):
    """(last metrics, log lines) of the trainer on a URL's run staged in `stage`, in this process;
    watch: called with each line as it is logged."""
    logs = []

    def log(line):
        logs.append(line)
        if watch is not None:
            watch(line)

    mirror = store.open_mirror(url, stage, log=log)
    try:
        last = loop.run(prepare_lib.prepare(cfg, stage, progress=False), progress=False, log=log, mirror=mirror)
    finally:
        mirror.close(quiet=True)
    return last, logs


def store_steps(s3, bucket, run):
    """The steps the store holds as committed."""
    return sorted(int(k.split("/")[-2]) for k in s3.keys(bucket, f"{run}/checkpoints/")
                  if k.endswith("/" + store.COMMITTED))


def stage_steps(stage):
    """The steps a stage holds."""
    return sorted(int(p.name) for p in (stage / "checkpoints").iterdir() if p.name.isdigit())


# ----------------------------------------------------------------------------- URLs

@pytest.mark.parametrize("url, words", [
    ("gs://bucket-only", "give a bucket and a path inside it"),
    ("ftp://b/run", "not ftp://"),
    ("s3://bucket-only", "give a bucket and a path inside it"),
    ("s3:/runs/tiny", "'s3:/runs/tiny' reads as the URL s3://runs/tiny with a slash lost: write s3://runs/tiny "
                      "(for a local directory of that name, give its absolute path)"),
    ("gs:/b/run", "reads as the URL gs://b/run with a slash lost"),
])
def test_a_url_the_trainer_cannot_serve_is_refused(url, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", "tiny", "--workdir", url])
    assert e.value.code == 2
    assert words in capsys.readouterr().err
    assert not any(tmp_path.iterdir())   # nothing written where the slashes collapse


def test_a_url_names_its_scheme_in_any_case_and_a_path_its_directory():
    assert store.check_url("S3://b/run") == "s3://b/run" and store.check_url("Gs://b/run") == "gs://b/run"
    assert store.check_url("/abs/s3:/runs/x") == "/abs/s3:/runs/x"   # a local directory of that name
    with pytest.raises(argparse.ArgumentTypeError, match="reads as the URL s3://runs/x with a slash lost"):
        urls.local_path("s3:/runs/x")


@pytest.mark.parametrize("scheme, module", [("s3", "s3fs"), ("gs", "gcsfs")])
def test_a_missing_library_is_named_with_its_extra(scheme, module, monkeypatch):
    real = store.importlib.util.find_spec
    monkeypatch.setattr(store.importlib.util, "find_spec", lambda name: None if name == module else real(name))
    with pytest.raises(ValueError, match=rf"needs {module}, which is not installed: pip install 'fractus-jax\[{scheme}\]'"):
        store.check_url(f"{scheme}://b/run")
    assert store.check_url("runs/a") == "runs/a"   # a local path is taken as it is


def test_a_missing_bucket_is_refused_before_any_step(served, tmp_path, capsys):
    server, url = served
    scheme = url.split(":")[0]
    code = train_cli(["--config", "tiny", "--workdir", f"{scheme}://no-such-bucket/run", "--stage",
                      str(tmp_path / "stage"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: {scheme}://no-such-bucket/run: the bucket no-such-bucket does not exist (or this endpoint "
                   f"does not serve it) at {server.endpoint}; create it first"]
    assert not (tmp_path / "stage").exists()


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/4", "checkpoints/4/params"])
def test_a_run_inside_another_runs_checkpoints_is_refused_before_any_step(served, inside, tmp_path, capsys):
    server, url = served
    store.Store(url).write(b"{}", store.LEASE)   # a run that has started: its lease
    code = train_cli(["--config", "tiny", "--workdir", f"{url}/{inside}", "--stage", str(tmp_path / "stage"),
                      "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {url}/{inside} lies in the checkpoints directory of the run {url}: a run there would write among "
        f"that run's steps; give a URL outside {url}/checkpoints"]
    assert not (tmp_path / "stage").exists()
    # control: a name beside it is a run of its own, and a run whose lease the store lacks is none
    store.Store(f"{url}/checkpoints-b").check_not_in_run()
    store.Store(f"{url}2/checkpoints/4").check_not_in_run()


def test_no_credentials_are_refused_before_any_step(s3, monkeypatch, tmp_path, capsys):
    set_env(monkeypatch, s3.env())
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code = train_cli(["--config", "tiny", "--workdir", "s3://runs/run", "--stage", str(tmp_path / "stage"),
                      "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["error: s3://runs/run: no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                   "(or AWS_PROFILE)"]


@pytest.mark.parametrize("secret, words", [
    ("wrong", "The request signature we calculated does not match"),
    (None, "The AWS Access Key Id you provided does not exist"),
])
def test_wrong_credentials_are_refused_before_any_step(secret, words, monkeypatch, tmp_path, capsys):
    """Against a server that checks keys: a wrong secret, and a key it does not know."""
    checking = S3Server(checks_keys_after=4)   # the user, its key, its policy, the bucket
    try:
        key_id, _ = checking.user_key()
        checking.bucket("runs")
        set_env(monkeypatch, checking.env())
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id if secret else "AKIAUNKNOWN000000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret or "x")
        code = train_cli(["--config", "tiny", "--workdir", "s3://runs/run", "--stage", str(tmp_path / "stage"),
                          "--no-progress"])
    finally:
        checking.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: s3://runs/run: access refused (") and words in err[0], err
    assert err[0].endswith("; check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
    assert not (tmp_path / "stage").exists()


class _PrefixOnly:
    """A filesystem whose key may touch and list one prefix of its bucket, as an IAM policy
    limited to it allows (s3:ListBucket with an s3:prefix condition, object actions on
    BUCKET/PREFIX/*): any call on a path outside it is refused as the store would refuse it."""

    def __init__(self, fs, prefix):
        self._fs, self._prefix = fs, prefix

    def __getattr__(self, name):
        real = getattr(self._fs, name)
        if not callable(real):
            return real

        def call(path, *args, **kwargs):
            remote = args[0] if name in ("put", "put_file") else path   # put: (local, remote)
            for p in (remote if isinstance(remote, list) else [remote]):
                if not (str(p) == self._prefix or str(p).startswith(self._prefix + "/")):
                    raise PermissionError(f"Access Denied ({name} {p})")
            return real(path, *args, **kwargs)
        return call


def test_a_key_limited_to_the_runs_prefix_trains_and_reads_it(served, corpus_file, tmp_path, monkeypatch, capsys):
    """Credentials that may list and touch only the run's prefix open a new run, train it,
    resume it and read it (nothing is listed above the prefix but to tell a missing bucket)."""
    server, url = served
    real = store._filesystem
    monkeypatch.setattr(store, "_filesystem", lambda scheme: _PrefixOnly(real(scheme), url.split("://")[1]))
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    common = ["--config", "tiny", "--workdir", url, "--set", f"corpus={corpus_file}", "--set", "save_every=2",
              "--no-progress"]
    assert train_cli([*common, "--stage", str(tmp_path / "a"), "--set", "max_steps=2"]) == 0
    assert train_cli([*common, "--stage", str(tmp_path / "b"), "--set", "max_steps=4"]) == 0
    err = capsys.readouterr().err
    assert f"resumed {tmp_path / 'b'} at step 2" in err
    # s3://: a key that may not list the bucket's multipart uploads is told so at each start
    assert err.count(f"note: cannot abort the unfinished uploads under {url}/checkpoints (") == \
        2 * url.startswith("s3://"), err
    assert eval_cli(["--ckpt", url, "--corpus", str(corpus_file), "--ids", "256", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    # the control: the same key outside its prefix is refused at the start, in one line
    other = url.rsplit("/", 1)[0] + "/other"
    assert train_cli(["--config", "tiny", "--workdir", other, "--stage", str(tmp_path / "c"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {other}: access refused (")


# ----------------------------------------------------------------------------- the lease

def test_the_lease_admits_one_writer(served, monkeypatch):
    run = store.Store(served[1])
    notes = []
    first = store.Lease(run, notes.append).acquire()
    with pytest.raises(rundir.RunDirBusy, match=r"is in use by pid \d+ on .*wait for it to end or stop it"):
        store.Lease(run, notes.append).acquire()
    # the holder renews; a lease another process overwrote is lost, and the holder commits no more
    first.renew()
    first.check()
    run.write(b'{"holder": "other", "host": "elsewhere", "pid": 1, "expires": 1e12}', store.LEASE)
    first.renew()
    with pytest.raises(rundir.RunDirBusy, match="another process took the lease"):
        first.check()
    first.release()
    assert run.exists(store.LEASE)   # not ours any more: left alone
    # a holder on another machine is watched: refused once it renews its lease (it runs) ...
    monkeypatch.setattr(store, "LEASE_POLL_SECONDS", 0.05)

    def renewed_once_watched(line):   # the holder renews as the new start begins to watch
        notes.append(line)
        if " waiting up to " in line:
            run.write(b'{"holder": "other", "host": "elsewhere", "pid": 1, "expires": 1e12, "renewed": 1}',
                      store.LEASE)

    with pytest.raises(rundir.RunDirBusy, match="is in use by pid 1 on elsewhere: it renewed its lease"):
        store.Lease(run, renewed_once_watched).acquire()
    assert notes[-1].startswith(f"note: {served[1]} is held by pid 1 on elsewhere; waiting up to "), notes
    # ... taken once it lapses: unrenewed for LEASE_SECONDS (a pod that ended), or past its expiry
    with monkeypatch.context() as m:
        m.setattr(store, "LEASE_SECONDS", 0.5)
        lapsed = store.Lease(run, notes.append).acquire()
    assert notes[-1].startswith(f"note: took the lease of {served[1]}/lease.json (expired: pid 1 on elsewhere)")
    lapsed.release()
    run.write(json.dumps({"holder": "old", "host": "elsewhere", "pid": 1, "expires": time.time() - 1}).encode(),
              store.LEASE)
    second = store.Lease(run, notes.append).acquire()
    assert notes[-1].startswith(f"note: took the lease of {served[1]}/lease.json (expired: pid 1 on elsewhere)")
    second.release()
    assert not run.exists(store.LEASE)
    # a holder of this host whose process ended is taken over at once
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    # (a container with the same host name but another pid namespace does not count: its
    # lease is watched as another machine's, and taken once it lapses)
    for machine in ("another-boot/1", None):
        run.write(json.dumps({"holder": "dead", "host": store.socket.gethostname(), "pid": int(gone.stdout),
                              "machine": machine, "expires": time.time() + 1000}).encode(), store.LEASE)
        with monkeypatch.context() as m:
            m.setattr(store, "LEASE_SECONDS", 0.5)
            lapsed = store.Lease(run, notes.append).acquire()
        assert "waiting up to" in notes[-2] and f"(expired: pid {int(gone.stdout)} on" in notes[-1], notes
        lapsed.release()
    run.write(json.dumps({"holder": "dead", "host": store.socket.gethostname(), "pid": int(gone.stdout),
                          "machine": store._machine(), "expires": time.time() + 1000}).encode(), store.LEASE)
    third = store.Lease(run, notes.append).acquire()
    assert "its holder's process has ended" in notes[-1]
    # a renewal the store took but whose answer was lost is still ours
    run.write(third._body(), store.LEASE)
    third.renew()
    third.check()
    assert third.version == run.version(store.LEASE)
    # a holder that could not renew for LEASE_TRUST_SECONDS commits nothing until a renewal
    # goes through, which it does while the lease is still the one it wrote ...
    third._renewed -= store.LEASE_TRUST_SECONDS + 1
    for _ in range(2):
        with pytest.raises(rundir.RunDirBusy, match=r"the lease was not renewed for \d+ s .* this process commits "
                                                    "nothing until a renewal goes through"):
            third.check()
    assert third.lost is None
    third.check(renew=True)
    third.check()
    assert third.version == run.version(store.LEASE)
    # ... and fails once another process took it meanwhile: the lease is lost
    third._renewed -= store.LEASE_TRUST_SECONDS + 1
    run.write(b'{"holder": "other", "host": "elsewhere", "pid": 1, "expires": 1e12}', store.LEASE)
    with pytest.raises(rundir.RunDirBusy, match="another process took the lease .*; this process commits nothing more"):
        third.check(renew=True)
    with pytest.raises(rundir.RunDirBusy, match="another process took the lease"):
        third.check(renew=True)
    third.release()
    assert json.loads(run.read(store.LEASE))["holder"] == "other"
    run.delete(store.LEASE)


def test_a_lease_let_go_as_the_process_ends_is_taken_at_once_and_commits_nothing_more(served):
    """let_leases_go (the watchdog's before_exit): the store's lease is deleted, so a start on
    another machine takes it without waiting for it to lapse; an upload still running in the
    ending process commits nothing after it; a lease another process took is left alone."""
    run = store.Store(served[1])
    first = store.Lease(run, print).acquire()
    store.let_leases_go()
    assert not run.exists(store.LEASE)
    with pytest.raises(rundir.RunDirBusy, match="this process is ending; this process commits nothing more"):
        first.check()
    notes = []
    second = store.Lease(run, notes.append).acquire()   # no wait, no take-over: created afresh
    assert notes == [] and run.exists(store.LEASE)
    first.release()   # the first process's close, had it come: the second's lease stays
    assert run.exists(store.LEASE)
    run.write(b'{"holder": "other", "host": "elsewhere", "pid": 1, "expires": 1e12}', store.LEASE)
    second.renew()   # lost to another process: not deleted at the end
    store.let_leases_go()
    assert json.loads(run.read(store.LEASE))["holder"] == "other"
    run.delete(store.LEASE)


@pytest.mark.parametrize("store_kind, words", [
    ("ignores If-None-Match", r"ignores conditional writes \(If-None-Match\)"),
    ("ignores If-Match", r"ignores conditional writes \(If-Match\)"),
    ("refuses If-Match", r"refuses a PUT naming the object's own version \(Not Implemented \(ENOTSUP\)\), so the "
                         r"run's lease could never be renewed"),
])
def test_a_store_without_conditional_writes_is_refused(store_kind, words, bucket, monkeypatch):
    run = store.Store(f"s3://{bucket}/run")

    def unconditional(data, *parts, version=None):
        run.write(data, *parts)
        return run.version(*parts)

    def refused(data, version, *parts):
        raise OSError(95, "Not Implemented")

    if store_kind == "ignores If-None-Match":
        monkeypatch.setattr(run, "create", unconditional)
    else:
        monkeypatch.setattr(run, "replace", lambda data, version, *parts: (
            unconditional(data, *parts) if store_kind == "ignores If-Match" else refused(data, version, *parts)))
    with pytest.raises(rundir.CheckpointError, match=words):
        store.Lease(run, print).acquire()
    assert not run.exists(store.LEASE)
    assert run.files() == {}   # the probe removed


def test_a_lease_the_store_refuses_to_write_is_one_line(bucket, monkeypatch, tmp_path, capsys):
    """Credentials that read but may not write: exit 2 and one line, before any step."""
    real = store.Store.create

    def read_only(self, data, *parts):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(store.Store, "create", read_only)
    url = f"s3://{bucket}/run"
    code = train_cli(["--config", "tiny", "--workdir", url, "--stage", str(tmp_path / "stage"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: {url}: cannot take the run's lease (PermissionError: Access Denied); the "
                   "credentials must be allowed to write there"]
    monkeypatch.setattr(store.Store, "create", real)
    store.open_mirror(url, tmp_path / "stage").close()   # the stage's lock was let go


def test_two_urls_on_one_stage_are_refused_before_the_pull(bucket, tmp_path):
    """A second run staged in the same directory is refused before it moves anything there."""
    first = store.open_mirror(f"s3://{bucket}/a", tmp_path / "stage")
    try:
        (tmp_path / "stage" / "metrics.jsonl").write_text("{}\n")
        with pytest.raises(rundir.RunDirBusy, match="is in use by pid"):
            store.open_mirror(f"s3://{bucket}/b", tmp_path / "stage")
        assert (tmp_path / "stage" / "metrics.jsonl").read_text() == "{}\n"
        assert not (tmp_path / "stage" / store.UNPUSHED).exists()
    finally:
        first.close()


def test_a_step_of_several_processes_is_committed_only_when_every_part_is_in_the_store(
        s3, bucket, tmp_path, monkeypatch):
    """Process 0 of two uploads its part of a step; while process 1's file is missing from
    the store, or there at another size, nothing is committed and the upload fails naming
    process 1 once PARTS_WAIT_SECONDS pass; with it there, the step is committed."""
    monkeypatch.setattr(store, "PARTS_WAIT_SECONDS", 1.0)
    monkeypatch.setattr(store, "PARTS_POLL_SECONDS", 0.1)
    monkeypatch.setattr(store, "TRIES_SECONDS", 0.0)   # the failure, not tried again
    url = f"s3://{bucket}/run"
    mirror = store.Mirror(url, tmp_path / "stage-0", lambda m: None, index=0, count=2).open()
    run = store.Store(url)
    try:
        step_dir = tmp_path / "stage-0" / store.CHECKPOINTS / "2"
        step_dir.mkdir(parents=True)
        (step_dir / "mine").write_bytes(b"0" * 10)
        parts = {"mine": (10, 0), "theirs": (7, 1)}
        for theirs in (None, b"1" * 6):   # missing; cut short
            if theirs is not None:
                run.write(theirs, store.CHECKPOINTS, "2", "theirs")
            mirror.push(2, parts)
            with pytest.raises(rundir.RunDirIOError, match=r"cannot upload step 2 to .*: TimeoutError: process\(es\) 1 "
                               r"did not upload their files of it within 1 s \(1 missing, e\.g\. theirs\); .* holds no "
                               r"committed step yet"):
                mirror.settle()
            assert store_steps(s3, bucket, "run") == []
        run.write(b"1" * 7, store.CHECKPOINTS, "2", "theirs")   # process 1's upload, whole
        mirror.push(2, parts)
        mirror.settle()
        assert store_steps(s3, bucket, "run") == [2]
        assert json.loads(run.read(store.CHECKPOINTS, "2", store.COMMITTED))["files"] == {"mine": 10, "theirs": 7}
    finally:
        mirror.close(quiet=True)


def test_a_step_whose_other_parts_come_late_is_committed_on_a_later_try(s3, bucket, tmp_path, monkeypatch):
    """Process 1's file of step 2 reaches the store after process 0's wait for it ended: process
    0's upload is tried again, without sending its own file again, and commits the step."""
    monkeypatch.setattr(store, "PARTS_WAIT_SECONDS", 1.0)
    monkeypatch.setattr(store, "PARTS_POLL_SECONDS", 0.1)
    monkeypatch.setattr(store, "TRY_WAITS", (0.2,))
    monkeypatch.setattr(store, "TRIES_SECONDS", 60.0)
    url = f"s3://{bucket}/run"
    notes = []
    run = store.Store(url)
    sent = []
    put = store.Store.put

    def count_put(self, local, remote, transfer=None):
        sent.extend(remote)
        return put(self, local, remote, transfer)

    def theirs_once_said(line):   # process 1's upload, whole, after process 0's first try failed
        notes.append(line)
        if line.startswith("warning: the upload of step 2"):
            run.write(b"1" * 7, store.CHECKPOINTS, "2", "theirs")

    monkeypatch.setattr(store.Store, "put", count_put)
    mirror = store.Mirror(url, tmp_path / "stage-0", theirs_once_said, index=0, count=2).open()
    try:
        step_dir = tmp_path / "stage-0" / store.CHECKPOINTS / "2"
        step_dir.mkdir(parents=True)
        (step_dir / "mine").write_bytes(b"0" * 10)
        mirror.push(2, {"mine": (10, 0), "theirs": (7, 1)})
        mirror.settle()
        assert [n for n in notes if "upload" in n] == [
            f"warning: the upload of step 2 to {url} failed (TimeoutError: process(es) 1 did not upload their files "
            "of it within 1 s (1 missing, e.g. theirs)); trying again in 0.2 s while training goes on (it stops the "
            "run if it still fails 60 s from now)",
            f"note: step 2 is uploaded to {url} (try 2)"], notes
        assert sent == [f"{store.CHECKPOINTS}/2/mine"]
        assert store_steps(s3, bucket, "run") == [2]
        assert json.loads(run.read(store.CHECKPOINTS, "2", store.COMMITTED))["files"] == {"mine": 10, "theirs": 7}
    finally:
        mirror.close(quiet=True)


def test_a_reader_refuses_a_step_whose_files_differ_from_its_commit(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    client = s3.client()
    client.put_object(Bucket=bucket, Key="run/checkpoints/2/meta/data", Body=b"12345")
    client.put_object(Bucket=bucket, Key="run/checkpoints/2/committed.json",
                      Body=json.dumps({"step": 2, "files": {"meta/data": 4}}).encode())
    with pytest.raises(rundir.CheckpointError, match=r"checkpoints/2 does not hold the files its committed.json "
                                                     r"names \(1 differ, e.g. meta/data\)"):
        store.readable(f"s3://{bucket}/run")
    assert not list((tmp_path / "cache").rglob("data"))
    with pytest.raises(rundir.CheckpointError, match="give a bucket and a path inside it"):
        store.readable(f"s3://{bucket}/checkpoints/2")   # a run at the bucket's root


def put_committed_step(client, bucket, step: int, bodies: dict[str, bytes]) -> dict[str, bytes]:
    """A step of these files ("item/name": its bytes) in the store at run/checkpoints/<step>,
    with its checksums.json and committed.json; returns its files, checksums.json among them."""
    items = collections.defaultdict(dict)
    for name, body in bodies.items():
        item, _, path = name.partition("/")
        items[item][path] = hashlib.sha256(body).hexdigest()
    bodies = {**bodies, "checksums.json": json.dumps({"items": items}).encode()}
    for name, body in bodies.items():
        client.put_object(Bucket=bucket, Key=f"run/checkpoints/{step}/{name}", Body=body)
    client.put_object(Bucket=bucket, Key=f"run/checkpoints/{step}/{store.COMMITTED}", Body=json.dumps(
        {"step": step, "files": {n: len(b) for n, b in bodies.items()}}).encode())
    return bodies


def test_a_step_another_command_reads_stays_in_the_read_cache(s3, bucket, tmp_path, monkeypatch):
    """Two commands read one run through the cache of one machine. Fetching the rest of a step
    the other reads leaves the files it reads in their place; a step the store has dropped stays
    in the cache while the other reads it, and goes once it has ended."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    client = s3.client()
    for step in (2, 4):
        step_files = put_committed_step(client, bucket, step, {"params/a": b"w" * 64, "opt_state/b": b"m" * 128})
    url = f"s3://{bucket}/run"
    other = subprocess.Popen(   # reads the weights of steps 2 and 4, and goes on until its stdin ends
        [sys.executable, "-c", "import sys\nfrom fractus_jax.train import store\n"
         f"for step in (2, 4): print(store.readable({url!r} + f'/checkpoints/{{step}}', items=('params',), "
         "log=lambda m: None), flush=True)\nsys.stdin.read()"],
        env=child_env(s3.env()), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        read = [Path(other.stdout.readline().strip()) for _ in range(2)]
        assert [sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) for d in read] == [
            ["checksums.json", "params/a"]] * 2
        weights = read[1] / "params" / "a"
        inode = weights.stat().st_ino
        real_get = store.Store.get

        def get(self, names, paths, transfer=None):   # while the rest of step 4 is fetched, the weights are in place
            assert weights.stat().st_ino == inode
            return real_get(self, names, paths, transfer)

        monkeypatch.setattr(store.Store, "get", get)
        logs = []
        assert Path(store.readable(f"{url}/checkpoints/4", log=logs.append)) == read[1]
        assert "; 2 of its files are here already" in logs[0], logs
        assert {str(p.relative_to(read[1])): p.stat().st_size for p in read[1].rglob("*") if p.is_file()} == {
            n: len(b) for n, b in step_files.items()}
        assert weights.stat().st_ino == inode
        for key in s3.keys(bucket, "run/checkpoints/2/"):   # the store drops step 2
            client.delete_object(Bucket=bucket, Key=key)
        store.readable(url, log=logs.append)
        assert (read[0] / "params" / "a").read_bytes() == step_files["params/a"]   # the other reads it still
    finally:
        other.communicate(timeout=60)
    assert other.returncode == 0
    store.readable(url, log=logs.append)
    assert not read[0].exists() and read[1].is_dir()


@pytest.mark.parametrize("damage", ["a weights file", "checksums.json", "the moments, not read"])
def test_a_cached_step_damaged_on_disk_is_fetched_again_and_hashed_once(damage, s3, bucket, tmp_path, monkeypatch):
    """A step the read cache holds is checked as a command reads it: a weights file that no
    longer matches its checksum (a byte flipped, its size kept), or a checksums.json that no
    longer reads, and the step is fetched again from the store, with a note, instead of the
    command refusing it (--step) or falling back to an older step. Files it does not read
    (the moments, for eval) are not checked. The items checked are not hashed again by the
    command's own check, and those fetched are hashed once, by it."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    client = s3.client()
    bodies = put_committed_step(client, bucket, 2, {"params/a": b"w" * 64, "extra/c": b"c" * 32,
                                                    "opt_state/b": b"m" * 128})
    url = f"s3://{bucket}/run/checkpoints/2"
    step_dir = Path(store.readable(url, log=lambda m: None))   # the whole step in the cache
    store.done_reading()
    name = {"a weights file": "params/a", "checksums.json": "checksums.json", "the moments, not read": "opt_state/b"}
    target = step_dir / name[damage]
    target.write_bytes(b"x" * target.stat().st_size)
    hashed = []
    real = ckpt_lib._file_sha256
    monkeypatch.setattr(ckpt_lib, "_file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    logs = []
    assert Path(store.readable(url, log=logs.append, items=("params", "extra"))) == step_dir
    refetched = damage != "the moments, not read"
    notes = [line for line in logs if line.startswith("note:")]
    assert len(notes) == refetched, logs
    if refetched:
        why = ("params failed its checksum (a differs)" if damage == "a weights file" else
               "its checksums.json does not read")
        assert notes[0] == (f"note: the read cache's copy of step 2 of s3://{bucket}/run is not the one committed "
                            f"({why}); fetching it again ({step_dir})"), logs
        assert sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()) == [
            "checksums.json", "extra/c", "params/a"]   # fetched anew, for the items read
    assert all((step_dir / n).read_bytes() == bodies[n] for n in ("checksums.json", "params/a", "extra/c"))
    # the cache's check: the items read, up to the first that fails
    assert sorted(hashed) == {"a weights file": ["a"], "checksums.json": []}.get(damage, ["a", "c"]), hashed
    hashed.clear()
    assert ckpt_lib.check_files(step_dir, ("params", "extra")) == ("ok", None)   # the command's check
    assert sorted(hashed) == (["a", "c"] if refetched else []), hashed   # each file hashed once in all
    hashed.clear()
    assert ckpt_lib.check_files(step_dir, ("params", "extra")) == ("ok", None)   # a later check hashes again
    assert sorted(hashed) == ["a", "c"], hashed


def test_a_damaged_cached_step_another_command_reads_is_left_to_it(s3, bucket, tmp_path, monkeypatch):
    """A cached step found damaged while another command reads it is not removed under that
    command: this one stops with one line, and once the other has ended it fetches the step."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    client = s3.client()
    bodies = put_committed_step(client, bucket, 2, {"params/a": b"w" * 64})
    url = f"s3://{bucket}/run"
    other = subprocess.Popen(   # reads step 2, and goes on until its stdin ends
        [sys.executable, "-c", "import sys\nfrom fractus_jax.train import store\n"
         f"print(store.readable({url!r}, log=lambda m: None), flush=True)\nsys.stdin.read()"],
        env=child_env(s3.env()), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        weights = Path(other.stdout.readline().strip()) / "checkpoints" / "2" / "params" / "a"
        weights.write_bytes(b"x" * 64)
        with pytest.raises(rundir.CheckpointError, match=r"the read cache's copy of step 2 of .* is not the one "
                           r"committed \(params failed its checksum \(a differs\)\), and another command reads it: "
                           "run this one again once it ends"):
            store.readable(url, log=lambda m: None)
        assert weights.read_bytes() == b"x" * 64   # left to the other
    finally:
        other.communicate(timeout=60)
    assert other.returncode == 0
    store.readable(url, log=lambda m: None)
    assert weights.read_bytes() == bodies["params/a"]


def test_the_read_cache_keeps_the_steps_read_last(s3, bucket, tmp_path, monkeypatch):
    """Reading step after step of a run keeps the READ_CACHE_STEPS steps read last in the
    cache, and a step a command still reads besides."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    client = s3.client()
    for step in (2, 4, 6):
        client.put_object(Bucket=bucket, Key=f"run/checkpoints/{step}/params/a", Body=b"w" * 64)
        client.put_object(Bucket=bucket, Key=f"run/checkpoints/{step}/{store.COMMITTED}",
                          Body=json.dumps({"step": step, "files": {"params/a": 64}}).encode())
    url = f"s3://{bucket}/run"
    logs, local = [], tmp_path / "cache" / "read" / "s3" / bucket / "run"
    cached = lambda: sorted(int(p.name) for p in (local / "checkpoints").iterdir() if p.name.isdigit())  # noqa: E731
    for step in (2, 4, 6):
        store.done_reading()   # as a new command
        store.readable(f"{url}/checkpoints/{step}", log=logs.append)
    assert cached() == [4, 6], logs
    assert [line for line in logs if line.startswith("note:")] == [
        f"note: removed step 2 from the read cache {local} (it keeps the {store.READ_CACHE_STEPS} steps of a run "
        "read last)"], logs
    store.readable(f"{url}/checkpoints/2", log=logs.append)   # 6 is read still (by this process): 4 goes
    assert cached() == [2, 6], logs
    store.readable(f"{url}/checkpoints/4", log=logs.append)   # 2 and 6 are read still: both stay
    assert cached() == [2, 4, 6], logs
    store.done_reading()
    store.readable(f"{url}/checkpoints/4", log=logs.append)
    assert cached() == [2, 4], logs   # 6 read before 2


def test_a_pull_the_disk_cannot_hold_is_refused_before_a_byte_comes(s3, bucket, tmp_path, monkeypatch, capsys):
    """The trainer's pull into its stage and a reader's fetch into the read cache: a disk
    without room for the step's files is refused at once (exit 2, one line), nothing fetched."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    client = s3.client()
    client.put_object(Bucket=bucket, Key="run/checkpoints/2/params/a", Body=b"w" * 3000)
    client.put_object(Bucket=bucket, Key=f"run/checkpoints/2/{store.COMMITTED}",
                      Body=json.dumps({"step": 2, "files": {"params/a": 3000}}).encode())
    real = store.shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: real(path)._replace(free=2000))
    url = f"s3://{bucket}/run"
    for run, where in ((lambda: eval_cli(["--ckpt", url, "--no-progress"]), tmp_path / "cache"),
                       (lambda: train_cli(["--config", "tiny", "--workdir", url, "--stage", str(tmp_path / "stage"),
                                           "--no-progress"]), tmp_path / "stage")):
        capsys.readouterr()
        assert run() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: cannot pull step 2 of {url} into {where}"), err
        assert err[0].endswith(": it needs 0.00 GB more and the disk has 0.00 GB free; free some, or put it on a "
                               "larger disk (the trainer's --stage DIR; FRACTUS_CACHE=DIR for the read cache)"), err
        assert not [p for p in where.rglob("a") if p.is_file()]


def test_a_transfer_waited_for_says_how_far_it_is(served, tmp_path, monkeypatch):
    """A pull says its bytes received as they come, and a wait for an upload the bytes sent,
    on both stores (s3fs reports each file's bytes as increments, gcsfs's uploads as totals)."""
    server, url = served
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transfer_lib, "PROGRESS_SECONDS", 0.05)
    stage = tmp_path / "stage"
    sizes = {"checksums.json": 2, "params/a": 3_000_000, "opt_state/b": 2_000_000}
    said, logs = threading.Event(), []

    def log(line):
        logs.append(line)
        if line.startswith(f"waiting for the upload of step 2 to {url}: 5.0 of 5.0 MB ("):
            said.set()

    real_put = store.Store.put

    def put(self, local, remote, transfer=None):   # the upload ends once its wait has said it is all sent
        real_put(self, local, remote, transfer)
        assert said.wait(30)

    monkeypatch.setattr(store.Store, "put", put)
    mirror = store.open_mirror(url, stage, log=log)
    try:
        for name, size in sizes.items():   # a step the stage committed
            (stage / "checkpoints" / "2" / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / "checkpoints" / "2" / name).write_bytes(os.urandom(size))
        mirror.push(2)
        mirror.settle()
    finally:
        mirror.close(quiet=True)
    sent = [float(re.match(r"waiting for the upload of step 2 to \S+: ([\d.]+) of 5\.0 MB \(\d+ MB/s\)$", line)
                  .group(1)) for line in logs if line.startswith("waiting for the upload")]
    assert sent == sorted(sent) and sent[-1] == 5.0, logs   # the bytes as they were sent, to the last
    assert store.store_steps(store.Store(url))[2]["files"] == sizes

    monkeypatch.setattr(transfer_lib, "PROGRESS_SECONDS", 0.0)   # each file's bytes said as they come
    logs.clear()
    store.readable(url, log=logs.append)
    figures = [tuple(float(x) for x in re.match(r"pulling step 2: ([\d.]+) of ([\d.]+) MB \(\d+ MB/s\)$", line)
                     .groups()) for line in logs if line.startswith("pulling step 2: ")]
    assert len(figures) >= 2 and all(total == 5.0 for _, total in figures), logs
    assert [done for done, _ in figures] == sorted(done for done, _ in figures) and figures[-1][0] == 5.0, logs


# ----------------------------------------------------------------------------- a step pulled in part

def test_a_steps_chunk_files_are_told_from_its_other_files():
    files = ["params/w/.zarray", "params/w/0.0", "params/w/1.0", "params/_sharding", "params/_METADATA",
             "params/array_metadatas/process_0", "params/a.b/.zarray", "params/a.b/0", "params/n/.zarray",
             "params/n/0/3", "meta/metadata", "checksums.json", "_CHECKPOINT_METADATA", "extra/s/.zarray",
             "extra/s/0", "opt_state/ocdbt.process_0/d/1a2b", "params/commit_success.txt"]
    assert store.chunk_files(files) == {"params/w/0.0": "params/w", "params/w/1.0": "params/w",
                                        "params/a.b/0": "params/a.b", "params/n/0/3": "params/n",
                                        "extra/s/0": "extra/s"}


def needed_by_elements(shape, grid, indices):
    """The chunks holding an element some index covers, found element by element."""
    covered = np.zeros(shape, bool)
    for index in indices:
        covered[index] = True
    needed = set()
    for key in np.ndindex(*[-(-n // c) for n, c in zip(shape, grid)]):
        region = tuple(slice(k * c, (k + 1) * c) for k, c in zip(key, grid))
        if covered[region].any():
            needed.add(".".join(map(str, key)))
    return needed


def test_the_chunks_a_process_reads_are_those_its_shards_touch():
    """A process fetches, of a step pulled in part, the chunk files its devices' shards read
    (a chunk file left out fails the restore): the chunks that hold an element of a shard,
    whatever the saved chunks' grid and the target sharding."""
    devices = np.array(jax.devices()[:8])
    P = jax.sharding.PartitionSpec
    cases = [((2, 32), (2, 4), (2, 4), P(None, "fsdp")), ((4, 32), (2, 8), (4, 2), P("data", "fsdp")),
             ((6, 10), (4, 3), (2, 4), P("data", None)), ((3, 5, 8), (1, 5, 3), (2, 4), P(None, None, "fsdp")),
             ((8,), (8,), (2, 4), P()), ((8, 6), (5, 6), (8, 1), P("data"))]
    for shape, grid, mesh_shape, spec in cases:
        mesh = jax.sharding.Mesh(devices.reshape(mesh_shape), ("data", "fsdp"))
        by_device = jax.sharding.NamedSharding(mesh, spec).devices_indices_map(shape)
        zarray = {"shape": list(shape), "chunks": list(grid), "dimension_separator": "."}
        for process in (devices.reshape(2, 4)[0], devices.reshape(2, 4)[1], devices[:1]):   # a host's devices
            indices = [by_device[d] for d in process]
            assert store.chunk_names(zarray, indices) == needed_by_elements(shape, grid, indices), (shape, spec)
        every = needed_by_elements(shape, grid, list(by_device.values()))
        assert store.chunk_names(zarray, by_device.values()) == every
    first = jax.sharding.NamedSharding(jax.sharding.Mesh(devices.reshape(2, 4), ("data", "fsdp")),
                                       P(None, ("data", "fsdp")))
    mine = store.chunk_names({"shape": [2, 32], "chunks": [2, 4]},
                             [first.devices_indices_map((2, 32))[d] for d in devices[4:]])
    assert mine == {"0.4", "0.5", "0.6", "0.7"}   # the half of the columns on the second host's devices
    assert store.chunk_names({"shape": [], "chunks": []}, [()]) == {"0"}
    assert store.chunk_names({"shape": [4, 4], "chunks": [2, 2], "dimension_separator": "/"},
                             [(slice(0, 2), slice(2, 4))]) == {"0/1"}


# ----------------------------------------------------------------------------- the margin

def test_the_deadline_margin_counts_the_upload(bucket, tmp_path, straight):
    """Before an upload is timed the margin reserves the state's bytes at the stated rate; then
    the slowest of the last uploads, for each upload owed (the last save's, an unfinished
    save's) and the one in flight."""
    cfg6, d = straight
    state, _ = restore(d, cfg6)
    mirror = store.open_mirror(f"s3://{bucket}/run", tmp_path / "stage", log=print)
    try:
        local = ckpt_lib.RunCheckpointer(tmp_path / "plain")
        ck = ckpt_lib.RunCheckpointer(tmp_path / "stage", mirror=mirror)
        local.expect(state)
        ck.expect(state)
        whole = ckpt_lib.save_bytes(state)[1]
        assert ck.save_seconds() == pytest.approx(local.save_seconds() + whole / store.UPLOAD_BYTES_PER_SECOND)
        mirror._pushes.extend([0.5, 7.0, 1.0])
        assert ck.save_seconds() == pytest.approx(local.save_seconds() + 7.0)
        assert mirror.push_seconds(owed=2) == pytest.approx(14.0)
        local.close()
        ck.close()
    finally:
        mirror.close()


def test_a_run_with_a_slow_store_stops_committed_before_its_deadline(s3, bucket, corpus_file, tmp_path, monkeypatch):
    """Each upload takes 2 s more (a slow link): the run reserves the slowest uploads in its
    margin, so that its last step is saved, uploaded and committed in the store before the
    deadline, and the store holds that step."""
    real = store.Mirror._upload_step

    def slow(self, step, parts, done):
        time.sleep(2.0)
        return real(self, step, parts, done)

    monkeypatch.setattr(store.Mirror, "_upload_step", slow)
    deadline = time.time() + 45
    cfg = tiny(corpus_file, "max_steps=1000000", "save_every=25", f"deadline={deadline}")
    last, logs = train_url(cfg, f"s3://{bucket}/run", tmp_path / "stage")
    ended = time.time()
    stopped = [line for line in logs if line.startswith("stopped at step ") and "(deadline near)" in line]
    assert len(stopped) == 1, logs
    step = int(stopped[0].split()[3])
    assert ended <= deadline, (ended - deadline, logs)
    assert store_steps(s3, bucket, "run")[-1] == step == last["step"]


def test_a_slow_upload_is_not_pruned_under_it(s3, bucket, corpus_file, tmp_path, monkeypatch):
    """keep_checkpoints=1 and uploads slower than the steps: each step's upload ends before
    retention or the next manifest touches the stage, so every commit the store receives
    names the step's files, and the store ends with the last step alone."""
    real = store.Mirror._upload_step
    commits = []
    write_commit = store.write_commit

    def slow(self, step, parts, done):
        time.sleep(1.0)
        return real(self, step, parts, done)

    def record(s, step, files):
        commits.append((step, files))
        write_commit(s, step, files)

    monkeypatch.setattr(store.Mirror, "_upload_step", slow)
    monkeypatch.setattr(store, "write_commit", record)
    cfg = tiny(corpus_file, "max_steps=4", "save_every=1", "keep_checkpoints=1")
    last, logs = train_url(cfg, f"s3://{bucket}/run", tmp_path / "stage")
    assert [step for step, _ in commits] == [1, 2, 3, 4]
    assert all("checksums.json" in files and len(files) > 3 for _, files in commits), commits
    assert store_steps(s3, bucket, "run") == [4]
    assert strict(s3.read(bucket, "run/manifest.json").decode())["step"] == 4


def test_the_stage_holds_the_step_saved_last_and_the_newest_good_one(s3, bucket, straight, tmp_path):
    """keep_checkpoints=3: the store keeps the run's three newest steps (and its newest good
    one); the stage drops each step once its upload has settled, holding the step just saved
    and the newest good one: two steps while a save is written, however many are kept."""
    cfg6, straight_dir = straight
    state, meta = restore(straight_dir, cfg6, 4)
    bad = dict(state, params={**state["params"], "observe": state["params"]["observe"] * np.nan})
    stage, logs, staged = tmp_path / "stage", [], []
    mirror = store.open_mirror(f"s3://{bucket}/run", stage, log=logs.append)
    ck = ckpt_lib.RunCheckpointer(stage, keep=3, log=logs.append, mirror=mirror)
    try:
        for step, saved in [(1, state), (2, state), (3, bad), (4, bad), (5, state), (6, state)]:
            ck.save(saved, dict(meta, step=step))
            staged.append(stage_steps(stage))
        mirror.settle()
    finally:
        ck.close()
        mirror.close(quiet=True)
    assert staged == [[1], [2], [2, 3], [2, 4], [5], [6]], staged
    assert store_steps(s3, bucket, "run") == [4, 5, 6]
    assert sum("holds NaN or Inf" in line for line in logs) == 2, logs
    # the steps only the store holds are whole: each passes its checksums (and its flags say how it was saved)
    pulled = tmp_path / "pod-b"
    fetch = store.Store(f"s3://{bucket}/run")
    for step in (4, 5):
        files = json.loads(s3.read(bucket, f"run/checkpoints/{step}/committed.json"))["files"]
        store.fetch_step(fetch, step, files, pulled / "checkpoints", logs.append)
    for step in (4, 5):
        assert ckpt_lib.check_files(pulled / "checkpoints" / str(step)) == ("ok", None)
    assert ckpt_lib.saved_non_finite(pulled / "checkpoints" / "5") is None
    assert ckpt_lib.saved_non_finite(pulled / "checkpoints" / "4") is not None   # not finite, as saved


# ----------------------------------------------------------------------------- kills and cuts

KILLED = r'''
import json, os, signal, sys
args = json.loads(sys.argv[1])
from fractus_jax.train import config as cfg_lib, loop, prepare as prepare_lib, store
where = args["where"]
write_commit = store.write_commit
def hook(s, step, files):
    if step == 4 and where == "before the commit":
        os.kill(os.getpid(), signal.SIGKILL)
    write_commit(s, step, files)
    if step == 4 and where == "after the commit":
        os.kill(os.getpid(), signal.SIGKILL)
store.write_commit = hook
if where == "in the pull":   # the start's fetch of step 4, once three of its files came whole
    get = store.Store.get
    def killed_pulling(s, remote, local, transfer=None):
        if any(r.startswith("checkpoints/4/") for r in remote):
            get(s, remote[:3], local[:3], transfer)
            os.kill(os.getpid(), signal.SIGKILL)
        return get(s, remote, local, transfer)
    store.Store.get = killed_pulling
cfg = cfg_lib.TrainConfig.from_dict(args["config"])
mirror = store.open_mirror(args["url"], args["stage"])
loop.run(prepare_lib.prepare(cfg, args["stage"], progress=False), progress=False, log=print, mirror=mirror)
'''


@pytest.mark.parametrize("where, resumed", [("before the commit", 2), ("after the commit", 4)])
def test_a_kill_inside_an_upload_resumes_from_a_fresh_stage_bit_exact(where, resumed, served, straight, tmp_path):
    """SIGKILL inside step 4's upload (its files written, its commit not; or its commit written,
    the manifest not); then a new stage (a new pod) resumes from the store to step 6, equal bit
    for bit to the run never interrupted; the store's log and steps are the run's."""
    cfg6, straight_dir = straight
    s3, url = served   # either kind of store
    bucket = url.split("/")[2]
    args = {"config": cfg6.to_dict(), "url": url, "stage": str(tmp_path / "pod-a"), "where": where}
    out = subprocess.run([sys.executable, "-c", KILLED, json.dumps(args)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=child_env(s3.env()))
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert store_steps(s3, bucket, "run") == [2, 4][:1 + (where == "after the commit")]
    assert any(k.startswith("run/checkpoints/4/") for k in s3.keys(bucket, "run/"))
    stage = tmp_path / "pod-b"
    last, logs = train_url(cfg6, url, stage)
    assert any(line.startswith("note: took the lease") and "its holder's process has ended" in line
               for line in logs), logs
    if where == "before the commit":
        assert f"note: removed {url}/checkpoints/4, left by an upload that did not finish" in logs, logs
    assert f"resumed {stage} at step {resumed}, lane offset {resumed * cfg6.seq_len}" in logs, logs
    assert_same_state(straight_dir, stage, cfg6)
    assert metrics_steps(stage) == [1, 2, 3, 4, 5, 6]
    assert [strict(x)["step"] for x in s3.read(bucket, "run/metrics.jsonl").decode().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert strict(s3.read(bucket, "run/manifest.json").decode())["step"] == 6
    # the store keeps the run's three newest steps; the new stage, the step it saved last
    assert store_steps(s3, bucket, "run") == [2, 4, 6]
    assert stage_steps(stage) == [6]
    if where == "after the commit":
        assert f"note: step 2 left in {url} (not pulled): the resume needs step 4 alone" in logs, logs
    assert "run/lease.json" not in s3.keys(bucket, "run/")


def test_a_run_on_a_versioned_bucket_trains_resumes_and_says_what_retention_keeps(served, corpus_file, tmp_path):
    """On a bucket that keeps every deleted or replaced object as an older version, a run
    trains, retires old steps and resumes as on any (its lease deleted, then created again
    over the older versions); its starts say that the steps retention deletes stay billed."""
    server, url = served
    bucket = url.split("/")[2]
    server.versioned(bucket)
    warning = f"warning: {url.split('://')[0]}://{bucket} keeps each object deleted or replaced as an older version"
    last, logs = train_url(tiny(corpus_file, "max_steps=4", "keep_checkpoints=1"), url, tmp_path / "pod-a")
    assert sum(line.startswith(warning) for line in logs) == 1, logs
    assert store_steps(server, bucket, "run") == [4] and "run/lease.json" not in server.keys(bucket)
    stage = tmp_path / "pod-b"
    last, logs = train_url(tiny(corpus_file, "max_steps=6", "keep_checkpoints=1"), url, stage)
    assert any(line.startswith(f"resumed {stage} at step 4,") for line in logs), logs
    assert sum(line.startswith(warning) for line in logs) == 1, logs
    assert store_steps(server, bucket, "run") == [6] and last["step"] == 6


def test_a_lifecycle_rule_that_deletes_the_runs_older_versions_silences_the_warning(s3, bucket):
    """S3: the warning holds until an enabled rule expiring noncurrent versions covers the
    run's prefix; a rule of another prefix, a disabled one, or one limited to a tag does not.
    GCS's rules are read the same way (fake-gcs-server keeps none, so they are read here from
    the JSON the API returns)."""
    run = store.Store(f"s3://{bucket}/runs/a")
    assert not run.keeps_deleted()   # versioning off
    s3.versioned(bucket)
    assert run.keeps_deleted()

    def rule(where, status="Enabled"):
        s3.client().put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [
            {"ID": "old", "Status": status, "Filter": where, "NoncurrentVersionExpiration": {"NoncurrentDays": 1}}]})
        return run.keeps_deleted()

    assert rule({"Prefix": "runs/b/"})
    assert rule({"Prefix": "runs/"}, status="Disabled")
    assert rule({"And": {"Prefix": "runs/", "Tags": [{"Key": "k", "Value": "v"}]}})
    assert not rule({"Prefix": "runs/"})
    assert not rule({"Prefix": ""})
    gcs = store._gcs_rule_covers
    assert gcs({"action": {"type": "Delete"}, "condition": {"isLive": False}}, "runs/a/")
    assert gcs({"action": {"type": "Delete"}, "condition": {"numNewerVersions": 2, "matchesPrefix": ["runs/"]}},
               "runs/a/")
    assert gcs({"action": {"type": "Delete"}, "condition": {"age": 30}}, "runs/a/")
    assert not gcs({"action": {"type": "Delete"}, "condition": {"age": 30, "isLive": True}}, "runs/a/")
    assert not gcs({"action": {"type": "SetStorageClass"}, "condition": {"isLive": False}}, "runs/a/")
    assert not gcs({"action": {"type": "Delete"}, "condition": {"isLive": False, "matchesPrefix": ["runs/b/"]}},
                   "runs/a/")


def test_a_start_aborts_the_uploads_to_the_run_a_killed_one_left_unfinished(s3, bucket, corpus_file, tmp_path):
    """A file of 100 MiB or more goes to s3:// as a multipart upload; one its process never
    ended (killed, or its call cut at the run's deadline) keeps its parts stored, and billed,
    where no listing of objects shows them. The next start, holding the lease, aborts those
    under the run's steps and rejected steps, saying how much they held, and leaves alone the
    ones of another run and of a run inside this one's prefix."""
    url = f"s3://{bucket}/run"
    train_url(tiny(corpus_file, "max_steps=2"), url, tmp_path / "pod-a")
    client = s3.client()

    def uploads():
        return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads") or [])

    assert uploads() == []   # the run's own uploads all ended
    ours = {"run/checkpoints/4/params/d/0a": 3_000_000, "run/checkpoints/4/opt_state/d/0b": 2_000_000,
            "run/rejected/2/params/d/0c": 1_000_000}
    others = {"run2/checkpoints/4/params/d/0a": 1000, "run/sub/checkpoints/4/params/d/0a": 1000}
    for key, size in {**ours, **others}.items():   # as a killed client leaves them: begun, a part sent
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * size)
    stage = tmp_path / "pod-b"
    last, logs = train_url(tiny(corpus_file, "max_steps=4"), url, stage)
    assert f"note: aborted 2 uploads to {url}/checkpoints left unfinished (e.g. 4/opt_state/d/0b): the 5.0 MB " \
           "of parts they held are deleted" in logs, logs
    assert f"note: aborted 1 upload to {url}/rejected left unfinished (e.g. 2/params/d/0c): the 1.0 MB of parts " \
           "they held are deleted" in logs, logs
    assert uploads() == sorted(others)
    assert any(line.startswith(f"resumed {stage} at step 2,") for line in logs), logs
    assert store_steps(s3, bucket, "run") == [2, 4]


def test_a_start_killed_in_its_pull_goes_on_from_the_files_it_left(s3, bucket, straight, tmp_path):
    """Pod B's start is killed as it pulls step 4, three of the step's files whole in its
    stage; started again there, it takes over those files (each checked against the step's
    checksums), fetches the others only, and trains to step 6 bit for bit as the run never
    interrupted."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"

    def killed(stage, where):
        args = {"config": cfg6.to_dict(), "url": url, "stage": str(tmp_path / stage), "where": where}
        out = subprocess.run([sys.executable, "-c", KILLED, json.dumps(args)], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env=child_env(s3.env()))
        assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]

    killed("pod-a", "after the commit")
    killed("pod-b", "in the pull")
    stage = tmp_path / "pod-b"
    files = json.loads(s3.read(bucket, "run/checkpoints/4/committed.json"))["files"]
    left = [p for p in (stage / store.CHECKPOINTS).iterdir() if p.name.startswith(f"4{store.PULL_TMP}-")]
    assert len(left) == 1 and len(store._step_files(left[0])) == 3, sorted((stage / store.CHECKPOINTS).iterdir())
    came = set(store._step_files(left[0])) - {ckpt_lib.CHECKSUMS}
    rest = (sum(files.values()) - sum(files[n] for n in came)) / 1e6
    last, logs = train_url(cfg6, url, stage)
    assert f"pulling step 4 ({rest:.1f} MB) from {url}/checkpoints/4; {len(came)} came whole in a fetch that did " \
           "not finish (checked against the step's checksums)" in logs, logs
    assert f"resumed {stage} at step 4, lane offset {4 * cfg6.seq_len}" in logs, logs
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and "run/lease.json" not in s3.keys(bucket, "run/")


def ended(seconds, fn):
    """fn(), in a thread given `seconds` to end: a call that hangs fails the test rather than
    the suite."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:   # noqa: BLE001 - raised below, in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} had not ended after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def behind_a_relay(served, monkeypatch, waits, tries_seconds):
    """The served store (either kind) reached through a Relay, to cut or stall at will; the
    clients' read timeout 1 s, the upload's tries as given: (server, url, bucket, relay)."""
    server, url = served
    relay = Relay(server.port)
    set_env(monkeypatch, server.env(relay.endpoint))
    monkeypatch.setattr(store, "READ_SECONDS", 1.0)
    monkeypatch.setattr(store, "TRY_WAITS", waits)
    monkeypatch.setattr(store, "TRIES_SECONDS", tries_seconds)
    return server, url, url.split("/")[2], relay


def down_until_said(relay, monkeypatch, method, step, said):
    """The store cut the first time `method` ("put" or "get") moves the files of `step`, and
    back once a line the run logs starts with `said` (None: when the test restores it):
    returns the watch that restores it."""
    real = getattr(store.Store, method)
    cuts = []

    def cut_at_step(self, a, b, transfer=None):
        remote = b if method == "put" else a
        if not cuts and any(r.startswith(f"{store.CHECKPOINTS}/{step}/") for r in remote):
            cuts.append(remote)
            relay.cut()
        return real(self, a, b, transfer)

    def back_once_said(line):
        if said is not None and line.startswith(said) and len(cuts) == 1:
            cuts.append("restored")
            relay.restore()

    monkeypatch.setattr(store.Store, method, cut_at_step)
    return back_once_said


@pytest.mark.parametrize("how", ["cut", "stall"])
def test_a_store_cut_inside_an_upload_loses_nothing_committed(how, served, straight, tmp_path, monkeypatch):
    """The store stops as step 4's files are sent, closing its connections (cut) or holding
    them and answering nothing (stall, bounded by the clients' read timeout), and stays down:
    the upload is tried again until TRIES_SECONDS pass, then the run stops saying what
    failed and which step the store holds; with the store back, the same URL resumes to the
    same state."""
    cfg6, straight_dir = straight
    s3, url, bucket, relay = behind_a_relay(served, monkeypatch, waits=(0.2,), tries_seconds=0.5)
    real = store.Store.put

    def stop_at_4(self, local, remote, transfer=None):   # as the first file of step 4 is sent
        if any(r.startswith(f"{store.CHECKPOINTS}/4/") for r in remote):
            relay.cut() if how == "cut" else relay.stall()
        return real(self, local, remote, transfer)

    monkeypatch.setattr(store.Store, "put", stop_at_4)
    with pytest.raises(rundir.RunDirIOError) as e:
        ended(600, lambda: train_url(cfg6, url, tmp_path / "pod-a"))
    assert str(e.value).startswith(f"cannot upload step 4 to {url}/checkpoints/4: ")
    assert re.search(r" \(tried [2-9] times over \d+ s\); ", str(e.value)), e.value
    assert str(e.value).endswith(f"; {url} holds step 2 (the same command resumes from it)")
    if how == "stall":
        assert ("Read timeout on endpoint URL" in str(e.value) if url.startswith("s3") else
                "the store did not answer (no byte for 1 s, on each of the client's tries)" in str(e.value)), e.value
    assert store_steps(s3, bucket, "run") == [2]
    monkeypatch.setattr(store.Store, "put", real)
    relay.restore() if how == "cut" else relay.stall(False)
    stage = tmp_path / "pod-b"
    last, logs = train_url(cfg6, url, stage)
    assert f"resumed {stage} at step 2, lane offset {2 * cfg6.seq_len}" in logs, logs
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and stage_steps(stage) == [6]


def test_a_store_down_for_a_while_inside_an_upload_costs_the_run_nothing(served, straight, tmp_path, monkeypatch):
    """The store stops as step 4's files are sent, and is back once the run has said so: the
    upload is tried again while training goes on, and the run ends at step 6 as one never
    interrupted, its three steps committed in the store and its lease let go."""
    cfg6, straight_dir = straight
    s3, url, bucket, relay = behind_a_relay(served, monkeypatch, waits=(0.5,), tries_seconds=300.0)
    watch = down_until_said(relay, monkeypatch, "put", 4, f"warning: the upload of step 4 to {url} failed (")
    stage = tmp_path / "pod-a"
    last, logs = ended(600, lambda: train_url(cfg6, url, stage, watch=watch))
    said = [line for line in logs if line.startswith("warning: the upload")]
    assert len(said) == 1 and re.fullmatch(
        rf"warning: the upload of step 4 to {re.escape(url)} failed \(.+\); trying again in 0\.5 s while training "
        r"goes on \(it stops the run if it still fails (29\d|300) s from now\)", said[0]), logs
    assert f"note: step 4 is uploaded to {url} (try 2)" in logs, logs
    assert last["step"] == 6
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and stage_steps(stage) == [6]
    assert [strict(x)["step"] for x in s3.read(bucket, "run/metrics.jsonl").decode().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert "run/lease.json" not in s3.keys(bucket, "run/")


def test_training_goes_on_past_a_save_due_while_an_upload_is_tried_again(s3, bucket, straight, tmp_path,
                                                                         monkeypatch):
    """The store stops as step 2's files are sent, and is back only once the run reaches step 6:
    step 4's save, due while the upload is tried again, is held (the run says so) and training
    goes on, where a save waiting for the upload would stall it until the tries end; the upload
    of step 2 goes through, and the run's last save commits step 6, as a run never interrupted."""
    cfg6, straight_dir = straight
    _, url, _, relay = behind_a_relay((s3, f"s3://{bucket}/run"), monkeypatch, waits=(0.5,), tries_seconds=30.0)
    logs, at_step = [], policy.StopSavePolicy.at_step
    failed = f"warning: the upload of step 2 to {url} failed ("
    down_until_said(relay, monkeypatch, "put", 2, said=None)   # back at step 6, below

    def steps_around_the_cut(self, step, signal, ckpt, step_seconds):
        if step == 3:
            ckpt.wait()   # step 2's save finished now, its upload started (and cut)
        if step == 4:   # the upload has failed before step 4's save is due
            t0 = time.time()
            while not any(line.startswith(failed) for line in logs):
                assert time.time() - t0 < 60, logs
                time.sleep(0.05)
        if step == 5:   # a save of step 4, had one started, is on disk: this step would finish it
            while ckpt.manager.is_saving_in_progress():
                time.sleep(0.05)
        if step == 6:
            relay.restore()
        return at_step(self, step, signal, ckpt, step_seconds)

    monkeypatch.setattr(policy.StopSavePolicy, "at_step", steps_around_the_cut)
    stage = tmp_path / "pod-a"
    last, _ = ended(300, lambda: train_url(cfg6, url, stage, watch=logs.append))
    held = [i for i, line in enumerate(logs) if line.startswith("note: step 4 is not saved yet")]
    assert len(held) == 1 and logs[held[0]] == (
        f"note: step 4 is not saved yet: the upload of step 2 to {url} is being tried again; training goes on, and "
        "the save is made once that upload is through"), logs
    tries = sum(line.startswith(failed) for line in logs) + 1
    uploaded = logs.index(f"note: step 2 is uploaded to {url} (try {tries})")
    assert held[0] < uploaded, logs   # training passed step 4 while the upload failed
    assert last["step"] == 6
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 6] and stage_steps(stage) == [6]
    assert [strict(x)["step"] for x in s3.read(bucket, "run/metrics.jsonl").decode().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert "run/lease.json" not in s3.keys(bucket, "run/")


def test_training_goes_on_while_an_upload_before_a_committed_save_is_slow(s3, bucket, straight, tmp_path,
                                                                          monkeypatch):
    """Step 2's upload is slow: its files are sent only once the run has decided step 5. Step
    4's save has committed on the stage by then (each step waits for a save in flight to
    commit before its decision), and its finish (checksums, retention, its own upload), which
    would wait for step 2's upload, waits instead for a step after that upload: training goes
    on. The run ends at step 6 as a run never interrupted."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    decided, stalled, at_step, put = threading.Event(), [], policy.StopSavePolicy.at_step, store.Store.put

    def committed_first(self, step, signal, ckpt, step_seconds):
        while ckpt.manager.is_saving_in_progress():
            time.sleep(0.05)
        decision = at_step(self, step, signal, ckpt, step_seconds)
        if step == 5:
            decided.set()
        return decision

    def slow(self, local, remote, transfer=None):
        if any(r.startswith(f"{store.CHECKPOINTS}/2/") for r in remote) and not decided.wait(30):
            stalled.append("step 5 was not decided while step 2 was uploaded")
        return put(self, local, remote, transfer)

    monkeypatch.setattr(policy.StopSavePolicy, "at_step", committed_first)
    monkeypatch.setattr(store.Store, "put", slow)
    stage = tmp_path / "pod-a"
    last, logs = ended(300, lambda: train_url(cfg6, url, stage))
    assert not stalled and last["step"] == 6, stalled
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and stage_steps(stage) == [6]
    assert [strict(x)["step"] for x in s3.read(bucket, "run/metrics.jsonl").decode().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_save_kept_waiting_by_the_upload_before_it_says_so(s3, bucket, straight, tmp_path, monkeypatch):
    """Step 2's upload is sent only once step 6's save waits for it, 1.5 s later: step 4's save,
    unfinished while step 2 uploads, makes step 6's wait. That save says how long it waited
    and what lets training go on; the end of the run, which waits for step 6's upload, says
    nothing. The run ends as one never interrupted."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    waiting, stalled, settle, put = threading.Event(), [], store.Mirror.settle, store.Store.put

    def watched(self):
        if self.pushing():
            waiting.set()
        return settle(self)

    def slow(self, local, remote, transfer=None):
        if any(r.startswith(f"{store.CHECKPOINTS}/2/") for r in remote):
            if not waiting.wait(60):
                stalled.append("no save waited for step 2's upload")
            time.sleep(1.5)
        return put(self, local, remote, transfer)

    monkeypatch.setattr(store.Mirror, "settle", watched)
    monkeypatch.setattr(store.Store, "put", slow)
    monkeypatch.setattr(ckpt_lib, "UPLOAD_WAIT_WARN_SECONDS", 1.0)
    stage = tmp_path / "pod-a"
    last, logs = ended(300, lambda: train_url(cfg6, url, stage))
    assert not stalled and last["step"] == 6, stalled
    said = [line for line in logs if line.startswith("warning: the save of step ")]
    assert len(said) == 1 and re.fullmatch(
        rf"warning: the save of step 6 waited \d+ s for the upload of step 2 to {url}, and training with it: the "
        r"store takes a step more slowly than the run saves; saving less often \(a larger save_every\) lets "
        r"training go on", said[0]), logs
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and stage_steps(stage) == [6]


@pytest.mark.parametrize("error, again", [
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), True),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"), True),
    (TimeoutError(), True),
    (OSError(errno.ETIMEDOUT, "Connection timed out"), True),
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (OSError(errno.EBUSY, "Device or resource busy", "/stage/checkpoints/4/x"), False),
    (FileNotFoundError(errno.ENOENT, "The specified key does not exist", "b/run/checkpoints/4/x"), False),
    (PermissionError(errno.EACCES, "Forbidden"), False),
    (rundir.CheckpointError("step 4 does not hold the files its commit names"), False),
])
def test_a_pull_tries_again_where_the_store_failed_not_the_disk_nor_a_refusal(error, again):
    assert store.store_failed(error) is again


def test_a_store_down_for_a_while_inside_the_pull_costs_the_start_nothing(served, straight, corpus_file, tmp_path,
                                                                         monkeypatch):
    """A new pod's start pulls step 4, and the store stops as its files are fetched, back once
    the start has said so: the pull is tried again, and the run resumes at step 4 and ends at
    step 6 as one never interrupted."""
    cfg6, straight_dir = straight
    s3, url, bucket, relay = behind_a_relay(served, monkeypatch, waits=(0.5,), tries_seconds=300.0)
    train_url(tiny(corpus_file, "max_steps=4"), url, tmp_path / "pod-a")
    watch = down_until_said(relay, monkeypatch, "get", 4, f"warning: the pull of {url} into ")
    stage = tmp_path / "pod-b"
    last, logs = ended(600, lambda: train_url(cfg6, url, stage, watch=watch))
    said = [line for line in logs if line.startswith("warning: the pull")]
    assert len(said) == 1 and re.fullmatch(
        rf"warning: the pull of {re.escape(url)} into {re.escape(str(stage))} failed \(.+\); trying again in 0\.5 s "
        r"\(it stops if it still fails (29\d|300) s from now\)", said[0]), logs
    assert f"resumed {stage} at step 4, lane offset {4 * cfg6.seq_len}" in logs, logs
    assert last["step"] == 6
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6]
    assert "run/lease.json" not in s3.keys(bucket, "run/")


def test_a_pull_failing_as_the_deadline_comes_stops_the_start_before_it(s3, bucket, corpus_file, tmp_path,
                                                                        monkeypatch, capsys):
    """A new pod's start pulls step 4, and the store goes down as its files are fetched and
    stays down: the pull is tried again until the run's deadline leaves no time for another
    try, and the start stops by the deadline (the try under way ends on its own), saying so
    (exit 2, no traceback)."""
    _, url, _, relay = behind_a_relay((s3, f"s3://{bucket}/run"), monkeypatch, waits=(1.0,), tries_seconds=120.0)
    train_url(tiny(corpus_file, "max_steps=4"), url, tmp_path / "pod-a")
    down_until_said(relay, monkeypatch, "get", 4, said=None)
    deadline = time.time() + 30
    stage = tmp_path / "pod-b"
    code = ended(300, lambda: train_cli(["--config", "tiny", "--workdir", url, "--stage", str(stage), "--no-progress",
                                         *(f"--set={kv}" for kv in (f"corpus={corpus_file}", "save_every=2",
                                                                     "max_steps=6", f"deadline={deadline}"))]))
    finished = time.time()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err), err
    assert re.fullmatch(
        rf"error: cannot pull {re.escape(url)} into {re.escape(str(stage))}: .+ \(tried \d+ times over \d+ s; the "
        rf"run's deadline, {re.escape(policy.deadline_words(deadline))}, comes before another try\)", err[-1]), err
    said = [line for line in err if line.startswith("warning: the pull")]
    assert said and all(int(re.search(r"still fails (\d+) s from now", line)[1]) <= 30 for line in said), said
    assert finished < deadline + 10, (finished - deadline, err[-5:])
    assert store_steps(s3, bucket, "run") == [2, 4]   # the lease, unreleased with the store down, lapses


def test_a_reader_whose_store_goes_down_for_a_while_fetches_the_step(s3, bucket, tmp_path, monkeypatch):
    """A reader's fetch of a step (eval's, generate's, convert export's, grow's) meets the
    store down as the step's files come, back once the fetch has said so: it is tried again,
    and the read cache holds the step whole, as committed."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    bodies = put_committed_step(s3.client(), bucket, 4, {"params/a": b"w" * 64, "opt_state/b": b"m" * 128})
    _, url, _, relay = behind_a_relay((s3, f"s3://{bucket}/run"), monkeypatch, waits=(0.5,), tries_seconds=300.0)
    watch = down_until_said(relay, monkeypatch, "get", 4, f"warning: the fetch of step 4 of {url} failed (")
    logs = []
    local = Path(ended(120, lambda: store.readable(url, log=lambda line: (logs.append(line), watch(line)))))
    said = [line for line in logs if line.startswith("warning: ")]
    assert len(said) == 1 and re.fullmatch(
        rf"warning: the fetch of step 4 of {re.escape(url)} failed \(.+\); trying again in 0\.5 s \(it stops if it "
        r"still fails (29\d|300) s from now\)", said[0]), logs
    step_dir = local / store.CHECKPOINTS / "4"
    assert {str(f.relative_to(step_dir)): f.read_bytes() for f in step_dir.rglob("*") if f.is_file()} == bodies


def test_a_fetch_tried_again_fetches_only_the_files_that_did_not_come_whole(s3, bucket, tmp_path, monkeypatch):
    """The store fails a reader's fetch of step 4 once two of its four files have come whole
    and a third in part: the next try fetches the other two only, and the read cache ends
    with the step's exact bytes."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "TRY_WAITS", (0.1,))
    bodies = put_committed_step(s3.client(), bucket, 4, {f"params/{c}": c.encode() * 4096 for c in "abcd"})
    real, asked = store.Store.get, []

    def cut_after_two(self, remote, local, transfer=None):
        if any(r.startswith(f"{store.CHECKPOINTS}/4/") for r in remote):
            asked.append([r.split("/", 2)[2] for r in remote])
            if len(asked) == 1:
                real(self, remote[:2], local[:2], transfer)
                local[2].write_bytes(b"c" * 100)   # a file cut short
                raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        return real(self, remote, local, transfer)

    monkeypatch.setattr(store.Store, "get", cut_after_two)
    logs = []
    local = Path(ended(120, lambda: store.readable(f"s3://{bucket}/run", log=logs.append)))
    assert sorted(asked[0]) == sorted(bodies) and len(asked) == 2, asked
    assert sorted(asked[1]) == sorted(asked[0][2:]), asked
    assert any(line.endswith("; 2 came whole in the try before") for line in logs), logs
    step_dir = local / store.CHECKPOINTS / "4"
    assert {str(f.relative_to(step_dir)): f.read_bytes() for f in step_dir.rglob("*") if f.is_file()} == bodies


KILLED_IN_A_FETCH = """
import os, signal, sys
from pathlib import Path
from fractus_jax.train import store
url, step = sys.argv[1], int(sys.argv[2])
real = store.Store.get
def killed_after_three(self, remote, local, transfer=None):
    if any(r.startswith(f"checkpoints/{step}/") for r in remote):
        real(self, remote[:3], local[:3], transfer)
        Path(local[3]).write_bytes(b"c" * 100)   # a file cut short
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, remote, local, transfer)
store.Store.get = killed_after_three
store.readable(f"{url}/checkpoints/{step}", log=lambda m: None)
"""


def test_a_fetch_after_one_killed_fetches_what_it_did_not_leave_whole(s3, bucket, tmp_path, monkeypatch):
    """A reader on this machine is killed as it fetches step 4, once three files came whole
    (checksums.json, params/a, params/b) and a fourth in part. The next read of step 4 takes
    over its fetch: checksums.json comes again (the other files are checked against it), and
    so do the file cut short and the files never sent, the store failing that first try
    once the checksums came; params/b, changed on this disk since it came, differs from the
    checksums and comes again. The cache ends with the step's exact bytes. A fetch of step 2
    killed the same way is removed by the next read of another step."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "TRY_WAITS", (0.1,))
    client = s3.client()
    bodies = {step: put_committed_step(client, bucket, step, {f"params/{c}": f"{c}{step}".encode() * 4096
                                                              for c in "abcde"}) for step in (2, 4)}
    url = f"s3://{bucket}/run"
    checkpoints = tmp_path / "cache" / "read" / "s3" / bucket / "run" / store.CHECKPOINTS

    def killed_fetching(step):
        """The directory its fetch left."""
        killed = subprocess.run([sys.executable, "-c", KILLED_IN_A_FETCH, url, str(step)], env=child_env(s3.env()),
                                capture_output=True, text=True, timeout=120)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        left = [p for p in checkpoints.iterdir() if p.name.startswith(f"{step}{store.PULL_TMP}-")]
        assert len(left) == 1, sorted(checkpoints.iterdir())
        return left[0]

    left = killed_fetching(4)
    assert sorted(store._step_files(left)) == ["checksums.json", "params/a", "params/b", "params/c"]
    (left / "params" / "b").write_bytes(b"x" * len(bodies[4]["params/b"]))   # damaged, its size kept
    real, asked = store.Store.get, []

    def counted(self, remote, local, transfer=None):
        asked.append(sorted(r.split("/", 2)[2] for r in remote))
        if len(asked) == 1:   # the store fails the first try once the checksums came
            real(self, remote[:1], local[:1], transfer)
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        return real(self, remote, local, transfer)

    monkeypatch.setattr(store.Store, "get", counted)
    logs = []
    step_dir = Path(store.readable(f"{url}/checkpoints/4", log=logs.append))
    rest = ["checksums.json", "params/c", "params/d", "params/e"]
    assert asked == [rest, rest[1:], ["params/b"]], asked
    assert any(line.endswith("; 2 came whole in a fetch that did not finish (checked against the step's "
                             "checksums)") for line in logs), logs
    assert any(line.startswith("note: 1 of the files of step 4 that a fetch which did not finish left differ from "
                               "its checksums (e.g. params/b)") for line in logs), logs
    assert {str(f.relative_to(step_dir)): f.read_bytes() for f in step_dir.rglob("*") if f.is_file()} == bodies[4]

    left = killed_fetching(2)
    store.done_reading()
    store.readable(f"{url}/checkpoints/4", log=logs.append)
    assert f"note: removed {left}, left by a fetch that did not finish" in logs, logs
    assert sorted(p.name for p in checkpoints.iterdir()) == ["4"]


@pytest.mark.parametrize("fault", ["cut", "stall"])
def test_an_upload_failing_as_the_deadline_comes_stops_the_run_by_it(fault, s3, bucket, corpus_file, tmp_path,
                                                                     monkeypatch):
    """The store goes down as step 10's files are sent and stays down, and the run stops by
    its deadline (the pod ends then), saying so and which step the store holds:
    - cut (the store refuses connections): the upload is tried again while training goes on
      until the deadline leaves no time for another try, and the run stops before it;
    - stall (the store holds its connections answering nothing; the clients' own bounds
      longer than the pod lives): the try under way is cut at the deadline (without the cut
      the run hangs past the test's 300 s)."""
    _, url, _, relay = behind_a_relay((s3, f"s3://{bucket}/run"), monkeypatch, waits=(1.0,), tries_seconds=600.0)
    monkeypatch.setattr(store, "READ_SECONDS", 600.0)
    real = store.Store.put

    def down_at_10(self, local, remote, transfer=None):
        if any(r.startswith(f"{store.CHECKPOINTS}/10/") for r in remote):
            relay.cut() if fault == "cut" else relay.stall()
        return real(self, local, remote, transfer)

    monkeypatch.setattr(store.Store, "put", down_at_10)
    deadline = time.time() + 45
    cfg = tiny(corpus_file, "max_steps=1000000", "save_every=5", f"deadline={deadline}")
    logs = []
    with pytest.raises(rundir.RunDirIOError) as e:
        ended(300, lambda: train_url(cfg, url, tmp_path / "stage", watch=logs.append))
    finished = time.time()
    when = re.escape(policy.deadline_words(deadline))
    what = ".+ " if fault == "cut" else f"TimeoutError: cut at the run's deadline, {when} "
    assert re.fullmatch(
        rf"cannot upload step 10 to {re.escape(url)}/checkpoints/10: {what}\((tried \d+ times over \d+ s; )?the "
        rf"run's deadline, {when}, comes before another try\); {re.escape(url)} holds step 5 \(the same command "
        r"resumes from it\)", str(e.value)), e.value
    said = [line for line in logs if line.startswith("warning: the upload of step 10")]
    assert all(int(re.search(r"still fails (\d+) s from now", line)[1]) <= 45 for line in said), said
    if fault == "cut":
        assert said and finished < deadline + 10, (finished - deadline, logs[-5:])
    else:   # the calls the stop makes after the deadline (the lease let go) are given a few seconds each
        assert deadline <= finished < deadline + 3 * store.DEADLINE_GRACE_SECONDS, finished - deadline
    assert store_steps(s3, bucket, "run") == [5]


def test_an_upload_tried_again_goes_on_from_where_it_stopped(s3, bucket, straight, tmp_path, monkeypatch):
    """Step 4's upload fails once its commit is written (the manifest refused): the next try
    writes the manifest and retention only, leaving the step committed once, its files sent
    once; the run ends as one never interrupted."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    monkeypatch.setattr(store, "TRY_WAITS", (0.1,))
    sent, commits, refused = collections.Counter(), [], []
    put, write, write_commit = store.Store.put, store.Store.write, store.write_commit

    def count_put(self, local, remote, transfer=None):
        sent.update(r.split("/")[1] for r in remote if r.startswith(store.CHECKPOINTS + "/"))
        return put(self, local, remote, transfer)

    def refuse_once(self, data, *parts):
        if parts == (store.MANIFEST,) and commits[-1:] == [4] and not refused:
            refused.append(parts)
            raise PermissionError(errno.EACCES, "Access Denied")
        return write(self, data, *parts)

    def record(s, step, files):
        commits.append(step)
        write_commit(s, step, files)

    monkeypatch.setattr(store.Store, "put", count_put)
    monkeypatch.setattr(store.Store, "write", refuse_once)
    monkeypatch.setattr(store, "write_commit", record)
    stage = tmp_path / "stage"
    last, logs = train_url(cfg6, url, stage)
    assert refused and commits == [2, 4, 6], commits
    assert f"note: step 4 is uploaded to {url} (try 2)" in logs, logs
    assert sent == {str(k): len(json.loads(s3.read(bucket, f"run/checkpoints/{k}/committed.json"))["files"])
                    for k in (2, 4, 6)}, sent
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6]
    assert strict(s3.read(bucket, "run/manifest.json").decode())["step"] == 6


def test_a_store_that_stops_reading_a_body_fails_the_upload(served, tmp_path, monkeypatch):
    """The store reads the first MiB a connection sends and no more, the connection open: a
    32 MiB upload (a step's file of a real run) fills the buffers and waits on a shut window,
    where the read timeout is not yet running. It fails (TCP_USER_TIMEOUT, SEND_SECONDS, on
    each of the client's tries) instead of waiting for ever; with the store reading again,
    the same upload goes through."""
    server, url = served
    bucket = url.split("/")[2]
    relay = Relay(server.port)
    set_env(monkeypatch, server.env(relay.endpoint))
    monkeypatch.setattr(store, "READ_SECONDS", 1.0)
    monkeypatch.setattr(store, "SEND_SECONDS", 2.0)
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * (32 << 12))
    relay.deaf(1 << 20)
    with pytest.raises(Exception) as e:   # noqa: PT011 - each client library has its own
        ended(600, lambda: store.Store(url).put([big], ["big"]))
    assert store.failure_words(e.value) == ("the store took nothing sent to it for 2 s, on each of the client's "
                                            "tries"), e.value
    relay.deaf(None)
    store.Store(url).put([big], ["big"])
    assert server.read(bucket, "run/big") == big.read_bytes()


def test_a_rejected_step_saved_again_is_moved_aside_in_the_store(s3, bucket, straight, tmp_path):
    """Step 4 damaged in the store (same sizes): a new pod pulls it, its resume rejects it and
    falls back to step 2; when step 4 is saved again, the store's old one goes to
    URL/rejected/4 before any new file lands, and the run ends equal to one never damaged."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    train_url(tiny(cfg6.corpus, "max_steps=4"), url, tmp_path / "pod-a")
    keys = s3.keys(bucket, "run/checkpoints/4/params/")
    biggest = max(keys, key=lambda k: len(s3.read(bucket, k)))
    data = bytearray(s3.read(bucket, biggest))
    data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64])
    s3.client().put_object(Bucket=bucket, Key=biggest, Body=bytes(data))
    stage = tmp_path / "pod-b"
    last, logs = train_url(cfg6, url, stage)
    assert any(line.startswith("warning: step 4: params failed its checksum; falling back to step 2")
               for line in logs), logs
    assert f"note: moved the rejected {url}/checkpoints/4 to {url}/rejected/4" in logs, logs
    assert s3.read(bucket, "rejected/4/".join(biggest.split("checkpoints/4/"))) == bytes(data)
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and stage_steps(stage) == [6]
    # the store's step 4 is the one saved again: its commit names its files, and no other
    held = json.loads(s3.read(bucket, "run/checkpoints/4/committed.json"))["files"]
    prefix = "run/checkpoints/4/"
    assert held == {k[len(prefix):]: len(s3.read(bucket, k)) for k in s3.keys(bucket, prefix)
                    if k != prefix + store.COMMITTED}
    assert biggest[len(prefix):] not in held


@pytest.mark.parametrize("damaged", ["a params file", "checksums.json", "a params file cut short"])
def test_a_stage_whose_copy_of_a_step_is_damaged_fetches_it_again(damaged, s3, bucket, straight, tmp_path):
    """The same pod starts again on its stage, whose copy of step 4 its disk has changed (a
    params file or the step's checksums.json at the same size; a params file cut short, which
    moves the copy aside); the store's step 4 is the one committed: the pull fetches it again,
    the run resumes from it, the store keeps it, and the run ends equal to one never
    interrupted."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    stage = tmp_path / "pod-a"
    train_url(tiny(cfg6.corpus, "max_steps=4"), url, stage)
    step_4 = stage / "checkpoints" / "4"
    target = (max((p for p in (step_4 / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
              if damaged == "a params file" else step_4 / ckpt_lib.CHECKSUMS)
    data = bytearray(target.read_bytes())
    if damaged == "a params file":
        data[len(data) // 2] ^= 0x20
    elif damaged == "checksums.json":
        data[0] = ord("x")   # a JSON that does not read
    else:
        del data[len(data) // 2:]
    target.write_bytes(bytes(data))
    last, logs = train_url(cfg6, url, stage)
    if damaged == "a params file cut short":
        moved = stage / "unpushed" / "4"
        assert f"note: moved {step_4} to {moved}: {url} holds step 4 committed with other files" in logs, logs
        assert (moved / target.relative_to(step_4)).stat().st_size == len(data)
    else:
        why = "params failed its checksum" if damaged == "a params file" else "its checksums.json does not read"
        notes = [line for line in logs if line.startswith(f"note: the stage's copy of step 4 is not the one "
                                                          f"committed ({why}")]
        assert len(notes) == 1 and notes[0].endswith(f"fetching it again from {url}"), logs
    assert [line.split()[2] for line in logs if line.startswith("pulling step ")] == ["4"], logs
    assert f"resumed {stage} at step 4, lane offset {4 * cfg6.seq_len}" in logs, logs
    assert not any(line.startswith("warning:") for line in logs), logs
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and not s3.keys(bucket, "run/rejected/")


@pytest.mark.parametrize("damaged", [False, True])
def test_a_process_whose_part_of_a_step_is_damaged_fetches_the_step_again(damaged, bucket, tmp_path):
    """Process 1 of two starts on its old stage, which holds its part of step 4 (one of the
    array's two chunk files); when its disk has changed that chunk file (at its size), the pull
    fetches the step again, leaving both chunk files to the restore; otherwise it keeps it."""
    url = f"s3://{bucket}/run"
    saved = tmp_path / "saved" / "4"
    contents = {"params/w/.zarray": b'{"chunks": [1, 4]}', "params/w/0.0": b"a" * 64, "params/w/1.0": b"b" * 64,
                "params/_METADATA": b"{}"}
    for name, data in contents.items():
        (saved / name).parent.mkdir(parents=True, exist_ok=True)
        (saved / name).write_bytes(data)
    ckpt_lib.write_checksums(saved, {"params": True}, {"params": ckpt_lib.item_checksums(saved / "params")})
    files = store._step_files(saved)
    run = store.Store(url)
    run.put([saved / n for n in files], [f"checkpoints/4/{n}" for n in files])
    store.write_commit(run, 4, files)
    part = tmp_path / "stage" / "checkpoints" / "4"
    for name in ("params/w/.zarray", "params/w/1.0"):
        (part / name).parent.mkdir(parents=True, exist_ok=True)
        (part / name).write_bytes(b"c" * 64 if damaged and name.endswith("1.0") else contents[name])

    logs = []
    mirror = store.Mirror(url, tmp_path / "stage", logs.append, index=1, count=2)
    mirror.pull()
    noted = [line for line in logs if line.startswith("note: the stage's copy of step 4 is not the one committed")]
    assert noted == ([f"note: the stage's copy of step 4 is not the one committed (params failed its checksum "
                      f"(w/1.0 differs)); fetching it again from {url}"] if damaged else []), logs
    left = {"params/w/0.0": (64, "params/w")} | ({"params/w/1.0": (64, "params/w")} if damaged else {})
    assert mirror.left_out == {4: left} and mirror.checked == {4}
    assert set(store._step_files(part)) == set(files) - set(left)
    assert ckpt_lib.check_files(part, absent=set(left)) == ("ok", None)


def test_a_new_pod_pulls_only_the_step_it_resumes_from(s3, bucket, straight, tmp_path):
    """The store holds steps 2 and 4 (keep_checkpoints=2): a new pod pulls step 4 alone, step 2
    staying in the store as the run's; retention counts it, and step 6's commit retires it.
    The run ends equal to one never interrupted."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    train_url(tiny(cfg6.corpus, "max_steps=4", "keep_checkpoints=2"), url, tmp_path / "pod-a")
    assert store_steps(s3, bucket, "run") == [2, 4]
    stage = tmp_path / "pod-b"
    last, logs = train_url(tiny(cfg6.corpus, "max_steps=6", "keep_checkpoints=2"), url, stage)
    pulled = [line.split()[2] for line in logs if line.startswith("pulling step ")]
    assert pulled == ["4"], logs
    assert f"note: step 2 left in {url} (not pulled): the resume needs step 4 alone" in logs, logs
    assert f"resumed {stage} at step 4, lane offset {4 * cfg6.seq_len}" in logs, logs
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [4, 6] and stage_steps(stage) == [6]
    assert not s3.keys(bucket, "run/checkpoints/2/") and not s3.keys(bucket, "run/rejected/")


def test_a_new_pod_hashes_the_step_it_pulls_once(s3, bucket, corpus_file, tmp_path, monkeypatch, capsys):
    """The pull checks the step's files against their checksums, and the resume trusts that
    check (the stage is locked between them): each file of the step is read once to hash it."""
    url = f"s3://{bucket}/run"
    common = ["--config", "tiny", "--workdir", url, "--set", f"corpus={corpus_file}", "--set", "save_every=2",
              "--no-progress"]
    assert train_cli([*common, "--stage", str(tmp_path / "a"), "--set", "max_steps=2"]) == 0
    hashed = collections.Counter()
    real = ckpt_lib._file_sha256

    def counted(path):
        hashed[Path(path)] += 1
        return real(path)

    monkeypatch.setattr(ckpt_lib, "_file_sha256", counted)
    assert train_cli([*common, "--stage", str(tmp_path / "b"), "--set", "max_steps=4"]) == 0
    assert "resumed " in capsys.readouterr().err
    step_2 = tmp_path / "b" / "checkpoints" / "2"   # pulled, then dropped from the stage once step 4 was saved
    files = {step_2 / n for n in json.loads(s3.read(bucket, "run/checkpoints/2/committed.json"))["files"]
             if "/" in n}   # the items' files
    assert files and {p: hashed[p] for p in files} == {p: 1 for p in files}


@pytest.mark.parametrize("store_down", [False, True])
def test_a_resume_that_rejects_the_pulled_step_fetches_the_older_ones(store_down, s3, bucket, straight, tmp_path,
                                                                      monkeypatch):
    """Step 4 verifies (checksums, finite flags) but does not restore: the resume fetches the
    step 2 the pull left in the store, falls back to it, moves the store's step 4 aside, and
    ends equal to a run never interrupted. store_down: the store stops as step 2's files are
    fetched, back once the fetch has said so; it is tried again."""
    cfg6, straight_dir = straight
    url = f"s3://{bucket}/run"
    train_url(tiny(cfg6.corpus, "max_steps=4"), url, tmp_path / "pod-a")
    watch = None
    if store_down:
        _, _, _, relay = behind_a_relay((s3, url), monkeypatch, waits=(0.5,), tries_seconds=300.0)
        watch = down_until_said(relay, monkeypatch, "get", 2, f"warning: the fetch of step 2 of {url} failed (")
    real = ckpt_lib.RunCheckpointer.restore

    def step_4_fails(self, abstract_state, step=None, items=("params", "opt_state", "extra")):
        if step == 4:
            raise OSError("a damaged file the checksums did not catch")
        return real(self, abstract_state, step, items)

    monkeypatch.setattr(ckpt_lib.RunCheckpointer, "restore", step_4_fails)
    stage = tmp_path / "pod-b"
    last, logs = ended(600, lambda: train_url(cfg6, url, stage, watch=watch))
    pulled = [line.split()[2] for line in logs if line.startswith("pulling step ")]
    assert pulled == (["4", "2", "2"] if store_down else ["4", "2"]), logs
    said = [line for line in logs if line.startswith("warning: the fetch")]
    assert len(said) == int(store_down), logs
    assert ("warning: step 4: could not be restored; falling back to step 2 (OSError: a damaged file the "
            "checksums did not catch)") in logs, logs
    assert f"resumed {stage} at step 2, lane offset {2 * cfg6.seq_len}" in logs, logs
    assert f"note: moved the rejected {url}/checkpoints/4 to {url}/rejected/4" in logs, logs
    assert_same_state(straight_dir, stage, cfg6)
    assert store_steps(s3, bucket, "run") == [2, 4, 6] and stage_steps(stage) == [6]


def test_the_commands_train_on_a_url_resume_it_and_read_it(served, corpus_file, tmp_path, capsys, monkeypatch):
    """`python -m fractus_jax.train --workdir s3://...` (or gs://...): the stage is the store's,
    and a second pod's stage, pulled, resumes where the first stopped. eval, generate and
    convert export read the URL (a run, a step, --step) as they read the stage, and grow grows
    it; a step the store does not commit is refused."""
    s3, url = served   # either kind of store
    bucket = url.split("/")[2]
    common = ["--config", "tiny", "--workdir", url, "--set", f"corpus={corpus_file}", "--set", "save_every=2",
              "--no-progress"]
    assert train_cli([*common, "--stage", str(tmp_path / "a"), "--set", "max_steps=4"]) == 0
    err = capsys.readouterr().err
    assert f"run directory: {url} (trained in {tmp_path / 'a'})" in err
    assert f"  last checkpoint: step 4 ({url}/checkpoints/4)\n" in err   # the store's, not the stage's copy
    assert f"  metrics: {url}/metrics.jsonl (the stage's copy: {tmp_path / 'a' / 'metrics.jsonl'})\n" in err
    assert train_cli([*common, "--stage", str(tmp_path / "b"), "--set", "max_steps=6"]) == 0
    err = capsys.readouterr().err
    assert "pulling step 4 " in err and f"resumed {tmp_path / 'b'} at step 4" in err, err
    assert strict(s3.read(bucket, "run/manifest.json").decode())["step"] == 6
    with pytest.raises(SystemExit):
        parse_args(["--config", "tiny", "--workdir", str(tmp_path / "local"), "--stage", str(tmp_path / "x")])

    # The reading commands read the URL (fetched into the read cache) as they read the stage.
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    stage = tmp_path / "b"   # holds step 6, the step it saved last; pod A's stage, step 4
    scores = {}
    for argv, staged in ((["--ids", "512", "--json"], stage), (["--step", "4", "--ids", "512", "--json"], tmp_path / "a")):
        argv = [*argv, "--corpus", str(corpus_file)]
        assert eval_cli(["--ckpt", url, *argv, "--no-progress"]) == 0
        from_url = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        scores[from_url["step"]] = from_url["nats"]
        assert eval_cli(["--ckpt", str(staged), *argv, "--no-progress"]) == 0
        from_stage = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert from_url["step"] == from_stage["step"] == (4 if "--step" in argv else 6)
        assert from_url["nats"] == from_stage["nats"] and from_url["n_ids"] == from_stage["n_ids"] > 0
        assert from_url["ckpt"] == url and from_stage["ckpt"] == str(staged)   # named as given, not the cache
    # a weights file of the cache's step 6 damaged on this disk (its size kept): fetched again
    cached = next((tmp_path / "cache" / "read").rglob(rundir.CHECKPOINTS))
    weights = max((p for p in (cached / "6" / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert eval_cli(["--ckpt", url, "--step", "6", "--ids", "512", "--json", "--corpus", str(corpus_file),
                     "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "is not the one committed (params failed its checksum" in out.err and "pulling step 6" in out.err, out.err
    assert json.loads(out.out.strip().splitlines()[-1])["nats"] == scores[6]
    gen = ["--prompt", "def main(", "--max-new", "8", "--json"]
    assert generate_cli(["--ckpt", f"{url}/checkpoints/4", *gen]) == 0
    from_url = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate_cli(["--ckpt", str(tmp_path / "a" / "checkpoints" / "4"), *gen]) == 0
    from_stage = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for timing in ("ms_per_id", "seconds", "ids_per_s"):
        from_url.pop(timing, None), from_stage.pop(timing, None)
    assert from_url == from_stage
    assert generate_cli(["--ckpt", str(stage), *gen]) == 0   # step 6: another step's weights
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["confidence"] != from_url["confidence"]
    assert convert_cli(["export", "--ckpt", url, "--out", str(tmp_path / "from-url.pt")]) == 0
    assert convert_cli(["export", "--ckpt", str(stage), "--out", str(tmp_path / "from-stage.pt")]) == 0
    a, b = (torch.load(tmp_path / f"from-{w}.pt", weights_only=True) for w in ("url", "stage"))
    assert a.keys() == b.keys() and a["step"] == b["step"] == 6
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in b["model_state"])
    # those read the weights alone: the moments stayed in the store
    items = lambda step: {p.name for p in (cached / str(step)).iterdir() if p.is_dir()}  # noqa: E731
    assert items(4) == items(6) == set(ckpt_lib.WEIGHTS_ITEMS)
    assert {p.name for p in (stage / "checkpoints" / "6").iterdir() if p.is_dir()} == set(ckpt_lib.ITEMS)
    capsys.readouterr()
    assert grow_cli(["--ckpt", url, "--out", str(tmp_path / "grown"), "--add-layers", "1",
                     "--corpus", str(corpus_file)]) == 0
    assert strict((tmp_path / "grown" / "manifest.json").read_text())["step"] == 6
    # grow reads the moments too: the rest of step 6 fetched, the files held kept (the weights'
    # items' and the step's own, such as its checksums)
    held = [p.relative_to(stage / "checkpoints" / "6").parts for p in (stage / "checkpoints" / "6").rglob("*")
            if p.is_file()]
    kept = sum(1 for parts in held if len(parts) == 1 or parts[0] in ckpt_lib.WEIGHTS_ITEMS)
    assert 0 < kept < len(held)
    assert f"; {kept} of its files are here already" in capsys.readouterr().err
    assert items(6) == set(ckpt_lib.ITEMS)
    assert store.store_steps(store.Store(url))[6]["files"] == {
        str(p.relative_to(cached / "6")): p.stat().st_size for p in (cached / "6").rglob("*") if p.is_file()}
    capsys.readouterr()
    # a reader given the stage and a step it no longer holds is sent to the store
    sent = f"{stage} is the stage of {url}, which holds the run's older steps: --ckpt {url} --step 4"
    assert eval_cli(["--ckpt", str(stage), "--step", "4", "--corpus", str(corpus_file), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {stage} has no checkpoint at step 4 (steps: [6]); {sent}"
    with pytest.raises(SystemExit) as e:
        generate_cli(["--ckpt", str(stage / "checkpoints" / "4"), *gen])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(f"/checkpoints/4; {sent}")
    assert convert_cli(["export", "--ckpt", str(stage / "checkpoints" / "4"), "--out", str(tmp_path / "x.pt")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"no such run directory or checkpoint; {sent}")
    assert eval_cli(["--ckpt", f"{url}/checkpoints/5", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {url} has no committed checkpoint at step 5 "
                                                "(steps: [2, 4, 6])")


def test_a_fresh_run_starts_from_the_weights_of_a_run_on_a_url(bucket, corpus_file, tmp_path, monkeypatch, capsys):
    """init_from=s3://.../checkpoints/N: the step's weights fetched into the read cache (its
    moments left in the store), and the new run equal, bit for bit, to one started from that
    step on disk; a corpus given as a URL is refused before anything is written."""
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    url = f"s3://{bucket}/run"
    train_url(tiny(corpus_file, "max_steps=2", "save_every=2"), url, tmp_path / "source")
    common = ["--config", "tiny", "--set", f"corpus={corpus_file}", "--set", "max_steps=1", "--set", "save_every=1",
              "--no-progress"]
    capsys.readouterr()
    assert train_cli([*common, "--workdir", str(tmp_path / "a"), "--set", f"init_from={url}/checkpoints/2"]) == 0
    err = capsys.readouterr().err
    assert "pulling step 2 " in err and f"weights from {url}/checkpoints/2; fresh optimizer moments" in err, err
    cached = next((tmp_path / "cache" / "read").rglob(rundir.CHECKPOINTS)) / "2"
    assert {p.name for p in cached.iterdir() if p.is_dir()} == set(ckpt_lib.WEIGHTS_ITEMS)
    source = tmp_path / "source" / rundir.CHECKPOINTS / "2"
    assert train_cli([*common, "--workdir", str(tmp_path / "b"), "--set", f"init_from={source}"]) == 0
    assert_same_state(tmp_path / "a", tmp_path / "b", tiny(corpus_file, "max_steps=1"))
    capsys.readouterr()
    assert train_cli([*common[:2], "--workdir", str(tmp_path / "c"), "--set", f"corpus={url}/held.u16",
                      "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {url}/held.u16: a s3:// URL; a corpus is read from this "
                                                "machine's disk (or a filesystem mounted on every host): copy it "
                                                "here first and give its path")
    assert not (tmp_path / "c").exists()


def test_grow_and_import_write_a_new_run_to_a_url(served, straight, corpus_file, tmp_path, monkeypatch, capsys):
    """grow --out and convert import --out take a URL that holds no run: the new run is
    committed in the store, reads as the same run written locally, and trains on from there."""
    cfg6, straight_dir = straight
    s3, url = served   # either kind of store
    bucket, base = url.split("/")[2], url.rsplit("/", 1)[0]
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    grown = f"{base}/grown"
    grow = ["--ckpt", str(straight_dir), "--add-layers", "1", "--corpus", str(corpus_file)]
    assert grow_cli([*grow, "--out", grown]) == 0
    assert grow_cli([*grow, "--out", str(tmp_path / "grown")]) == 0
    assert store_steps(s3, bucket, "grown") == [6]
    score = ["--ids", "512", "--json", "--no-progress", "--corpus", str(corpus_file)]
    capsys.readouterr()
    figures = []
    for ckpt in (grown, str(tmp_path / "grown")):
        assert eval_cli(["--ckpt", ckpt, *score]) == 0
        figures.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["nats"])
    assert figures[0] == figures[1]
    assert grow_cli([*grow, "--out", grown]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{grown} holds a run already (step 6): give a new path")

    pt = tmp_path / "run.pt"
    assert convert_cli(["export", "--ckpt", str(straight_dir), "--out", str(pt), "--opt"]) == 0
    imported = f"{base}/imported"
    assert convert_cli(["import", "--pt", str(pt), "--out", imported, "--config", "tiny",
                        "--set", f"corpus={corpus_file}", "--set", "save_every=2"]) == 0
    assert store_steps(s3, bucket, "imported") == [6]
    capsys.readouterr()
    assert train_cli(["--config", "tiny", "--workdir", imported, "--stage", str(tmp_path / "stage"),
                      "--set", f"corpus={corpus_file}", "--set", "save_every=2", "--set", "max_steps=8",
                      "--no-progress"]) == 0
    assert f"resumed {tmp_path / 'stage'} at step 6" in capsys.readouterr().err
    assert store_steps(s3, bucket, "imported")[-1] == 8
