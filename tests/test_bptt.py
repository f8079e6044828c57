"""bptt_chunks=K: the gradient flows through the carry across K consecutive chunks of each
lane (the carry entering a group of K detached, as it enters every chunk with K=1):
float64 autodiff of the unrolled chunks, resume and the sharded step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fractus_jax as fj
from fractus_jax import model, sharding
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train import step as step_lib
from engine_testing import move_off_init, restore_state


def tiny(*overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), list(overrides))


def unrolled_grads(params, carry, inputs, targets, cfg, K):
    """The mean of the A chunks' losses (CE + lb_coef·lb, written here from the engine's
    logits), the carry flowing from chunk to chunk and detached at every K-th: written out,
    differentiated by jax.grad."""
    def loss(p):
        total, c = 0.0, carry
        for a in range(inputs.shape[0]):
            if a % K == 0:
                c = jax.lax.stop_gradient(c)
            h, aux, c = model.forward_hidden(p, c, inputs[a], cfg.model, carry_grad=True)
            logp = jax.nn.log_softmax(model.logits_from_hidden(p, h), axis=-1)
            ce = -jnp.take_along_axis(logp, targets[a][..., None], axis=-1).mean()
            total = total + ce + cfg.lb_coef * aux.lb
        return total / inputs.shape[0]
    return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize("accum, K, decay", [(4, 2, None), (6, 3, "0.8,0.95"), (4, 2, "learned")],
                         ids=["accum4-K2", "accum6-K3-carry-decay", "accum4-K2-learned-carry-decay"])
def test_bptt_gradients_are_autodiff_of_the_unrolled_chunks_in_float64(accum, K, decay):
    """Several groups of K chunks: the detach between groups, the grouping and the mean over
    the step's chunks, against jax.grad of the chunks written out (with the carry that
    forgets too, fixed or learned: the learned γ's gradient crosses the chunks as well); each
    broken variant of that definition is caught at the same tolerance."""
    decay_set = {None: [], "learned": ["model.carry_decay=0.8,0.95", "model.learn_carry_decay=true"]}.get(
        decay, [f"model.carry_decay={decay}"])
    cfg = tiny(f"accum={accum}", f"bptt_chunks={K}", "model.capacity_factor=none", *decay_set)
    detached = cfg_lib.apply_overrides(cfg, ["bptt_chunks=1"])
    B, C = cfg.batch_size, cfg.seq_len
    with jax.enable_x64(True):
        params = move_off_init(fj.init_params(cfg.model, jax.random.PRNGKey(0), jnp.float64), jax.random.PRNGKey(1))
        ids = jax.random.randint(jax.random.PRNGKey(2), (accum + 1, B, C + 1), 0, 256)
        # a carry that holds something: one chunk of text before the step
        _, _, carry = jax.jit(fj.forward_chunk, static_argnums=3)(
            params, fj.init_state(cfg.model, B, jnp.float64), ids[0, :, :-1], cfg.model)
        inputs, targets = ids[1:, :, :-1], ids[1:, :, 1:]
        grads, new_carry = {}, {}
        for name, c in (("bptt", cfg), ("detached", detached)):
            new_carry[name], grads[name], _, _ = jax.jit(
                lambda p, s, c=c: step_lib.accumulate(p, s, inputs, targets, None, c))(params, carry)
        want = unrolled_grads(params, carry, inputs, targets, cfg, K=K)
        # broken definitions: no detach between the groups (one group of all the chunks); a sum, not a mean
        broken = {"one group": unrolled_grads(params, carry, inputs, targets, cfg, K=accum),
                  "sum": jax.tree.map(lambda g: g * accum, want)}

    def close(a, b):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12), a, b)

    close(grads["bptt"], want)
    for wrong in broken.values():
        with pytest.raises(AssertionError):
            close(grads["bptt"], wrong)
    # the carry the step hands on is the same either way (two programs: equal up to float64
    # rounding, 1.3e-13 relative in an element of 0.22 where the sums cancel, on a clean CI)
    close(new_carry["bptt"], new_carry["detached"])
    # the gradient through the carry is not nothing: the detached carry's gradient (K=1, the
    # mean of the chunks' own gradients) differs far beyond the tolerance
    rel = jax.tree_util.tree_map_with_path(
        lambda path, a, b: (jax.tree_util.keystr(path), float(jnp.abs(a - b).max() / jnp.abs(b).max())),
        grads["detached"], want)
    moved = [name for name, r in jax.tree.leaves(rel, is_leaf=lambda x: isinstance(x, tuple)) if r > 1e-6]
    assert any("attn" in name for name in moved) and len(moved) >= 5, rel
    if decay == "learned":
        assert any("decay_logit" in name for name in moved), rel


def test_bptt_chunks_must_divide_accum():
    assert tiny("accum=4", "bptt_chunks=4").conflicts() == []
    problems = tiny("accum=3", "bptt_chunks=2").conflicts()
    assert problems and "bptt_chunks=2 needs accum to be a multiple of it" in problems[0]
    with pytest.raises(cfg_lib.ConfigError, match="bptt_chunks must be >= 1"):
        tiny("bptt_chunks=0")


def _train(cfg, workdir):
    return loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=lambda m: None)


def _state(workdir, cfg, step=None):
    return restore_state(workdir, state_lib.abstract_train_state(cfg), step)


@pytest.mark.devices(8)
def test_bptt_resumes_bit_exact_and_its_sharded_step_reaches_the_one_device_weights(corpus_file, tmp_path):
    cfg = tiny(f"corpus={corpus_file}", "batch_size=8", "accum=2", "bptt_chunks=2", "carry_reset_prob=0.25", "max_steps=4",
               "save_every=2", "optimizer=sgd", "lr=0.05")
    _train(cfg, tmp_path / "straight")
    _train(cfg_lib.apply_overrides(cfg, ["max_steps=2"]), tmp_path / "split")
    _train(cfg, tmp_path / "split")
    straight, split = _state(tmp_path / "straight", cfg), _state(tmp_path / "split", cfg)
    for part in ("params", "opt_state", "carry"):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     straight[part], split[part])
    # 2 x 4 devices: each leaf within 1e-3 of its own update over 2 steps, every leaf moved
    sharded = cfg_lib.apply_overrides(cfg, ["max_steps=2", "mesh.data=2", "mesh.fsdp=4"])
    _train(sharded, tmp_path / "sharded")
    init, _ = state_lib.create_train_state(cfg, sharding.make_mesh(), jax.random.PRNGKey(cfg.seed))
    one = _state(tmp_path / "straight", cfg, step=2)["params"]
    eight = _state(tmp_path / "sharded", sharded)["params"]

    def check(path, w0, w1, w8):
        w0, w1, w8 = (np.asarray(x, np.float64) for x in (w0, w1, w8))
        update = np.abs(w1 - w0).max()
        assert np.abs(w8 - w1).max() <= 1e-3 * update, (jax.tree_util.keystr(path), np.abs(w8 - w1).max(), update)
        return update > 0   # the heads the loss never reaches (and atom_feat, unfed) stay as they were

    moved = jax.tree_util.tree_map_with_path(check, init["params"], one, eight)
    still = {jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(moved) if not m}
    # what the loss never reaches: the unfed packet features, the decode heads, and the
    # parameters the engine holds fixed (level offsets, expert phases)
    assert still <= {"['atom_feat']['bias']", "['atom_feat']['weight']", "['confidence_head']['bias']",
                     "['confidence_head']['weight']", "['salience_head']['bias']", "['salience_head']['weight']",
                     "['blocks']['attn']['level_offsets']", "['blocks']['moe']['expert_phases']"}, still
