"""The contract every fused ``dW`` + update implementation in this package keeps.

``update_fn(g, w, slots, scalars) -> (u, new_slots)``
  ``g``, ``w`` and each slot are float32 tiles of one shape; ``scalars`` is the
  caller's pytree of float32 0-d values (rebuilt inside a kernel from a packed
  vector); ``u`` is the float32 update (the weight becomes ``w + u``) and
  ``new_slots`` the float32 slots. Plain elementwise jnp arithmetic only: the
  same function runs in the kernels' epilogues, in the XLA reference and in the
  tests' expectations.

Stored forms (:mod:`pallas_kernels.numerics`): every value is read through a
codec's ``decode`` into float32 and written back through its ``encode``. The
weight's codec is an argument (``weight_codec``: round to nearest by default,
or stochastic rounding to bfloat16 with bits hashed from ``seed``, ``step``,
``layer`` and the element's index); a slot is either a float array (round to
nearest) or a :class:`~pallas_kernels.numerics.QuantizedArray` (int8 codes +
per-block scales, dequantized and re-quantized in registers).

Stacked weights: ``w`` and the slots may carry a leading layer axis
([L, K, N]); then ``layer`` (an int32 scalar, clamped to ``[0, L)``) selects
the one slice that is read and rewritten, so a loop over layers updates a
stacked parameter in place without slicing copies.

Skipping a whole update: with ``apply`` (a boolean scalar, may be traced) false, an
implementation stores nothing (the kernels skip their stores into the aliased buffers, the
reference selects the old stored values), so ``w`` and every slot, int8 codes and scales
included, come back bit for bit; the gradient and its norm are still computed.

Every implementation returns ``(new_w, new_slots, grad_sq_norm)``, the last
``None`` unless ``compute_grad_sq_norm``. The squared norm is summed from
:func:`grad_sq_terms`: NaN when any element of ``dW`` is not finite (``inf``
only when finite elements overflow), so it marks a non-finite gradient.

Non-finite gradient elements: with an ``update_fn`` wrapped by
:func:`skip_non_finite`, an element whose gradient is NaN or infinite keeps
its weight and every slot at their old float32 values (written back through
the codecs: bit for bit the stored values for float arrays, including a
stochastically rounded bfloat16 weight; an int8 slot's element is re-encoded
from its old value with its block's other, updated values). Every
implementation applies the rule through :func:`apply_update`, the one place
the guard lives: it selects after the weight's ``w + u``, so a compiler that
contracts the rule's last multiply into that add (an FMA) does so with the
guard on and off alike, and a finite step is bit-identical either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import numerics

Array = jax.Array
UpdateFn = Callable[..., tuple[Array, tuple[Array, ...]]]


def check_quantized(s: numerics.QuantizedArray, name: str) -> None:
  """ValueErrors for an int8 state whose codes, scales or block do not fit its shape."""
  s.codec.check(s.shape, name)
  scale_shape = s.codec.scale_shape(s.shape)
  if s.codes.dtype != numerics.CODE_DTYPE or s.scale.dtype != numerics.SCALE_DTYPE:
    raise ValueError(
        f"{name} has codes of dtype {s.codes.dtype} and scales of dtype {s.scale.dtype}; "
        f"expected {numerics.CODE_DTYPE} and {numerics.SCALE_DTYPE} (build it with "
        "BlockQuantized.quantize)."
    )
  if tuple(s.scale.shape) != scale_shape:
    raise ValueError(
        f"{name}.scale.shape={tuple(s.scale.shape)} must be {scale_shape}: one scale "
        f"per block of {s.codec.block} values along the last axis, block-major ([..., N // "
        "block, K]; build it with BlockQuantized.quantize)."
    )


def operand_problem(x: Any, dy: Any, w: Any, slots: Sequence[Any]) -> Optional[str]:
  """Why ``x``, ``dy``, ``w`` and the slots (arrays or ``jax.ShapeDtypeStruct``) break the
  contract's shapes, whatever the implementation, or ``None``; the reason names the value and
  the fix. Each implementation adds the dtypes it takes."""
  if len(x.shape) != 2 or len(dy.shape) != 2:
    return (f"x.shape={x.shape} and dy.shape={dy.shape} must be 2-d [T, K] and [T, N]; "
            "flatten the batch and sequence axes into one token axis first.")
  if x.shape[0] != dy.shape[0]:
    return (f"x.shape={x.shape} and dy.shape={dy.shape} must have the same number of "
            "tokens T (axis 0).")
  kn = (x.shape[1], dy.shape[1])
  if len(w.shape) not in (2, 3) or tuple(w.shape[-2:]) != kn:
    return (f"w.shape={w.shape} must be [K, N]={list(kn)} (or [L, K, N] stacked) for "
            f"x.shape={x.shape} and dy.shape={dy.shape}.")
  for i, s in enumerate(slots):
    if tuple(s.shape) != tuple(w.shape):
      return (f"slots[{i}].shape={s.shape} must equal w.shape={w.shape}: every optimizer "
              "slot is elementwise, shaped like its weight.")
    if isinstance(s, numerics.QuantizedArray):
      try:
        check_quantized(s, f"slots[{i}]")
      except ValueError as e:
        return str(e)
  return None


def layer_problem(w: Any, layer: Any) -> Optional[str]:
  """Why ``layer`` does not go with ``w`` (given exactly for a stacked ``[L, K, N]`` one, a
  scalar), or ``None``."""
  if len(w.shape) == 3 and layer is None:
    return (f"w.shape={w.shape} is stacked [L, K, N]: pass layer= (an int32 scalar) "
            "to select the slice to update.")
  if len(w.shape) == 2 and layer is not None:
    return (f"layer={layer!r} was given but w.shape={w.shape} is not stacked; pass "
            "layer=None or a stacked [L, K, N] w.")
  if layer is not None and jnp.ndim(layer) != 0:
    return f"layer must be an int32 scalar, got shape {jnp.shape(layer)}."
  return None


def codecs_for(w: Array, slots: tuple, weight_codec) -> tuple[numerics.Codec, ...]:
  """The weight's codec (round to nearest unless given), then each slot's."""
  return (weight_codec or numerics.Cast(),) + tuple(numerics.codec_of(s) for s in slots)


def parts_of(codecs, w: Array, slots: tuple) -> list[Array]:
  """The stored arrays of the weight and slots, in order (an int8 slot: codes, then scales)."""
  return [p for c, v in zip(codecs, (w,) + slots) for p in c.parts(v)]


def rebuild(codecs, parts: Sequence[Array]) -> tuple[Array, tuple]:
  """Inverse of :func:`parts_of`: ``(w, slots)`` from the stored arrays."""
  values, i = [], 0
  for c in codecs:
    m = len(c.col_divisors())
    values.append(c.rebuild(parts[i : i + m]))
    i += m
  return values[0], tuple(values[1:])


def rounding_ints(codecs, seed, step) -> tuple[Array, Array]:
  """(seed, step) as int32 scalars; a ValueError if bits are needed but missing."""
  if any(c.needs_bits for c in codecs) and (seed is None or step is None):
    raise ValueError(
        f"seed={seed!r} and step={step!r}: stochastic rounding needs both (the random "
        "bits hash seed, step, layer and the element index). Pass seed= and step=."
    )
  as_i32 = lambda v: jax.lax.bitcast_convert_type(numerics._u32(0 if v is None else v), jnp.int32)
  return as_i32(seed), as_i32(step)


def pack_scalars(scalars: Any) -> tuple[Array, Any]:
  """Flattens the scalars pytree into one float32 vector (+ its treedef)."""
  leaves, treedef = jax.tree.flatten(scalars)
  for i, leaf in enumerate(leaves):
    if jnp.ndim(leaf) != 0:
      raise ValueError(
          f"scalars leaf {i} has shape {jnp.shape(leaf)}; every leaf of scalars "
          "must be a 0-d value (per-element data belongs in the slots)."
      )
  # A zero-length input is not a valid Triton argument: keep one dummy entry.
  packed = [jnp.asarray(leaf, jnp.float32) for leaf in leaves] or [jnp.zeros((), jnp.float32)]
  return jnp.stack(packed), treedef


def finite(g: Array) -> Array:
  """Where ``g`` is finite: ``|g| < inf`` (False for NaN and +-inf). Spelled with ``abs`` and
  ``lt``, which every backend lowers (Mosaic GPU has no ``is_finite``)."""
  return jnp.abs(g) < jnp.inf


def grad_sq_terms(g: Array) -> Array:
  """``g * g`` where ``g`` is finite, NaN where it is not: summed, a squared norm that is NaN
  exactly when an element is not finite (a finite ``g`` whose square overflows gives ``inf``)."""
  return jnp.where(finite(g), g * g, jnp.nan)


def apply_update(update_fn: UpdateFn, g: Array, w: Array, slots: Sequence[Array], scalars: Any,
                 rule: Any = None) -> tuple[Array, tuple[Array, ...]]:
  """``(new w, new slots)`` in float32: ``w + u`` and the rule's slots, with every element whose
  gradient is not finite left at ``w`` and ``slots`` if ``update_fn`` is :func:`skip_non_finite`'s.

  ``rule``: what to call instead of the unwrapped ``update_fn`` (the Mosaic kernel's traced
  copy of it). Selecting after the add costs one compare and one select per stored value.
  """
  inner, skip = unwrap(update_fn)
  u, new_slots = (rule or inner)(g, w, tuple(slots), scalars)
  new_w, new_slots = w + u, tuple(new_slots)
  if len(new_slots) != len(slots):
    raise ValueError(
        f"update_fn returned {len(new_slots)} slots for {len(slots)} slot inputs; "
        "it must return (u, new_slots) with one new slot per slot."
    )
  if not skip:
    return new_w, new_slots
  ok = finite(g)
  return jnp.where(ok, new_w, w), tuple(jnp.where(ok, n, s) for n, s in zip(new_slots, slots))


def unwrap(update_fn: UpdateFn) -> tuple[UpdateFn, bool]:
  """``(the rule, whether non-finite elements are skipped)``."""
  if isinstance(update_fn, SkipNonFinite):
    return update_fn.update_fn, True
  return update_fn, False


def keep_non_finite(g: Array, slots: Sequence[Array], u: Array, new_slots: Sequence[Array]):
  """``(u, new_slots)`` of an update with every element whose gradient is not finite left as it
  was: ``u = -0.0`` there (``w + -0.0`` is ``w`` for every ``w``, ``-0.0`` included, where
  ``+0.0`` would turn ``-0.0`` into ``+0.0``) and each new slot its old value. Per element an
  abs, a compare and one select per stored value; no pass of its own. For callers that return
  ``u``; the kernels use :func:`apply_update`."""
  ok = finite(g)
  u = jnp.where(ok, u, -0.0)
  return u, tuple(jnp.where(ok, n, s) for n, s in zip(new_slots, slots))


@dataclasses.dataclass(frozen=True)
class SkipNonFinite:
  """``update_fn`` guarded against non-finite gradient elements (see :func:`apply_update`):
  hashable and equal by value when ``update_fn`` is (the kernels cache their traces by it).
  Called directly, it returns ``u = -0.0`` and the old slots there (:func:`keep_non_finite`)."""

  update_fn: UpdateFn

  def __call__(self, g, w, slots, scalars):
    u, new_slots = self.update_fn(g, w, slots, scalars)
    return keep_non_finite(g, slots, u, tuple(new_slots))


def skip_non_finite(update_fn: UpdateFn) -> UpdateFn:
  """``update_fn`` that leaves elements with a non-finite gradient unchanged (see the module
  docstring)."""
  return SkipNonFinite(update_fn)


def zero_after(x: Array) -> Array:
  """A float32 zero (0.0 or -0.0) computed from one element of ``x``: adding it to a value
  orders that value's consumers after ``x`` without changing it (XLA cannot fold it away,
  and ``lax.optimization_barrier`` alone does not order on every backend)."""
  token = jnp.ravel(x)[0].astype(jnp.float32)
  return jnp.where(jnp.isfinite(token), token, 0.0) * 0.0
