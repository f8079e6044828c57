"""The fast kernels against their executable references, in float64."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from fractus_jax.kernels import attention as A
from fractus_jax.kernels import cpu
from fractus_jax.kernels import kuramoto as K
from fractus_jax.kernels import mixed
from fractus_jax.kernels import moe as M
from fractus_jax.kernels import plain
from fractus_jax.kernels import select
from fractus_jax.kernels.loss import chunked_cross_entropy
from fractus_jax.kernels.trig import sincos


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# The kernels compared jitted: one compiled program a call, where op by op each of their
# operations would compile on its own (hundreds a test).
linear_attention = jax.jit(A.linear_attention, static_argnames=("block_size", "one_block_axis"))
linear_attention_reference = jax.jit(A.linear_attention_reference)
moe_capacity = jax.jit(M.moe_capacity, static_argnames="capacity")
moe_exact = jax.jit(M.moe_exact)


def _attn_inputs(key, B=3, C=21, dH=5, reset=None):
    ks = jax.random.split(key, 5)
    qf = A.elu1(jax.random.normal(ks[0], (B, C, dH), jnp.float64))
    kf = A.elu1(jax.random.normal(ks[1], (B, C, dH), jnp.float64))
    v = jax.random.normal(ks[2], (B, C, dH), jnp.float64)
    S0 = jnp.abs(jax.random.normal(ks[3], (B, dH, dH), jnp.float64))
    z0 = jnp.abs(jax.random.normal(ks[4], (B, dH), jnp.float64))
    if reset is None:
        reset = jnp.zeros((B, C), bool)
    return qf, kf, v, S0, z0, reset


def _resets(B, C, block):
    r = np.zeros((B, C), bool)
    r[0, block // 2] = True                 # mid-block
    r[1, block] = True                      # at a block start
    r[1, 2 * block + 1] = r[1, 2 * block + 2] = True   # back to back
    r[2, 0] = True                          # first position: the carry never enters
    r[2, C - 1] = True                      # last position: the carry out is one token's
    return jnp.asarray(r)


@pytest.mark.parametrize("block", [1, 4, 7, 64])
def test_chunkwise_attention_equals_position_scan(block):
    B, C = 3, 21
    inputs = _attn_inputs(jax.random.PRNGKey(0), B, C, reset=_resets(B, C, 4))
    y_ref, S_ref, z_ref = linear_attention_reference(*inputs)
    y, S, z = linear_attention(*inputs, block_size=block)
    # the CPU form (no block axis for one block, block 64 > C) computes the same
    for got, want in zip(linear_attention(*inputs, block_size=block, one_block_axis=False), (y, S, z)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # The test can fail: the resets change the outputs they should change.
    y_noreset, _, _ = linear_attention_reference(*inputs[:5], jnp.zeros((B, C), bool))
    assert float(jnp.abs(y_noreset - y_ref).max()) > 1e-3
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(S, S_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(z, z_ref, rtol=1e-12, atol=1e-12)


def test_attention_reset_isolates_rows_and_drops_carry():
    B, C = 3, 12
    r = jnp.zeros((B, C), bool).at[0, 5].set(True)
    qf, kf, v, S0, z0, _ = _attn_inputs(jax.random.PRNGKey(1), B, C)
    y, _, _ = linear_attention(qf, kf, v, S0, z0, r, block_size=4)
    y2, _, _ = linear_attention(qf, kf, v, S0 * 3.0, z0 * 3.0, r, block_size=4)
    # Row 0 after its reset no longer sees the carry; before it, and other rows, do.
    np.testing.assert_allclose(y[0, 5:], y2[0, 5:], rtol=1e-12)
    assert float(jnp.abs(y[0, :5] - y2[0, :5]).max()) > 1e-6
    assert float(jnp.abs(y[1] - y2[1]).max()) > 1e-6


def test_attention_gradients():
    inputs = _attn_inputs(jax.random.PRNGKey(2), 2, 9, 3, reset=jnp.zeros((2, 9), bool).at[0, 4].set(True))
    f = lambda q, k, v, S, z: A.linear_attention(q, k, v, S, z, inputs[5], block_size=4)  # noqa: E731
    check_grads(jax.jit(f), inputs[:5], order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    g_fast = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)[0])), argnums=(0, 1, 2, 3, 4)))(*inputs[:5])
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(A.linear_attention_reference(*a, inputs[5])[0])),
                             argnums=(0, 1, 2, 3, 4)))(*inputs[:5])
    for a, b in zip(g_fast, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_attention_is_causal():
    qf, kf, v, S0, z0, r = _attn_inputs(jax.random.PRNGKey(3), 1, 16)
    t = 6
    jac = jax.jit(jax.jacrev(lambda vv: A.linear_attention(qf, kf, vv, S0, z0, r, block_size=4)[0][0, t]))(v)
    assert float(jnp.abs(jac[..., : t + 1, :]).max()) > 0.0
    assert float(jnp.abs(jac[..., t + 1:, :]).max()) == 0.0


# ----------------------------------------------------------------------------- the carry that forgets

DECAY = 0.85


def _scan_per_position(qf, kf, v, S0, z0, reset, gamma):
    """S_t = γ·[not reset_t]·S_{t-1} + k_t v_tᵀ by hand in numpy: the definition itself."""
    qf, kf, v, S, z, reset = (np.asarray(a) for a in (qf, kf, v, S0, z0, reset))
    S, z = S.copy(), z.copy()
    ys = np.zeros_like(v)
    for t in range(qf.shape[-2]):
        keep = gamma * (~reset[..., t])
        S = keep[..., None, None] * S + kf[..., t, :, None] * v[..., t, None, :]
        z = keep[..., None] * z + kf[..., t, :]
        ys[..., t, :] = np.einsum("...d,...de->...e", qf[..., t, :], S) / np.einsum("...d,...d->...", qf[..., t, :], z)[..., None]
    return ys, S, z


@pytest.mark.parametrize("block", [1, 4, 7, 64])
def test_decayed_chunkwise_attention_equals_the_recurrence(block):
    """Every form of the decayed kernel (blocks with a padded last one, one block with and
    without its axis) against the position scan and a numpy loop of the definition: outputs
    and the carry out, float64."""
    B, C = 3, 21
    inputs = _attn_inputs(jax.random.PRNGKey(0), B, C, reset=_resets(B, C, 4))
    want = _scan_per_position(*inputs, DECAY)
    scan = linear_attention_reference(*inputs, decay=DECAY)
    for one_axis in (True, False):
        got = linear_attention(*inputs, block_size=block, one_block_axis=one_axis, decay=DECAY)
        for g, s, w in zip(got, scan, want, strict=True):
            np.testing.assert_allclose(s, w, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    # The test can fail: decay changes the outputs and the carry.
    plain_sum = linear_attention(*inputs, block_size=block)
    assert float(jnp.abs(plain_sum[0] - want[0]).max()) > 1e-2
    assert float(jnp.abs(plain_sum[1] - want[1]).max()) > 1e-1


def test_decay_one_is_the_running_sum_bit_for_bit():
    inputs = _attn_inputs(jax.random.PRNGKey(4), 3, 21, reset=_resets(3, 21, 4))
    for block in (4, 64):
        want = linear_attention(*inputs, block_size=block)
        got = linear_attention(*inputs, block_size=block, decay=1.0)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_decayed_carry_two_chunks_equal_one_chunk_of_twice_the_length():
    C = 16
    qf, kf, v, S0, z0, r = _attn_inputs(jax.random.PRNGKey(5), 3, 2 * C, reset=_resets(3, 2 * C, 4))
    whole = linear_attention(qf, kf, v, S0, z0, r, block_size=4, decay=DECAY)
    first = linear_attention(qf[:, :C], kf[:, :C], v[:, :C], S0, z0, r[:, :C], block_size=4, decay=DECAY)
    second = linear_attention(qf[:, C:], kf[:, C:], v[:, C:], first[1], first[2], r[:, C:], block_size=4,
                              decay=DECAY)
    np.testing.assert_allclose(jnp.concatenate([first[0], second[0]], 1), whole[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(second[1], whole[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(second[2], whole[2], rtol=1e-12, atol=1e-12)


def test_decay_per_leading_axis_and_its_gradients():
    """One γ per slice of the leading axis (the engine's levels): each slice is its own
    recurrence; gradients of every input equal the position scan's (and finite differences)."""
    inputs = _attn_inputs(jax.random.PRNGKey(6), 2, 9, 3, reset=jnp.zeros((2, 9), bool).at[0, 4].set(True))
    gammas = jnp.asarray([0.7, 0.95])
    y, S, z = linear_attention(*inputs, block_size=4, decay=gammas)
    for row, g in enumerate(gammas):
        y_r, S_r, z_r = linear_attention(*(a[row:row + 1] for a in inputs), block_size=4, decay=float(g))
        np.testing.assert_allclose(y[row:row + 1], y_r, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(S[row:row + 1], S_r, rtol=1e-12, atol=1e-12)
    f = lambda q, k, v, S, z: A.linear_attention(q, k, v, S, z, inputs[5], block_size=4, decay=gammas)  # noqa: E731
    check_grads(jax.jit(f), inputs[:5], order=1, modes=["rev"], atol=1e-6, rtol=1e-6)

    def loss(fn):
        return jax.jit(jax.grad(lambda *a: sum(jnp.sum(jnp.sin(o)) for o in fn(*a)), argnums=(0, 1, 2, 3, 4)))

    g_fast = loss(f)(*inputs[:5])
    g_ref = loss(lambda *a: A.linear_attention_reference(*a, inputs[5], decay=gammas))(*inputs[:5])
    for a, b in zip(g_fast, g_ref, strict=True):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="broadcast"):
        A.linear_attention(*inputs, block_size=4, decay=jnp.ones(3))


def test_gradient_of_a_learned_decay_per_slice():
    """γ as an input (a learned decay, one per leading slice, under a sigmoid): the chunkwise
    kernel's gradient with respect to its logit equals the position scan's and finite
    differences, with resets and a padded last block, float64."""
    inputs = _attn_inputs(jax.random.PRNGKey(7), 3, 11, 3, reset=jnp.zeros((3, 11), bool).at[1, 6].set(True))
    logit = jnp.asarray([0.5, 2.0, 3.5])

    def loss(attention):
        def f(lg):
            y, S, z = attention(*inputs, decay=jax.nn.sigmoid(lg))
            return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(S)) + jnp.sum(jnp.sin(z))
        return f

    fast = loss(functools.partial(A.linear_attention, block_size=4))
    g_fast = jax.jit(jax.grad(fast))(logit)
    g_ref = jax.jit(jax.grad(loss(A.linear_attention_reference)))(logit)
    assert float(jnp.abs(g_ref).min()) > 1e-3     # every slice's γ reaches the loss
    np.testing.assert_allclose(g_fast, g_ref, rtol=1e-10, atol=1e-12)
    check_grads(jax.jit(fast), (logit,), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    # The test can fail: the slices' gradients differ, so a kernel that shared one γ could not pass.
    assert float(jnp.abs(g_ref[0] - g_ref[2])) > 1e-3


def test_farey_phases():
    want = [0, 0.8378, 1.5708, 2.3562, 3.1416, 3.9270, 4.7124, 5.4454]
    np.testing.assert_allclose(M.farey_phases(8), want, atol=1e-4)
    assert len(set(np.round(M.farey_phases(128), 12))) == 128


def _moe_setup(key, T=40, D=6, E=8, F=10, r=3, K=2):
    ks = jax.random.split(key, 10)
    u = lambda k, s: jax.random.uniform(k, s, jnp.float64, -0.5, 0.5)  # noqa: E731
    f = {"U1": u(ks[0], (E, F, r)), "V1": u(ks[1], (E, D, r)), "U2": u(ks[2], (E, D, r)),
         "V2": u(ks[3], (E, F, r)), "scale1": 1 + u(ks[4], (E, 1, 1)), "scale2": 1 + u(ks[5], (E, 1, 1)),
         "b1": u(ks[6], (E, F)), "b2": u(ks[7], (E, D))}
    x = jax.random.normal(ks[8], (T, D), jnp.float64)
    theta_bar = jax.random.uniform(ks[9], (T,), jnp.float64, -np.pi, np.pi)
    g = M.gates(theta_bar, jnp.asarray(M.farey_phases(E)), 1.6)
    idx, w = M.top_k_route(g, K)
    return x, idx, w, f


def test_capacity_moe_equals_exact_without_overflow():
    x, idx, w, f = _moe_setup(jax.random.PRNGKey(4))
    T, K = idx.shape
    E = f["b2"].shape[0]
    cap = M.expert_capacity(T, E, K, E / K)
    assert cap == T
    y_cap, kept = moe_capacity(x, idx, w, f, cap)
    y_ref = moe_exact(x, idx, w, f)
    assert bool(kept.all())
    assert float(jnp.abs(y_ref).max()) > 1e-3
    np.testing.assert_allclose(y_cap, y_ref, rtol=1e-12, atol=1e-12)
    grad = lambda moe: jax.jit(jax.grad(lambda x, f: jnp.sum(jnp.tanh(moe(x, f))), argnums=(0, 1)))  # noqa: E731
    g1 = grad(lambda x, f: M.moe_capacity(x, idx, w, f, cap)[0])(x, f)
    g2 = grad(lambda x, f: M.moe_exact(x, idx, w, f))(x, f)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), g1, g2)


def test_capacity_overflow_drops_later_assignments():
    x, idx, w, f = _moe_setup(jax.random.PRNGKey(5), T=40)
    T, K = idx.shape
    E = f["b2"].shape[0]
    cap = 3
    y_cap, kept = moe_capacity(x, idx, w, f, cap)
    # The drop rule written as a plain loop: first choices in token order, then seconds.
    load = np.zeros(E, int)
    want_kept = np.zeros((T, K), bool)
    for k in range(K):
        for t in range(T):
            e = int(idx[t, k])
            if load[e] < cap:
                load[e] += 1
                want_kept[t, k] = True
    assert 0 < want_kept.sum() < T * K
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    # Dropped assignments contribute zero and the other weight is not renormalised.
    w_kept = jnp.where(jnp.asarray(want_kept), w, 0.0)
    np.testing.assert_allclose(y_cap, moe_exact(x, idx, w_kept, f), rtol=1e-12, atol=1e-12)
    keep_rate = float(kept.mean())
    assert keep_rate == pytest.approx(want_kept.sum() / (T * K))


def test_gates_and_load_balance():
    E = 8
    phases = jnp.asarray(M.farey_phases(E))
    g = M.gates(jnp.array([0.3, 2.0, -1.0]), phases, 1.6)
    np.testing.assert_allclose(g.sum(-1), 1.0, rtol=1e-12)
    idx, w = M.top_k_route(g, 2)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    assert int(idx[0, 0]) == int(jnp.argmax(g[0]))
    assert float(M.load_balance(jnp.full((5, E), 1.0 / E))) == pytest.approx(0.0, abs=1e-15)
    one_hot = jax.nn.one_hot(jnp.zeros(5, int), E, dtype=jnp.float64)
    assert float(M.load_balance(one_hot)) == pytest.approx(E * ((1 - 1 / E) ** 2 + (E - 1) / E ** 2))


def test_kuramoto_wraps_and_differentiates():
    N, r = 6, 3
    ks = jax.random.split(jax.random.PRNGKey(6), 4)
    omega = jax.random.uniform(ks[0], (N,), jnp.float64, -0.2, 0.2)
    U = jax.random.uniform(ks[1], (N, r), jnp.float64, -1, 1)
    lam = jax.random.uniform(ks[2], (r,), jnp.float64, 0.01, 0.51)
    theta0 = K.initial_phases(jax.random.normal(ks[3], (4,), jnp.float64) * 3, N)
    run = lambda o, u, l, t: K.integrate(t, o, u, l, n_steps=3, dt=0.1, damping=0.01)  # noqa: E731
    theta = run(omega, U, lam, theta0)
    assert float(theta.min()) >= 0.0 and float(theta.max()) < 2 * np.pi
    assert float(jnp.abs(theta - theta0).max()) > 1e-3
    # Away from the wrap point the mod has slope 1, so finite differences hold.
    check_grads(jax.jit(lambda o, u, l: run(o, u, l, theta0)), (omega, U, lam), order=1, modes=["rev"], atol=1e-5,
                rtol=1e-5)


@pytest.mark.parametrize("dtype, bound", [(np.float64, 4e-16), (np.float32, 1.2e-7)])
def test_sincos_matches_numpy_and_differentiates_as_sin_and_cos(dtype, bound):
    rng = np.random.default_rng(8)
    # Quadrant edges (multiples of π/4, both sides), the phases' own range and far beyond.
    edges = np.pi / 4 * np.arange(-16, 17)
    x = np.concatenate([rng.uniform(-100, 100, 20000), rng.uniform(0, 2 * np.pi, 20000),
                        edges, np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf),
                        [0.0, -0.0, 1e-30, 1e3, -1e3]]).astype(dtype)
    sin, cos = sincos(jnp.asarray(x))
    assert sin.dtype == cos.dtype == dtype
    truth = x.astype(np.float64)
    assert np.abs(np.asarray(sin, np.float64) - np.sin(truth)).max() <= bound
    assert np.abs(np.asarray(cos, np.float64) - np.cos(truth)).max() <= bound
    assert np.isnan(np.asarray(sincos(jnp.asarray([np.nan, np.inf], dtype))[0])).all()
    if dtype == np.float64:
        # d sin = cos, d cos = −sin exactly (the rule), and to second order by differences.
        t = jnp.asarray(x[:40])
        ds = jax.vmap(jax.grad(lambda v: sincos(v)[0]))(t)
        dc = jax.vmap(jax.grad(lambda v: sincos(v)[1]))(t)
        np.testing.assert_array_equal(ds, sincos(t)[1])
        np.testing.assert_array_equal(dc, -sincos(t)[0])
        check_grads(lambda v: sincos(v)[0] * sincos(v)[1] ** 2, (t,), order=2, modes=["fwd", "rev"])


def test_chunked_ce_equals_full_softmax():
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    h = jax.random.normal(ks[0], (3, 7, 5), jnp.float64)
    W = jax.random.normal(ks[1], (11, 5), jnp.float64)
    t = jax.random.randint(ks[2], (3, 7), 0, 11)
    full = lambda h, W: jnp.mean(jax.nn.logsumexp(h @ W.T, -1) - jnp.take_along_axis(h @ W.T, t[..., None], -1)[..., 0])  # noqa: E731
    loss_and_grads = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, W)  # noqa: E731
    want, gb = loss_and_grads(full)
    for chunk in (1, 4, 21, 100):
        got, ga = loss_and_grads(lambda h, W: chunked_cross_entropy(h, W, t, chunk))
        np.testing.assert_allclose(got, want, rtol=1e-12)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14), ga, gb)


def test_capacity_groups_are_independent():
    x1, idx1, w1, f = _moe_setup(jax.random.PRNGKey(8), T=24)
    x2, idx2, w2, _ = _moe_setup(jax.random.PRNGKey(9), T=24)
    cap = 3
    y, kept = moe_capacity(jnp.stack([x1, x2]), jnp.stack([idx1, idx2]), jnp.stack([w1, w2]), f, cap)
    for g, (x, idx, w) in enumerate(((x1, idx1, w1), (x2, idx2, w2))):
        y_g, kept_g = moe_capacity(x, idx, w, f, cap)
        np.testing.assert_array_equal(np.asarray(kept[g]), np.asarray(kept_g))
        np.testing.assert_allclose(y[g], y_g, rtol=1e-12, atol=1e-12)
    # Counted per group: one group of all 48 tokens would keep a different set.
    _, kept_one = moe_capacity(jnp.concatenate([x1, x2]), jnp.concatenate([idx1, idx2]),
                               jnp.concatenate([w1, w2]), f, cap)
    assert not np.array_equal(np.asarray(kept_one), np.asarray(kept).reshape(48, -1))


def test_capacity_groups_sharded_over_devices_need_no_communication():
    """One dispatch group per device (what the trainer sets up): the dispatch, the experts
    and the combine, forward and the input's gradient, stay on each device."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec as P

    n = 8
    assert len(jax.devices()) >= n
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
    parts = [_moe_setup(jax.random.PRNGKey(20 + g), T=24) for g in range(n)]
    f = parts[0][3]
    x, idx, w = (jnp.stack([p[i] for p in parts]) for i in range(3))
    by_group = NamedSharding(mesh, P("data"))
    x, idx, w = (jax.device_put(a, by_group) for a in (x, idx, w))
    f = jax.device_put(f, NamedSharding(mesh, P()))

    def loss(x, idx, w, f):
        return jnp.sum(jnp.tanh(M.moe_capacity(x, idx, w, f, 3)[0]))

    for fn in (jax.jit(lambda *a: M.moe_capacity(*a, 3)), jax.jit(jax.grad(loss))):
        hlo = fn.lower(x, idx, w, f).compile().as_text()
        collectives = re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(", hlo)
        assert collectives == [], collectives
    # and the sharded result is the per-group one
    y, _ = jax.jit(lambda *a: M.moe_capacity(*a, 3))(x, idx, w, f)
    y3, _ = M.moe_capacity(*parts[3][:3], f, 3)
    np.testing.assert_allclose(y[3], y3, rtol=1e-12, atol=1e-12)


def test_elu1_is_elu_plus_one_with_its_derivative_at_zero():
    u = jnp.array([-30.0, -2.0, -1e-3, 0.0, 1e-3, 2.0], jnp.float64)
    want = jnp.where(u > 0, u + 1.0, jnp.exp(u))          # ELU(α=1) + 1, as docs/spec.md §3.1 defines it
    np.testing.assert_allclose(A.elu1(u), want, rtol=1e-15)
    d = jax.vmap(jax.grad(A.elu1))(u)
    np.testing.assert_allclose(d, jnp.where(u > 0, 1.0, jnp.exp(u)), rtol=1e-15)
    assert float(d[3]) == 1.0   # both one-sided derivatives are 1 at 0


@pytest.mark.parametrize("forms", [plain, cpu], ids=["plain", "cpu"])
def test_layer_norm_backward_is_the_gradient_of_its_definition(forms):
    layer_norm = forms.layer_norm

    def definition(x, p, eps=1e-5):
        mu = x.mean(-1, keepdims=True)
        var = jnp.square(x - mu).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + eps) * p["weight"] + p["bias"]

    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    x = 3.0 * jax.random.normal(ks[0], (2, 5, 24), jnp.float64) + 1.0
    p = {"weight": jax.random.normal(ks[1], (24,), jnp.float64),
         "bias": jax.random.normal(ks[2], (24,), jnp.float64)}
    probe = jax.random.normal(ks[3], (2, 5, 24), jnp.float64)
    ours = jax.grad(lambda x, p: jnp.sum(layer_norm(x, p, 1e-5) * probe), argnums=(0, 1))(x, p)
    want = jax.grad(lambda x, p: jnp.sum(definition(x, p) * probe), argnums=(0, 1))(x, p)
    np.testing.assert_allclose(layer_norm(x, p, 1e-5), definition(x, p), rtol=1e-12, atol=1e-12)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(b))) > 1e-3          # a real gradient to compare
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    check_grads(lambda x, w, b: layer_norm(x, {"weight": w, "bias": b}, 1e-5),
                (x, p["weight"], p["bias"]), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_bfloat16_products_give_float32_weight_gradients_summed_in_float32():
    """kernels/mixed.py: operands rounded to bfloat16, float32 sums; the weight's gradient is
    a float32-output product (no bfloat16 dot in the backward), equal to the float32 product
    of the rounded activations and cotangent."""
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (3, 40, 8), jnp.float32)
    w = jax.random.normal(kw, (8, 6), jnp.float32)
    g = jax.random.normal(kg, (3, 40, 6), jnp.float32)
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    f = lambda x, w: jnp.sum(mixed.einsum("bcd,de->bce", x, w, jnp.bfloat16, jnp.float32) * g)  # noqa: E731
    np.testing.assert_allclose(f(x, w), jnp.sum(jnp.einsum("bcd,de->bce", bf(x), bf(w)) * g), rtol=1e-5)
    dx, dw = jax.grad(f, (0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, jnp.einsum("bcd,bce->de", bf(x), bf(g)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, jnp.einsum("bce,de->bcd", bf(g), bf(w)), rtol=1e-5, atol=1e-5)
    dots = [e for e in jax.make_jaxpr(jax.grad(f, 1))(x, w).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)
    # float32 compute is the plain product, and a summed-within-one-operand index is refused
    np.testing.assert_array_equal(mixed.einsum("bcd,de->bce", x, w, jnp.float32), jnp.einsum("bcd,de->bce", x, w))
    with pytest.raises(ValueError, match="transpose"):
        mixed.einsum("bcd,df->bc", x, w, jnp.bfloat16)


# ----------------------------------------------------------------------------- the CPU forms

def _form_cases():
    """Per kernel form: (differentiable inputs, the call's other arguments), float64."""
    ks = iter(jax.random.split(jax.random.PRNGKey(11), 16))
    rnd = lambda *shape: jax.random.normal(next(ks), shape, jnp.float64)  # noqa: E731
    B, C, D, H, L = 2, 12, 16, 4, 2
    d = D // H
    reset = jnp.zeros((B, C), bool).at[1, 5].set(True)
    qf, kf = A.elu1(rnd(L, B, H, C, d)), A.elu1(rnd(L, B, H, C, d))
    v, S, z = rnd(B, H, C, d), jnp.abs(rnd(B, H, d, d)), jnp.abs(rnd(B, H, d))
    omega = jnp.asarray([1.0, 0.38])
    return {
        "sin_cos": ((40.0 * rnd(3, 7),), ()),
        "layer_norm": ((3.0 * rnd(B, C, D) + 1.0, {"weight": rnd(D), "bias": rnd(D)}), (1e-5,)),
        "qkv_features": ((rnd(B, C, D), rnd(D, 3, D) / 4, rnd(3, D)), (omega, H, jnp.float64)),
        # one block (64 > C), where the CPU form drops the block axis
        "linear_attention": ((qf[0], kf[0], v, S, z), (reset[:, None, :], 64)),
        "level_attention": ((qf, kf, v, S, z), (reset, jax.nn.softmax(rnd(L)), 5, plain.linear_attention)),
        # the carry that forgets: one γ per level, a padded last block; one block without its axis
        "level_attention, decayed": ((qf, kf, v, S, z), (reset, jax.nn.softmax(rnd(L)), 5, plain.linear_attention,
                                                         (0.8, 0.95))),
        "linear_attention, decayed": ((qf[0], kf[0], v, S, z), (reset[:, None, :], 64, 0.9)),
        # a learned decay: one γ per level and head
        "level_attention, decayed per head": ((qf, kf, v, S, z), (reset, jax.nn.softmax(rnd(L)), 5,
                                                                  plain.linear_attention,
                                                                  jax.nn.sigmoid(2.0 + rnd(L, H)))),
    }


def _outputs(out):
    """A form's outputs as a list of arrays, per-level tuples (the CPU qkv_features') stacked."""
    return [jnp.stack(o) if isinstance(o, tuple) else o for o in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("case", [*select.Forms._fields, "level_attention, decayed", "linear_attention, decayed",
                                  "level_attention, decayed per head"])
def test_each_cpu_form_computes_its_plain_form_in_float64(case):
    """kernels/cpu.py form by form against kernels/plain.py: outputs and the gradient of
    every differentiable input in float64, and the two are different programs."""
    diff, rest = _form_cases()[case]
    name = case.split(",")[0]
    forms = {"plain": select.PLAIN, "cpu": select.CPU}

    def outputs(side, *a):
        return _outputs(getattr(forms[side], name)(*a, *rest))

    # jitted, as the engine calls them (one program each, not one per operation)
    want, got = (jax.jit(functools.partial(outputs, side))(*diff) for side in forms)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    cts = [jax.random.normal(jax.random.PRNGKey(i), o.shape, o.dtype) for i, o in enumerate(want)]

    def loss(side):
        return lambda *a: sum(jnp.vdot(o, c) for o, c in zip(outputs(side, *a), cts))

    argnums = tuple(range(len(diff)))
    g_plain, g_cpu = (jax.jit(jax.grad(loss(side), argnums))(*diff) for side in forms)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_cpu), strict=True):
        assert float(jnp.abs(a).max()) > 1e-3              # a real gradient to compare
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-11)
    programs = [str(jax.make_jaxpr(jax.grad(loss(side), argnums))(*diff)) for side in forms]
    assert programs[0] != programs[1]
