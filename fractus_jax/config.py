"""The engine's configuration, two frozen dataclasses, hashable so they can be static jit arguments.

EngineConfig is what the weights compute. Its field names up to ``atom_feat_dim`` are the
PyTorch reference constructor's arguments (``fractus_jax.reference.FractusEngine(**cfg.torch_kwargs())``);
the two after them are the capacity routing the JAX side adds. Execution is how a machine
computes that function (kernels, dtype, remat, block sizes, schedules): a run may change it
when it resumes, and an export does not carry it.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

from fractus_jax.atom import ids as atom_ids
from fractus_jax.kernels.select import KERNELS
from fractus_jax.kernels.select import resolved as resolved_kernels

VARIANTS = ("atom", "parent")
# The EngineConfig fields that decide what the weights are (their shapes and meaning): a
# resumed or imported run must keep them. The others are constants of the function those
# weights compute (and Execution's fields only choose how it is computed).
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
    # ---- Capacity routing (the JAX side's one addition to the function; docs/spec.md §3.3) ----
    # None (dropless): every token gets its top_k experts, the PyTorch engine's function.
    # A number: each expert takes at most ceil(cf·T·K/E) assignments of a dispatch group
    # of T tokens, and the rest are dropped.
    capacity_factor: Optional[float] = None
    # Rows per capacity group; 0 makes the whole batch one group. With a capacity factor
    # the group decides which assignments are dropped, so it is part of the trained
    # function: a fixed number of rows, the same on any mesh (the trainer refuses a group
    # that does not divide the rows one device holds). Unused when dropless.
    moe_group_rows: int = 1
    # ---- A carry that forgets (opt-in; docs/spec.md §3.1) ----
    # None: the parent's recurrence S_t = S_{t-1} + φ(k_t)⊗v_t, an unbounded running sum.
    # A tuple of one γ_l in (0, 1] per attention level: S_t = γ_l·S_{t-1} + φ_l(k_t)⊗v_t (z
    # likewise), so level l's state is stationary past a horizon of about 1/(1−γ_l) ids.
    # `decay_ladder` gives the golden-ratio ladder of horizons. The PyTorch trainers' engine
    # does not compute it (an export says so); the reference engine does.
    carry_decay: Optional[tuple[float, ...]] = None
    # False: carry_decay is a constant of the function. True: carry_decay is where a weight
    # starts, every block learns γ = sigmoid(attn.decay_logit) per level and head (an
    # (n_levels, n_heads) weight, docs/spec.md §2), and carry_decay must be set, each γ < 1.
    learn_carry_decay: bool = False
    # ---- The engine's input (Atom) ----
    # True: the forward receives the 320-d packet features (fractus_jax.atom.features) at
    # boundary ids, computed from each chunk and the FEATURE_CONTEXT ids before it, by the
    # loader in training and by every reader of the weights (held-out scoring, decoding,
    # the probes). False: no features (atom_feat is then never reached). Atom engines only.
    packet_features: bool = False

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
        if self.carry_decay is not None:
            # A saved config gives a list, --set a string "0.9,0.96": kept as a tuple of floats (hashable).
            raw = self.carry_decay
            try:
                decay = tuple(float(g) for g in (raw.split(",") if isinstance(raw, str) else raw))
            except (TypeError, ValueError):
                raise ValueError(f"carry_decay must be one number per attention level, got {raw!r}") from None
            if len(decay) != self.n_levels:
                raise ValueError(f"carry_decay has {len(decay)} values, the engine {self.n_levels} attention "
                                 f"levels (n_levels): give one γ per level, e.g. "
                                 f"{','.join(f'{g:.4g}' for g in decay_ladder(16, self.n_levels))}")
            bad = [g for g in decay if not 0.0 < g <= 1.0]
            if bad:
                raise ValueError(f"carry_decay values must be in (0, 1] (1: no decay), got {bad[0]!r}")
            object.__setattr__(self, "carry_decay", decay)
        if self.learn_carry_decay:
            if self.carry_decay is None:
                raise ValueError("learn_carry_decay needs carry_decay, the γ each level's weight starts at, e.g. "
                                 f"carry_decay={','.join(f'{g:.4g}' for g in decay_ladder(16, self.n_levels))}")
            if max(self.carry_decay) >= 1.0:
                raise ValueError(f"learn_carry_decay: a learned γ = sigmoid(decay_logit) stays below 1, so "
                                 f"carry_decay must start below 1, got {max(self.carry_decay)!r}")

    @property
    def is_atom(self) -> bool:
        return self.variant == "atom"

    @property
    def feeds_features(self) -> bool:
        """Whether the forward receives packet features (packet_features, Atom engines)."""
        return self.packet_features and self.is_atom

    def torch_kwargs(self) -> dict[str, Any]:
        """The PyTorch reference constructor's arguments (what an export's "config" holds):
        the PyTorch trainers' engine's, and carry_decay (with learn_carry_decay when learned)
        when set (the reference engine computes it; the trainers' engine does not know it)."""
        names = [f.name for f in dataclasses.fields(self)]
        out = {n: getattr(self, n) for n in names[: names.index("atom_feat_dim") + 1]}
        if self.carry_decay is not None:
            out["carry_decay"] = list(self.carry_decay)
        if self.learn_carry_decay:
            out["learn_carry_decay"] = True
        return out

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def for_inference(self, exact: bool = True) -> "EngineConfig":
        """The function scoring, decoding, probing and growth checks compute: when exact (the
        default), with no capacity, so every token gets its top_k experts, the function the
        weights define and the PyTorch engine computes; otherwise as trained."""
        return self.replace(capacity_factor=None) if exact else self

    @classmethod
    def from_dict(cls, d: dict[str, Any], unknown: str = "warn", log: Optional[Callable[[str], None]] = None,
                  where: str = "config") -> "EngineConfig":
        """Build from a saved config (`field_values` says what happens to keys this version
        does not know and to fields the dict lacks). A PyTorch checkpoint's "config" carries
        keys of the PyTorch trainer and none of the JAX-side fields: read it with unknown="ignore"."""
        return cls(**field_values(cls, d, unknown, log, where))


def decay_ladder(horizon: float, n_levels: int) -> tuple[float, ...]:
    """EngineConfig.carry_decay as a golden-ratio ladder: level l forgets over a horizon of
    horizon·φ^(2l) ids (γ_l = 1 − 1/horizon_l), the levels' feature offsets' ratio (φ^-2l)
    turned into time scales."""
    if horizon < 1:
        raise ValueError(f"a decay horizon is at least 1 id, got {horizon!r}")
    golden = (1.0 + 5.0 ** 0.5) / 2.0
    return tuple(1.0 - 1.0 / (horizon * golden ** (2 * l)) for l in range(n_levels))


COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a machine computes an EngineConfig's function: none of these changes the weights
    or what they compute (up to the rounding of compute_dtype), so a run may change any of
    them when it resumes, and an export does not carry them."""
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
    # different cores at once. Only the load-balance term joins them (P_e stays the mean over
    # every token). A stream holds whole MoE dispatch groups, so row_streams > 1 needs
    # moe_group_rows set (checked where the batch is known). The numbers are one stream's
    # with the same groups. It pays with the layer loop unrolled (scan_unroll = n_layers);
    # with the loop kept, two streams ran slower than one (smoke, docs/training.md).
    row_streams: int = 1
    # Dropless dispatch: the batch's rows dispatch as this many independent slices, one
    # per device (the trainer sets it from the mesh) so that no token crosses devices.
    # Dropless routing gives the same numbers for any value.
    moe_shards: int = 1
    # Dropless dispatch: each expert's assignments run in whole blocks of this many rows
    # (at most one partial block per expert; docs/engine.md).
    moe_block_rows: int = 32
    attn_block_size: int = 64

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be {', '.join(map(repr, KERNELS[:-1]))} or {KERNELS[-1]!r}, "
                             f"got {self.kernels!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        for name in ("scan_unroll", "row_streams", "moe_shards", "moe_block_rows", "attn_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def replace(self, **changes) -> "Execution":
        return dataclasses.replace(self, **changes)

    def for_platform(self, platform: str) -> "Execution":
        """These settings with "auto" kernels resolved for `platform` (the platform a program
        is lowered for, "cpu", "cuda", "tpu", ...), not for this process's backend."""
        return self.replace(kernels=resolved_kernels(self.kernels, platform))

    def for_inference(self) -> "Execution":
        """As scoring, decoding, probing and growth checks run: a few rows on one device, so
        one row stream and one dispatch slice (the same numbers as any other count)."""
        return self.replace(row_streams=1, moe_shards=1)


EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(Execution))


def split_fields(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A saved engine dict as (weight fields, execution fields): run directories written
    before Execution existed keep both kinds under "model"."""
    return ({k: v for k, v in d.items() if k not in EXECUTION_FIELDS},
            {k: v for k, v in d.items() if k in EXECUTION_FIELDS})


UNKNOWN_KEYS = ("warn", "ignore", "error")
# Fields added after run directories were written whose default is the function those runs
# computed: a saved config that lacks one takes its default without a note.
SAME_FUNCTION_DEFAULTS = ("carry_decay", "learn_carry_decay", "packet_features")


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
    absent = [f for f in absent if f.name not in SAME_FUNCTION_DEFAULTS]
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
                expert_d_ff=48, siren_rank=8, variant="atom")
    base.update(overrides)
    return EngineConfig(**base)


# The tiny engine's execution in tests and in the tiny run config: attention blocks of 8
# positions, so that a chunk of a few dozen spans several.
TINY_EXECUTION = Execution(attn_block_size=8)
