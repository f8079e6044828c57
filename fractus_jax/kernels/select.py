"""Which forms of the engine's kernels a forward runs: the plain ones (kernels/plain.py, the
math as written, differentiated by autodiff: what a GPU or TPU runs) or the ones tuned for
XLA:CPU (kernels/cpu.py, the same functions). `Execution.kernels` chooses: "auto" (the
default) takes the CPU forms on a CPU backend and the plain ones elsewhere, "plain" and
"cpu" force one side. The engine asks once per forward (`forms(ex.kernels)`), when it is
traced, so a jitted function keeps the forms of the backend it was traced for.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax

from fractus_jax.kernels import cpu
from fractus_jax.kernels import plain

KERNELS = ("auto", "plain", "cpu")


class Forms(NamedTuple):
    """One form of each kernel the engine's forward calls (signatures: kernels/plain.py)."""
    sin_cos: Callable            # θ → (sin θ, cos θ): the Kuramoto field, the MoE routing
    layer_norm: Callable         # (x, p, eps) → LayerNorm(x)
    qkv_features: Callable       # (x, W_qkv, b_qkv, ω, H, matmul dtype) → (qf, kf, v) by level
    linear_attention: Callable   # one level's chunkwise attention with a carried (S, z)
    level_attention: Callable    # every level's, mixed, with each level's carry decay: (a, S, z)


def _forms(module) -> Forms:
    return Forms(**{name: getattr(module, name) for name in Forms._fields})


PLAIN = _forms(plain)
CPU = _forms(cpu)


def resolved(kernels: str, platform: str | None = None) -> str:
    """"plain" or "cpu": what `kernels` ("auto", "plain", "cpu") means on `platform` (the
    one a program is lowered for: "cpu", "cuda", "rocm", "tpu"), by default this process's
    backend. A CPU process lowering for a GPU passes the GPU's platform and gets the plain forms."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "auto":
        return "cpu" if (platform or jax.default_backend()) == "cpu" else "plain"
    return kernels


def forms(kernels: str) -> Forms:
    """The forms `kernels` ("auto", "plain", "cpu") runs on this backend."""
    return CPU if resolved(kernels) == "cpu" else PLAIN
