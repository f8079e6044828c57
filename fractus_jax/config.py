"""The engine's configuration: one frozen dataclass, hashable so it can be a static jit argument.

Field names up to ``atom_feat_dim`` are the PyTorch reference constructor's arguments
(``fractus_jax.reference.FractusEngine(**cfg.torch_kwargs())``); the fields after them only
choose how the JAX side computes the same function (dtype, block sizes, capacity, remat).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

from fractus_jax.atom import ids as atom_ids
from fractus_jax.kernels.select import KERNELS

VARIANTS = ("atom", "parent")
# The fields that decide what the weights are (their shapes and meaning): a resumed or
# imported run must keep them; the others only choose how the same function is computed.
WEIGHT_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_head", "n_levels", "n_oscillators",
                 "coupling_rank", "n_experts", "top_k", "expert_d_ff", "siren_rank", "variant", "atom_feat_dim")
ATOM_VOCAB = atom_ids.VOCAB
ATOM_BOS = atom_ids.BOS
# What a compiled PyTorch module (torch.compile) puts before every state-dict key: the
# reference engine's load_state_dict and the converter both strip it. Declared here, below
# both, because the converter's core must not import torch and the reference package does.
COMPILED_PREFIX = "_orig_mod."


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_head: int
    n_levels: int
    n_oscillators: int
    coupling_rank: int
    n_experts: int
    top_k: int
    expert_d_ff: int
    siren_rank: int
    variant: str = "atom"
    gate_temperature: float = 2.5
    kuramoto_steps: int = 1
    kuramoto_dt: float = 0.1
    kuramoto_damping: float = 0.01
    moe_kappa: float = 4.0
    ln_eps: float = 1e-5
    # Id whose presence at position t zeroes a row's carried state entering t (docs/spec.md §4);
    # None disables document resets (the parent's GPT-2 stream has no BOS).
    bos_id: Optional[int] = ATOM_BOS
    atom_feat_dim: int = atom_ids.FEAT_DIM
    # ---- JAX-side computation choices (not part of the weights) ----
    # None (dropless): every token gets its top_k experts, the PyTorch engine's function.
    # A number: each expert takes at most ceil(cf·T·K/E) assignments of a dispatch group
    # of T tokens, and the rest are dropped (docs/spec.md §3.3).
    capacity_factor: Optional[float] = None
    # Rows per capacity group; 0 makes the whole batch one group. With a capacity factor
    # the group decides which assignments are dropped, so it is part of the trained
    # function: a fixed number of rows, the same on any mesh (the trainer refuses a group
    # that does not divide the rows one device holds). Unused when dropless.
    moe_group_rows: int = 1
    # Dropless dispatch: each expert's assignments run in whole blocks of this many rows
    # (at most one partial block per expert; docs/engine.md).
    moe_block_rows: int = 32
    # Dropless dispatch: the batch's rows dispatch as this many independent slices, one
    # per device (the trainer sets it from the mesh) so that no token crosses devices.
    # Execution only: dropless routing gives the same numbers for any value.
    moe_shards: int = 1
    attn_block_size: int = 64
    # "auto": the forms tuned for XLA:CPU on a CPU backend, the plain formulation elsewhere;
    # "plain" or "cpu" force one (fractus_jax/kernels/select.py: kernels/plain.py or kernels/cpu.py, the same function).
    kernels: str = "auto"
    compute_dtype: str = "float32"
    remat: bool = False
    # Layers per iteration of the layer scan (n_layers: no loop at all). Unrolling lets XLA
    # keep each layer's saved activations in their own buffers instead of copying them into
    # stacked ones (on CPU, docs/performance.md); compile time grows with it.
    scan_unroll: int = 1
    # Independent row streams, a CPU schedule (leave it at 1 on a GPU): the batch runs as this
    # many row slices, each through every layer on its own, so that XLA:CPU runs them on
    # different cores at once. Only the
    # load-balance term joins them (P_e stays the mean over every token). A stream holds
    # whole MoE dispatch groups, so row_streams > 1 needs moe_group_rows set (checked
    # where the batch is known). Execution only: the numbers are one stream's with the
    # same groups. It pays with the layer loop unrolled (scan_unroll = n_layers); with
    # the loop kept, two streams ran slower than one (smoke, docs/training.md).
    row_streams: int = 1

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.n_heads * self.d_head != self.d_model:
            raise ValueError(f"n_heads*d_head = {self.n_heads}*{self.d_head} != d_model={self.d_model}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.moe_group_rows < 0:
            raise ValueError(f"moe_group_rows must be >= 0 (0: the whole batch), got {self.moe_group_rows}")
        if self.moe_block_rows < 1 or self.moe_shards < 1:
            raise ValueError(f"moe_block_rows and moe_shards must be >= 1, got {self.moe_block_rows}, "
                             f"{self.moe_shards}")
        if self.scan_unroll < 1:
            raise ValueError(f"scan_unroll must be >= 1, got {self.scan_unroll}")
        if self.row_streams < 1:
            raise ValueError(f"row_streams must be >= 1, got {self.row_streams}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be {', '.join(map(repr, KERNELS[:-1]))} or {KERNELS[-1]!r}, "
                             f"got {self.kernels!r}")
        if self.attn_block_size < 1:
            raise ValueError(f"attn_block_size must be >= 1, got {self.attn_block_size}")
        if self.compute_dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"unknown compute_dtype {self.compute_dtype!r}")

    @property
    def is_atom(self) -> bool:
        return self.variant == "atom"

    def torch_kwargs(self) -> dict[str, Any]:
        """The PyTorch reference constructor's arguments (what an export's "config" holds)."""
        names = [f.name for f in dataclasses.fields(self)]
        return {n: getattr(self, n) for n in names[: names.index("atom_feat_dim") + 1]}

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def for_inference(self, exact: bool = True) -> "EngineConfig":
        """The engine as scoring, decoding, probing and growth checks run it: a few rows on
        one device, so one row stream and one dispatch slice (execution settings: the same
        numbers), and, when exact (the default), no capacity: every token gets its top_k
        experts, the function the weights define and the PyTorch engine computes."""
        cfg = self.replace(row_streams=1, moe_shards=1)
        return cfg.replace(capacity_factor=None) if exact else cfg

    @classmethod
    def from_dict(cls, d: dict[str, Any], unknown: str = "warn", log: Optional[Callable[[str], None]] = None,
                  where: str = "config") -> "EngineConfig":
        """Build from a saved config (`field_values` says what happens to keys this version
        does not know and to fields the dict lacks). A PyTorch checkpoint's "config" carries
        keys of the PyTorch trainer and none of the JAX-side fields: read it with unknown="ignore"."""
        return cls(**field_values(cls, d, unknown, log, where))


UNKNOWN_KEYS = ("warn", "ignore", "error")


def field_values(cls, d: dict[str, Any], unknown: str = "warn", log: Optional[Callable[[str], None]] = None,
                 where: str = "config") -> dict[str, Any]:
    """The keyword arguments of dataclass `cls` held in `d`, a config saved by some version.

    A key `cls` has no field for (a field renamed or dropped since) is named: a warning
    through `log` (unknown="warn"), a ValueError ("error"), or nothing ("ignore": a foreign
    dict whose extra keys are expected). A field `d` lacks (added since) takes its default,
    named in a note through `log` (not with "ignore"); a lacking field without a default is
    a ValueError naming it. `log` defaults to printing on stderr.
    """
    if unknown not in UNKNOWN_KEYS:
        raise ValueError(f"unknown must be one of {UNKNOWN_KEYS}, got {unknown!r}")
    say = log or (lambda msg: print(msg, file=sys.stderr))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(k for k in d if k not in fields)
    if extra and unknown == "error":
        raise ValueError(f"{where} has fields this version does not know: {', '.join(extra)}")
    if extra and unknown == "warn":
        say(f"warning: {where} has fields this version does not know, ignored: {', '.join(extra)}")
    absent = [f for name, f in fields.items() if name not in d]
    required = [f.name for f in absent if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ValueError(f"{where} lacks fields this version needs: {', '.join(required)}")
    if absent and unknown != "ignore":
        defaults = [f"{f.name}={f.default if f.default is not dataclasses.MISSING else f.default_factory()!r}"
                    for f in absent]
        say(f"note: {where} predates fields of this version, which take their defaults: {', '.join(defaults)}")
    return {k: v for k, v in d.items() if k in fields}


def atom_1b(**overrides) -> EngineConfig:
    base = dict(vocab_size=ATOM_VOCAB, d_model=1280, n_layers=16, n_heads=20, d_head=64,
                n_levels=2, n_oscillators=16, coupling_rank=8, n_experts=128, top_k=2,
                expert_d_ff=2048, siren_rank=64, variant="atom")
    base.update(overrides)
    return EngineConfig(**base)


def parent_1b(**overrides) -> EngineConfig:
    base = dict(vocab_size=50257, d_model=1280, n_layers=16, n_heads=20, d_head=64,
                n_levels=2, n_oscillators=16, coupling_rank=8, n_experts=128, top_k=2,
                expert_d_ff=2048, siren_rank=64, variant="parent", bos_id=None)
    base.update(overrides)
    return EngineConfig(**base)


def tiny(**overrides) -> EngineConfig:
    """A few-thousand-parameter engine for tests: every code path, seconds to compile."""
    base = dict(vocab_size=ATOM_VOCAB, d_model=32, n_layers=2, n_heads=2, d_head=16,
                n_levels=2, n_oscillators=8, coupling_rank=4, n_experts=8, top_k=2,
                expert_d_ff=48, siren_rank=8, variant="atom", attn_block_size=8)
    base.update(overrides)
    return EngineConfig(**base)
