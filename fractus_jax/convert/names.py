"""The one declared map between JAX parameter paths and PyTorch state-dict names (docs/spec.md §2).

A JAX path is a tuple of dict keys into the parameter tree; block paths are relative to
`params["blocks"]`, whose leaves carry a leading layer axis, and their PyTorch names take the
block index `{i}`. Nothing else in the package spells a PyTorch name, save the prefix a
compiled module puts before every key (`fractus_jax.config.COMPILED_PREFIX`, which the
torch-only reference engine strips too).
"""
from __future__ import annotations

from fractus_jax.config import EngineConfig

# (JAX path, PyTorch name); the PyTorch name of block entries is "blocks.{i}." + name.
TOP_LEVEL = (
    (("observe",), "observe.weight"),
    (("confidence_head", "weight"), "confidence_head.weight"),
    (("confidence_head", "bias"), "confidence_head.bias"),
    (("salience_head", "weight"), "salience_head.weight"),
    (("salience_head", "bias"), "salience_head.bias"),
)
ATOM_TOP_LEVEL = (
    (("atom_feat", "weight"), "atom_feat.weight"),
    (("atom_feat", "bias"), "atom_feat.bias"),
)
PER_BLOCK = (
    (("attn", "w_qkv"), "attn.w_qkv"),
    (("attn", "b_qkv"), "attn.b_qkv"),
    (("attn", "w_out"), "attn.w_out"),
    (("attn", "b_out"), "attn.b_out"),
    (("attn", "level_logits"), "attn.level_logits"),
    (("attn", "level_offsets"), "attn.level_offsets"),
    (("norm_attn", "weight"), "norm_attn.weight"),
    (("norm_attn", "bias"), "norm_attn.bias"),
    (("kuramoto", "omega"), "kuramoto.omega"),
    (("kuramoto", "coupling_u"), "kuramoto.coupling_u"),
    (("kuramoto", "coupling_lambda"), "kuramoto.coupling_lambda"),
    (("norm_kur", "weight"), "norm_kur.weight"),
    (("norm_kur", "bias"), "norm_kur.bias"),
    (("moe", "U1"), "moe.U1"),
    (("moe", "V1"), "moe.V1"),
    (("moe", "U2"), "moe.U2"),
    (("moe", "V2"), "moe.V2"),
    (("moe", "scale1"), "moe.scale1"),
    (("moe", "scale2"), "moe.scale2"),
    (("moe", "b1"), "moe.b1"),
    (("moe", "b2"), "moe.b2"),
    (("moe", "expert_phases"), "moe.expert_phases"),
    (("norm_moe", "weight"), "norm_moe.weight"),
    (("norm_moe", "bias"), "norm_moe.bias"),
)
ATOM_PER_BLOCK = (
    (("kuramoto", "phase_proj", "weight"), "kuramoto.phase_proj.weight"),
    (("kuramoto", "phase_proj", "bias"), "kuramoto.phase_proj.bias"),
)
LEARNED_DECAY_PER_BLOCK = (   # EngineConfig.learn_carry_decay: γ = sigmoid(decay_logit), (L, H)
    (("attn", "decay_logit"), "attn.decay_logit"),
)
TIED_HEAD = "output_head.weight"  # the same tensor as observe.weight

# Carried state buffers (docs/spec.md §2): names and how they map to the JAX state dict.
THOUGHT = "thought_state"
LAST_LB = "last_lb_loss"
BLOCK_S, BLOCK_Z, BLOCK_PHASE = "attn_S", "attn_z", "kuramoto_phases"

# Keys of the PyTorch trainers' checkpoint "config" dicts besides the constructor's arguments.
# The trainers build the module, then set every block's `moe.temperature` to GATE_TEMP and
# save that value under GATE_TEMP; the constructor's own key is GATE_TEMPERATURE.
GATE_TEMP, GATE_TEMPERATURE = "gate_temp", "gate_temperature"
TOKENS_PROCESSED = "tokens_processed"   # ids trained on, all lanes together
# Trainer settings saved in the config dict → the TrainConfig field each one is.
TRAINER_KEYS = {"batch": "batch_size", "B": "batch_size", "seq": "seq_len", "lr": "lr", "lb_coef": "lb_coef",
                "ss_rate": "ss_rate"}


def top_level(cfg: EngineConfig):
    return TOP_LEVEL + (ATOM_TOP_LEVEL if cfg.is_atom else ())


def per_block(cfg: EngineConfig):
    return (PER_BLOCK + (ATOM_PER_BLOCK if cfg.is_atom else ())
            + (LEARNED_DECAY_PER_BLOCK if cfg.learn_carry_decay else ()))


def block_key(i: int, name: str) -> str:
    return f"blocks.{i}.{name}"


def weight_keys(cfg: EngineConfig) -> list[str]:
    """Every weight/buffer key of the state dict except the carry, tied head included."""
    keys = [name for _, name in top_level(cfg)] + [TIED_HEAD]
    keys += [block_key(i, name) for i in range(cfg.n_layers) for _, name in per_block(cfg)]
    return keys


def state_keys(cfg: EngineConfig) -> list[str]:
    keys = [THOUGHT, LAST_LB]
    for i in range(cfg.n_layers):
        keys += [block_key(i, BLOCK_S), block_key(i, BLOCK_Z), block_key(i, BLOCK_PHASE)]
    return keys
