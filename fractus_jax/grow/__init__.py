"""``python -m fractus_jax.grow``: grow a run directory into a new one (the command line and
its run-directory side, `fractus_jax.grow.run`; the engine's arrays grow in
`fractus_jax.growth`, a train state in `fractus_jax.train.growth`)."""
