"""A small Atom model that thinks continuously, trained for 200 steps on the embedded corpus:
64 lanes read in 16-id chunks, the carry streamed along each lane and forgetting at a rate
each head learns (model.learn_carry_decay), starting from a golden-ratio ladder of horizons
(model.carry_decay, 10 and 26 ids), the gradient through it across the 4 chunks of each
step (accum = bptt_chunks = 4). Its held-out score is read with
the carry streamed along each held-out lane, as it trains; `generate` decodes it the same
way (chunks of 16 carrying the state). Figures and the study behind the recipe:
docs/training.md, "A carry that forgets"."""
from fractus_jax.config import EngineConfig, decay_ladder
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    model = EngineConfig(
        vocab_size=266, d_model=128, n_layers=2, n_heads=4, d_head=32, n_levels=2,
        n_oscillators=16, coupling_rank=8, n_experts=16, top_k=2, expert_d_ff=256,
        siren_rank=16, variant="atom", carry_decay=decay_ladder(10, 2), learn_carry_decay=True)
    return TrainConfig(
        # 64 lanes of 16 ids, 4 chunks of each a step: 4096 ids a step, drawn from 64 places
        # of the corpus (docs/notes/2026-11-30-carry-resets.md: 8 lanes read a few files' worth).
        model=model, batch_size=64, seq_len=16, accum=4, bptt_chunks=4, max_steps=200, lr=6e-3,
        warmup_steps=10, ce_chunk=512, log_every=10, save_every=100, probe_every=100,
        # The carry streams: never restarted (a BOS in the text still restarts its row).
        carry_reset_every=0,
        # The last 1% of the corpus is held out (the lanes never read it); its first 4096 ids,
        # in 4 lanes of 63 chunks, are scored at steps 100 and 200: val_ce, val_bpb (the carry
        # streamed, as trained), val_bpb_warm (the same), val_bpb_no_carry (each chunk fresh).
        val_fraction=0.01, eval_every=100, val_ids=4096, val_lanes=4,
    )
