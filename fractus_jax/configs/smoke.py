"""A small Atom model trained for 100 steps on the embedded corpus, each step's chunk read
from a fresh carry (carry_reset_every=1): about 1.5 minutes on 2 CPU cores, about 45 s of it
compiling the step (measured: `time python -m fractus_jax.train --config smoke --workdir
/tmp/smoke_run`, a fresh workdir). Its held-out score is in docs/training.md ("Carry
resets and the held-out score"): the reset and lr 6e-3 took it from 8.6 to about 3.9 bits
per byte; a bigram count model of the training ids scores 3.5."""
from fractus_jax.config import EngineConfig
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    model = EngineConfig(
        vocab_size=266, d_model=128, n_layers=2, n_heads=4, d_head=32, n_levels=2,
        n_oscillators=16, coupling_rank=8, n_experts=16, top_k=2, expert_d_ff=256,
        siren_rank=16, variant="atom", attn_block_size=64)
    return TrainConfig(
        model=model, batch_size=8, seq_len=128, max_steps=100, lr=6e-3, warmup_steps=10,
        ce_chunk=512, log_every=5, save_every=50, probe_every=50,
        # Every step starts its chunk from the initial carry: trained on its own lanes'
        # ever-longer carry, the model scored 8.6 bits per byte held out (docs/training.md).
        carry_reset_every=1,
        # The last 1% of the corpus is held out (the lanes never read it); its first 4096 ids,
        # in 4 lanes of 7 chunks, are scored at steps 50 and 100: val_ce, val_bpb.
        val_fraction=0.01, eval_every=50, val_ids=4096, val_lanes=4,
    )
