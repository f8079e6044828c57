"""The Flax NNX module of the engine against the pure functions it composes."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fractus_jax as fj
from fractus_jax import config, model
from fractus_jax.convert import state_dicts
from fractus_jax.nn import Buffer, Carry, FractusEngine
from engine_testing import move_off_init

B, C = 3, 7
F32 = dict(rtol=1e-6, atol=1e-6)


def _cfg():
    return config.tiny(capacity_factor=None)


def _params(cfg, seed=0):
    return move_off_init(fj.init_params(cfg, jax.random.PRNGKey(seed)), jax.random.PRNGKey(seed + 1))


def _chunks(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, size=(n, B, C)).astype(np.int32)
    ids[:, :, 2::3] = rng.integers(259, 266, size=ids[:, :, 2::3].shape)   # boundary ids
    ids[-1, 1, 4] = cfg.bos_id                                             # a reset mid-chunk
    feats = rng.normal(size=(n, B, C, cfg.atom_feat_dim)).astype(np.float32)
    return ids, feats


def _pure_chunks(cfg, params, ids, feats, jit):
    fwd = jax.jit(model.forward_chunk, static_argnums=3) if jit else model.forward_chunk
    state, out = fj.init_state(cfg, B), []
    for c in range(len(ids)):
        logits, lb, state = fwd(params, state, jnp.asarray(ids[c]), cfg, jnp.asarray(feats[c]))
        out.append((logits, lb, state))
    return out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_module_equals_forward_chunk_over_two_chunks(jit):
    cfg = _cfg()
    params = _params(cfg)
    ids, feats = _chunks(cfg, 2)
    m = FractusEngine.from_params(cfg, params, B)
    call = nnx.jit(lambda m, i, f: m(i, f)) if jit else (lambda m, i, f: m(i, f))
    want = _pure_chunks(cfg, params, ids, feats, jit)
    for c, (logits_w, lb_w, state_w) in enumerate(want):
        logits, lb = call(m, jnp.asarray(ids[c]), jnp.asarray(feats[c]))
        chex.assert_shape(logits, (B, C, cfg.vocab_size))
        chex.assert_type(logits, jnp.float32)
        chex.assert_trees_all_close((logits, lb, m.carried()), (logits_w, lb_w, state_w), **F32)
    # The carry mattered: chunk 2 from zero is not chunk 2 from chunk 1's carry.
    logits_0, _, _ = model.forward_chunk(params, fj.init_state(cfg, B), ids[1], cfg, feats[1])
    assert float(jnp.abs(logits_0 - want[1][0]).max()) > 1e-3
    # And eager and jitted runs of the module agree with each other as well.
    other = _pure_chunks(cfg, params, ids, feats, not jit)
    chex.assert_trees_all_close(want, other, **F32)


def test_params_round_trip_and_names_match_the_pure_tree():
    cfg = _cfg()
    params = _params(cfg)
    m = FractusEngine.from_params(cfg, params, B)
    back = m.to_params()
    chex.assert_trees_all_equal_structs(back, params)
    chex.assert_trees_all_equal(back, params)
    chex.assert_trees_all_equal(FractusEngine.from_params(cfg, back, B).to_params(), params)
    # Params are exactly the trainable leaves of model.trainable_mask, Buffers the others.
    mask = model.trainable_mask(params)
    trainable = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    buffers = nnx.to_pure_dict(nnx.state(m, Buffer))
    flat_mask = {path: keep for path, keep in jax.tree_util.tree_flatten_with_path(mask)[0]}
    assert {p for p, keep in flat_mask.items() if keep} == {p for p, _ in jax.tree_util.tree_flatten_with_path(trainable)[0]}
    assert {p for p, keep in flat_mask.items() if not keep} == {p for p, _ in jax.tree_util.tree_flatten_with_path(buffers)[0]}
    assert set(nnx.to_pure_dict(nnx.state(m, Carry))) == {"carry"}
    # A fresh module from rngs has the pure tree's structure and a zero carry.
    fresh = FractusEngine(cfg, 2, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal_shapes_and_dtypes(fresh.to_params(), params)
    chex.assert_trees_all_equal(fresh.carried(), fj.init_state(cfg, 2))


def test_module_from_host_arrays_of_the_converter():
    cfg = _cfg()
    params = _params(cfg)
    ids, feats = _chunks(cfg, 1)
    _, _, state = model.forward_chunk(params, fj.init_state(cfg, B), ids[0], cfg, feats[0])
    sd = {**state_dicts.params_to_torch(params, cfg), **state_dicts.state_to_torch(state, cfg)}
    host_params, host_state = state_dicts.params_from_torch(sd, cfg), state_dicts.state_from_torch(sd, cfg)
    m = FractusEngine.from_params(cfg, host_params, B, state=host_state)
    logits, lb = m(ids[0], feats[0])
    logits_w, lb_w, state_w = model.forward_chunk(params, state, ids[0], cfg, feats[0])
    chex.assert_trees_all_close((logits, lb, m.carried()), (logits_w, lb_w, state_w), **F32)


def test_reset_zeroes_the_carry():
    cfg = _cfg()
    m = FractusEngine(cfg, B, rngs=nnx.Rngs(1))
    ids, feats = _chunks(cfg, 1)
    m(ids[0], feats[0])
    assert all(float(jnp.abs(v).max()) > 0 for v in m.carried().values())
    m.reset()
    chex.assert_trees_all_equal(m.carried(), fj.init_state(cfg, B))
    m.reset(5)
    chex.assert_trees_all_equal(m.carried(), fj.init_state(cfg, 5))
    logits, _ = m(jnp.ones((5, 4), jnp.int32))
    chex.assert_shape(logits, (5, 4, cfg.vocab_size))


LB_COEF = 0.02


def _loss(logits, lb, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean() + LB_COEF * lb


def test_nnx_optimizer_steps_equal_pure_steps():
    cfg = _cfg()
    params = _params(cfg)
    n_steps = 4
    ids, feats = _chunks(cfg, n_steps, seed=5)
    targets = np.roll(ids, -1, axis=-1)
    adamw = optax.adamw(3e-3, weight_decay=0.1)

    # The module: nnx.Optimizer over the Params (the Buffers are not in wrt).
    m = FractusEngine.from_params(cfg, params, B)
    opt = nnx.Optimizer(m, adamw, wrt=nnx.Param)

    @nnx.jit
    def module_step(m, opt, ids, feats, targets):
        def loss_fn(m):
            logits, lb = m(ids, feats)
            return _loss(logits, lb, targets)
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    # The pure tree: the same AdamW on the trainable leaves, the buffers held out as the
    # trainer holds them; the carry flows from step to step in both.
    labels = jax.tree.map(lambda t: "train" if t else "frozen", model.trainable_mask(params))
    tx = optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)

    @jax.jit
    def pure_step(params, opt_state, carry, ids, feats, targets):
        def loss_fn(p):
            logits, lb, new_carry = model.forward_chunk(p, carry, ids, cfg, feats)
            return _loss(logits, lb, targets), new_carry
        (loss, carry), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, carry, loss

    p, o, carry = params, tx.init(params), fj.init_state(cfg, B)
    for s in range(n_steps):
        args = (jnp.asarray(ids[s]), jnp.asarray(feats[s]), jnp.asarray(targets[s]))
        loss_m = module_step(m, opt, *args)
        p, o, carry, loss_p = pure_step(p, o, carry, *args)
        chex.assert_trees_all_close(loss_m, loss_p, **F32)
    assert int(opt.step[...]) == n_steps
    chex.assert_trees_all_close(m.to_params(), p, **F32)
    chex.assert_trees_all_close(m.carried(), carry, **F32)
    # The steps moved the weights, and left the buffers alone.
    assert float(jnp.abs(p["blocks"]["attn"]["w_qkv"] - params["blocks"]["attn"]["w_qkv"]).max()) > 1e-3
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(m, Buffer)),
                                {"blocks": {"attn": {"level_offsets": params["blocks"]["attn"]["level_offsets"]},
                                            "moe": {"expert_phases": params["blocks"]["moe"]["expert_phases"]}}})


def test_lazy_attribute_of_the_package():
    import fractus_jax
    assert fractus_jax.nn.FractusEngine is FractusEngine


def test_module_shards_with_the_project_rule_table():
    """The module's weights carry the pure tree's names, so sharding.py's one table lays
    them out: params placed by param_shardings stay where they were put, and the
    sharded module computes what the unsharded one does."""
    from fractus_jax import sharding

    cfg = _cfg()
    params = _params(cfg)
    rows = 4
    mesh = sharding.make_mesh(2, 4)
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(7), (rows, C), 0, cfg.vocab_size), np.int32)
    layout = sharding.param_shardings(params, mesh)
    carry = fj.init_state(cfg, rows)
    m = FractusEngine.from_params(cfg, jax.device_put(params, layout), rows,
                                  state=jax.device_put(carry, sharding.state_shardings(carry, mesh)))
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a.sharding, m.to_params()), layout)
    assert m.blocks["moe"]["U1"][...].sharding.spec[:2] == (None, "fsdp")   # experts really split
    call = nnx.jit(lambda m, i: m(i))
    logits, lb = call(m, jnp.asarray(ids))
    want = model.forward_chunk(params, carry, ids, cfg)
    chex.assert_trees_all_close((logits, lb), want[:2], rtol=1e-5, atol=1e-5)
    # the carried sums (S reaches |5| here) by 1e-5 of each array's largest value: the
    # devices add the positions' outer products in another order
    jax.tree.map(lambda a, b: np.testing.assert_array_less(np.abs(a - b).max(), 1e-5 * np.abs(b).max() + 1e-12),
                 m.carried(), want[2])
