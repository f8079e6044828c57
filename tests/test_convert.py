"""The converter both ways: run directory ↔ .pt / .bin / safetensors, optimizer moments, refusals.

One tiny run is trained by the trainer (3 steps, AdamW) and shared; every test starts
from it or from the PyTorch reference engine.
"""
import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from fractus_jax import model  # noqa: E402
from fractus_jax.config import WEIGHT_FIELDS  # noqa: E402
from fractus_jax.convert import state_dicts  # noqa: E402
from fractus_jax.convert import files, names, optim, run  # noqa: E402
from fractus_jax.convert.__main__ import main as cli  # noqa: E402
from fractus_jax.lanes import LaneReader  # noqa: E402
from fractus_jax.reference import FractusEngine  # noqa: E402
from fractus_jax.reference import functional as Fn  # noqa: E402
from fractus_jax.train import checkpoint as ckpt_lib  # noqa: E402
from fractus_jax.train import config as cfg_lib  # noqa: E402
from fractus_jax.train import loop  # noqa: E402
from fractus_jax.train import prepare as prepare_lib  # noqa: E402
from fractus_jax.train import state as state_lib  # noqa: E402
from fractus_jax.train import step as step_lib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tiny(corpus_file, *overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [f"corpus={corpus_file}", "max_steps=3", *overrides])


def train(cfg, workdir):
    plan = prepare_lib.prepare(cfg, workdir, progress=False)
    loop.run(plan, progress=False, log=lambda m: None)
    return plan


@pytest.fixture(scope="module")
def trained(corpus_file, tmp_path_factory):
    """(cfg, run dir at step 3, its export a.pt + a.opt)."""
    base = tmp_path_factory.mktemp("trained")
    cfg = tiny(corpus_file)
    train(cfg, base / "run")
    written = run.export_run(base / "run", base / "a.pt", opt=True)
    assert written == [base / "a.pt", base / "a.opt"]
    return cfg, base / "run", base / "a.pt"


def _restore(workdir, cfg):
    snap = run.load_run(workdir, with_opt=True)
    return {"params": snap.params, "opt_state": snap.opt_state, "carry": snap.carry,
            "step": snap.step, "skipped": snap.skipped}


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _assert_files_equal(a, b):
    """Two exports hold the same tensors bit for bit and the same extra keys."""
    ta, tb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert list(ta["model_state"]) == list(tb["model_state"])
    for k in ta["model_state"]:
        assert torch.equal(ta["model_state"][k], tb["model_state"][k]), k
    assert {k: v for k, v in ta.items() if k != "model_state"} == {k: v for k, v in tb.items() if k != "model_state"}


def _assert_opt_equal(a, b):
    oa, ob = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        assert oa["state"][i].keys() == ob["state"][i].keys()
        for slot in oa["state"][i]:
            assert torch.equal(oa["state"][i][slot], ob["state"][i][slot]), (i, slot)


def test_pt_round_trip_is_bit_exact_and_the_import_resumes_alike(trained, corpus_file, tmp_path):
    cfg, run_dir, a_pt = trained
    meta = run.import_checkpoint(a_pt, tmp_path / "imported", "tiny", [f"corpus={corpus_file}"], log=print)
    assert meta["step"] == 3 and meta["start_token_next"] == 3 * cfg.seq_len and meta["carry"] == "imported"
    run.export_run(tmp_path / "imported", tmp_path / "b.pt", opt=True)
    _assert_files_equal(a_pt, tmp_path / "b.pt")
    _assert_opt_equal(a_pt.with_suffix(".opt"), tmp_path / "b.opt")
    original = _restore(run_dir, cfg)
    _assert_trees_equal(original, _restore(tmp_path / "imported", cfg))
    assert np.any(original["carry"]["S"]) and np.any(optim.find_moments(original["opt_state"]).nu["observe"])

    # Nothing was lost: the trainer continues both directories to the same bits.
    shutil.copytree(run_dir, tmp_path / "original")
    longer = tiny(corpus_file, "max_steps=5")
    for d in ("original", "imported"):
        plan = train(longer, tmp_path / d)
        assert plan.resume_step == 3 and plan.start_pos == 3 * cfg.seq_len
    a, b = _restore(tmp_path / "original", longer), _restore(tmp_path / "imported", longer)
    assert a["step"] == 5
    _assert_trees_equal(a, b)


def test_safetensors_round_trip_is_bit_exact(trained, corpus_file, tmp_path):
    from safetensors import safe_open
    _, run_dir, a_pt = trained
    run.export_run(run_dir, tmp_path / "a.safetensors", opt=True)
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        stored, metadata = set(f.keys()), f.metadata()
    assert names.TIED_HEAD not in stored and "observe.weight" in stored      # the tied head once
    assert json.loads(metadata["config"])["capacity_factor"] is None and json.loads(metadata["step"]) == 3
    run.import_checkpoint(tmp_path / "a.safetensors", tmp_path / "imported", "tiny", [f"corpus={corpus_file}"],
                          log=print)
    run.export_run(tmp_path / "imported", tmp_path / "b.safetensors", opt=True)
    ca, cb = files.read_checkpoint(tmp_path / "a.safetensors"), files.read_checkpoint(tmp_path / "b.safetensors")
    pt = files.read_checkpoint(a_pt)
    assert ca.config == cb.config == pt.config and ca.extras == cb.extras == pt.extras
    assert set(ca.model_state) == set(cb.model_state) == set(pt.model_state)
    for k in pt.model_state:
        assert torch.equal(ca.model_state[k], cb.model_state[k]) and torch.equal(ca.model_state[k], pt.model_state[k]), k
    _assert_opt_equal(tmp_path / "a.opt", tmp_path / "b.opt")


def test_export_loads_strictly_and_gives_the_jax_logits_on_the_next_chunk(trained, corpus_file):
    cfg, run_dir, a_pt = trained
    blob = torch.load(a_pt, weights_only=True)
    assert blob["config"] == {**cfg.model.torch_kwargs(), "capacity_factor": cfg.model.capacity_factor,
                              "gate_temp": cfg.model.gate_temperature}   # the PyTorch trainers' key too
    assert (blob["step"], blob["start_token_next"], blob["batch_size"], blob["seq_len"]) == (3, 48, 4, 16)
    sd = blob["model_state"]
    assert sd[names.TIED_HEAD] is sd["observe.weight"]
    assert sd["thought_state"].shape == (4, 1, 32) and sd["blocks.0.kuramoto_phases"].shape == (4, 1, 8)
    assert "blocks.1.kuramoto.phase_proj.weight" in sd and "atom_feat.weight" in sd
    ref = FractusEngine(**blob["config"])
    assert list(sd) == list(ref.state_dict())
    missing, unexpected = ref.load_state_dict(sd, strict=True)
    assert not missing and not unexpected

    corpus = np.fromfile(corpus_file, "<u2")
    ids = LaneReader(corpus, cfg.batch_size, cfg.seq_len).read(blob["start_token_next"])[0][0, :, :-1]
    with torch.no_grad():
        logits_t, _ = ref(torch.from_numpy(ids.astype(np.int64)))
    snap = run.load_run(run_dir, with_opt=False)
    exact = cfg.model.replace(capacity_factor=None)       # the reference routes without capacity
    logits_j, _, new_state = jax.jit(model.forward_chunk, static_argnums=3)(snap.params, snap.carry, ids, exact)
    np.testing.assert_allclose(np.asarray(logits_j), logits_t.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(new_state["thought"]), ref.thought_state[:, 0].numpy(), rtol=1e-4, atol=1e-4)
    # The carried state matters: from a zero carry the logits differ.
    zero = model.init_state(cfg.model, cfg.batch_size)
    logits_0, _, _ = jax.jit(model.forward_chunk, static_argnums=3)(snap.params, zero, ids, exact)
    assert np.abs(np.asarray(logits_0) - logits_t.numpy()).max() > 1e-3


def test_import_fresh_carry_starts_from_a_zero_carry(trained, corpus_file, tmp_path, capsys):
    """`convert import --fresh-carry`: the weights and moments as in the file, the carry zeros
    (without the flag the same file's carry comes in)."""
    _, run_dir, a_pt = trained
    argv = ["import", "--pt", str(a_pt), "--config", "tiny", "--set", f"corpus={corpus_file}"]
    assert cli([*argv, "--out", str(tmp_path / "fresh"), "--fresh-carry"]) == 0
    captured = capsys.readouterr()
    assert "carry zero" in captured.out and "--fresh-carry: the run starts from a zero carry" in captured.err
    fresh, original = run.load_run(tmp_path / "fresh", with_opt=True), run.load_run(run_dir, with_opt=True)
    _assert_trees_equal(fresh.params, original.params)
    _assert_trees_equal(fresh.opt_state, original.opt_state)
    assert np.any(original.carry["S"]) and not any(np.any(a) for a in jax.tree.leaves(fresh.carry))
    assert fresh.meta["carry"] == "zero" and fresh.step == original.step


DECAY = "model.carry_decay=0.8,0.95"


def test_a_decayed_run_exports_with_a_warning_and_imports_its_decay(corpus_file, tmp_path, capsys):
    """A run with carry_decay: the export's config records it and the command says that the
    PyTorch trainers' engine computes another function; the reference engine built from that
    config gives the run's logits (and without the decay it does not); import takes the
    file's decay, and refuses a config that sets another."""
    cfg = tiny(corpus_file, DECAY, "max_steps=2")
    train(cfg, tmp_path / "run")
    assert cli(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "d.pt")]) == 0
    err = capsys.readouterr().err
    assert "warning: carry_decay=0.8,0.95 is set" in err and "PyTorch trainers' engine" in err, err
    blob = torch.load(tmp_path / "d.pt", weights_only=True)
    assert blob["config"]["carry_decay"] == [0.8, 0.95]

    corpus = np.fromfile(corpus_file, "<u2")
    ids = LaneReader(corpus, cfg.batch_size, cfg.seq_len).read(blob["start_token_next"])[0][0, :, :-1]
    snap = run.load_run(tmp_path / "run", with_opt=False)
    logits_j, _, _ = jax.jit(model.forward_chunk, static_argnums=3)(snap.params, snap.carry, ids, cfg.model)

    def reference_logits(config):
        ref = FractusEngine(**config)
        ref.load_state_dict(blob["model_state"], strict=True)
        with torch.no_grad():
            return ref(torch.from_numpy(ids.astype(np.int64)))[0].numpy()

    np.testing.assert_allclose(np.asarray(logits_j), reference_logits(blob["config"]), rtol=1e-4, atol=1e-4)
    undecayed = {k: v for k, v in blob["config"].items() if k != "carry_decay"}
    assert np.abs(np.asarray(logits_j) - reference_logits(undecayed)).max() > 1e-3

    argv = ["import", "--pt", str(tmp_path / "d.pt"), "--config", "tiny", "--set", f"corpus={corpus_file}"]
    assert cli([*argv, "--out", str(tmp_path / "back")]) == 0, capsys.readouterr().err
    assert "computes the file's carry_decay [0.8, 0.95]" in capsys.readouterr().err
    assert ckpt_lib.read_manifest(tmp_path / "back")["config"]["model"]["carry_decay"] == [0.8, 0.95]
    _refused(capsys, [*argv, "--out", str(tmp_path / "other"), "--set", "model.carry_decay=0.9,0.95"],
             tmp_path / "other", "the file's carry_decay is [0.8, 0.95]", "--set model.carry_decay=0.8,0.95")


def test_a_learned_decay_exports_its_weights_and_imports_them(trained, corpus_file, tmp_path, capsys):
    """learn_carry_decay: attn.decay_logit is a weight. The export holds it and its config the
    switch, and says that the PyTorch trainers' engine would refuse it; the reference engine
    built from that config loads it strictly and gives the run's logits; import brings the
    trained weight back, and refuses the switch for a file without it."""
    trained_pt = trained[2]
    cfg = tiny(corpus_file, DECAY, "model.learn_carry_decay=true", "max_steps=2")
    train(cfg, tmp_path / "run")
    assert cli(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "d.pt")]) == 0
    err = capsys.readouterr().err
    assert "warning: learn_carry_decay is set" in err and "attn.decay_logit" in err, err
    blob = torch.load(tmp_path / "d.pt", weights_only=True)
    assert blob["config"]["learn_carry_decay"] is True
    snap = run.load_run(tmp_path / "run", with_opt=False)
    logit = np.asarray(snap.params["blocks"]["attn"]["decay_logit"])
    assert logit.shape == (cfg.model.n_layers, cfg.model.n_levels, cfg.model.n_heads)
    assert np.abs(logit - model.decay_logits(cfg.model)).max() > 1e-4, "the decay is trained"
    np.testing.assert_array_equal(blob["model_state"]["blocks.1.attn.decay_logit"].numpy(), logit[1])

    corpus = np.fromfile(corpus_file, "<u2")
    ids = LaneReader(corpus, cfg.batch_size, cfg.seq_len).read(blob["start_token_next"])[0][0, :, :-1]
    logits_j, _, _ = jax.jit(model.forward_chunk, static_argnums=3)(snap.params, snap.carry, ids, cfg.model)
    ref = FractusEngine(**blob["config"])
    ref.load_state_dict(blob["model_state"], strict=True)
    with torch.no_grad():
        logits_t = ref(torch.from_numpy(ids.astype(np.int64)))[0].numpy()
    np.testing.assert_allclose(np.asarray(logits_j), logits_t, rtol=1e-4, atol=1e-4)
    fixed = {k: v for k, v in blob["config"].items() if k != "learn_carry_decay"}
    with pytest.raises(RuntimeError, match="decay_logit"):
        FractusEngine(**fixed).load_state_dict(blob["model_state"], strict=True)

    argv = ["import", "--pt", str(tmp_path / "d.pt"), "--config", "tiny", "--set", f"corpus={corpus_file}"]
    assert cli([*argv, "--out", str(tmp_path / "back")]) == 0, capsys.readouterr().err
    assert "learns the carry decay from the file's attn.decay_logit" in capsys.readouterr().err
    back = run.load_run(tmp_path / "back", with_opt=False)
    assert back.cfg.model.learn_carry_decay and back.cfg.model.carry_decay == (0.8, 0.95)
    np.testing.assert_array_equal(np.asarray(back.params["blocks"]["attn"]["decay_logit"]), logit)

    _refused(capsys, ["import", "--pt", str(trained_pt), "--config", "tiny", "--set", f"corpus={corpus_file}",
                      "--set", DECAY, "--set", "model.learn_carry_decay=true", "--out", str(tmp_path / "other")],
             tmp_path / "other", "holds no learned carry decay", "learn_carry_decay=true")


# What the training loss never reaches (no features fed): PyTorch's optimizers skip them, and so does the trainer.
UNREACHED = {"confidence_head.weight", "confidence_head.bias", "salience_head.weight", "salience_head.bias",
             "atom_feat.weight", "atom_feat.bias"}


def _torch_steps(engine, opt, grads, cfg, first_step):
    for k, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = optim.scheduled_lr(cfg, first_step + k)
        for n, p in engine.named_parameters():
            p.grad = torch.from_numpy(g[n]) if n in g else None
        torch.nn.utils.clip_grad_norm_(engine.parameters(), cfg.clip_norm)
        opt.step()


def _jax_steps(params, opt_state, grads, cfg, first_step):
    tx = state_lib.make_optimizer(cfg, params)
    shapes = state_dicts.expected_shapes(cfg.model)
    for k, g in enumerate(grads):
        sd = {n: g.get(n, np.zeros(s, np.float32)) for n, s in shapes.items()}
        tree = state_dicts.params_from_torch(sd, cfg.model)
        updates, opt_state = tx.update(tree, opt_state, params)
        lr = optim.scheduled_lr(cfg, first_step + k)
        params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
    return params, opt_state


def _grads(engine, n, seed):
    """Random gradients for the parameters a loss reaches (the others' .grad stays None)."""
    rng = np.random.default_rng(seed)
    return [{name: (0.3 * rng.standard_normal(p.shape)).astype(np.float32) for name, p in engine.named_parameters()
             if name not in UNREACHED} for _ in range(n)]


def _batches(cfg, n, seed):
    """n batches of (B, C + 1) ids, as the trainer's lanes give one step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g) for _ in range(n)]


def _torch_adamw(engine, cfg):
    return torch.optim.AdamW(engine.parameters(), lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def _torch_train_step(engine, opt, ids, cfg, step, lr_dtype=float):
    """One training step on the reference engine, written here as the PyTorch trainers' loop
    does it (not their code): CE + lb_coef·lb on the chunk (the carry flowing, detached),
    clip 1.0, the optimizer at the trainer's scheduled lr (rounded by lr_dtype: the JAX
    trainer holds it as a float32 scalar)."""
    for group in opt.param_groups:
        group["lr"] = float(lr_dtype(optim.scheduled_lr(cfg, step)))
    opt.zero_grad(set_to_none=True)
    logits, lb = engine(ids[:, :-1])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    (ce + cfg.lb_coef * lb).backward()
    torch.nn.utils.clip_grad_norm_(engine.parameters(), cfg.clip_norm)
    opt.step()


def _jax_train_step(snap, ids, x64: bool = False, kernels: str = "plain"):
    """The trainer's own step (make_train_step) once, from a restored run, with the plain
    kernels (a GPU's) or the CPU-tuned forms (what a CPU run trains with); with x64, in
    float64 (the weights, moments and carry cast up), as `_float64_step` on the PyTorch side."""
    cfg = cfg_lib.apply_overrides(snap.cfg, [f"execution.kernels={kernels}"])
    state = {"params": snap.params, "opt_state": snap.opt_state, "carry": snap.carry,
             "step": np.asarray(snap.step, np.int32), "skipped": np.asarray(snap.skipped, np.int32)}
    batch = {"ids": np.asarray(ids.numpy()[None], np.int32)}
    with jax.enable_x64(x64):
        if x64:
            state = jax.tree.map(lambda x: np.asarray(x, np.float64) if np.issubdtype(x.dtype, np.floating) else x,
                                 jax.device_get(state))
        new, metrics = jax.jit(step_lib.make_train_step(cfg))(state, batch)
        assert int(metrics["skipped"]) == 0
        return jax.device_get(new)


def _rel(got, want, floor: float = 0.0) -> float:
    """|got - want| / max(|want|, floor) over the leaf (L2). Not element by element: AdamW's
    g/√v turns the float32 rounding of an element whose gradient nearly cancels into a step of
    up to lr, on one side and not the other (seen: one element at 3.9e-4 of the leaf's largest
    step)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor, 1e-30))


# A float32 step is compared with PyTorch's on a batch where float32 cannot change a top-k
# choice. A position whose K-th and (K+1)-th float64 gates lie within TIE_MARGIN of each other
# is a near tie: 50× the largest float32 gate error measured on these tests' batches (6.1e-6,
# the reference engine in float32 against float64), so no float32 program, on any CPU, picks
# other experts there than float64 does. Near ties are counted in the first draw (at most
# NEAR_TIE_RATE of its positions·layers); each row holding one is redrawn until none does.
TIE_MARGIN = 3e-4
NEAR_TIE_RATE = 0.01


def _gates(engine, ids, cfg, dtype) -> np.ndarray:
    """(layers, B, C, E) each block's gates on ids[:, :-1], from a copy of the engine (its
    weights and carry) in dtype."""
    copy_ = FractusEngine(**cfg.model.torch_kwargs())
    copy_.load_state_dict(engine.state_dict(), strict=True)
    copy_.to(dtype)
    gates = []

    def hook(module, inputs, _output):
        gates.append(Fn.phase_gates(inputs[1], module.expert_phases, module.kappa_eff).detach().double().numpy())

    for block in copy_.blocks:
        block.moe.register_forward_hook(hook)
    with torch.no_grad():
        copy_(ids[:, :-1])
    return np.stack(gates)


def _near_ties(gates: np.ndarray, top_k: int) -> np.ndarray:
    """(layers, B, C): the K-th and (K+1)-th gates within TIE_MARGIN."""
    ranked = -np.sort(-gates, axis=-1)
    return ranked[..., top_k - 1] - ranked[..., top_k] < TIE_MARGIN


def _clear_of_ties(engine, ids, cfg, seed: int):
    """ids with every row that holds a near tie (float64) redrawn, until none does; the
    first draw's near ties are counted and bounded, and float32's gate error is checked far
    inside the margin."""
    g = torch.Generator().manual_seed(seed)
    ties = _near_ties(_gates(engine, ids, cfg, torch.float64), cfg.model.top_k)
    print(f"near top-k ties: {int(ties.sum())}/{ties.size} positions·layers")
    assert ties.mean() <= NEAR_TIE_RATE, (int(ties.sum()), ties.size)
    for _ in range(20):
        rows = np.nonzero(ties.any(axis=(0, 2)))[0]
        if not len(rows):
            break
        ids = ids.clone()
        ids[torch.from_numpy(rows)] = torch.randint(0, cfg.model.vocab_size, (len(rows), ids.shape[1]), generator=g)
        ties = _near_ties(_gates(engine, ids, cfg, torch.float64), cfg.model.top_k)
    assert not ties.any()
    error = np.abs(_gates(engine, ids, cfg, torch.float32) - _gates(engine, ids, cfg, torch.float64)).max()
    assert error < TIE_MARGIN / 10, error
    return ids


def _float64_step(engine, opt, ids, cfg, step):
    """The same PyTorch step in float64, on copies of the engine (its carry included) and the
    optimizer, at the float32 lr the JAX trainer holds: (engine, opt) after it."""
    e64 = FractusEngine(**cfg.model.torch_kwargs())
    e64.load_state_dict(engine.state_dict(), strict=True)   # the weights and the carry buffers
    e64.double()
    o64 = _torch_adamw(e64, cfg)
    o64.load_state_dict(copy.deepcopy(opt.state_dict()))   # the moments cast to the parameters' float64
    _torch_train_step(e64, o64, ids.clone(), cfg, step, lr_dtype=np.float32)
    return e64, o64


def _step_figures(jax_state, engine, opt, before, cfg):
    """name → {update, exp_avg, exp_avg_sq} of one step on each side (numpy), and the
    unreached parameters checked bitwise untouched on both sides, with no moments on either."""
    after = state_dicts.params_to_torch(jax_state["params"], cfg.model)
    exported = optim.optimizer_to_torch(jax_state["opt_state"], jax_state["params"], cfg, int(jax_state["step"]))["state"]
    theirs = opt.state_dict()["state"]
    torch_after = {n: p.detach().numpy() for n, p in engine.named_parameters()}
    got, want = {}, {}
    for i, (name, _) in enumerate(optim.torch_parameters(cfg.model)):
        if name in UNREACHED:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
            np.testing.assert_array_equal(torch_after[name], before[name], err_msg=name)
            assert i not in exported and i not in theirs, name
            continue
        assert float(exported[i]["step"]) == float(theirs[i]["step"]), name
        got[name] = {"update": after[name] - before[name], **{s: exported[i][s].numpy() for s in MOMENTS}}
        want[name] = {"update": torch_after[name] - before[name], **{s: theirs[i][s].numpy() for s in MOMENTS}}
    return got, want


MOMENTS = ("exp_avg", "exp_avg_sq")


# One trainer step against one PyTorch step from the same state, each leaf's update and
# moments as |jax − torch| over the leaf (L2), against the larger of the leaf's own norm and
# a leaf of its size at the slot's typical element (`_one_step_figures`). Float64: one
# function (largest measured 7.3e-14). Float32: a fixed bound near the largest figure measured
# over both hand-off tests' leaf checks (`pytest tests/test_convert.py -k hands_off -s` prints
# them): 4.5e-5, with the plain kernels and with the CPU-tuned forms alike.
FLOAT64_BOUND = 1e-10
FLOAT32_BOUND = {"plain": 1e-4, "cpu": 1e-4}
# The control: a trainer step whose update is off by this share is caught by either bound.
BROKEN_UPDATE = 1e-3


# AdamW moves an element by m̂/(√v̂ + ε). Where √v̂ is not 0 but within ILL_CONDITIONED·ε
# of it, the element's gradient is of ε's size, a sum of far larger terms that cancel, and
# float32's rounding of that sum is a large share of it; the step follows that share. Seen
# on one version of the tests' corpus: one element of blocks.1.moe.U1 at m = -1.52e-10 in
# float32 against -1.44e-10 in float64, 5% apart; such elements took that leaf's float32
# update figure to 1.6e-4, and without them (82 of 39,294 elements) the largest figure is
# 3.6e-5. A float32 update is compared without those elements (their moments are compared
# with the rest); they are counted, at most ILL_CONDITIONED_RATE of the elements reached.
ILL_CONDITIONED = 10.0
ILL_CONDITIONED_RATE = 0.01


def _ill_conditioned(opt64, cfg) -> dict:
    """name → the elements whose float64 step (opt64, after it) has 0 < √v̂ < ILL_CONDITIONED·ε."""
    names = [n for n, _ in optim.torch_parameters(cfg.model)]
    out = {}
    for i, entry in opt64.state_dict()["state"].items():
        v_hat = entry["exp_avg_sq"].numpy() / (1.0 - cfg.b2 ** float(entry["step"]))
        out[names[i]] = (v_hat > 0) & (np.sqrt(v_hat) < ILL_CONDITIONED * cfg.eps)
    return out


def _one_step_figures(before, jax_state, engine, opt, cfg, ill=None) -> dict:
    """(name, slot) → |jax − torch| over the leaf (`_rel`) of one step on each side from
    `before`, against the larger of the leaf's own norm and a leaf of its size at the slot's
    typical element (`_typical_floor`); the update without the elements `ill` names."""
    got, want = _step_figures(jax_state, engine, opt, before, cfg)
    for name, mask in (ill or {}).items():
        for side in (got, want):
            side[name]["update"] = np.where(mask, 0.0, side[name]["update"])
    slots = ("update", *MOMENTS)
    floor = {slot: _typical_floor([want[name][slot] for name in want]) for slot in slots}
    return {(name, slot): _rel(got[name][slot], want[name][slot], floor[slot](want[name][slot]))
            for name in got for slot in slots}


def _typical_floor(leaves):
    """leaf → the norm of a leaf of its size whose every element is the RMS element of
    `leaves` (all the model's leaves of one slot). A leaf whose gradient cancels over the
    batch (a scalar reached only through the top-k routing, `kuramoto.phase_proj.bias`) has
    moments and an update far below the others, and the float32 rounding of its sum is then
    a large share of its own small value: measured against its own norm, 1.7e-3 on one version
    of the test corpus, 2.1e-4 on another, against 4e-5 for every other leaf."""
    rms = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in leaves)
                        / sum(np.size(x) for x in leaves)))
    return lambda leaf: rms * float(np.sqrt(np.size(leaf)))


def _assert_within(figures: dict, bound: float, what: str) -> float:
    """Every figure within `bound`; returns the largest."""
    worst = max(figures, key=figures.get)
    assert figures[worst] <= bound, (what, worst, figures[worst], bound)
    return figures[worst]


def _broken(jax_state, before, cfg):
    """The trainer's step with its update scaled by 1 + BROKEN_UPDATE: a deliberately wrong run."""
    after = state_dicts.params_to_torch(jax_state["params"], cfg.model)
    wrong = {n: before[n] + (1.0 + BROKEN_UPDATE) * (a - before[n]) if n in before else a for n, a in after.items()}
    return {**jax_state, "params": state_dicts.params_from_torch(wrong, cfg.model)}


def _assert_one_step_alike(before, torch_side, jax32: dict, torch64, jax64, cfg) -> dict:
    """The trainer's float32 steps (`jax32`: kernels → state) and the PyTorch float32 step
    (`torch_side`: engine, opt) from the same `before`, and both float64 steps: float64 within
    FLOAT64_BOUND, float32 within FLOAT32_BOUND of its kernels, and a broken step caught.
    Returns the largest figures."""
    worst = {"float64": _assert_within(_one_step_figures(before, jax64, *torch64, cfg), FLOAT64_BOUND, "float64")}
    ill = _ill_conditioned(torch64[1], cfg)
    n_ill, n_reached = sum(int(m.sum()) for m in ill.values()), sum(m.size for m in ill.values())
    print(f"ill-conditioned AdamW elements: {n_ill}/{n_reached}")
    assert n_ill <= ILL_CONDITIONED_RATE * n_reached
    for kernels, state in jax32.items():
        bound = FLOAT32_BOUND[kernels]
        worst[f"float32 {kernels}"] = _assert_within(_one_step_figures(before, state, *torch_side, cfg, ill), bound,
                                                     f"float32, {kernels} kernels")
        with pytest.raises(AssertionError):
            _assert_within(_one_step_figures(before, _broken(state, before, cfg), *torch_side, cfg, ill), bound,
                           "broken")
    return worst


def test_a_pytorch_adamw_run_hands_off_to_one_trainer_step(corpus_file, tmp_path):
    """Reference engine + torch AdamW for 3 steps → .pt/.opt → import → the trainer's step
    equals a fourth PyTorch step on the same batch."""
    cfg = tiny(corpus_file)
    torch.manual_seed(0)
    engine = FractusEngine(**cfg.model.torch_kwargs())
    opt = _torch_adamw(engine, cfg)
    batches = _batches(cfg, 4, seed=3)
    for k, ids in enumerate(batches[:3]):
        _torch_train_step(engine, opt, ids, cfg, k)
    assert not set(opt.state_dict()["state"]) & {i for i, (n, _) in enumerate(optim.torch_parameters(cfg.model))
                                                  if n in UNREACHED}
    torch.save({"model_state": engine.state_dict(), "config": cfg.model.torch_kwargs(), "step": 3}, tmp_path / "p.pt")
    torch.save(opt.state_dict(), tmp_path / "p.opt")
    warnings = []
    run.import_checkpoint(tmp_path / "p.pt", tmp_path / "run", "tiny", [f"corpus={corpus_file}"], log=warnings.append)
    assert not any("moments" in w for w in warnings), warnings
    snap = run.load_run(tmp_path / "run", with_opt=True)
    assert snap.step == 3 and int(optim.find_moments(snap.opt_state).count) == 3
    before = {n: p.detach().numpy().copy() for n, p in engine.named_parameters()}
    for k, v in state_dicts.params_to_torch(snap.params, cfg.model).items():
        np.testing.assert_array_equal(v, before.get(k, v), err_msg=k)
    ids = _clear_of_ties(engine, batches[3], cfg, seed=4)
    jax64, torch64 = _jax_train_step(snap, ids, x64=True), _float64_step(engine, opt, ids, cfg, 3)
    jax32 = {k: _jax_train_step(snap, ids, kernels=k) for k in FLOAT32_BOUND}
    _torch_train_step(engine, opt, ids, cfg, 3)
    print("PyTorch → JAX, largest figures:", _assert_one_step_alike(before, (engine, opt), jax32, torch64, jax64, cfg))


def test_a_trainer_run_hands_off_to_pytorch_adamw_and_back(trained, corpus_file, tmp_path):
    """The trainer's run (3 steps) → export --opt → reference engine + torch AdamW: one torch
    step equals one trainer step; torch's state saved as a PyTorch trainer does comes back
    through import as the same moments."""
    cfg, run_dir, a_pt = trained
    snap = run.load_run(run_dir, with_opt=True)
    blob = torch.load(a_pt, weights_only=True)
    engine = FractusEngine(**blob["config"])
    engine.load_state_dict(blob["model_state"], strict=True)
    opt = _torch_adamw(engine, cfg)
    opt_sd = torch.load(a_pt.with_suffix(".opt"), weights_only=True)
    unreached = {i for i, (n, _) in enumerate(optim.torch_parameters(cfg.model)) if n in UNREACHED}
    assert not set(opt_sd["state"]) & unreached and len(opt_sd["state"]) == len(optim.torch_parameters(cfg.model)) - 6
    opt.load_state_dict(opt_sd)
    assert opt.param_groups[0]["betas"] == (cfg.b1, cfg.b2) and opt.param_groups[0]["weight_decay"] == cfg.weight_decay
    before = {n: p.detach().numpy().copy() for n, p in engine.named_parameters()}
    ids = _clear_of_ties(engine, _batches(cfg, 1, seed=5)[0], cfg, seed=6)
    jax64, torch64 = _jax_train_step(snap, ids, x64=True), _float64_step(engine, opt, ids, cfg, snap.step)
    jax32 = {k: _jax_train_step(snap, ids, kernels=k) for k in FLOAT32_BOUND}
    _torch_train_step(engine, opt, ids, cfg, snap.step)
    print("JAX → PyTorch, largest figures:", _assert_one_step_alike(before, (engine, opt), jax32, torch64, jax64, cfg))

    # PyTorch → JAX: the PyTorch trainer's files (compiled-module prefixes) come back as the same moments.
    prefixed = {"_orig_mod." + k: v for k, v in engine.state_dict().items()}
    torch.save({"model_state": prefixed, "config": blob["config"], "step": 4, "start_token_next": 128,
                "batch_size": 4, "seq_len": 16}, tmp_path / "c.pt")
    torch.save(opt.state_dict(), tmp_path / "c.opt")
    run.import_checkpoint(tmp_path / "c.pt", tmp_path / "back", "tiny", [f"corpus={corpus_file}"], log=print)
    back = run.load_run(tmp_path / "back", with_opt=True)
    assert back.step == 4 and back.meta["start_token_next"] == 128
    assert int(optim.find_moments(back.opt_state).count) == 4
    again = optim.optimizer_to_torch(back.opt_state, back.params, cfg, 4)["state"]
    assert again.keys() == opt.state_dict()["state"].keys()
    for i, entry in opt.state_dict()["state"].items():
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again[i][slot], entry[slot]), (i, slot)


def test_sgd_momentum_maps_both_ways(trained):
    cfg, run_dir, _ = trained
    sgd = cfg_lib.apply_overrides(cfg, ["optimizer=sgd", "lr=7e-4"])
    params = run.load_run(run_dir, with_opt=False).params
    engine = FractusEngine(**sgd.model.torch_kwargs())
    engine.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state_dicts.params_to_torch(params, sgd.model).items()},
                           strict=False)
    grads = _grads(engine, 2, seed=2)
    params1, opt_state = _jax_steps(params, state_lib.make_optimizer(sgd, params).init(params), grads[:1], sgd, 10)
    sd = optim.optimizer_to_torch(opt_state, params1, sgd, 11)
    assert set(sd["state"][0]) == {"momentum_buffer"} and sd["param_groups"][0]["momentum"] == 0.9
    template = state_lib.make_optimizer(sgd, params).init(params)
    _assert_trees_equal(optim.optimizer_from_torch(sd, template, params1, sgd, "x.opt", print), opt_state)
    # One more step on both sides from the mapped state agrees.
    engine.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state_dicts.params_to_torch(params1, sgd.model).items()},
                           strict=False)
    opt = torch.optim.SGD(engine.parameters(), lr=sgd.lr, momentum=sgd.momentum)
    opt.load_state_dict(sd)
    _torch_steps(engine, opt, grads[1:], sgd, 11)
    params2, _ = _jax_steps(params1, opt_state, grads[1:], sgd, 11)
    now = {k: v.numpy() for k, v in engine.state_dict().items()}
    for k, v in state_dicts.params_to_torch(params2, sgd.model).items():
        np.testing.assert_allclose(v, now[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _chunk_phases(sd, cfg, chunk):
    """The phases as a PyTorch chunk call leaves them, (B, C, N): only the last position is state."""
    sd = dict(sd)
    for i in range(cfg.model.n_layers):
        last = sd[names.block_key(i, names.BLOCK_PHASE)]
        sd[names.block_key(i, names.BLOCK_PHASE)] = torch.cat([torch.rand(last.shape[0], chunk - 1, last.shape[2]), last], 1)
    return sd


def _torch_trainer_files(cfg, directory, stem, batch=2, chunk=5, with_opt=True):
    """What the PyTorch trainers leave: .bin names, `_orig_mod.` keys, (B, C, N) phases, a .opt.bin."""
    torch.manual_seed(0)
    engine = FractusEngine(**cfg.model.torch_kwargs())
    opt = torch.optim.AdamW(engine.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    logits, lb = engine(torch.randint(0, 256, (batch, chunk)))
    (logits.square().mean() + lb).backward()
    opt.step()
    sd = _chunk_phases(engine.state_dict(), cfg, chunk)
    torch.save({"model_state": {"_orig_mod." + k: v for k, v in sd.items()}, "config": cfg.model.torch_kwargs(),
                "step": 7}, directory / f"{stem}.bin")
    if with_opt:
        torch.save(opt.state_dict(), directory / f"{stem}.opt.bin")
    return engine, opt


def test_pytorch_trainer_files_and_the_parent_key_set(corpus_file, tmp_path):
    parent = tiny(corpus_file, "model.variant=parent", "model.bos_id=none")
    engine, opt = _torch_trainer_files(parent, tmp_path, "parent")
    warnings = []
    meta = run.import_checkpoint(tmp_path / "parent.bin", tmp_path / "run", "tiny",
                                 [f"corpus={corpus_file}", "model.variant=parent", "model.bos_id=none"],
                                 log=warnings.append)
    assert meta["step"] == 7 and meta["carry"] == "zero"
    assert any("batch 2" in w for w in warnings) and any("start_token_next" in w for w in warnings)
    snap = run.load_run(tmp_path / "run", with_opt=True)
    moments = optim.find_moments(snap.opt_state)
    assert int(moments.count) == 1
    np.testing.assert_array_equal(moments.mu["observe"], opt.state[engine.observe.weight]["exp_avg"].numpy())

    written = run.export_run(tmp_path / "run", tmp_path / "out.pt", opt=True, hub=True)
    assert written == [tmp_path / "out.bin", tmp_path / "out.opt.bin"]
    sd = torch.load(tmp_path / "out.bin", weights_only=True)["model_state"]
    fresh = FractusEngine(**parent.model.torch_kwargs())
    assert set(sd) == set(fresh.state_dict())          # exactly the parent's keys: no phase_proj, no atom_feat
    assert not any("phase_proj" in k or "atom_feat" in k for k in sd)
    fresh.load_state_dict(sd, strict=True)
    for k, v in engine.state_dict().items():
        if k not in names.state_keys(parent.model):
            assert torch.equal(fresh.state_dict()[k], v), k


def test_a_fresh_pytorch_model_imports_at_step_0_and_trains(corpus_file, tmp_path):
    cfg = tiny(corpus_file)
    torch.manual_seed(1)
    engine = FractusEngine(**cfg.model.torch_kwargs())
    with torch.no_grad():
        engine(torch.randint(0, 266, (cfg.batch_size, 5)))                   # a carry at the config's batch
    sd = _chunk_phases(engine.state_dict(), cfg, 5)
    torch.save({"model_state": sd}, tmp_path / "fresh.pt")                    # no config, no step, no .opt
    warnings = []
    meta = run.import_checkpoint(tmp_path / "fresh.pt", tmp_path / "run", "tiny", [f"corpus={corpus_file}"],
                                 log=warnings.append)
    assert meta["step"] == 0 and meta["start_token_next"] == 0 and meta["carry"] == "imported"
    assert any("fresh optimizer moments" in w for w in warnings)
    carry = run.load_run(tmp_path / "run", with_opt=False).carry
    np.testing.assert_array_equal(carry["phase"][1], sd["blocks.1.kuramoto_phases"][:, -1].numpy())
    np.testing.assert_array_equal(carry["thought"], sd["thought_state"][:, 0].numpy())
    plan = train(cfg, tmp_path / "run")
    assert plan.resume_step == 0
    assert ckpt_lib.read_manifest(tmp_path / "run")["step"] == 3
    trained_params = run.load_run(tmp_path / "run", with_opt=False).params
    assert np.abs(trained_params["observe"] - engine.observe.weight.detach().numpy()).max() > 0


PARENT = ("model.variant=parent", "model.bos_id=none")
_forward_chunk = jax.jit(model.forward_chunk, static_argnums=3)   # one program for the tests below


def _off_by(got, want) -> float:
    """The largest difference relative to want's scale (the parent's logits reach tens)."""
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def _trainer_config(cfg, trainer, batch, chunk):
    """A PyTorch trainer's checkpoint (config dict, other top-level keys), as each one saves it."""
    sizes = {k: v for k, v in cfg.model.torch_kwargs().items() if k in WEIGHT_FIELDS and k not in ("variant", "atom_feat_dim")}
    return {
        "boost": ({**sizes, "gpu": "H100", "boost": True, "batch": batch, "lr": 1e-3, "ss_rate": 0.25,
                   "tokens_processed": 6 * batch * chunk}, {}),
        "surgery": ({**sizes, "gpu": "H100", "surgery": True, "gate_temp": cfg.model.gate_temperature,
                     "lb_coef": 0.01}, {}),
        "plain": ({**sizes, "gpu": "H100", "B": batch, "seq": 8}, {}),
        "growth": ({**sizes, "method": "gpu_progressive_growth"}, {"params": 123456, "ppl": 321.5}),
    }[trainer]


def _trainer_checkpoint(cfg, path, config, top=(), chunk=5, seed=0):
    """A PyTorch trainer's file after one chunk at the config's batch: the reference engine built at
    the config's gate temperature (the trainers set it on the built module), `config` as its config
    dict, phases (B, C, N). Returns the engine, carrying on where the file stops."""
    torch.manual_seed(seed)
    engine = FractusEngine(**cfg.model.torch_kwargs())
    with torch.no_grad():
        engine(torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, chunk)))
    torch.save({"model_state": _chunk_phases(engine.state_dict(), cfg, chunk), "config": config, **dict(top)}, path)
    return engine


@pytest.mark.parametrize("trainer", ["boost", "surgery", "plain", "growth"])
def test_each_pytorch_trainer_dict_imports_and_continues_the_reference(corpus_file, tmp_path, trainer):
    cfg = tiny(corpus_file, *PARENT)
    config, top = _trainer_config(cfg, trainer, cfg.batch_size, 5)
    engine = _trainer_checkpoint(cfg, tmp_path / "t.pt", config, top)
    warnings = []
    meta = run.import_checkpoint(tmp_path / "t.pt", tmp_path / "run", "tiny", [f"corpus={corpus_file}", *PARENT],
                                 log=warnings.append)
    assert meta["step"] == 0 and meta["carry"] == "imported"
    said = " | ".join(w.replace(str(tmp_path / "t.pt"), "FILE") for w in warnings)
    # Each named difference is a line; so are the missing optimizer file and, but for gate_temp, the
    # missing gate temperature. Unknown keys are ignored quietly.
    named = {"boost": ["trained with lr 0.001, the config's lr 0.003", "trained with ss_rate 0.25, the config's ss_rate 0.0",
                       "records no start_token_next", "tokens_processed 120 counts the ids of all lanes together",
                       "N = 120 / 4 = 30"],
             "surgery": ["trained with lb_coef 0.01, the config's lb_coef 0.02"],
             "plain": ["trained with seq 8, the config's seq_len 16"], "growth": []}[trainer]
    for needle in [*named, "no optimizer file"]:
        assert needle in said, (needle, said)
    assert ("records no gate temperature" in said) == (trainer != "surgery"), said
    for unknown in ("gpu", "boost", "surgery", "method", "params", "ppl", "H100", "123456"):
        assert not re.search(rf"\b{unknown}\b", said), (unknown, said)
    assert len(warnings) == {"boost": 5, "surgery": 2, "plain": 3, "growth": 2}[trainer], said

    ids = np.random.default_rng(3).integers(0, cfg.model.vocab_size, (cfg.batch_size, 7))
    with torch.no_grad():
        logits_t, _ = engine(torch.from_numpy(ids))
    snap = run.load_run(tmp_path / "run", with_opt=False)
    logits_j, _, new_state = _forward_chunk(snap.params, snap.carry, ids, cfg.model.replace(capacity_factor=None))
    # float32 on both sides (measured: 5e-5 of the scale for the logits, 8e-5 for the thought); from a
    # zero carry the logits are off by most of their scale.
    assert _off_by(logits_j, logits_t) < 2e-4 and _off_by(new_state["thought"], engine.thought_state[:, 0]) < 2e-4
    logits_0, _, _ = _forward_chunk(snap.params, model.init_state(cfg.model, cfg.batch_size), ids,
                                    cfg.model.replace(capacity_factor=None))
    assert _off_by(logits_0, logits_t) > 0.1


def test_a_gate_temperature_unlike_the_configs_is_refused(corpus_file, tmp_path, capsys):
    cfg = tiny(corpus_file, *PARENT)
    config, _ = _trainer_config(cfg, "surgery", cfg.batch_size, 5)
    _trainer_checkpoint(tiny(corpus_file, *PARENT, "model.gate_temperature=3.0"), tmp_path / "hot.pt",
                        {**config, "gate_temp": 3.0})

    def argv(pt, out, *sets):
        return ["import", "--pt", str(tmp_path / pt), "--out", str(tmp_path / out), "--config", "tiny",
                *(a for s in (f"corpus={corpus_file}", *sets) for a in ("--set", s))]

    _refused(capsys, argv("hot.pt", "run", *PARENT), tmp_path / "run", str(tmp_path / "hot.pt"), "gate_temp is 3.0",
             "gate_temperature is 2.5", "--set model.gate_temperature=3.0")
    code, err = cli(argv("hot.pt", "run", *PARENT, "model.gate_temperature=3.0")), capsys.readouterr().err
    assert code == 0 and "gate_temp" not in err.replace(str(tmp_path), ""), err
    assert ckpt_lib.read_manifest(tmp_path / "run")["config"]["model"]["gate_temperature"] == 3.0
    # The trainers' gate_temp is what their module ran at: it wins over the constructor's key.
    torch.save({**torch.load(tmp_path / "hot.pt", weights_only=True),
                "config": {**config, "gate_temperature": 2.5, "gate_temp": 3.0}}, tmp_path / "both.pt")
    _refused(capsys, argv("both.pt", "other", *PARENT), tmp_path / "other", "gate_temp is 3.0")
    # The constructor's key alone (an export's, or the reference engine's) is held to the same.
    sizes = {k: v for k, v in config.items() if k not in ("gate_temp", "lb_coef")}
    torch.save({**torch.load(tmp_path / "hot.pt", weights_only=True), "config": {**sizes, "gate_temperature": 1.0}},
               tmp_path / "cold.pt")
    _refused(capsys, argv("cold.pt", "cold", *PARENT), tmp_path / "cold", "gate_temperature is 1.0, the config's",
             "--set model.gate_temperature=1.0")


# ----------------------------------------------------------------------------- refusals

def _refused(capsys, argv, out_dir=None, *needles):
    code = cli(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    if out_dir is not None:
        assert not Path(out_dir).exists()
    return err


def test_refusals(trained, corpus_file, tmp_path, capsys):
    cfg, run_dir, a_pt = trained
    good = torch.load(a_pt, weights_only=True)
    base = ["import", "--out", str(tmp_path / "never"), "--config", "tiny", "--set", f"corpus={corpus_file}"]

    def refuse(blob_or_path, *needles, extra=()):
        path = blob_or_path
        if not isinstance(blob_or_path, Path):
            path = tmp_path / "bad.pt"
            torch.save(blob_or_path, path)
        return _refused(capsys, ["import", "--pt", str(path), *base[1:], *extra], tmp_path / "never", *needles)

    gpt2 = FractusEngine(**cfg.model.replace(vocab_size=50257).torch_kwargs())
    refuse({"model_state": gpt2.state_dict()}, "vocab", "50257", "266")
    sd = dict(good["model_state"])
    del sd["blocks.1.moe.U1"], sd["atom_feat.bias"]
    sd["blocks.0.attn.extra"] = torch.zeros(2)
    refuse({"model_state": sd}, "missing tensors: atom_feat.bias, blocks.1.moe.U1", "unexpected tensors: blocks.0.attn.extra")
    sd = dict(good["model_state"], **{"blocks.0.attn.w_out": torch.zeros(3, 3)})
    refuse({"model_state": sd}, "blocks.0.attn.w_out", "(3, 3)", "(32, 32)")
    sd = dict(good["model_state"], **{"blocks.1.attn_S": torch.zeros(4, 32, 31)})
    refuse({"model_state": sd}, "blocks.1.attn_S", "(4, 32, 31)")
    refuse({"model_state": good["model_state"], "config": {**good["config"], "n_heads": 4, "d_head": 8}}, "n_heads")

    data = a_pt.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    refuse(tmp_path / "cut.pt", str(tmp_path / "cut.pt"), "truncated or corrupt")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    refuse(tmp_path / "junk.safetensors", "junk.safetensors", "truncated or corrupt")
    refuse(tmp_path / "missing.pt", "missing.pt", "no such file")
    refuse({"model_state": good["model_state"], "args": argparse.Namespace(lr=3e-4)}, "argparse.Namespace",
           "--trust-pickle")
    assert cli(["import", "--pt", str(tmp_path / "bad.pt"), *base[1:], "--no-opt", "--trust-pickle"]) == 0
    assert "warning: --no-opt" in capsys.readouterr().err
    assert ckpt_lib.read_manifest(tmp_path / "never")["step"] == 0
    shutil.rmtree(tmp_path / "never")

    shutil.copy(a_pt, tmp_path / "w.pt")
    opt = a_pt.with_suffix(".opt").read_bytes()
    (tmp_path / "w.opt").write_bytes(opt[:-100])
    refuse(tmp_path / "w.pt", str(tmp_path / "w.opt"), "truncated or corrupt")
    sgd, params = cfg_lib.apply_overrides(cfg, ["optimizer=sgd"]), run.load_run(run_dir, False).params
    sgd_moments = state_lib.make_optimizer(sgd, params).init(params)
    torch.save(optim.optimizer_to_torch(sgd_moments, params, sgd, 0), tmp_path / "w.opt")
    refuse(tmp_path / "w.pt", "SGD", "optimizer=sgd", "--no-opt")
    bad_opt = torch.load(a_pt.with_suffix(".opt"), weights_only=True)
    bad_opt["state"][0]["exp_avg"] = torch.zeros(5)
    torch.save(bad_opt, tmp_path / "w.opt")
    refuse(tmp_path / "w.pt", "parameter 0 (observe.weight)", "(5,)", "(266, 32)")
    # An existing run is never overwritten.
    err = _refused(capsys, ["import", "--pt", str(a_pt), "--out", str(run_dir), "--config", "tiny"], None, "already holds a run")
    assert ckpt_lib.read_manifest(run_dir)["step"] == 3 and err
    _refused(capsys, ["export", "--ckpt", str(tmp_path), "--out", str(tmp_path / "x.pt")], None, "neither a run directory")
    assert not (tmp_path / "x.pt").exists()


def test_cli_in_a_process(trained, corpus_file, tmp_path):
    _, run_dir, _ = trained
    step_dir = run_dir / "checkpoints" / "3"
    ok = subprocess.run([sys.executable, "-m", "fractus_jax.convert", "export", "--ckpt", str(step_dir),
                         "--out", str(tmp_path / "x.safetensors"), "--opt"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == [str(tmp_path / "x.safetensors"), str(tmp_path / "x.opt")]
    (tmp_path / "x.opt").write_bytes(b"\x80\x02garbage")
    bad = subprocess.run([sys.executable, "-m", "fractus_jax.convert", "import", "--pt", str(tmp_path / "x.safetensors"),
                          "--out", str(tmp_path / "dir"), "--config", "tiny", "--set", f"corpus={corpus_file}"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.startswith("error: ") and "x.opt" in bad.stderr and not (tmp_path / "dir").exists()


def _convert_without(module, *argv):
    """The converter's CLI in a process where `module` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from fractus_jax.convert.__main__ import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("module, out_name", [("torch", "x.pt"), ("safetensors", "x.safetensors")])
def test_export_without_the_torch_extra_names_the_install_command(trained, tmp_path, module, out_name):
    _, run_dir, _ = trained
    out = _convert_without(module, "export", "--ckpt", str(run_dir), "--out", str(tmp_path / out_name))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert module in out.stderr and 'pip install -e ".[torch]"' in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []     # nothing written


def test_export_prints_no_absl_warnings(trained, tmp_path):
    _, run_dir, _ = trained
    out = subprocess.run([sys.executable, "-m", "fractus_jax.convert", "export", "--ckpt", str(run_dir),
                          "--out", str(tmp_path / "x.pt")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "WARNING:absl" not in out.stderr and out.stderr.strip() == "", out.stderr
