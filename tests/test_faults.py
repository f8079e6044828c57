"""Faults a living run meets, each reproduced and its outcome shown: a kill at every phase of
a save, damaged checkpoints, a torn metrics log, a second writer, a full disk, a diverged run.

Two tiny runs are trained once (save_every=2): `straight` to step 6, `split` to step 4. Each
fault is applied to a copy of `split` (the state a kill leaves is written as the kill leaves
it, so the phase is exact), the same command resumes it to step 6, and the result must equal
`straight` bit for bit: the weights, the moments, the carry, and a metrics log of steps 1-6.
"""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from fractus_jax.convert.__main__ import main as convert_cli
from fractus_jax.generate import main as generate_cli
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop, rundir
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train.__main__ import main as train_cli
from fractus_jax.train.errors import StalledError
from fractus_jax.train.watch import SkipWatch

from tensorboard_testing import assert_curves_are_the_log, read_event_files

ROOT = Path(__file__).resolve().parents[1]


def tiny(corpus_file, *overrides):
    cfg = cfg_lib.load_config("tiny")
    return cfg_lib.apply_overrides(cfg, [f"corpus={corpus_file}", "save_every=2", *overrides])


def train(cfg, workdir):
    """(last metrics, log lines) of the trainer on workdir, in this process."""
    logs = []
    last = loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=logs.append)
    return last, logs


def restore(workdir, cfg, step=None):
    ck = ckpt_lib.RunCheckpointer(workdir, read_only=True)
    try:
        return ck.restore(state_lib.abstract_train_state(cfg), step)
    finally:
        ck.close()


def strict(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def metrics_steps(workdir):
    return [strict(x)["step"] for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def assert_same_state(a_dir, b_dir, cfg):
    a, meta_a = restore(a_dir, cfg)
    b, meta_b = restore(b_dir, cfg)
    assert meta_a["step"] == meta_b["step"] == cfg.max_steps
    assert meta_a["start_token_next"] == meta_b["start_token_next"]
    for part in ("params", "opt_state", "carry"):
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a[part], b[part])


@pytest.fixture(scope="module")
def runs(corpus_file, tmp_path_factory):
    """(cfg to step 6, straight run dir at 6, split run dir at 4 (steps 2 and 4))."""
    base = tmp_path_factory.mktemp("faults")
    cfg6 = tiny(corpus_file, "max_steps=6")
    train(cfg6, base / "straight")
    train(tiny(corpus_file, "max_steps=4"), base / "split")
    # The bit-exact comparisons can fail: two more steps change every part of the state.
    at_4, _ = restore(base / "split", cfg6, 4)
    at_6, _ = restore(base / "straight", cfg6, 6)
    for part in ("params", "opt_state", "carry"):
        diff = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), at_4[part], at_6[part])
        assert any(jax.tree.leaves(diff)), part
    return cfg6, base / "straight", base / "split"


def copy_split(runs, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(runs[2], d)
    return d


def manifest_of_step(d, step):
    _, meta, _ = ckpt_lib.read_step(d, step)
    return rundir.manifest_of(meta)


# ----------------------------------------------------------------------------- kill -9 at each phase of a save

def _kill_before_tmp(d):          # killed before Orbax made the temporary directory of step 4
    manifest = manifest_of_step(d, 2)
    shutil.rmtree(d / "checkpoints" / "4")
    rundir.write_json_atomic(d / "manifest.json", manifest)


def _kill_inside_tmp(d):          # killed while Orbax wrote step 4 into its temporary directory
    manifest = manifest_of_step(d, 2)
    tmp = d / "checkpoints" / "4.orbax-checkpoint-tmp-1712345678"
    os.replace(d / "checkpoints" / "4", tmp)
    (tmp / "checksums.json").unlink()
    shutil.rmtree(tmp / "opt_state")
    victim = max((p for p in (tmp / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    rundir.write_json_atomic(d / "manifest.json", manifest)


def _kill_after_commit(d):        # Orbax committed step 4; killed before its checksums and manifest
    manifest = manifest_of_step(d, 2)
    (d / "checkpoints" / "4" / "checksums.json").unlink()
    rundir.write_json_atomic(d / "manifest.json", manifest)


def _kill_after_checksums(d):     # step 4 committed and checksummed; killed before its manifest
    rundir.write_json_atomic(d / "manifest.json", manifest_of_step(d, 2))


def _manifest_deleted(d):
    (d / "manifest.json").unlink()


def _kill_after_manifest(d):      # the save was complete: steps 5 and 6 were being trained
    pass


@pytest.mark.parametrize("phase, resumed_at", [
    (_kill_before_tmp, 2), (_kill_inside_tmp, 2), (_kill_after_commit, 4), (_kill_after_checksums, 4),
    (_manifest_deleted, 4), (_kill_after_manifest, 4)], ids=lambda x: getattr(x, "__name__", str(x)).strip("_"))
def test_a_kill_at_each_phase_of_a_save_resumes_bit_exact(phase, resumed_at, runs, tmp_path):
    cfg6, straight, _ = runs
    d = copy_split(runs, tmp_path)
    phase(d)
    last, logs = train(cfg6, d)
    assert f"resumed {d} at step {resumed_at}, lane offset {resumed_at * cfg6.seq_len}" in logs, logs
    assert last["step"] == 6
    assert_same_state(straight, d, cfg6)
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    manifest = strict((d / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["checkpoint"] == "checkpoints/6"
    assert not [p for p in (d / "checkpoints").iterdir() if rundir.ORBAX_TMP in p.name]
    if phase is _kill_inside_tmp:
        assert any(line.startswith("note: removed") and "orbax-checkpoint-tmp" in line for line in logs), logs
    if phase is _kill_after_commit:
        assert any("step 4 has no checksums" in line for line in logs), logs
        assert ckpt_lib.check_files(d / "checkpoints" / "4") == ("ok", None)   # recorded once restored
    if phase in (_kill_after_commit, _kill_after_checksums, _manifest_deleted):
        assert any(line.startswith(f"note: repaired {d / 'manifest.json'}") for line in logs), logs


def test_a_step_pulled_in_part_is_checked_in_the_files_it_holds(runs, tmp_path):
    """A process of a multi-process run pulls a step but the chunk files it does not read:
    the files it lacks are not failures, the files it holds are checked as ever."""
    d = copy_split(runs, tmp_path)
    step4 = d / "checkpoints" / "4"
    held = sorted(str(p.relative_to(step4)) for p in (step4 / "params").rglob("*") if p.is_file())
    gone, changed = held[-1], held[-2]
    (step4 / gone).unlink()
    assert ckpt_lib.check_files(step4)[0] == "bad"
    assert ckpt_lib.check_files(step4, absent={gone}) == ("ok", None)
    step, _, rejected, _ = ckpt_lib.newest_good_step(d, absent={4: {gone}})
    assert (step, rejected) == (4, [])
    step, _, rejected, _ = ckpt_lib.newest_good_step(d, absent={2: {gone}})   # another step's files
    assert step == 2 and [s for s, _ in rejected] == [4]
    data = (step4 / changed).read_bytes()
    (step4 / changed).write_bytes(bytes([data[0] ^ 1]) + data[1:])
    assert ckpt_lib.check_files(step4, absent={gone, changed}) == (
        "bad", f"params failed its checksum ({changed[len('params/'):]} differs)")
    assert ckpt_lib.check_some(step4, {changed}) == f"params failed its checksum ({changed[len('params/'):]} differs)"


def test_a_real_kill_9_between_commit_and_manifest(runs, corpus_file, tmp_path):
    """The process dies by SIGKILL right after Orbax committed step 4 (before its checksums
    and manifest); the same command then resumes at step 4, bit-exact."""
    cfg6, straight, _ = runs
    d = tmp_path / "run"
    code = textwrap.dedent(f"""
        import os, signal
        from fractus_jax.train import checkpoint as ckpt_lib, config as cfg_lib, loop, prepare as prepare_lib
        write = ckpt_lib.write_checksums
        def die_at_4(step_dir, finite):
            if step_dir.name == "4":
                os.kill(os.getpid(), signal.SIGKILL)
            write(step_dir, finite)
        ckpt_lib.write_checksums = die_at_4
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"),
                                      ["corpus={corpus_file}", "save_every=2", "max_steps=4"])
        loop.run(prepare_lib.prepare(cfg, {str(d)!r}, progress=False), progress=False, log=print)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert (d / "checkpoints" / "4").is_dir() and not (d / "checkpoints" / "4" / "checksums.json").exists()
    assert strict((d / "manifest.json").read_text())["step"] == 2   # the manifest lags
    last, logs = train(cfg6, d)
    assert f"resumed {d} at step 4, lane offset {4 * cfg6.seq_len}" in logs, logs
    assert_same_state(straight, d, cfg6)
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]


# ----------------------------------------------------------------------------- damaged checkpoints

def _largest(d):
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_params(d):
    f = _largest(d / "checkpoints" / "4" / "params")
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    f.write_bytes(bytes(data))


def _truncate_opt_state(d):
    f = _largest(d / "checkpoints" / "4" / "opt_state")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty_meta(d):
    (d / "checkpoints" / "4" / "meta" / "metadata").write_text("")


def _nan_params_no_checksums(d, cfg):
    """A step 4 whose params hold a NaN, with no checksums (as an older run's): only the
    finite check of the restored arrays can catch it."""
    state, meta = restore(d, cfg, 4)
    shutil.rmtree(d / "checkpoints" / "4")
    state = dict(state, params={**state["params"], "observe": state["params"]["observe"].at[3, 0].set(np.nan)})
    logs = []
    ck = ckpt_lib.RunCheckpointer(d, log=logs.append)
    ck.save(state, meta)
    ck.close()
    assert "step 4: params holds NaN or Inf (observe)" in logs[0]
    assert strict((d / "checkpoints" / "4" / "checksums.json").read_text())["finite"]["params"] is False
    assert strict((d / "manifest.json").read_text())["step"] == 4   # written before: the test's own copy
    (d / "checkpoints" / "4" / "checksums.json").unlink()


@pytest.mark.parametrize("damage, warning", [
    (_flip_params, "warning: step 4: params failed its checksum"),
    (_truncate_opt_state, "warning: step 4: opt_state failed its checksum"),
    (_empty_meta, "warning: step 4: meta failed its checksum"),
    (_nan_params_no_checksums, "warning: step 4: params holds NaN or Inf"),
], ids=lambda x: getattr(x, "__name__", "").strip("_"))
def test_a_damaged_newest_step_falls_back_to_the_previous_one(damage, warning, runs, tmp_path):
    cfg6, straight, _ = runs
    d = copy_split(runs, tmp_path)
    damage(d, cfg6) if damage is _nan_params_no_checksums else damage(d)
    last, logs = train(cfg6, d)
    assert any(line.startswith(f"{warning}; falling back to step 2") for line in logs), logs
    if damage is _nan_params_no_checksums:
        assert "warning: step 4: params holds NaN or Inf; falling back to step 2 (observe)" in logs
    assert f"resumed {d} at step 2, lane offset {2 * cfg6.seq_len}" in logs
    assert (d / "rejected" / "4").is_dir()   # kept for inspection, out of the way
    assert_same_state(straight, d, cfg6)      # steps 3 and 4 trained again, identically
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    assert strict((d / "manifest.json").read_text())["step"] == 6
    # TensorBoard's curves: steps 3 and 4 of the first life cut, once each from the second
    steps = assert_curves_are_the_log(d)
    assert steps["ce_tf"] == steps["grad_norm"] == [1, 2, 3, 4, 5, 6]
    (_, first), (_, second) = read_event_files(d / "tensorboard")
    assert [e.step for e in first if e.summary.value] == [1, 2]
    assert second[1].session_log.status == second[1].session_log.START and second[1].step == 3   # purge_step


def test_generate_and_export_skip_a_damaged_newest_step(runs, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    d = copy_split(runs, tmp_path)
    _flip_params(d)
    step, _, _ = ckpt_lib.read_step(d)
    assert step == 2 and "warning: step 4: params failed its checksum; falling back to step 2" in capsys.readouterr().err
    with pytest.raises(rundir.CheckpointError, match="step 4: params failed its checksum"):
        ckpt_lib.load_for_inference(d, step=4)
    # the commands, given the run directory, use step 2: what they print and write is step 2's
    outs = {}
    for name, ckpt in (("run", d), ("step2", d / "checkpoints" / "2")):
        assert generate_cli(["--ckpt", str(ckpt), "--prompt", "def f(", "--max-new", "6", "--json"]) == 0
        out, err = capsys.readouterr()
        outs[name] = json.loads(out.strip().splitlines()[-1])
        if name == "run":
            assert "warning: step 4: params failed its checksum; falling back to step 2" in err, err
        assert convert_cli(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / f"{name}.pt")]) == 0
        capsys.readouterr()
    assert outs["run"]["ids"] == outs["step2"]["ids"]
    a, b = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("run", "step2"))
    assert a["step"] == b["step"] == 2
    assert a["model_state"].keys() == b["model_state"].keys()
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in a["model_state"])


def test_a_reader_of_the_weights_checks_the_items_it_reads(runs, tmp_path, capsys):
    """Step 4's moments damaged: a reader of the weights alone (eval, generate, an export
    without --opt) takes step 4, whose weights pass their checksums; one that reads the
    moments falls back to step 2, and refuses step 4 when it is named."""
    d = copy_split(runs, tmp_path)
    _truncate_opt_state(d)
    assert ckpt_lib.read_step(d, items=ckpt_lib.WEIGHTS_ITEMS)[0] == 4
    assert "warning" not in capsys.readouterr().err
    assert ckpt_lib.read_step(d)[0] == 2
    assert "warning: step 4: opt_state failed its checksum; falling back to step 2" in capsys.readouterr().err
    with pytest.raises(rundir.CheckpointError, match="step 4: opt_state failed its checksum"):
        ckpt_lib.read_step(d, 4)
    params, _ = ckpt_lib.load_for_inference(d)
    want = restore(runs[2], runs[0], 4)[0]["params"]   # the run before the damage
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(want))


def test_retention_keeps_the_newest_good_step(runs, tmp_path):
    """keep_checkpoints=2, then two saves whose weights are not finite: Orbax's own retention
    would have deleted the last good step; it stays until a newer good one is saved."""
    cfg6, _, split = runs
    state, meta = restore(split, cfg6, 4)
    bad = dict(state, params={**state["params"], "observe": state["params"]["observe"] * np.nan})
    logs = []
    ck = ckpt_lib.RunCheckpointer(tmp_path / "run", keep=2, log=logs.append)
    try:
        ck.save(state, dict(meta, step=1))
        ck.save(bad, dict(meta, step=2))
        ck.save(bad, dict(meta, step=3))
        assert sorted(ck.manager.all_steps()) == [1, 2, 3] and ck.last_good == 1
        assert strict((tmp_path / "run" / "manifest.json").read_text())["step"] == 1
        ck.save(state, dict(meta, step=4))
        assert sorted(ck.manager.all_steps()) == [3, 4] and ck.last_good == 4
    finally:
        ck.close()
    assert sum("holds NaN or Inf" in line for line in logs) == 2


def test_a_disk_without_room_for_the_saves_is_warned_of_at_the_start(runs, tmp_path, monkeypatch):
    """The saves to come fill the step being written and the steps kept beside it (the newest
    keep_checkpoints, less those held; a stage, the step saved last): a disk with less room
    is named at the start, by the trainer too, with the bytes free and needed."""
    cfg6, _, split = runs
    state, meta = restore(split, cfg6, 4)
    step_bytes = ckpt_lib.save_bytes(state)[1]
    free = {"bytes": 0}
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=free["bytes"]))

    def warned(workdir, mirror=None, saved=0):
        logs = []
        ck = ckpt_lib.RunCheckpointer(workdir, keep=2, log=logs.append, mirror=mirror)
        try:
            for step in range(1, saved + 1):
                ck.save(state, dict(meta, step=step))
            ck.expect(state)
        finally:
            ck.close()
        return [line for line in logs if line.startswith("warning: ")]

    free["bytes"] = 3 * step_bytes - 1   # keep_checkpoints=2, and the one being written
    assert warned(tmp_path / "a") == [
        f"warning: {tmp_path / 'a'}'s disk has {free['bytes'] / 1e9:.1f} GB free, and this run's saves may fill "
        f"{3 * step_bytes / 1e9:.1f} GB more there (3 more steps of about {step_bytes / 1e9:.1f} GB: "
        "keep_checkpoints=2, and a save writes the next beside it); a save that finds the disk full stops the "
        "run, its last good step kept"]
    free["bytes"] = 3 * step_bytes
    assert warned(tmp_path / "b") == []
    free["bytes"] = 2 * step_bytes - 1   # a step held already: two more
    assert "(2 more steps of about" in warned(tmp_path / "c", saved=1)[0]
    staged = types.SimpleNamespace(parts=False, expect=lambda whole: None, deferred=set())
    assert "(2 more steps of about" in warned(tmp_path / "d", staged)[0]
    assert "the stage keeps the step saved last" in warned(tmp_path / "d", staged)[0]
    free["bytes"] = 2 * step_bytes
    assert warned(tmp_path / "e", staged) == []
    # the trainer's start
    free["bytes"] = 0
    _, logs = train(tiny(cfg6.corpus, "max_steps=1"), tmp_path / "run")
    assert any(line.startswith(f"warning: {tmp_path / 'run'}'s disk has 0.0 GB free") for line in logs), logs


# ----------------------------------------------------------------------------- the metrics log

def test_a_torn_metrics_line_is_dropped_on_resume(runs, tmp_path):
    cfg6, straight, _ = runs
    d = copy_split(runs, tmp_path)
    text = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    (d / "metrics.jsonl").write_text("".join(text[:2]) + '{"step": 3, "ce_tf": 5.\n' + "".join(text[2:])
                                     + '{"step": 5, "ce_tf": 5.4, "gr')   # the disk filled mid-line
    last, logs = train(cfg6, d)
    assert any(line.startswith(f"warning: {d / 'metrics.jsonl'}: dropped 2 lines") for line in logs), logs
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    assert_same_state(straight, d, cfg6)
    assert assert_curves_are_the_log(d)["ce_tf"] == [1, 2, 3, 4, 5, 6]


def test_a_life_with_tensorboard_false_writes_no_curves_and_the_next_start_catches_up(runs, corpus_file,
                                                                                     tmp_path):
    cfg6, straight, _ = runs
    d = copy_split(runs, tmp_path)
    before = {p.name: p.read_bytes() for p in (d / "tensorboard").iterdir()}
    _, logs = train(tiny(corpus_file, "max_steps=6", "tensorboard=false"), d)
    assert not any(line.startswith(("note:", "warning:")) for line in logs), logs
    assert {p.name: p.read_bytes() for p in (d / "tensorboard").iterdir()} == before
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    assert_same_state(straight, d, cfg6)
    # tensorboard back on: a start at max_steps trains nothing and writes steps 5 and 6 to the curves
    train(cfg6, d)
    assert assert_curves_are_the_log(d)["ce_tf"] == [1, 2, 3, 4, 5, 6]


def test_a_fresh_run_never_appends_to_an_older_runs_log(runs, corpus_file, tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(runs[2] / "metrics.jsonl", d / "metrics.jsonl")   # a log, and no checkpoint
    shutil.copytree(runs[2] / "tensorboard", d / "tensorboard")     # and its curves
    _, logs = train(tiny(corpus_file, "max_steps=4"), d)   # the split run's config: its step is compiled
    assert metrics_steps(d) == [1, 2, 3, 4]
    old = list(d.glob("metrics.old-*.jsonl"))
    assert len(old) == 1 and old[0].read_text() == (runs[2] / "metrics.jsonl").read_text()
    assert sum("moved it to" in line for line in logs) == 2, logs
    assert [p.name for p in d.glob("tensorboard.old-*/*")] == [p.name for p in (runs[2] / "tensorboard").iterdir()]
    assert len(read_event_files(d / "tensorboard")) == 1 and assert_curves_are_the_log(d)["ce_tf"] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- one writer

def _cli(capsys, workdir, corpus_file, *overrides):
    rc = train_cli(["--no-progress", "--config", "tiny", "--workdir", str(workdir), f"--set=corpus={corpus_file}",
                    "--set=save_every=2", *[f"--set={o}" for o in overrides]])
    return rc, capsys.readouterr().err


def _snapshot(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.name != rundir.LOCK)


def test_a_second_writer_is_refused(runs, corpus_file, tmp_path, capsys):
    d = copy_split(runs, tmp_path)
    before = _snapshot(d)
    with rundir.RunLock(d):   # the first writer (another open file: flock refuses even this process)
        rc, err = _cli(capsys, d, corpus_file, "max_steps=6")
        assert rc == 2 and "Traceback" not in err
        assert f"error: {d} is in use by pid {os.getpid()}" in err
        assert _snapshot(d) == before

        # grow and convert import refuse an --out that a trainer holds
        out = tmp_path / "out"
        with rundir.RunLock(_mk(out)):
            from fractus_jax.grow import run as grow_run
            state, meta = ckpt_lib.restore_one_device(d, 4, runs[0])
            with pytest.raises(rundir.RunDirBusy, match=f"{out} is in use by pid {os.getpid()}"):
                grow_run._write(out, state, meta, d, 4, runs[0])
            assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK]
    rc, err = _cli(capsys, d, corpus_file, "max_steps=6")   # released: the run goes on
    assert rc == 0, err


def _mk(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_convert_import_refuses_a_locked_out(runs, corpus_file, tmp_path):
    pytest.importorskip("torch")
    from fractus_jax.convert import run as convert_run

    d = copy_split(runs, tmp_path)
    pt = tmp_path / "a.pt"
    convert_run.export_run(d, pt, opt=True)
    out = _mk(tmp_path / "imported")
    with rundir.RunLock(out):
        with pytest.raises(rundir.RunDirBusy, match=f"{out} is in use by pid {os.getpid()}"):
            convert_run.import_checkpoint(pt, out, "tiny", [f"corpus={corpus_file}"], log=lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK]


# ----------------------------------------------------------------------------- I/O failures

class _DiskFull:
    """Counts calls; from the n-th on, raises ENOSPC as a full disk does."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def hit(self, path):
        self.calls += 1
        if self.calls >= self.n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_disk_full_during_a_save_is_one_error_line_and_the_run_resumes(corpus_file, tmp_path, capsys, monkeypatch):
    import orbax.checkpoint as ocp

    d = tmp_path / "run"
    full = _DiskFull(2)   # the save of step 2 commits, the save of step 4 finds the disk full
    save = ocp.CheckpointManager.save

    def save_on_full_disk(self, step, *a, **kw):
        full.hit(self.directory / str(step))
        return save(self, step, *a, **kw)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_on_full_disk)
    rc, err = _cli(capsys, d, corpus_file, "max_steps=4")
    assert rc == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot save step 4 to {d / 'checkpoints'}: No space left on device (ENOSPC); "
                      "the last good checkpoint is step 2 (the same command resumes from it)"], err
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)   # space freed
    rc, err = _cli(capsys, d, corpus_file, "max_steps=4")
    assert rc == 0 and f"resumed {d} at step 2" in err, err
    assert strict((d / "manifest.json").read_text())["step"] == 4


def test_disk_full_inside_orbaxs_asynchronous_write_loses_nothing_and_the_run_resumes(corpus_file, tmp_path,
                                                                                        capsys, monkeypatch):
    """ENOSPC raised where Orbax writes an array, in its background thread (the function
    tests/test_kills.py hooks, as of orbax-checkpoint 0.12): the run stops with one error
    line, step 2 stays the good checkpoint, no half-written step 4 is taken for one, and the
    same command resumes and ends equal bit for bit to a run that never met a full disk."""
    from orbax.checkpoint._src.serialization import serialization

    serialize = serialization.async_serialize_from_host
    failed = []

    async def serialize_on_a_full_disk(value, tspec, *a, **kw):
        if "/4.orbax-checkpoint-tmp" in json.dumps(tspec):
            failed.append(True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "params")
        return await serialize(value, tspec, *a, **kw)

    d = tmp_path / "run"
    monkeypatch.setattr(serialization, "async_serialize_from_host", serialize_on_a_full_disk)
    rc, err = _cli(capsys, d, corpus_file, "max_steps=4")
    assert failed, "the hook was never reached: Orbax's write path moved"
    assert rc == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step 4" in errors[0] and "No space left on device" in errors[0], err
    assert ckpt_lib.read_manifest(d)["step"] == 2
    monkeypatch.setattr(serialization, "async_serialize_from_host", serialize)   # space freed
    rc, err = _cli(capsys, d, corpus_file, "max_steps=4")
    assert rc == 0 and f"resumed {d} at step 2" in err, err
    rc, _ = _cli(capsys, tmp_path / "straight", corpus_file, "max_steps=4")
    assert rc == 0
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [f"corpus={corpus_file}", "save_every=2",
                                                                  "max_steps=4"])
    abstract = state_lib.abstract_train_state(cfg)
    states = []
    for run_dir in (d, tmp_path / "straight"):
        ck = ckpt_lib.RunCheckpointer(run_dir, read_only=True)
        try:
            states.append(ck.restore(abstract, 4)[0])
        finally:
            ck.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), *states)


def test_disk_full_while_logging_is_one_error_line(corpus_file, tmp_path, capsys, monkeypatch):
    d = tmp_path / "run"
    full = _DiskFull(4)

    class FullFile:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            full.hit(d / "metrics.jsonl")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def open_on_full_disk(path, *a, **kw):
        f = open(path, *a, **kw)
        return FullFile(f) if Path(path).name == "metrics.jsonl" else f

    monkeypatch.setattr(rundir, "open", open_on_full_disk, raising=False)
    rc, err = _cli(capsys, d, corpus_file, "max_steps=6")
    assert rc == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot write {d / 'metrics.jsonl'}: No space left on device (ENOSPC); "
                      "the last good checkpoint is step 2 (the same command resumes from it)"], err


# ----------------------------------------------------------------------------- a diverged run

def test_lr_1e30_stops_after_k_skipped_steps_and_all_json_stays_finite(corpus_file, tmp_path, capsys):
    d = tmp_path / "run"
    rc, err = _cli(capsys, d, corpus_file, "lr=1e30", "max_skipped_steps=4", "max_steps=1000")
    assert rc == 2 and "Traceback" not in err, err
    warned = [line for line in err.splitlines() if line.startswith("warning: step") and "was skipped" in line]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "4 steps in a row were skipped" in errors[0] and "lr=1e+30" in errors[0], err
    assert len(warned) == 2 and "(1 in a row; the run stops at 4)" in warned[0] and "(2 in a row" in warned[1], err
    manifest = strict((d / "manifest.json").read_text())   # no NaN in it
    assert manifest["ema_tf"] is None or np.isfinite(manifest["ema_tf"])
    for step_dir in (d / "checkpoints").iterdir():
        strict((step_dir / "meta" / "metadata").read_text())
    lines = [strict(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["skipped"] == 1 and all(m["ema_tf"] is None or np.isfinite(m["ema_tf"]) for m in lines)
    assert lines[-1]["step"] < 20


def test_skipped_step_warnings_are_rate_limited():
    logs = []
    watch = SkipWatch(0, 1e-3, logs.append)
    for step in range(1, 101):
        watch.observe(step, 1.0, None)
    assert len(logs) == 7   # 1, 2, 4, ..., 64 in a row
    watch.observe(101, 0.0, None)
    assert logs[-1] == "note: step 101 trained again after 100 skipped steps"
    stop = SkipWatch(3, 1e30, logs.append)
    stop.observe(7, 0.0, lambda: 6)
    stop.observe(8, 1.0, lambda: 6)
    stop.observe(9, 1.0, lambda: 6)
    with pytest.raises(StalledError, match="steps 8-10: 3 steps in a row.*The last checkpoint, step 6, is from "
                       "before the first skipped step"):
        stop.observe(10, 1.0, lambda: 6)
    stop = SkipWatch(2, 1e30, logs.append)
    stop.observe(8, 1.0, lambda: 9)
    with pytest.raises(StalledError, match=r"from step 7 on \(the last: step 9\) hold these weights"):
        stop.observe(9, 1.0, lambda: 9)


def test_generate_refuses_a_max_new_above_the_bound(capsys):
    from fractus_jax import generate

    for value in ("1e9", "1000000000", "1e20"):
        with pytest.raises(SystemExit) as e:
            generate.main(["--ckpt", ".", "--prompt", "a", "--max-new", value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument --max-new" in err and "above the limit of 1,000,000" in err, err
