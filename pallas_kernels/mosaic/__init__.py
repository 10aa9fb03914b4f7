"""The fused ``dW`` + optimizer update for Hopper GPUs, lowered through Mosaic GPU.

``config``: the tiling and its one table of defaults (shapes and dtypes only); ``rule_eval``: the
optimizer rule evaluated so that Mosaic GPU can lower it; ``kernel``: the kernel and its wrapper.
``stacked_matmul`` is the GEMM of scanned stacks; ``common`` holds what both kernels use;
``parallel_compile`` compiles a lowered computation's Mosaic GPU kernels on a thread pool while
XLA compiles the rest (on from this import, on a GPU backend).
"""

from pallas_kernels.mosaic.config import (MosaicTileConfig, default_config, select_config,
                                          supports)
from pallas_kernels.mosaic.kernel import fused_dw_update_mosaic
from pallas_kernels.mosaic import parallel_compile

parallel_compile.install()

__all__ = ["MosaicTileConfig", "default_config", "fused_dw_update_mosaic", "select_config",
           "supports"]
