"""The carry-reset schedule (carry_reset_every, carry_reset_prob) on the tiny config."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fractus_jax import model, sharding
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train import step as step_lib

from engine_testing import assert_trained_alike

# Two programs sum in other orders: measured up to 2.9e-5 of a leaf's change over the step
# (bit-equal only where XLA happens to fuse both alike); a carry left unreset is not within
# the bound (checked below).
ALIKE = 1e-3


def tiny(corpus_file, *overrides):
    # Exact routing: rows do not compete for expert capacity, so each row's carry depends
    # on its own inputs only (the per-row comparisons below are then meaningful).
    cfg = cfg_lib.load_config("tiny")
    return cfg_lib.apply_overrides(cfg, [f"corpus={corpus_file}", "model.capacity_factor=none", *overrides])


def _ids(cfg, seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 256, (cfg.accum, cfg.batch_size, cfg.seq_len + 1)), jnp.int32)


@pytest.fixture(scope="module")
def warm_state(corpus_file):
    """A train state after two plain steps: a non-zero carry in every row, at step 2."""
    cfg = tiny(corpus_file)
    state, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(0))
    step = jax.jit(step_lib.make_train_step(cfg))
    for seed in (1, 2):
        state, _ = step(state, {"ids": _ids(cfg, seed)})
    assert int(state["step"]) == 2
    for k in ("thought", "S", "z"):
        rows = _rows(state["carry"], k)
        assert (np.abs(rows.reshape(cfg.batch_size, -1)).max(1) > 0).all(), k
    return state


def _rows(carry, k):
    """carry[k] with its row axis first."""
    return np.moveaxis(np.asarray(carry[k]), model.STATE_ROW_AXIS[k], 0)


def _run(cfg, state, seed=3):
    return jax.jit(step_lib.make_train_step(cfg))(state, {"ids": _ids(cfg, seed)})


def _fresh(cfg, state):
    """The state with the initial carry, placed as the state's own carry: the step then
    runs the program it ran on the state (one compilation, not one per placement)."""
    placed = jax.tree.map(lambda a: a.sharding, state["carry"])
    return {**state, "carry": jax.device_put(model.init_state(cfg.model, cfg.batch_size), placed)}


def _equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _alike(got, want, start):
    """One step compiled as two programs (one of them with the schedule's select): equal to
    float32 rounding, the state leaf by leaf against that leaf's own change over the step
    (engine_testing.assert_trained_alike), the metrics to a relative 1e-5."""
    assert_trained_alike(got[0], want[0], start, ALIKE)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5), got[1], want[1])


def test_a_reset_step_equals_a_step_from_the_initial_carry(corpus_file, warm_state):
    plain = tiny(corpus_file)
    reset = tiny(corpus_file, "carry_reset_every=1")
    got = _run(reset, warm_state)
    want = _run(plain, _fresh(plain, warm_state))
    streamed = _run(plain, warm_state)
    with pytest.raises(AssertionError):   # the bound tells a carry left unreset apart
        assert_trained_alike(streamed[0], want[0], _fresh(plain, warm_state), ALIKE)
    _alike(got, want, _fresh(plain, warm_state))


def test_a_step_off_the_schedule_equals_todays_step(corpus_file, warm_state):
    plain = tiny(corpus_file)
    assert step_lib.reset_rows(plain, warm_state["step"], jax.random.PRNGKey(0)) is None   # today's program
    off = tiny(corpus_file, "carry_reset_every=3")    # step 2 is no multiple of 3
    _alike(_run(off, warm_state), _run(plain, warm_state), warm_state)


def test_per_row_reset_touches_only_those_rows(corpus_file, warm_state):
    plain = tiny(corpus_file)
    cfg = tiny(corpus_file, "carry_reset_prob=0.5", "seed=3")
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), warm_state["step"])
    rows = np.asarray(step_lib.reset_rows(cfg, warm_state["step"], key))
    assert rows.any() and not rows.all(), rows    # a mix: both kinds of row are checked
    kept = model.reset_state_rows(warm_state["carry"], rows)
    for k in model.STATE_ROW_AXIS:
        a, b = _rows(kept, k), _rows(warm_state["carry"], k)
        assert (a[rows] == 0).all(), k
        np.testing.assert_array_equal(a[~rows], b[~rows])

    got, _ = _run(cfg, warm_state)
    streamed, _ = _run(plain, warm_state)
    fresh, _ = _run(plain, _fresh(plain, warm_state))
    for k in ("thought", "S", "z"):   # the carried phase is the chunk's last, whatever the carry
        g, s, f = (_rows(x["carry"], k) for x in (got, streamed, fresh))
        # Other rows in the batch, other shapes in the MoE dispatch: equal to rounding.
        np.testing.assert_allclose(g[~rows], s[~rows], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g[rows], f[rows], rtol=1e-5, atol=1e-6)
        assert np.abs(s[rows] - f[rows]).max() > 1e-4, k


def test_reset_draws_are_a_function_of_seed_and_step(corpus_file):
    cfg = tiny(corpus_file, "carry_reset_prob=0.25", "batch_size=64")

    def draw(seed, step):
        c = cfg_lib.apply_overrides(cfg, [f"seed={seed}"])
        key = jax.random.fold_in(jax.random.PRNGKey(c.seed), step)
        return np.asarray(step_lib.reset_rows(c, jnp.asarray(step, jnp.int32), key))

    np.testing.assert_array_equal(draw(0, 5), draw(0, 5))
    assert (draw(0, 5) != draw(0, 6)).any() and (draw(0, 5) != draw(1, 5)).any()
    frac = np.mean([draw(0, s).mean() for s in range(8)])
    assert 0.1 < frac < 0.4, frac
    every = tiny(corpus_file, "carry_reset_every=4")
    assert [bool(step_lib.reset_rows(every, jnp.asarray(s), None).all()) for s in range(6)] == \
        [True, False, False, False, True, False]


def _train(cfg, workdir):
    return loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=lambda m: None)


def _restore(workdir, cfg):
    ck = ckpt_lib.RunCheckpointer(workdir, read_only=True)
    try:
        return ck.restore(state_lib.abstract_train_state(cfg), None)
    finally:
        ck.close()


def test_resume_with_resets_is_bit_exact(corpus_file, tmp_path):
    cfg = tiny(corpus_file, "carry_reset_prob=0.3", "carry_reset_every=4", "max_steps=6", "save_every=3")
    _train(cfg, tmp_path / "straight")
    _train(cfg_lib.apply_overrides(cfg, ["max_steps=3"]), tmp_path / "split")
    _train(cfg, tmp_path / "split")
    (a, meta_a), (b, meta_b) = _restore(tmp_path / "straight", cfg), _restore(tmp_path / "split", cfg)
    assert meta_a["step"] == meta_b["step"] == 6
    for part in ("params", "opt_state", "carry"):
        _equal(a[part], b[part])
    lines = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]


def test_the_table_script_prints_a_row_beside_the_bigram(corpus_file, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "carry_table.py"
    spec = importlib.util.spec_from_file_location("carry_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    sets = [f"corpus={corpus_file}", "val_fraction=0.1", "val_ids=600", "val_lanes=2", "model.capacity_factor=none",
            "batch_size=4", "seq_len=16"]   # --set comes after the table's shape: tiny's own
    argv = ["--config", "tiny", "--table", "8x128", "--rows", "every 4", "--json"] + [a for s in sets for a in ("--set", s)]
    assert table.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "in 2 lanes of 16-id chunks" in lines[0], lines   # --set applies after the table's shape
    assert lines[3].startswith("| reset every 4 steps, lr 3e-3, 60 steps | 60 | "), lines
    assert lines[4].startswith("| bigram counts"), lines
    out = json.loads(lines[-1])
    assert [r["row"] for r in out["rows"]] == ["reset every 4 steps, lr 3e-3, 60 steps"]
    row = out["rows"][0]
    assert 0 < row["val_bpb"] < 20 and out["bigram"]["n_bytes"] > 0
    # restarted every 4 chunks as it trained: neither the warm carry's figure nor the fresh one's
    assert len({row["val_bpb"], row["val_bpb_warm"], row["val_bpb_no_carry"]}) == 3
    assert table.main(["--config", "tiny", "--set", f"corpus={corpus_file}"]) == 2   # nothing held out
    with pytest.raises(SystemExit):
        table.main(["--config", "tiny", "--table", "9x9"])


def test_every_table_row_sets_the_carry_it_measures():
    """A row names its carry (decay, learned or not) and its schedule itself: applied on smoke
    and on smoke with another carry, every row of every table gives the same config, and
    each applies (a row that relied on the config's default broke when smoke changed)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "carry_table.py"
    spec = importlib.util.spec_from_file_location("carry_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    smoke = cfg_lib.load_config("smoke")
    other = cfg_lib.apply_overrides(smoke, ["model.learn_carry_decay=false", "model.carry_decay=0.5,0.6"])
    assert smoke.model.learn_carry_decay   # else the two bases do not differ where it matters
    for name, (shape, rows) in table.TABLES.items():
        for label, overrides in rows:
            a, b = (cfg_lib.apply_overrides(base, shape + overrides) for base in (smoke, other))
            assert (a.model.carry_decay, a.model.learn_carry_decay) == (b.model.carry_decay,
                                                                         b.model.learn_carry_decay), (name, label)
            assert a.lr_schedule == b.lr_schedule and a.decay_steps == b.decay_steps, (name, label)


def test_generate_decodes_as_the_run_trained(corpus_file, tmp_path, capsys):
    """A run whose every step started from the initial carry, reading accum=2 chunks a step,
    trained the window function of 2·seq_len ids: `generate` without --mode decodes so; a
    run that streams its carry decodes in chunks of seq_len carrying the state (its trained
    function); --mode and --window still choose."""
    from fractus_jax import generate as gen

    def decoded(workdir, *extra):
        assert gen.main(["--ckpt", str(workdir), "--prompt", "def f(", "--max-new", "3", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    cfg = tiny(corpus_file, "carry_reset_every=1", "accum=2", "max_steps=1", "save_every=1")
    _train(cfg, tmp_path / "window")
    assert cfg.trained_window() == 2 * cfg.seq_len
    got = decoded(tmp_path / "window")
    assert (got["mode"], got["window"]) == ("window", 2 * cfg.seq_len)
    assert (decoded(tmp_path / "window", "--mode", "step")["mode"]) == "step"
    assert decoded(tmp_path / "window", "--window", "5")["window"] == 5
    _train(cfg_lib.apply_overrides(cfg, ["carry_reset_every=0"]), tmp_path / "streamed")
    got = decoded(tmp_path / "streamed")
    assert (got["mode"], got["window"]) == ("chunk", cfg.seq_len)
