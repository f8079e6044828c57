"""The Atom 1B run (docs/spec.md §1): AdamW 3e-4, 800 warmup steps, bfloat16 compute, block remat."""
from fractus_jax import config
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        model=config.atom_1b(),
        execution=config.Execution(compute_dtype="bfloat16", remat=True),
        batch_size=16, seq_len=128, max_steps=200_000, optimizer="adamw", lr=3e-4,
        warmup_steps=800, ce_chunk=1024, log_every=10, save_every=1000,
        save_every_minutes=30.0,
        # The last 0.1% of the corpus is held out (4 M ids of a 4 B-id corpus; the lanes never
        # read it); its first 65536 ids, 16 lanes of 32 chunks, are scored every 1000 steps:
        # val_ce, val_bpb (the carry as trained), val_bpb_warm, val_bpb_no_carry.
        val_fraction=0.001, eval_every=1000, val_ids=65536, val_lanes=16,
        probe_every=1000,
    )
