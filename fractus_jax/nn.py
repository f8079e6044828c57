"""The engine as a Flax NNX module, for code built with Flax (docs/engine.md "As a Flax module").

`FractusEngine` holds the same parameter tree as `model.init_params`, leaf for leaf and
name for name (``m.observe``, ``m.blocks["attn"]["w_qkv"]``, ...), as NNX variables:
trainable weights are `nnx.Param`; the two buffers (`model.BUFFER_NAMES`) are `Buffer`,
which no ``wrt=nnx.Param`` filter selects, so neither `nnx.grad` nor `nnx.Optimizer`
touches them. The carried thought (S, z, phase, thought) is module state of type `Carry`.
A call runs the pure `model.forward_chunk` on those values (the module holds no math of
its own) and writes the new carry back, so consecutive calls continue the stream:

    m = FractusEngine(cfg, batch_size=4, rngs=nnx.Rngs(0))
    logits, lb = m(ids)            # chunk 1
    logits, lb = m(next_ids)       # chunk 2, from chunk 1's carry
    m.reset()                      # a new stream

`from_params` / `to_params` convert to and from the pure tree the trainer, the converter
and the checkpoints use.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import nnx

from fractus_jax import model
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.dtypes import accum_dtype


class Buffer(nnx.Variable):
    """A weight that is not trained (level offsets, expert phases)."""


class Carry(nnx.Variable):
    """The engine's carried state between chunks; not trained."""


def _variables(tree, buffer: bool = False):
    """The pure tree's leaves wrapped as Param, or Buffer under a BUFFER_NAMES key."""
    if isinstance(tree, dict):
        return {k: _variables(v, k in model.BUFFER_NAMES) for k, v in tree.items()}
    return (Buffer if buffer else nnx.Param)(jnp.asarray(tree))


class FractusEngine(nnx.Module):
    """The engine with its weights and its carried state; ``m(ids, feats=None) -> (logits, lb)``."""

    def __init__(self, cfg: EngineConfig, batch_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 params: Optional[model.Params] = None, state: Optional[model.State] = None,
                 ex: Execution = Execution()):
        """Fresh weights from ``rngs.params()`` (model.init_params), or the given ``params``
        tree; a zero carry for ``batch_size`` rows, or the given ``state``. ``ex``: how the
        forward is computed (kernels, dtype, remat, blocks)."""
        self.cfg, self.ex = cfg, ex
        if params is None:
            params = model.init_params(cfg, rngs.params(), dtype)
        self._param_names = tuple(params)
        for name, value in params.items():
            var = _variables(value, name in model.BUFFER_NAMES)
            setattr(self, name, var if isinstance(var, nnx.Variable) else nnx.data(var))
        self.carry = nnx.data({})
        self.reset(batch_size)
        if state is not None:
            for k, v in state.items():
                self.carry[k] = Carry(jnp.asarray(v))

    @classmethod
    def from_params(cls, cfg: EngineConfig, params: model.Params, batch_size: int,
                    state: Optional[model.State] = None, ex: Execution = Execution()) -> "FractusEngine":
        """A module around a pure parameter tree (init_params, a checkpoint, the converter;
        host arrays too) with a zero carry, or the given pure ``state``."""
        return cls(cfg, batch_size, rngs=nnx.Rngs(0), params=params, state=state, ex=ex)

    def to_params(self) -> model.Params:
        """The pure parameter tree (plain nested dicts of arrays, buffers included)."""
        return {name: _values(getattr(self, name)) for name in self._param_names}

    def carried(self) -> model.State:
        """The carried state as the pure dict forward_chunk takes."""
        return {k: v[...] for k, v in self.carry.items()}

    def reset(self, batch_size: Optional[int] = None) -> None:
        """Zero the carry (a stream start), for ``batch_size`` rows (default: as now)."""
        if batch_size is None:
            batch_size = self.carry["thought"].shape[0]
        for k, v in model.init_state(self.cfg, batch_size, accum_dtype(self.observe[...].dtype)).items():
            self.carry[k] = Carry(v)

    def __call__(self, ids_BxC, feats=None):
        logits, lb, new_state = model.forward_chunk(self.to_params(), self.carried(), ids_BxC, self.cfg, feats,
                                                   ex=self.ex)
        for k, v in new_state.items():
            self.carry[k][...] = v
        return logits, lb


def _values(tree):
    if isinstance(tree, nnx.Variable):
        return tree[...]
    return {k: _values(v) for k, v in tree.items()}


__all__ = ["Buffer", "Carry", "FractusEngine"]
