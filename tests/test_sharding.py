"""The train step on a mesh of 8 fake CPU devices equals one device; checkpoints move
between meshes; two processes on localhost train like one."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from fractus_jax import sharding
from fractus_jax.lanes import LaneReader
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import reach
from fractus_jax.train import state as state_lib
from fractus_jax.train.data import global_batch
from fractus_jax.train.memory import plan_memory
from fractus_jax.train.step import batch_shardings, jit_train_step

from engine_testing import SUBPROCESS_XLA_FLAGS, assert_trained_alike, changed_leaves

ROOT = Path(__file__).resolve().parents[1]
MESHES = [(1, 1), (2, 4), (8, 1)]
SHARDED_RUN = ["batch_size=8", "model.moe_group_rows=1", "optimizer=sgd", "lr=0.05"]
STEPS = 3
# The two-process run's length; the planner plans the same config, so that its step is the
# one compiled for the one-process run beside it (no second compilation in the module).
TWO_PROCESS_RUN = ["max_steps=2", "save_every=2"]

pytestmark = pytest.mark.devices(8)   # conftest's fake devices: fewer fails


def _cfg(corpus_file, data, fsdp):
    cfg = cfg_lib.load_config("tiny")
    # One MoE group per row: the same dispatch groups on every mesh. SGD: an update is
    # linear in the gradient, so reduction-order rounding stays rounding (AdamW's m/√v
    # turns a 1e-9 gradient difference of a near-zero entry into an lr-sized step).
    return cfg_lib.apply_overrides(cfg, [f"corpus={corpus_file}", *SHARDED_RUN, f"mesh.data={data}",
                                         f"mesh.fsdp={fsdp}"])


def _train_steps(cfg, corpus_ids):
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    state, shardings = state_lib.create_train_state(cfg, mesh, jax.random.PRNGKey(cfg.seed))
    batch_shard = batch_shardings(cfg, mesh)
    step = jit_train_step(cfg, shardings, batch_shard)
    reader = LaneReader(corpus_ids, cfg.batch_size, cfg.seq_len)
    for i in range(STEPS):
        state, _ = step(state, global_batch(reader, i * cfg.seq_len, batch_shard))
    return state, shardings


@pytest.fixture(scope="module")
def trained(corpus_file):
    from fractus_jax.atom.corpus import open_corpus

    ids = open_corpus(corpus_file).ids
    out = {}
    with jax.default_matmul_precision("highest"):
        for data, fsdp in MESHES:
            out[(data, fsdp)] = _train_steps(_cfg(corpus_file, data, fsdp), ids)
    return out


@pytest.fixture(scope="module")
def start(corpus_file):
    """The state every mesh starts from (the fixture's config and precision: its
    initialisation is compiled already)."""
    with jax.default_matmul_precision("highest"):
        state, _ = state_lib.create_train_state(_cfg(corpus_file, 1, 1), sharding.make_mesh(), jax.random.PRNGKey(0))
    return jax.device_get(state)


# Leaf by leaf against each leaf's own change over the 3 steps (engine_testing.assert_trained_alike):
# the devices sum the gradient's partial sums in another order (measured up to 6.7e-5 on one
# leaf, 1.5e-5 on the moments, 5e-7 on the carry). A leaf a mesh left untrained differs by 1.
MESH_BOUND = 1e-3


@pytest.mark.parametrize("mesh", [(2, 4), (8, 1)])
def test_sharded_steps_reach_the_single_device_weights(trained, corpus_file, start, mesh):
    single, _ = trained[(1, 1)]
    sharded, shardings = trained[mesh]
    obs = sharded["params"]["observe"]
    if mesh == (2, 4):   # the parameters really are split along fsdp (ZeRO-3)
        assert "fsdp" in str(obs.sharding.spec)
        assert obs.addressable_shards[0].data.shape[1] == obs.shape[1] // 4
    assert int(sharded["step"]) == STEPS
    # every parameter the loss reaches was trained on one device
    reached = jax.tree_util.tree_flatten_with_path(reach.loss_reach(_cfg(corpus_file, 1, 1)))[0]
    assert {jax.tree_util.keystr(p) for p, r in reached if r} <= changed_leaves(single["params"], start["params"])
    for part in ("params", "opt_state", "carry"):
        worst = assert_trained_alike(sharded[part], single[part], start[part], MESH_BOUND, (mesh, part))
        print(mesh, part, f"worst leaf difference / its change: {worst:.2e}")


def test_checkpoint_saved_on_one_mesh_restores_on_another(trained, corpus_file, tmp_path):
    state, _ = trained[(2, 4)]
    ck = ckpt_lib.RunCheckpointer(tmp_path)
    ck.save(state, {"step": STEPS, "start_token_next": 0})
    ck.close()
    for data, fsdp in [(8, 1), (1, 1)]:
        cfg = _cfg(corpus_file, data, fsdp)
        mesh = sharding.make_mesh(data, fsdp)
        abstract = state_lib.abstract_train_state(cfg)
        shardings = state_lib.train_state_shardings(cfg, mesh, abstract)
        reader = ckpt_lib.RunCheckpointer(tmp_path, read_only=True)
        restored, meta = reader.restore(ckpt_lib.abstract_with_shardings(abstract, shardings))
        reader.close()
        assert meta["step"] == STEPS
        assert restored["params"]["observe"].sharding == shardings["params"]["observe"]
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, state)


def test_a_run_moves_to_another_mesh_through_the_trainer(corpus_file, start, tmp_path):
    """A pod of 8 devices trains to step 4 and ends; the next pod has 2 and resumes the run
    directory to step 8: the weights, moments and carry of one device's 8 steps."""
    def run(workdir, data, steps):
        cfg = cfg_lib.apply_overrides(_cfg(corpus_file, data, 1), [f"max_steps={steps}", "save_every=4"])
        logs = []
        with jax.default_matmul_precision("highest"):
            loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=logs.append)
        return cfg, logs

    run(tmp_path / "moved", 8, 4)
    cfg, logs = run(tmp_path / "moved", 2, 8)
    assert f"resumed {tmp_path / 'moved'} at step 4, lane offset {4 * cfg.seq_len}" in logs, logs
    run(tmp_path / "one", 1, 8)
    single_cfg = _cfg(corpus_file, 1, 1)
    moved, meta = ckpt_lib.restore_one_device(tmp_path / "moved", 8, single_cfg, items=("params", "opt_state", "extra"))
    one, _ = ckpt_lib.restore_one_device(tmp_path / "one", 8, single_cfg, items=("params", "opt_state", "extra"))
    assert meta["step"] == 8 and meta["config"]["mesh"]["data"] == 2
    assert changed_leaves(one["params"], start["params"])
    for part in ("params", "opt_state", "carry"):
        worst = assert_trained_alike(moved[part], one[part], start[part], MESH_BOUND, part)
        print(part, f"worst leaf difference / its change: {worst:.2e}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_localhost_match_one(corpus_file, start, tmp_path):
    overrides = [f"--set=corpus={corpus_file}", *[f"--set={o}" for o in SHARDED_RUN],
                 "--set=mesh.data=2", "--set=mesh.fsdp=4", *[f"--set={o}" for o in TWO_PROCESS_RUN]]
    # `--distributed` alone: JAX reads the cluster from the environment, here a SLURM job step
    # of two tasks on this machine (its coordinator address given, on a free port);
    # tests/test_multihost_faults.py launches with the explicit --coordinator flags
    port = _free_port()
    workdir = tmp_path / "two"

    def slurm(i):
        return {**os.environ, "XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}

    procs = [subprocess.Popen(
        [sys.executable, "-m", "fractus_jax.train", "--no-progress", "--config", "tiny", "--workdir", str(workdir),
         *overrides, "--distributed", "--local-devices", "4"], cwd=ROOT, env=slurm(i), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]

    one = tmp_path / "one"
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [o.split("=", 1)[1] for o in overrides])
    loop.run(prepare_lib.prepare(cfg, one, progress=False), progress=False, log=lambda m: None)

    def params(d):
        c = cfg_lib.resolve_for_mesh(cfg)
        abstract = state_lib.abstract_train_state(c)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
        ck = ckpt_lib.RunCheckpointer(d, read_only=True)
        try:
            return ck.restore(abstract)[0]["params"]
        finally:
            ck.close()

    a, b = params(workdir), params(one)
    assert ckpt_lib.read_manifest(workdir)["step"] == 2
    assert changed_leaves(b, start["params"])   # the run trained
    # gloo sums in another order than one process; the two processes' initialisation rounds
    # otherwise too (an untrained head differed by 3.4e-8 of its norm): floor 1e-6
    print("worst leaf difference / its change:", assert_trained_alike(a, b, start["params"], MESH_BOUND, floor=1e-6))


def test_plan_reports_the_sharded_step_memory(corpus_file):
    with jax.default_matmul_precision("highest"):   # the `trained` fixture's: its step is compiled already
        one = plan_memory(_cfg(corpus_file, 1, 1))
    eight = plan_memory(cfg_lib.resolve_for_mesh(cfg_lib.apply_overrides(_cfg(corpus_file, 2, 4), TWO_PROCESS_RUN)))
    for r in (one, eight):
        d = r["per_device"]
        assert d["total_bytes"] == d["argument_bytes"] + d["output_bytes"] - d["alias_bytes"] + d["temp_bytes"]
        assert d["argument_bytes"] > 0 and d["temp_bytes"] > 0
        assert d["alias_bytes"] > 0          # the donated state is updated in place
        assert r["flops_per_step"] > 0 and r["ids_per_step"] == 8 * 16
    # fsdp=4 splits the parameters and moments: each device holds about a quarter.
    assert eight["params_bytes_per_device"] < 0.4 * one["params_bytes_per_device"]
    assert eight["opt_state_bytes_per_device"] < 0.4 * one["opt_state_bytes_per_device"]
    # With the atom features fed, the planned step takes them too: (A, B, C, 320) float32
    # more arguments, rows split over all 8 devices (data × fsdp), as the trainer feeds them;
    # and atom_feat, which the loss now reaches, gets its moments.
    feats = plan_memory(cfg_lib.resolve_for_mesh(cfg_lib.apply_overrides(_cfg(corpus_file, 2, 4),
                                                                  [*TWO_PROCESS_RUN, "feats=true"])))
    moments = feats["opt_state_bytes_per_device"] - eight["opt_state_bytes_per_device"]
    assert moments > 0
    extra = feats["per_device"]["argument_bytes"] - eight["per_device"]["argument_bytes"] - moments
    assert extra == 1 * 8 * 16 * 320 * 4 // 8
