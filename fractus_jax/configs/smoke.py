"""A small Atom model trained for 200 steps on the embedded corpus: 64 lanes read in
16-id chunks, each step's chunk from a fresh carry (carry_reset_every=1). About 40 s
on 2 CPU cores, about 15 s of it compiling the step (measured: `time python -m
fractus_jax.train --config smoke --workdir /tmp/smoke_run`, a fresh workdir). Scored as it
trains, each chunk from a fresh carry, its held-out score (val_bpb 3.28 bits per byte)
beats a bigram count model of the whole training text (3.53); with the carry streamed
along a lane (val_bpb_warm 4.28) it does not (docs/training.md, "Carry resets and the
held-out score")."""
from fractus_jax.config import EngineConfig
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    model = EngineConfig(
        vocab_size=266, d_model=128, n_layers=2, n_heads=4, d_head=32, n_levels=2,
        n_oscillators=16, coupling_rank=8, n_experts=16, top_k=2, expert_d_ff=256,
        siren_rank=16, variant="atom")
    return TrainConfig(
        # 64 lanes of 16 ids: the same 1024 ids a step as 8 lanes of 128, drawn from 64 places
        # of the corpus instead of 8 (docs/training.md: 8 lanes read a few files' worth).
        model=model, batch_size=64, seq_len=16, max_steps=200, lr=6e-3, warmup_steps=10,
        ce_chunk=512, log_every=10, save_every=100, probe_every=100,
        # Every step starts its chunk from the initial carry: trained on its own lanes'
        # ever-longer carry, the model scored 7.7 bits per byte held out (docs/training.md).
        carry_reset_every=1,
        # The last 1% of the corpus is held out (the lanes never read it); its first 4096 ids,
        # in 4 lanes of 63 chunks, are scored at steps 100 and 200: val_ce, val_bpb (as trained),
        # val_bpb_warm, val_bpb_no_carry.
        val_fraction=0.01, eval_every=100, val_ids=4096, val_lanes=4,
    )
