"""The benchmark config of `bench train` and `bench profile` (docs/performance.md): small enough
for 2 CPU cores, every kernel exercised."""
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
    model = EngineConfig(
        vocab_size=266, d_model=256, n_layers=4, n_heads=4, d_head=64, n_levels=2,
        n_oscillators=16, coupling_rank=8, n_experts=16, top_k=2, expert_d_ff=512,
        siren_rank=32, variant="atom")   # dropless MoE (the default)
    # Two independent row streams of 4 rows (as two data-parallel devices would have):
    # XLA:CPU runs them on both cores at once.
    execution = Execution(scan_unroll=4, row_streams=2)
    return TrainConfig(
        model=model, execution=execution, batch_size=8, seq_len=128, optimizer="sgd", lr=7e-4, momentum=0.9,
        warmup_steps=0, lb_coef=0.02, max_steps=100, log_every=10, save_every=10**9,
    )
