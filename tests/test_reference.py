"""Tests of the PyTorch reference engine (fractus_jax.reference) against docs/spec.md §1–§4."""
import io
import math

import pytest

torch = pytest.importorskip("torch")

from fractus_jax.config import atom_1b, tiny  # noqa: E402
from fractus_jax.reference import (FractusEngine, einsum_attention, farey_phases,  # noqa: E402
                                   farey_sequence, level_offsets, loop_attention)
from fractus_jax.reference import functional as Fn  # noqa: E402

BOS = 257
VARIANTS = ("atom", "parent")


def make(variant="atom", seed=0, **overrides):
    torch.manual_seed(seed)
    return FractusEngine(**tiny(variant=variant, **overrides).torch_kwargs()).double()


def random_ids(B, C, seed, lo=0, hi=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (B, C), generator=g)


def expected_shapes(cfg):
    """The weight contract of docs/spec.md §2, written out independently of the module."""
    V, D, N, r_k = cfg.vocab_size, cfg.d_model, cfg.n_oscillators, cfg.coupling_rank
    E, F, r, L = cfg.n_experts, cfg.expert_d_ff, cfg.siren_rank, cfg.n_levels
    s = {"observe.weight": (V, D), "output_head.weight": (V, D),
         "confidence_head.weight": (1, D), "confidence_head.bias": (1,),
         "salience_head.weight": (1, D), "salience_head.bias": (1,),
         "thought_state": (1, 1, D), "last_lb_loss": ()}
    if cfg.variant == "atom":
        s.update({"atom_feat.weight": (D, 320), "atom_feat.bias": (D,)})
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        s.update({p + "attn.w_qkv": (3, D, D), p + "attn.b_qkv": (3, D),
                  p + "attn.w_out": (D, D), p + "attn.b_out": (D,),
                  p + "attn.level_logits": (L,), p + "attn.level_offsets": (L,),
                  p + "kuramoto.omega": (N,), p + "kuramoto.coupling_u": (N, r_k),
                  p + "kuramoto.coupling_lambda": (r_k,),
                  p + "moe.U1": (E, F, r), p + "moe.V1": (E, D, r), p + "moe.U2": (E, D, r),
                  p + "moe.V2": (E, F, r), p + "moe.scale1": (E, 1, 1), p + "moe.scale2": (E, 1, 1),
                  p + "moe.b1": (E, F), p + "moe.b2": (E, D), p + "moe.expert_phases": (E,),
                  p + "attn_S": (1, D, D), p + "attn_z": (1, D), p + "kuramoto_phases": (1, 1, N)})
        for norm in ("norm_attn", "norm_kur", "norm_moe"):
            s.update({p + norm + ".weight": (D,), p + norm + ".bias": (D,)})
        if cfg.variant == "atom":
            s.update({p + "kuramoto.phase_proj.weight": (1, D), p + "kuramoto.phase_proj.bias": (1,)})
    return s


# ------------------------------------------------------------------ weight contract

@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_keys_and_shapes(variant):
    cfg = tiny(variant=variant)
    model = FractusEngine(**cfg.torch_kwargs())
    sd = model.state_dict()
    want = expected_shapes(cfg)
    assert set(sd) == set(want), (set(sd) ^ set(want))
    for key, shape in want.items():
        assert tuple(sd[key].shape) == shape, key
    if variant == "parent":
        assert not [k for k in sd if "phase_proj" in k or "atom_feat" in k]
    # Tied: one tensor, counted once.
    assert model.output_head.weight is model.observe.weight
    assert sd["output_head.weight"].data_ptr() == sd["observe.weight"].data_ptr()
    assert model.output_head.bias is None
    names = [n for n, _ in model.named_parameters()]
    assert "observe.weight" in names and "output_head.weight" not in names


def test_extra_kwargs_are_ignored():
    kw = dict(tiny().torch_kwargs(), capacity_factor=1.25, compute_dtype="float32")
    assert set(FractusEngine(**kw).state_dict()) == set(FractusEngine(**tiny().torch_kwargs()).state_dict())


def test_atom_1b_parameter_count():
    with torch.device("meta"):
        model = FractusEngine(**atom_1b().torch_kwargs())
    assert model.observe.weight.is_meta
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n == 985_074_354


@pytest.mark.parametrize("variant", VARIANTS)
def test_initialisation(variant):
    model = make(variant)
    D = model.d_model
    emb_std = model.observe.weight.std().item()
    assert (abs(emb_std - 0.02) < 0.004) if variant == "atom" else (abs(emb_std - 1.0) < 0.1)
    omega_bound = 0.2 if variant == "atom" else 0.05
    blk = model.blocks[0]
    assert blk.kuramoto.omega.abs().max() <= omega_bound
    assert blk.kuramoto.omega.abs().max() > omega_bound / 4
    lam = blk.kuramoto.coupling_lambda
    assert lam.min() >= 0.01 and lam.max() <= 0.51
    assert blk.attn.w_qkv.abs().max() <= math.sqrt(2 / (2 * D))
    assert torch.all(blk.moe.scale1 == 1) and torch.all(blk.moe.b1 == 0)
    assert torch.all(blk.attn.level_logits == 0) and torch.all(blk.attn.b_qkv == 0)
    if variant == "atom":
        assert torch.all(model.atom_feat.weight == 0) and torch.all(model.atom_feat.bias == 0)
        assert torch.all(blk.kuramoto.phase_proj.bias == 0)
    # Buffers are plain state: a load (or a growth) decides them, dtype changes only cast.
    assert blk.attn.level_offsets.dtype == torch.float64
    torch.testing.assert_close(blk.attn.level_offsets, level_offsets(2), rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(blk.moe.expert_phases, farey_phases(8), rtol=1e-7, atol=1e-7)


def test_farey_phases_and_level_offsets():
    assert len(farey_sequence(16)) == 81
    seq = farey_sequence(16)
    assert seq[0] == (0, 1) and seq[-1] == (1, 1)
    assert all(a * d < c * b for (a, b), (c, d) in zip(seq, seq[1:]))   # strictly ascending
    want = torch.tensor([0, 0.8378, 1.5708, 2.3562, 3.1416, 3.9270, 4.7124, 5.4454], dtype=torch.float64)
    got = farey_phases(8)
    assert got.dtype == torch.float64 and got.shape == (8,)
    assert torch.allclose(got, want, atol=6e-5)
    phi = (1 + math.sqrt(5)) / 2
    assert torch.allclose(level_offsets(3), torch.tensor([1.0, phi ** -2, phi ** -4], dtype=torch.float64))


# ------------------------------------------------------------------ kernels

def _random_attention_inputs(B=2, H=3, C=17, dH=5, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    qf, kf = Fn.elu1(rnd(B, H, C, dH)), Fn.elu1(rnd(B, H, C, dH))
    S0 = rnd(B, H, dH, dH)
    z0 = Fn.elu1(rnd(B, H, dH))
    return qf, kf, rnd(B, H, C, dH), S0, z0


def test_einsum_attention_equals_loop_attention():
    qf, kf, v, S0, z0 = _random_attention_inputs()
    y_loop, S_loop, z_loop = loop_attention(qf, kf, v, S0, z0)
    y_ein, S_ein, z_ein = einsum_attention(qf, kf, v, S0, z0)
    y_zero, _, _ = loop_attention(qf, kf, v, torch.zeros_like(S0), torch.zeros_like(z0))
    assert (y_loop - y_zero).abs().max() > 1e-3          # the carry matters: a real comparison
    torch.testing.assert_close(y_ein, y_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S_ein, S_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z_ein, z_loop, rtol=1e-12, atol=1e-12)
    # Position 0 by hand: y_0 = qf_0·(S0 + kf_0⊗v_0) / qf_0·(z0 + kf_0).
    S1 = S0 + kf[:, :, 0, :, None] * v[:, :, 0, None, :]
    y0 = torch.einsum("bhi,bhij->bhj", qf[:, :, 0], S1) / (qf[:, :, 0] * (z0 + kf[:, :, 0])).sum(-1)[..., None]
    torch.testing.assert_close(y_loop[:, :, 0], y0, rtol=1e-12, atol=1e-12)


def test_loop_attention_reset_restarts_the_row():
    qf, kf, v, S0, z0 = _random_attention_inputs()
    t = 6
    reset = torch.zeros(2, qf.shape[2], dtype=torch.bool)
    reset[0, t] = True
    y, _, _ = loop_attention(qf, kf, v, S0, z0, reset)
    y_plain, _, _ = loop_attention(qf, kf, v, S0, z0)
    y_fresh, _, _ = loop_attention(qf[:1, :, t:], kf[:1, :, t:], v[:1, :, t:],
                                   torch.zeros_like(S0[:1]), torch.zeros_like(z0[:1]))
    assert (y_plain[0, :, t:] - y_fresh[0]).abs().max() > 1e-3
    torch.testing.assert_close(y[0, :, t:], y_fresh[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(y[0, :, :t], y_plain[0, :, :t]) and torch.equal(y[1], y_plain[1])


def test_kuramoto_uncoupled_is_exact_rotation():
    # With U = 0 and no damping the field is the constant ω, so RK4 is exact: θ0 + dt·ω (mod 2π).
    g = torch.Generator().manual_seed(0)
    theta0 = torch.rand(3, 4, 8, generator=g, dtype=torch.float64) * Fn.TWO_PI
    omega = torch.randn(8, generator=g, dtype=torch.float64)
    out = Fn.kuramoto_integrate(theta0, omega, torch.zeros(8, 2, dtype=torch.float64),
                                torch.ones(2, dtype=torch.float64), 0.0, 0.1, 3)
    want = torch.remainder(theta0 + 0.3 * omega, Fn.TWO_PI)
    diff = torch.remainder(out - want + math.pi, Fn.TWO_PI) - math.pi      # on the circle
    assert diff.abs().max() < 1e-12
    assert out.min() >= 0 and out.max() < Fn.TWO_PI


def test_gates_pick_the_expert_at_the_mean_phase():
    phases = farey_phases(8)
    psi = phases[3].repeat(5, 16)             # every oscillator at expert 3's angle
    g = Fn.phase_gates(psi, phases, 1.6)
    torch.testing.assert_close(g.sum(-1), torch.ones(5, dtype=torch.float64))
    w, idx = Fn.topk_weights(g, 2)
    assert torch.all(idx[:, 0] == 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(5, dtype=torch.float64))
    assert Fn.load_balance(torch.full((4, 8), 1 / 8, dtype=torch.float64)) == 0
    assert Fn.load_balance(g) > 0


# ------------------------------------------------------------------ engine behaviour

def off_the_wrap(model, seed=0):
    """Random norm_kur weights and a bias of mean 0.5 in every block.

    At init the parent's mean-phase encoding is the mean of a LayerNorm output with unit
    weight and zero bias: rounding noise of either sign, so `mod 2π` puts oscillator 0 at
    ~0 or ~2π depending on the CPU (docs/spec.md §3.2). Off that point the base phase is a
    real function of the input and two computations of it agree up to rounding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in model.blocks:
            n = blk.norm_kur
            n.weight.add_(0.3 * torch.randn(n.weight.shape, generator=g, dtype=n.weight.dtype))
            n.bias.copy_(0.5 + 0.3 * torch.randn(n.bias.shape, generator=g, dtype=n.bias.dtype))
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_bos_in_the_middle_resets_only_that_row(variant):
    model = off_the_wrap(make(variant))
    model(random_ids(2, 12, seed=1))                      # non-zero carry
    warm = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.thought_state.abs().max() > 0 and model.blocks[0].attn_S.abs().max() > 0

    t, C = 5, 16
    ids = random_ids(2, C, seed=2)
    ids[0, t] = BOS
    logits, _ = model(ids)

    model.load_state_dict(warm)
    ids_nobos = ids.clone()
    ids_nobos[0, t] = 65
    logits_nobos, _ = model(ids_nobos)
    assert (logits[0, t:] - logits_nobos[0, t:]).abs().max() > 1e-6
    torch.testing.assert_close(logits[1], logits_nobos[1], rtol=1e-12, atol=1e-12)
    if variant == "atom":
        # The Atom engine is causal: positions before the BOS do not see it.
        torch.testing.assert_close(logits[0, :t], logits_nobos[0, :t], rtol=1e-12, atol=1e-12)
    else:
        # The parent routes every position of a row by the chunk's last position
        # (docs/spec.md §3.3), which the reset changes: it is causal in attention only.
        assert (logits[0, :t] - logits_nobos[0, :t]).abs().max() > 1e-6

    # From the BOS on, row 0 is a fresh document: equal to a freshly reset engine on the suffix.
    model.reset_state(1)
    fresh, _ = model(ids[:1, t:])
    torch.testing.assert_close(logits[0, t:], fresh[0], rtol=1e-10, atol=1e-10)
    # ...and only because of the reset: without bos_id the earlier context leaks in.
    no_reset = make(variant, bos_id=None)
    no_reset.load_state_dict(warm)
    leaked, _ = no_reset(ids)
    assert (leaked[0, t:] - fresh[0]).abs().max() > 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_bos_at_position_zero_skips_thought_and_carry(variant):
    model = off_the_wrap(make(variant))
    model(random_ids(2, 10, seed=3))
    assert model.thought_state.abs().max() > 0
    ids = random_ids(2, 8, seed=4)
    ids[0, 0] = BOS
    logits, _ = model(ids)
    model.reset_state(2)
    fresh, _ = model(ids)
    torch.testing.assert_close(logits[0], fresh[0], rtol=1e-10, atol=1e-10)
    assert (logits[1] - fresh[1]).abs().max() > 1e-6      # row 1 kept its carry


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_is_deterministic_and_updates_the_carry(variant):
    model = make(variant)
    B, C, D, N = 3, 9, model.d_model, 8
    ids = random_ids(B, C, seed=5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.thought_state.shape == (1, 1, D)
    logits1, lb1 = model(ids)
    assert logits1.shape == (B, C, model.vocab_size) and lb1.shape == ()
    assert model.thought_state.shape == (B, 1, D)         # reset to the new batch size
    torch.testing.assert_close(model.thought_state, model.last_hidden[:, -1:].detach(), rtol=0, atol=0)
    assert not model.thought_state.requires_grad and model.last_hidden.requires_grad
    assert model.last_lb_loss == lb1.detach()
    for blk in model.blocks:
        assert blk.attn_S.shape == (B, D, D) and blk.attn_z.shape == (B, D)
        assert blk.attn_S.abs().max() > 0 and blk.attn_z.min() > 0
        assert blk.kuramoto_phases.shape == (B, 1, N)
        assert blk.kuramoto_phases.min() >= 0 and blk.kuramoto_phases.max() < Fn.TWO_PI
        # Block-diagonal: head 0 (rows 0..15) owns no entries of head 1's columns.
        assert torch.all(blk.attn_S[:, :16, 16:] == 0) and torch.all(blk.attn_S[:, 16:, :16] == 0)
    after1 = {k: v.clone() for k, v in model.state_dict().items()}

    logits2, _ = model(ids)                               # same ids, carried state
    assert (logits2 - logits1).abs().max() > 1e-6

    model.load_state_dict(start)
    again, lb_again = model(ids)
    assert torch.equal(again, logits1) and torch.equal(lb_again, lb1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, after1[k]), k


@pytest.mark.parametrize("variant", VARIANTS)
def test_strict_load_into_fresh_engine_gives_identical_logits(variant):
    src = make(variant, seed=0)
    src(random_ids(2, 7, seed=6))                         # carry at batch 2
    buf = io.BytesIO()
    torch.save({"model_state": src.state_dict(), "config": tiny(variant=variant).torch_kwargs()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    dst = FractusEngine(**ckpt["config"]).double()        # different init (RNG moved on)
    probe = random_ids(2, 6, seed=7)
    before, _ = dst(probe)
    dst.reset_state(1)
    expected, _ = src(probe)
    assert (before - expected).abs().max() > 1e-3
    result = dst.load_state_dict(ckpt["model_state"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert dst.output_head.weight is dst.observe.weight
    got, _ = dst(probe)
    assert torch.equal(got, expected)


def test_load_accepts_compiled_prefix_and_chunk_shaped_phases():
    src = make("atom")
    src(random_ids(2, 5, seed=8))
    sd = {"_orig_mod." + k: v for k, v in src.state_dict().items()}
    sd["_orig_mod.blocks.0.kuramoto_phases"] = torch.cat(
        [torch.zeros(2, 4, 8, dtype=torch.float64), src.blocks[0].kuramoto_phases], dim=1)
    dst = make("atom", seed=1)
    dst.load_state_dict(sd, strict=True)
    assert torch.equal(dst.blocks[0].kuramoto_phases, src.blocks[0].kuramoto_phases)


def test_atom_features_enter_only_at_boundary_ids():
    model = make("atom")
    with torch.no_grad():
        model.atom_feat.weight.normal_()
    ids = random_ids(1, 8, seed=9)
    ids[0, 4] = 259
    feats = torch.randn(1, 8, 320, dtype=torch.float64)
    base, _ = model(ids)
    model.reset_state(1)
    with_f, _ = model(ids, feats)
    torch.testing.assert_close(with_f[0, :4], base[0, :4], rtol=1e-12, atol=1e-12)
    assert (with_f[0, 4:] - base[0, 4:]).abs().max() > 1e-6
    feats2 = feats.clone()
    feats2[0, :4] += 10.0                                  # non-boundary positions: ignored
    model.reset_state(1)
    with_f2, _ = model(ids, feats2)
    assert torch.equal(with_f2, with_f)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_reach_every_trainable_parameter(variant):
    model = make(variant)
    ids = random_ids(2, 10, seed=10, hi=266)
    ids[:, 3] = 260
    kwargs = {}
    if variant == "atom":
        kwargs["feats"] = torch.randn(2, 10, 320, dtype=torch.float64)
    logits, lb = model(ids, **kwargs)
    targets = torch.roll(ids, -1, dims=1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    conf = torch.sigmoid(model.confidence_head(model.last_hidden[:, -1])).mean()
    (loss + 0.02 * lb + conf).backward()
    for name, p in model.named_parameters():
        if name.startswith("salience_head"):              # not used by the forward (docs/spec.md §4)
            continue
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
