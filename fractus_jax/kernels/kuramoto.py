"""Kuramoto oscillator phases (docs/spec.md §3.2): a low-rank coupled field integrated by RK4.

Every position's N oscillators evolve independently of the other positions, so the
kernels work on any leading axes `...` with phases θ of shape (..., N).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fractus_jax.kernels import plain

TWO_PI = 2.0 * math.pi


def initial_phases(base_phase, n_oscillators: int):
    """θ0_n = (b + 2π·n/N) mod 2π for a base phase b of shape (...)."""
    spread = TWO_PI * jnp.arange(n_oscillators, dtype=base_phase.dtype) / n_oscillators
    return jnp.mod(base_phase[..., None] + spread, TWO_PI)


def mean_phase_encoding(y):
    """Parent encoding: b = 2π·mean_d(y)."""
    return TWO_PI * jnp.mean(y, axis=-1)


def kuramoto_field(theta, omega, coupling_u, coupling_lambda, damping: float, sin_cos=plain.sin_cos):
    """dθ/dt = ω − damping·θ + cos θ ⊙ (U p) − sin θ ⊙ (U q), p = Λ⊙(Uᵀ sin θ), q = Λ⊙(Uᵀ cos θ)."""
    sin, cos = sin_cos(theta)
    p = coupling_lambda * (sin @ coupling_u)
    q = coupling_lambda * (cos @ coupling_u)
    return omega - damping * theta + cos * (p @ coupling_u.T) - sin * (q @ coupling_u.T)


def integrate(theta0, omega, coupling_u, coupling_lambda, *, n_steps: int, dt: float,
              damping: float, sin_cos=plain.sin_cos):
    """n_steps RK4 steps of size dt, wrapping mod 2π after each (the wrap has slope 1);
    sin_cos is the plain form or a tuned one (kernels/select.py)."""

    def f(theta):
        return kuramoto_field(theta, omega, coupling_u, coupling_lambda, damping, sin_cos)

    def rk4_step(theta, _):
        k1 = f(theta)
        k2 = f(theta + 0.5 * dt * k1)
        k3 = f(theta + 0.5 * dt * k2)
        k4 = f(theta + dt * k3)
        theta = theta + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
        return jnp.mod(theta, TWO_PI), None

    theta, _ = jax.lax.scan(rk4_step, theta0, None, length=n_steps, unroll=True)
    return theta
