"""The parent x8 GPT-2 run (docs/spec.md §1): SGD momentum 0.9 at 7e-4, as the older PyTorch runs."""
from fractus_jax import config
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        # Dropless MoE (the default): the parent routes a whole row by its last position,
        # so its tokens crowd a few experts, and any capacity below E/K would drop rows.
        model=config.parent_1b(),
        execution=config.Execution(compute_dtype="bfloat16", remat=True),
        batch_size=16, seq_len=128, max_steps=200_000, optimizer="sgd", lr=7e-4,
        warmup_steps=800, ce_chunk=256, log_every=10, save_every=1000,
        save_every_minutes=30.0,
        # The last 0.1% of the corpus is held out (the lanes never read it); its first 65536
        # ids, 16 lanes of 32 chunks, are scored every 1000 steps: val_ce (the carry as
        # trained), val_ce_warm, val_ce_no_carry (no bits per byte: GPT-2 ids).
        val_fraction=0.001, eval_every=1000, val_ids=65536, val_lanes=16,
        probe_every=0,
    )
