"""The trainer's configuration: frozen dataclasses, config files and dotted overrides.

`--config NAME` loads `NAME.py` of the shipped configs (fractus_jax/configs/; a
`configs/NAME.py` in the working directory first), or a path, whose `get_config()` returns a
TrainConfig; `--set a.b=value` replaces one field, parsed by the field's declared type.
The PyTorch trainers' environment names (BATCH, LR, ...) are accepted as override keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Optional

from fractus_jax.config import EXECUTION_FIELDS, EngineConfig, Execution, field_values, split_fields
from fractus_jax.kernels.loss import CE_BLOCK


class ConfigError(ValueError):
    """A user mistake in a config name, file or override."""


LR_SCHEDULES = ("constant", "cosine", "linear")
# What a run does around its step: where its data comes from; when it logs, evaluates,
# saves, grows or stops; its mesh (the jitted programs take their shardings as arguments).
# No function the trainer compiles reads these fields (TrainConfig.for_programs).
RUN_FIELDS = ("max_steps", "corpus", "val_fraction", "val_corpus", "eval_every", "val_ids", "val_lanes",
              "start_token", "log_every", "tensorboard", "save_every", "save_every_minutes", "keep_checkpoints",
              "max_skipped_steps", "probe_every", "deadline", "init_from", "mesh", "grow_at", "grow")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1


@dataclasses.dataclass(frozen=True)
class GrowConfig:
    """What `grow_at` adds (fractus_jax.growth.GrowthSpec's fields)."""
    add_layers: int = 0
    add_experts: int = 0
    siren_rank: Optional[int] = None  # the new expert rank; None keeps it


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: EngineConfig               # what the weights compute
    execution: Execution = Execution()  # how this run's machines compute it
    batch_size: int = 8
    seq_len: int = 128
    max_steps: int = 1000
    optimizer: str = "adamw"          # "adamw" or "sgd"
    lr: float = 3e-4
    warmup_steps: int = 800
    lr_schedule: str = "constant"     # after warmup: "constant", or "cosine" / "linear" decay to lr_floor
    lr_floor: float = 0.0             # the decay's end value (an absolute lr, <= lr)
    decay_steps: int = 0              # steps from the end of warmup to lr_floor (needed by cosine/linear)
    momentum: float = 0.9             # SGD
    b1: float = 0.9                   # AdamW
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    step_unreached: bool = False      # also step parameters the loss does not reach (decay, moments); off as in PyTorch
    accum: int = 1                    # consecutive chunks per update, the carry flowing through
    bptt_chunks: int = 1              # the gradient flows through the carry across this many of them (1: detached)
    carry_reset_every: int = 0        # every row's carry reset to the initial one on multiples of this step (0: never)
    carry_reset_prob: float = 0.0     # ... and each row's with this probability at a step's start (from seed, step)
    ce_chunk: int = CE_BLOCK          # positions per cross-entropy block
    lb_coef: float = 0.02
    repeat_coef: float = 0.0
    ss_rate: float = 0.0              # probability of a scheduled-sampling update per step
    ss_p0: float = 0.0
    ss_p1: float = 0.25
    ss_ramp: int = 64                 # positions over which ss_prob goes from p0 to p1
    ss_temperature: float = 0.9
    corpus: str = ""                  # empty: the embedded default corpus (standard library text)
    val_fraction: float = 0.0         # held out from the END of the corpus: the lanes never read it
    val_corpus: str = ""              # or a held-out id file of its own
    eval_every: int = 0               # val_ce / val_bpb every this many steps and at the last (0: off)
    val_ids: int = 4096               # the fixed held-out slice: the first val_ids ids of the held-out part
    val_lanes: int = 4                # ... read in this many lanes, chunks of seq_len, the carry flowing
    start_token: Optional[int] = None  # offset inside each lane; None: 0 fresh, the checkpoint's on resume
    seed: int = 0
    log_every: int = 10
    tensorboard: bool = True          # the metrics log's records also as event files in WORKDIR/tensorboard
    save_every: int = 1000
    save_every_minutes: float = 0.0
    keep_checkpoints: int = 3
    max_skipped_steps: int = 50       # stop with an error after this many skipped steps in a row (0: never)
    probe_every: int = 0
    deadline: str = ""                # ISO time or unix seconds: save and stop before it
    init_from: str = ""               # a run directory whose weights start a fresh run
    mesh: MeshConfig = MeshConfig()
    grow_at: int = 0                  # at this step: save, grow the body by `grow`, continue
    grow: GrowConfig = GrowConfig()

    def __post_init__(self):
        def positive(x):   # > 0 and finite (NaN fails every comparison)
            return 0.0 < x < math.inf

        def non_negative(x):
            return 0.0 <= x < math.inf

        checks = [
            (self.optimizer in ("adamw", "sgd"), f"optimizer must be adamw or sgd, got {self.optimizer!r}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}"),
            (self.max_steps >= 0, f"max_steps must be >= 0, got {self.max_steps}"),
            (positive(self.lr), f"lr must be > 0 and finite, got {self.lr}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.lr_schedule in LR_SCHEDULES,
             f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}"),
            (non_negative(self.lr_floor), f"lr_floor must be >= 0 and finite, got {self.lr_floor}"),
            (self.decay_steps >= 0, f"decay_steps must be >= 0, got {self.decay_steps}"),
            (0.0 <= self.momentum < 1.0, f"momentum must be in [0, 1), got {self.momentum}"),
            (0.0 <= self.b1 < 1.0, f"b1 must be in [0, 1), got {self.b1}"),
            (0.0 <= self.b2 < 1.0, f"b2 must be in [0, 1), got {self.b2}"),
            (positive(self.eps), f"eps must be > 0 and finite, got {self.eps}"),
            (non_negative(self.weight_decay), f"weight_decay must be >= 0 and finite, got {self.weight_decay}"),
            (positive(self.clip_norm), f"clip_norm must be > 0 and finite, got {self.clip_norm}"),
            (self.accum >= 1, f"accum must be >= 1, got {self.accum}"),
            (self.bptt_chunks >= 1, f"bptt_chunks must be >= 1 (1: the carry enters each chunk detached), "
                                    f"got {self.bptt_chunks}"),
            (self.carry_reset_every >= 0, f"carry_reset_every must be >= 0 (0: never), got {self.carry_reset_every}"),
            (0.0 <= self.carry_reset_prob <= 1.0,
             f"carry_reset_prob must be in [0, 1], got {self.carry_reset_prob}"),
            (self.ce_chunk >= 1, f"ce_chunk must be >= 1, got {self.ce_chunk}"),
            (non_negative(self.lb_coef), f"lb_coef must be >= 0 and finite, got {self.lb_coef}"),
            (non_negative(self.repeat_coef), f"repeat_coef must be >= 0 and finite, got {self.repeat_coef}"),
            (0.0 <= self.ss_rate <= 1.0, f"ss_rate must be in [0, 1], got {self.ss_rate}"),
            (0.0 <= self.ss_p0 <= 1.0, f"ss_p0 must be in [0, 1], got {self.ss_p0}"),
            (0.0 <= self.ss_p1 <= 1.0, f"ss_p1 must be in [0, 1], got {self.ss_p1}"),
            (self.ss_ramp >= 0, f"ss_ramp must be >= 0, got {self.ss_ramp}"),
            (positive(self.ss_temperature), f"ss_temperature must be > 0 and finite, got {self.ss_temperature}"),
            (self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}"),
            (self.save_every >= 1, f"save_every must be >= 1, got {self.save_every}"),
            (non_negative(self.save_every_minutes),
             f"save_every_minutes must be >= 0 and finite (0: off), got {self.save_every_minutes}"),
            (self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.probe_every >= 0, f"probe_every must be >= 0 (0: off), got {self.probe_every}"),
            (self.grow_at >= 0, f"grow_at must be >= 0 (0: off), got {self.grow_at}"),
            (0.0 <= self.val_fraction < 1.0, f"val_fraction must be in [0, 1), got {self.val_fraction}"),
            (self.eval_every >= 0, f"eval_every must be >= 0 (0: off), got {self.eval_every}"),
            (self.val_ids >= 2, f"val_ids must be >= 2, got {self.val_ids}"),
            (self.val_lanes >= 1, f"val_lanes must be >= 1, got {self.val_lanes}"),
            (self.start_token is None or self.start_token >= 0, f"start_token must be >= 0, got {self.start_token}"),
            (self.mesh.data >= 1 and self.mesh.fsdp >= 1, f"mesh sizes must be >= 1, got {self.mesh}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    def conflicts(self) -> list[str]:
        """What is wrong between fields (checked once every override is applied: a check
        in __post_init__ would make the order of --set matter)."""
        out = []
        if self.lr_schedule != "constant" and self.decay_steps < 1:
            out.append(f"lr_schedule={self.lr_schedule} needs decay_steps >= 1 (the steps from the end of "
                       "warmup to lr_floor)")
        if self.lr_floor > self.lr:
            out.append(f"lr_floor={self.lr_floor:g} is above lr={self.lr:g}")
        if self.val_fraction and self.val_corpus:
            out.append(f"set one of val_fraction ({self.val_fraction:g}) and val_corpus ({self.val_corpus!r}), "
                       "not both")
        if self.accum % self.bptt_chunks:
            out.append(f"bptt_chunks={self.bptt_chunks} needs accum to be a multiple of it (the step's accum={self.accum} "
                       f"chunks are cut into groups of bptt_chunks, the gradient flowing through the carry inside "
                       f"each): set accum={self.bptt_chunks * max(1, self.accum // self.bptt_chunks)}")
        if self.eval_every and not (self.val_fraction or self.val_corpus):
            out.append(f"eval_every={self.eval_every} scores a held-out part: set val_fraction (held out from "
                       "the end of the corpus) or val_corpus=FILE, or eval_every=0")
        return out

    def trained_window(self) -> Optional[int]:
        """accum·seq_len when every step started from the initial carry (carry_reset_every = 1
        or carry_reset_prob = 1): the function trained is then the window function of that
        many ids, the step's accum chunks read one after another from a fresh carry
        (docs/generation.md, window mode); None when the carry ran across steps."""
        return self.accum * self.seq_len if self.carry_reset_every == 1 or self.carry_reset_prob >= 1.0 else None

    def trained_decoding(self) -> tuple[str, Optional[int]]:
        """(decode mode, its window) that computes the function this run trained (decode.py):
        ("window", accum·seq_len) when every step started from the initial carry; an Atom run
        that carried its state across chunks ("chunk", seq_len): chunks of seq_len, each from
        the carry the one before left; a parent run ("step", None)."""
        window = self.trained_window()
        if window:
            return "window", window
        return ("chunk", self.seq_len) if self.model.is_atom else ("step", None)

    def for_programs(self) -> "TrainConfig":
        """This config with RUN_FIELDS at their defaults: what the train step and the state's
        initialisation are built from (train/step.py, train/state.py), so that configs apart
        only in RUN_FIELDS (a resume, a longer run, another run directory in the same
        process) share those functions and trace and compile them once."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in RUN_FIELDS}
        return dataclasses.replace(self, **defaults)

    @property
    def feats(self) -> bool:
        """Whether the step feeds packet features: the engine's `feeds_features`."""
        return self.model.feeds_features

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], unknown: str = "warn",
                  log: Optional[Callable[[str], None]] = None) -> "TrainConfig":
        """Build from a saved config (a manifest's or a checkpoint's): a key this version does
        not know is warned about (unknown="warn") or refused ("error"), a field it lacks takes
        its default with a note, a lacking required field is refused (ConfigError), each named
        (fractus_jax.config.field_values)."""
        try:
            d = dict(d)
            if "model" in d and "execution" not in d:   # written before Execution: both under "model"
                d["model"], d["execution"] = split_fields(d["model"])
            if "feats" in d:   # written before the features joined the engine's config
                feats = d.pop("feats")
                if "model" in d:
                    d["model"] = {"packet_features": feats, **d["model"]}
            d = field_values(cls, d, unknown, log)
            groups = {"model": EngineConfig, "execution": Execution, "mesh": MeshConfig, "grow": GrowConfig}
            for name, group in groups.items():
                if name in d:
                    d[name] = group(**field_values(group, d[name], unknown, log, where=f"config.{name}"))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        return cls(**d)


# Override keys that are not field paths: the PyTorch trainers' environment names, and
# short names for execution fields.
ALIASES = {
    "BATCH": "batch_size", "SEQ": "seq_len", "LR": "lr", "OPT": "optimizer",
    "WARMUP_STEPS": "warmup_steps", "SS_RATE": "ss_rate", "REPEAT_COEF": "repeat_coef",
    "SAVE_EVERY": "save_every", "START_TOKEN": "start_token", "CE_CHUNK": "ce_chunk",
    "ACCUM": "accum", "BLOCK_CKPT": "execution.remat", "PROBE_EVERY": "probe_every",
    "MAX_STEPS": "max_steps", "CKPT_IN": "init_from",
    "remat": "execution.remat", "dtype": "execution.compute_dtype",
    "feats": "model.packet_features",
}
# The execution fields' names from before they left the engine config (model.kernels, ...):
# still accepted, each with a note naming its new path.
MOVED = {f"model.{name}": f"execution.{name}" for name in EXECUTION_FIELDS}
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"   # shipped with the package


def load_config(name: str) -> TrainConfig:
    """NAME → ./configs/NAME.py or fractus_jax/configs/NAME.py (or NAME as a path) → its get_config()."""
    path = Path(name)
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")
    if path.suffix == ".py" and len(path.parts) == 1 and not path.exists():
        name = path.stem   # smoke.py: the config named smoke
        path = Path(name)
    if path.suffix == ".py" or len(path.parts) > 1:
        # A path: a file, or the name of a file that is not there (no configs/ lookup).
        if path.suffix != ".py" and path.with_suffix(".py").is_file():
            path = path.with_suffix(".py")
        if path.is_dir():
            raise ConfigError(f"--config {name}: {path} is a directory, not a config file")
        if not path.is_file():
            raise ConfigError(f"--config {name}: no such config file {path} "
                              f"(or a config name: {', '.join(known)})")
    else:
        candidates = list(dict.fromkeys([Path.cwd() / "configs" / f"{name}.py", CONFIG_DIR / f"{name}.py"]))
        path = next((p for p in candidates if p.exists()), None)
        if path is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"no config named {name!r} ({hint}looked in "
                              f"{', '.join(str(p) for p in candidates)}; known: {', '.join(known)})")
    spec = importlib.util.spec_from_file_location(f"fractus_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config()")
    cfg = module.get_config()
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not TrainConfig")
    return cfg


def _parse(value: str, annotation, key: str):
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value.lower() in ("none", "null", ""):
            return None
        return _parse(value, args[0], key)
    try:
        if annotation is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if annotation is int:
            return int(value)
        if annotation is float:
            return float(value)
        return value
    except ValueError:
        raise ConfigError(f"--set {key}={value}: expected {annotation.__name__}") from None


def _replace_path(obj, path: list[str], value: str, key: str):
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if path[0] not in fields:
        close = difflib.get_close_matches(path[0], list(fields), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--set {key}: {type(obj).__name__} has no field {path[0]!r} "
                          f"({hint}fields: {', '.join(fields)})")
    if len(path) == 1:
        field = fields[path[0]]
        hints = typing.get_type_hints(type(obj))
        return dataclasses.replace(obj, **{path[0]: _parse(value, hints.get(field.name, field.type), key)})
    child = getattr(obj, path[0])
    if not dataclasses.is_dataclass(child):
        raise ConfigError(f"--set {key}: {path[0]} is not a group of fields")
    return dataclasses.replace(obj, **{path[0]: _replace_path(child, path[1:], value, key)})


def _path(key: str, log: Optional[Callable[[str], None]] = None) -> str:
    if key in MOVED and log is not None:
        log(f"note: --set {key} is now {MOVED[key]} (how the engine is computed, apart from its weights)")
    return ALIASES.get(key) or MOVED.get(key, key)


def apply_overrides(cfg: TrainConfig, overrides: list[str], log: Optional[Callable[[str], None]] = None) -> TrainConfig:
    """Apply `key=value` overrides in order; keys are dotted field paths, ALIASES or MOVED
    names (each noted through `log`, by default on stderr)."""
    say = log or (lambda msg: print(msg, file=sys.stderr))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        path = _path(key, say)
        try:
            cfg = _replace_path(cfg, path.split("."), value.strip(), key)
        except ValueError as e:  # a __post_init__ check of the new value (or a message that names it)
            if isinstance(e, ConfigError) and str(e).startswith("--set"):
                raise
            raise ConfigError(f"--set {key}={value.strip()}: {e}") from None
    return cfg


def override_fields(overrides: list[str]) -> frozenset:
    """The dotted field paths that `key=value` overrides set (ALIASES resolved)."""
    keys = (item.split("=", 1)[0].strip() for item in overrides if "=" in item)
    return frozenset(_path(k) for k in keys)


def resolve_for_mesh(cfg: TrainConfig) -> TrainConfig:
    """The execution choices that follow from the mesh: dropless MoE dispatch runs one
    slice of rows per device (execution.moe_shards), so no token's dispatch crosses devices.
    The trained function does not change: capacity groups (model.moe_group_rows) are a
    model setting, the same on any mesh."""
    n = cfg.mesh.data * cfg.mesh.fsdp
    if cfg.execution.moe_shards != n and cfg.batch_size % n == 0:
        return dataclasses.replace(cfg, execution=cfg.execution.replace(moe_shards=n))
    return cfg


def config_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)
