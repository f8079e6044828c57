"""Growth: more layers, experts or expert rank without changing (or with a measured change
of) what the run computes; the grown directory resumes, exports and refuses what it must.

One tiny run (2 AdamW steps) is trained and grown once by the CLI (all three growths);
the pure functions are tested on its state.
"""
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fractus_jax import config as engine_cfg
from fractus_jax import growth as engine_growth
from fractus_jax import model
from fractus_jax.grow import run as grow_run
from fractus_jax.grow.__main__ import main as cli
from fractus_jax.growth import GrowthError, GrowthSpec
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import growth as growth_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train import objective
from fractus_jax.train.config import MeshConfig, TrainConfig
from fractus_jax.train.errors import TrainError

from tensorboard_testing import assert_curves_are_the_log

ROOT = Path(__file__).resolve().parents[1]
GROW_ALL = ["--add-layers", "1", "--add-experts", "2", "--siren-rank", "12"]


def tiny(corpus_file, *overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [f"corpus={corpus_file}", *overrides])


@pytest.fixture(scope="module")
def trained(corpus_file, tmp_path_factory):
    """(cfg, run dir at step 2)."""
    cfg = tiny(corpus_file, "max_steps=2", "save_every=2")
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    loop.run(prepare_lib.prepare(cfg, run_dir, progress=False), progress=False, log=lambda m: None)
    return cfg, run_dir


@pytest.fixture(scope="module")
def source(trained):
    """(cfg, state, ids of the next chunk): the trained run as the trainer would continue it."""
    cfg, run_dir = trained
    step, meta, _ = ckpt_lib.read_step(run_dir)
    state = jax.device_get(grow_run.load_state(run_dir, step, cfg))
    ids, where = grow_run.probe_chunk(cfg, meta, cfg.batch_size)
    assert where.startswith("next batch") and ids.shape == (cfg.batch_size, cfg.seq_len)
    return cfg, state, ids


@pytest.fixture(scope="module")
def grown(trained, tmp_path_factory):
    """(record, grown dir): the CLI's growth of the trained run by all three."""
    _, run_dir = trained
    out = tmp_path_factory.mktemp("grown") / "g"
    assert cli(["--ckpt", str(run_dir), "--out", str(out), *GROW_ALL]) == 0
    return ckpt_lib.read_manifest(out)["growth"][-1], out


_forward = jax.jit(model.forward_chunk, static_argnums=3)


def _corner(a, shape):
    return np.asarray(a)[tuple(slice(0, s) for s in shape)]


def test_layer_and_rank_growth_leave_the_logits_unchanged(source):
    cfg, state, ids = source
    logits, _, carry = _forward(state["params"], state["carry"], ids, cfg.model)
    L = cfg.model.n_layers
    for spec in (GrowthSpec(add_layers=1), GrowthSpec(siren_rank=12)):
        new, new_cfg = growth_lib.grow_train_state(state, cfg, spec, key=jax.random.PRNGKey(7))
        # Old entries kept exactly, in the leading corner.
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(_corner(b, a.shape), a), state["params"], new["params"])
        got, _, new_carry = _forward(new["params"], new["carry"], ids, new_cfg.model)   # the trainer's capacity path
        np.testing.assert_allclose(np.asarray(got), np.asarray(logits), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new_carry["thought"]), np.asarray(carry["thought"]), rtol=1e-5, atol=1e-5)
        for k in ("S", "z", "phase"):
            np.testing.assert_allclose(np.asarray(new_carry[k])[:L], np.asarray(carry[k]), rtol=1e-5, atol=1e-5)
        # The test can fail: with the new zero tensors made random, the logits move.
        moe = dict(new["params"]["blocks"]["moe"])
        if spec.add_layers:
            attn = dict(new["params"]["blocks"]["attn"])
            assert not np.any(np.asarray(attn["w_out"])[L:]) and not np.any(np.asarray(moe["U2"])[L:])
            attn["w_out"] = attn["w_out"].at[L:].set(0.1)
            broken = {**new["params"], "blocks": {**new["params"]["blocks"], "attn": attn}}
        else:
            assert not np.any(np.asarray(moe["V1"])[..., 8:]) and np.all(np.asarray(moe["U1"])[..., 8:] != 0)
            moe["U2"] = moe["U2"].at[..., 8:].set(0.5)
            broken = {**new["params"], "blocks": {**new["params"]["blocks"], "moe": moe}}
        bad, _, _ = _forward(broken, new["carry"], ids, new_cfg.model)
        assert np.abs(np.asarray(bad) - np.asarray(logits)).max() > 1e-3, spec


def test_expert_growth_changes_exactly_the_rerouted_tokens_in_one_block(source):
    cfg1 = TrainConfig(model=engine_cfg.tiny(n_layers=1), batch_size=4, seq_len=16)
    params = model.init_params(cfg1.model, jax.random.PRNGKey(3))
    carry = model.init_state(cfg1.model, 4)
    state = {"params": params, "opt_state": state_lib.make_optimizer(cfg1, params).init(params),
             "carry": carry, "step": jnp.zeros((), jnp.int32), "skipped": jnp.zeros((), jnp.int32)}
    ids = source[2]
    before = engine_growth.probe(params, carry, ids, cfg1.model)
    hits = engine_growth.routing_demand(before[1], 8)
    new, new_cfg = growth_lib.grow_train_state(state, cfg1, GrowthSpec(add_experts=2), key=jax.random.PRNGKey(4),
                                               hits=hits)
    phases = np.asarray(new["params"]["blocks"]["moe"]["expert_phases"])[0]
    busiest = np.argsort(-hits[0], kind="stable")[:2]
    np.testing.assert_allclose(phases[8:], np.mod(phases[busiest] + 2 * math.pi / 8 / 4, 2 * math.pi), atol=1e-6)
    after = engine_growth.probe(new["params"], new["carry"], ids, new_cfg.model)
    change = engine_growth.compare_probe(before, after)
    rerouted, changed = change["rerouted_mask"], change["changed_mask"]
    assert 0 < change["rerouted_fraction"] < 1 and change["rerouted_fraction"] == rerouted.mean()
    np.testing.assert_array_equal(changed, rerouted)           # exactly the rerouted tokens move
    delta = np.abs(after[0] - before[0]).max(-1)
    assert delta[~rerouted].max() < 1e-5 and delta[rerouted].min() > 1e-4
    assert change["max_logit_change"] == pytest.approx(delta.max())
    # Only a new expert can displace an old one: every new pair holds one.
    assert np.all((after[1][0][rerouted] >= 8).any(-1))
    print(f"one block, +2 experts: {change['rerouted_fraction']:.1%} of 64 tokens rerouted, "
          f"max logit change {change['max_logit_change']:.3g}")


def test_gradients_reach_the_new_parameters(source):
    cfg, state, ids = source
    hits = engine_growth.routing_demand(engine_growth.probe(state["params"], state["carry"], ids, cfg.model)[1], 8)
    new, new_cfg = growth_lib.grow_train_state(state, cfg, GrowthSpec(1, 2, 12), key=jax.random.PRNGKey(5),
                                               hits=hits)
    exact = TrainConfig(**{**new_cfg.__dict__, "model": new_cfg.model.replace(capacity_factor=None)})
    inputs, targets = ids, np.roll(ids, -1, axis=1)
    grad = jax.jit(jax.grad(lambda p: objective.train_loss(p, new["carry"], inputs, targets, None, exact, 1.0)[0]))
    L, E, r = 2, 8, 8

    def regions(tree):
        b = tree["blocks"]
        out = {f"new layer {k}/{n}": np.asarray(v)[L:] for k, grp in b.items() for n, v in grp.items()
               if not isinstance(v, dict) and n not in model.BUFFER_NAMES}
        out.update({f"new expert {n}": np.asarray(v)[:L, E:] for n, v in b["moe"].items() if n != "expert_phases"})
        out.update({f"new rank {n}": np.asarray(b["moe"][n])[:L, :E, ..., r:] for n in engine_growth.FACTORS})
        return out

    zero_init = ("new layer attn/w_out", "new layer attn/b_out", "new layer moe/U2", "new layer moe/b2",
                 "new expert U2", "new expert b2", "new rank V1", "new rank U2")
    params = new["params"]
    for name in zero_init:
        assert not np.any(regions(params)[name]), name
    g0 = regions(grad(params))
    for name in zero_init:   # the zero tensors learn from the first step
        assert np.abs(g0[name]).max() > 0, name
    stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grad(params))
    g1 = regions(grad(stepped))
    dead = [name for name, g in g1.items() if not np.abs(g).max() > 0]
    assert not dead, dead    # and then every new entry gets a gradient


def test_the_grown_directory_records_the_growth_and_keeps_old_moments(trained, grown):
    cfg, run_dir = trained
    record, out = grown
    manifest = ckpt_lib.read_manifest(out)
    source = ckpt_lib.read_manifest(run_dir)
    for key in ("step", "start_token_next", "batch_size", "seq_len", "accum", "corpus", "ema_tf"):
        assert manifest[key] == source[key], key
    m = manifest["config"]["model"]
    assert (m["n_layers"], m["n_experts"], m["siren_rank"], m["vocab_size"]) == (3, 10, 12, 266)
    for key in ("at_step", "time", "add_layers", "add_experts", "siren_rank", "rerouted_fraction", "max_logit_change"):
        assert key in record, key
    assert (record["at_step"], record["add_layers"], record["add_experts"], record["siren_rank"]) == (2, 1, 2, 12)
    assert record["hits_source"] == "probe" and 0 <= record["rerouted_fraction"] <= 1
    assert record["capacity_per_expert"] is None        # dropless: no capacity to change
    # With a capacity, the record says what one group of the config's rows gets per expert.
    cap = cfg_lib.apply_overrides(cfg, ["model.capacity_factor=1.25", "model.moe_group_rows=2"])
    more = cfg_lib.apply_overrides(cap, ["model.n_experts=10"])
    assert growth_lib.capacity_change(cap, more) == {"group_tokens": 2 * cfg.seq_len, "before": 10, "after": 8}
    assert (out / "metrics.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()
    assert grow_run.resume_overrides(manifest["growth"]) == ["model.n_experts=10", "model.n_layers=3",
                                                             "model.siren_rank=12"]
    print("CLI growth of the trained run:", {k: record[k] for k in ("rerouted_fraction", "max_logit_change",
                                                                     "changed_fraction")})

    new_cfg = TrainConfig.from_dict(manifest["config"])
    old = jax.device_get(grow_run.load_state(run_dir, 2, cfg))
    new = jax.device_get(grow_run.load_state(out, 2, new_cfg))
    assert int(new["step"]) == int(old["step"]) == 2
    adam_old = old["opt_state"].inner_states["train"].inner_state[1][0]
    adam_new = new["opt_state"].inner_states["train"].inner_state[1][0]
    assert int(adam_new.count) == int(adam_old.count) == 2
    for moments_old, moments_new in ((adam_old.mu, adam_new.mu), (adam_old.nu, adam_new.nu)):
        def check(o, n):
            n = np.array(n)
            np.testing.assert_array_equal(_corner(n, o.shape), o)
            n[tuple(slice(0, s) for s in o.shape)] = 0
            assert not np.any(n)                                   # zeros everywhere else
        jax.tree.map(check, moments_old, moments_new)
    assert np.any(np.asarray(adam_old.mu["blocks"]["moe"]["U1"]))
    for k in ("S", "z", "phase"):
        np.testing.assert_array_equal(np.asarray(new["carry"][k])[:2], old["carry"][k])
        assert not np.any(np.asarray(new["carry"][k])[2:])
    np.testing.assert_array_equal(new["carry"]["thought"], old["carry"]["thought"])


def test_training_resumes_from_the_grown_directory(corpus_file, grown, tmp_path):
    record, out = grown
    work = tmp_path / "g"
    shutil.copytree(out, work)
    manifest = ckpt_lib.read_manifest(work)
    shape = grow_run.resume_overrides(manifest["growth"])   # the grown shape, given explicitly
    cfg = tiny(corpus_file, "max_steps=3", *shape)
    plan = prepare_lib.prepare(cfg, work, progress=False)
    assert (plan.resume_step, plan.start_pos) == (2, manifest["start_token_next"])
    loop.run(plan, progress=False, log=lambda m: None)
    after = ckpt_lib.read_manifest(work)
    assert after["step"] == 3 and after["start_token_next"] == 3 * cfg.seq_len
    state = jax.device_get(grow_run.load_state(work, 3, cfg))
    mu = state["opt_state"].inner_states["train"].inner_state[1][0].mu["blocks"]
    assert np.abs(mu["attn"]["w_out"][2]).max() > 0 and np.abs(mu["moe"]["U2"][:2, 8:]).max() > 0
    assert np.abs(mu["moe"]["V1"][:2, :8, :, 8:]).max() > 0
    assert np.all(np.isfinite(state["params"]["observe"]))
    # the copied log's history went to the grown run's TensorBoard curves, then its step 3
    assert not (out / "tensorboard").exists()
    assert assert_curves_are_the_log(work)["ce_tf"] == [1, 2, 3]


def test_the_trainer_keeps_the_growth_history_in_later_manifests(corpus_file, grown, tmp_path):
    _, out = grown
    work = tmp_path / "g"
    shutil.copytree(out, work)
    manifest = ckpt_lib.read_manifest(work)
    cfg = tiny(corpus_file, "max_steps=3", *grow_run.resume_overrides(manifest["growth"]))
    loop.run(prepare_lib.prepare(cfg, work, progress=False), progress=False, log=lambda m: None)
    assert ckpt_lib.read_manifest(work).get("growth") == manifest["growth"]


def test_the_export_of_a_grown_run_loads_into_the_pytorch_reference(grown, tmp_path):
    torch = pytest.importorskip("torch")
    from fractus_jax.convert import run as convert_run
    from fractus_jax.reference import FractusEngine

    _, out = grown
    convert_run.export_run(out, tmp_path / "g.pt")
    blob = torch.load(tmp_path / "g.pt", weights_only=True)
    assert (blob["config"]["n_layers"], blob["config"]["n_experts"], blob["config"]["siren_rank"]) == (3, 10, 12)
    ref = FractusEngine(**blob["config"])
    missing, unexpected = ref.load_state_dict(blob["model_state"], strict=True)
    assert not missing and not unexpected
    manifest = ckpt_lib.read_manifest(out)
    cfg = TrainConfig.from_dict(manifest["config"])
    ids, _ = grow_run.probe_chunk(cfg, manifest, cfg.batch_size)
    with torch.no_grad():
        logits_t, _ = ref(torch.from_numpy(ids.astype(np.int64)))
    state = grow_run.load_state(out, manifest["step"], cfg)
    logits_j, _ = engine_growth.probe(state["params"], state["carry"], ids, cfg.model)
    np.testing.assert_allclose(logits_j, logits_t.numpy(), rtol=1e-4, atol=1e-4)


def test_growth_on_a_mesh_lands_on_the_grown_runs_shardings(source):
    """What the trainer's in-place growth does on a mesh: one jitted function of the state."""
    from fractus_jax import sharding

    cfg = TrainConfig(**{**source[0].__dict__, "mesh": MeshConfig(fsdp=2)})
    mesh = sharding.make_mesh(1, 2)
    state = jax.device_put(source[1], state_lib.train_state_shardings(cfg, mesh))
    new_cfg = growth_lib.target_config(cfg, GrowthSpec(1, 2, 12))
    phases = engine_growth.new_expert_phases(np.asarray(state["params"]["blocks"]["moe"]["expert_phases"]), 2)
    shardings = state_lib.train_state_shardings(new_cfg, mesh)
    got, _ = growth_lib.grow_train_state(state, cfg, new_cfg.model, key=jax.random.PRNGKey(1), new_phases=phases,
                                         mesh=mesh)
    assert got["params"]["blocks"]["moe"]["U1"].sharding == shardings["params"]["blocks"]["moe"]["U1"]
    assert got["params"]["blocks"]["moe"]["U1"].shape == (3, 10, 48, 12)
    want, _ = growth_lib.grow_train_state(source[1], source[0], new_cfg.model, key=jax.random.PRNGKey(1),
                                          new_phases=phases)   # the same growth on one device
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), got, want)


def test_sgd_momentum_grows_like_the_parameters(source):
    cfg, state, _ = source
    cfg = TrainConfig(**{**cfg.__dict__, "optimizer": "sgd"})
    opt = state_lib.make_optimizer(cfg, state["params"]).init(state["params"])
    opt = jax.tree.map(lambda leaf: jnp.full_like(leaf, 0.5), opt)
    new, new_cfg = growth_lib.grow_train_state({**state, "opt_state": opt}, cfg, GrowthSpec(1, 2, 12),
                                               key=jax.random.PRNGKey(5), new_phases=np.zeros((2, 2)))
    assert new_cfg.model.n_experts == 10 and int(new["step"]) == 2
    traced = {jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_flatten_with_path(new["opt_state"])[0]}
    assert traced and all("trace" in name for name in traced)
    u1 = next(t for name, t in traced.items() if "U1" in name)
    assert u1.shape == (3, 10, 48, 12) and np.all(u1[:2, :8, :, :8] == 0.5)
    assert not np.any(u1[2:]) and not np.any(u1[:, 8:]) and not np.any(u1[..., 8:])
    for name, t in traced.items():
        assert set(np.unique(t)) <= {0.0, 0.5}, name


def test_new_expert_phases():
    phases = np.array([[0, 1.5, 2, 3, 4, 5, 5.5, 6.0], [0, .5, 1, 1.5, 2, 2.5, 3, 3.1]])
    gap = engine_growth.new_expert_phases(phases, 2)      # no hits: the middle of the widest gap, twice
    np.testing.assert_allclose(gap[0], [0.75, 2.5])
    assert gap[1, 0] == pytest.approx((3.1 + 2 * math.pi) / 2)
    hits = np.array([[0, 5, 9, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1]])
    busy = engine_growth.new_expert_phases(phases, 2, hits)
    q = 2 * math.pi / 8 / 4                          # a quarter of the mean spacing
    np.testing.assert_allclose(busy[0], [2 + q, 1.5 + q])
    # Layer 1 has one busy expert: the second new one goes to the widest gap.
    np.testing.assert_allclose(busy[1], [3.1 + q, (3.1 + q + 2 * math.pi) / 2])


def test_cli_in_a_process_refuses_without_a_traceback(trained, tmp_path):
    import subprocess
    import sys

    _, run_dir = trained
    out = subprocess.run([sys.executable, "-m", "fractus_jax.grow", "--ckpt", str(run_dir), "--out",
                          str(tmp_path / "o"), "--set", "model.vocab_size=50257"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "vocab" in out.stderr, out.stderr
    assert not (tmp_path / "o").exists()


def _snapshot(path: Path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def _fake_run(path: Path, cfg: TrainConfig) -> Path:
    """A run directory without training (zeros): enough for refusals made before any load."""
    state = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), state_lib.abstract_train_state(cfg))
    ck = ckpt_lib.RunCheckpointer(path)
    ck.save(state, {"step": 1, "start_token_next": 16, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                    "accum": 1, "corpus": {}, "config": cfg.to_dict()})
    ck.close()
    return path


@pytest.mark.parametrize("case", ["vocab", "shrink_layers", "shrink_rank", "other_field", "nothing",
                                  "not_model", "sharding", "out_not_empty", "no_run"])
def test_refusals_say_why_and_write_nothing(case, trained, tmp_path, capsys):
    _, run_dir = trained
    src, out = run_dir, tmp_path / "out"
    args = {"vocab": (["--set", "model.vocab_size=300"], ["vocab", "266", "300", "closed"]),
            "shrink_layers": (["--add-layers", "-1"], ["shrink", "add_layers=-1"]),
            "shrink_rank": (["--siren-rank", "4"], ["shrink", "siren_rank 8 -> 4"]),
            "other_field": (["--set", "model.expert_d_ff=64", "--add-layers", "1"], ["expert_d_ff 48 -> 64"]),
            "nothing": ([], ["nothing to grow"]),
            "not_model": (["--set", "lr=1", "--add-layers", "1"], ["model.FIELD", "lr=1"]),
            "sharding": (["--add-experts", "2"], ["fsdp=4", "experts=10", "blocks/moe/U1"]),
            "out_not_empty": (["--add-layers", "1"], ["not empty"]),
            "no_run": (["--add-layers", "1"], ["no such run"])}[case]
    if case == "sharding":
        cfg = TrainConfig(model=engine_cfg.tiny(), batch_size=4, seq_len=16, mesh=MeshConfig(fsdp=4))
        src = _fake_run(tmp_path / "sharded", cfg)
        with pytest.raises(GrowthError, match="fsdp"):      # the pure check says the same
            growth_lib.target_config(cfg, GrowthSpec(add_experts=2))
        growth_lib.target_config(cfg, GrowthSpec(add_experts=4))   # a multiple of fsdp is fine
    if case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    if case == "no_run":
        src = tmp_path / "nope"
    before = _snapshot(tmp_path), _snapshot(run_dir)
    capsys.readouterr()
    assert cli(["--ckpt", str(src), "--out", str(out), *args[0]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for word in args[1]:
        assert word in err, (word, err)
    assert (_snapshot(tmp_path), _snapshot(run_dir)) == before


def test_a_grown_run_resumes_from_its_original_command_line(corpus_file, grown, tmp_path):
    """The manifest's growth records explain the shape: no --set model.* flags needed."""
    _, out = grown
    work = tmp_path / "g"
    shutil.copytree(out, work)
    manifest = ckpt_lib.read_manifest(work)
    cfg = tiny(corpus_file, f"max_steps={manifest['step'] + 1}")
    assert cfg.model.n_layers != manifest["config"]["model"]["n_layers"]
    loop.run(prepare_lib.prepare(cfg, work, progress=False), progress=False, log=lambda m: None)
    after = ckpt_lib.read_manifest(work)
    assert after["step"] == manifest["step"] + 1
    assert after["config"]["model"]["n_layers"] == manifest["config"]["model"]["n_layers"]
    # Another shape that no growth record explains is still refused.
    bad = tiny(corpus_file, "max_steps=9", "model.expert_d_ff=64")
    with pytest.raises(TrainError, match="differs"):
        prepare_lib.prepare(bad, work, progress=False)


IN_PLACE = ["max_steps=4", "save_every=100", "grow_at=2", "grow.add_layers=1", "grow.siren_rank=12"]


@pytest.fixture(scope="module")
def grown_in_place(corpus_file, tmp_path_factory):
    """A run the trainer grew in place at step 2 (+1 layer, rank 8 -> 12) and trained to step 4:
    it holds step 2 at the old shape and step 4 at the grown one. Tests that train on copy it."""
    work = tmp_path_factory.mktemp("in_place") / "run"
    loop.run(prepare_lib.prepare(tiny(corpus_file, *IN_PLACE), work, progress=False), progress=False, log=lambda m: None)
    return work


def test_the_trainer_grows_in_place_at_grow_at(corpus_file, grown_in_place, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(grown_in_place, work)
    line = list(IN_PLACE)
    manifest = ckpt_lib.read_manifest(work)
    assert manifest["step"] == 4 and manifest["start_token_next"] == 4 * 16   # no lost offset
    (record,) = manifest["growth"]
    assert record["at_step"] == 2 and record["in_place"] and record["to"]["n_layers"] == 3
    assert manifest["config"]["model"]["n_layers"] == 3 and manifest["config"]["model"]["siren_rank"] == 12
    steps = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert 2 in steps   # the run as it was before growing
    before = ckpt_lib.RunCheckpointer(work, read_only=True)
    old_cfg = tiny(corpus_file)
    _, meta = before.restore(state_lib.abstract_train_state(old_cfg), 2)
    before.close()
    assert meta["config"]["model"]["n_layers"] == 2
    # The same command line resumes the grown run, and does not grow it again.
    line[0] = "max_steps=5"
    loop.run(prepare_lib.prepare(tiny(corpus_file, *line), work, progress=False), progress=False, log=lambda m: None)
    manifest = ckpt_lib.read_manifest(work)
    assert manifest["step"] == 5 and len(manifest["growth"]) == 1
    assert manifest["config"]["model"]["n_layers"] == 3


def test_a_step_saved_before_an_in_place_growth_exports_and_loads_at_its_own_shape(grown_in_place, tmp_path):
    """The manifest describes the grown step; an older step is read in the shapes of its own config."""
    torch = pytest.importorskip("torch")
    from fractus_jax.convert.__main__ import main as convert_cli

    work = grown_in_place
    for ckpt, name, want in ((work / "checkpoints" / "2", "pre.pt", (2, 2, 8)), (work, "post.pt", (4, 3, 12))):
        assert convert_cli(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / name)]) == 0
        blob = torch.load(tmp_path / name, weights_only=True)
        step, n_layers, rank = want
        assert (blob["step"], blob["config"]["n_layers"], blob["config"]["siren_rank"]) == want
        sd = blob["model_state"]
        assert f"blocks.{n_layers - 1}.moe.U1" in sd and f"blocks.{n_layers}.moe.U1" not in sd
        assert sd["blocks.0.moe.U1"].shape[-1] == rank
        params, engine = ckpt_lib.load_for_inference(work, step=step)
        assert (engine.n_layers, engine.siren_rank) == (n_layers, rank)
        assert np.asarray(params["blocks"]["moe"]["U1"]).shape[::3] == (n_layers, rank)
        np.testing.assert_array_equal(sd["observe.weight"].numpy(), np.asarray(params["observe"]))
