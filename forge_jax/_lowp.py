"""Low-precision storage of weights and optimizer states: :class:`Precision`.

A :class:`Precision` says how an optimizer stores what it writes:

* ``weight_rounding``: how a new bfloat16 weight is rounded from its float32
  value: ``"nearest"`` (what ``optax.apply_updates`` does) or
  ``"stochastic"`` (unbiased: sub-ulp updates survive on average). float32
  weights are exact either way; they are the "master weights" to compare with.
* ``state_dtype``: the storage of the optimizer-state slots: ``None`` (the
  optimizer's own choice: the parameter's dtype, or ``mu_dtype``), a float
  dtype for every slot, or ``"int8"``: codes + one float32 scale per
  ``block_size`` values along the last axis, dequantized, updated in float32
  and re-quantized on write-back, with a quantization map chosen per slot
  (signed first moments, non-negative second moments).

The conversions themselves live in :mod:`pallas_kernels.numerics`, shared by
the fused kernel, the XLA backend and the optax-protocol path here.
``Precision()`` is exactly the behaviour without one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import numerics
from pallas_kernels.numerics import QuantMap, QuantizedArray

WEIGHT_ROUNDINGS = ("nearest", "stochastic")
NONFINITE = ("skip", "propagate")
# Second moments are squares (or sums of squares): a signed map would waste
# its sign bit and a linear one its small values.
NONNEGATIVE_SLOTS = frozenset({"nu", "sum_of_squares"})

# Default maps (docs/precision.md has the measurements behind them). With
# blocks of 64 a first moment spans a small range, where a uniform grid is
# the most precise. A second moment spans many octaves even within a block
# (it is a square), where a minifloat keeps the relative error bounded; and
# it moves by ~(1 - b2) = 0.1% a step, far below one code step, so round to
# nearest sticks (measured: a growing v lags by ~40% after 400 steps and the
# run trains with steps ~25% too large) while stochastic rounding follows it
# unbiased.
DEFAULT_SIGNED_MAP = QuantMap("linear", signed=True)
DEFAULT_UNSIGNED_MAP = QuantMap("float", signed=False, mantissa_bits=4, rounding="stochastic")

# The float dtype that carries int8 codes through autodiff (see to_float_view).
# fnuz: no negative zero, and its one NaN pattern (0x80, int8 -128) is never a
# code, so even an accidental `+ 0` would leave every code's bits unchanged.
VIEW_DTYPE = jnp.dtype(jnp.float8_e4m3fnuz)


@dataclasses.dataclass(frozen=True)
class Precision:
  """Storage precision of an optimizer's weight write-back and state slots.

  Pass it to any forge_jax optimizer (``forge_jax.adamw(..., precision=p)``);
  FORGE layers, the XLA backend and the optax ``init``/``update`` then all
  store the same way. (Not to be confused with ``Dense.precision``, the
  matmul precision.)

  Attributes:
    weight_rounding: ``"nearest"`` or ``"stochastic"``. Applies to bfloat16
      weights: each new weight is rounded up or down with probability
      proportional to its distance to the two neighbouring bfloat16 values,
      with random bits hashed from (``seed``, step, weight, layer, element
      index): reproducible and independent of tiling. float32 weights are
      stored exactly (no rounding to choose). Other dtypes: ValueError.
    state_dtype: ``None`` (the optimizer's default), a float dtype for every
      slot (e.g. ``"bfloat16"``), or ``"int8"`` (or ``jnp.int8``): block-quantized.
    block_size: values per float32 scale of int8 states (a power of two);
      blocks run along the last axis, which must be a multiple of it.
    signed_map: the int8 map of signed slots (first moments, traces).
    unsigned_map: the int8 map of non-negative slots (second moments).
    min_quantized_size: arrays with fewer elements keep float32 states under
      ``state_dtype="int8"`` (as bitsandbytes' ``min_8bit_size``): biases,
      norms and small layers, where quantization saves nothing worth its error.
    seed: the stochastic-rounding seed.
    nonfinite: what a FORGE kernel's element whose gradient is NaN or
      infinite does in the fused update (every backend, ``"xla"`` included):
      ``"skip"`` (the default): its weight and every state keep their old
      values (an int8 state's element is re-encoded from its old value with
      the block's other, updated values); ``"propagate"``: the rule runs on
      it as on any value (the weight and states become NaN or infinite, as
      with optax). The optax ``update`` (the parameters FORGE does not
      manage) has no guard: it stays optax's arithmetic and propagates.
  """

  weight_rounding: str = "nearest"
  state_dtype: Any = None
  block_size: int = 64
  signed_map: QuantMap = DEFAULT_SIGNED_MAP
  unsigned_map: QuantMap = DEFAULT_UNSIGNED_MAP
  min_quantized_size: int = 4096
  seed: int = 0
  nonfinite: str = "skip"

  def __post_init__(self):
    if self.nonfinite not in NONFINITE:
      raise ValueError(
          f"nonfinite={self.nonfinite!r} must be one of {NONFINITE}: 'skip' leaves an element "
          "whose gradient is not finite unchanged, 'propagate' updates it as any other."
      )
    if self.weight_rounding not in WEIGHT_ROUNDINGS:
      raise ValueError(
          f"weight_rounding={self.weight_rounding!r} must be one of {WEIGHT_ROUNDINGS}."
      )
    if self.state_dtype is not None and not isinstance(self.state_dtype, str):
      try:
        if jnp.dtype(self.state_dtype) == jnp.int8:  # jnp.int8 means the int8 codec
          object.__setattr__(self, "state_dtype", "int8")
      except TypeError:
        pass
    if self.state_dtype is not None and self.state_dtype != "int8":
      try:
        dtype = jnp.dtype(self.state_dtype)
      except TypeError:
        dtype = None
      if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"state_dtype={self.state_dtype!r} must be None, a float dtype (e.g. "
            "'bfloat16', 'float32') or 'int8'."
        )
      object.__setattr__(self, "state_dtype", dtype)
    for name in ("block_size", "min_quantized_size", "seed"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an int.")
    if self.block_size < 1 or self.block_size & (self.block_size - 1):
      raise ValueError(f"block_size={self.block_size} must be a power of two (64 by default).")
    if self.signed_map.signed is not True or self.unsigned_map.signed is not False:
      raise ValueError(
          f"signed_map={self.signed_map} must be a signed QuantMap and "
          f"unsigned_map={self.unsigned_map} an unsigned one."
      )
    if self.min_quantized_size < 0:
      raise ValueError(f"min_quantized_size={self.min_quantized_size} must be >= 0.")

  @property
  def stochastic(self) -> bool:
    return self.weight_rounding == "stochastic"

  @property
  def skips_non_finite(self) -> bool:
    return self.nonfinite == "skip"

  def codec(self, slot_name: str) -> numerics.BlockQuantized:
    """The int8 codec of a slot (by its optax name)."""
    qmap = self.unsigned_map if slot_name in NONNEGATIVE_SLOTS else self.signed_map
    return numerics.BlockQuantized(qmap, self.block_size)

  def quantizes(self, shape) -> bool:
    """Whether a parameter of ``shape`` gets int8 states."""
    size = 1
    for d in shape:
      size *= d
    return self.state_dtype == "int8" and len(shape) >= 1 and size >= self.min_quantized_size


DEFAULT = Precision()


def check_rule(rule, precision: Precision) -> None:
  """A ValueError when the rule's own slot dtype and ``state_dtype`` are both set."""
  if precision.state_dtype is None:
    return
  for name in ("mu_dtype", "accumulator_dtype"):
    value = getattr(rule, name, None)
    if value is not None:
      raise ValueError(
          f"forge_jax.{rule.name}: {name}={value!r} and precision.state_dtype="
          f"{precision.state_dtype!r} both set the state's storage; pass only one."
      )


def init_slots(rule, precision: Precision, w) -> tuple:
  """The initial slots of one parameter, stored as ``precision`` says.

  Every rule's initial slots are constants (``rule.slot_init_values()``), so
  they are built directly in their storage form: a float ``state_dtype`` is
  filled in that dtype, and int8 states quantize one block of the constant
  and broadcast its (single) code and scale. No float32 array of the
  parameter's size is made: outside ``jit`` (``optimizer.init`` of a large
  embedding, say) that detour and the quantizer's temporaries were each
  allocated in turn (3.7 GiB of peak for Qwen3-0.6B's embedding, now 0.37;
  ``experiments/int8_init_memory.py`` at commit 2b67016).
  """
  if precision.state_dtype is None:
    return rule.init_slots(w)
  shape = tuple(jnp.shape(w))
  if precision.state_dtype != "int8":
    return tuple(jnp.full(shape, v, precision.state_dtype) for v in rule.slot_init_values())
  if not precision.quantizes(shape):
    return rule.init_slots(jnp.zeros(shape, jnp.float32))
  if shape[-1] % precision.block_size:
    raise ValueError(
        f"state_dtype='int8': a parameter of shape {shape} has a last axis that is not a "
        f"multiple of block_size={precision.block_size} (blocks run along the last "
        "axis, N). Pad N, choose a block_size that divides it, or set "
        f"min_quantized_size above its size ({w.size}) to keep its states in float32."
    )
  slots = []
  for name, value in zip(rule.slot_names, rule.slot_init_values()):
    block = precision.codec(name).quantize(jnp.full((precision.block_size,), value, jnp.float32))
    slots.append(dataclasses.replace(
        block,
        codes=jnp.broadcast_to(block.codes[0], shape),  # a constant: one code throughout
        scale=jnp.broadcast_to(block.scale[0], block.codec.scale_shape(shape)),
    ))
  return tuple(slots)


def decode_slot(slot, dtype) -> jax.Array:
  """A stored slot as an array of the compute ``dtype``."""
  if isinstance(slot, QuantizedArray):
    return slot.dequantize().astype(dtype)
  return jnp.asarray(slot).astype(dtype)


def encode_slot(value, like, bits=None):
  """``value`` stored the way ``like`` is (round to nearest, or re-quantized)."""
  if isinstance(like, QuantizedArray):
    return like.codec.rebuild(like.codec.encode(value, bits=bits))
  return value.astype(like.dtype)


def weight_codec(precision: Precision, w_dtype) -> numerics.Codec:
  """The kernel's write-back of a weight of ``w_dtype``."""
  if precision.stochastic and jnp.dtype(w_dtype) != jnp.dtype(jnp.float32):
    return numerics.StochasticRound()
  return numerics.Cast()


def element_bits(precision: Precision, shape, step, stream: Union[int, jax.Array]) -> jax.Array:
  """The optax path's random bits of one parameter (value 0: the weight).

  The element index is the flat position in the leaf (``row * N + col`` for
  a 2-d weight, as the kernel) and the stream (which leaf) is folded into
  the seed; slot ``j`` uses ``numerics.value_bits(bits, j + 1)`` as the
  kernel does.
  """
  key = numerics.rounding_key(numerics.stream_seed(precision.seed, stream), step, 0)
  return numerics.element_bits(key, numerics.matrix_index(tuple(shape)))


# ----------------------------------------------------------------------------
# int8 codes through autodiff.
# ----------------------------------------------------------------------------


def _is_quantized(x) -> bool:
  return isinstance(x, QuantizedArray)


def to_float_view(tree):
  """``tree`` with the int8 codes of every QuantizedArray bitcast to a float8 dtype.

  A FORGE layer returns its new optimizer state as the *cotangent* of the
  state; JAX drops cotangents of integer inputs (their tangent space is
  float0), so int8 codes cannot travel that way. Their bits can, in a float
  dtype of the same width: :func:`forge_jax.train_step` differentiates with
  respect to this view and turns the result back with
  :func:`from_float_view`; no arithmetic ever touches the codes.
  """

  def view(x):
    if _is_quantized(x) and x.codes.dtype == numerics.CODE_DTYPE:
      return dataclasses.replace(x, codes=jax.lax.bitcast_convert_type(x.codes, VIEW_DTYPE))
    return x

  return jax.tree.map(view, tree, is_leaf=_is_quantized)


def from_float_view(tree):
  """The inverse of :func:`to_float_view` (int8 codes again)."""

  def unview(x):
    if _is_quantized(x) and x.codes.dtype == VIEW_DTYPE:
      return dataclasses.replace(x, codes=jax.lax.bitcast_convert_type(x.codes, numerics.CODE_DTYPE))
    return x

  return jax.tree.map(unview, tree, is_leaf=_is_quantized)


def view_like(value, like):
  """``value`` (int8 codes) in ``like``'s representation (int8 or float view)."""
  if _is_quantized(like) and like.codes.dtype == VIEW_DTYPE:
    return to_float_view(value)
  return value


# ----------------------------------------------------------------------------
# Memory.
# ----------------------------------------------------------------------------


def stored_bytes(tree) -> int:
  """Bytes of every array in ``tree`` (a QuantizedArray counts codes + scales)."""
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def bytes_per_param(optimizer, shape, w_dtype) -> dict:
  """Bytes per parameter of a weight of ``shape`` and its state, from real sizes.

  Uses ``jax.eval_shape`` of ``optimizer.init`` (nothing is allocated); the
  step count is left out (4 bytes per array, not per parameter).
  """
  w = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(w_dtype))
  state = jax.eval_shape(optimizer.init, w)
  n = 1
  for d in shape:
    n *= d
  weights = stored_bytes(w) / n
  states = stored_bytes(optimizer.rule.slots_of(state)) / n  # a stabilizer's scalars left out too
  return {"weights": weights, "states": states, "total": weights + states}
