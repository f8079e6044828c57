"""A small Atom model whose CE falls from 5.6 to about 3 in 60 steps: about 1.5 minutes on
2 CPU cores, about 45 s of it compiling the step (measured: `time python -m
fractus_jax.train --config smoke --workdir /tmp/smoke_run`, a fresh workdir)."""
from fractus_jax.config import EngineConfig
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    model = EngineConfig(
        vocab_size=266, d_model=128, n_layers=2, n_heads=4, d_head=32, n_levels=2,
        n_oscillators=16, coupling_rank=8, n_experts=16, top_k=2, expert_d_ff=256,
        siren_rank=16, variant="atom", attn_block_size=64)
    return TrainConfig(
        model=model, batch_size=8, seq_len=128, max_steps=60, lr=3e-3, warmup_steps=10,
        ce_chunk=512, log_every=5, save_every=30, probe_every=30,
        # The last 1% of the corpus is held out (the lanes never read it); its first 4096 ids,
        # in 4 lanes of 7 chunks, are scored at steps 30 and 60: val_ce, val_bpb.
        val_fraction=0.01, eval_every=30, val_ids=4096, val_lanes=4,
    )
