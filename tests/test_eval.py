"""Held-out evaluation: the scorer against a plain forward_chunk loop, the trainer's logged
val_ce against the command, a run through export and import, the bits-per-byte
denominator, and the command's refusals."""
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import fractus_jax
from fractus_jax import atom, model, scoring
from fractus_jax.atom.features import FEATURE_CONTEXT
from fractus_jax.config import tiny as tiny_engine
from fractus_jax.eval.__main__ import main as eval_main
from fractus_jax.lanes import lane_layout, lane_targets
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib

from tensorboard_testing import assert_curves_are_the_log, read_event_files

ROOT = Path(__file__).resolve().parents[1]
VAL = ["val_fraction=0.1", "eval_every=3", "val_ids=512", "val_lanes=4"]


def tiny(corpus_file, *overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [f"corpus={corpus_file}", *overrides])


@pytest.fixture(scope="module")
def run(corpus_file, tmp_path_factory):
    """(cfg, run dir, plan): the tiny config, 6 steps, the last tenth of the corpus held out."""
    workdir = tmp_path_factory.mktemp("eval") / "run"
    cfg = tiny(corpus_file, *VAL)
    plan = prepare_lib.prepare(cfg, workdir, progress=False)
    loop.run(plan, progress=False, log=lambda m: None)
    return cfg, workdir, plan


@pytest.fixture(scope="module")
def held_out_file(run, tmp_path_factory):
    """The run's held-out end as an id file of its own."""
    _, _, plan = run
    path = tmp_path_factory.mktemp("held") / "held.u16"
    np.asarray(plan.val.ids, "<u2").tofile(path)
    return path


def plain_loop(params, cfg, ids, lanes, chunk, restarts=None, feats=False):
    """(mean CE with the carry, mean CE from a zero carry at each chunk, targets): the lanes
    read by hand, forward_chunk and a float64 log-softmax, exact routing. restarts
    (n_chunks, lanes) bool: the lanes whose carry is set to zeros before each chunk. feats:
    each chunk's packet features, with the FEATURE_CONTEXT ids before it in its lane as
    their left context where the lane has that many (docs/spec.md §5)."""
    cfg = cfg.replace(capacity_factor=None)
    lane_len = len(ids) // lanes
    n_chunks = (lane_len - 1) // chunk
    lane = np.stack([np.asarray(ids[b * lane_len:(b + 1) * lane_len], np.int32) for b in range(lanes)])
    step = jax.jit(fractus_jax.forward_chunk, static_argnums=3)
    state = fractus_jax.init_state(cfg, lanes)
    totals = [0.0, 0.0]
    for k in range(n_chunks):
        if restarts is not None:
            state = {name: np.moveaxis(np.moveaxis(np.asarray(a), model.STATE_ROW_AXIS[name], 0)
                                       * ~restarts[k].reshape((lanes,) + (1,) * (a.ndim - 1)),
                                       0, model.STATE_ROW_AXIS[name]) for name, a in state.items()}
        inputs = lane[:, k * chunk:(k + 1) * chunk]
        targets = lane[:, k * chunk + 1:(k + 1) * chunk + 1]
        f = None
        if feats:
            start = k * chunk
            left = lane[:, start - FEATURE_CONTEXT:start] if start >= FEATURE_CONTEXT else None
            f = atom.atom_features(inputs, left=left)
        logits, _, state_next = step(params, state, inputs, cfg, f)
        fresh, _, _ = step(params, fractus_jax.init_state(cfg, lanes), inputs, cfg, f)
        for i, lg in enumerate((logits, fresh)):
            lg = np.asarray(lg, np.float64)
            logp = lg - lg.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            totals[i] -= np.take_along_axis(logp, targets[..., None], -1).sum()
        state = state_next
    n = lanes * n_chunks * chunk
    return totals[0] / n, totals[1] / n, n


def test_the_score_is_a_plain_loop_over_forward_chunk(run):
    _, workdir, plan = run
    params, cfg = ckpt_lib.load_for_inference(workdir)
    ids = np.asarray(plan.val.ids[:1500])
    got = scoring.score(params, cfg, ids, lanes=3, chunk=16)
    ce, ce0, n = plain_loop(params, cfg, ids, 3, 16)
    assert got.n_ids == n == 3 * 31 * 16
    assert abs(got.ce - ce) <= 1e-5 and abs(got.ce_no_carry - ce0) <= 1e-5
    assert got.ce == got.ce_warm   # no carry schedule: the carry as trained is the warm one
    # the carry carries something: a trained model scores the two ways apart
    assert abs(got.ce - got.ce_no_carry) > 1e-3
    targets = lane_targets(ids, 3, 16)
    assert got.n_bytes == scoring.count_bytes(targets)
    assert got.bpb == pytest.approx(got.nats / math.log(2) / got.n_bytes, rel=1e-12)


@pytest.mark.parametrize("schedule", [scoring.CarrySchedule(every=4), scoring.CarrySchedule(prob=0.3),
                                      scoring.CarrySchedule(every=5, prob=0.2),
                                      scoring.CarrySchedule(every=1, span=4),
                                      scoring.CarrySchedule(every=2, prob=0.4, span=3)])
def test_a_carry_schedule_restarts_the_lanes_it_names_and_no_others(run, schedule):
    _, workdir, plan = run
    params, cfg = ckpt_lib.load_for_inference(workdir)
    ids = np.asarray(plan.val.ids[:1500])
    got = scoring.score(params, cfg, ids, lanes=3, chunk=16, schedule=schedule)
    restarts = schedule.resets(31, 3)
    assert 0 < restarts[1:].sum() < restarts[1:].size      # some lanes restart, not all
    ce, ce0, _ = plain_loop(params, cfg, ids, 3, 16, restarts)
    warm, _, _ = plain_loop(params, cfg, ids, 3, 16)
    # float32 sums of 3 streams in one forward against 3 lanes alone: bounded, not bit-equal
    assert abs(got.ce - ce) <= 1e-4 and abs(got.ce_warm - warm) <= 1e-4 and abs(got.ce_no_carry - ce0) <= 1e-4
    assert min(abs(ce - warm), abs(ce - ce0)) > 1e-3       # a third figure, neither of the others
    assert (schedule.resets(31, 3) == restarts).all()      # the same draws every time
    # a step of `span` chunks (the trainer's accum) restarts only before its first chunk
    first = np.arange(31) % schedule.span == 0
    assert not restarts[~first].any()


def test_the_logged_score_of_a_run_with_features_and_restarts_is_a_plain_loop(corpus_file, tmp_path):
    """The trainer's val_ce of a run that trains with packet features and restarts its
    carry every 3 steps, against the plain loop with the features and the restarts written
    out by hand (chunks 0, 3, 6, ... from a zero carry), not through the Scorer."""
    cfg = tiny(corpus_file, *VAL, "feats=true", "carry_reset_every=3", "max_steps=3", "val_ids=768")
    plan = prepare_lib.prepare(cfg, tmp_path / "run", progress=False)
    loop.run(plan, progress=False, log=lambda m: None)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in lines if "val_ce" in m][-1]
    assert logged["step"] == 3
    params, engine = ckpt_lib.load_for_inference(tmp_path / "run")
    ids = np.asarray(plan.val.ids[:cfg.val_ids])
    n_chunks = (len(ids) // cfg.val_lanes - 1) // cfg.seq_len
    restarts = np.repeat((np.arange(n_chunks) % 3 == 0)[:, None], cfg.val_lanes, 1)
    ce, ce0, _ = plain_loop(params, engine, ids, cfg.val_lanes, cfg.seq_len, restarts, feats=True)
    warm, _, _ = plain_loop(params, engine, ids, cfg.val_lanes, cfg.seq_len, feats=True)
    assert abs(logged["val_ce"] - ce) <= 1e-4 and abs(logged["val_ce_no_carry"] - ce0) <= 1e-4
    assert abs(logged["val_ce_warm"] - warm) <= 1e-4
    # the features and the restarts change the score: without either the loop is elsewhere
    bare, _, _ = plain_loop(params, engine, ids, cfg.val_lanes, cfg.seq_len, restarts)
    assert min(abs(ce - bare), abs(ce - warm)) > 2e-4, (ce, bare, warm)   # twice the bound above


def test_a_run_that_restarts_its_carry_every_step_is_scored_from_a_zero_carry(run):
    _, workdir, plan = run
    params, cfg = ckpt_lib.load_for_inference(workdir)
    ids = np.asarray(plan.val.ids[:1000])
    plain = scoring.score(params, cfg, ids, lanes=2, chunk=16)
    every = scoring.score(params, cfg, ids, lanes=2, chunk=16, schedule=scoring.CarrySchedule(every=1))
    assert every.ce == every.ce_no_carry == plain.ce_no_carry and every.ce_warm == plain.ce_warm
    assert every.bpb == every.bpb_no_carry and every.to_json()["carry_reset_every"] == 1


def test_the_trainer_logs_what_the_command_reports(run, capsys):
    cfg, workdir, plan = run
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {m["step"]: m for m in lines if "val_ce" in m}
    assert sorted(evaluated) == [3, 6]
    for m in evaluated.values():
        for key in ("val_ce", "val_bpb", "val_ce_warm", "val_bpb_warm", "val_ce_no_carry", "val_bpb_no_carry"):
            assert math.isfinite(m[key]), key
        assert m["val_ce"] == m["val_ce_warm"]   # no carry schedule: as trained is warm
    assert evaluated[3]["val_ce"] != evaluated[6]["val_ce"]
    # the held-out end is outside every lane the trainer read
    assert plan.train.n_ids == plan.corpus.n_ids - int(plan.corpus.n_ids * 0.1) == plan.val.start
    manifest = ckpt_lib.read_manifest(workdir)
    assert manifest["train_ids"] == plan.train.n_ids and manifest["held_out"]["start"] == plan.train.n_ids
    for step in (3, 6):
        assert eval_main(["--ckpt", str(workdir / "checkpoints" / str(step)), "--ids", "512", "--lanes", "4",
                          "--json", "--no-progress"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["step"] == step
        assert abs(out["ce"] - evaluated[step]["val_ce"]) <= 1e-5
        assert abs(out["bpb"] - evaluated[step]["val_bpb"]) <= 1e-5
        assert abs(out["ce_no_carry"] - evaluated[step]["val_ce_no_carry"]) <= 1e-5


def test_the_event_files_hold_the_logs_scalars_at_its_steps(run):
    """TensorBoard's curves of the run: each number of each metrics.jsonl record, at its step."""
    _, workdir, _ = run
    steps = assert_curves_are_the_log(workdir)
    for tag in ("ce_tf", "ema_tf", "lr", "grad_norm", "keep_rate", "ids_per_s_tf", "step_s"):
        assert steps[tag] == [1, 2, 3, 4, 5, 6], tag
    for tag in ("val_ce", "val_bpb", "val_ce_warm", "val_bpb_warm", "val_ce_no_carry", "val_bpb_no_carry"):
        assert steps[tag] == [3, 6], tag
    (name, events), = read_event_files(workdir / "tensorboard")   # one life, one file
    assert name.startswith("events.out.tfevents.") and events[0].file_version == "brain.Event:2"
    assert events[1].session_log.status == events[1].session_log.START and events[1].step == 0


def test_an_exported_then_imported_run_scores_the_same(run, held_out_file, corpus_file, tmp_path, capsys):
    pytest.importorskip("torch")
    from fractus_jax.convert import run as convert_run

    _, workdir, _ = run
    convert_run.export_run(workdir, tmp_path / "a.pt", opt=True)
    convert_run.import_checkpoint(tmp_path / "a.pt", tmp_path / "imported", "tiny",
                                  [f"corpus={corpus_file}", *VAL], log=lambda m: None)
    scores = []
    for d in (workdir, tmp_path / "imported"):
        assert eval_main(["--ckpt", str(d), "--corpus", str(held_out_file), "--ids", "2000", "--lanes", "2",
                          "--json", "--no-progress"]) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    a, b = scores
    assert a["step"] == b["step"] == 6 and a["n_ids"] == b["n_ids"] == 2 * 62 * 16
    assert abs(a["ce"] - b["ce"]) <= 1e-5 and abs(a["ce_no_carry"] - b["ce_no_carry"]) <= 1e-5


def test_bits_per_byte_counts_bytes_not_characters_or_ids():
    text = "é 日本 naïve — ok\n" * 5
    ids = atom.encode(text)
    assert ids[0] == atom.BOS
    n_bytes = len(text.encode("utf-8"))
    assert n_bytes > len(text) and len(ids) > n_bytes   # bytes differ from characters and from ids
    assert scoring.count_bytes(ids) == n_bytes
    cfg = tiny_engine()
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    # one lane, one chunk over the whole stream: every id after the BOS is a target
    got = scoring.score(params, cfg, ids, lanes=1, chunk=len(ids) - 1)
    assert got.n_ids == len(ids) - 1 and got.n_bytes == n_bytes
    assert got.bpb == pytest.approx(got.nats / math.log(2) / n_bytes, rel=1e-12)
    # two lanes: what they do not cover (each lane's first id, the tail) is not counted
    two = scoring.score(params, cfg, ids, lanes=2, chunk=8)
    lane_len, n_chunks = lane_layout(len(ids), 2, 8)
    uncovered = [ids[b * lane_len] for b in range(2)]
    uncovered += [i for b in range(2) for i in ids[b * lane_len + 1 + n_chunks * 8:(b + 1) * lane_len]]
    uncovered += list(ids[2 * lane_len:])
    assert two.n_bytes == n_bytes - scoring.count_bytes(uncovered)
    assert scoring.bits_per_byte(1.0, 0) is None


def test_the_command_prints_one_json_line(run, held_out_file):
    _, workdir, _ = run
    out = subprocess.run([sys.executable, "-m", "fractus_jax.eval", "--ckpt", str(workdir), "--corpus",
                          str(held_out_file), "--ids", "600", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    for key in ("ce", "bpb", "ce_no_carry", "bpb_no_carry", "n_ids", "n_bytes", "step"):
        assert key in got, key
    assert got["step"] == 6 and got["lanes"] == 4 and got["chunk"] == 16 and got["n_ids"] == 4 * 9 * 16
    assert 0 < got["n_bytes"] <= got["n_ids"] and got["ce"] != got["ce_no_carry"]
    assert "Traceback" not in out.stderr


def test_refusals_exit_2_with_one_error_line(run, corpus_file, tmp_path, capsys):
    _, workdir, _ = run
    bad = tmp_path / "bad.u16"
    ids = np.fromfile(corpus_file, "<u2")[:3000].copy()
    ids[777] = 300
    ids.tofile(bad)
    other = tmp_path / "other"
    plan = prepare_lib.prepare(tiny(corpus_file, "max_steps=1"), other, progress=False)
    loop.run(plan, progress=False, log=lambda m: None)
    cases = [
        (["--ckpt", str(tmp_path / "nope")], ["nope", "not found"]),
        (["--ckpt", str(workdir), "--corpus", str(bad)], ["bad.u16", "777", "300"]),
        (["--ckpt", str(workdir), "--corpus", str(tmp_path / "missing.u16")], ["missing.u16"]),
        (["--ckpt", str(workdir), "--ids", "40"], ["40 ids", "4 lanes"]),
        (["--ckpt", str(workdir), "--step", "4"], ["step 4"]),
        (["--ckpt", str(other)], ["held out no part", "--corpus", "fractus_jax.atom build"]),
    ]
    for argv, words in cases:
        assert eval_main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        for w in words:
            assert w in err, (w, err)
