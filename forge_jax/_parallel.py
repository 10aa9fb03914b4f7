"""Tensor and sequence parallelism for FORGE layers (Megatron layouts on one mesh axis).

A FORGE layer's fused update needs the *complete* gradient of the weight it updates. Under a
data-parallel split of the batch each device holds a partial gradient, so FORGE refuses it.
Under tensor parallelism each device holds a slice of the weight and every token's
activations for that slice, so the slice's gradient is complete on the device that owns it:

* column-parallel ``W[K, N/P]``: the layer's input ``x`` (all tokens, all K) and its output
  cotangent ``dy[..., N/P]``; ``dW[:, slice] = x.T @ dy[:, slice]``;
* row-parallel ``W[K/P, N]``: ``x[..., K/P]`` and ``dy`` (all tokens, all N);
  ``dW[slice, :] = x[:, slice].T @ dy``.

The model runs under ``jax.jit`` with ``NamedSharding``s on the mesh: XLA's SPMD partitioner
(GSPMD) splits the forward matmuls, the ``dX`` products, attention, norms, embeddings, the
loss and every parameter the optax side updates, exactly. Only the fused update runs per device,
inside ``jax.shard_map(check_vma=False)`` with the in and out specs above, on the device's slice
of the weight and of its optimizer state: the update is local, and no weight, optimizer state or
weight gradient crosses devices. The squared gradient norm is the ``psum`` of the slices' sums.

Stochastic rounding (of bfloat16 weights, of int8 states) hashes each element's bits from its
*global* index ``row * N + col`` in the whole ``[K, N]`` weight, so the rounded values do not
depend on how many devices share the weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import numerics

LAYOUTS = ("column", "row")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """Where tensor-parallel FORGE layers split their weights.

  Attributes:
    mesh: the ``jax.sharding.Mesh``; it may have other axes (of size 1 for FORGE layers: a
      batch split over devices is refused by :func:`forge_jax.train_step`).
    axis: the mesh axis the weights are split over (Megatron's tensor-parallel group).
    sequence_parallel: between the parallel layers (norms, residual adds) activations are
      split over ``axis`` along the sequence (``sequence_dim``): an all-gather before each
      column-parallel layer and a reduce-scatter after each row-parallel one replace the
      all-reduce of plain tensor parallelism.
    sequence_dim: which axis of a ``[batch, sequence, features]`` activation holds the
      sequence (used only with ``sequence_parallel``).
  """

  mesh: Mesh
  axis: str = "tensor"
  sequence_parallel: bool = False
  sequence_dim: int = 1

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise ValueError(f"mesh={self.mesh!r} must be a jax.sharding.Mesh "
                       "(e.g. jax.sharding.Mesh(np.array(jax.devices()), ('tensor',))).")
    if self.axis not in self.mesh.axis_names:
      raise ValueError(
          f"axis={self.axis!r} is not an axis of the mesh (its axes: {self.mesh.axis_names}): "
          f"build the mesh with a {self.axis!r} axis or pass axis= one of its names.")
    types = dict(zip(self.mesh.axis_names, getattr(self.mesh, "axis_types", ()) or ()))
    kind = types.get(self.axis)
    if kind is not None and getattr(kind, "name", str(kind)) != "Auto":
      raise ValueError(
          f"the mesh axis {self.axis!r} is {kind}: the model's layouts are sharding constraints "
          "for the partitioner, which need an Auto axis. Build the mesh with "
          "axis_types=(jax.sharding.AxisType.Auto, ...) (jax.make_mesh makes Explicit axes "
          "by default) or as jax.sharding.Mesh(devices, names).")

  @property
  def size(self) -> int:
    """P, the number of devices a weight is split over."""
    return int(self.mesh.shape[self.axis])

  def kernel_spec(self, layout: str, ndim: int = 2) -> P:
    """The PartitionSpec of a ``[..., K, N]`` weight (or slot) of a ``layout`` layer."""
    if layout not in LAYOUTS:
      raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    lead = (None,) * (ndim - 2)
    return P(*lead, None, self.axis) if layout == "column" else P(*lead, self.axis, None)

  def features_spec(self, ndim: int) -> P:
    """An activation split on its last (feature) axis: a column-parallel layer's output."""
    return P(*(None,) * (ndim - 1), self.axis)

  def heads_spec(self, ndim: int = 4) -> P:
    """A ``[B, L, heads, H]`` activation split on its heads."""
    return P(*(None,) * (ndim - 2), self.axis, None)

  def between_spec(self, ndim: int = 3) -> P:
    """Activations between the parallel layers: split on the sequence under sequence
    parallelism, else replicated."""
    if not self.sequence_parallel:
      return P()
    spec = [None] * ndim
    spec[self.sequence_dim] = self.axis
    return P(*spec)

  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def constrain(self, x, spec: P):
    """``x`` laid out as ``spec`` (GSPMD inserts the collectives, forward and backward)."""
    return jax.lax.with_sharding_constraint(x, self.sharding(spec))

  def check_divides(self, what: str, size: int, fix: str) -> None:
    if size % self.size:
      raise ValueError(
          f"{what}={size} is not divisible by the {self.axis!r} axis size {self.size}: "
          f"tensor parallelism splits it evenly over the devices. {fix}")


# int8 scales are stored block-major, [..., N // block, K]: split on the other axis.
_SCALE_LAYOUT = {"column": "row", "row": "column"}


def slot_spec(tp: TensorParallel, layout: str, leaf, scale: bool = False) -> P:
  """An optimizer-state leaf's spec: like its weight for ``[..., K, N]`` leaves (moments,
  int8 codes), on the other axis for int8 scales (``scale``: ``[..., N // block, K]``),
  replicated for counts and norms."""
  ndim = jnp.ndim(leaf)
  if ndim < 2:
    return P()
  return tp.kernel_spec(_SCALE_LAYOUT[layout] if scale else layout, ndim)


def _is_scale(path) -> bool:
  return bool(path) and getattr(path[-1], "name", None) == "scale"


def _check_shapes(tp: TensorParallel, layout: str, path: str, kernel, slots) -> None:
  k, n = kernel.shape[-2:]
  split, dim = (n, "N (output features)") if layout == "column" else (k, "K (input features)")
  tp.check_divides(f"{layout}-parallel {path}: the weight {tuple(kernel.shape)}'s {dim}", split,
                   "Choose a layer size (or head count) divisible by it, or a smaller tensor axis.")
  if layout != "column":
    return
  for q in slots:
    if isinstance(q, numerics.QuantizedArray) and (n // tp.size) % q.codec.block:
      raise ValueError(
          f"column-parallel {path}: its int8 state's quantization blocks of {q.codec.block} "
          f"values run along N={n}, and each of the {tp.size} devices holds N/P={n // tp.size} "
          "of them, which would split a block (and its scale) between devices. Use a "
          f"block_size that divides {n // tp.size} (forge_jax.Precision(block_size=...)), a "
          "smaller tensor axis, or float states.")


def sharded_linear_update(tp: TensorParallel, layout: str, path: str, x, dy, kernel, opt_state,
                          optimizer, backend, *, layer=None, after=None, decay=True, config=None,
                          stream=0, apply=None):
  """:func:`forge_jax.fused_linear_update` of a ``layout``-parallel weight, per device.

  Returns ``(new_kernel, new_opt_state, grad_sq_norm)``: the kernel and state split like the
  inputs, and the squared norm of the whole weight's gradient (a ``psum`` over ``tp.axis``).
  """
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top  (a cycle otherwise)
  from forge_jax import _lowp  # pylint: disable=g-import-not-at-top
  from forge_jax import _optimizers  # pylint: disable=g-import-not-at-top
  opt = _optimizers.as_forge_optimizer(optimizer)
  slots = [_lowp.from_float_view(s) for s in opt.rule.slots_of(opt_state)]
  _check_shapes(tp, layout, path, kernel, slots)
  axis = tp.axis
  w_spec = tp.kernel_spec(layout, kernel.ndim)
  state_spec = jax.tree_util.tree_map_with_path(
      lambda path, a: slot_spec(tp, layout, a, _is_scale(path)), opt_state)
  rows = lambda a: P(*(None,) * (a.ndim - 1), axis)
  x_spec, dy_spec = (P(), rows(dy)) if layout == "column" else (rows(x), P())
  k_local, n_local = kernel.shape[-2] // tp.size, kernel.shape[-1] // tp.size
  n_global = kernel.shape[-1]
  # `after` (dX, which reads the old weight) is laid out as the partitioner chose; the update
  # needs only a zero computed from it, which orders the update after it.
  order = jnp.zeros((), jnp.float32) if after is None else _zero_after(after)
  layer_arg = jnp.zeros((), jnp.int32) if layer is None else layer
  apply_arg = jnp.ones((), bool) if apply is None else jnp.asarray(apply, bool)

  def local(x_l, dy_l, w_l, state_l, order_l, layer_l, apply_l):
    shard = jax.lax.axis_index(axis)
    row0, col0 = (0, shard * n_local) if layout == "column" else (shard * k_local, 0)
    new_w, new_state, sq = _fused.fused_linear_update(
        x_l, dy_l, w_l, state_l, optimizer, backend, layer=None if layer is None else layer_l,
        after=order_l, decay=decay, config=config, return_grad_sq_norm=True, stream=stream,
        element_offset=(row0, col0, n_global), sum_sq_over=axis,
        apply=None if apply is None else apply_l)
    return new_w, new_state, sq

  smap = jax.shard_map(
      local, mesh=tp.mesh,
      in_specs=(x_spec, dy_spec, w_spec, state_spec, P(), P(), P()),
      out_specs=(w_spec, state_spec, P()),
      check_vma=False)
  return smap(x, dy, kernel, opt_state, order, layer_arg, apply_arg)


def _zero_after(x):
  # x's first element by index, not by ravel: reshaping a feature-split dX to 1-d would make
  # the partitioner all-gather it.
  token = x[(0,) * x.ndim].astype(jnp.float32)
  return jnp.where(jnp.isfinite(token), token, 0.0) * 0.0


def global_element_index(shape, offset) -> jax.Array:
  """The uint32 index ``row * N + col`` of each entry of a ``[k, n]`` slice of a ``[K, N]``
  weight, whose first entry is at (``row0``, ``col0``); ``offset = (row0, col0, N)``."""
  row0, col0, n_global = offset
  k, n = shape[-2:]
  rows = jax.lax.broadcasted_iota(jnp.uint32, (k, n), 0) + jnp.asarray(row0).astype(jnp.uint32)
  cols = jax.lax.broadcasted_iota(jnp.uint32, (k, n), 1) + jnp.asarray(col0).astype(jnp.uint32)
  return numerics.element_index(rows, cols, n_global)


def shard_tree(tp: TensorParallel, tree, layouts: dict) -> Any:
  """The NamedShardings of a pytree of parameters, optimizer states or a whole TrainState.

  A leaf whose path holds a module named in ``layouts`` (``{"q_proj": "column", ...}``)
  followed by ``"kernel"`` (a weight, its optax moments, its FORGE state) or ``"embedding"``
  (a ``[V, D]`` table: ``"row"`` splits the vocabulary) is split like that layout's weight if
  it has two or more dimensions (a stacked ``[L, K, N]`` on its last two);
  a column-parallel layer's ``bias`` is split on its features; everything else is replicated.
  """

  def names(path):
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]

  def spec(path, leaf):
    ns = names(path)
    ndim = len(getattr(leaf, "shape", ()))
    for i, name in enumerate(ns[:-1]):
      layout = layouts.get(name)
      if layout is None:
        continue
      if ns[i + 1] in ("kernel", "embedding") and ndim >= 2:
        split = _SCALE_LAYOUT[layout] if _is_scale(path) else layout
        _check_split(tp, layout, "/".join(ns), leaf.shape, split)
        return tp.sharding(tp.kernel_spec(split, ndim))
      if ns[i + 1] == "bias" and layout == "column" and ndim >= 1:
        return tp.sharding(P(*(None,) * (ndim - 1), tp.axis))
    return tp.sharding(P())

  return jax.tree_util.tree_map_with_path(spec, tree)


def _check_split(tp: TensorParallel, layout: str, path: str, shape, split: str) -> None:
  """``split``: the layout whose axis this leaf splits (an int8 scale's is the other one)."""
  size = shape[-1] if split == "column" else shape[-2]
  if size % tp.size == 0:
    return
  if path.endswith("scale") and layout == "column":
    raise ValueError(
        f"{path}: this int8 state has {size} quantization blocks per row (scales "
        f"{tuple(shape)}), not divisible by the {tp.axis!r} axis size {tp.size}: a "
        f"{layout}-parallel split of N would cut a block (and its scale) between devices. "
        "Use a block_size that divides N/P (forge_jax.Precision(block_size=...)), a smaller "
        "tensor axis, or float states.")
  raise ValueError(
      f"{path}: shape {tuple(shape)} is not divisible by the {tp.axis!r} axis size {tp.size} "
      f"along the axis a {layout}-parallel layer splits. Choose layer sizes divisible by it "
      "or a smaller tensor axis.")
