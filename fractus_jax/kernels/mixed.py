"""A weight product in a low-precision compute dtype whose sums stay float32.

`einsum(spec, x, w, dtype, out_dtype)` multiplies activations x by a float32 weight w with
both operands rounded to `dtype` (bfloat16: the GPU settings' matmuls) and float32
accumulation. Its backward is written out (custom_vjp) so that the weight's gradient is a
float32 product too: autodiff of `x.astype(bf16) @ w.astype(bf16)` would give the weight
a bfloat16 dot whose sum over every token of the batch is rounded to bfloat16, and on a
mesh each device's partial sum would be rounded so and summed across devices in bfloat16
(XLA's partitioner reduces a dot's partial sums in the dot's output dtype). Here the
gradient dot outputs float32: the token sum, and the cross-device sum of its partial sums,
are float32 (docs/engine.md, "Numerics"). With `dtype` equal to the weight's dtype it is
the plain einsum.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _acc(dtype):
    """The sums' dtype: float32, or float64 for float64 operands."""
    return jnp.promote_types(dtype, jnp.float32)


def _specs(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    for mine, others in ((a, b + out), (b, a + out)):
        if set(mine) - set(others):
            raise ValueError(f"einsum {spec!r}: an index summed within one operand has no transpose here")
    return a, b, out


def einsum(spec: str, x, w, dtype, out_dtype=None):
    """einsum(spec, x, w) with both operands in `dtype`, float32 sums, output `out_dtype`
    (default: `dtype`); w's gradient is float32 sums as well (module docstring)."""
    dtype = jnp.dtype(dtype)
    out_dtype = jnp.dtype(out_dtype or dtype)
    if dtype == jnp.dtype(w.dtype):   # no rounding of the weight: autodiff's products are the sums
        return jnp.einsum(spec, x.astype(dtype), w).astype(out_dtype)
    _specs(spec)
    return _mixed(spec, dtype, out_dtype, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mixed(spec, dtype, out_dtype, x, w):
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=_acc(dtype)).astype(out_dtype)


def _mixed_fwd(spec, dtype, out_dtype, x, w):
    x_c, w_c = x.astype(dtype), w.astype(dtype)
    y = jnp.einsum(spec, x_c, w_c, preferred_element_type=_acc(dtype)).astype(out_dtype)
    # the primal dtypes ride along as empty arrays
    return y, (x_c, w_c, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _mixed_bwd(spec, dtype, out_dtype, residuals, g):
    x_c, w_c, x_like, w_like = residuals
    a, b, out = _specs(spec)
    g_c = g.astype(dtype)
    dx = jnp.einsum(f"{out},{b}->{a}", g_c, w_c, preferred_element_type=_acc(dtype)).astype(x_like.dtype)
    dw = jnp.einsum(f"{a},{out}->{b}", x_c, g_c, preferred_element_type=_acc(dtype)).astype(w_like.dtype)
    return dx, dw


_mixed.defvjp(_mixed_fwd, _mixed_bwd)
