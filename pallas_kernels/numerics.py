"""Low-precision write-back: stochastic rounding and block-quantized states.

One definition of every conversion between the float32 values a kernel
computes and what is stored, shared by the Triton kernel, the XLA reference
and the optax-protocol path (:mod:`forge_jax`). Everything here is plain
``jnp``/``lax`` arithmetic on float32, int32 and uint32 (add, mul, xor,
shifts, bitcasts, min/max, floor, a max-reduction over the last axis of a
reshaped tile), so it lowers in Pallas Triton, plain XLA and, by design,
Mosaic GPU.

**Stochastic rounding to bfloat16.** A float32 ``x`` lies between two
neighbouring bfloat16 values ``lo <= x <= hi``; it is rounded to ``hi`` with
probability ``(x - lo) / (hi - lo)`` and to ``lo`` otherwise, so
``E[round(x)] = x``: sub-ulp updates survive on average instead of being
lost (round-to-nearest drops every update below half an ulp). bfloat16 is
the top half of a float32, so this is one integer add: the 16 low bits of
``x`` plus 16 uniform random bits carry into the kept half with exactly that
probability; then the low half is cleared.

**Random bits.** A counter-based hash, not a stateful generator: the bits of
an element are ``element_bits(rounding_key(seed, step, layer), index)`` with
``index = row * N + col`` of the element in its [K, N] weight. The same
element of the same step always gets the same bits, whatever the tile shape,
the backend or the order in which tiles run, so runs are reproducible and the
kernel equals its reference bit for bit. The mixer is Wellons' ``lowbias32``
(xor-shift-multiply, a bijection of uint32, avalanche bias ~0.17%), applied
once per element to ``index ^ key`` (the key itself is mixed three times);
for a fixed key the map from index to bits is a permutation, so no two
elements of one weight share bits in one step. Indices wrap modulo 2**32
(only weights of more than 4G elements would repeat bits).

Every consumer of random bits reads the top 16 of the 32 it is given (16 bits
resolve a rounding probability to 2**-16, as bfloat16 stochastic rounding
always did), so one hash serves two stored values: the weight takes the high
half and the second optimizer slot the low half (:func:`value_bits`); the
first and fourth slots share one more mix. The common int8 case (Adam's
second moment rounded stochastically, with or without a stochastically
rounded bfloat16 weight) costs one mix per element in the kernel epilogue.

**Block quantization (8 bits).** A state ``[..., N]`` is stored as int8 codes
of the same shape plus one float32 scale (the block's absolute maximum) per
``block`` consecutive values along the last axis (``[..., N // block]``). A
kernel tile whose ``block_n`` is a multiple of ``block`` holds whole blocks,
so it dequantizes in registers, updates in float32 and re-quantizes with the
new block maximum, without reading any other tile. Codes live in [-127, 127]
(255 levels; -128 is never written). Two maps (:class:`QuantMap`):

* ``"linear"``: ``x ~ code / 127 * absmax`` (signed; unsigned maps spend all
  255 levels on [0, absmax]). Round to nearest; error <= absmax / 254 per
  element (unsigned: absmax / 508).
* ``"float"``: a minifloat relative to the block maximum: ``m`` mantissa bits
  and the remaining bits of exponent, decoded by building a float32 from the
  code's bits (``(code + base) << (23 - m)``), so it costs integer adds and
  shifts, no table lookup. Relative error <= 2**-(m+1) per element over
  ``(255 or 127) / 2**m`` octaves below the block maximum. Code 0 is exact
  zero. Below the range, signed maps flush to zero and unsigned maps clamp to
  the smallest positive code: a second moment is never rounded to 0 (which
  would make ``m / (sqrt(v) + eps)`` explode), only overestimated.

Either map rounds to nearest or stochastically (``QuantMap.rounding``, with
the element's bits from :func:`value_bits`: independent of the weight's). A
state that moves by much less than a code step per update (AdamW's second
moment moves by ``1 - b2 = 0.1%``) sticks under round-to-nearest; stochastic
rounding follows it without bias, at an error of up to one code step.

See ``docs/precision.md`` for the choice per optimizer state and measured
errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_U32 = jnp.uint32
_F32 = jnp.float32
_I32 = jnp.int32
CODE_DTYPE = jnp.dtype(jnp.int8)
SCALE_DTYPE = jnp.dtype(jnp.float32)
# y + 1.5 * 2**23 is a float32 whose bits are _ROUND_MAGIC_BITS + round(y) for |y| < 2**22.
_ROUND_MAGIC = np.float32(1.5 * 2**23)
_ROUND_MAGIC_BITS = int(np.float32(1.5 * 2**23).view(np.int32))
_MIN_NORMAL = float(np.finfo(np.float32).tiny)


# ----------------------------------------------------------------------------
# Counter-based random bits.
# ----------------------------------------------------------------------------


def _u32(value) -> Array:
  """uint32 of an int (negative ints and int32 arrays wrap, bit for bit)."""
  if isinstance(value, (int, np.integer)):
    return jnp.asarray(np.uint32(int(value) % 2**32))
  value = jnp.asarray(value)
  if value.dtype == jnp.dtype(jnp.int32):
    return lax.bitcast_convert_type(value, _U32)
  return value.astype(_U32)


def mix32(x: Array) -> Array:
  """Wellons' ``lowbias32``: a bijective uint32 -> uint32 mixer."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def rounding_key(seed, step, layer=0) -> Array:
  """The uint32 key of one (seed, step, layer): all three absorbed and mixed.

  Args:
    seed: int or int32/uint32 scalar (callers fold a per-weight stream id
      into it, see :func:`stream_seed`).
    step: the optimizer step (int32 scalar, may be traced).
    layer: index into stacked weights (0 for an unstacked weight).
  """
  k = mix32(_u32(seed) + np.uint32(0x9E3779B9))
  k = mix32(k ^ _u32(step))
  return mix32(k + _u32(layer))


def stream_seed(seed, stream) -> Array:
  """Folds a stream id (which weight) into a seed, as a uint32 (computed on the host, with
  numpy's wrapping uint32 arrays, when both are ints, as every FORGE layer's are)."""
  if all(isinstance(v, (int, np.integer)) for v in (seed, stream)):
    host = lambda v: np.array([int(v) % 2**32], np.uint32)
    return jnp.asarray(mix32(host(seed) ^ mix32(host(stream) + np.uint32(0x632BE5AB)))[0])
  return mix32(_u32(seed) ^ mix32(_u32(stream) + np.uint32(0x632BE5AB)))


def element_bits(key: Array, index: Array) -> Array:
  """32 uniform bits per element from the key and the element's uint32 index."""
  return mix32(_u32(index) ^ key)


def value_bits(bits: Array, i: int) -> Array:
  """The bits of the ``i``-th stored value of an element (0: the weight, ``j + 1``: slot ``j``),
  independent across ``i``, in the top 16 bits (what every consumer reads).

  Values ``0`` and ``2`` are the two halves of ``bits`` itself; ``1`` and ``3`` the halves of
  one more mix, ``4`` and ``6`` of another, and so on. The pairing puts the weight and Adam's
  second moment (the slot that int8 stores with stochastic rounding by default) in one hash.
  lowbias32 ends with ``x ^ (x >> 16)``, so its low half is the xor of two halves of a uniform
  word and independent of its high half.
  """
  if i < 0:
    raise ValueError(f"value_bits: i={i} must be >= 0 (0 is the weight, j + 1 slot j)")
  pair = (i & 1) | ((i >> 2) << 1)
  h = bits if pair == 0 else mix32(bits + np.uint32((0x9E3779B9 * pair) % 2**32))
  return h << np.uint32(16) if (i >> 1) & 1 else h


def element_index(rows: Array, cols: Array, n: int) -> Array:
  """``row * n + col`` in uint32 (wrapping), broadcast over rows x cols."""
  return _u32(rows) * np.uint32(n % 2**32) + _u32(cols)


def matrix_index(shape: Sequence[int]) -> Array:
  """The uint32 element index of every entry of an array of ``shape``.

  Its flat position: for a 2-d [K, N] weight, ``row * N + col``, the index
  the kernel computes per tile.
  """
  size = int(np.prod(shape, dtype=np.int64))
  return lax.iota(_U32, size).reshape(tuple(shape))


# ----------------------------------------------------------------------------
# Stochastic rounding.
# ----------------------------------------------------------------------------


def stochastic_round(x: Array, bits: Array, dtype) -> Array:
  """Rounds float32 ``x`` to ``dtype`` up or down, unbiased, with ``bits``.

  ``dtype`` bfloat16: rounds to one of the two bfloat16 neighbours of ``x``
  with probability proportional to the distance to the other one (16 random
  bits: probabilities are multiples of 2**-16). float32: ``x`` unchanged.
  NaN stays NaN, infinities stay infinite; values beyond the largest
  bfloat16 may round to infinity, as round-to-nearest does.

  Raises:
    ValueError: for any other ``dtype``.
  """
  dtype = jnp.dtype(dtype)
  x = x.astype(_F32)
  if dtype == jnp.dtype(_F32):
    return x
  if dtype != jnp.dtype(jnp.bfloat16):
    raise ValueError(
        f"stochastic rounding to dtype={dtype} is not supported: it is defined for "
        "bfloat16 (the top half of a float32) and float32 (no rounding); store the "
        "weight in bfloat16 or use weight_rounding='nearest'."
    )
  xb = lax.bitcast_convert_type(x, _U32)
  rounded = (xb + (bits >> np.uint32(16))) & np.uint32(0xFFFF0000)
  # A NaN whose payload sits in the low half would lose it and become inf.
  rounded = jnp.where(x != x, xb, rounded)
  # The low half is zero: the conversion below is exact.
  return lax.bitcast_convert_type(rounded, _F32).astype(dtype)


# ----------------------------------------------------------------------------
# Quantization maps.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantMap:
  """How a value relative to its block maximum becomes an 8-bit code.

  Attributes:
    kind: ``"linear"`` (uniform steps) or ``"float"`` (a minifloat: uniform
      relative precision over many octaves).
    signed: whether values can be negative (a first moment) or not (a second
      moment, an AdaGrad accumulator).
    mantissa_bits: for ``"float"``: bits of mantissa (relative error
      <= 2**-(mantissa_bits+1)); the rest of the 8 bits are exponent.
    rounding: ``"nearest"`` or ``"stochastic"`` (unbiased: rounds up with
      probability proportional to the distance to the lower code, resolved to
      2**-16 by the top 16 of the element's random bits; error < one code
      step instead of half).
  """

  kind: str = "linear"
  signed: bool = True
  mantissa_bits: int = 3
  rounding: str = "nearest"

  def __post_init__(self):
    if self.kind not in ("linear", "float"):
      raise ValueError(f"QuantMap.kind={self.kind!r} must be 'linear' or 'float'.")
    if self.rounding not in ("nearest", "stochastic"):
      raise ValueError(f"QuantMap.rounding={self.rounding!r} must be 'nearest' or 'stochastic'.")
    if not 1 <= self.mantissa_bits <= 6:
      raise ValueError(f"QuantMap.mantissa_bits={self.mantissa_bits} must be in [1, 6].")

  @property
  def max_code(self) -> int:
    """The largest code magnitude: 127 signed, 254 unsigned (then offset by -127)."""
    return 127 if self.signed else 254

  @property
  def octaves(self) -> float:
    """For ``"float"``: how many octaves below the block maximum are representable."""
    return (self.max_code - 1) / 2**self.mantissa_bits

  @property
  def name(self) -> str:
    sign = "signed" if self.signed else "unsigned"
    sr = ", SR" if self.rounding == "stochastic" else ""
    if self.kind == "linear":
      return f"{sign} linear{sr}"
    exp = 8 - (1 if self.signed else 0) - self.mantissa_bits
    return f"{sign} float e{exp}m{self.mantissa_bits}{sr}"

  # The bit pattern of the float32 that magnitude code 0 would stand for, so
  # that code max_code is exactly 1.0 (float32 bits 127 << 23).
  def _base(self) -> int:
    return (127 << self.mantissa_bits) - self.max_code

  # A block's values reach the map as ``x * encode_factor(1 / absmax)``, and its codes leave it
  # as ``decode_scaled(codes, decode_factor(absmax))``: one multiply per block folds the linear
  # map's code step into the block's scale, so an element costs one multiply each way.

  def encode_factor(self, inv_absmax: Array) -> Array:
    """What a block's values are multiplied by before :meth:`encode_scaled`, from ``1 / absmax``
    (per block): the linear maps count in code steps, the float maps in fractions of absmax."""
    return inv_absmax * float(self.max_code) if self.kind == "linear" else inv_absmax

  def decode_factor(self, scale: Array) -> Array:
    """What :meth:`decode_scaled` multiplies a block's codes by, from its scale (per block)."""
    return scale * (1.0 / self.max_code) if self.kind == "linear" else scale

  def encode(self, x_rel: Array, bits: Optional[Array] = None) -> Array:
    """int32 codes in [-127, 127] of ``x_rel = x / absmax`` (clipped to [-1, 1]).

    ``bits`` (uint32 per element) are needed by stochastic rounding.
    """
    return self.encode_scaled(jnp.clip(x_rel, -1.0, 1.0) * self.encode_factor(1.0), bits)

  def encode_scaled(self, y: Array, bits: Optional[Array] = None) -> Array:
    """int32 codes of ``y = x * encode_factor(1 / absmax)``."""
    stochastic = self.rounding == "stochastic"
    if stochastic and bits is None:
      raise ValueError("QuantMap(rounding='stochastic') needs the element bits (bits=None given).")
    if self.kind == "linear" and not stochastic:
      # Nearest (ties to even), sign included: adding 1.5 * 2**23 leaves round(y) in the float's
      # low mantissa bits (|y| <= max_code * (1 + 3 ulp) < 2**22 here), and the int8 store keeps
      # the low byte. The min / max between y's product and the add is needed: without it XLA and
      # LLVM may contract the two into one fma, which rounds once, where a program's fusions
      # decide (a weight split over devices then got other codes than the whole one).
      y, shift = ((jnp.minimum(y, float(self.max_code)), 0) if self.signed
                  else (jnp.maximum(y, 0.0), 127))
      return lax.bitcast_convert_type(y + _ROUND_MAGIC, _I32) - (_ROUND_MAGIC_BITS + shift)
    mag = jnp.abs(y) if self.signed else jnp.maximum(y, 0.0)
    if self.kind == "linear":  # stochastic: + a uniform [0, 1) (the top 16 bits), then floor
      offset = (bits >> np.uint32(16)).astype(_F32) * 2.0**-16
      # The conversion truncates, which is floor here (the operand is >= 0), and
      # lowers where floor does not (Mosaic GPU, warpgroup semantics).
      q = (mag + offset).astype(_I32)
      q = jnp.minimum(q, self.max_code)
    else:
      m = self.mantissa_bits
      mbits = lax.bitcast_convert_type(mag, _I32)
      # Add half a code step (nearest) or a uniform fraction of one
      # (stochastic: the top 16 bits, at the top of the dropped bits) to the
      # float32 bits, then drop the bits below the code.
      if stochastic:
        offset = lax.bitcast_convert_type((bits >> np.uint32(16)) << np.uint32(7 - m), _I32)
      else:
        offset = 1 << (22 - m)
      q = ((mbits + offset) >> (23 - m)) - self._base()
      low = 0 if self.signed else 1  # never round a positive second moment to 0
      q = jnp.where(mag > 0.0, jnp.clip(q, low, self.max_code), 0)
    if self.signed:
      return jnp.where(y < 0.0, -q, q)
    return q - 127

  def decode(self, codes: Array) -> Array:
    """float32 values relative to the block maximum of int codes."""
    return self.decode_scaled(codes, self.decode_factor(1.0))

  def decode_scaled(self, codes: Array, factor: Array) -> Array:
    """float32 values of int codes whose block's :meth:`decode_factor` is ``factor``."""
    c = codes.astype(_I32)
    if self.kind == "linear":  # a signed code carries its sign: no abs, no select
      return (c if self.signed else c + 127).astype(_F32) * factor
    mag = jnp.abs(c) if self.signed else c + 127
    m = self.mantissa_bits
    xbits = (mag + self._base()) << (23 - m)
    # Code 0 stands for 0.0. Tested on the shifted bits, which code 0 alone gives, not on the
    # code: on a GPU a test of the code reads the stored byte a second time, zero-extended (one
    # more byte permute an element in the Mosaic kernel's SASS).
    x = jnp.where(xbits == self._base() << (23 - m), 0.0, lax.bitcast_convert_type(xbits, _F32))
    if self.signed:
      x = jnp.where(c < 0, -x, x)
    return x * factor


# ----------------------------------------------------------------------------
# Codecs: how a float32 value is stored and read back.
# ----------------------------------------------------------------------------


class Codec:
  """The stored form of one array (a weight or an optimizer-state slot).

  A stored value is made of one or more *parts* (arrays); part ``i`` has one
  column per ``col_divisors[i]`` columns of the logical array (1 for a full
  array, ``block`` for per-block scales), so a kernel tile of columns
  ``[n0, n0 + bn)`` reads columns ``[n0 / d, (n0 + bn) / d)`` of that part.
  ``decode`` and ``encode`` work on tiles or whole arrays alike (last axis =
  columns).
  """

  @property
  def needs_bits(self) -> bool:
    """Whether ``encode`` needs per-element random bits."""
    return False

  def parts(self, value) -> tuple[Array, ...]:
    return (value,)

  def rebuild(self, parts: Sequence[Array]):
    (value,) = parts
    return value

  def col_divisors(self) -> tuple[int, ...]:
    return (1,)

  def decode(self, parts: Sequence[Array]) -> Array:
    (value,) = parts
    return value.astype(_F32)

  def encode(self, x: Array, dtypes: Sequence[Any], bits: Optional[Array] = None) -> tuple[Array, ...]:
    raise NotImplementedError

  def check(self, shape: Sequence[int], name: str) -> None:
    """Raises a ValueError if an array of ``shape`` cannot use this codec."""


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """A float array; written back with round-to-nearest (``astype``)."""

  def encode(self, x, dtypes, bits=None):
    del bits
    return (x.astype(dtypes[0]),)


@dataclasses.dataclass(frozen=True)
class StochasticRound(Codec):
  """A float array; written back with :func:`stochastic_round`."""

  @property
  def needs_bits(self) -> bool:
    return True

  def encode(self, x, dtypes, bits=None):
    if bits is None:
      raise ValueError("StochasticRound.encode needs the element bits (bits=None given).")
    return (stochastic_round(x, bits, dtypes[0]),)


@dataclasses.dataclass(frozen=True)
class BlockQuantized(Codec):
  """int8 codes + one float32 absmax per ``block`` values along the last axis.

  The scales of a matrix ``[..., K, N]`` are stored block-major, ``[..., N // block, K]``
  (:meth:`scale_shape`): one row per block column, so the scales of a block column's rows are
  contiguous, as the Mosaic kernel reads and writes them (one TMA box per sub-tile, in place).
  A vector's are ``[N // block]``.

  Attributes:
    qmap: the code map (:class:`QuantMap`).
    block: values per scale; a power of two, and the last axis must be a
      multiple of it.
  """

  qmap: QuantMap = QuantMap()
  block: int = 64

  def __post_init__(self):
    if self.block < 1 or self.block & (self.block - 1):
      raise ValueError(f"block={self.block} must be a power of two (the kernel's tiles are).")

  @property
  def needs_bits(self) -> bool:
    return self.qmap.rounding == "stochastic"

  def parts(self, value):
    if not isinstance(value, QuantizedArray):
      raise TypeError(f"expected a QuantizedArray, got {type(value).__name__}")
    return (value.codes, value.scale)

  def rebuild(self, parts):
    codes, scale = parts
    return QuantizedArray(codes, scale, self)

  def col_divisors(self):
    return (1, self.block)

  def check(self, shape, name):
    if len(shape) < 1 or shape[-1] % self.block:
      raise ValueError(
          f"{name} has shape {tuple(shape)}: its last axis must be a multiple of the "
          f"quantization block={self.block} (blocks run along the last axis, N). Pad N, "
          "choose a block that divides it, or keep this state in a float dtype."
      )

  def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The scales' shape for codes of ``shape``: ``[..., N // block, K]`` (block-major) for a
    matrix or a stack of them, ``[N // block]`` for a vector."""
    shape = tuple(shape)
    blocks = shape[-1] // self.block
    return (blocks,) if len(shape) < 2 else shape[:-2] + (blocks, shape[-2])

  @staticmethod
  def _swap(a: Array, ndim: int) -> Array:
    """Block-major scales <-> ``[..., K, N // block]`` (row-major, as the blocks lie)."""
    return a if ndim < 2 else jnp.swapaxes(a, -1, -2)

  def _blocks(self, x: Array) -> Array:
    return x.reshape(x.shape[:-1] + (x.shape[-1] // self.block, self.block))

  def _expand(self, per_block: Array, n: int) -> Array:
    """[..., N // block] -> [..., N], each value repeated over its block."""
    b = jnp.broadcast_to(per_block[..., None], per_block.shape + (self.block,))
    return b.reshape(per_block.shape[:-1] + (n,))

  def _codes(self, x: Array, absmax: Array, spread, bits: Optional[Array]) -> Array:
    """int32 codes of ``x`` relative to its blocks' ``absmax``; ``spread`` maps a
    per-block array onto ``x``'s shape (after the per-block arithmetic). A block whose largest
    magnitude is below the smallest normal float32 (2**-126) stores zeros, as flush-to-zero
    arithmetic would: its ``1 / absmax`` would overflow."""
    inv = jnp.where(absmax >= _MIN_NORMAL, 1.0 / absmax, 0.0)
    return self.qmap.encode_scaled(x * spread(self.qmap.encode_factor(inv)), bits)

  def decode(self, parts):
    codes, scale = parts
    factor = self.qmap.decode_factor(self._swap(scale, codes.ndim).astype(_F32))
    return self.qmap.decode_scaled(codes, self._expand(factor, codes.shape[-1]))

  def encode(self, x, dtypes=None, bits=None):
    del dtypes
    x = x.astype(_F32)
    absmax = jnp.max(jnp.abs(self._blocks(x)), axis=-1)
    codes = self._codes(x, absmax, lambda v: self._expand(v, x.shape[-1]), bits)
    return codes.astype(CODE_DTYPE), self._swap(absmax, x.ndim).astype(SCALE_DTYPE)

  # The same codec for a tile whose rows are exactly one block each (a [M, block]
  # float32 tile, one scale per row), as the Mosaic GPU epilogue holds it: no
  # reshape, and the per-row values reach the elements by broadcast_in_dim, which
  # Mosaic GPU's warpgroup lowering supports.

  def _rows(self, per_row: Array, shape) -> Array:
    return lax.broadcast_in_dim(per_row, tuple(shape), tuple(range(len(shape) - 1)))

  def decode_block_rows(self, codes: Array, scale: Array) -> Array:
    """float32 values of ``codes`` [..., block] with one ``scale`` per row [...]."""
    factor = self.qmap.decode_factor(scale.astype(_F32))
    return self.qmap.decode_scaled(codes, self._rows(factor, codes.shape))

  def encode_block_rows(self, x: Array, bits: Optional[Array] = None) -> tuple[Array, Array]:
    """``(int32 codes, float32 per-row absmax)`` of ``x`` [..., block]: ``encode`` with one
    block per row."""
    absmax = jnp.max(jnp.abs(x), axis=-1)
    return self._codes(x, absmax, lambda v: self._rows(v, x.shape), bits), absmax

  def quantize(self, x: Array, bits: Optional[Array] = None) -> "QuantizedArray":
    """The :class:`QuantizedArray` of a whole float array."""
    self.check(jnp.shape(x), "the array")
    if self.needs_bits and bits is None:
      # Initial values (zeros, constants) are exact in either rounding.
      bits = jnp.zeros(jnp.shape(x), _U32)
    return self.rebuild(self.encode(jnp.asarray(x), bits=bits))


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A block-quantized array: int8 ``codes`` and float32 per-block ``scale``.

  A pytree with two array leaves (``codes`` [..., K, N], ``scale`` [..., N // block, K],
  block-major: :meth:`BlockQuantized.scale_shape`); the codec is static metadata. ``shape`` is
  the logical shape.
  """

  codes: Array
  scale: Array
  codec: BlockQuantized = BlockQuantized()

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.codes.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(self.codes.nbytes + self.scale.nbytes)

  def dequantize(self) -> Array:
    return self.codec.decode((self.codes, self.scale))


jax.tree_util.register_dataclass(QuantizedArray, data_fields=["codes", "scale"], meta_fields=["codec"])


def codec_of(value, default: Codec = Cast()) -> Codec:
  """The codec of a stored slot: its own if quantized, else ``default``."""
  return value.codec if isinstance(value, QuantizedArray) else default


def store_cast(value: Array, dtype) -> Array:
  """Round-to-nearest write-back of a float32 result (the default codec)."""
  return Cast().encode(value, (dtype,))[0]
