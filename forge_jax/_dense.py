"""``forge_jax.Dense``: a Flax linen Dense whose backward pass updates its kernel.

Forward: an ordinary matmul. Backward (``jax.custom_vjp``): ``dX = dY @ W.T``
with the old weight, then :func:`forge_jax.fused_linear_update` computes the
weight gradient tile by tile and applies the optimizer to each tile, in place.
The update waits for ``dX`` (it overwrites the weight ``dX`` reads), and the
layers below an unstacked layer wait for its update, so that ``dY`` dies there
(for an LM head, the loss's gradient over the vocabulary); a scanned stack's
layer ends each iteration with both.

How the new weight leaves the backward pass ("overwrite with gradient", as in
``flax.linen.fp8_ops``): the cotangent that autodiff returns for a FORGE
kernel *is the new kernel*, and the cotangent of the layer's entry in the
``"forge_state"`` collection is its new optimizer state (plus the squared norm
of the gradient it consumed). No gradient-sized buffer exists at any point;
:func:`forge_jax.train_step` knows which entries to overwrite instead of
handing them to optax. A plain ``jax.grad`` with respect to FORGE kernels
would therefore return *new weights*, not gradients: it raises outside
``train_step``. With respect to the inputs alone (the kernels constants of
the differentiation) the backward pass is an ordinary Dense's: only ``dX``.
Each backward pass marks its ``dy`` with its module path
(:mod:`forge_jax._reuse`), so that ``train_step`` can check in the step's
jaxpr that every kernel is updated exactly once.

Without a ``"forge_state"`` collection (e.g. ``model.apply({"params": p}, x)``
for evaluation) the layer is an ordinary ``nn.Dense``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import zlib
from typing import Any, Callable, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
from flax import traverse_util
from flax import struct
from flax.core import meta as flax_meta
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as flax_dtypes
from jax.custom_derivatives import CustomVJPPrimal as _CustomVJPPrimal
from jax.custom_derivatives import SymbolicZero as _SymbolicZero

from forge_jax import _fused
from forge_jax import _optimizers
from forge_jax import _parallel
from forge_jax import _reuse

FORGE_STATE = "forge_state"

default_kernel_init = nn.initializers.lecun_normal()


class KernelState(NamedTuple):
  """What the ``"forge_state"`` collection holds for one FORGE kernel.

  Attributes:
    opt: the optimizer state of the kernel (``optimizer.init(kernel)``).
    grad_sq_norm: float32 scalar; its cotangent is ``sum(dW**2)`` of the step,
      accumulated inside the kernel (the stored value itself is unused).
  """

  opt: Any
  grad_sq_norm: jax.Array


class StackSlice(struct.PyTreeNode, flax_meta.AxisMetadata):
  """Layer ``layer`` of a stacked variable, handed to a block by ScannedStack.

  Reading it as a normal variable (``unbox``) gives the slice. A FORGE Dense
  that finds one updates the layer *inside the stacked buffer* (the kernel
  takes the stack and the layer index), so a scanned stack is updated in
  place without slicing copies.
  """

  stack: Any
  layer: jax.Array

  def unbox(self):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False), self.stack)

  def replace_boxed(self, val):
    raise NotImplementedError("a StackSlice is read-only")

  def add_axis(self, index, params):
    return self

  def remove_axis(self, index, params):
    return self


def unfreeze(tree):
  """A plain dict for a flax FrozenDict (anything else as is)."""
  return flax.core.unfreeze(tree) if isinstance(tree, flax.core.FrozenDict) else tree


def flat_variables(tree) -> dict:
  """``{path tuple: leaf}`` of a (possibly frozen) variable dict."""
  return traverse_util.flatten_dict(unfreeze(tree))


def init_kernel_state(optimizer, kernel) -> KernelState:
  return KernelState(optimizer.init(kernel), jnp.zeros((), jnp.float32))


_FUSED_BACKWARD = contextvars.ContextVar("forge_fused_backward", default=False)
# Within fused_backward(): the kernels whose backward pass was traced, as
# kernel_stream(full module path) of the forge_jax.Dense (inside a ScannedStack
# too: see _PATH_PREFIX).
_UPDATED: contextvars.ContextVar = contextvars.ContextVar("forge_updated", default=None)
# Within fused_backward(apply=...): a traced bool; where it is False every FORGE update is
# skipped and the weight and state come back bit for bit (train_step's non-finite guard). Or
# _reuse.DEFERRED: each layer binds a placeholder that train_step substitutes.
_APPLY: contextvars.ContextVar = contextvars.ContextVar("forge_apply", default=None)


# The module path of the block a ScannedStack is applying (its layers have
# paths relative to the block): prefixed to its layers' paths, so that every
# FORGE kernel's stream is the hash of its full path.
_PATH_PREFIX: contextvars.ContextVar = contextvars.ContextVar("forge_path_prefix", default=())


def kernel_stream(path) -> int:
  """A forge_jax.Dense's stochastic-rounding stream: a hash of its module path."""
  return zlib.crc32("/".join(path).encode())


@contextlib.contextmanager
def path_prefix(prefix: tuple):
  """Within it, forge_jax.Dense layers take their streams from ``prefix`` + their paths."""
  token = _PATH_PREFIX.set(tuple(prefix))
  try:
    yield
  finally:
    _PATH_PREFIX.reset(token)


def _mark_updated(key) -> None:
  updated = _UPDATED.get()
  if updated is not None:
    updated.add(key)


_EXPECTED_OPTIMIZER: contextvars.ContextVar = contextvars.ContextVar("forge_optimizer", default=None)


@contextlib.contextmanager
def fused_backward(optimizer=None, apply=None):
  """Allows the backward pass of FORGE layers to be traced in this scope.

  :func:`forge_jax.train_step` opens it around its VJP. A FORGE layer's
  backward pass *overwrites* its weight and returns the new weight where
  autodiff expects a gradient, so a plain ``jax.grad`` of a loss through FORGE
  layers, gradient accumulation over micro-batches, or an all-reduce of the
  returned "gradients" would silently compute nonsense; outside this scope the
  backward pass raises instead. Open it yourself only in a custom training
  step that overwrites FORGE kernels with their cotangents exactly once.

  With ``optimizer`` (the one that updates the other parameters and advances
  the FORGE counts), a FORGE layer built with a different rule or precision
  raises. With ``apply`` (a boolean scalar, traced or not), each FORGE update
  runs only where it is true; otherwise the layer returns its weight and state
  unchanged. Yields the set of the layers whose backward pass ran, as
  :func:`kernel_stream` of their module paths.
  """
  token = _FUSED_BACKWARD.set(True)
  token_apply = _APPLY.set(apply)
  updated = set()
  token_updated = _UPDATED.set(updated)
  token_opt = _EXPECTED_OPTIMIZER.set(optimizer)
  try:
    yield updated
  finally:
    _EXPECTED_OPTIMIZER.reset(token_opt)
    _UPDATED.reset(token_updated)
    _APPLY.reset(token_apply)
    _FUSED_BACKWARD.reset(token)


@contextlib.contextmanager
def apply_bound_here():
  """Within it, FORGE layers take the flag of the enclosing ``fused_backward(apply=...)`` as
  bound on entry: a ScannedStack's backward pass binds train_step's placeholder for it once,
  outside its loop over the layers (train_step replaces it there; one in the
  loop's body would not be replaced)."""
  apply = _APPLY.get()
  token_guarded = _GUARDED.set(apply is _reuse.DEFERRED or _GUARDED.get())
  token = _APPLY.set(_reuse.apply_flag(apply))
  try:
    yield
  finally:
    _APPLY.reset(token)
    _GUARDED.reset(token_guarded)


# Within apply_bound_here() under train_step's placeholder: the layers' flag is that
# placeholder's value.
_GUARDED: contextvars.ContextVar = contextvars.ContextVar("forge_guarded", default=False)


def _layer_apply():
  """The flag a FORGE layer's update takes, and whether it is train_step's placeholder (or its
  value): a backward pass jax caches and reuses in a later step is then still guarded there."""
  apply = _APPLY.get()
  return _reuse.apply_flag(apply), apply is _reuse.DEFERRED or _GUARDED.get()


# The steps at which two schedules (functions of the step count, equal only to themselves as
# objects) are compared: 0 to 2**31 - 1, about six per decade.
_SCHEDULE_STEPS = tuple(sorted({0, 2**31 - 1} | {int(round(10 ** (e / 6))) for e in range(0, 56)}))


@functools.lru_cache(maxsize=256)
def _schedule_mismatch(a, b) -> Optional[str]:
  """Where hyperparameters ``a`` and ``b`` (numbers or schedules) differ, or None. Schedules are
  compared by their float32 values at :data:`_SCHEDULE_STEPS`."""
  with jax.ensure_compile_time_eval():  # concrete values, also while a step is traced
    for step in _SCHEDULE_STEPS:
      count = jnp.int32(step)
      va, vb = (np.float32(v(count) if callable(v) else v) for v in (a, b))
      if va.tobytes() != vb.tobytes():
        return f"at step {step}: {float(va):.7g} against {float(vb):.7g}"
  return None


def _rule_mismatch(a, b) -> Optional[str]:
  """How rule ``b`` differs from rule ``a``, or None where they are equal (schedules compared by
  value, :func:`_schedule_mismatch`)."""
  if type(a) is not type(b):
    return f"{type(a).__name__} against {type(b).__name__}"
  if not dataclasses.is_dataclass(a):
    return None if a == b else f"{a} against {b}"
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if callable(x) or callable(y):
      why = None if x is y else _schedule_mismatch(x, y)
      if why:
        return f"{f.name} differs {why}"
    elif x != y:
      why = _rule_mismatch(x, y) if dataclasses.is_dataclass(x) else f"{x!r} against {y!r}"
      return f"{f.name}: {why}"
  return None


def _check_optimizer(optimizer) -> None:
  expected = _EXPECTED_OPTIMIZER.get()
  if expected is None:
    return
  ours = _optimizers.as_forge_optimizer(optimizer)
  why = _rule_mismatch(ours.rule, expected.rule)
  if why is None and ours.precision != expected.precision:
    why = f"precision {ours.precision} against {expected.precision}"
  if why:
    raise ValueError(
        f"a forge_jax.Dense was built with another optimizer than train_step's TrainState: "
        f"{why}. The FORGE layer runs its own optimizer inside its backward pass while the "
        "TrainState's updates every other parameter and advances the counts: pass the same "
        "optimizer to the model and to TrainState.create (a learning-rate sweep rebuilds "
        f"both). The layer's: {ours.rule} ({ours.precision}); the TrainState's: "
        f"{expected.rule} ({expected.precision})."
    )


def _check_fused_backward_allowed(path: str):
  if not _FUSED_BACKWARD.get():
    raise ValueError(
        f"the backward pass of the forge_jax.Dense {path} was traced outside "
        "forge_jax.train_step with its kernel differentiated. It updates the weight in place "
        "and returns the new weight where a gradient is expected, so plain jax.grad, gradient "
        "accumulation over micro-batches or a data-parallel all-reduce of its cotangents would "
        "be silently wrong. Train with forge_jax.train_step. For gradients with respect to the "
        "inputs alone, differentiate only the inputs (jax.grad(lambda x: loss(model.apply("
        "variables, x)))(x)), or apply the model to {'params': variables['params']} alone, where "
        "every forge_jax.Dense is a plain Dense; for true weight gradients use "
        "flax.linen.Dense. A custom step that overwrites each FORGE kernel with its cotangent "
        "exactly once may open forge_jax.fused_backward()."
    )


def _float0_like(x):
  return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 10))
def forge_matmul(optimizer, dtype, precision, backend, decay, config, path, x, kernel, kstate,
                 layout=None):
  """``x @ kernel`` whose VJP updates ``kernel`` and ``kstate`` (see module doc).

  ``path``: the full module path of the kernel's layer (a tuple of names); it names the
  layer in errors and seeds its stochastic-rounding stream. ``layout``: ``None``, or
  ``(TensorParallel, "column" | "row")`` for a weight split over a mesh axis.
  """
  del optimizer, backend, decay, config, path, layout, kstate
  return _dot(x, kernel.astype(dtype), precision)


def _dot(x, kernel, precision):
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _value(primals):
  """The values of a pytree of ``CustomVJPPrimal`` (one per leaf, with symbolic zeros)."""
  is_primal = lambda p: isinstance(p, _CustomVJPPrimal)
  return jax.tree.map(lambda p: p.value if is_primal(p) else p, primals, is_leaf=is_primal)


def _perturbed(primal) -> bool:
  return primal.perturbed if isinstance(primal, _CustomVJPPrimal) else True


def _dense_dy(dy):
  """A symbolic-zero cotangent (the layer's output does not reach the loss) as zeros."""
  if isinstance(dy, _SymbolicZero):
    return jnp.zeros(dy.aval.shape, dy.aval.dtype)
  return dy


def _forge_matmul_fwd(optimizer, dtype, precision, backend, decay, config, path, x, kernel,
                      kstate, layout=None):
  # With symbolic zeros jax says which inputs are differentiated. A kernel that is not (a
  # constant of jax.grad with respect to the inputs) gets no update: the backward pass computes
  # dX alone, as an ordinary Dense.
  x, kernel, kstate, train = _value(x), _value(kernel), _value(kstate), _perturbed(kernel)
  y = _dot(x, kernel.astype(dtype), precision)
  return y, (x, kernel, kstate if train else None)


def _update(layout, name, x, dy, kernel, opt_state, optimizer, backend, **kwargs):
  """The fused update of one weight: on each device's slice for a tensor-parallel layout."""
  if layout is None:
    return _fused.fused_linear_update(x, dy, kernel, opt_state, optimizer, backend,
                                      return_grad_sq_norm=True, **kwargs)
  tp, kind = layout
  return _parallel.sharded_linear_update(tp, kind, name, x, dy, kernel, opt_state, optimizer,
                                         backend, **kwargs)


def _forge_matmul_bwd(optimizer, dtype, precision, backend, decay, config, path, layout, res, dy):
  x, kernel, kstate = res
  dy = _dense_dy(dy)
  dx = jax.lax.dot_general(
      dy, kernel.astype(dtype), (((dy.ndim - 1,), (1,)), ((), ())), precision=precision
  )
  if kstate is None:
    return dx.astype(x.dtype), None, None
  name = "/".join(path)
  _check_fused_backward_allowed(name)
  _check_optimizer(optimizer)
  stream = kernel_stream(path)
  _mark_updated(stream)
  apply, guarded = _layer_apply()
  dy = _reuse.mark_backward(dy, name, guarded=guarded)
  # The update below overwrites `kernel` in place: every read of the old weight
  # (the dX product) must be ordered before it, or XLA protects the buffer
  # with a defensive copy. `after=dx` makes the update depend on dX.
  new_kernel, new_opt, sq = _update(
      layout, name, x, dy, kernel, kstate.opt, optimizer, backend, after=dx, decay=decay,
      config=config, stream=stream, apply=apply)
  # And the other way round: whatever consumes dX (the layers below) waits for the update, so
  # that `dy` dies here. Left free, XLA may schedule the update last: at 120 x 1024 tokens of
  # Llama-3.1-8B with int8 states it kept the LM head's dY (29.4 GiB of dlogits) live across the
  # layers' backward (results/h200/live_jumps/).
  dx, new_kernel, new_opt, sq = jax.lax.optimization_barrier((dx, new_kernel, new_opt, sq))
  new_kernel, new_opt, sq = _reuse.mark_new_values((new_kernel, new_opt, sq), name)
  new_opt = new_opt._replace(count=_float0_like(new_opt.count))
  return dx.astype(x.dtype), new_kernel, KernelState(new_opt, sq)


forge_matmul.defvjp(_forge_matmul_fwd, _forge_matmul_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 11))
def forge_matmul_stacked(optimizer, dtype, precision, backend, decay, config, path, x,
                         kernels, kstates, layer, layout=None):
  """``x @ kernels[layer]`` whose VJP updates layer ``layer`` of the stacks in place."""
  del optimizer, decay, config, path, kstates
  return _stacked_product(x, kernels, layer, dtype, precision, backend, layout)


def _stacked_product(x, kernels, layer, dtype, precision, backend, layout, transpose=False):
  """``x @ kernels[layer]`` (``.T`` with ``transpose``): layer ``layer`` read in place by the
  Mosaic stacked GEMM where it runs (not for a tensor-parallel layout), else sliced by XLA."""
  return _fused.stacked_dot(x, kernels, layer, transpose=transpose, dtype=dtype,
                            backend="xla" if layout is not None else backend, precision=precision)


def _forge_matmul_stacked_fwd(optimizer, dtype, precision, backend, decay, config, path,
                              x, kernels, kstates, layer, layout=None):
  return (_stacked_product(x, kernels, layer, dtype, precision, backend, layout),
          (x, kernels, kstates, layer))


def _forge_matmul_stacked_bwd(optimizer, dtype, precision, backend, decay, config, path, layout,
                              res, dy):
  name = "/".join(path)
  _check_fused_backward_allowed(name)
  _check_optimizer(optimizer)
  stream = kernel_stream(path)
  _mark_updated(stream)
  x, kernels, kstates, layer = res
  # One backward pass per layer of the stack: the loop over the layers is not a reuse.
  apply, guarded = _layer_apply()
  dy = _reuse.mark_backward(dy, name, stacked=True, guarded=guarded)
  dx = _stacked_product(dy, kernels, layer, dtype, precision, backend, layout, transpose=True)
  new_kernels, new_opt, sq = _update(
      layout, name, x, dy, kernels, kstates.opt, optimizer, backend, layer=layer, after=dx,
      decay=decay, config=config, stream=stream, apply=apply,
  )
  new_kernels, new_opt, sq = _reuse.mark_new_values((new_kernels, new_opt, sq), name)
  new_opt = new_opt._replace(count=_float0_like(new_opt.count))
  sq = jax.lax.dynamic_update_index_in_dim(
      jnp.zeros_like(kstates.grad_sq_norm), sq, layer, 0)
  return dx.astype(x.dtype), new_kernels, KernelState(new_opt, sq), _float0_like(layer)


forge_matmul_stacked.defvjp(_forge_matmul_stacked_fwd, _forge_matmul_stacked_bwd)


class Dense(nn.Module):
  """A linear transformation trained by FORGE (same parameters as ``nn.Dense``).

  Attributes:
    features: the number of output features.
    use_bias: whether to add a bias (trained by the optimizer's optax form).
    dtype: the dtype of the computation (default: inferred from inputs and params).
    param_dtype: the dtype of the parameters (float32 or bfloat16 for the kernel).
    precision: numerical precision of the forward and dX matmuls.
    kernel_init: initializer for the weight matrix.
    bias_init: initializer for the bias.
    optimizer: the forge_jax optimizer the kernel is trained with; must be the
      one given to :class:`forge_jax.TrainState`.
    decay: apply the optimizer's weight decay to the kernel. (An optimizer
      ``mask`` governs the parameters optax updates; see TrainState.)
    backend: the fused-update backend (``"auto"``, ``"xla"``, ``"pallas"``,
      ``"mosaic"``, ``"interpret"``, ``"mosaic_interpret"``; see
      :func:`forge_jax.fused_linear_update`).
    tile_config: the kernel's tile configuration (``None``: per-shape default).
    parallel: ``None`` (the weight whole on every device), ``"column"`` (split on its output
      features over ``tensor_parallel.axis``) or ``"row"`` (split on its input features).
    tensor_parallel: the :class:`forge_jax.TensorParallel` of a ``parallel`` layer. The
      fused update then runs on each device's slice of the weight and its optimizer state
      (see :mod:`forge_jax._parallel`); the model's parameters must be placed on the mesh
      that way (:func:`forge_jax.shard_tree`).
  """

  features: int
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable = default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()
  optimizer: Optional[_optimizers.ForgeOptimizer] = None
  decay: bool = True
  backend: str = "auto"
  tile_config: Any = None
  parallel: Optional[str] = None
  tensor_parallel: Any = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    if self.optimizer is None:
      raise ValueError(
          f"forge_jax.Dense {self._path()} needs `optimizer=` (the forge_jax "
          "optimizer that trains it); use flax.linen.Dense for a plain layer."
      )
    _optimizers.as_forge_optimizer(self.optimizer)
    kernel = self.param(
        "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
    )
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    dtype = flax_dtypes.canonicalize_dtype(inputs, kernel, bias, dtype=self.dtype)
    inputs = jnp.asarray(inputs, dtype)
    layout = self._layout()
    if layout is not None:
      # The layouts the update's shard_map reads (all tokens and features into a column-parallel
      # layer, feature-split into a row-parallel one), fixed here so that the partitioner moves
      # activations (an all-gather of x under sequence parallelism) rather than weights.
      tp, kind = layout
      inputs = tp.constrain(inputs, _parallel.P() if kind == "column" else
                            tp.features_spec(inputs.ndim))
    if self.has_variable(FORGE_STATE, "kernel") or self.is_mutable_collection(FORGE_STATE):
      self._count_call()
      kstate = self.variable(
          FORGE_STATE, "kernel", init_kernel_state, self.optimizer, kernel
      ).value
      # The full path names the layer in errors and seeds its stochastic-rounding stream
      # (layers of a ScannedStack share it and differ by layer index).
      path = (*_PATH_PREFIX.get(), *self.scope.path)
      static = (self.optimizer, dtype, self.precision, self.backend, self.decay, self.tile_config,
                path)
      raw_kernel = self.scope.get_variable("params", "kernel")
      raw_state = self.scope.get_variable(FORGE_STATE, "kernel")
      if isinstance(raw_kernel, StackSlice) and isinstance(raw_state, StackSlice):
        y = forge_matmul_stacked(*static, inputs, raw_kernel.stack, raw_state.stack, raw_kernel.layer,
                                 layout)
      else:
        y = forge_matmul(*static, inputs, kernel, kstate, layout)
    else:  # no optimizer state given: evaluation, an ordinary Dense
      y = _dot(inputs, kernel.astype(dtype), self.precision)
    if bias is not None:
      y = y + jnp.reshape(bias.astype(dtype), (1,) * (y.ndim - 1) + (-1,))
    if layout is not None and layout[1] == "column":
      y = layout[0].constrain(y, layout[0].features_spec(y.ndim))
    return y

  def _layout(self):
    if (self.parallel is None) != (self.tensor_parallel is None):
      raise ValueError(
          f"forge_jax.Dense {self._path()}: parallel={self.parallel!r} and tensor_parallel="
          f"{self.tensor_parallel!r} go together: pass both (a forge_jax.TensorParallel and "
          "'column' or 'row') or neither.")
    if self.parallel is None:
      return None
    if self.parallel not in _parallel.LAYOUTS:
      raise ValueError(f"forge_jax.Dense {self._path()}: parallel={self.parallel!r} is not one "
                       f"of {_parallel.LAYOUTS} (or None).")
    if not isinstance(self.tensor_parallel, _parallel.TensorParallel):
      raise ValueError(f"forge_jax.Dense {self._path()}: tensor_parallel="
                       f"{self.tensor_parallel!r} must be a forge_jax.TensorParallel.")
    return (self.tensor_parallel, self.parallel)

  def _path(self) -> str:
    try:
      return "/".join(self.scope.path) or "(root)"
    except AttributeError:
      return "(unbound)"

  def _count_call(self):
    # FORGE updates the kernel inside this call's backward pass; a second call
    # in the same apply would make autodiff *sum* two new kernels. Shared or
    # tied weights cannot be fused: refuse instead of computing nonsense.
    calls = getattr(self, "_forge_calls", 0)
    if calls:
      raise ValueError(
          f"forge_jax.Dense {self._path()} was called {calls + 1} times in one "
          "apply. FORGE updates a weight inside its single backward pass, so a "
          "weight used more than once per step (tied or shared weights, a layer "
          "reused in a loop) cannot be fused: use flax.linen.Dense for that "
          "layer (optax will update it) or give each use its own weights."
      )
    object.__setattr__(self, "_forge_calls", calls + 1)
