"""forge-jax: FORGE (Fused On-Register Gradient Elimination) for JAX and Flax.

The backward pass of each linear layer computes its weight gradient tile by
tile in float32 registers and applies the optimizer to that tile right there,
so the full gradient never exists in device memory.

Public API:

* optimizers with optax's names, signatures and defaults: :func:`adam`,
  :func:`adamw`, :func:`nadam`, :func:`nadamw`, :func:`radam`, :func:`lion`,
  :func:`rmsprop`, :func:`adagrad`, :func:`sgd`, and :func:`adam_atan2`. Each returns a
  :class:`ForgeOptimizer`, a real ``optax.GradientTransformationExtraArgs``
  that also carries its :class:`ElementwiseRule` for the kernels. Each takes
  the pool-free stabilizers of :func:`stabilize` (``clip_prev_norm``,
  ``update_clip``, ``layer_clip``; docs/stabilizers.md).
* :func:`fused_linear_update`: one layer's weight update from ``x`` and ``dy``
  without materializing ``dW`` (backends ``"mosaic"``, ``"pallas"``,
  ``"interpret"``, ``"mosaic_interpret"``, ``"xla"``, ``"auto"``).
* :class:`Dense`: a Flax linen Dense whose backward pass updates its kernel
  and optimizer state in place; :class:`TrainState` and :func:`train_step`
  run a whole in-place training step.
* :mod:`forge_jax.nnx`: the same for Flax NNX (:class:`forge_jax.nnx.Linear`,
  :class:`forge_jax.nnx.ScannedStack`, :func:`forge_jax.nnx.train_step`).
* :class:`TensorParallel` and :func:`shard_tree`: Megatron-style tensor and
  sequence parallelism of FORGE layers on a mesh axis (docs/parallel.md).
* :class:`Precision` (``precision=`` of every optimizer): stochastic rounding
  of bfloat16 weights, bfloat16 or int8 (block-quantized, :class:`QuantMap`,
  :class:`QuantizedArray`) optimizer states.
"""

from forge_jax._checkpoint import restore_train_state
from forge_jax._checkpoint import save_train_state
from forge_jax._dense import FORGE_STATE
from forge_jax._dense import Dense
from forge_jax._dense import fused_backward
from forge_jax._dense import KernelState
from forge_jax._fused import BACKENDS
from forge_jax._fused import fused_linear_update
from forge_jax._lowp import Precision
from forge_jax._optimizers import ForgeOptimizer
from forge_jax._optimizers import adagrad
from forge_jax._optimizers import adam
from forge_jax._optimizers import adam_atan2
from forge_jax._optimizers import adamw
from forge_jax._optimizers import apply_rule
from forge_jax._optimizers import as_forge_optimizer
from forge_jax._optimizers import lion
from forge_jax._optimizers import nadam
from forge_jax._optimizers import nadamw
from forge_jax._optimizers import radam
from forge_jax._optimizers import rmsprop
from forge_jax._optimizers import sgd
from forge_jax._optimizers import stabilize
from forge_jax._parallel import TensorParallel
from forge_jax._parallel import shard_tree
from forge_jax._rules import AdagradState
from forge_jax._rules import AdamState
from forge_jax._rules import CenteredRMSPropMomentumState
from forge_jax._rules import CenteredRMSPropState
from forge_jax._rules import ElementwiseRule
from forge_jax._rules import LionState
from forge_jax._rules import RMSPropMomentumState
from forge_jax._rules import RMSPropState
from forge_jax._rules import SGDMomentumState
from forge_jax._rules import SGDState
from forge_jax._rules import StabilizedRule
from forge_jax._stack import ScannedStack, save_all_but_elementwise
from forge_jax._train import NoBackwardPassWarning
from forge_jax._train import RetraceWarning
from forge_jax._train import TrainState
from forge_jax._train import carry_grad_norm
from forge_jax._train import train_step
from pallas_kernels.numerics import QuantMap
from pallas_kernels.numerics import QuantizedArray

__version__ = "0.1.0"


def __getattr__(name):
  # forge_jax.nnx (the Flax NNX front end) loads on first use: Linen users do not pay for
  # importing flax.nnx.
  if name == "nnx":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("forge_jax.nnx")
  raise AttributeError(f"module 'forge_jax' has no attribute {name!r}")

__all__ = [
    "BACKENDS",
    "Dense",
    "FORGE_STATE",
    "KernelState",
    "AdagradState",
    "AdamState",
    "CenteredRMSPropMomentumState",
    "CenteredRMSPropState",
    "ElementwiseRule",
    "ForgeOptimizer",
    "LionState",
    "NoBackwardPassWarning",
    "RetraceWarning",
    "Precision",
    "QuantMap",
    "QuantizedArray",
    "RMSPropMomentumState",
    "RMSPropState",
    "SGDMomentumState",
    "SGDState",
    "StabilizedRule",
    "ScannedStack",
    "TensorParallel",
    "TrainState",
    "adagrad",
    "adam",
    "adam_atan2",
    "adamw",
    "apply_rule",
    "carry_grad_norm",
    "as_forge_optimizer",
    "fused_backward",
    "fused_linear_update",
    "lion",
    "nadam",
    "nadamw",
    "radam",
    "restore_train_state",
    "rmsprop",
    "save_all_but_elementwise",
    "save_train_state",
    "sgd",
    "shard_tree",
    "stabilize",
    "train_step",
]
