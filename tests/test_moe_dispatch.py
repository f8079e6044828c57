"""MoE dispatch: dropless equals the exact definition, the defaults train the PyTorch
engine's function (nothing dropped), and the trained function does not depend on the mesh."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fractus_jax import config, model
from fractus_jax.kernels import moe as M
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import reach
from fractus_jax.train import watch
from fractus_jax.train.errors import TrainError

from engine_testing import assert_trained_alike, changed_leaves, move_off_init

CONFIGS = ("tiny", "smoke", "atom_1b", "parent_1b", "bench_small")


def _factors(key, E=8, D=12, F=20, r=4, dtype=jnp.float64):
    ks = iter(jax.random.split(key, 8))
    n = lambda shape: jax.random.normal(next(ks), shape, dtype)  # noqa: E731
    return {"U1": n((E, F, r)), "V1": n((E, D, r)), "U2": n((E, D, r)), "V2": n((E, F, r)),
            "scale1": 1 + n((E, 1, 1)), "scale2": 1 + n((E, 1, 1)), "b1": n((E, F)), "b2": n((E, D))}


def _skewed_routing(key, T, E, K, dtype=jnp.float64):
    """Gates that crowd expert 3 (more than a capacity of T·K/E would take) and leave
    others empty: the counts the padding to whole blocks must handle."""
    g = jax.nn.softmax(3 * jax.random.normal(key, (T, E), dtype))
    g = g.at[: T // 2, 3].add(5.0).at[:, E - 2].set(0.0)
    return M.top_k_route(g, K)


@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_dropless_equals_exact_forward_and_gradients(block):
    with jax.enable_x64(True):
        T, E, K = 37, 8, 2
        f = _factors(jax.random.PRNGKey(0), E)
        x = jax.random.normal(jax.random.PRNGKey(1), (T, 12), jnp.float64)
        idx, w = _skewed_routing(jax.random.PRNGKey(2), T, E, K)
        counts = np.bincount(np.asarray(idx).ravel(), minlength=E)
        assert counts.max() > T * K / E and (counts == 0).any()      # crowded and empty experts
        dropless = lambda *a: M.moe_dropless(*a, block)  # noqa: E731
        # jitted, as the engine calls them (one program each, not one per operation)
        y = jax.jit(dropless)(x, idx, w, f)
        y_ref = jax.jit(M.moe_exact)(x, idx, w, f)
        assert float(jnp.abs(y_ref).max()) > 1e-2
        np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)

        def loss(fn):
            return lambda x, w, f: jnp.sum(jnp.tanh(fn(x, idx, w, f)))
        g = jax.jit(jax.grad(loss(dropless), argnums=(0, 1, 2)))(x, w, f)
        g_ref = jax.jit(jax.grad(loss(M.moe_exact), argnums=(0, 1, 2)))(x, w, f)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11), g, g_ref)


def test_dropless_groups_are_independent():
    with jax.enable_x64(True):
        f = _factors(jax.random.PRNGKey(3))
        parts = []
        for s in range(3):
            idx, w = _skewed_routing(jax.random.PRNGKey(10 + s), 16, 8, 2)
            parts.append((jax.random.normal(jax.random.PRNGKey(20 + s), (16, 12), jnp.float64), idx, w))
        stacked = [jnp.stack(p) for p in zip(*parts)]
        y = M.moe_dropless(*stacked, f, 4)
        for g, (x, idx, w) in enumerate(parts):
            np.testing.assert_allclose(y[g], M.moe_exact(x, idx, w, f), rtol=1e-12, atol=1e-12)


def test_dropless_block_count_bounds_any_routing():
    # The worst case pads every expert by b − 1 rows: the bound must hold with equality there.
    T, E, K, b = 10, 4, 2, 4
    idx = jnp.array([[e, (e + 1) % E] for e in (0, 0, 0, 1, 1, 1, 2, 2, 2, 3)], jnp.int32)
    counts = np.bincount(np.asarray(idx).ravel(), minlength=E)
    assert sum(-(-c // b) for c in counts) <= M.dropless_blocks(T, E, K, b)
    assert M.dropless_blocks(T, E, K, 1) == T * K


@pytest.mark.parametrize("variant", ["atom", "parent"])
def test_engine_dropless_equals_capacity_at_e_over_k(variant):
    """The engine's default dispatch against the capacity path with room for everything
    (cf = E/K: the exact routing, padded), float64, forward, state and gradients."""
    cfg = config.tiny(variant=variant, bos_id=None if variant == "parent" else config.ATOM_BOS)
    assert cfg.capacity_factor is None
    padded = cfg.replace(capacity_factor=cfg.n_experts / cfg.top_k)
    with jax.enable_x64(True):
        params = model.init_params(cfg, jax.random.PRNGKey(0), jnp.float64)
        params = move_off_init(params, jax.random.PRNGKey(1))
        ids = jax.random.randint(jax.random.PRNGKey(2), (3, 16), 0, 266)
        state = model.init_state(cfg, 3, jnp.float64)

        def loss(p, c):
            logits, lb, new_state = model.forward_chunk(p, state, ids, c)
            return jnp.mean(jax.nn.logsumexp(logits, -1)) + 0.02 * lb, (logits, new_state)

        loss_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
        (l1, (lg1, st1)), g1 = loss_and_grad(params, cfg)
        (l2, (lg2, st2)), g2 = loss_and_grad(params, padded)
    np.testing.assert_allclose(lg1, lg2, rtol=1e-11, atol=1e-11)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11), st1, st2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11), g1, g2)
    assert float(jnp.abs(g1["blocks"]["moe"]["V1"]).max()) > 0


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_keep_every_assignment(name):
    cfg = cfg_lib.load_config(name)
    assert cfg.model.capacity_factor is None, f"fractus_jax/configs/{name}.py drops expert assignments"


@pytest.mark.parametrize("variant", ["atom", "parent"])
def test_a_default_step_keeps_every_assignment(corpus_file, tmp_path, variant):
    """The parent routes a whole row by its last position: with any capacity below E/K
    whole rows overflow their experts. The default config keeps every assignment."""
    overrides = [f"corpus={corpus_file}", "max_steps=2", "save_every=2"]
    if variant == "parent":
        overrides += ["model.variant=parent", "model.bos_id=none"]
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), overrides)
    loop.run(prepare_lib.prepare(cfg, tmp_path, progress=False), progress=False, log=lambda m: None)
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    keep = [m["keep_rate"] for m in lines if "keep_rate" in m]
    assert keep and min(keep) == 1.0


def test_a_capacity_that_drops_warns_naming_the_setting(corpus_file, tmp_path):
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [
        f"corpus={corpus_file}", "model.capacity_factor=0.5", "max_steps=6", "save_every=6", "log_every=1"])
    said = []
    loop.run(prepare_lib.prepare(cfg, tmp_path, progress=False), progress=False, log=said.append)
    warnings = [s for s in said if "keep_rate" in s]
    assert len(warnings) == 1, said            # once, not on every step
    assert "model.capacity_factor=0.5" in warnings[0] and warnings[0].startswith("warning:")


def test_keep_rate_watch_window_floor_and_repeat():
    w = watch.KeepRateWatch(1.25)
    assert all(w.update(s, 0.99) is None for s in range(1, 50))          # above the floor
    said = [w.update(s, 0.5) for s in range(50, 80)]
    fired = [s for s, msg in zip(range(50, 80), said) if msg]
    assert len(fired) == 1                                                # once the mean falls below
    assert w.update(fired[0] + watch.KEEP_RATE_REPEAT - 1, 0.5) is None   # not again soon
    assert w.update(fired[0] + watch.KEEP_RATE_REPEAT, 0.5) is not None     # but much later
    assert watch.KeepRateWatch(None).update(1, 0.0) is None               # dropless: nothing to say


@pytest.mark.devices(8)
@pytest.mark.parametrize("capacity", ["none", "1.25"], ids=["dropless", "cf=1.25"])
def test_the_trained_function_does_not_depend_on_the_mesh(corpus_file, tmp_path, capacity):
    """tiny's defaults (AdamW) with batch 8 on 1, 2×4 and 8×1 devices end at the same
    weights: the capacity groups are a model setting, not the rows a device holds."""
    weights, keep = {}, {}
    for data, fsdp in [(1, 1), (2, 4), (8, 1)]:
        cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [
            f"corpus={corpus_file}", "batch_size=8", f"model.capacity_factor={capacity}",
            f"mesh.data={data}", f"mesh.fsdp={fsdp}", "max_steps=3", "save_every=3"])
        run = tmp_path / f"{data}x{fsdp}"
        with jax.default_matmul_precision("highest"):
            loop.run(prepare_lib.prepare(cfg, run, progress=False), progress=False, log=lambda m: None)
        params, _ = ckpt_lib.load_for_inference(run)
        weights[(data, fsdp)] = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
        lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        keep[(data, fsdp)] = [m["keep_rate"] for m in lines if "keep_rate" in m]
    if capacity == "none":
        assert min(min(k) for k in keep.values()) == 1.0
    else:
        assert max(keep[(1, 1)]) < 1.0                   # the capacity dropped assignments...
        np.testing.assert_allclose(keep[(8, 1)], keep[(1, 1)], rtol=1e-6)   # ...the same ones
    one = weights[(1, 1)]
    init = jax.tree.map(lambda a: np.asarray(a, np.float64),
                        model.init_params(cfg_lib.load_config("tiny").model, jax.random.PRNGKey(0)))
    # AdamW: every leaf the loss reaches moved about lr a step per element (the others at most by decay)
    reached = jax.tree_util.tree_flatten_with_path(reach.loss_reach(cfg))[0]
    assert {jax.tree_util.keystr(p) for p, r in reached if r} <= changed_leaves(one, init)
    for mesh in [(2, 4), (8, 1)]:
        diff = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, weights[mesh], one))
        norm = np.sqrt(sum(np.sum(d ** 2) for d in diff) / sum(np.sum(b ** 2) for b in jax.tree.leaves(one)))
        assert norm <= 1e-4, (mesh, norm)
        # Leaf by leaf against the leaf's own change over the 3 steps: measured up to 2.1e-4
        # (one w_qkv element of 6144 differed by 1.1% of the leaf's largest step, the leaf by
        # 1.5e-4 of its change).
        print(mesh, "worst leaf difference / its change:", assert_trained_alike(weights[mesh], one, init, 5e-3, mesh))


@pytest.mark.devices(8)
def test_a_capacity_group_spanning_devices_is_refused(corpus_file, tmp_path):
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [
        f"corpus={corpus_file}", "batch_size=8", "model.capacity_factor=2", "model.moe_group_rows=2",
        "mesh.data=8"])
    with pytest.raises(TrainError, match=r"moe_group_rows=2 .*divide the 1 rows each of the 8 devices"):
        prepare_lib.prepare(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
