"""Weights and carried state between the JAX trees and PyTorch state dicts (docs/spec.md §2).

All functions speak numpy on the PyTorch side (torch tensors are accepted as input), so
this module never imports torch; file formats (.pt, safetensors) live in `convert.files`.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from fractus_jax.config import COMPILED_PREFIX, EngineConfig
from fractus_jax.convert import names
from fractus_jax.model import init_params


class ConversionError(ValueError):
    """A state dict that does not fit the config; the message lists what is wrong."""


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def strip_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the prefix a compiled PyTorch module adds to every key (`COMPILED_PREFIX`)."""
    p = COMPILED_PREFIX
    return {(k[len(p):] if k.startswith(p) else k): v for k, v in state_dict.items()}


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def expected_shapes(cfg: EngineConfig) -> dict[str, tuple]:
    """PyTorch name → shape of every weight and buffer the config implies."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    out = {name: tuple(_get(shapes, path).shape) for path, name in names.top_level(cfg)}
    out[names.TIED_HEAD] = out["observe.weight"]
    blocks = shapes["blocks"]
    for path, name in names.per_block(cfg):
        per_layer = tuple(_get(blocks, path).shape[1:])
        for i in range(cfg.n_layers):
            out[names.block_key(i, name)] = per_layer
    return out


def check_state_dict(state_dict: Mapping[str, Any], cfg: EngineConfig) -> None:
    """Raise ConversionError naming vocab mismatches, missing/unexpected keys, bad shapes."""
    sd = strip_prefix(state_dict)
    obs = sd.get("observe.weight")
    if obs is not None and tuple(obs.shape)[0] != cfg.vocab_size:
        raise ConversionError(
            f"vocab mismatch: the checkpoint's observe.weight has {tuple(obs.shape)[0]} rows, "
            f"the config's vocab_size is {cfg.vocab_size}")
    want = expected_shapes(cfg)
    carry = set(names.state_keys(cfg))
    missing = sorted(k for k in want if k not in sd and k != names.TIED_HEAD)
    unexpected = sorted(k for k in sd if k not in want and k not in carry)
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(unexpected))
    for k, shape in want.items():
        if k in sd and tuple(sd[k].shape) != shape:
            problems.append(f"wrong shape for {k}: checkpoint {tuple(sd[k].shape)}, config {shape}")
    if problems:
        raise ConversionError("; ".join(problems))


def params_from_torch(state_dict: Mapping[str, Any], cfg: EngineConfig, dtype=None):
    """A PyTorch state dict (prefixed or not, carry buffers ignored) → the JAX parameter tree
    of numpy arrays, in the state dict's dtype unless `dtype` is given."""
    check_state_dict(state_dict, cfg)
    sd = strip_prefix(state_dict)
    cast = (lambda a: a.astype(dtype)) if dtype is not None else (lambda a: a)
    params: dict = {}
    for path, name in names.top_level(cfg):
        _set(params, path, cast(_to_numpy(sd[name])))
    blocks: dict = {}
    for path, name in names.per_block(cfg):
        stacked = np.stack([_to_numpy(sd[names.block_key(i, name)]) for i in range(cfg.n_layers)])
        _set(blocks, path, cast(stacked))
    params["blocks"] = blocks
    return params


def params_to_torch(params, cfg: EngineConfig) -> dict[str, np.ndarray]:
    """The JAX parameter (or gradient) tree → docs/spec.md §2 names → numpy arrays; the tied
    output head is written as the same array as observe.weight."""
    out = {name: np.asarray(_get(params, path)) for path, name in names.top_level(cfg)}
    out[names.TIED_HEAD] = out["observe.weight"]
    for path, name in names.per_block(cfg):
        stacked = np.asarray(_get(params["blocks"], path))
        for i in range(cfg.n_layers):
            out[names.block_key(i, name)] = stacked[i]
    return out


def _block_diag_to_heads(S_BxDxD: np.ndarray, n_heads: int, d_head: int) -> np.ndarray:
    B = S_BxDxD.shape[0]
    blocks = S_BxDxD.reshape(B, n_heads, d_head, n_heads, d_head)
    return np.stack([blocks[:, h, :, h, :] for h in range(n_heads)], axis=1)


def _heads_to_block_diag(S_BxHxdxd: np.ndarray) -> np.ndarray:
    B, H, dH, _ = S_BxHxdxd.shape
    out = np.zeros((B, H * dH, H * dH), S_BxHxdxd.dtype)
    for h in range(H):
        out[:, h * dH:(h + 1) * dH, h * dH:(h + 1) * dH] = S_BxHxdxd[:, h]
    return out


def state_from_torch(state_dict: Mapping[str, Any], cfg: EngineConfig) -> dict[str, np.ndarray]:
    """The PyTorch carry buffers → the JAX state; kuramoto_phases keeps its last position."""
    sd = strip_prefix(state_dict)
    missing = [k for k in names.state_keys(cfg) if k not in sd and k != names.LAST_LB]
    if missing:
        raise ConversionError("missing carry buffers: " + ", ".join(missing))
    H, dH = cfg.n_heads, cfg.d_head
    thought = _to_numpy(sd[names.THOUGHT])
    B = thought.shape[0]
    S, z, phase = [], [], []
    for i in range(cfg.n_layers):
        S.append(_block_diag_to_heads(_to_numpy(sd[names.block_key(i, names.BLOCK_S)]), H, dH))
        z.append(_to_numpy(sd[names.block_key(i, names.BLOCK_Z)]).reshape(B, H, dH))
        phase.append(_to_numpy(sd[names.block_key(i, names.BLOCK_PHASE)])[:, -1, :])
    return {"thought": thought.reshape(B, cfg.d_model), "S": np.stack(S), "z": np.stack(z),
            "phase": np.stack(phase)}


def state_to_torch(state, cfg: EngineConfig, last_lb_loss: float = 0.0) -> dict[str, np.ndarray]:
    """The JAX state → PyTorch carry buffers (block-diagonal attn_S, phases as (B, 1, N))."""
    thought = np.asarray(state["thought"])
    B = thought.shape[0]
    S, z, phase = (np.asarray(state[k]) for k in ("S", "z", "phase"))
    out = {names.THOUGHT: thought.reshape(B, 1, cfg.d_model),
           names.LAST_LB: np.asarray(last_lb_loss, dtype=thought.dtype)}
    for i in range(cfg.n_layers):
        out[names.block_key(i, names.BLOCK_S)] = _heads_to_block_diag(S[i])
        out[names.block_key(i, names.BLOCK_Z)] = z[i].reshape(B, cfg.d_model)
        out[names.block_key(i, names.BLOCK_PHASE)] = phase[i].reshape(B, 1, cfg.n_oscillators)
    return out
