"""Where each array lives on the device mesh: tables of logical axes, one of rules.

Mesh axes are `data` (pure data parallelism) and `fsdp` (data parallelism whose devices
also split the parameters and optimizer moments, ZeRO-3 style). Parameters name logical
axes per dimension (PARAM_AXES), the carried state per leaf (`model.STATE_AXES`, which the
engine slices rows by); LOGICAL_RULES maps logical axes to mesh axes. A dimension that the
mesh axis does not divide stays replicated, and `plan_report` says so.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fractus_jax.model import STATE_AXES

MESH_AXES = ("data", "fsdp")

LOGICAL_RULES = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "experts": "fsdp",
}

# Path regex (keys joined by "/") → logical axes of that leaf, first match wins.
PARAM_AXES = (
    (r"observe", ("vocab", "embed")),
    (r"blocks/attn/w_qkv", ("layers", None, "embed", None)),
    (r"blocks/attn/w_out", ("layers", "embed", None)),
    (r"blocks/moe/(U1|V1|U2|V2|scale1|scale2|b1|b2|expert_phases)", ("layers", "experts")),
    (r"atom_feat/weight", ("embed", None)),
)


def make_mesh(data: int = 1, fsdp: int = 1, devices=None) -> jax.sharding.Mesh:
    devices = devices if devices is not None else jax.devices()
    n = data * fsdp
    if n > len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} needs {n} devices, {len(devices)} available")
    # Auto axes: XLA propagates shardings through the step as pjit does (jax.make_mesh
    # would default to Explicit axes, under which FSDP matmuls need manual reshards).
    return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(data, fsdp), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _mesh_size(mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_spec(logical, shape, mesh) -> P:
    spec = []
    for dim, name in zip(shape, tuple(logical) + (None,) * (len(shape) - len(logical))):
        axes = LOGICAL_RULES.get(name) if name else None
        spec.append(axes if axes and dim % _mesh_size(mesh, axes) == 0 else None)
    return P(*spec)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_logical_axes(path: str):
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, path):
            return axes
    return ()


def param_shardings(abstract_params, mesh):
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, logical_to_spec(param_logical_axes(_path_str(path)),
                                                               leaf.shape, mesh)),
        abstract_params)


def state_shardings(abstract_state, mesh):
    return {k: NamedSharding(mesh, logical_to_spec(STATE_AXES[k], v.shape, mesh))
            for k, v in abstract_state.items()}


def batch_sharding(mesh, ndim: int, batch_dim: int = 0) -> NamedSharding:
    """Lanes (rows) split over data × fsdp."""
    spec = [None] * ndim
    spec[batch_dim] = LOGICAL_RULES["batch"]
    return NamedSharding(mesh, P(*spec))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def unsharded_dims(abstract_params, mesh) -> list[str]:
    """Leaves whose logical axes asked for a split the mesh could not make."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        name = _path_str(path)
        logical = param_logical_axes(name)
        for dim, axis in zip(leaf.shape, logical):
            rule = LOGICAL_RULES.get(axis) if axis else None
            if rule and dim % _mesh_size(mesh, rule) != 0:
                out.append(f"{name}: {axis}={dim} not divisible by {rule}={_mesh_size(mesh, rule)}")
    return out
