"""The run directory's own files (fractus_jax/train/rundir.py): lock, leftovers, manifest
repair, metrics log. Plain files, no JAX: each test runs in milliseconds."""
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fractus_jax.train import rundir
from fractus_jax.train.__main__ import main as train_cli

ROOT = Path(__file__).resolve().parents[1]


def strict(text):
    """json.loads that refuses NaN and Infinity, as every JSON reader but Python's does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def lines(records):
    return "".join(json.dumps(r) + "\n" for r in records)


def test_the_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    first = rundir.RunLock(tmp_path).acquire()
    try:
        with pytest.raises(rundir.RunDirBusy, match=f"{tmp_path} is in use by pid {os.getpid()}"):
            rundir.RunLock(tmp_path).acquire()   # another open file: flock refuses it even here
    finally:
        first.release()
    rundir.RunLock(tmp_path).acquire().release()   # free again


def test_the_kernel_releases_the_lock_of_a_killed_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from fractus_jax.train import rundir
            rundir.RunLock({str(tmp_path)!r}).acquire()
            print("held", flush=True)
            time.sleep(120)
        """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(rundir.RunDirBusy, match=f"in use by pid {holder.pid}"):
            rundir.RunLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    rundir.RunLock(tmp_path).acquire().release()   # no stale lock after kill -9


def test_leftovers_of_interrupted_writes_are_removed(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "4").mkdir(parents=True)
    (ck / "4" / "checksums.json.tmp").write_text("{")
    (ck / "6.orbax-checkpoint-tmp-1712345678" / "params").mkdir(parents=True)
    (ck / "6.orbax-checkpoint-tmp-1712345678" / "params" / "d").write_bytes(b"x" * 10)
    (tmp_path / "manifest.json.tmp").write_text("{")
    (tmp_path / "metrics.jsonl.tmp").write_text("")
    notes = []
    removed = rundir.remove_leftovers(tmp_path, notes.append)
    assert len(removed) == 4 and len(notes) == 4
    assert sorted(p.name for p in ck.iterdir()) == ["4"] and list((ck / "4").iterdir()) == []
    assert not (tmp_path / "manifest.json.tmp").exists() and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert rundir.remove_leftovers(tmp_path, notes.append) == []


def test_torn_metrics_lines_are_dropped_with_a_warning_and_the_rewrite_is_clean(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines([{"step": 1}, {"step": 2}]) + '{"step": 3, "ce_t\n' + lines([{"step": 3}, {"step": 4}])
                    + '{"step": 5, "ce')   # a write cut short, twice
    logs = []
    rundir.truncate_metrics(path, 3, logs.append)
    assert [strict(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert path.read_text().endswith("\n")
    assert len(logs) == 1 and logs[0].startswith("warning: ") and "dropped 2 lines" in logs[0] and "line 3, 6" in logs[0]
    before = path.stat().st_mtime_ns
    rundir.truncate_metrics(path, 3, logs.append)   # nothing to change: not rewritten
    assert path.stat().st_mtime_ns == before and len(logs) == 1


def test_copy_metrics_takes_the_history_up_to_a_step(tmp_path):
    src, dst = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    src.write_text(lines([{"step": 1}, {"step": 2}]) + "garbage\n" + lines([{"step": 3}]))
    logs = []
    rundir.copy_metrics(src, dst, 2, logs.append)
    assert [strict(x)["step"] for x in dst.read_text().splitlines()] == [1, 2] and "dropped 1 line" in logs[0]


def test_a_fresh_run_sets_an_older_log_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines([{"step": 1}, {"step": 2}]))
    logs = []
    log = rundir.MetricsLog(path, None, logs.append)
    log.write({"step": 1, "ce_tf": float("nan"), "x": [float("inf"), 1.0]})
    log.close()
    assert [strict(x) for x in path.read_text().splitlines()] == [{"step": 1, "ce_tf": None, "x": [None, 1.0]}]
    old = list(tmp_path.glob("metrics.old-*.jsonl"))
    assert len(old) == 1 and old[0].read_text() == lines([{"step": 1}, {"step": 2}])
    assert "moved it to" in logs[0] and old[0].name in logs[0]


def test_the_manifest_is_repaired_from_the_resumed_steps_meta(tmp_path):
    meta = {"step": 4, "start_token_next": 64, "ema_tf": float("nan")}
    logs = []
    assert rundir.repair_manifest(tmp_path, meta, logs.append)   # missing
    manifest = strict((tmp_path / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["checkpoint"] == "checkpoints/4" and manifest["ema_tf"] is None
    assert "it was missing" in logs[-1]
    assert not rundir.repair_manifest(tmp_path, meta, logs.append)   # names the step: kept
    rundir.write_manifest(tmp_path, dict(meta, step=2))
    assert rundir.repair_manifest(tmp_path, meta, logs.append) and "named step 2" in logs[-1]
    (tmp_path / "manifest.json").write_text('{"step": 4, "ema')   # damaged
    assert rundir.repair_manifest(tmp_path, meta, logs.append) and "damaged" in logs[-1]
    assert strict((tmp_path / "manifest.json").read_text())["step"] == 4


def test_rejected_steps_are_moved_aside_not_deleted(tmp_path):
    for step in (2, 4):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
        (tmp_path / "checkpoints" / str(step) / "x").write_text(str(step))
    (tmp_path / "rejected" / "4").mkdir(parents=True)   # an earlier rejection of the same step
    logs = []
    moved = rundir.set_aside_steps(tmp_path, [4], logs.append)
    assert moved == [tmp_path / "rejected" / "4-2"] and (moved[0] / "x").read_text() == "4"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_io_errors_name_the_path_and_the_last_good_step(tmp_path):
    err = rundir.io_error("cannot write", tmp_path / "metrics.jsonl", OSError(28, os.strerror(28)), 6)
    assert str(err) == (f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device (ENOSPC); "
                        "the last good checkpoint is step 6 (the same command resumes from it)")
    assert isinstance(err, rundir.CheckpointError)
    long = rundir.reason(ValueError("first line\n" + "x" * 1000))
    assert long == "ValueError: first line"


# ----------------------------------------------------------------------------- TensorBoard event files

def test_the_scalars_of_a_record_are_its_finite_numbers_and_flat_lists():
    from fractus_jax.train.tboard import scalars
    record = {"step": 7, "ce_tf": 2.5, "lr": 1e-3, "skipped": 0.0, "ce_ss": float("nan"), "ema_ss": None,
              "lb_per_block": [0.5, 0.25], "alive_experts": [4, 3], "expert_hits": [[1, 2], [3, 4]],
              "speech_text": "def main(", "speech_unique_ids": 12}
    assert scalars(record) == {"ce_tf": 2.5, "lr": float(np.float32(1e-3)), "skipped": 0.0, "lb_per_block/0": 0.5,
                               "lb_per_block/1": 0.25, "alive_experts/0": 4.0, "alive_experts/1": 3.0,
                               "speech_unique_ids": 12.0}


def test_a_resume_cuts_the_event_files_to_the_log_and_writes_what_they_lack(tmp_path):
    """Steps past the resumed one and a torn write are cut; records the files lack are written
    again; the new life's file sorts last and opens with TensorBoard's purge_step."""
    from tensorboard_testing import curves, read_event_files
    from fractus_jax.train import tboard

    d = tmp_path / "tensorboard"
    records = [{"step": s, "ce": 5.0 - s, "probe": [s, 2 * s]} for s in range(1, 9)]
    log = tboard.TensorBoardLog(d, None, [], print)
    for r in records[:6]:
        log.write(r)
    log.close()
    first = log.path
    with open(first, "ab") as f:
        f.write(b"\x30\x00\x00")   # a record cut short by a kill
    log = tboard.TensorBoardLog(d, 4, records[:4], print)   # fell back to step 4
    for r in records[4:6]:
        log.write(r)
    log.close()
    assert curves(d)["ce"] == [(s, 5.0 - s) for s in range(1, 7)] and curves(d)["probe/1"][-1] == (6, 12.0)
    (a, old), (b, new) = read_event_files(d)
    assert (a, b) == (first.name, log.path.name) and a < b
    assert [e.step for e in old if e.summary.value] == [1, 2, 3, 4]
    assert new[1].session_log.status == new[1].session_log.START and new[1].step == 5
    # the files lost (a grown run's copy of the log, a life with tensorboard=false): all written again
    for p in d.iterdir():
        p.unlink()
    log = tboard.TensorBoardLog(d, 8, records, print)
    log.close()
    assert curves(d)["ce"] == [(s, 5.0 - s) for s in range(1, 9)]
    # nothing to change: the files stay as they are, the new one adds only its header
    sizes = {p.name: p.stat().st_size for p in d.iterdir()}
    log = tboard.TensorBoardLog(d, 8, records, print)
    log.close()
    assert {p.name: p.stat().st_size for p in d.iterdir() if p.name in sizes} == sizes
    assert curves(d)["ce"] == [(s, 5.0 - s) for s in range(1, 9)]


def test_tensorboard_false_writes_no_event_files(tmp_path):
    rd = rundir.RunDir(tmp_path, tensorboard=False, log=print).open()
    rd.start_metrics(None)
    rd.write_metrics({"step": 1, "ce": 1.0})
    rd.close()
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").exists()


def test_the_event_records_are_tensorboards_protobufs_byte_for_byte():
    """The hand-written encoding of each kind of event a run writes equals protobuf's own
    (tensorboardX's generated Event), decodes back, and the record checksum equals
    tensorboardX's masked CRC-32C."""
    import random

    from tensorboardX.proto.event_pb2 import Event as PbEvent
    from tensorboardX.record_writer import masked_crc32c

    from fractus_jax.train import tboard

    rng = random.Random(0)
    for n in (0, 1, 3, 4, 7, 8, 9, 64, 255, 1000):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert tboard.masked_crc32c(data) == masked_crc32c(data), n
    f32 = lambda x: float(np.float32(x))   # noqa: E731 - a scalar as the files hold it
    events = [tboard.Event(wall_time=1.7e9 + 0.25, file_version=tboard.FILE_VERSION),
              tboard.Event(wall_time=1.7e9, step=5, run_status=tboard.START),
              tboard.Event(wall_time=1.7e9, step=2**40 + 3,
                           summary={"ce_tf": 2.5, "skipped": 0.0, "lb_per_block/0": f32(-1.25e-7), "é": 3.0}),
              tboard.Event(wall_time=1.7e9, step=-3, summary={})]
    for e in events:
        pb = PbEvent(wall_time=e.wall_time, step=e.step)
        if e.file_version is not None:
            pb.file_version = e.file_version
        if e.run_status is not None:   # Event's field 7, as tboard writes it
            getattr(pb, PbEvent.DESCRIPTOR.fields_by_number[7].name).status = e.run_status
        if e.summary is not None:
            pb.summary.SetInParent()
            for tag, v in e.summary.items():
                pb.summary.value.add(tag=tag, simple_value=v)
        assert e.encode() == pb.SerializeToString(), e
        assert tboard.Event.decode(pb.SerializeToString()) == e
    with pytest.raises(ValueError):
        tboard.Event.decode(events[2].encode()[:-3])   # cut short: the reader stops there


@pytest.mark.parametrize("command, argv", [
    ("train", ["--config", "tiny", "--workdir", "az://runs/tiny"]),
    ("train", ["--config", "tiny", "--workdir", "ftp://runs/tiny"]),
    ("eval", ["--ckpt", "az://bucket/run"]),
    ("generate", ["--ckpt", "az://runs/tiny", "--prompt", "a"]),
    ("grow", ["--ckpt", "runs/tiny", "--out", "az://runs/grown", "--add-layers", "1"]),
    ("convert", ["export", "--ckpt", "ftp://runs/tiny", "--out", "model.pt"]),
    ("convert", ["import", "--pt", "model.pt", "--config", "tiny", "--out", "ftp://runs/imported"]),
    ("convert", ["export", "--ckpt", "runs/tiny", "--out", "s3://runs/model.pt"]),
    ("convert", ["import", "--pt", "s3://runs/model.pt", "--config", "tiny", "--out", "imported"]),
    ("convert", ["import", "--pt", "model.pt", "--opt", "gs://runs/model.opt", "--config", "tiny", "--out", "x"]),
    ("eval", ["--ckpt", "runs/tiny", "--corpus", "s3://data/held.u16"]),
    ("grow", ["--ckpt", "runs/tiny", "--out", "grown", "--add-layers", "1", "--corpus", "gs://data/c.u16"]),
    ("atom", ["build", "--src", "s3://data/text", "--out", "c.u16"]),
    ("atom", ["build", "--src", "text", "--out", "gs://data/c.u16"]),
    ("atom", ["validate", "s3://data/c.u16"]),
    ("atom", ["stats", "s3://data/c.u16"]),
    ("atom", ["decode", "s3://data/c.u16"]),
    ("bench", ["store", "--url", "s3://b/p", "--stage", "gs://b/stage"]),
    ("bench", ["lanes", "--dir", "s3://b/corpora"]),
])
def test_an_object_storage_url_is_refused_not_taken_as_a_local_path(command, argv, tmp_path, monkeypatch, capsys):
    """A run directory given as a URL a command does not serve (s3:// and gs:// are served where
    a run is read or trained, tests/test_store.py) is refused at start (exit 2, the URL named), and no local directory
    named after it ("s3:/runs/tiny") appears."""
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"fractus_jax.{command}.__main__" if command != "generate"
                                   else "fractus_jax.generate").main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("URL" in err or "not served" in err) and "://" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/4", "checkpoints/4/params"])
def test_a_run_inside_another_runs_checkpoints_is_refused_before_anything_is_written(inside, tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    run = rundir.RunDir(tmp_path / "a").open()   # a run that has started: its lock
    run.close(quiet=True)
    (tmp_path / "a" / "checkpoints" / "4").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert train_cli(["--config", "tiny", "--workdir", f"a/{inside}", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: a/{inside} lies in the checkpoints directory of the run {tmp_path / 'a'}: a run directory there "
        f"would write among that run's steps; give a path outside {tmp_path / 'a' / 'checkpoints'}"]
    with pytest.raises(rundir.CheckpointError, match="lies in the checkpoints directory"):   # grow's, import's --out
        rundir.RunDir(tmp_path / "a" / inside).open()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # control: a directory named checkpoints elsewhere, or beside the run's, is a run of its own
    for other in ("b/checkpoints", "a/checkpoints-b"):
        rundir.RunDir(tmp_path / other).open().close(quiet=True)
