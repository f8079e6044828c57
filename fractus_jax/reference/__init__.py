"""The PyTorch reference engine (imported only where torch is installed)."""
import torch  # noqa: F401  (this subpackage requires torch)

from fractus_jax.reference.engine import FractusEngine
from fractus_jax.reference.functional import (einsum_attention, farey_phases, farey_sequence,
                                              level_offsets, loop_attention)

__all__ = ["FractusEngine", "farey_phases", "farey_sequence", "level_offsets",
           "einsum_attention", "loop_attention"]
