"""``python -m fractus_jax.eval``: held-out scoring of a run's checkpoint (the command line;
the library is `fractus_jax.scoring`), and ``python -m fractus_jax.eval.bigram``."""
