"""The fused ``dW`` + optimizer update for Hopper GPUs, lowered through Mosaic GPU.

``config`` holds the tiling and its one table of defaults (shapes and dtypes only);
``rule_eval`` evaluates the optimizer rule so that Mosaic GPU can lower it; ``kernel`` is the
kernel and its wrapper.
"""

from pallas_kernels.mosaic.config import MosaicTileConfig
from pallas_kernels.mosaic.config import default_config
from pallas_kernels.mosaic.config import interpreter_problem
from pallas_kernels.mosaic.config import select_config
from pallas_kernels.mosaic.config import supports
from pallas_kernels.mosaic.kernel import fused_dw_update_mosaic

__all__ = [
    "MosaicTileConfig",
    "default_config",
    "fused_dw_update_mosaic",
    "interpreter_problem",
    "select_config",
    "supports",
]
