"""Shared helpers for the engine tests."""
import jax


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
    out = dict(params)
    out["blocks"] = blocks
    if "atom_feat" in params:
        w = params["atom_feat"]["weight"]
        out["atom_feat"] = {"weight": 0.05 * jax.random.normal(next(keys), w.shape, w.dtype),
                            "bias": params["atom_feat"]["bias"]}
    return out
