"""The reference block (docs/spec.md §3): fractal linear attention, Kuramoto phases, phase-routed MoE.

Module and parameter names are the weight contract of docs/spec.md §2.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from fractus_jax.reference import functional as Fn


def _uniform_(t: torch.Tensor, bound: float) -> torch.Tensor:
    return nn.init.uniform_(t, -bound, bound)


class FractalAttention(nn.Module):
    """Causal multi-level linear attention with a carried (S, z) state (docs/spec.md §3.1)."""

    def __init__(self, d_model: int, n_heads: int, d_head: int, n_levels: int, carry_decay=None,
                 learn_carry_decay: bool = False):
        super().__init__()
        self.d_model, self.n_heads, self.d_head, self.n_levels = d_model, n_heads, d_head, n_levels
        # One γ per level (a constant of the function, not a weight), or None: the parent's sum.
        # Learned: the weight decay_logit (L, H) starts at logit(γ_l), γ = sigmoid(decay_logit).
        self.carry_decay = None if carry_decay is None else tuple(float(g) for g in carry_decay)
        if self.carry_decay is not None and len(self.carry_decay) != n_levels:
            raise ValueError(f"carry_decay has {len(self.carry_decay)} values for {n_levels} levels")
        self.learn_carry_decay = bool(learn_carry_decay)
        if self.learn_carry_decay:
            if self.carry_decay is None or max(self.carry_decay) >= 1.0:
                raise ValueError("learn_carry_decay needs carry_decay, each γ below 1")
            g = torch.tensor(self.carry_decay, dtype=torch.get_default_dtype())
            self.decay_logit = nn.Parameter(torch.logit(g)[:, None].repeat(1, n_heads))
        D = d_model
        self.w_qkv = nn.Parameter(torch.empty(3, D, D))
        self.b_qkv = nn.Parameter(torch.zeros(3, D))
        self.w_out = nn.Parameter(torch.empty(D, D))
        self.b_out = nn.Parameter(torch.zeros(D))
        self.level_logits = nn.Parameter(torch.zeros(n_levels))
        self.register_buffer("level_offsets",
                             Fn.level_offsets(n_levels).to(torch.get_default_dtype()))
        bound = math.sqrt(2.0 / (D + D))
        with torch.no_grad():
            _uniform_(self.w_qkv, bound)
            _uniform_(self.w_out, bound)

    # Carry layout helpers: block-diagonal (B, D, D) / (B, D)  <->  per head (B, H, dH, dH) / (B, H, dH)
    def split_state(self, S_bd: torch.Tensor, z: torch.Tensor):
        H, dH = self.n_heads, self.d_head
        S = torch.stack([S_bd[:, h * dH:(h + 1) * dH, h * dH:(h + 1) * dH] for h in range(H)], 1)
        return S, z.reshape(z.shape[0], H, dH)

    def join_state(self, S: torch.Tensor, z: torch.Tensor):
        B, H, dH, _ = S.shape
        S_bd = S.new_zeros(B, H * dH, H * dH)
        for h in range(H):
            S_bd[:, h * dH:(h + 1) * dH, h * dH:(h + 1) * dH] = S[:, h]
        return S_bd, z.reshape(B, H * dH)

    def decay(self, l: int):
        """Level l's γ: None, a number, or one per head (H,) when learned."""
        if self.learn_carry_decay:
            return torch.sigmoid(self.decay_logit[l])
        return None if self.carry_decay is None else self.carry_decay[l]

    def forward(self, x: torch.Tensor, S_bd: torch.Tensor, z_bd: torch.Tensor,
                reset: Optional[torch.Tensor] = None):
        """x = LN_attn(h) (B, C, D). Returns (a·w_out + b_out, new S (B,D,D), new z (B,D)),
        the new carry detached."""
        B, C, D = x.shape
        H, dH = self.n_heads, self.d_head

        def heads(t):
            return t.reshape(B, C, H, dH).transpose(1, 2)    # (B, H, C, dH)

        q = heads(x @ self.w_qkv[0] + self.b_qkv[0])
        k = heads(x @ self.w_qkv[1] + self.b_qkv[1])
        v = heads(x @ self.w_qkv[2] + self.b_qkv[2])
        S0, z0 = self.split_state(S_bd, z_bd)
        mix = torch.softmax(self.level_logits, dim=0)
        a = None
        S_fin, z_fin = [], []
        for l in range(self.n_levels):
            w = self.level_offsets[l]
            y, S_l, z_l = Fn.loop_attention(Fn.elu1(q + w), Fn.elu1(k + w), v, S0, z0, reset, self.decay(l))
            a = mix[l] * y if a is None else a + mix[l] * y
            S_fin.append(S_l)
            z_fin.append(z_l)
        a = a.transpose(1, 2).reshape(B, C, D)
        S_new = torch.stack(S_fin).mean(0).detach()
        z_new = torch.stack(z_fin).mean(0).detach()
        S_new, z_new = self.join_state(S_new, z_new)
        return a @ self.w_out + self.b_out, S_new, z_new


class Kuramoto(nn.Module):
    """Per-position oscillator phases from LN_kur(h) (docs/spec.md §3.2)."""

    def __init__(self, d_model: int, n_oscillators: int, coupling_rank: int, variant: str,
                 dt: float, damping: float, n_steps: int):
        super().__init__()
        self.variant, self.n_oscillators = variant, n_oscillators
        self.dt, self.damping, self.n_steps = float(dt), float(damping), int(n_steps)
        self.omega = nn.Parameter(torch.empty(n_oscillators))
        self.coupling_u = nn.Parameter(torch.empty(n_oscillators, coupling_rank))
        self.coupling_lambda = nn.Parameter(torch.empty(coupling_rank))
        with torch.no_grad():
            _uniform_(self.omega, 0.2 if variant == "atom" else 0.05)
            _uniform_(self.coupling_u, 1.0)
            nn.init.uniform_(self.coupling_lambda, 0.01, 0.51)
        if variant == "atom":
            self.phase_proj = nn.Linear(d_model, 1)
            with torch.no_grad():
                nn.init.normal_(self.phase_proj.weight, 0.0, 1.0 / math.sqrt(d_model))
                nn.init.zeros_(self.phase_proj.bias)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """y = LN_kur(h) (B, C, D) → θ (B, C, N) after the RK4 steps."""
        if self.variant == "atom":
            base = self.phase_proj(y).squeeze(-1)
        else:
            base = Fn.TWO_PI * y.mean(-1)
        theta = Fn.initial_phases(base, self.n_oscillators)
        return Fn.kuramoto_integrate(theta, self.omega, self.coupling_u, self.coupling_lambda,
                                     self.damping, self.dt, self.n_steps)


class PhaseMoE(nn.Module):
    """Low-rank experts routed by the oscillators' mean phase, exact top-k (docs/spec.md §3.3)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, d_ff: int, rank: int,
                 kappa: float, temperature: float):
        super().__init__()
        E, D, F, r = n_experts, d_model, d_ff, rank
        self.n_experts, self.top_k = E, top_k
        self.kappa_eff = float(kappa) / float(temperature)
        self.U1 = nn.Parameter(torch.empty(E, F, r))
        self.V1 = nn.Parameter(torch.empty(E, D, r))
        self.U2 = nn.Parameter(torch.empty(E, D, r))
        self.V2 = nn.Parameter(torch.empty(E, F, r))
        self.scale1 = nn.Parameter(torch.ones(E, 1, 1))
        self.scale2 = nn.Parameter(torch.ones(E, 1, 1))
        self.b1 = nn.Parameter(torch.zeros(E, F))
        self.b2 = nn.Parameter(torch.zeros(E, D))
        self.register_buffer("expert_phases", Fn.farey_phases(E).to(torch.get_default_dtype()))
        with torch.no_grad():
            _uniform_(self.U1, math.sqrt(2.0 / (F + r)))
            _uniform_(self.V1, math.sqrt(2.0 / (D + r)))
            _uniform_(self.U2, math.sqrt(2.0 / (D + r)))
            _uniform_(self.V2, math.sqrt(2.0 / (F + r)))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        u = self.scale1[e] * ((x @ self.V1[e]) @ self.U1[e].T) + self.b1[e]
        u = Fn.gelu_tanh(u)
        return self.scale2[e] * ((u @ self.V2[e]) @ self.U2[e].T) + self.b2[e]

    def forward(self, x: torch.Tensor, psi: torch.Tensor):
        """x = LN_moe(h) (B, C, D); psi routing phases (B, C, N). Returns (Σ_k w_k·o_k, lb)."""
        B, C, D = x.shape
        T, K = B * C, self.top_k
        gates = Fn.phase_gates(psi, self.expert_phases, self.kappa_eff)    # (B, C, E)
        w, idx = Fn.topk_weights(gates, K)                                 # (B, C, K)
        xt, w, idx = x.reshape(T, D), w.reshape(T, K), idx.reshape(T, K)
        slots = x.new_zeros(T, K, D)                 # slots[t, k] = o_{e_k}(x_t)
        for e in range(self.n_experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            slots = slots.index_put((tok, slot), self.expert(e, xt[tok]))
        out = (w[..., None] * slots).sum(1)
        return out.reshape(B, C, D), Fn.load_balance(gates)


class FractusBlock(nn.Module):
    """h + attn(LN_attn(h)); θ from LN_kur(h); h + moe(LN_moe(h)) (same h, after attention)."""

    def __init__(self, *, d_model, n_heads, d_head, n_levels, n_oscillators, coupling_rank,
                 n_experts, top_k, expert_d_ff, siren_rank, variant, gate_temperature,
                 kuramoto_steps, kuramoto_dt, kuramoto_damping, moe_kappa, ln_eps, carry_decay=None,
                 learn_carry_decay=False):
        super().__init__()
        self.variant = variant
        self.d_model, self.n_oscillators = d_model, n_oscillators
        self.attn = FractalAttention(d_model, n_heads, d_head, n_levels, carry_decay, learn_carry_decay)
        self.norm_attn = nn.LayerNorm(d_model, eps=ln_eps)
        self.kuramoto = Kuramoto(d_model, n_oscillators, coupling_rank, variant,
                                 kuramoto_dt, kuramoto_damping, kuramoto_steps)
        self.norm_kur = nn.LayerNorm(d_model, eps=ln_eps)
        self.moe = PhaseMoE(d_model, n_experts, top_k, expert_d_ff, siren_rank,
                            moe_kappa, gate_temperature)
        self.norm_moe = nn.LayerNorm(d_model, eps=ln_eps)
        self.register_buffer("attn_S", torch.zeros(1, d_model, d_model))
        self.register_buffer("attn_z", torch.zeros(1, d_model))
        self.register_buffer("kuramoto_phases", torch.zeros(1, 1, n_oscillators))

    def reset_state(self, batch_size: int, dtype: torch.dtype, device) -> None:
        D, N = self.d_model, self.n_oscillators
        self.attn_S = torch.zeros(batch_size, D, D, dtype=dtype, device=device)
        self.attn_z = torch.zeros(batch_size, D, dtype=dtype, device=device)
        self.kuramoto_phases = torch.zeros(batch_size, 1, N, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, reset: Optional[torch.Tensor] = None):
        a, S_new, z_new = self.attn(self.norm_attn(h), self.attn_S, self.attn_z, reset)
        h = h + a
        theta = self.kuramoto(self.norm_kur(h))                       # (B, C, N)
        if self.variant == "atom":
            psi = theta
        else:
            psi = theta[:, -1:, :].expand_as(theta)
        out, lb = self.moe(self.norm_moe(h), psi)
        h = h + out
        self.attn_S, self.attn_z = S_new, z_new
        self.kuramoto_phases = theta[:, -1:, :].detach()
        return h, lb
