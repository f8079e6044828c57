"""Optimizer moments between the trainer's optax state and a PyTorch optimizer state dict.

The trainer's optimizer is `optax.multi_transform` with a "train" partition
`chain(clip_by_global_norm, adamw(1.0) | sgd(1.0, momentum))` (the step multiplies the
update by lr), so the moments sit in one `ScaleByAdamState` (count, mu, nu) or one
`TraceState` (trace) somewhere inside it; `find_moments` locates it by walking the tree.

PyTorch layout (what `torch.optim.AdamW/SGD.state_dict()` holds), with i the index of the
parameter in `list(FractusEngine(...).parameters())` (the tied head once; buffers are not
parameters):
    {"state": {i: {"step": tensor(float), "exp_avg": ..., "exp_avg_sq": ...}}   # AdamW
              {i: {"momentum_buffer": ...}}                                      # SGD
     "param_groups": [{"params": [0..n-1], "lr": ..., "betas": ..., ...}]}
Gradient clipping is outside a PyTorch optimizer and stateless here: nothing to carry.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import numpy as np
import optax
import torch

from fractus_jax.config import EngineConfig
from fractus_jax.convert import state_dicts
from fractus_jax.convert.state_dicts import ConversionError
from fractus_jax.reference import FractusEngine
from fractus_jax.train.config import TrainConfig
from fractus_jax.train.state import learning_rate

_MOMENT_TYPES = (optax.ScaleByAdamState, optax.TraceState)
_KIND = {"adamw": "AdamW (exp_avg, exp_avg_sq)", "sgd": "SGD (momentum_buffer)"}


# ----------------------------------------------------------------------------- the optax side

def _walk(node, visit: Callable):
    """Rebuild `node` with every moments node replaced by visit(node)."""
    if isinstance(node, _MOMENT_TYPES):
        return visit(node)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_walk(c, visit) for c in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_walk(c, visit) for c in node)
    if isinstance(node, dict):
        return {k: _walk(v, visit) for k, v in node.items()}
    return node


def find_moments(opt_state):
    """The one ScaleByAdamState or TraceState inside the trainer's optimizer state."""
    found = []

    def visit(node):
        found.append(node)
        return node

    _walk(opt_state, visit)
    if len(found) != 1:
        raise ConversionError(f"expected one AdamW or SGD moments node in the optimizer state, found {len(found)}")
    return found[0]


def replace_moments(opt_state, new_node):
    return _walk(opt_state, lambda _: new_node)


def _path_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _tree_to_names(tree, params, cfg: EngineConfig) -> dict[str, np.ndarray]:
    """A moment tree (MaskedNode at the buffers) → PyTorch name → numpy array."""
    leaves = {_path_keys(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    full = jax.tree_util.tree_map_with_path(
        lambda p, x: leaves.get(_path_keys(p), np.zeros(x.shape, x.dtype)), params)
    return state_dicts.params_to_torch(full, cfg)


def _stepped(tree, params, cfg: EngineConfig) -> set[str]:
    """The PyTorch names whose moments `tree` holds (not a MaskedNode: the parameters the
    trainer steps; the ones the loss does not reach have none, as in PyTorch)."""
    held = {_path_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    flags = jax.tree_util.tree_map_with_path(
        lambda p, x: np.full(x.shape, _path_keys(p) in held), params)
    return {name for name, f in state_dicts.params_to_torch(flags, cfg).items() if f.all()}


def _names_to_tree(by_name: dict[str, np.ndarray], template, cfg: EngineConfig):
    """PyTorch name → array (trainable names only) → a moment tree shaped like template."""
    shapes = state_dicts.expected_shapes(cfg)
    sd = {k: by_name.get(k, np.zeros(shape, np.float32)) for k, shape in shapes.items()}
    full = state_dicts.params_from_torch(sd, cfg)
    get = lambda keys: functools.reduce(lambda t, k: t[k], keys, full)  # noqa: E731
    return jax.tree_util.tree_map_with_path(
        lambda p, x: np.asarray(get(_path_keys(p)), dtype=x.dtype), template)


# ----------------------------------------------------------------------------- the PyTorch side

@functools.lru_cache(maxsize=4)
def _meta_engine(cfg: EngineConfig):
    """The reference module on the meta device: names, order and shapes, no memory."""
    with torch.device("meta"):
        return FractusEngine(**cfg.torch_kwargs())


def torch_parameters(cfg: EngineConfig) -> list[tuple[str, tuple]]:
    """(name, shape) of `list(FractusEngine(...).parameters())`, in that order."""
    return [(n, tuple(p.shape)) for n, p in _meta_engine(cfg).named_parameters()]


def torch_state_dict_order(cfg: EngineConfig) -> list[str]:
    return list(_meta_engine(cfg).state_dict().keys())


def scheduled_lr(cfg: TrainConfig, step: int) -> float:
    """The trainer's learning rate for its next update (state.learning_rate; the warmup and
    the constant schedule in Python, a decay by its optax schedule)."""
    if cfg.lr_schedule != "constant" and step >= cfg.warmup_steps:
        return float(learning_rate(cfg, step))
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))


def _param_groups(cfg: TrainConfig, step: int) -> list[dict]:
    params = _meta_engine(cfg.model).parameters()
    lr = scheduled_lr(cfg, step)
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum)
    groups = opt.state_dict()["param_groups"]
    groups[0]["initial_lr"] = cfg.lr   # what a PyTorch LR scheduler keeps beside the current lr
    return groups


def optimizer_to_torch(opt_state, params, cfg: TrainConfig, step: int) -> dict:
    """The trainer's optimizer state → a PyTorch AdamW/SGD state dict (torch tensors). A
    parameter the trainer does not step (no moments) has no entry, as a PyTorch optimizer
    keeps none for a parameter that never had a gradient."""
    node = find_moments(opt_state)
    stepped = _stepped(node.mu if isinstance(node, optax.ScaleByAdamState) else node.trace, params, cfg.model)
    order = [(i, n) for i, (n, _) in enumerate(torch_parameters(cfg.model)) if n in stepped]
    tensor = lambda a: torch.from_numpy(np.array(a, copy=True, order="C"))  # noqa: E731
    state = {}
    if isinstance(node, optax.ScaleByAdamState):
        mu, nu = _tree_to_names(node.mu, params, cfg.model), _tree_to_names(node.nu, params, cfg.model)
        count = float(np.asarray(node.count))
        for i, name in order:
            state[i] = {"step": torch.tensor(count, dtype=torch.float32),
                        "exp_avg": tensor(mu[name]), "exp_avg_sq": tensor(nu[name])}
    else:
        trace = _tree_to_names(node.trace, params, cfg.model)
        for i, name in order:
            state[i] = {"momentum_buffer": tensor(trace[name])}
    return {"state": state, "param_groups": _param_groups(cfg, step)}


def _kind_of(opt_sd: dict) -> Optional[str]:
    keys = set()
    for entry in opt_sd["state"].values():
        keys |= set(entry) if isinstance(entry, dict) else set()
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return "adamw"
    if "momentum_buffer" in keys:
        return "sgd"
    group = opt_sd["param_groups"][0] if opt_sd["param_groups"] else {}
    return "adamw" if "betas" in group else "sgd" if "momentum" in group else None


def _check_groups(opt_sd: dict, cfg: TrainConfig, path, warn) -> None:
    groups = opt_sd["param_groups"]
    want = ({"betas": (cfg.b1, cfg.b2), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
            if cfg.optimizer == "adamw" else {"momentum": cfg.momentum, "dampening": 0, "nesterov": False,
                                              "weight_decay": 0})
    for g, group in enumerate(groups):
        for key, value in want.items():
            if key in group and not np.allclose(np.asarray(group[key], float), np.asarray(value, float)):
                warn(f"{path}: param group {g} has {key}={group[key]!r}, the config's optimizer uses {value!r} "
                     f"(the config's value applies from now on)")
        if cfg.optimizer == "adamw" and group.get("decoupled_weight_decay") is False and group.get("weight_decay"):
            warn(f"{path}: param group {g} is Adam with L2 weight decay, the trainer's AdamW decouples it")
        if group.get("amsgrad"):
            warn(f"{path}: param group {g} uses amsgrad; its max_exp_avg_sq is dropped")
    if len(groups) > 1:
        warn(f"{path}: {len(groups)} param groups; the moments are matched to parameters by their index "
             "in the reference module's parameter order")


def optimizer_from_torch(opt_sd: dict, opt_state_template, params, cfg: TrainConfig, path,
                         warn: Callable[[str], None]):
    """A PyTorch AdamW/SGD state dict → the trainer's optimizer state (like the template)."""
    order = torch_parameters(cfg.model)
    kind = _kind_of(opt_sd)
    if kind is None:
        raise ConversionError(f"{path}: cannot tell AdamW from SGD (no moments, no betas or momentum)")
    if kind != cfg.optimizer:
        other = "sgd" if cfg.optimizer == "adamw" else "adamw"
        raise ConversionError(f"{path} holds {_KIND[kind]} moments but the config's optimizer is {cfg.optimizer}; "
                              f"pass --set optimizer={other}, or --no-opt to start fresh moments")
    indices = [i for g in opt_sd["param_groups"] for i in g.get("params", [])]
    if sorted(indices) != list(range(len(order))):
        raise ConversionError(f"{path} is the optimizer of {len(indices)} parameters, the model has {len(order)}")
    _check_groups(opt_sd, cfg, path, warn)
    slots = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
    moments = {slot: {} for slot in slots}
    steps, problems, empty = set(), [], []
    for i, (name, shape) in enumerate(order):
        entry = opt_sd["state"].get(i, opt_sd["state"].get(str(i)))
        if not entry or any(entry.get(s) is None for s in slots):
            empty.append(name)
            continue
        for slot in slots:
            value = entry[slot]
            if tuple(value.shape) != shape:
                problems.append(f"parameter {i} ({name}): {slot} {tuple(value.shape)} in the file, {shape} in the model")
            else:
                moments[slot][name] = state_dicts._to_numpy(value)
        if "step" in entry:
            steps.add(float(state_dicts._to_numpy(entry["step"])))
    if problems:
        raise ConversionError(f"{path}: wrong shapes: " + "; ".join(problems))
    node = find_moments(opt_state_template)
    stepped = _stepped(node.mu if kind == "adamw" else node.trace, params, cfg.model)
    empty = [name for name in empty if name in stepped]
    dropped = [name for name in moments[slots[0]] if name not in stepped]
    if dropped:
        warn(f"{path}: moments for {len(dropped)} parameters the training loss does not reach "
             f"({', '.join(dropped[:6])}{', ...' if len(dropped) > 6 else ''}) are dropped: the trainer "
             "leaves them alone (--set step_unreached=true keeps and steps them)")
    if empty and len(empty) < len(stepped):
        warn(f"{path}: no moments for {len(empty)} parameters ({', '.join(empty[:6])}"
             f"{', ...' if len(empty) > 6 else ''}); they start at zero")
    if kind == "adamw":
        if len(steps) > 1:
            warn(f"{path}: the parameters' step counts differ ({sorted(steps)}); using the largest")
        count = int(max(steps)) if steps else 0
        new = node._replace(count=np.asarray(count, np.asarray(node.count).dtype),
                            mu=_names_to_tree(moments["exp_avg"], node.mu, cfg.model),
                            nu=_names_to_tree(moments["exp_avg_sq"], node.nu, cfg.model))
    else:
        new = node._replace(trace=_names_to_tree(moments["momentum_buffer"], node.trace, cfg.model))
    return replace_moments(opt_state_template, new)
