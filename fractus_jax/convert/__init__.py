"""The converter between a run and PyTorch files (docs/convert.md): state dicts
(`state_dicts`, the names in `names`), file formats (`files`), optimizer state (`optim`), run
directories (`run`), and the command line ``python -m fractus_jax.convert``.

The state-dict functions stay reachable here, as the public engine API names them
(README.md): `fractus_jax.convert.params_from_torch` and the rest."""
from fractus_jax.convert.state_dicts import (ConversionError, params_from_torch, params_to_torch,
                                             state_from_torch, state_to_torch)

__all__ = ["ConversionError", "params_from_torch", "params_to_torch", "state_from_torch", "state_to_torch"]
