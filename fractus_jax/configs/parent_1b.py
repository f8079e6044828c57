"""The parent x8 GPT-2 run (docs/spec.md §1): SGD momentum 0.9 at 7e-4, as the older PyTorch runs."""
from fractus_jax import config
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        # Dropless MoE (the default): the parent routes a whole row by its last position,
        # so its tokens crowd a few experts, and any capacity below E/K would drop rows.
        model=config.parent_1b(compute_dtype="bfloat16", remat=True),
        batch_size=16, seq_len=128, max_steps=200_000, optimizer="sgd", lr=7e-4,
        warmup_steps=800, ce_chunk=256, log_every=10, save_every=1000,
        save_every_minutes=30.0, probe_every=0,
    )
