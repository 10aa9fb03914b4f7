"""The ``"xla"`` reference of the fused update: one float32 dot, then the rule.

Same contract as the kernels (:mod:`pallas_kernels.contract`); XLA fuses the
rule into whatever it sees fit, and the full float32 gradient exists in device
memory for the duration of the update.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import numerics
from pallas_kernels.contract import (UpdateFn, apply_update, codecs_for, grad_sq_terms, parts_of,
                                     rebuild, rounding_ints, unwrap, zero_after)

Array = jax.Array


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
    weight_codec: Optional[numerics.Codec] = None,
    seed: Optional[Any] = None,
    step: Optional[Any] = None,
    index: Optional[Array] = None,
    apply: Optional[Array] = None,
):
  """Plain-jnp reference: the same contract as the kernels.

  Args:
    x: [T, K] layer input (any float dtype).
    dy: [T, N] output cotangent.
    w: [K, N] weight, or [L, K, N] stacked weights with ``layer`` given.
    slots: optimizer-state arrays shaped like ``w`` (float arrays or
      :class:`~pallas_kernels.numerics.QuantizedArray`).
    scalars: pytree of float32 0-d arrays passed to ``update_fn``.
    update_fn: the elementwise rule (see the module docstring).
    layer: int32 scalar index into the leading axis of stacked ``w``/slots.
    compute_grad_sq_norm: also return ``sum(dW**2)`` in float32 (NaN if an element of
      ``dW`` is not finite: :func:`~pallas_kernels.contract.grad_sq_terms`).
    weight_codec: the weight's write-back (see :func:`fused_dw_update`).
    seed: the rounding seed (stochastic rounding).
    step: the optimizer step (stochastic rounding).
    index: the uint32 index each element of the [K, N] update hashes its bits
      from (default: its own ``row * N + col``); a slice of a weight split over
      devices passes its elements' indices in the whole weight.
    apply: a boolean scalar (may be traced): where false ``w`` and the slots
      come back as they were, bit for bit.

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
  codecs = codecs_for(w, slots, weight_codec)
  seed_i32, step_i32 = rounding_ints(codecs, seed, step)
  parts = parts_of(codecs, w, slots)
  if layer is None:
    parts_l, layer_i32 = parts, jnp.int32(0)
  else:
    # Clamped like dynamic_index_in_dim (and like the kernel's index).
    layer_i32 = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
    parts_l = [jax.lax.dynamic_index_in_dim(p, layer_i32, keepdims=False) for p in parts]
  w_l, slots_l = rebuild(codecs, parts_l)
  w32 = codecs[0].decode(codecs[0].parts(w_l))
  slots32 = tuple(c.decode(c.parts(s)) for c, s in zip(codecs[1:], slots_l))
  bits = None
  if any(c.needs_bits for c in codecs):
    key = numerics.rounding_key(seed_i32, step_i32, layer_i32)
    bits = numerics.element_bits(key, numerics.matrix_index(g.shape) if index is None else index)

  def encode(values, first):
    out, i = [], sum(len(c.col_divisors()) for c in codecs[:first])
    for j, (c, value) in enumerate(zip(codecs[first:], values), start=first):
      m = len(c.col_divisors())
      bits_j = numerics.value_bits(bits, j) if c.needs_bits else None
      out += c.encode(value, tuple(p.dtype for p in parts_l[i : i + m]), bits_j)
      i += m
    return out

  def gate(new_parts, old_parts):
    """With ``apply``: the stored values where it is true, the old ones (int8 codes and scales
    included) where it is false."""
    if apply is None:
      return new_parts
    return [jnp.where(apply, q.astype(p.dtype), p) for q, p in zip(new_parts, old_parts)]

  n_w = len(codecs[0].col_divisors())

  def at_once():
    new_w32, new = apply_update(update_fn, g, w32, slots32, scalars)
    return gate(encode((new_w32, *new), 0), parts_l)

  def weight_first():
    # With the guard's selects on the slots, no slot output holds the rule's new slots any
    # more: XLA:CPU recomputes them from the old slots inside the weight's fusion and overwrites
    # the old slots in place only if that fusion provably comes first (else a copy of every
    # state per layer, and per-layer lax.cond outputs that stop aliasing their inputs:
    # tests/test_flax_binding.py). So the slots' update reads a gradient that depends on the
    # written weight (g + -0.0, bit for bit g). Ordering it through the selects' mask instead
    # changed the FMAs XLA contracts in the slots' fusion (up to 117 ulp from optax on first
    # moments near zero: tests/test_optimizers.py); this keeps that fusion as it was.
    new_w32, _ = apply_update(update_fn, g, w32, slots32, scalars)
    w_parts = gate(encode((new_w32,), 0), parts_l[:n_w])
    g_after = g - jnp.abs(zero_after(w_parts[0]))  # g + -0.0: g bit for bit
    _, new = apply_update(update_fn, g_after, w32, slots32, scalars)
    return list(w_parts) + gate(encode(new, 1), parts_l[n_w:])

  if unwrap(update_fn)[1] and layer is None:
    # Whole arrays with the guard. XLA:GPU makes one multi-output fusion of the rule evaluated
    # once, updating W and the slots in place; weight_first's order costs it a second pass over
    # g, W and the slots per layer, and copies of the slots in a model's step (the guard cost
    # the layer +31-33% at T=1024 on the H200, experiments/results/h200/guard). XLA:CPU needs
    # the order. (A stack's slots are written after its weight below, whatever the platform.)
    new_parts = list(jax.lax.platform_dependent(cpu=weight_first, default=at_once))
  else:
    new_parts = at_once()
  if layer is not None:
    # The weight's update reads the old slots (its step needs their new
    # values), and nothing orders that read before the slots' in-place
    # updates: XLA then protects every slot stack with copies, twice per layer
    # inside a ScannedStack's backward loop (XLA:CPU, fp32 AdamW, a 2-weight
    # stack: 8 stack-sized copies, step temporaries 754 KB against 361 KB
    # without them; experiments/stack_copies.py at commit 2b67016).
    # The slots are written at an index that depends on the written weight,
    # so every read of the old slots comes first.
    def update(parts_, new_, index):
      return [jax.lax.dynamic_update_index_in_dim(p, q.astype(p.dtype), index, 0)
              for p, q in zip(parts_, new_)]

    new_w_parts = update(parts[:n_w], new_parts[:n_w], layer_i32)
    new_parts = new_w_parts + update(parts[n_w:], new_parts[n_w:],
                                     layer_i32 + zero_after(new_w_parts[0]).astype(jnp.int32))
  new_w, new_slots = rebuild(codecs, new_parts)
  norm = jnp.sum(grad_sq_terms(g)) if compute_grad_sq_norm else None
  return new_w, new_slots, norm
