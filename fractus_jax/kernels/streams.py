"""Row streams: a function of a batch run as n independent slices of its rows, one after
another, and their outputs joined. On one CPU device it lets XLA schedule each slice's
work apart (config.Execution.row_streams; docs/performance.md); the function is
unchanged where the rows are independent of each other.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _slice(axis, a, i, n):
    if axis is None or a is None:
        return a
    rows = a.shape[axis] // n
    return jax.lax.slice_in_dim(a, i * rows, (i + 1) * rows, axis=axis)


def _join(how, parts):
    if how == "sum":
        return sum(parts)
    if how == "mean":
        return sum(parts) / len(parts)
    if isinstance(how, int):
        return jnp.concatenate(parts, how)
    raise ValueError(f"an output joins on an axis, 'sum' or 'mean', got {how!r}")


def in_row_streams(fn, n: int, in_axes, out_axes):
    """fn(*args) over n equal slices of its rows. in_axes: per argument (a pytree prefix of
    the arguments), the axis holding the rows, or None for an argument every slice takes
    whole. out_axes: per output (a prefix of fn's outputs), the axis the slices' outputs are
    concatenated on, or "sum" or "mean" over the slices."""

    def check(axis, a):
        if axis is not None and a is not None and a.shape[axis] % n:
            raise ValueError(f"{a.shape[axis]} rows do not split into {n} row streams")

    def run(*args):
        jax.tree.map(check, in_axes, args, is_leaf=lambda x: x is None)
        outs = [fn(*jax.tree.map(lambda axis, a: _slice(axis, a, i, n), in_axes, args,
                                 is_leaf=lambda x: x is None))
                for i in range(n)]
        return jax.tree.map(lambda how, *parts: _join(how, parts), out_axes, *outs)

    return run
