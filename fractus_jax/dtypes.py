"""The accumulation rule, written once: float64 inputs accumulate (and carry state) in
float64, every other dtype (float32, bfloat16) in float32."""
from __future__ import annotations

import jax.numpy as jnp


def accum_dtype(dtype):
    """The accumulation dtype for arrays of `dtype`."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
