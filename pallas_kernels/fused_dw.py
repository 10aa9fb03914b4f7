"""Fused weight-gradient + optimizer update: ``dW = x.T @ dy`` consumed in place.

For ``x`` [T, K] and ``dy`` [T, N], each program of the kernel owns one
(block_k, block_n) tile of the weight ``w`` [K, N]: it accumulates
``x[:, tile_k].T @ dy[:, tile_n]`` over all T tokens in float32, calls the
optimizer's elementwise ``update_fn`` on that tile, and writes the new weight
and state-slot tiles in place. The gradient tile never leaves the kernel.

The contract shared by every implementation in this package:

``update_fn(g, w, slots, scalars) -> (u, new_slots)``
  ``g``, ``w`` and each slot are float32 tiles of one shape; ``scalars`` is the
  caller's pytree of float32 0-d values (rebuilt inside the kernel from a
  packed vector); ``u`` is the float32 update (the weight becomes ``w + u``)
  and ``new_slots`` the float32 slots. Plain jnp arithmetic only.

Stacked weights: ``w`` and the slots may carry a leading layer axis
([L, K, N]); then ``layer`` (an int32 scalar) selects the one slice that is
read and rewritten, and every other slice is left untouched, so a loop over
layers can update a stacked parameter in place without slicing copies.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
UpdateFn = Callable[..., tuple[Array, tuple[Array, ...]]]


def store_cast(value: Array, dtype) -> Array:
  """The write-back conversion from the float32 result to a storage dtype.

  Round to nearest for now; stochastic rounding and quantized slots plug in
  here (one definition for every backend).
  """
  return value.astype(dtype)


def fused_dw_update_reference(
    x: Array,
    dy: Array,
    w: Array,
    slots: Sequence[Array],
    scalars: Any,
    update_fn: UpdateFn,
    *,
    layer: Optional[Array] = None,
    compute_grad_sq_norm: bool = False,
):
  """Plain-jnp reference: the same contract as the kernels.

  Args:
    x: [T, K] layer input (any float dtype).
    dy: [T, N] output cotangent.
    w: [K, N] weight, or [L, K, N] stacked weights with ``layer`` given.
    slots: optimizer-state arrays shaped like ``w``.
    scalars: pytree of float32 0-d arrays passed to ``update_fn``.
    update_fn: the elementwise rule (see the module docstring).
    layer: int32 scalar index into the leading axis of stacked ``w``/slots.
    compute_grad_sq_norm: also return ``sum(dW**2)`` in float32.

  Returns:
    ``(new_w, new_slots, grad_sq_norm)``; ``grad_sq_norm`` is ``None`` unless
    requested.
  """
  g = jax.lax.dot_general(
      x, dy, (((0,), (0,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
  )
  slots = tuple(slots)
  if layer is None:
    w_l, slots_l = w, slots
  else:
    w_l = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    slots_l = tuple(jax.lax.dynamic_index_in_dim(s, layer, keepdims=False) for s in slots)
  w32 = w_l.astype(jnp.float32)
  u, new = update_fn(g, w32, tuple(s.astype(jnp.float32) for s in slots_l), scalars)
  new_w = store_cast(w32 + u, w.dtype)
  new_slots = tuple(store_cast(n, s.dtype) for n, s in zip(new, slots))
  if layer is not None:
    new_w = jax.lax.dynamic_update_index_in_dim(w, new_w, layer, 0)
    new_slots = tuple(
        jax.lax.dynamic_update_index_in_dim(s, n, layer, 0) for s, n in zip(slots, new_slots)
    )
  norm = jnp.sum(g * g) if compute_grad_sq_norm else None
  return new_w, new_slots, norm
