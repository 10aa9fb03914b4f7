"""Pallas GPU kernels for FORGE, each with a plain-jnp reference beside it.

This package is a leaf: it imports jax only. A kernel receives the optimizer's
elementwise update as a function argument (plus its per-step scalars) and
knows nothing of optimizers, Flax or models.
"""

from pallas_kernels.fused_dw import TileConfig
from pallas_kernels.fused_dw import default_tile_config
from pallas_kernels.fused_dw import fused_dw_update
from pallas_kernels.fused_dw import fused_dw_update_reference
from pallas_kernels.numerics import store_cast

__all__ = [
    "TileConfig",
    "default_tile_config",
    "fused_dw_update",
    "fused_dw_update_reference",
    "store_cast",
]
