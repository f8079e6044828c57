"""The JAX engine against the PyTorch reference: forward, gradients and carried state.

Weights start in JAX (moved off their init so every bias path matters), travel to the
reference through `params_to_torch` and a strict `load_state_dict`, and both sides run the
same three chunks with the carry flowing between them: BOS resets mid-row, atom features
at boundary ids, and a chunk length that is not a multiple of the attention block.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fractus_jax as fj  # noqa: E402
from fractus_jax import config, model  # noqa: E402
from fractus_jax.convert import state_dicts  # noqa: E402
from fractus_jax.reference import FractusEngine  # noqa: E402
from fractus_jax.reference import functional as Fn  # noqa: E402
from engine_testing import move_off_init  # noqa: E402

B, C, N_CHUNKS = 3, 13, 3
# |jax − torch| ≤ atol + rtol·|torch| elementwise (chex.assert_trees_all_close), per dtype;
# rtol = atol = tol is max |jax − torch| / (1 + |torch|) ≤ tol.
TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=2e-4, atol=2e-4)}


def _chunks(cfg, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 266 if cfg.is_atom else cfg.vocab_size, size=(N_CHUNKS, B, C))
    if cfg.is_atom:
        ids[:, :, 3::4] = rng.integers(259, 266, size=ids[:, :, 3::4].shape)  # boundary ids
    if cfg.bos_id is not None:
        ids[0, 0, 0] = cfg.bos_id      # a reset at a chunk's first position
        ids[1, 1, 5] = cfg.bos_id      # mid-chunk
        ids[2, 2, 8] = ids[2, 2, 9] = cfg.bos_id   # back to back
    feats = rng.normal(size=(N_CHUNKS, B, C, cfg.atom_feat_dim)) if cfg.is_atom else None
    probe = rng.normal(size=(N_CHUNKS, B, C, cfg.vocab_size))   # loss = Σ probe·logits + lb
    return ids, feats, probe


HEADS_AVERAGED = "one learned γ per level"


def _torch_engine(cfg, params, state, dtype, decay="as cfg"):
    """The reference engine holding params and state; decay: the reference's carry_decay
    ("as cfg": the config's), or HEADS_AVERAGED: the learned decay_logit averaged over heads."""
    kwargs = cfg.torch_kwargs()
    if decay not in ("as cfg", HEADS_AVERAGED):
        kwargs["carry_decay"] = decay
    ref = FractusEngine(**kwargs).to(dtype)
    sd = {**state_dicts.params_to_torch(params, cfg), **state_dicts.state_to_torch(state, cfg)}
    tensors = {k: torch.from_numpy(np.array(v)).to(dtype) for k, v in sd.items()}
    # The tied head must stay one tensor: load observe.weight only through itself.
    tensors["output_head.weight"] = tensors["observe.weight"]
    ref.load_state_dict(tensors, strict=True)
    if decay == HEADS_AVERAGED:
        with torch.no_grad():
            for block in ref.blocks:
                block.attn.decay_logit.copy_(block.attn.decay_logit.mean(1, keepdim=True).expand_as(
                    block.attn.decay_logit))
    return ref


def _capture_routes(ref, cfg):
    """Record each block's top-k experts, recomputed from the MoE's routing-phase input."""
    routes = []

    def hook(module, inputs, _output):
        gates = Fn.phase_gates(inputs[1], module.expert_phases, module.kappa_eff)
        routes.append(torch.topk(gates, cfg.top_k, dim=-1).indices.detach().numpy())

    for block in ref.blocks:
        block.moe.register_forward_hook(hook)
    return routes


def _run_both(cfg, dtype_name, seed=0, ex=config.TINY_EXECUTION, torch_decay="as cfg"):
    jdtype = jnp.float64 if dtype_name == "float64" else jnp.float32
    tdtype = torch.float64 if dtype_name == "float64" else torch.float32
    params = fj.init_params(cfg, jax.random.PRNGKey(seed), jdtype)
    params = move_off_init(params, jax.random.PRNGKey(seed + 100))
    state = fj.init_state(cfg, B, jdtype)
    ref = _torch_engine(cfg, params, state, tdtype, torch_decay)
    routes_t = _capture_routes(ref, cfg)
    ids, feats, probe = _chunks(cfg, seed)

    def jax_loss(p, s, i, f, pr):
        h, aux, new_s = model.forward_hidden(p, s, i, cfg, f, ex=ex)
        logits = model.logits_from_hidden(p, h)
        return jnp.sum(logits * pr) + aux.lb, (logits, aux, new_s)

    grad_fn = jax.jit(jax.value_and_grad(jax_loss, has_aux=True))
    out = []
    for c in range(N_CHUNKS):
        f_j = None if feats is None else jnp.asarray(feats[c], jdtype)
        (_, (logits_j, aux, state)), grads_j = grad_fn(params, state, jnp.asarray(ids[c]), f_j,
                                                       jnp.asarray(probe[c], jdtype))
        ref.zero_grad(set_to_none=True)
        f_t = None if feats is None else torch.from_numpy(feats[c]).to(tdtype)
        logits_t, lb_t = ref(torch.from_numpy(ids[c]), f_t)
        (torch.sum(logits_t * torch.from_numpy(probe[c]).to(tdtype)) + lb_t).backward()
        grads_t = {n: (p.grad.numpy() if p.grad is not None else np.zeros(p.shape))
                   for n, p in ref.named_parameters()}
        out.append(dict(
            logits=(np.asarray(logits_j), logits_t.detach().numpy()),
            lb=(float(aux.lb), lb_t.item()),
            state=(state_dicts.state_to_torch(state, cfg, last_lb_loss=float(aux.lb)),
                   {k: v.numpy() for k, v in ref.state_dict().items()}),
            grads=(state_dicts.params_to_torch(grads_j, cfg), grads_t),
            routes=(np.asarray(aux.expert_idx), np.stack(routes_t[-cfg.n_layers:])),
        ))
    return out


def _assert_close(a, b, tol, what):
    """Trees a ≈ b with chex at tol (a TOL entry); returns the largest |a − b| / (1 + |b|)."""
    chex.assert_trees_all_close(a, b, **tol, custom_message=what)
    return max((float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / (1.0 + np.abs(np.asarray(y)))))
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))), default=0.0)


def _assert_not_trivial(out):
    # The comparison can fail: chunks differ from one another, and the carry changes
    # the outputs (chunk 2 from its state is not chunk 2 from zero).
    l0, l1 = out[0]["logits"][0], out[1]["logits"][0]
    assert np.abs(l0 - l1).max() > 1e-3
    for c in out:
        assert np.abs(c["logits"][0]).max() > 1e-3 and c["lb"][0] > 0


@pytest.mark.parametrize("variant", ["atom", "parent", "atom, carry decay", "atom, learned carry decay"])
def test_float64_forward_state_and_gradients_match(variant):
    """The engines in float64 over three chunks; "carry decay": the carry that forgets
    (carry_decay, one γ per level), which the reference engine computes from its config;
    "learned": γ = sigmoid(decay_logit), a weight with one γ per level and head (moved off
    its init so that the heads differ), its gradient compared with the others."""
    decay = (0.8, 0.95) if "decay" in variant else None
    learned = "learned" in variant
    variant = variant.split(",")[0]
    cfg = config.tiny(variant=variant, capacity_factor=None, bos_id=config.ATOM_BOS if variant == "atom" else None,
                      carry_decay=decay, learn_carry_decay=learned)
    with jax.enable_x64(True):
        out = _run_both(cfg, "float64", ex=config.Execution(attn_block_size=4))
        if decay is not None:
            # The comparison can fail: the reference without the decay (learned: with one γ
            # per level, the heads' mean logit) computes another function.
            control = _run_both(cfg, "float64", ex=config.Execution(attn_block_size=4),
                                torch_decay=HEADS_AVERAGED if learned else None)
            assert np.abs(control[2]["logits"][0] - control[2]["logits"][1]).max() > 1e-3
    if learned:
        grad_t = out[2]["grads"][1]["blocks.0.attn.decay_logit"]
        assert np.abs(grad_t).min() > 0, "every level and head's γ gets a gradient"
    _assert_not_trivial(out)
    worst = dict.fromkeys(("logits", "state", "phases", "gradients"), 0.0)
    for c, chunk in enumerate(out):
        tol = TOL["float64"]
        worst["logits"] = max(worst["logits"], _assert_close(*chunk["logits"], tol, f"chunk {c} logits"))
        assert chunk["lb"][0] == pytest.approx(chunk["lb"][1], rel=1e-9, abs=1e-12)
        state_j, state_t = chunk["state"]
        assert set(state_j) <= set(state_t)   # the reference's state dict holds the weights too
        phases = {k for k in state_j if k.endswith("kuramoto_phases")}
        for k in phases:   # on the circle: 0 and 2π are the same phase
            d = np.angle(np.exp(1j * (state_j[k] - state_t[k])))
            assert np.abs(d).max() < tol["atol"], k
            worst["phases"] = max(worst["phases"], float(np.abs(d).max()))
        rest = sorted(set(state_j) - phases)
        worst["state"] = max(worst["state"], _assert_close({k: state_j[k] for k in rest},
                                                           {k: state_t[k] for k in rest}, tol, f"chunk {c} state"))
        grads_j, grads_t = chunk["grads"]
        assert set(grads_t) <= set(grads_j)
        worst["gradients"] = max(worst["gradients"], _assert_close({n: grads_j[n] for n in grads_t}, grads_t,
                                                                   tol, f"chunk {c} gradients"))
        zero = {name for name, g_t in grads_t.items() if np.abs(g_t).max() == 0}
        # Every gradient is exercised but the two heads' (the loss uses neither).
        assert zero == {f"{h}.{w}" for h in ("confidence_head", "salience_head") for w in ("weight", "bias")}
        np.testing.assert_array_equal(*chunk["routes"])
    print(f"{variant} float64, largest |jax − torch| / (1 + |torch|) over 3 chunks: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


@pytest.mark.parametrize("variant", ["atom", "parent"])
def test_float32_matches_with_topk_flips_counted(variant):
    cfg = config.tiny(variant=variant, capacity_factor=None,
                      bos_id=config.ATOM_BOS if variant == "atom" else None)
    out = _run_both(cfg, "float32", seed=3)
    _assert_not_trivial(out)
    tokens = flips = 0
    flipped_rows = set()
    for c, chunk in enumerate(out):
        r_j, r_t = chunk["routes"]
        differ = np.any(np.sort(r_j, -1) != np.sort(r_t, -1), axis=-1)   # (layers, B, C)
        tokens += differ.size
        flips += int(differ.sum())
        # A flip changes its row from there on, and the carry takes it to later chunks.
        flipped_rows |= set(np.nonzero(differ.any(axis=(0, 2)))[0].tolist())
        for b in range(B):
            if b in flipped_rows:
                continue
            _assert_close(chunk["logits"][0][b], chunk["logits"][1][b], TOL["float32"], f"chunk {c} row {b}")
            assert chunk["lb"][0] == pytest.approx(chunk["lb"][1], rel=1e-4)
    print(f"{variant}: top-k flips {flips}/{tokens} tokens·layers")
    assert flips / tokens <= 0.01
    assert len(flipped_rows) < B   # some rows were compared exactly


def test_capacity_factor_of_e_over_k_equals_exact_routing():
    cfg_exact = config.tiny(capacity_factor=None)
    cfg_cap = cfg_exact.replace(capacity_factor=cfg_exact.n_experts / cfg_exact.top_k)
    cfg_tight = cfg_exact.replace(capacity_factor=0.5)
    with jax.enable_x64(True):
        params = fj.init_params(cfg_exact, jax.random.PRNGKey(0), jnp.float64)
        state = fj.init_state(cfg_exact, B, jnp.float64)
        ids = jnp.asarray(_chunks(cfg_exact, 0)[0][0])
        exact, _, _ = fj.forward_chunk(params, state, ids, cfg_exact)
        cap, _, _ = fj.forward_chunk(params, state, ids, cfg_cap)
        tight, _, _ = fj.forward_chunk(params, state, ids, cfg_tight)
        _, aux, _ = model.forward_hidden(params, state, ids, cfg_tight)
    assert np.abs(np.asarray(tight - exact)).max() > 1e-6   # drops do change the output
    assert float(aux.keep_rate.max()) < 1.0
    chex.assert_trees_all_close(cap, exact, rtol=1e-12, atol=1e-12)


def test_export_loads_strictly_and_round_trips():
    cfg = config.tiny()
    params = fj.init_params(cfg, jax.random.PRNGKey(1))
    state = fj.init_state(cfg, 2)
    _, _, state = fj.forward_chunk(params, state, jnp.ones((2, 5), jnp.int32), cfg)
    sd = {**state_dicts.params_to_torch(params, cfg), **state_dicts.state_to_torch(state, cfg)}
    ref = FractusEngine(**cfg.torch_kwargs())
    missing, unexpected = ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()},
                                              strict=True)
    assert not missing and not unexpected
    back = state_dicts.params_from_torch(ref.state_dict(), cfg)
    chex.assert_trees_all_equal(params, back)
    state_back = state_dicts.state_from_torch(ref.state_dict(), cfg)
    chex.assert_trees_all_equal(state, state_back)
    # A fresh reference differs, so the round trip above is not trivially true.
    fresh = state_dicts.params_from_torch(FractusEngine(**cfg.torch_kwargs()).state_dict(), cfg)
    assert np.abs(fresh["blocks"]["attn"]["w_qkv"] - back["blocks"]["attn"]["w_qkv"]).max() > 0


def test_params_from_torch_refuses_mismatches():
    cfg = config.tiny()
    sd = state_dicts.params_to_torch(fj.init_params(cfg, jax.random.PRNGKey(0)), cfg)
    with pytest.raises(state_dicts.ConversionError, match="vocab"):
        state_dicts.params_from_torch(sd, cfg.replace(vocab_size=300))
    bad = dict(sd)
    del bad["blocks.1.moe.U1"]
    bad["blocks.0.extra"] = np.zeros(2)
    with pytest.raises(state_dicts.ConversionError, match=r"missing tensors: blocks\.1\.moe\.U1.*unexpected tensors: blocks\.0\.extra"):
        state_dicts.params_from_torch(bad, cfg)
    bad = dict(sd)
    bad["blocks.0.attn.w_out"] = np.zeros((3, 3))
    with pytest.raises(state_dicts.ConversionError, match=r"blocks\.0\.attn\.w_out.*\(3, 3\).*\(32, 32\)"):
        state_dicts.params_from_torch(bad, cfg)
    prefixed = {"_orig_mod." + k: v for k, v in sd.items()}
    back = state_dicts.params_from_torch(prefixed, cfg)
    np.testing.assert_array_equal(back["observe"], sd["observe.weight"])
