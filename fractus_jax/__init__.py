"""fractus-jax: the Fractus Continuous Thought Engine in JAX."""
from fractus_jax.config import EngineConfig
from fractus_jax.model import count_params, forward_chunk, init_params, init_state

__all__ = ["EngineConfig", "count_params", "forward_chunk", "init_params", "init_state"]
