"""``forge_jax.nnx.Linear``: a ``flax.nnx.Linear`` whose backward pass updates its kernel.

The layer binds the same custom VJP as the Linen :class:`forge_jax.Dense`
(:func:`forge_jax._dense.forge_matmul`): the backward pass computes ``dX``,
then the fused update writes the new kernel and optimizer state, and returns
them where autodiff expects the gradients. The kernel's optimizer state is an
:class:`OptState` variable of the layer (``kernel_opt``), so
``nnx.state(model, forge_jax.nnx.OptState)`` selects every FORGE state for
saving or sharding. :func:`forge_jax.nnx.train_step` overwrites kernels and
states with those cotangents.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import dtypes as flax_dtypes

from forge_jax import _dense
from forge_jax import _optimizers

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

# A Linear that train_step has not named (a plain call, or nnx.grad outside it) names itself so
# in errors.
_UNNAMED = ("(a forge_jax.nnx.Linear outside forge_jax.nnx.train_step)",)


class OptState(nnx.Variable):
  """The optimizer state of one FORGE kernel: a :class:`forge_jax.KernelState`.

  ``opt`` is ``optimizer.init(kernel)``; ``grad_sq_norm`` is a float32 scalar
  whose cotangent carries the step's ``sum(dW**2)`` (the stored value is
  unused). Inside a :class:`forge_jax.nnx.ScannedStack` every leaf has the
  stack's leading layer axis.
  """


def _value(variable):
  return variable.get_value()


class Linear(nnx.Module):
  """A linear layer trained by FORGE, with the attributes of ``flax.nnx.Linear``.

  Args:
    in_features: the number of input features.
    out_features: the number of output features.
    use_bias: whether to add a bias (trained by the optimizer's optax form).
    dtype: the dtype of the computation (default: inferred from inputs and params).
    param_dtype: the dtype of the parameters.
    precision: numerical precision of the forward and ``dX`` matmuls.
    kernel_init: initializer of the ``[in_features, out_features]`` kernel.
    bias_init: initializer of the bias.
    rngs: the :class:`flax.nnx.Rngs` the initializers draw from (``rngs.params()``).
    optimizer: the forge_jax optimizer the kernel is trained with; the one
      given to :class:`forge_jax.nnx.Optimizer`.
    decay: apply the optimizer's weight decay to the kernel.
    backend: the fused-update backend (see :func:`forge_jax.fused_linear_update`).
    tile_config: the kernel's tile configuration (``None``: per-shape default).

  Variables: ``kernel`` and ``bias`` (:class:`flax.nnx.Param`, as in
  ``nnx.Linear``) and ``kernel_opt`` (:class:`OptState`).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      use_bias: bool = True,
      dtype: Optional[Any] = None,
      param_dtype: Any = jnp.float32,
      precision: Any = None,
      kernel_init: Callable = default_kernel_init,
      bias_init: Callable = default_bias_init,
      rngs: nnx.Rngs,
      optimizer: Optional[_optimizers.ForgeOptimizer] = None,
      decay: bool = True,
      backend: str = "auto",
      tile_config: Any = None,
  ):
    if optimizer is None:
      raise ValueError(
          "forge_jax.nnx.Linear needs `optimizer=` (the forge_jax optimizer that trains its "
          "kernel, e.g. forge_jax.adamw(1e-3)); use flax.nnx.Linear for a plain layer.")
    optimizer = _optimizers.as_forge_optimizer(optimizer)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
    else:
      self.bias = nnx.data(None)
    self.kernel_opt = OptState(_dense.init_kernel_state(optimizer, self.kernel.get_value()))
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.optimizer = optimizer
    self.decay = decay
    self.backend = backend
    self.tile_config = tile_config
    # The module path (set by train_step on its copy of the model): names the layer in errors,
    # seeds its stochastic-rounding stream, and lets train_step check it is updated once.
    self.forge_path = _UNNAMED

  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel, kstate = _value(self.kernel), _value(self.kernel_opt)
    bias = _value(self.bias) if self.bias is not None else None
    stacked = isinstance(kernel, _dense.StackSlice)
    if stacked != isinstance(kstate, _dense.StackSlice):
      raise ValueError(
          f"forge_jax.nnx.Linear {'/'.join(self.forge_path)}: its kernel and kernel_opt must be "
          "stacked together (a forge_jax.nnx.ScannedStack hands both as slices of the stack).")
    ref = kernel.stack if stacked else kernel
    dtype = flax_dtypes.canonicalize_dtype(inputs, ref, bias, dtype=self.dtype)
    inputs = jnp.asarray(inputs, dtype)
    static = (self.optimizer, dtype, self.precision, self.backend, self.decay, self.tile_config,
              tuple(self.forge_path))
    if stacked:
      y = _dense.forge_matmul_stacked(*static, inputs, kernel.stack, kstate.stack, kernel.layer)
    else:
      y = _dense.forge_matmul(*static, inputs, kernel, kstate)
    if bias is not None:
      y = y + jnp.reshape(bias.astype(dtype), (1,) * (y.ndim - 1) + (-1,))
    return y
