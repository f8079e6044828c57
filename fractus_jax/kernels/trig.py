"""sin and cos of the same angles by one reduction and two polynomials in multiply-adds,
which XLA:CPU runs faster than its sin and cos: kernels/cpu.py's form of the plain
jnp.sin and jnp.cos (docs/performance.md)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# π/2 as a sum of three parts for the reduction x − n·π/2 (Cody and Waite): the first two
# have 8 and 13 significant bits, so n times them is exact in float32 while |n| < 2^11
# (|x| < 3,000; the phases stay within a few units of [0, 2π)); the third is the float64
# remainder, π/2 − 1.5703125 − 4.837512969970703125e-4, to 1e-24.
_PIO2_PARTS = (1.5703125, 4.837512969970703125e-4, 7.549789954891882e-08)


@jax.custom_jvp
def sincos(x):
    """(sin x, cos x) for float32 or float64 x, by a reduction to [−π/4, π/4] and Taylor
    polynomials long enough for the dtype (the dropped term: 2e-8 in float32, 2e-18 in
    float64), with the derivative rule d sin = cos, d cos = −sin.
    Errors against float64 numpy for |x| ≤ 1,000 (tests/test_kernels.py): ≤ 1.2e-7 in
    float32, ≤ 4e-16 in float64; NaN for NaN and ±inf.
    """
    n = jnp.round(x * (2.0 / math.pi))
    r = x
    for part in _PIO2_PARTS:
        r = r - n * part
    r2 = r * r
    terms = 9 if x.dtype == jnp.float64 else 5
    s = c = jnp.zeros_like(r)
    for k in reversed(range(terms)):                  # Horner in r²
        s = s * r2 + (-1) ** k / math.factorial(2 * k + 1)
        c = c * r2 + (-1) ** k / math.factorial(2 * k)
    s = s * r
    quadrant = n.astype(jnp.int32) & 3                # x = r + quadrant·π/2 (mod 2π)
    odd = (quadrant & 1) == 1
    sin = jnp.where(odd, c, s)
    cos = jnp.where(odd, s, c)
    return (jnp.where(quadrant >= 2, -sin, sin),
            jnp.where((quadrant == 1) | (quadrant == 2), -cos, cos))


@sincos.defjvp
def _sincos_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    sin, cos = sincos(x)
    return (sin, cos), (cos * dx, -sin * dx)
