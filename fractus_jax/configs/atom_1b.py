"""The Atom 1B run (docs/spec.md §1): AdamW 3e-4, 800 warmup steps, bfloat16 compute, block remat."""
from fractus_jax import config
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model=config.atom_1b(compute_dtype="bfloat16", remat=True, attn_block_size=64),
        batch_size=16, seq_len=128, max_steps=200_000, optimizer="adamw", lr=3e-4,
        warmup_steps=800, ce_chunk=1024, log_every=10, save_every=1000,
        save_every_minutes=30.0, probe_every=1000,
    )
