"""The shipped training configs: `--config NAME` loads NAME.py of this folder (each file's
`get_config()` returns a TrainConfig; fractus_jax.train.config.load_config)."""
