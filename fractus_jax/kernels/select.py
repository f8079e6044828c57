"""Which form of a kernel the engine runs: the plain formulation, or one tuned for XLA:CPU.

The plain form is the math as written, differentiated by autodiff; it is what a GPU or TPU
runs. A CPU-tuned form computes the same function in a way XLA:CPU runs faster (each is
measured against its plain form in docs/performance.md and tested against it in float64).
`EngineConfig.kernels` chooses: "auto" (the default) takes the CPU forms on a CPU backend
and the plain ones elsewhere, "plain" and "cpu" force one side. The choice is made when the
forward is traced, so a jitted function keeps the forms of the backend it was traced for.
"""
from __future__ import annotations

import jax

KERNELS = ("auto", "plain", "cpu")

# The CPU-tuned forms, by name (the call sites name theirs):
#   "sincos"       kernels/trig.sincos for sin and cos (Kuramoto field, MoE routing)
#   "layer_norm"   LayerNorm with its backward written out
#   "qkv_features" the qkv projection and feature maps with their backward written out
#   "level_slices" one attention kernel call per level instead of a level axis
#   "one_block"    no block axis in the attention kernel when the chunk is one block
CPU_FORMS = ("sincos", "layer_norm", "qkv_features", "level_slices", "one_block")


def resolved(kernels: str) -> str:
    """"plain" or "cpu": what `kernels` ("auto", "plain", "cpu") means on this backend."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "auto":
        return "cpu" if jax.default_backend() == "cpu" else "plain"
    return kernels


def cpu_tuned(kernels: str, form: str) -> bool:
    """True when the CPU-tuned `form` runs: kernels="cpu", or "auto" on a CPU backend."""
    if form not in CPU_FORMS:
        raise ValueError(f"unknown CPU form {form!r}; known: {CPU_FORMS}")
    return resolved(kernels) == "cpu"
