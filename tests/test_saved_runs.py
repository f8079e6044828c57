"""Run directories written by an earlier main resume under today's code.

tests/data/run_2250e87 is a tiny run of two steps written by main at 2250e87, before the
execution settings left the engine config: its saved configs hold kernels, remat and the
other execution fields under "model" (how it was written: tests/data/run_2250e87/README.md)."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from fractus_jax import config
from fractus_jax.lanes import LaneReader
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import step as step_lib
from fractus_jax.train.__main__ import main as train_main

from engine_testing import restore_state

DATA = Path(__file__).resolve().parent / "data" / "run_2250e87"
# The command that wrote it, but for --workdir, --corpus and max_steps; model.kernels under
# its name of then.
ARGS = ["--config", "tiny", "--no-progress", "--set", "save_every=2", "--set", "batch_size=2",
        "--set", "seq_len=16", "--set", "optimizer=sgd", "--set", "model.kernels=plain",
        "--set", "execution.remat=true", "--set", "tensorboard=false"]


def test_a_run_directory_from_before_the_execution_split_reads_and_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DATA, run, ignore=shutil.ignore_patterns("corpus.u16", "README.md"))
    corpus = shutil.copy(DATA / "corpus.u16", tmp_path / "corpus.u16")
    old = json.loads((DATA / "manifest.json").read_text())["config"]
    assert "execution" not in old and old["model"]["kernels"] == "plain"   # the layout of then

    # Its saved config reads as the two kinds of field, with nothing unknown or defaulted.
    _, meta, cfg = ckpt_lib.read_step(run, 2)
    assert meta["step"] == 2 and capsys.readouterr().err == ""
    assert cfg.model == config.tiny()
    assert cfg.execution == config.TINY_EXECUTION.replace(kernels="plain", remat=True)
    params, engine = ckpt_lib.load_for_inference(run)
    assert engine == config.tiny()
    capsys.readouterr()

    # It resumes at step 3 from its own step 2, and trains on to step 4.
    assert train_main([*ARGS, "--workdir", str(run), "--set", f"corpus={corpus}", "--set", "max_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "note: --set model.kernels is now execution.kernels" in err
    assert "Traceback" not in err and "warning" not in err.lower()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "ce_tf" in json.loads(line)]
    assert steps == [1, 2, 3, 4]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["start_token_next"] == 4 * 16
    # Written today: the weights' fields under "model", the execution apart.
    assert "kernels" not in manifest["config"]["model"]
    assert manifest["config"]["execution"]["kernels"] == "plain" and manifest["config"]["execution"]["remat"]
    # Step 2 is still the one written then, and step 4 moved on from it.
    then, _ = ckpt_lib.load_for_inference(run, step=2)
    now, _ = ckpt_lib.load_for_inference(run, step=4)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(then)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(then), jax.tree.leaves(now)))
    assert moved > 0

    # What it resumed from is what was saved: steps 3 and 4 taken here by today's step from
    # the old step 2 (its weights, SGD momentum and carry, read without the trainer) on the
    # lanes at offsets 32 and 48 give step 4's weights, momentum and carry bit for bit.
    today = cfg_lib.apply_overrides(cfg, [f"corpus={corpus}"])
    abstract = ckpt_lib.one_device_abstract(today)
    old_2, at_4 = restore_state(DATA, abstract, 2), restore_state(run, abstract, 4)
    momentum = optax.tree_utils.tree_get(old_2["opt_state"], "trace")
    assert np.abs(np.asarray(momentum["observe"])).max() > 0       # a momentum to misread
    reader = LaneReader(np.fromfile(corpus, "<u2"), today.batch_size, today.seq_len)
    step = jax.jit(step_lib.make_train_step(today))

    def two_steps(state):
        for offset in (2 * 16, 3 * 16):
            state, _ = step(state, {"ids": reader.read(offset)[0]})
        return jax.device_get(state)

    def close(a, b):   # two programs (the trainer's is sharded and donates): equal up to float32 rounding
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-8), a, b)

    taken = two_steps(old_2)
    for part in ("params", "opt_state", "carry"):
        close(taken[part], at_4[part])
    # the control: the same two steps from the momentum read as zeros end elsewhere
    zeroed = optax.tree_utils.tree_set(old_2["opt_state"], trace=jax.tree.map(np.zeros_like, momentum))
    wrong = two_steps({**restore_state(DATA, abstract, 2), "opt_state": zeroed})
    with pytest.raises(AssertionError):
        close(wrong["params"], at_4["params"])
