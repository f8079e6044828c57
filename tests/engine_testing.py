"""Shared helpers for the engine tests."""
import os

import jax
import numpy as np

from fractus_jax.train import checkpoint as ckpt_lib

# XLA_FLAGS for a subprocess that sets its own device count (`--local-devices`, a script):
# the suite's code generation flags (tests/conftest.py) and nothing else.
SUBPROCESS_XLA_FLAGS = os.environ["FRACTUS_TEST_SUBPROCESS_XLA_FLAGS"]


def move_off_init(params, key, scale=0.3):
    """Random LayerNorm weights/biases and nonzero level logits / expert biases.

    Fresh-init LayerNorm biases are exactly zero, which makes the parent's mean-phase
    encoding pure rounding noise (docs/spec.md §3.2 trap) and hides bugs in the bias paths; the
    kuramoto bias is shifted well away from zero mean.
    """
    blocks = dict(params["blocks"])
    keys = iter(jax.random.split(key, 16))
    for norm in ("norm_attn", "norm_kur", "norm_moe"):
        w, b = blocks[norm]["weight"], blocks[norm]["bias"]
        blocks[norm] = {"weight": w + scale * jax.random.normal(next(keys), w.shape, w.dtype),
                        "bias": scale * jax.random.normal(next(keys), b.shape, b.dtype)
                        + (0.5 if norm == "norm_kur" else 0.0)}
    attn = dict(blocks["attn"])
    attn["level_logits"] = jax.random.normal(next(keys), attn["level_logits"].shape, attn["level_logits"].dtype)
    attn["b_qkv"] = 0.1 * jax.random.normal(next(keys), attn["b_qkv"].shape, attn["b_qkv"].dtype)
    blocks["attn"] = attn
    moe = dict(blocks["moe"])
    moe["b1"] = 0.1 * jax.random.normal(next(keys), moe["b1"].shape, moe["b1"].dtype)
    moe["b2"] = 0.1 * jax.random.normal(next(keys), moe["b2"].shape, moe["b2"].dtype)
    blocks["moe"] = moe
    if "decay_logit" in attn:   # a learned carry decay: every head its own γ
        attn["decay_logit"] = attn["decay_logit"] + 0.5 * jax.random.normal(
            jax.random.fold_in(key, 1), attn["decay_logit"].shape, attn["decay_logit"].dtype)
    out = dict(params)
    out["blocks"] = blocks
    if "atom_feat" in params:
        w = params["atom_feat"]["weight"]
        out["atom_feat"] = {"weight": 0.05 * jax.random.normal(next(keys), w.shape, w.dtype),
                            "bias": params["atom_feat"]["bias"]}
    return out


def assert_trained_alike(got, want, start, bound, label="", floor=0.0):
    """Two trainings of the same function (another mesh, another dispatch, a resume) end
    alike: leaf by leaf, the L2 norm of got − want within `bound` times the L2 norm of that
    leaf's own change over the training, want − start (`start`: the common initial tree;
    zeros for state that starts at zero, such as moments and the carry). A tolerance against
    the change, not the weight: a leaf that one side never trained differs by its whole
    change (ratio 1), and a leaf that did not change must be equal. Not element by element:
    an element whose gradient cancels over the batch carries a large relative rounding error
    (AdamW's g/√v turns it into a step of up to lr). `floor`, relative to the leaf's norm,
    admits trees whose starts differ by rounding (an initialisation computed by other
    processes). Returns the worst ratio."""
    worst = [0.0]

    def check(path, a, b, s):
        a, b, s = (np.asarray(x, np.float64) for x in (a, b, s))
        change, diff = np.linalg.norm(b - s), np.linalg.norm(a - b)
        assert diff <= bound * change + floor * np.linalg.norm(b), (label, jax.tree_util.keystr(path), float(diff), float(change))
        worst[0] = max(worst[0], float(diff / change) if change else 0.0)

    jax.tree_util.tree_map_with_path(check, got, want, start)
    return worst[0]


def changed_leaves(tree, start):
    """The key paths of the leaves that differ from `start`."""
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda a, s: bool(np.any(np.asarray(a) != np.asarray(s))),
                                                             tree, start))[0]
    return {jax.tree_util.keystr(p) for p, moved in flat if moved}


def restore_state(run_dir, abstract, step=None):
    """The train state of a run directory's step (its newest by default), read-only, in the
    shapes and shardings of `abstract`."""
    ck = ckpt_lib.RunCheckpointer(run_dir, read_only=True)
    try:
        return ck.restore(abstract, step)[0]
    finally:
        ck.close()
