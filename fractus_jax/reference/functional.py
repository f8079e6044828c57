"""Pure functions of the PyTorch reference (docs/spec.md §3): constants, attention kernels, Kuramoto.

Everything here is written to be obviously equal to the spec text, not fast.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from fractus_jax.atom.ids import BOUNDARY_FIRST, BOUNDARY_LAST

TWO_PI = 2.0 * math.pi
GOLDEN = (1.0 + math.sqrt(5.0)) / 2.0
# Atom boundary ids (docs/spec.md §5): atom features enter only at these positions.
BOUNDARY_IDS = (BOUNDARY_FIRST, BOUNDARY_LAST)  # inclusive range
DEN_EPS = 1e-20
DEN_MIN = 1e-10
GATE_MIN = 1e-10


# ---------------------------------------------------------------- constants (docs/spec.md §2, §3.4)

@functools.lru_cache(maxsize=None)
def farey_sequence(n: int) -> tuple:
    """F_n: every reduced p/q in [0, 1] with q <= n, ascending, 0/1 and 1/1 included."""
    if n < 1:
        raise ValueError(f"Farey order must be >= 1, got {n}")
    a, b, c, d = 0, 1, 1, n
    seq = [(a, b)]
    while c <= n:
        k = (n + b) // d
        a, b, c, d = c, d, k * c - a, k * d - b
        seq.append((a, b))
    return tuple(seq)


def farey_phases(n_experts: int) -> torch.Tensor:
    """Expert i gets 2π·p/q of element min(floor(i·M/E), M−1) of F_{2E}; float64, shape (E,)."""
    seq = farey_sequence(2 * n_experts)
    m = len(seq)
    out = []
    for i in range(n_experts):
        p, q = seq[min((i * m) // n_experts, m - 1)]
        out.append(TWO_PI * p / q)
    return torch.tensor(out, dtype=torch.float64)


def level_offsets(n_levels: int) -> torch.Tensor:
    """ω_l = (φ²)^(−l), φ the golden ratio; float64, shape (L,)."""
    return torch.tensor([(GOLDEN ** 2) ** (-l) for l in range(n_levels)], dtype=torch.float64)


# ---------------------------------------------------------------- attention (docs/spec.md §3.1)

def elu1(u: torch.Tensor) -> torch.Tensor:
    """u + 1 where u > 0, else exp(u) (strictly positive). exp sees min(u, 0) so its
    gradient never meets an overflowed exp on the unselected branch."""
    return torch.where(u > 0, u + 1.0, torch.exp(torch.clamp(u, max=0.0)))


def _safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / (den + 1e-20) where |den| > 1e-10, else 0. num (..., dH), den (...)."""
    ok = den.abs() > DEN_MIN
    den_ok = torch.where(ok, den, torch.ones_like(den))
    return torch.where(ok[..., None], num / (den_ok[..., None] + DEN_EPS), torch.zeros_like(num))


def loop_attention(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor,
                   S0: torch.Tensor, z0: torch.Tensor,
                   reset: Optional[torch.Tensor] = None, decay: Optional[float] = None):
    """One level of causal linear attention as a plain loop over positions.

    qf, kf, v: (B, H, C, dH) (features already applied); S0: (B, H, dH, dH) with
    S[i, j] = Σ kf[i]·v[j]; z0: (B, H, dH); reset: optional (B, C) bool, True where the
    row's state entering that position is zero (a document start); decay: the carry's γ
    (S_t = γ·S_{t-1} + kf_t⊗v_t, z likewise), a number or one per head (H,), None for the
    parent's running sum.
    Returns y (B, H, C, dH) and the state after the last position (S_C, z_C).
    """
    B, H, C, dH = qf.shape
    S, z = S0, z0
    ys = []
    for t in range(C):
        if reset is not None:
            r = reset[:, t].view(B, 1, 1)
            S = torch.where(r[..., None], torch.zeros_like(S), S)
            z = torch.where(r, torch.zeros_like(z), z)
        k_t, v_t, q_t = kf[:, :, t], v[:, :, t], qf[:, :, t]
        if torch.is_tensor(decay):          # one γ per head
            g = decay.view(1, H, 1)
            S, z = g[..., None] * S, g * z
        elif decay is not None:
            S, z = decay * S, decay * z
        S = S + k_t[..., :, None] * v_t[..., None, :]
        z = z + k_t
        num = torch.einsum("bhi,bhij->bhj", q_t, S)
        den = (q_t * z).sum(-1)
        ys.append(_safe_ratio(num, den))
    return torch.stack(ys, dim=2), S, z


def einsum_attention(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor,
                     S0: torch.Tensor, z0: torch.Tensor):
    """The PyTorch parent's kind of kernel: materialise every position's (dH, dH) state with a
    cumulative sum of outer products (O(C·dH²) memory per head; no document resets).

    Same shapes and result as ``loop_attention`` without ``reset``.
    """
    outer = torch.einsum("bhci,bhcj->bhcij", kf, v)
    S = S0[:, :, None] + torch.cumsum(outer, dim=2)          # (B, H, C, dH, dH)
    z = z0[:, :, None] + torch.cumsum(kf, dim=2)             # (B, H, C, dH)
    num = torch.einsum("bhci,bhcij->bhcj", qf, S)
    den = torch.einsum("bhci,bhci->bhc", qf, z)
    return _safe_ratio(num, den), S[:, :, -1], z[:, :, -1]


# ---------------------------------------------------------------- Kuramoto (docs/spec.md §3.2)

def kuramoto_field(theta: torch.Tensor, omega: torch.Tensor, U: torch.Tensor,
                   lam: torch.Tensor, damping: float) -> torch.Tensor:
    """dθ/dt = ω − damping·θ + cos θ ⊙ (U p) − sin θ ⊙ (U q), p = Λ ⊙ (Uᵀ sin θ), q = Λ ⊙ (Uᵀ cos θ)."""
    s, c = torch.sin(theta), torch.cos(theta)
    p = lam * (s @ U)
    q = lam * (c @ U)
    return omega - damping * theta + c * (p @ U.T) - s * (q @ U.T)


def kuramoto_integrate(theta: torch.Tensor, omega: torch.Tensor, U: torch.Tensor,
                       lam: torch.Tensor, damping: float, dt: float, n_steps: int) -> torch.Tensor:
    """n_steps RK4 steps of size dt, wrapping with remainder(·, 2π) after each step."""
    for _ in range(n_steps):
        k1 = kuramoto_field(theta, omega, U, lam, damping)
        k2 = kuramoto_field(theta + (dt / 2.0) * k1, omega, U, lam, damping)
        k3 = kuramoto_field(theta + (dt / 2.0) * k2, omega, U, lam, damping)
        k4 = kuramoto_field(theta + dt * k3, omega, U, lam, damping)
        theta = theta + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
        theta = torch.remainder(theta, TWO_PI)
    return theta


def initial_phases(base: torch.Tensor, n_oscillators: int) -> torch.Tensor:
    """θ0_n = (b + 2π·n/N) mod 2π; base (...,) → (..., N)."""
    n = torch.arange(n_oscillators, dtype=base.dtype, device=base.device)
    return torch.remainder(base[..., None] + TWO_PI * n / n_oscillators, TWO_PI)


# ---------------------------------------------------------------- MoE (docs/spec.md §3.3)

def gelu_tanh(u: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(u, approximate="tanh")


def phase_gates(psi: torch.Tensor, expert_phases: torch.Tensor, kappa_eff: float) -> torch.Tensor:
    """Normalised gates (..., E) from routing phases psi (..., N)."""
    theta_bar = torch.atan2(torch.sin(psi).sum(-1), torch.cos(psi).sum(-1))
    g = torch.exp(kappa_eff * torch.cos(theta_bar[..., None] - expert_phases))
    n_experts = expert_phases.shape[-1]
    s = g.sum(-1, keepdim=True)
    ok = s > GATE_MIN
    s_ok = torch.where(ok, s, torch.ones_like(s))
    return torch.where(ok, g / s_ok, torch.full_like(g, 1.0 / n_experts))


def topk_weights(gates: torch.Tensor, k: int):
    """Top-k experts by gate and their weights renormalised to sum 1 (uniform 1/k if ≤ 1e-10)."""
    vals, idx = torch.topk(gates, k, dim=-1)
    s = vals.sum(-1, keepdim=True)
    ok = s > GATE_MIN
    s_ok = torch.where(ok, s, torch.ones_like(s))
    return torch.where(ok, vals / s_ok, torch.full_like(vals, 1.0 / k)), idx


def load_balance(gates: torch.Tensor) -> torch.Tensor:
    """lb = E·Σ_e (P_e − 1/E)², P_e the mean gate over all tokens."""
    n_experts = gates.shape[-1]
    P = gates.reshape(-1, n_experts).mean(0)
    return n_experts * ((P - 1.0 / n_experts) ** 2).sum()
