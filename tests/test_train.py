"""The trainer on the tiny config: resume, refusals, preemption, accumulation, skipping."""
import dataclasses
import functools
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fractus_jax import sharding
from fractus_jax.config import EngineConfig
from fractus_jax.lanes import LaneReader
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import progress as progress_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train import objective
from fractus_jax.train import step as step_lib
from fractus_jax.train.__main__ import main as train_cli
from fractus_jax.train.errors import TrainError

from engine_testing import move_off_init

ROOT = Path(__file__).resolve().parents[1]


def tiny(corpus_file, *overrides):
    cfg = cfg_lib.load_config("tiny")
    return cfg_lib.apply_overrides(cfg, [f"corpus={corpus_file}", *overrides])


def train(cfg, workdir):
    plan = prepare_lib.prepare(cfg, workdir, progress=False)
    return loop.run(plan, progress=False, log=lambda m: None)


def restore(workdir, cfg, step=None):
    abstract = state_lib.abstract_train_state(cfg)
    ck = ckpt_lib.RunCheckpointer(workdir, read_only=True)
    try:
        return ck.restore(abstract, step)
    finally:
        ck.close()


def test_resume_is_bit_exact_with_scheduled_sampling(corpus_file, tmp_path):
    cfg = tiny(corpus_file, "ss_rate=0.5", "max_steps=6", "save_every=3")
    train(cfg, tmp_path / "straight")
    train(cfg.__class__(**{**cfg.__dict__, "max_steps": 3}), tmp_path / "split")
    manifest = ckpt_lib.read_manifest(tmp_path / "split")
    assert manifest["step"] == 3 and manifest["start_token_next"] == 3 * cfg.seq_len
    train(cfg, tmp_path / "split")   # the same command resumes to max_steps

    straight, meta_a = restore(tmp_path / "straight", cfg)
    split, meta_b = restore(tmp_path / "split", cfg)
    at_3, _ = restore(tmp_path / "split", cfg, step=3)
    assert meta_a["step"] == meta_b["step"] == 6
    assert meta_a["start_token_next"] == meta_b["start_token_next"] == 6 * cfg.seq_len
    # The comparison can fail: three more steps did change every part of the state.
    for part in ("params", "opt_state", "carry"):
        diff = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), straight[part], at_3[part])
        assert any(jax.tree.leaves(diff)), part
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     straight[part], split[part])
    lines = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert any(m["ss_ran"] for m in lines), "scheduled sampling never ran: the test would prove nothing"
    ss_line = next(m for m in lines if m["ss_ran"])
    for key in ("ce_tf", "ema_tf", "lb", "grad_norm", "lr", "skipped", "ids_per_s_tf", "ids_per_s_wall",
                "ce_ss", "ema_ss"):
        assert key in ss_line


def test_accumulation_equals_one_gradient_of_the_summed_chunks(corpus_file):
    cfg = tiny(corpus_file, "accum=2", "model.capacity_factor=none")
    mesh = sharding.make_mesh()
    state, _ = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 266, (2, cfg.batch_size, cfg.seq_len + 1)), jnp.int32)
    inputs, targets = ids[..., :-1], ids[..., 1:]
    _, grads, _, _ = jax.jit(lambda p, c: step_lib.accumulate(p, c, inputs, targets, None, cfg))(
        state["params"], state["carry"])

    def two_chunks(params, weights):
        loss0, aux0 = objective.train_loss(params, state["carry"], inputs[0], targets[0], None, cfg, 1.0)
        loss1, _ = objective.train_loss(params, aux0[4], inputs[1], targets[1], None, cfg, 1.0)
        return (weights[0] * loss0 + weights[1] * loss1) / 2

    # One program: weights (1, 1) give the mean of the two chunks' losses, (2, 0) the first alone.
    grad = jax.jit(jax.grad(two_chunks))
    want = grad(state["params"], jnp.array([1.0, 1.0]))
    other = grad(state["params"], jnp.array([2.0, 0.0]))
    # Leaf by leaf, the norm of the difference against the leaf's own norm: the two programs
    # sum in another order (float32 rounding: measured up to 4.8e-6 of a leaf), while the
    # gradient of the first chunk alone is off by 0.31 of a leaf or more on every leaf the
    # loss reaches (checked here, so that the bound is seen to tell the two apart).
    jax.tree.map(lambda a, b: _assert_close_as_a_whole(np.asarray(a), np.asarray(b), 1e-4), grads, want)
    jax.tree.map(lambda a, b: _assert_apart(np.asarray(a), np.asarray(b), 1e-4), other, want)


def _assert_close_as_a_whole(got, want, rel):
    err, size = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    assert err <= rel * size, (err, size)


def _assert_apart(got, want, rel):
    err, size = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    assert err > rel * size or size == 0, (err, size)   # 0: a leaf the loss does not reach


def test_row_streams_train_step_equals_one_stream(corpus_file):
    """The trainer's whole step (both passes, clipping, optimizer) with two row streams
    gives the one-stream step's state and metrics (same dispatch groups, float32)."""
    # SGD: Adam's step normalises a near-zero gradient's rounding into a full-size update
    one = tiny(corpus_file, "model.capacity_factor=1.25", "model.moe_group_rows=2", "execution.scan_unroll=2", "ss_rate=1",
               "optimizer=sgd", "lr=0.05")
    two = cfg_lib.apply_overrides(one, ["execution.row_streams=2"])
    state, _ = state_lib.create_train_state(one, sharding.make_mesh(), jax.random.PRNGKey(0))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 266, (1, one.batch_size, one.seq_len + 1)), jnp.int32)
    outs = [jax.jit(step_lib.make_train_step(c))(state, {"ids": ids}) for c in (one, two)]
    (s1, m1), (s2, m2) = outs
    assert int(m1["ss_ran"]) == 1 and float(m1["keep_rate"]) < 1.0
    assert float(jnp.abs(s1["params"]["blocks"]["moe"]["U1"] - state["params"]["blocks"]["moe"]["U1"]).max()) > 1e-6
    # float32: other shapes round differently; each array within 1e-5 of its own scale
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(np.asarray(b, np.float64)).max()))), (s1, m1), (s2, m2))


def test_non_finite_gradient_skips_the_update(corpus_file):
    cfg = tiny(corpus_file)
    mesh = sharding.make_mesh()
    state, shardings = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(0))
    step = step_lib.make_train_step(cfg)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, cfg.batch_size, cfg.seq_len + 1)), jnp.int32)
    bad = dict(state, params={**state["params"], "observe": state["params"]["observe"].at[3, 0].set(jnp.nan)})
    bad_ids = ids.at[0, 0, 0].set(3)
    new, metrics = jax.jit(step)(bad, {"ids": bad_ids})
    assert int(metrics["skipped"]) == 1 and int(new["skipped"]) == 1 and int(new["step"]) == 1
    np.testing.assert_array_equal(np.asarray(new["params"]["blocks"]["attn"]["w_qkv"]),
                                  np.asarray(bad["params"]["blocks"]["attn"]["w_qkv"]))
    good, metrics = jax.jit(step)(state, {"ids": ids})
    assert int(metrics["skipped"]) == 0
    assert float(jnp.abs(good["params"]["blocks"]["attn"]["w_qkv"] - state["params"]["blocks"]["attn"]["w_qkv"]).max()) > 0


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fractus_jax.train", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _snapshot(path: Path):
    if not path.exists():
        return None
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def trained_dir(corpus_file, tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "run"
    train(tiny(corpus_file, "max_steps=2", "save_every=2"), d)
    return d


@pytest.mark.parametrize("case", ["bad_id", "missing_corpus", "start_token_0", "batch_change", "vocab_change",
                                  "row_streams", "row_streams_on_a_mesh", "val_fraction_change"])
def test_refusals_exit_nonzero_without_traceback_and_touch_nothing(case, corpus_file, trained_dir, tmp_path,
                                                                 capsys):
    workdir = tmp_path / "fresh"
    overrides = [f"corpus={corpus_file}", "max_steps=4"]
    if case == "bad_id":
        ids = np.fromfile(corpus_file, "<u2")[:5000].copy()
        ids[1234] = 300
        bad = tmp_path / "bad.u16"
        ids.tofile(bad)
        overrides[0] = f"corpus={bad}"
        expect = ["1234", "300", str(bad)]
    elif case == "row_streams":
        overrides += ["execution.row_streams=3", "model.moe_group_rows=1"]
        expect = ["row_streams=3", "batch_size 4"]
    elif case == "row_streams_on_a_mesh":
        overrides += ["execution.row_streams=2", "model.moe_group_rows=1", "mesh.data=2"]
        expect = ["row_streams=2", "one device", "2 devices"]
    elif case == "missing_corpus":
        overrides[0] = f"corpus={tmp_path / 'nope.u16'}"
        expect = ["nope.u16"]
    else:
        workdir = trained_dir
        extra = {"start_token_0": ("start_token=0", ["start_token=0"]),
                 "batch_change": ("batch_size=2", ["batch_size", "4", "2"]),
                 "vocab_change": ("model.vocab_size=300", ["vocab", "266", "300"]),
                 # a run from before held-out splits held nothing out: its lanes stay as they were
                 "val_fraction_change": ("val_fraction=0.1", ["val_fraction was 0", "now 0.1",
                                                              "keep val_fraction=0"])}[case]
        overrides.append(extra[0])
        expect = extra[1]
    before = _snapshot(workdir)
    args = ["--config", "tiny", "--workdir", str(workdir), *[f"--set={o}" for o in overrides]]
    if case == "bad_id":   # in a process of its own: the exit status and the stderr a user sees
        out = _cli(*args)
        rc, err = out.returncode, out.stderr
    else:                  # the same main() in this process (a traceback would fail the test here)
        rc, err = train_cli(["--no-progress", *args]), capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    assert err.startswith("error: ") or "\nerror: " in err
    for word in expect:
        assert word in err, (word, err)
    assert _snapshot(workdir) == before


def test_sigterm_finishes_the_step_saves_and_exits_zero(corpus_file, tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fractus_jax.train", "--no-progress", "--config", "tiny",
                             "--workdir", str(workdir), f"--set=corpus={corpus_file}", "--set=max_steps=100000",
                             "--set=save_every=100000", "--set=log_every=1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    manifest = ckpt_lib.read_manifest(workdir)
    assert 3 <= manifest["step"] < 100000 and "SIGTERM" in err
    assert manifest["start_token_next"] == manifest["step"] * 16
    assert (workdir / "checkpoints" / str(manifest["step"])).is_dir()


def _deadline_run(cfg, workdir):
    logs = []
    last = loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=logs.append)
    manifest = ckpt_lib.read_manifest(workdir)
    assert manifest["step"] == last["step"] and "(deadline near)" in logs[-1], logs
    state, meta = restore(workdir, cfg)
    assert int(state["step"]) == meta["step"] == last["step"]
    assert meta["start_token_next"] == last["step"] * cfg.seq_len
    return last["step"], (workdir / "manifest.json").stat().st_mtime


def test_deadline_saves_and_stops_before_it(corpus_file, tmp_path):
    # A deadline already past: the step in flight is saved. Its duration, most of it the
    # step's compilation, is what the timed run below needs before its first step.
    t0 = time.time()
    step, _ = _deadline_run(tiny(corpus_file, "max_steps=2", f"deadline={time.time()}"), tmp_path / "past")
    assert step == 1
    startup = time.time() - t0

    # Before its first save is timed, the run reserves one sized by its 0.6 MB state (the
    # 2 s floor), not 30 s, which would stop it at step 1; the saves every 10 steps replace
    # it with measured times, as in a long run.
    deadline = time.time() + startup + 20
    cfg = tiny(corpus_file, "max_steps=4000", "save_every=10", f"deadline={deadline}")
    step, committed = _deadline_run(cfg, tmp_path / "run")
    # The last save committed before the deadline, but not long before it: the stop came from
    # the margin (two steps, 1.5 times the slowest save and a second), after measured saves. The
    # bound leaves room for a CPU shared with other tests, whose saves are slower.
    assert deadline - 10 < committed < deadline and step >= 20, (step, deadline - committed)


def test_embedded_default_corpus_is_built_once_and_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("FRACTUS_CACHE", str(tmp_path / "cache"))
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), ["max_steps=1", "save_every=1"])
    assert cfg.corpus == ""
    plan = prepare_lib.prepare(cfg, tmp_path / "run", progress=False)
    built = list((tmp_path / "cache").glob("*.u16"))
    assert len(built) == 1 and plan.corpus.n_ids > 1_000_000
    mtime = built[0].stat().st_mtime_ns
    loop.run(plan, progress=False, log=lambda m: None)
    prepare_lib.prepare(cfg.__class__(**{**cfg.__dict__, "max_steps": 2}), tmp_path / "run", progress=False)
    assert built[0].stat().st_mtime_ns == mtime   # reused, not rebuilt
    text = bytes(np.asarray(plan.corpus.ids[:20000])[np.asarray(plan.corpus.ids[:20000]) < 256].astype(np.uint8))
    assert b"def " in text or b"import " in text   # real code


def test_config_overrides_and_aliases():
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"),
                                  ["BATCH=8", "LR=0.01", "OPT=sgd", "BLOCK_CKPT=1", "model.variant=parent",
                                   "dtype=bfloat16", "start_token=none"])
    assert (cfg.batch_size, cfg.lr, cfg.optimizer, cfg.execution.remat, cfg.model.variant, cfg.execution.compute_dtype,
            cfg.start_token) == (8, 0.01, "sgd", True, "parent", "bfloat16", None)
    # The execution fields' names from before they left the engine config: mapped, each noted.
    said = []
    moved = cfg_lib.apply_overrides(cfg, ["model.kernels=plain", "model.row_streams=2", "execution.scan_unroll=2"],
                                    log=said.append)
    assert (moved.execution.kernels, moved.execution.row_streams, moved.execution.scan_unroll) == ("plain", 2, 2)
    assert moved.model == cfg.model
    assert said == ["note: --set model.kernels is now execution.kernels (how the engine is computed, apart from "
                    "its weights)", "note: --set model.row_streams is now execution.row_streams (how the engine "
                    "is computed, apart from its weights)"]
    assert cfg_lib.override_fields(["model.remat=1", "BLOCK_CKPT=1"]) == {"execution.remat"}
    for bad, msg in (("nope=1", "no field 'nope'"), ("batch_size=x", "expected int"),
                     ("optimizer=lion", "adamw or sgd"), ("lr", "key=value")):
        with pytest.raises(cfg_lib.ConfigError, match=msg):
            cfg_lib.apply_overrides(cfg, [bad])
    with pytest.raises(cfg_lib.ConfigError, match="no config named"):
        cfg_lib.load_config("no_such_config")
    for name in ("tiny", "smoke", "atom_1b", "parent_1b", "bench_small"):
        assert isinstance(cfg_lib.load_config(name), cfg_lib.TrainConfig)
        assert cfg_lib.load_config(name).conflicts() == [], name


def test_lanes_targets_and_feature_context(corpus_file):
    from fractus_jax.atom.corpus import open_corpus
    from fractus_jax.lanes import LaneReader
    from fractus_jax.train.data import chunk_features

    ids = open_corpus(corpus_file).ids
    reader = LaneReader(ids, batch_size=3, seq_len=8, accum=2)
    lane = reader.lane_len
    chunks, nxt, context = reader.read(40, left=16)
    assert chunks.shape == (2, 3, 9) and nxt == 56
    for b in range(3):
        np.testing.assert_array_equal(chunks[0, b], ids[b * lane + 40:b * lane + 49])
        np.testing.assert_array_equal(chunks[1, b], ids[b * lane + 48:b * lane + 57])   # consecutive
        np.testing.assert_array_equal(context[1, b], ids[b * lane + 32:b * lane + 48])
    assert reader.read(lane - 10)[1] == 16          # no room left: every lane restarts at 0
    feats = chunk_features(chunks, context)
    boundary = (chunks[..., :-1] >= 259) & (chunks[..., :-1] <= 265)
    assert boundary.any() and np.abs(feats[boundary]).sum() > 0 and np.abs(feats[~boundary]).sum() == 0


def test_probes_at_init(corpus_file):
    from fractus_jax.atom.corpus import open_corpus
    from fractus_jax.train.probes import SPEECH_STEPS, Prober

    # Trained on 2 devices with capacity groups of 8 rows, which 4 probe rows are not a multiple of.
    cfg = cfg_lib.resolve_for_mesh(tiny(corpus_file, "batch_size=16", "mesh.data=2", "model.capacity_factor=1.25",
                                        "model.moe_group_rows=8"))
    assert cfg.execution.moe_shards == 2
    prober = Prober(cfg, open_corpus(corpus_file))
    state, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(0))
    out = prober.run(state["params"], initial=True)
    # An untrained atom engine: CE near ln 266, no echo (embedding std 0.02, docs/spec.md §6).
    assert abs(out["init_ce"] - np.log(266)) < 0.1
    assert out["init_echo"] < 0.05
    assert 1 <= out["speech_unique_ids"] <= SPEECH_STEPS and 0 <= out["speech_unique_bytes"] <= out["speech_unique_ids"]
    assert 0 <= out["ar_match"] <= 1 and out["ar_ce"] > 0
    assert len(out["lb_per_block"]) == cfg.model.n_layers
    hits = np.asarray(out["expert_hits"])
    assert hits.shape == (cfg.model.n_layers, cfg.model.n_experts)
    assert list((hits > 0).sum(-1)) == out["alive_experts"]


def test_the_speech_probe_decodes_as_the_run_trained(corpus_file):
    from fractus_jax.atom import decode
    from fractus_jax.atom.corpus import open_corpus
    from fractus_jax.decode import decode_ids
    from fractus_jax.train.probes import SPEECH_STEPS, Prober

    # an Atom run that streams its carry: chunks of seq_len from the carry before (decode mode "chunk")
    assert Prober(tiny(corpus_file), open_corpus(corpus_file)).speech_mode == {"mode": "chunk", "window": 16}
    assert tiny(corpus_file, "model.variant=parent", "model.bos_id=none").trained_decoding() == ("step", None)
    cfg = tiny(corpus_file, "carry_reset_every=1")   # every chunk from the initial carry: the window function
    prober = Prober(cfg, open_corpus(corpus_file))
    assert prober.speech_mode == {"mode": "window", "window": cfg.seq_len} and cfg.trained_window() == 16
    # a step of accum chunks read one after another from the initial carry: their window
    assert tiny(corpus_file, "carry_reset_every=1", "accum=3").trained_window() == 48
    assert tiny(corpus_file, "carry_reset_every=2", "accum=3").trained_window() is None
    state, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(0))
    params = move_off_init(state["params"], jax.random.PRNGKey(1))
    ids, _, n = decode_ids(params, prober.decode_cfg, prober.prompt, SPEECH_STEPS, mode="window", window=16)
    assert prober.run(params)["speech_text"] == decode(np.asarray(ids)[0, :int(n[0])])


def test_the_loop_lowers_the_step_once(corpus_file, tmp_path):
    """No recompilation inside the loop: 6 steps with saves and logging lower the step once
    (a shape, dtype or weak type drifting between steps would lower it again)."""
    from jax._src import dispatch, monitoring

    lowered = []

    def listen(event, _duration, **kw):
        if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
            lowered.append(kw.get("fun_name"))

    # A sequence length no other test uses: this program is new to the process.
    cfg = tiny(corpus_file, "seq_len=20", "max_steps=6", "save_every=2", "log_every=1")
    monitoring.register_event_duration_secs_listener(listen)
    try:
        last = train(cfg, tmp_path / "run")
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert last["step"] == 6
    assert lowered.count("jit(step)") == 1, lowered
    # Nor anything else the loop jits (state init, checkpoint staging): once each.
    assert len(lowered) == len(set(lowered)), lowered


# ----------------------------------------------------------------------------- config checks, messages, the run's end

@pytest.mark.parametrize("override, words", [
    ("lr=0", ["lr", "0.0"]), ("lr=-1e-3", ["lr", "-0.001"]), ("lr=nan", ["lr", "nan"]), ("lr=inf", ["lr", "inf"]),
    ("save_every=0", ["save_every", "0"]), ("max_steps=-1", ["max_steps", "-1"]),
    ("log_every=0", ["log_every", "0"]), ("keep_checkpoints=0", ["keep_checkpoints", "0"]),
    ("warmup_steps=-5", ["warmup_steps", "-5"]), ("clip_norm=0", ["clip_norm", "0.0"]),
    ("clip_norm=inf", ["clip_norm", "inf"]), ("eps=0", ["eps", "0.0"]), ("b2=1.0", ["b2", "1.0"]),
    ("weight_decay=-0.1", ["weight_decay", "-0.1"]), ("ce_chunk=0", ["ce_chunk", "0"]),
    ("probe_every=-1", ["probe_every", "-1"]), ("save_every_minutes=-1", ["save_every_minutes", "-1.0"]),
    ("ss_temperature=0", ["ss_temperature", "0.0"]), ("ss_p1=1.5", ["ss_p1", "1.5"]),
    ("carry_reset_every=-1", ["carry_reset_every", "-1"]), ("carry_reset_prob=1.5", ["carry_reset_prob", "1.5"]),
    ("carry_reset_prob=-0.1", ["carry_reset_prob", "-0.1"]), ("carry_reset_prob=nan", ["carry_reset_prob", "nan"]),
])
def test_obviously_invalid_values_are_refused_naming_the_field_and_value(override, words):
    with pytest.raises(cfg_lib.ConfigError) as e:
        cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [override])
    msg = str(e.value)
    assert msg.startswith(f"--set {override}: "), msg
    for word in words:
        assert word in msg, (word, msg)


def test_valid_edge_values_are_accepted():
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [
        "max_steps=0", "warmup_steps=0", "weight_decay=0", "probe_every=0", "save_every_minutes=0",
        "keep_checkpoints=1", "momentum=0", "lb_coef=0", "ss_rate=1", "carry_reset_every=0", "carry_reset_prob=1"])
    assert cfg.max_steps == 0 and cfg.keep_checkpoints == 1 and cfg.carry_reset_prob == 1.0


def test_an_unknown_key_suggests_the_nearest_field():
    with pytest.raises(cfg_lib.ConfigError, match="did you mean max_steps?"):
        cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), ["max_step=3"])
    with pytest.raises(cfg_lib.ConfigError, match="did you mean d_model?"):
        cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), ["model.d_modle=3"])
    with pytest.raises(cfg_lib.ConfigError) as e:
        cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), ["zzzzzz=3"])
    assert "did you mean" not in str(e.value) and "fields:" in str(e.value)


def test_carry_decay_settings_that_cannot_work_are_refused():
    """carry_decay: one γ in (0, 1] per level; learn_carry_decay needs where its weights start,
    below 1 (γ = sigmoid(logit) never reaches it). A saved config without either reads as the
    running sum the run computed."""
    tiny = cfg_lib.load_config("tiny")
    for bad, msg in (("model.carry_decay=0.9", "2 attention levels"),
                     ("model.carry_decay=0.9,x", "one number per attention level"),
                     ("model.carry_decay=0.9,1.5", r"in \(0, 1\]"),
                     ("model.learn_carry_decay=true", "needs carry_decay"),
                     ("model.carry_decay=0.9,1 model.learn_carry_decay=true", "must start below 1")):
        with pytest.raises(cfg_lib.ConfigError, match=msg):
            cfg_lib.apply_overrides(tiny, bad.split())
    learned = cfg_lib.apply_overrides(tiny, ["model.carry_decay=0.9,0.96", "model.learn_carry_decay=true"])
    assert learned.model.torch_kwargs()["learn_carry_decay"] is True
    assert "learn_carry_decay" not in tiny.model.torch_kwargs() and "carry_decay" not in tiny.model.torch_kwargs()
    saved = {k: v for k, v in dataclasses.asdict(tiny.model).items() if k not in ("carry_decay", "learn_carry_decay")}
    said = []
    assert EngineConfig.from_dict(saved, unknown="error", log=said.append) == tiny.model and not said


def test_packet_features_are_the_engines_and_old_configs_bring_theirs():
    """The features the forward receives are part of the engine's config (what every reader
    of the weights loads): `--set feats=true` sets model.packet_features, and a config saved
    before they moved there (a top-level "feats") brings its value into the engine."""
    tiny = cfg_lib.load_config("tiny")
    fed = cfg_lib.apply_overrides(tiny, ["feats=true"])
    assert fed.model.packet_features and fed.feats and fed.model.feeds_features and not tiny.feats
    old = fed.to_dict()
    old["feats"] = old["model"].pop("packet_features")
    said = []
    back = cfg_lib.TrainConfig.from_dict(old, unknown="error", log=said.append)
    assert back == fed and not said
    parent = cfg_lib.apply_overrides(tiny, ["feats=true", "model.variant=parent", "model.bos_id=none"])
    assert not parent.feats   # the parent engine takes no packet features


def test_a_missing_config_file_is_named_as_given(tmp_path):
    missing = str(tmp_path / "cfg.py")
    with pytest.raises(cfg_lib.ConfigError) as e:
        cfg_lib.load_config(missing)
    assert f"no such config file {missing} " in str(e.value) and ".py.py" not in str(e.value)
    with pytest.raises(cfg_lib.ConfigError, match="did you mean smoke?"):
        cfg_lib.load_config("smok")
    assert cfg_lib.load_config("tiny.py") == cfg_lib.load_config("tiny")   # fractus_jax/configs/tiny.py
    (tmp_path / "mine.py").write_text((ROOT / "fractus_jax" / "configs" / "tiny.py").read_text())
    assert cfg_lib.load_config(str(tmp_path / "mine")) == cfg_lib.load_config("tiny")


def test_a_saved_config_from_another_version_names_what_differs():
    cfg = cfg_lib.load_config("tiny")
    saved = cfg.to_dict()
    saved["renamed_knob"] = 1                      # a field this version does not know
    saved["model"]["old_engine_knob"] = 2
    del saved["lr"], saved["execution"]["remat"]   # fields added since: their defaults, with a note
    said = []
    got = cfg_lib.TrainConfig.from_dict(saved, log=said.append)
    assert got.lr == cfg_lib.TrainConfig.lr and got.execution.remat is False and got.seq_len == cfg.seq_len
    text = "\n".join(said)
    assert "renamed_knob" in text and "old_engine_knob" in text and "lr=0.0003" in text and "remat=False" in text
    with pytest.raises(cfg_lib.ConfigError, match="renamed_knob"):
        cfg_lib.TrainConfig.from_dict(saved, unknown="error", log=said.append)
    del saved["model"]["d_model"]                  # a required field missing: refused, named
    with pytest.raises(cfg_lib.ConfigError, match="config.model lacks fields this version needs: d_model"):
        cfg_lib.TrainConfig.from_dict(saved, log=said.append)
    # A PyTorch checkpoint's config: the other trainer's keys are expected, nothing is said.
    torch_config = {**cfg.model.torch_kwargs(), "lr": 3e-4, "batch": 8}
    said.clear()
    assert EngineConfig.from_dict(torch_config, unknown="ignore", log=said.append) == EngineConfig(
        **cfg.model.torch_kwargs())
    assert said == []
    # The unchanged config reads back silently.
    assert cfg_lib.TrainConfig.from_dict(cfg.to_dict(), log=said.append) == cfg and said == []


def test_a_refused_config_exits_2_with_one_error_line_and_no_note(tmp_path):
    for args in (["--config", str(tmp_path / "nope.py")], ["--config", "tiny", "--set", "lr=0"],
                 ["--config", "tiny", "--set", "max_step=3"]):
        out = _cli(*args, "--workdir", str(tmp_path / "run"))
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
        assert not (tmp_path / "run").exists()


def test_progress_bar_says_compiling_and_its_eta_starts_after_the_first_step(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    clock = [1000.0]
    bar = progress_lib.progress_bar(60, 0, True, "compiling the train step")
    bar._time = lambda: clock[0]
    bar.start_t = bar.last_print_t = clock[0]
    assert "compiling the train step" in stream.getvalue()
    clock[0] += 48.0                      # the first step waited for the compilation
    progress_lib.bar_compiled(bar, 1, 48.0)
    for _ in range(9):                    # then 4 steps a second
        clock[0] += 0.25
        bar.update(1)
    rate = bar.format_dict["rate"]
    assert rate == pytest.approx(4.0, rel=0.05), rate    # 50 steps left: an ETA of ~12 s, not 40 min
    assert bar.n == 10 and "compiled in 48s" in bar.desc
    bar.close()


def test_the_end_of_a_run_says_where_its_outputs_are(corpus_file, tmp_path):
    workdir = tmp_path / "run"
    args = ["--config", "tiny", "--workdir", str(workdir), f"--set=corpus={corpus_file}", "--set=eval_every=2",
            "--set=val_fraction=0.1", "--set=val_ids=256", "--set=max_steps=2", "--set=save_every=2",
            "--set=carry_reset_every=1"]
    out = subprocess.run([sys.executable, "-m", "fractus_jax.train", *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert "compiling the train step" in err and "compiled in" in err      # the bar says it
    assert f"run directory: {workdir}" in err
    assert f"last checkpoint: step 2 ({workdir / 'checkpoints' / '2'})" in err
    assert str(workdir / "metrics.jsonl") in err
    # at max_steps: the same command, further (its max_steps replaced)
    further = next(line for line in err.splitlines() if "train further:" in line)
    assert f"--workdir {workdir}" in further and "max_steps=4" in further and "max_steps=2" not in further
    # trained from a fresh carry at every step: the window it was trained on
    assert f"python -m fractus_jax.generate --ckpt {workdir} --prompt 'def main(' --mode window --window 16" in err
    assert f"python -m fractus_jax.convert export --ckpt {workdir}" in err
    assert "scripts/plot_metrics.py" in err and (ROOT / "scripts" / "plot_metrics.py").exists()
    assert f"watch: tensorboard --logdir {workdir / 'tensorboard'}" in err and (workdir / "tensorboard").is_dir()
    assert f"python -m fractus_jax.eval --ckpt {workdir}" in err
    held = next(line for line in err.splitlines() if line.startswith("held-out ("))
    assert "256 ids" in held and "val_bpb" in held and "the carry as trained (restarted at every chunk)" in held
    assert "carry streamed along each lane: val_ce" in held and "from a zero carry" not in held
    assert err.index("run directory:") > err.index("compiling the train step")   # at the end
    # stopped short of max_steps: the same command resumes
    summary = loop_summary(args[:-2] + ["--set=max_steps=5"], workdir)
    assert "resume (the same command): python -m fractus_jax.train --config tiny" in summary


def loop_summary(argv, workdir):
    from fractus_jax.train.__main__ import outputs_summary, parse_args
    args = parse_args(argv)
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), args.overrides)
    return outputs_summary(args, argv, cfg, ckpt_lib.read_manifest(workdir))


def _off_default(name, value):
    """Another valid value of a TrainConfig field than its default."""
    if name == "mesh":
        return cfg_lib.MeshConfig(data=2, fsdp=4)
    if name == "grow":
        return cfg_lib.GrowConfig(add_layers=1)
    if value is None:
        return 5
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + (3 if isinstance(value, int) else 0.5)
    if isinstance(value, str):
        return value + "x"
    raise AssertionError(f"the test has no other value for {name}={value!r}: add one")


def test_configs_apart_in_run_fields_share_one_step_that_reads_none_of_them(corpus_file):
    """The trainer keeps one step function and one initialisation per `for_programs()`,
    RUN_FIELDS at their defaults. That is sound only if neither reads a run field: built
    from a config whose every run field is off its default, each traces to the same jaxpr
    (the test fails on a step that starts reading one)."""
    cfg = tiny(corpus_file)
    assert cfg.corpus and cfg.max_steps != cfg_lib.TrainConfig.max_steps   # off the defaults already
    changed = dataclasses.replace(cfg, **{f.name: _off_default(f.name, f.default)
                                          for f in dataclasses.fields(cfg) if f.name in cfg_lib.RUN_FIELDS})
    assert all(getattr(changed, name) != getattr(cfg, name) for name in cfg_lib.RUN_FIELDS)
    assert step_lib.make_train_step(changed) is step_lib.make_train_step(cfg)

    state = state_lib.abstract_train_state(cfg)
    batch = {"ids": jax.ShapeDtypeStruct((cfg.accum, cfg.batch_size, cfg.seq_len + 1), jnp.int32)}
    built = [str(jax.make_jaxpr(step_lib._make_train_step(c))(state, batch)) for c in (changed, cfg.for_programs())]
    assert built[0] == built[1]
    key = jax.random.PRNGKey(0)
    inits = [str(jax.make_jaxpr(functools.partial(state_lib._init, c))(key)) for c in (changed, cfg.for_programs())]
    assert inits[0] == inits[1]


def test_the_train_step_traces_once_per_run_over_many_steps_and_a_resume(corpus_file, tmp_path, monkeypatch):
    """chex.assert_max_traces on the trainer's step function: 8 steps with saves and
    logging trace it once; the run resumed to 14 steps (a config with another max_steps:
    a new program) traces it once more, and no more."""
    traced = []
    make = step_lib.make_train_step

    @functools.lru_cache(maxsize=None)   # one function per config, as make_train_step
    def counted(cfg):
        inner = make(cfg)

        def step(state, batch):
            traced.append(cfg.max_steps)
            return inner(state, batch)

        return chex.assert_max_traces(step, n=1)

    monkeypatch.setattr(step_lib, "make_train_step", counted)   # jit_train_step's source of the step
    cfg = tiny(corpus_file, "max_steps=8", "save_every=4", "log_every=1")
    chex.clear_trace_counter()
    assert train(cfg, tmp_path / "run")["step"] == 8
    assert traced == [8]
    chex.clear_trace_counter()   # the resumed run's step is a new function (max_steps differs)
    assert train(cfg.__class__(**{**cfg.__dict__, "max_steps": 14}), tmp_path / "run")["step"] == 14
    assert traced == [8, 14]
    assert ckpt_lib.read_manifest(tmp_path / "run")["step"] == 14


def test_the_allocator_note_is_one_short_line(monkeypatch):
    from fractus_jax import hostmem
    monkeypatch.setattr(hostmem, "allocator", lambda: "glibc")
    for lib in ("libtcmalloc_minimal.so.4", None):
        monkeypatch.setattr(hostmem, "find_tcmalloc", lambda lib=lib: lib)
        note = hostmem.cpu_training_note("cpu")
        assert note.startswith("note: ") and "\n" not in note and len(note) <= 160, note
        assert "scripts/with_tcmalloc" in note and "docs/performance.md" in note


@pytest.mark.parametrize("overrides, words", [
    (["eval_every=2"], ["eval_every=2", "val_fraction", "val_corpus"]),
    (["lr_schedule=cosine"], ["lr_schedule=cosine", "decay_steps"]),
    (["lr_floor=0.1"], ["lr_floor=0.1", "above lr"]),
    (["val_fraction=0.1", "val_corpus=held.u16"], ["one of val_fraction"]),
    (["val_fraction=0.1", "eval_every=2", "val_ids=40"], ["held-out slice", "40 ids", "val_lanes=4"]),
    (["val_corpus=nope.u16"], ["val_corpus", "nope.u16"]),
])
def test_fields_that_conflict_are_refused_before_anything_is_written(overrides, words, corpus_file, tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainError) as e:
        prepare_lib.prepare(tiny(corpus_file, *overrides), tmp_path / "run", progress=False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "run").exists()


def test_the_order_of_overrides_does_not_matter():
    for order in (["eval_every=5", "val_fraction=0.01"], ["val_fraction=0.01", "eval_every=5"],
                  ["lr_schedule=linear", "decay_steps=10"], ["decay_steps=10", "lr_schedule=linear"]):
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), order)
        assert cfg.conflicts() == []


def test_the_constant_schedule_is_the_hand_written_warmup_bit_for_bit():
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), ["lr=3e-4", "warmup_steps=800"])
    steps = jnp.arange(1000, dtype=jnp.int32)
    got = np.asarray(jax.jit(jax.vmap(lambda s: state_lib.learning_rate(cfg, s)))(steps))
    # the expression every run before schedules trained with
    want = np.asarray(jax.jit(jax.vmap(lambda s: 3e-4 * jnp.minimum(1.0, (s + 1) / 800)))(steps))
    np.testing.assert_array_equal(got, want)
    # and not optax's line, which rounds differently (the reason it stays hand-written)
    optax_line = np.asarray(jax.vmap(optax.linear_schedule(3e-4 / 800, 3e-4, 799))(steps))
    assert np.any(optax_line != got)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decaying_schedules_warm_up_then_decay_to_the_floor(schedule):
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [
        f"lr_schedule={schedule}", "lr=1e-3", "lr_floor=1e-4", "warmup_steps=4", "decay_steps=10"])
    lr = [float(state_lib.learning_rate(cfg, jnp.int32(s))) for s in range(20)]
    np.testing.assert_allclose(lr[:4], [2.5e-4, 5e-4, 7.5e-4, 1e-3], rtol=1e-6)
    assert lr[4] == pytest.approx(1e-3, rel=1e-6)                        # the decay starts at the peak
    assert all(a > b for a, b in zip(lr[4:14], lr[5:15]))                # falls every step
    np.testing.assert_allclose(lr[14:], 1e-4, rtol=1e-6)                 # then holds the floor
    decay = (optax.cosine_decay_schedule(1e-3, 10, alpha=0.1) if schedule == "cosine"
             else optax.linear_schedule(1e-3, 1e-4, 10))
    np.testing.assert_allclose(lr[4:], [float(decay(k)) for k in range(16)], rtol=1e-6)


def test_a_resumed_run_continues_the_same_learning_rate_curve(corpus_file, tmp_path):
    cfg = tiny(corpus_file, "lr_schedule=cosine", "decay_steps=3", "lr_floor=3e-4", "max_steps=6", "save_every=3")
    train(cfg, tmp_path / "straight")
    logs = []
    train(cfg_lib.apply_overrides(cfg, ["max_steps=3"]), tmp_path / "split")
    plan = prepare_lib.prepare(cfg, tmp_path / "split", progress=False)
    assert plan.resume_step == 3
    loop.run(plan, progress=False, log=logs.append)
    assert not any("schedule differs" in line for line in logs)

    def lrs(d):
        return [(m["step"], m["lr"]) for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]

    straight, split = lrs(tmp_path / "straight"), lrs(tmp_path / "split")
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    assert straight == split
    values = [v for _, v in straight]
    assert values[2] > values[3] > values[4] > values[5] == pytest.approx(3e-4, rel=1e-6)
    # the saved config holds the schedule; a resume with another one says so
    assert ckpt_lib.read_manifest(tmp_path / "split")["config"]["lr_schedule"] == "cosine"
    note = prepare_lib.schedule_change_note(cfg.to_dict(), cfg_lib.apply_overrides(cfg, ["lr_floor=1e-4"]), 6)
    assert "lr_floor 0.0003 -> 0.0001" in note and "step 6" in note
    assert prepare_lib.schedule_change_note({"lr": cfg.lr, "warmup_steps": cfg.warmup_steps}, tiny(corpus_file), 6) is None


def _unreached(tree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0] if not v}


def test_parameters_the_loss_does_not_reach_are_left_alone_and_old_opt_states_resume(corpus_file, tmp_path):
    """The mask is the loss's own reach (no names): the heads, atom_feat without features
    and the buffers get no update, no decay and no moments; features make atom_feat
    trained; step_unreached steps them all, in the layout of checkpoints written before
    the mask, which restore into the masked layout."""
    from fractus_jax.train import reach

    cfg = tiny(corpus_file)
    heads = {f"['{h}']['{w}']" for h in ("confidence_head", "salience_head") for w in ("weight", "bias")}
    buffers = {"['blocks']['attn']['level_offsets']", "['blocks']['moe']['expert_phases']"}
    feat = {"['atom_feat']['weight']", "['atom_feat']['bias']"}
    assert _unreached(reach.loss_reach(cfg)) == heads | buffers | feat
    assert _unreached(reach.loss_reach(cfg_lib.apply_overrides(cfg, ["feats=true"]))) == heads | buffers

    mesh = sharding.make_mesh()
    state, shardings = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(0))
    # nonzero everywhere: weight decay would show; a gradient even for the unreached: still left alone
    params, grads = jax.jit(lambda ps: (jax.tree.map(lambda p: p + 0.1, ps),
                                        jax.tree.map(lambda p: jnp.full_like(p, 0.01), ps)))(state["params"])
    state = {**state, "params": params}

    def apply(tx, opt_state):   # one compiled update (op by op, optax's tree maps compile hundreds)
        return jax.jit(lambda p, o, g: step_lib._apply(tx, p, o, g, 3e-3))(params, opt_state, grads)

    new_params, opt_state, _, _ = apply(state_lib.make_optimizer(cfg, params), state["opt_state"])
    moved = {jax.tree_util.keystr(p) for p, a, b in zip(
        *zip(*jax.tree_util.tree_flatten_with_path(params)[0]), jax.tree.leaves(new_params)) if not np.array_equal(a, b)}
    all_leaves = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert moved == all_leaves - heads - buffers - feat
    mu = opt_state.inner_states["train"].inner_state[1][0].mu
    assert {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0]} == moved

    old_cfg = cfg_lib.apply_overrides(cfg, ["step_unreached=true"])
    old = state_lib.make_optimizer(old_cfg, params)
    old_params, old_opt, _, _ = apply(old, jax.jit(old.init)(params))
    assert not np.array_equal(old_params["confidence_head"]["weight"], params["confidence_head"]["weight"])
    ckpt = ckpt_lib.RunCheckpointer(tmp_path / "run", log=lambda m: None)
    ckpt.save({**state, "params": old_params, "opt_state": old_opt}, {"step": 1})
    ckpt.close()
    restored, _ = ckpt_lib.RunCheckpointer(tmp_path / "run", read_only=True).restore(
        ckpt_lib.abstract_with_shardings(state_lib.abstract_train_state(cfg), shardings), 1)
    old_adam = old_opt.inner_states["train"].inner_state[1][0]
    new_adam = restored["opt_state"].inner_states["train"].inner_state[1][0]
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(opt_state)
    assert int(new_adam.count) == int(old_adam.count) == 1
    for name in ("mu", "nu"):
        old_leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(getattr(old_adam, name))[0]}
        for p, x in jax.tree_util.tree_flatten_with_path(getattr(new_adam, name))[0]:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(old_leaves[jax.tree_util.keystr(p)]))

    # Resuming a masked run with a config that steps more than it did is refused (no moments to resume).
    masked = cfg.to_dict()
    assert prepare_lib.moments_lacking(masked, cfg) == []
    assert set(prepare_lib.moments_lacking(masked, old_cfg)) == heads | feat
    assert prepare_lib.moments_lacking({k: v for k, v in masked.items() if k != "step_unreached"}, old_cfg) == []
    assert prepare_lib.moments_lacking(old_cfg.to_dict(), cfg) == []


def test_init_from_starts_a_fresh_run_from_another_runs_weights(corpus_file, tmp_path, monkeypatch):
    """init_from=DIR: the new run's first step starts from DIR's weights with fresh optimizer
    moments at step 0 (the step written out here from those weights gives its step-1 state),
    its own lanes from offset 0, its state built around those weights (no fresh state made
    to be overwritten); the source run is left as it was. A source of another engine is
    refused before anything is written."""
    source = tiny(corpus_file, "max_steps=3", "save_every=3", "lr=0.01")
    train(source, tmp_path / "source")
    weights, _ = ckpt_lib.load_for_inference(tmp_path / "source")
    cfg = tiny(corpus_file, "max_steps=1", "save_every=1", f"init_from={tmp_path / 'source'}")
    for bad, words in ((tiny(corpus_file, "model.n_layers=3", f"init_from={tmp_path / 'source'}"),
                        "n_layers: 2 there, 3 here"),
                       (tiny(corpus_file, f"init_from={tmp_path / 'nowhere'}"), f"init_from={tmp_path / 'nowhere'}")):
        with pytest.raises(TrainError, match=words):
            prepare_lib.prepare(bad, tmp_path / "refused", progress=False)
        assert not (tmp_path / "refused").exists()
    logs = []
    with monkeypatch.context() as m:
        def no_fresh_state(*a, **k):
            raise AssertionError("a run started from weights initialised a state of its own")
        m.setattr(state_lib, "create_train_state", no_fresh_state)
        loop.run(prepare_lib.prepare(cfg, tmp_path / "run", progress=False), progress=False, log=logs.append)
    assert any("weights from" in m and "fresh optimizer moments" in m for m in logs), logs
    got, _ = restore(tmp_path / "run", cfg)
    assert int(got["step"]) == 1

    mesh = sharding.make_mesh()
    state = state_lib.state_around(cfg, jax.tree.map(jnp.copy, weights), state_lib.train_state_shardings(cfg, mesh))
    assert int(optax.tree_utils.tree_get(state["opt_state"], "count")) == 0
    ids = prepare_lib.prepare(cfg, tmp_path / "probe", progress=False).train.ids
    from_source, _ = jax.jit(step_lib.make_train_step(cfg))(
        state, {"ids": LaneReader(ids, cfg.batch_size, cfg.seq_len).read(0)[0]})
    # every element within 2% of the step's learning rate of the same step taken here (two
    # programs: measured 1.2e-5 at lr 1.5e-3, 0.8%; AdamW's first step turns the rounding of
    # a gradient element that nearly cancels into a share of lr, one side only)
    lr = float(state_lib.learning_rate(cfg, 0))
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(jax.device_get(from_source["params"]))):
        assert float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) <= 0.02 * lr
    # the control: the config's own initialisation is far from where the run started
    fresh, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(cfg.seed))
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(fresh["params"]), jax.tree.leaves(got["params"]))) > 1e-3
    again, _ = ckpt_lib.load_for_inference(tmp_path / "source")
    jax.tree.map(np.testing.assert_array_equal, weights, again)
