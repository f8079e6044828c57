"""The JAX engine on its own: parameter count, layer scan, causality, resets, dtypes."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fractus_jax as fj
from fractus_jax import config, model
from fractus_jax.kernels import cpu as cpu_forms
from fractus_jax.kernels import moe as moe_k
from fractus_jax.kernels import select
from engine_testing import move_off_init


def test_atom_1b_parameter_count():
    assert fj.count_params(config.atom_1b()) == 985_074_354
    # the parent has no phase_proj / atom_feat, and a GPT-2 sized embedding
    parent = fj.count_params(config.parent_1b())
    atom = config.atom_1b()
    D, L = atom.d_model, atom.n_layers
    assert parent == 985_074_354 - 266 * D + 50257 * D - L * (D + 1) - (D * 320 + D)


def _tiny_inputs(cfg, B=4, C=19, seed=0, dtype=jnp.float32):
    params = fj.init_params(cfg, jax.random.PRNGKey(seed), dtype)
    ids = jax.random.randint(jax.random.PRNGKey(seed + 1), (B, C), 0, 256)
    return params, fj.init_state(cfg, B, dtype), ids


@pytest.mark.parametrize("variant", [pytest.param("atom", marks=pytest.mark.slow), "parent"])
def test_scanned_layers_equal_a_layer_loop(variant):
    cfg = config.tiny(variant=variant, n_layers=3, capacity_factor=None)
    with jax.enable_x64(True):
        params, state, ids = _tiny_inputs(cfg, dtype=jnp.float64)
        params = move_off_init(params, jax.random.PRNGKey(9))
        # Compiled (one program each, the layer's reused for every layer): op by op, the
        # float64 scan and its loop took most of the test's time.
        h_scan, aux, new_state = jax.jit(model.forward_hidden, static_argnums=3)(params, state, ids, cfg)
        h, reset = model.embed(params, state, ids, cfg)
        block = jax.jit(model.block_forward, static_argnums=(4, 5, 6))
        for i in range(cfg.n_layers):
            p_i = jax.tree.map(lambda a: a[i], params["blocks"])
            h_prev = h
            h, (S, z, phase), stats = block(
                p_i, h, (state["S"][i], state["z"][i], state["phase"][i]), reset, cfg, config.Execution(), jnp.float64)
            assert float(jnp.abs(h - h_prev).max()) > 1e-4  # every layer does something
            np.testing.assert_allclose(S, new_state["S"][i], rtol=1e-13, atol=1e-13)
            np.testing.assert_allclose(phase, new_state["phase"][i], rtol=1e-13, atol=1e-13)
            gate_mean = stats[2]
            assert float(moe_k.load_balance_of_means(gate_mean)) == pytest.approx(
                float(aux.lb_per_layer[i]), rel=1e-12)
        np.testing.assert_allclose(h, h_scan, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw, block", [(dict(), 8), (dict(variant="parent", capacity_factor=1.0), 32)])
def test_cpu_kernels_compute_the_plain_function(kw, block):
    """execution.kernels="cpu" (every CPU-tuned form, kernels/select.py) against "plain", in
    float64: outputs, new state, load balance and the gradients of every parameter, with
    resets, a carried state, several attention blocks (and one, block 32 > C), capacity."""
    cfg = config.tiny(**kw)
    with jax.enable_x64(True):
        params, state, ids = _tiny_inputs(cfg, B=3, C=19, dtype=jnp.float64)
        params = move_off_init(params, jax.random.PRNGKey(9))
        state = jax.tree.map(lambda a: jnp.abs(jax.random.normal(jax.random.PRNGKey(4), a.shape, a.dtype)), state)
        ids = ids.at[1, 6].set(config.ATOM_BOS)

        def loss(p, kernels):
            ex = config.Execution(kernels=kernels, attn_block_size=block)
            logits, lb, new_state = model.forward_chunk(p, state, ids, cfg, ex=ex)
            return jnp.sum(jnp.tanh(logits)) + lb, (logits, lb, new_state)

        # Compiled, one program per form: op by op, the float64 backward took most of the test.
        value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
        (_, plain), g_plain = value_and_grad(params, "plain")
        (_, cpu), g_cpu = value_and_grad(params, "cpu")
        # the CPU forms are the ones taken (their written-out backwards), and only there
        assert "custom_vjp_call" in str(jax.make_jaxpr(lambda p: loss(p, "cpu")[0])(params))
        assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda p: loss(p, "plain")[0])(params))
    for a, b in zip(jax.tree.leaves((plain, g_plain)), jax.tree.leaves((cpu, g_cpu))):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
    assert float(jnp.abs(g_plain["blocks"]["attn"]["w_qkv"]).max()) > 1e-3


def test_for_inference_keeps_the_weights_and_drops_only_the_training_schedule():
    """EngineConfig.for_inference: exact, no capacity, every other field as it was;
    Execution.for_inference: one row stream and one dispatch slice, every other setting kept."""
    cfg = config.tiny(capacity_factor=1.25, moe_group_rows=2, gate_temperature=1.5)
    ex = config.Execution(row_streams=2, moe_shards=4, kernels="plain", remat=True, compute_dtype="bfloat16")
    exact, routed, one = cfg.for_inference(), cfg.for_inference(exact=False), ex.for_inference()
    assert (exact.capacity_factor, routed, one.row_streams, one.moe_shards) == (None, cfg, 1, 1)
    for f in dataclasses.fields(cfg):
        if f.name != "capacity_factor":
            assert getattr(exact, f.name) == getattr(cfg, f.name), f.name
    for f in dataclasses.fields(ex):
        if f.name not in ("row_streams", "moe_shards"):
            assert getattr(one, f.name) == getattr(ex, f.name), f.name
    # The two kinds of field stay apart: a weight setting is no execution field, and back.
    assert not {f.name for f in dataclasses.fields(cfg)} & set(config.EXECUTION_FIELDS)


def test_kernels_auto_takes_the_cpu_forms_on_a_cpu_only():
    on_cpu = jax.default_backend() == "cpu"
    assert select.forms("auto") is (select.CPU if on_cpu else select.PLAIN)
    assert select.forms("cpu") is select.CPU and select.forms("plain") is select.PLAIN
    assert select.CPU != select.PLAIN
    with pytest.raises(ValueError, match="kernels"):
        config.Execution(kernels="gpu")


@pytest.mark.slow
def test_row_streams_change_nothing_but_the_schedule():
    """Two row streams give one stream's numbers (same dispatch groups): outputs, state,
    routing statistics and gradients, in float64, with capacity drops and a carried state."""
    cfg = config.tiny(n_layers=2, capacity_factor=1.0, moe_group_rows=2)
    one, streams = config.TINY_EXECUTION, config.TINY_EXECUTION.replace(row_streams=2)
    with jax.enable_x64(True):
        params, state, ids = _tiny_inputs(cfg, B=4, C=16, dtype=jnp.float64)
        params = move_off_init(params, jax.random.PRNGKey(9))
        keys = iter(jax.random.split(jax.random.PRNGKey(3), 8))
        state = {k: v + 0.5 * jnp.abs(jax.random.normal(next(keys), v.shape, v.dtype)) for k, v in state.items()}
        feats = jax.random.normal(next(keys), (4, 16, cfg.atom_feat_dim), jnp.float64)
        ids = ids.at[:, 3].set(262)       # boundary ids: the features enter

        def run(p, ex):
            h, aux, new_state = model.forward_hidden(p, state, ids, cfg, feats, ex=ex)
            return jnp.sum(jnp.sin(h)) + aux.lb, (h, aux, new_state)

        # Compiled, one program per config (op by op, the float64 backward took most of the test).
        value_and_grad = jax.jit(jax.value_and_grad(run, has_aux=True), static_argnums=1)
        (loss1, out1), g1 = value_and_grad(params, one)
        (loss2, out2), g2 = value_and_grad(params, streams)
        # The test can fail: the streams' own load balances do not average to the global one,
        # capacity dropped assignments, and the rows differ.
        halves = [model.forward_hidden(params, {k: jnp.split(v, 2, model.STATE_ROW_AXIS[k])[i]
                                                for k, v in state.items()},
                                       ids[2 * i:2 * i + 2], cfg, feats[2 * i:2 * i + 2], ex=one)[1].lb
                  for i in range(2)]
        assert abs(float(sum(halves)) / 2 - float(out1[1].lb)) > 1e-6
        assert float(out1[1].keep_rate.min()) < 1.0
        assert float(jnp.abs(out1[0][0] - out1[0][2]).max()) > 1e-3
        assert float(loss1) == pytest.approx(float(loss2), rel=1e-12)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), (out1, g1), (out2, g2))


def test_row_streams_need_whole_dispatch_groups():
    params, state, ids = _tiny_inputs(config.tiny(), B=2, C=8)
    two = config.Execution(row_streams=2)
    # traced only (the check is on shapes, made while tracing): nothing to compute
    forward = lambda groups: jax.eval_shape(  # noqa: E731
        lambda: model.forward_hidden(params, state, ids, config.tiny(moe_group_rows=groups), ex=two))
    for groups in (0, 2):     # the whole batch as one group; a group as large as the batch
        with pytest.raises(ValueError, match="row streams"):
            forward(groups)
    forward(1)


@pytest.mark.slow
def test_remat_gives_the_same_gradients_in_float64():
    cfg = config.tiny()
    with jax.enable_x64(True):   # float64: remat may reorder float32 rounding, nothing more
        params, state, ids = _tiny_inputs(cfg, dtype=jnp.float64)

        def loss(p, ex):
            logits, lb, _ = fj.forward_chunk(p, state, ids, cfg, ex=ex)
            return jnp.mean(logits ** 2) + lb

        g1 = jax.jit(jax.grad(loss), static_argnums=1)(params, config.TINY_EXECUTION)
        g2 = jax.jit(jax.grad(loss), static_argnums=1)(params, config.TINY_EXECUTION.replace(remat=True))
    assert float(jnp.abs(g1["blocks"]["attn"]["w_qkv"]).max()) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13), g1, g2)


@pytest.mark.parametrize("variant", ["atom", "parent"])
def test_no_gradient_from_a_later_input_to_an_earlier_output(variant):
    cfg = config.tiny(variant=variant)
    params, state, ids = _tiny_inputs(cfg, B=2, C=12)
    # Off init: there the parent's base phase is rounding noise (docs/spec.md §3.2), and
    # so would be the routing's dependence on later inputs that the parent case asserts.
    params = move_off_init(params, jax.random.PRNGKey(5))
    emb = params["observe"][ids]
    t = 5

    def out_at_t(emb_in):
        p = dict(params)
        # Feed embeddings directly: swap the table for one row per position.
        p["observe"] = emb_in.reshape(-1, cfg.d_model)
        positions = jnp.arange(ids.size).reshape(ids.shape)
        h, _, _ = model.forward_hidden(p, state, positions, cfg.replace(bos_id=None))
        return h[:, t].sum()

    g = jax.grad(out_at_t)(emb)
    if variant == "atom":
        assert float(jnp.abs(g[:, : t + 1]).max()) > 0
        assert float(jnp.abs(g[:, t + 1:]).max()) == 0.0
    else:
        # The parent routes every position by the LAST position's phases (docs/spec.md §3.3):
        # later inputs reach earlier outputs through the routing, by design.
        assert float(jnp.abs(g[:, t + 1:]).max()) > 0


def test_bos_resets_only_its_row():
    # Exact routing: with a capacity, tokens compete for slots across rows by design.
    cfg = config.tiny(capacity_factor=None)
    params, state, ids = _tiny_inputs(cfg, B=3, C=16)
    _, _, state = fj.forward_chunk(params, state, ids, cfg)  # a nonzero carry
    with_bos = ids.at[1, 6].set(cfg.bos_id)
    logits, _, _ = fj.forward_chunk(params, state, with_bos, cfg)
    logits_fresh, _, _ = fj.forward_chunk(params, fj.init_state(cfg, 3), with_bos, cfg)
    # After the BOS, row 1 no longer depends on the carry; before it, and row 0, do.
    np.testing.assert_allclose(logits[1, 6:], logits_fresh[1, 6:], rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(logits[1, :6] - logits_fresh[1, :6]).max()) > 1e-4
    assert float(jnp.abs(logits[0] - logits_fresh[0]).max()) > 1e-4


def test_bfloat16_compute_stays_close_and_keeps_float32_state():
    cfg = config.tiny(capacity_factor=None)
    params, state, ids = _tiny_inputs(cfg)
    l32, lb32, s32 = fj.forward_chunk(params, state, ids, cfg)
    l16, lb16, s16 = fj.forward_chunk(params, state, ids, cfg, ex=config.Execution(compute_dtype="bfloat16"))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(s16))
    assert l16.dtype == jnp.float32
    assert float(jnp.abs(l16 - l32).max()) > 0  # bf16 did run
    assert float(jnp.abs(l16 - l32).max()) < 0.05 * float(jnp.abs(l32).max())


def test_float64_params_run_in_float64():
    cfg = config.tiny()
    with jax.enable_x64(True):
        params, state, ids = _tiny_inputs(cfg, dtype=jnp.float64)
        logits, lb, new_state = fj.forward_chunk(params, state, ids, cfg)
        assert logits.dtype == jnp.float64 and lb.dtype == jnp.float64
        assert all(a.dtype == jnp.float64 for a in jax.tree.leaves(new_state))


def test_init_matches_spec_distributions():
    for variant, std, omega in (("atom", 0.02, 0.2), ("parent", 1.0, 0.05)):
        cfg = config.tiny(variant=variant, vocab_size=2000, n_layers=2)
        p = fj.init_params(cfg, jax.random.PRNGKey(0))
        assert float(jnp.std(p["observe"])) == pytest.approx(std, rel=0.05)
        om = p["blocks"]["kuramoto"]["omega"]
        assert float(jnp.abs(om).max()) <= omega and float(jnp.abs(om).max()) > 0.5 * omega
        assert ("atom_feat" in p) == (variant == "atom")
        assert ("phase_proj" in p["blocks"]["kuramoto"]) == (variant == "atom")
    assert float(jnp.abs(p["blocks"]["moe"]["b1"]).max()) == 0.0


@pytest.mark.parametrize("mm_dtype", [jnp.float64, jnp.bfloat16])
def test_qkv_features_backward_equals_autodiff(mm_dtype):
    """The written-out backward of the projection + heads + feature maps against JAX's
    autodiff of the same forward (the un-decorated function), all three inputs."""
    B, C, D, H = 2, 16, 32, 4
    with jax.enable_x64(True):
        k = jax.random.split(jax.random.PRNGKey(3), 4)
        x = jax.random.normal(k[0], (B, C, D), jnp.float64)
        w = jax.random.normal(k[1], (D, 3, D), jnp.float64) / 6
        b = jax.random.normal(k[2], (3, D), jnp.float64)
        offsets = jnp.asarray(model.level_offsets(2))
        outs = cpu_forms.features_by_level(x, w, b, offsets, H, mm_dtype)
        cts = [jax.random.normal(jax.random.fold_in(k[3], i), o.shape, o.dtype)
               for i, o in enumerate(jax.tree.leaves(outs))]
        assert len(cts) == 5   # qf and kf for both levels, v

        def loss(features):
            def f(x, w, b):
                return sum(jnp.vdot(o, c) for o, c in zip(jax.tree.leaves(features(x, w, b, offsets, H, mm_dtype)), cts))
            return f

        written = jax.grad(loss(cpu_forms.qkv_features), (0, 1, 2))(x, w, b)
        auto = jax.grad(loss(cpu_forms.features_by_level), (0, 1, 2))(x, w, b)
        # the written rule is the one taken
        jaxpr = str(jax.make_jaxpr(lambda *a: cpu_forms.qkv_features(*a, offsets, H, mm_dtype))(x, w, b))
        assert "custom_vjp_call" in jaxpr
    for g_w, g_a in zip(written, auto):
        assert g_w.dtype == g_a.dtype == jnp.float64
        assert float(jnp.abs(g_a).max()) > 1.0
        tol = 1e-12 if mm_dtype == jnp.float64 else 2e-2 * float(jnp.abs(g_a).max())
        np.testing.assert_allclose(g_w, g_a, rtol=0, atol=tol)


# ----------------------------------------------------------------------------- the public API, with chex

def _host_engine(cfg, B, seed=0):
    """Host (numpy) params and carry, as the converter hands them out, and a device twin."""
    from fractus_jax.convert import state_dicts

    params = move_off_init(fj.init_params(cfg, jax.random.PRNGKey(seed)), jax.random.PRNGKey(seed + 1))
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(seed + 2), (B, 11), 0, cfg.vocab_size), np.int32)
    _, _, state = model.forward_chunk(params, fj.init_state(cfg, B), ids, cfg)   # a carry that is not zero
    sd = {**state_dicts.params_to_torch(params, cfg), **state_dicts.state_to_torch(state, cfg)}
    host_params, host_state = state_dicts.params_from_torch(sd, cfg), state_dicts.state_from_torch(sd, cfg)
    assert all(type(a) is np.ndarray for a in jax.tree.leaves((host_params, host_state)))
    return (host_params, host_state), (params, state), ids


class TestPublicApiVariants(chex.TestCase):
    """forward_chunk and init_state, called with host arrays, with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_chunk_on_host_arrays(self):
        cfg = config.tiny()
        B, C = 3, 9
        (host_params, host_state), (params, state), ids = _host_engine(cfg, B)
        feats = np.random.default_rng(0).normal(size=(B, C, cfg.atom_feat_dim)).astype(np.float32)
        ids = ids[:, :C]
        forward = self.variant(fj.forward_chunk, static_argnums=3)
        reference = jax.jit(fj.forward_chunk, static_argnums=3)
        for f in (None, feats):   # without features the embedding is all host arrays
            logits, lb, new_state = forward(host_params, host_state, ids, cfg, f)
            chex.assert_shape(logits, (B, C, cfg.vocab_size))
            chex.assert_shape(lb, ())
            chex.assert_type([logits, lb], jnp.float32)
            chex.assert_trees_all_equal_shapes_and_dtypes(new_state, fj.init_state(cfg, B))
            chex.assert_tree_all_finite((logits, lb, new_state))
            # The same numbers as the device arrays under jit.
            want = reference(params, state, jnp.asarray(ids), cfg, None if f is None else jnp.asarray(f))
            chex.assert_trees_all_close((logits, lb, new_state), want, rtol=1e-6, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_init_state_and_params_shapes(self):
        cfg = config.tiny()
        init_state = self.variant(fj.init_state, static_argnums=(0, 1))
        state = init_state(cfg, 5)
        L, H, dH, N = cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.n_oscillators
        chex.assert_shape([state["thought"], state["S"], state["z"], state["phase"]],
                          [(5, cfg.d_model), (L, 5, H, dH, dH), (L, 5, H, dH), (L, 5, N)])
        chex.assert_type(list(state.values()), jnp.float32)
        chex.assert_trees_all_equal(state, jax.tree.map(jnp.zeros_like, state))
        init_params = self.variant(fj.init_params, static_argnums=0)
        params = init_params(cfg, jax.random.PRNGKey(0))
        chex.assert_tree_all_finite(params)
        chex.assert_shape(params["observe"], (cfg.vocab_size, cfg.d_model))
        chex.assert_shape(params["blocks"]["attn"]["w_qkv"], (L, 3, cfg.d_model, cfg.d_model))
        assert sum(a.size for a, m in zip(jax.tree.leaves(params), jax.tree.leaves(model.trainable_mask(params)))
                   if m) == fj.count_params(cfg)
