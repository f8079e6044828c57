"""What a training step computes, against definitions written here: the loss (CE, load
balance, the anti-repeat term), scheduled sampling's inputs, and its second update."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fractus_jax as fj
from fractus_jax import model, sharding
from fractus_jax.atom.corpus import build_corpus, open_corpus
from fractus_jax.atom.features import FEATURE_CONTEXT, atom_features
from fractus_jax.eval.__main__ import main as eval_main
from fractus_jax.lanes import LaneReader
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train import objective
from fractus_jax.train import probes as probes_lib
from fractus_jax.train import step as step_lib
from fractus_jax.train.data import chunk_features
from engine_testing import move_off_init


def tiny(*overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), list(overrides))


def loss_written_out(params, carry, inputs, targets, cfg, ce_weight=1.0):
    """ce_weight · mean next-id CE + lb_coef · lb + repeat_coef · mean p(next = the current
    input id), from the engine's logits."""
    logits, lb, _ = model.forward_chunk(params, carry, inputs, cfg.model)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, targets[..., None], -1).mean()
    repeat = jnp.exp(jnp.take_along_axis(logp, inputs[..., None], -1)).mean()
    return ce_weight * ce + cfg.lb_coef * lb + cfg.repeat_coef * repeat


def test_the_loss_is_ce_plus_load_balance_plus_the_anti_repeat_term():
    cfg = tiny("repeat_coef=0.7", "lb_coef=0.3", "ce_chunk=24", "model.capacity_factor=none")
    B, C = cfg.batch_size, cfg.seq_len
    with jax.enable_x64(True):
        params = move_off_init(fj.init_params(cfg.model, jax.random.PRNGKey(0), jnp.float64), jax.random.PRNGKey(1))
        ids = jax.random.randint(jax.random.PRNGKey(2), (B, C + 1), 0, 256)
        carry = fj.init_state(cfg.model, B, jnp.float64)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        got_loss, got_grad = jax.jit(jax.value_and_grad(
            lambda p: objective.train_loss(p, carry, inputs, targets, None, cfg, 0.5)[0]))(params)
        want_loss, want_grad = jax.jit(jax.value_and_grad(
            lambda p: loss_written_out(p, carry, inputs, targets, cfg, 0.5)))(params)
        without = loss_written_out(params, carry, inputs, targets, tiny("repeat_coef=0", "lb_coef=0"), 0.5)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-10 * abs(float(want_loss))
    assert abs(float(want_loss) - float(without)) > 1e-3   # the lb (and repeat) terms count
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), got_grad, want_grad)


def test_scheduled_sampling_replaces_inputs_by_the_previous_prediction_at_its_rate():
    # a near-zero temperature makes the sample the prediction's argmax: checkable exactly
    cfg = tiny("ss_p0=0", "ss_p1=1", "ss_ramp=15", "ss_temperature=1e-4", "batch_size=64")
    A, B, C = 1, cfg.batch_size, cfg.seq_len
    params = fj.init_params(cfg.model, jax.random.PRNGKey(0))
    inputs = jax.random.randint(jax.random.PRNGKey(1), (A, B, C), 0, 256)
    h = jax.random.normal(jax.random.PRNGKey(2), (A, B, C, cfg.model.d_model))
    draws = jax.random.split(jax.random.PRNGKey(3), 16)

    def mixes(c):
        """(draws, B, C): mix_inputs under 16 keys, so 1024 draws a position."""
        return np.asarray(jax.jit(jax.vmap(lambda k: step_lib.mix_inputs(c, params, inputs, h, k)[0]))(draws))

    mixed = mixes(cfg)
    logits = np.asarray(model.logits_from_hidden(params, h[0]), np.float64)   # (B, C, V)
    prediction = logits.argmax(-1)
    inputs = np.asarray(inputs)
    replaced = mixed[0] != inputs[0]
    assert not replaced[:, 0].any()
    # a replaced input is a sample of softmax(logits at t-1 / T): the argmax, or an id whose
    # logit is within a few T·(Gumbel noise) of it (near ties)
    rows, cols = np.nonzero(replaced[:, 1:])
    chosen = logits[rows, cols, mixed[0][:, 1:][rows, cols]]
    assert (chosen >= logits[rows, cols].max(-1) - 50 * cfg.ss_temperature).all()
    assert (mixed[0][:, 1:][rows, cols] == prediction[rows, cols]).mean() > 0.95

    # where the prediction equals the input a replacement is unseen: the rate is read on the others
    seen = prediction[:, :-1] != inputs[0][:, 1:]                        # (B, C-1)
    n = mixed.shape[0] * seen.sum(0)                                     # about 1000 draws a position

    def rate(m):
        """The share of inputs replaced at each position 1..C-1, among the seen ones."""
        return ((m[:, :, 1:] != inputs[0][:, 1:]) & seen).sum((0, 1)) / n

    # the rate at position t is ss_prob(t) = t/15: within 4 binomial standard deviations
    want = np.minimum(np.arange(1, C) / 15, 1.0)

    def within(r):
        return bool((np.abs(r - want) <= 4 * np.sqrt(want * (1 - want) / n) + 1 / n).all())

    got = rate(mixed)
    assert within(got), (got, want)
    assert got[-1] == 1.0 and got[0] < 0.15
    # the control: a ramp of 20 positions instead of 15 is caught at every bound above
    assert not within(rate(mixes(tiny("ss_p0=0", "ss_p1=1", "ss_ramp=20", "ss_temperature=1e-4", "batch_size=64"))))


def test_the_scheduled_sampling_update_is_a_second_step_at_half_the_ce():
    cfg = tiny("ss_rate=1", "optimizer=sgd", "lr=0.05", "model.capacity_factor=none")
    state, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, cfg.batch_size, cfg.seq_len + 1), 0, 256)
    new_state, metrics = jax.jit(step_lib.make_train_step(cfg))(state, {"ids": ids})
    assert int(metrics["ss_ran"]) == 1

    # written out: a teacher-forced update, then one at 0.5·CE on the mixed inputs from the
    # same starting carry, applied to the first update's parameters
    inputs, targets = ids[0, :, :-1], ids[0, :, 1:]
    p0, carry0 = state["params"], state["carry"]
    tx = state_lib.make_optimizer(cfg, p0)
    lr = state_lib.learning_rate(cfg, state["step"])

    def update(p, opt, loss_fn):
        g = jax.grad(loss_fn)(p)
        u, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, jax.tree.map(lambda x: lr * x, u)), opt

    @jax.jit
    def written_out(p0, opt0):
        p1, opt1 = update(p0, opt0, lambda p: loss_written_out(p, carry0, inputs, targets, cfg))
        h, _, _ = model.forward_hidden(p0, carry0, inputs, cfg.model)
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), state["step"])
        _, k_mix = jax.random.split(key)
        mixed = step_lib.mix_inputs(cfg, p0, inputs[None], h[None], k_mix)[0]
        p2, _ = update(p1, opt1, lambda p: loss_written_out(p, carry0, mixed, targets, cfg, 0.5))
        return p1, p2

    p1, p2 = written_out(p0, state["opt_state"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-7), new_state["params"], p2)
    # the second update moved the weights beyond that tolerance
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), p2, p1)
    assert max(jax.tree.leaves(moved)) > 1e-4


def test_a_run_with_packet_features_learns_a_memorisable_text_and_logs_its_own_ce(tmp_path, capsys):
    """The trainer, fed Atom packet features, on a text it can memorise: the loss falls; the
    logged ce_tf of a step equals the CE written out here from the checkpoint before it (its
    weights, carry and the batch its lane offset names); its val_corpus file is scored as
    the eval command scores it."""
    text = "the quick brown fox jumps over the lazy dog; " * 6
    build_corpus([_write(tmp_path / "a.txt", text * 40)], tmp_path / "a.u16", progress=False, log=lambda m: None)
    build_corpus([_write(tmp_path / "b.txt", text * 3)], tmp_path / "held.u16", progress=False, log=lambda m: None)
    cfg = tiny(f"corpus={tmp_path / 'a.u16'}", "feats=true", f"val_corpus={tmp_path / 'held.u16'}",
               "eval_every=30", "val_ids=1024", "max_steps=30", "save_every=10", "lr=1e-2", "warmup_steps=2",
               "model.capacity_factor=none")
    workdir = tmp_path / "run"
    loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=lambda m: None)
    log = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    ce = [m["ce_tf"] for m in log]
    assert np.mean(ce[-5:]) < np.mean(ce[:5]) - 1.0, ce

    # step 21's logged CE, from the checkpoint at step 20 and the batch step 21 read
    ck = ckpt_lib.RunCheckpointer(workdir, read_only=True)
    try:
        state, meta = ck.restore(state_lib.abstract_train_state(cfg), 20)
    finally:
        ck.close()
    reader = LaneReader(open_corpus(tmp_path / "a.u16").ids, cfg.batch_size, cfg.seq_len)
    chunks, _, context = reader.read(int(meta["start_token_next"]), left=FEATURE_CONTEXT)
    feats = chunk_features(chunks, context)[0]
    inputs, targets = jnp.asarray(chunks[0, :, :-1]), jnp.asarray(chunks[0, :, 1:])
    logits, _, _ = model.forward_chunk(state["params"], state["carry"], inputs, cfg.model, jnp.asarray(feats))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    want = float(-jnp.take_along_axis(logp, targets[..., None], -1).mean())
    without_feats, _, _ = model.forward_chunk(state["params"], state["carry"], inputs, cfg.model)
    assert float(jnp.abs(without_feats - logits).max()) > 1e-3   # the features enter the step
    got = next(m["ce_tf"] for m in log if m["step"] == 21)
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)

    # the probes feed the features too: the teacher-forced CE is the rows' with their features
    corpus = open_corpus(tmp_path / "a.u16")
    prober = probes_lib.Prober(cfg, corpus)
    got = prober.run(state["params"])
    rows = np.asarray(prober.rows)
    with_feats = probes_lib._teacher_forced(state["params"], prober.rows, prober.cfg, prober.ex,
                                            jnp.asarray(atom_features(rows[:, :-1])))
    assert abs(got["probe_ce"] - float(with_feats["ce"])) <= 1e-5
    blind = probes_lib.Prober(cfg_lib.apply_overrides(cfg, ["model.packet_features=false"]), corpus).run(state["params"])
    assert abs(blind["probe_ce"] - got["probe_ce"]) > 1e-3 and blind["ar_ce"] != got["ar_ce"]

    # the val_corpus file: logged at step 30 as the eval command scores it
    assert eval_main(["--ckpt", str(workdir), "--ids", "1024", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    logged = next(m for m in log if m["step"] == 30)
    assert out["corpus"].endswith("held.u16 (the run's val_corpus)")
    assert abs(out["ce"] - logged["val_ce"]) <= 1e-5 and abs(out["bpb"] - logged["val_bpb"]) <= 1e-5


def _write(path, text):
    path.write_text(text)
    return path


def test_the_repeat_prob_metric_is_the_mean_probability_of_repeating_the_input():
    """repeat_prob, logged each step: the mean over positions of softmax(logits)[input id],
    the probability the model gives to repeating the id it reads, written out here from the
    step's weights and carry (and not the probability of the target, which CE reads)."""
    cfg = tiny("model.capacity_factor=none")
    state, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(0))
    state["params"] = move_off_init(state["params"], jax.random.PRNGKey(4))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, cfg.batch_size, cfg.seq_len + 1), 0, 256)
    ids = ids.at[:, :, 1::2].set(ids[:, :, 0::2][:, :, :ids.shape[2] // 2])     # repeats to find
    logits, _, _ = jax.jit(fj.forward_chunk, static_argnums=3)(state["params"], state["carry"], ids[0, :, :-1],
                                                                cfg.model)
    p = jax.nn.softmax(np.asarray(logits, np.float64), axis=-1)
    want = float(np.take_along_axis(p, np.asarray(ids[0, :, :-1])[..., None], -1).mean())
    target = float(np.take_along_axis(p, np.asarray(ids[0, :, 1:])[..., None], -1).mean())
    _, metrics = jax.jit(step_lib.make_train_step(cfg))(state, {"ids": ids})
    assert abs(float(metrics["repeat_prob"]) - want) <= 1e-6 * max(want, 1e-3), (float(metrics["repeat_prob"]), want)
    assert abs(want - target) > 1e-5       # the control: the target's probability is another figure, far outside the bound
