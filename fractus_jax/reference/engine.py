"""The PyTorch reference FractusEngine (docs/spec.md §2 weights, §4 chunk forward with carried state).

Built as ``FractusEngine(**cfg.torch_kwargs())``; run in float64 with ``.double()`` for
equivalence tests.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from fractus_jax.atom.ids import BOS, FEAT_DIM
from fractus_jax.config import COMPILED_PREFIX
from fractus_jax.reference import functional as Fn
from fractus_jax.reference.blocks import FractusBlock


class FractusEngine(nn.Module):
    def __init__(self, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
                 d_head: int, n_levels: int, n_oscillators: int, coupling_rank: int,
                 n_experts: int, top_k: int, expert_d_ff: int, siren_rank: int,
                 variant: str = "atom", gate_temperature: float = 2.5, kuramoto_steps: int = 1,
                 kuramoto_dt: float = 0.1, kuramoto_damping: float = 0.01,
                 moe_kappa: float = 4.0, ln_eps: float = 1e-5, bos_id: Optional[int] = BOS,
                 atom_feat_dim: int = FEAT_DIM, carry_decay: Optional[Sequence[float]] = None,
                 learn_carry_decay: bool = False, **_ignored):
        super().__init__()
        if variant not in ("atom", "parent"):
            raise ValueError(f"variant must be 'atom' or 'parent', got {variant!r}")
        if n_heads * d_head != d_model:
            raise ValueError(f"n_heads*d_head = {n_heads}*{d_head} != d_model={d_model}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in 1..n_experts={n_experts}")
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.variant, self.bos_id, self.atom_feat_dim = variant, bos_id, atom_feat_dim
        D = d_model

        self.observe = nn.Embedding(vocab_size, D)
        with torch.no_grad():
            nn.init.normal_(self.observe.weight, 0.0, 0.02 if variant == "atom" else 1.0)
        self.output_head = nn.Linear(D, vocab_size, bias=False)
        self.output_head.weight = self.observe.weight          # tied: one tensor
        self.blocks = nn.ModuleList([
            FractusBlock(d_model=D, n_heads=n_heads, d_head=d_head, n_levels=n_levels,
                         n_oscillators=n_oscillators, coupling_rank=coupling_rank,
                         n_experts=n_experts, top_k=top_k, expert_d_ff=expert_d_ff,
                         siren_rank=siren_rank, variant=variant,
                         gate_temperature=gate_temperature, kuramoto_steps=kuramoto_steps,
                         kuramoto_dt=kuramoto_dt, kuramoto_damping=kuramoto_damping,
                         moe_kappa=moe_kappa, ln_eps=ln_eps, carry_decay=carry_decay,
                         learn_carry_decay=learn_carry_decay)
            for _ in range(n_layers)])
        self.confidence_head = nn.Linear(D, 1)
        self.salience_head = nn.Linear(D, 1)
        bound = 1.0 / D ** 0.5
        with torch.no_grad():
            for head in (self.confidence_head, self.salience_head):
                nn.init.uniform_(head.weight, -bound, bound)
                nn.init.uniform_(head.bias, -bound, bound)
        if variant == "atom":
            self.atom_feat = nn.Linear(atom_feat_dim, D)
            with torch.no_grad():
                nn.init.zeros_(self.atom_feat.weight)
                nn.init.zeros_(self.atom_feat.bias)
        self.register_buffer("thought_state", torch.zeros(1, 1, D))
        self.register_buffer("last_lb_loss", torch.zeros(()))
        self.last_hidden: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ carried state

    @property
    def batch_size(self) -> int:
        return self.thought_state.shape[0]

    def reset_state(self, batch_size: int = 1) -> None:
        """Re-create every carry buffer as zeros at ``batch_size`` (dtype/device of the params)."""
        ref = self.observe.weight
        dtype, device = ref.dtype, ref.device
        self.thought_state = torch.zeros(batch_size, 1, self.d_model, dtype=dtype, device=device)
        self.last_lb_loss = torch.zeros((), dtype=dtype, device=device)
        for block in self.blocks:
            block.reset_state(batch_size, dtype, device)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As nn.Module's, plus: the compiled-module prefix (``COMPILED_PREFIX``) is stripped,
        the carry buffers are re-created at the batch size the state dict holds, and a
        (B, C, N) kuramoto_phases buffer (as a PyTorch chunk call leaves it) is cut to its
        last position."""
        sd = {}
        for key, value in state_dict.items():
            if key.startswith(COMPILED_PREFIX):
                key = key[len(COMPILED_PREFIX):]
            if key.endswith("kuramoto_phases") and value.dim() == 3 and value.shape[1] != 1:
                value = value[:, -1:, :]
            sd[key] = value
        thought = sd.get("thought_state")
        if thought is not None and thought.dim() == 3 and thought.shape[0] != self.batch_size:
            self.reset_state(thought.shape[0])
        return super().load_state_dict(sd, strict=strict, assign=assign)

    # ------------------------------------------------------------------ chunk forward (docs/spec.md §4)

    def forward(self, ids: torch.Tensor, feats: Optional[torch.Tensor] = None):
        """ids (B, C) int64, feats optional (B, C, atom_feat_dim) (atom variant only).

        Returns (logits (B, C, V), lb scalar). Updates the carry buffers (detached), sets
        ``last_lb_loss`` and ``last_hidden`` (the final h, (B, C, D), still in the graph).
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be (B, C), got shape {tuple(ids.shape)}")
        B, C = ids.shape
        if self.batch_size != B:
            self.reset_state(B)

        h = self.observe(ids)                                               # (B, C, D)
        if feats is not None:
            if self.variant != "atom":
                raise ValueError("atom features are only accepted by the 'atom' variant")
            if feats.shape != (B, C, self.atom_feat_dim):
                raise ValueError(f"feats must be {(B, C, self.atom_feat_dim)}, got {tuple(feats.shape)}")
            lo, hi = Fn.BOUNDARY_IDS
            at_boundary = ((ids >= lo) & (ids <= hi))[..., None]
            h = torch.where(at_boundary, h + self.atom_feat(feats.to(h.dtype)), h)

        reset = None
        thought = self.thought_state[:, 0, :]                               # (B, D)
        if self.bos_id is not None:
            reset = ids == self.bos_id
            h0 = torch.where(reset[:, 0, None], h[:, 0], h[:, 0] + thought)
        else:
            h0 = h[:, 0] + thought
        h = torch.cat([h0[:, None], h[:, 1:]], dim=1)

        lb = h.new_zeros(())
        for block in self.blocks:
            h, lb_block = block(h, reset)
            lb = lb + lb_block

        self.thought_state = h[:, -1:, :].detach()
        self.last_lb_loss = lb.detach()
        self.last_hidden = h
        logits = self.output_head(h)                                        # h · observeᵀ
        return logits, lb
