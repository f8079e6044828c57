"""Tests: every code path of the trainer in seconds."""
from fractus_jax import config
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model=config.tiny(), execution=config.TINY_EXECUTION,
        batch_size=4, seq_len=16, max_steps=6, lr=3e-3, warmup_steps=2,
        ce_chunk=32, log_every=1, save_every=3, probe_every=0,
    )
