"""Pallas GPU kernels for FORGE, each with a plain-jnp reference beside it.

This package is a leaf: it imports jax only. A kernel receives the optimizer's elementwise
update as a function argument (plus its per-step scalars) and knows nothing of optimizers,
Flax or models. The contract all of them keep is :mod:`pallas_kernels.contract`'s;
:func:`fused_dw_update_reference` is the ``"xla"`` implementation of it, :func:`fused_dw_update`
the Triton-lowered kernel (any CUDA GPU) and :mod:`pallas_kernels.mosaic` the Mosaic GPU kernel
(Hopper), imported on first use because it needs a jax with Mosaic GPU.
"""

from pallas_kernels.contract import check_quantized
from pallas_kernels.contract import skip_non_finite
from pallas_kernels.contract import zero_after
from pallas_kernels.fused_dw import TileConfig
from pallas_kernels.fused_dw import default_tile_config
from pallas_kernels.fused_dw import fused_dw_update
from pallas_kernels.numerics import store_cast
from pallas_kernels.reference import fused_dw_update_reference

__all__ = [
    "TileConfig",
    "check_quantized",
    "default_tile_config",
    "fused_dw_update",
    "fused_dw_update_reference",
    "skip_non_finite",
    "store_cast",
    "zero_after",
]
