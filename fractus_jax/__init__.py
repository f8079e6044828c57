"""fractus-jax: the Fractus Continuous Thought Engine in JAX."""
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.model import count_params, forward_chunk, init_params, init_state

__all__ = ["EngineConfig", "Execution", "count_params", "forward_chunk", "init_params", "init_state"]


def __getattr__(name):
    # fractus_jax.nn (the Flax module) loads on first use: importing Flax NNX takes ~1 s,
    # which the pure API and the command-line tools do not need.
    if name == "nn":
        import importlib

        return importlib.import_module("fractus_jax.nn")
    raise AttributeError(f"module 'fractus_jax' has no attribute {name!r}")
