"""The trainer: `python -m fractus_jax.train --config NAME --workdir DIR [--set key=value ...]`."""
