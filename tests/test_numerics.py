"""Stochastic rounding and block quantization (pallas_kernels.numerics), and the
kernel's codecs against the jnp reference in interpret mode.

Exact comparisons. Where the kernel and the reference must agree bit for bit
(stochastic rounding, quantized codes, tile-shape independence), the inputs
are small integers, so ``x.T @ dy`` is exact in float32 in any summation
order and the only thing that can differ is what is under test: the random
bits, the block bookkeeping, the masks. With random inputs the float32
gradient differs in its last bits between the two (summation order), which
moves a stochastic rounding across its threshold with probability ~2**-16
per element and ulp of difference; that case is tested with a bound on the
fraction of elements one bfloat16 ulp apart.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from pallas_kernels import numerics as nm
from pallas_kernels import TileConfig, fused_dw_update, fused_dw_update_reference
from tests._lowering import lower_for_cuda

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

F32, BF16 = jnp.float32, jnp.bfloat16
SMALL = TileConfig(block_k=32, block_n=64, block_t=16, num_warps=4, num_stages=2)
OTHER = TileConfig(block_k=64, block_n=128, block_t=16, num_warps=4, num_stages=2)
LINEAR = nm.QuantMap("linear", signed=True)
UFLOAT = nm.QuantMap("float", signed=False, mantissa_bits=3)
UFLOAT_SR = nm.QuantMap("float", signed=False, mantissa_bits=4, rounding="stochastic")


def _bf16_neighbours(x):
  """(lo, hi): the bfloat16 values around float32 x (by truncation of the bits)."""
  bits = np.asarray(x, np.float32).view(np.uint32)
  lo = (bits & 0xFFFF0000).view(np.float32)
  hi = ((bits & 0xFFFF0000) + 0x10000).view(np.float32)
  exact = (bits & 0xFFFF) == 0
  return lo, np.where(exact, lo, hi)


def _sr(x, seed=0, step=0, layer=0):
  key = nm.rounding_key(seed, step, layer)
  bits = nm.element_bits(key, nm.matrix_index(jnp.shape(x)))
  return np.asarray(nm.stochastic_round(jnp.asarray(x, F32), bits, BF16).astype(F32))


# ----------------------------------------------------------------------------
# Stochastic rounding.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [1.0 + 2**-9, -1.0 - 3 * 2**-10, 0.1, 3.0e-3 + 1e-7, -7.77e5, 1.2e-38, 2.0 ** -8 * 1.0001],
)
def test_stochastic_rounding_is_unbiased_and_stays_between_neighbours(value):
  n = 200_000
  x = np.full((n,), value, np.float32)
  r = _sr(x, seed=3, step=11)
  lo, hi = map(float, _bf16_neighbours(np.float32(value)))
  assert set(np.unique(r).tolist()) <= {lo, hi}
  p = (np.float64(np.float32(value)) - lo) / (np.float64(hi) - lo)
  # Round-ups (away from zero) are Bernoulli(p) up to the 2**-16 resolution of the bits.
  se = abs(np.float64(hi) - lo) * np.sqrt(max(p * (1 - p), 2**-16) / n)
  assert abs(r.astype(np.float64).mean() - np.float32(value)) <= 5 * se + abs(hi - lo) * 2**-16


def test_stochastic_rounding_over_steps_of_one_element_is_unbiased():
  # The same element rounded at 4096 different steps (the sequence a weight sees).
  value = np.float32(0.3 + 1e-4)
  lo, hi = map(float, _bf16_neighbours(value))
  steps = jnp.arange(4096, dtype=jnp.int32)
  keys = jax.vmap(lambda s: nm.rounding_key(1, s, 0))(steps)
  bits = jax.vmap(lambda k: nm.element_bits(k, jnp.uint32(5)))(keys)
  rs = np.asarray(nm.stochastic_round(jnp.full((4096,), value), bits, BF16).astype(F32))
  assert set(np.unique(rs).tolist()) == {lo, hi}
  p = (np.float64(value) - lo) / (np.float64(hi) - lo)
  se = (np.float64(hi) - lo) * np.sqrt(p * (1 - p) / rs.size)
  assert abs(rs.astype(np.float64).mean() - value) <= 5 * se


def test_stochastic_rounding_is_deterministic_and_keyed():
  x = np.float32(1.0) + np.float32(2**-8) * np.random.default_rng(0).random((64, 96), np.float32)
  a, b = _sr(x, seed=5, step=2, layer=1), _sr(x, seed=5, step=2, layer=1)
  np.testing.assert_array_equal(a, b)
  for changed in (dict(seed=6, step=2, layer=1), dict(seed=5, step=3, layer=1), dict(seed=5, step=2, layer=0)):
    c = _sr(x, **changed)
    assert 0.2 < (c != a).mean() < 0.8, changed  # independent decisions, not a shift


def test_stochastic_rounding_special_values():
  x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.5], np.float32)
  r = _sr(x)
  np.testing.assert_array_equal(r[:4], x[:4])
  assert np.isnan(r[4])
  np.testing.assert_array_equal(r[5:], x[5:])  # bfloat16 values are exact
  nan_low_payload = np.array([0x7F800001], np.uint32).view(np.float32)
  assert np.isnan(_sr(nan_low_payload)[0])
  with pytest.raises(ValueError, match="stochastic rounding to dtype=float16"):
    nm.stochastic_round(jnp.ones(3), jnp.zeros(3, jnp.uint32), jnp.float16)


def test_random_bits_are_uniform_and_uncorrelated_between_neighbours():
  bits = np.asarray(nm.element_bits(nm.rounding_key(0, 0, 0), nm.matrix_index((512, 512))))
  u = (bits >> 16).astype(np.float64).ravel() / 2**16
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
  counts = np.bincount((bits >> 24).ravel(), minlength=256)  # top byte: chi-square, 255 dof
  chi2 = ((counts - u.size / 256) ** 2 / (u.size / 256)).sum()
  assert chi2 < 400
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
  assert len(np.unique(bits)) == bits.size  # a permutation for one key


def test_value_bits_of_one_element_are_uniform_and_independent():
  # The weight and up to four slots read the top 16 bits of value_bits(bits, i); values 0 and
  # 2 (1 and 3) are the two halves of one hash: each field uniform, no two fields correlated,
  # and a slot's field not the weight's, shifted.
  bits = nm.element_bits(nm.rounding_key(4, 9, 1), nm.matrix_index((256, 256)))
  fields = [np.asarray(nm.value_bits(bits, i) >> np.uint32(16)).ravel() for i in range(5)]
  u = np.stack(fields).astype(np.float64) / 2**16
  assert np.all(np.abs(u.mean(1) - 0.5) < 5 * np.sqrt(1 / 12 / u.shape[1]))
  corr = np.corrcoef(u)
  assert np.all(np.abs(corr[np.triu_indices(5, 1)]) < 0.01), corr
  for i in range(1, 5):
    assert np.mean(fields[i] == fields[0]) < 1e-3
  # Stochastic rounding decisions with the two halves of one hash are independent.
  up_w = fields[0] < 2**15
  up_v = fields[2] < 2**15
  assert abs(np.mean(up_w & up_v) - 0.25) < 5 * np.sqrt(0.25 * 0.75 / up_w.size)
  with pytest.raises(ValueError, match="i=-1"):
    nm.value_bits(bits, -1)


# ----------------------------------------------------------------------------
# Quantization maps.
# ----------------------------------------------------------------------------


def _heavy_tailed(key, shape, signed):
  """Values spanning several orders of magnitude inside a block of 64."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape) * jnp.exp(2.0 * jax.random.normal(k2, shape))
  return x if signed else x * x


@pytest.mark.parametrize(
    "qmap",
    [LINEAR, nm.QuantMap("float", True, 3), UFLOAT, nm.QuantMap("float", False, 4),
     nm.QuantMap("linear", False)],
    ids=lambda q: q.name.replace(" ", "_"),
)
@pytest.mark.parametrize("block", [64, 256])
def test_round_trip_error_is_within_the_documented_bound(qmap, block):
  x = _heavy_tailed(jax.random.PRNGKey(block), (48, 512), qmap.signed)
  codec = nm.BlockQuantized(qmap, block)
  q = codec.quantize(x)
  assert q.codes.dtype == jnp.int8 and q.scale.shape == (512 // block, 48)
  assert int(q.codes.min()) >= -127  # -128 is never a code
  y = np.asarray(q.dequantize(), np.float64)
  x = np.asarray(x, np.float64)
  absmax = np.repeat(np.abs(x).reshape(48, -1, block).max(-1), block, axis=1)
  err = np.abs(y - x)
  fp = 4 * 2**-24 * absmax  # float32 rounding of the decode
  if qmap.kind == "linear":
    assert np.all(err <= absmax / (2 * qmap.max_code) + fp)
    return
  # The smallest positive code is `octaves` octaves below the block maximum.
  v1 = float(qmap.decode(jnp.array([1 if qmap.signed else -126]))[0])
  assert abs(np.log2(v1) + qmap.octaves) <= 2.0**-qmap.mantissa_bits
  smallest = absmax * v1
  in_range = np.abs(x) >= smallest
  assert np.all(err[in_range] <= 2.0 ** -(qmap.mantissa_bits + 1) * np.abs(x[in_range]) + fp[in_range])
  below = ~in_range  # flushed to 0 (signed) or raised to the smallest code (unsigned)
  assert np.all(np.abs(y[below]) <= smallest[below] * (1 + 1e-6))
  if not qmap.signed:  # a positive second moment never becomes 0
    assert np.all(y[x > 0] > 0)
  assert np.all(y[x == 0] == 0)


@pytest.mark.parametrize("qmap", [nm.QuantMap("linear", True, rounding="stochastic"), UFLOAT_SR],
                         ids=lambda q: q.name.replace(" ", "_").replace(",", ""))
def test_stochastic_codes_are_unbiased_and_within_one_step(qmap):
  # Every row is the same 64 values (one block, same absmax), rounded with
  # different bits: the mean decode converges to the value itself.
  base = _heavy_tailed(jax.random.PRNGKey(7), (1, 64), qmap.signed)
  base = base.at[0, 0].set(jnp.max(jnp.abs(base)) * 1.5)  # a fixed block maximum
  x = jnp.tile(base, (4096, 1))
  bits = nm.element_bits(nm.rounding_key(2, 0, 0), nm.matrix_index(x.shape))
  codec = nm.BlockQuantized(qmap, 64)
  y = np.asarray(codec.quantize(x, bits).dequantize(), np.float64)
  x0 = np.asarray(base, np.float64)[0]
  absmax = np.abs(x0).max()
  # Within one code step: absmax / 127 (linear), 2**-m of the value (float).
  one_step = absmax / 127 if qmap.kind == "linear" else np.abs(x0) * 2.0**-qmap.mantissa_bits
  in_range = np.abs(x0) >= absmax * 2.0 ** -(qmap.octaves - 1)
  assert np.all((np.abs(y - x0) <= one_step * (1 + 1e-6))[:, in_range])
  # A value within 1/n of a code rounds the rarer way less than once in n draws, often never
  # (sample std 0): the variance is floored at that of a 1/n Bernoulli over one code step.
  n = y.shape[0]
  se = np.sqrt(np.maximum(y.var(0), one_step**2 / n) / n)
  assert np.all(np.abs(y.mean(0) - x0)[in_range] <= 5 * se[in_range] + 1e-6 * np.abs(x0[in_range]))
  with pytest.raises(ValueError, match="needs the element bits"):
    qmap.encode(jnp.ones(3))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("mantissa_bits", range(1, 7))
def test_every_float_code_decodes_to_its_minifloat(signed, mantissa_bits):
  """Each stored byte of a float map decodes to the minifloat it names: code ``max_code`` is
  1.0, each code below it a step of ``2**-m`` of its octave, code 0 is 0.0 (signed: the sign
  is the code's)."""
  qmap = nm.QuantMap("float", signed=signed, mantissa_bits=mantissa_bits)
  stored = np.arange(-127, 128)  # unsigned maps store code - 127
  mag = np.abs(stored) if signed else stored + 127
  e, frac = np.divmod(mag + (127 << mantissa_bits) - qmap.max_code, 2**mantissa_bits)
  want = np.where(mag == 0, 0.0, (1 + frac / 2**mantissa_bits) * 2.0 ** (e - 127))
  want = np.where(stored < 0, -want, want) if signed else want
  # Codes more than 126 octaves down (mantissa_bits=1) name subnormals: flushed, as XLA does.
  want = np.where(np.abs(want) < np.finfo(np.float32).tiny, 0.0, want)
  got = np.asarray(qmap.decode(jnp.asarray(stored, jnp.int8)), np.float64)
  np.testing.assert_array_equal(got, want)
  assert got[stored == stored.max()] == 1.0 and np.all(got[mag == 0] == 0)


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_linear_codes_are_the_rounded_values(signed):
  """The nearest linear map's codes are ``rint(x * max_code / absmax)`` (ties to even; unsigned:
  offset by -127), never beyond max_code, for values on and next to every half step."""
  qmap = nm.QuantMap("linear", signed=signed)
  steps = (np.arange(-254, 255) / 2 if signed else np.arange(0, 509) / 2).astype(np.float32)
  y = np.concatenate([steps, np.nextafter(steps, np.float32(np.inf)),
                      np.nextafter(steps, np.float32(-np.inf))])
  y = np.clip(y, -qmap.max_code if signed else 0.0, qmap.max_code).astype(np.float32)
  y = np.concatenate([y, np.zeros((-len(y)) % 64, np.float32)]).reshape(-1, 64)
  y[:, 0] = qmap.max_code  # each block's maximum: 1 / absmax * max_code is exactly 1 here
  codes, _ = nm.BlockQuantized(qmap, 64).encode(jnp.asarray(y))
  want = np.rint(y.astype(np.float64)) - (0 if signed else 127)
  assert np.sum(np.abs(y - np.floor(y)) == 0.5) > 200  # the ties are there
  np.testing.assert_array_equal(np.asarray(codes, np.int64), want)
  assert np.abs(np.asarray(codes, np.int64)).max() <= 127


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_linear_codes_do_not_depend_on_fusion(signed):
  """The codes of ``x * factor`` are the same whether the product is rounded on its own (another
  program) or fused with the encode (one program, where a compiler may contract the product
  and the rounding add into one fma): values whose exact product sits within an ulp of a half
  step, where one rounding and two differ."""
  qmap = nm.QuantMap("linear", signed=signed)
  factor = np.float32(1.2345678)
  k = np.arange(-126, 127) if signed else np.arange(0, 127)
  x = ((k[:, None] + 0.5) / factor * (1 + np.linspace(-4e-7, 4e-7, 512))).astype(np.float32)
  x = jnp.asarray(x.ravel())
  fused = jax.jit(lambda x, f: qmap.encode_scaled(x * f))(x, factor)
  y = jax.jit(lambda x, f: x * f)(x, factor)
  separate = jax.jit(qmap.encode_scaled)(y)
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(separate))


def test_a_block_below_the_normal_range_stores_zeros():
  """A block whose maximum is a float32 denormal stores zeros (its 1/absmax would overflow), as
  flush-to-zero arithmetic would; a normal block beside it is unaffected."""
  for qmap in (LINEAR, UFLOAT):
    x = np.full((2, 64), 1e-3, np.float32)
    x[0] = np.float32(1e-39) * (np.arange(64) % 3 + 1)  # below 2**-126 = 1.18e-38
    q = nm.BlockQuantized(qmap, 64).quantize(jnp.asarray(x))
    y = np.asarray(q.dequantize())
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_allclose(y[1], 1e-3, rtol=1e-6)


def test_quantizing_zeros_and_a_constant_is_exact():
  for qmap in (LINEAR, UFLOAT):
    codec = nm.BlockQuantized(qmap, 64)
    np.testing.assert_array_equal(codec.quantize(jnp.zeros((3, 128))).dequantize(), 0.0)
    np.testing.assert_allclose(codec.quantize(jnp.full((3, 128), 0.1)).dequantize(), 0.1, rtol=1e-6)


@pytest.mark.parametrize("qmap", [nm.QuantMap("linear", signed=True),
                                  nm.QuantMap("float", signed=False, mantissa_bits=4, rounding="stochastic")],
                         ids=["linear_signed", "float_unsigned_sr"])
def test_block_rows_form_equals_the_codec(qmap):
  """encode_block_rows / decode_block_rows (a tile whose rows are single blocks, as the Mosaic
  epilogue holds it) give the codec's own codes, scales and values, bit for bit."""
  codec = nm.BlockQuantized(qmap, 64)
  x = jax.random.normal(jax.random.PRNGKey(3), (8, 3, 64)) * 1e-2
  x = x if qmap.signed else jnp.abs(x)
  x = x.at[1, 2].set(0.0)  # an all-zero block: scale 0, codes 0
  bits = jax.random.bits(jax.random.PRNGKey(4), x.shape, jnp.uint32)
  want_codes, want_scale = codec.encode(x.reshape(8, 192), bits=bits.reshape(8, 192))
  codes, scale = codec.encode_block_rows(x, bits)
  np.testing.assert_array_equal(np.asarray(codes, np.int8).reshape(8, 192), np.asarray(want_codes))
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale).T)  # block-major
  np.testing.assert_array_equal(np.asarray(codec.decode_block_rows(codes.astype(jnp.int8), scale)).reshape(8, 192),
                                np.asarray(codec.decode((want_codes, want_scale))))


def test_quantize_errors_name_the_block():
  with pytest.raises(ValueError, match=r"last axis must be a multiple of the quantization block=64"):
    nm.BlockQuantized(LINEAR, 64).quantize(jnp.ones((4, 100)))
  with pytest.raises(ValueError, match="block=48 must be a power of two"):
    nm.BlockQuantized(LINEAR, 48)
  with pytest.raises(ValueError, match="kind='log'"):
    nm.QuantMap("log")


# ----------------------------------------------------------------------------
# The kernel's codecs against the reference (interpret mode).
# ----------------------------------------------------------------------------


def adam_rule():
  return forge_jax.adamw(1e-2, weight_decay=0.1).rule


def exact_rule(g, w, slots, s):
  """An update whose float32 arithmetic is exact for the integer inputs below.

  Powers of two and sums of few-bit values only: any backend, fused or not,
  with or without FMA contraction, computes the same bits, so a kernel and
  its reference can be compared bit for bit on what is under test.
  """
  del w
  m, v = slots
  return s["neg_lr"] * g, (g + 0.5 * m, g * g + 0.25 * v)


EXACT_SCALARS = {"neg_lr": jnp.float32(-(2.0**-4))}


def _int_inputs(seed, t, k, n, layers=None):
  """Small-integer x and dy: x.T @ dy is exact in float32 in any order."""
  kx, kd, kw, km, kv = jax.random.split(jax.random.PRNGKey(seed), 5)
  x = jax.random.randint(kx, (t, k), -3, 4).astype(BF16)
  dy = jax.random.randint(kd, (t, n), -3, 4).astype(BF16) * 2.0**-6
  w_shape = (k, n) if layers is None else (layers, k, n)
  w = jax.random.normal(kw, w_shape).astype(BF16)
  m = nm.BlockQuantized(LINEAR, 64).quantize(0.1 * jax.random.normal(km, w_shape))
  v = nm.BlockQuantized(UFLOAT_SR, 64).quantize(1e-2 * jax.random.normal(kv, w_shape) ** 2)
  return x, dy, w, (m, v)


def _bits_equal(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    u, v = np.atleast_1d(np.asarray(u)), np.atleast_1d(np.asarray(v))
    assert u.dtype == v.dtype and u.shape == v.shape
    np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


def _run(x, dy, w, slots, *, config=SMALL, interpret=True, exact=True, **kwargs):
  if exact:
    args = (x, dy, w, slots, EXACT_SCALARS, exact_rule)
  else:
    rule = adam_rule()
    args = (x, dy, w, slots, rule.scalars(jnp.int32(4)), rule.update)
  kw = dict(weight_codec=nm.StochasticRound(), seed=17, step=jnp.int32(4), **kwargs)
  if interpret is None:
    return fused_dw_update_reference(*args, **kw)
  return fused_dw_update(*args, config=config, interpret=True, **kw)


def test_kernel_equals_reference_bit_for_bit_sr_weights_int8_states_odd_shape():
  # 77 x 200 x 320: partial tiles in T, K and N (N = 5 blocks of 64).
  x, dy, w, slots = _int_inputs(0, 77, 200, 320)
  got = _run(x, dy, w, slots, compute_grad_sq_norm=True)
  want = _run(x, dy, w, slots, interpret=None, compute_grad_sq_norm=True)
  _bits_equal(got[:2], want[:2])
  assert not np.array_equal(np.asarray(got[0]), np.asarray(w))


def test_kernel_result_is_independent_of_the_tile_shape():
  x, dy, w, slots = _int_inputs(1, 40, 96, 384)
  _bits_equal(_run(x, dy, w, slots, config=SMALL)[:2], _run(x, dy, w, slots, config=OTHER)[:2])


def test_stacked_layer_int8_sr_matches_reference_and_leaves_other_layers():
  x, dy, w, slots = _int_inputs(2, 30, 72, 192, layers=3)
  got = _run(x, dy, w, slots, layer=jnp.int32(1))
  want = _run(x, dy, w, slots, interpret=None, layer=jnp.int32(1))
  _bits_equal(got[:2], want[:2])
  for new, old in zip(jax.tree.leaves(got[:2]), jax.tree.leaves((w, slots))):
    for l in (0, 2):
      np.testing.assert_array_equal(np.asarray(new[l]).view(np.uint8), np.asarray(old[l]).view(np.uint8))
  # Another layer of the same stack draws other bits.
  other = _run(x, dy, w, slots, interpret=None, layer=jnp.int32(2))
  assert not np.array_equal(np.asarray(other[0][2]), np.asarray(got[0][1]))


def test_kernel_matches_reference_with_random_inputs_and_adamw():
  # Random bf16 inputs and the real AdamW: the float32 results differ in their
  # last bits (sum order; XLA compiles a tile and a whole array differently),
  # so a quantized code may move by one step and a rounded weight by one ulp.
  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  x = jax.random.normal(k1, (77, 200)).astype(BF16)
  dy = jax.random.normal(k2, (77, 256)).astype(BF16)
  _, _, w, slots = _int_inputs(3, 77, 200, 256)
  got, want = _run(x, dy, w, slots, exact=False), _run(x, dy, w, slots, interpret=None, exact=False)
  gw, ww = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
  lo, hi = np.minimum(gw, ww), np.maximum(gw, ww)
  assert (gw != ww).mean() <= 1e-3
  assert np.all((hi == lo) | (hi == _bf16_neighbours(lo + (hi - lo) / 2)[1]))  # one ulp apart
  for a, b in zip(got[1], want[1]):
    assert (np.asarray(a.codes) != np.asarray(b.codes)).mean() <= 1e-3
    assert np.abs(np.asarray(a.codes, np.int32) - np.asarray(b.codes, np.int32)).max() <= 1
    np.testing.assert_allclose(a.scale, b.scale, rtol=1e-5)


def test_bf16_states_and_nearest_rounding_match_reference():
  x, dy, w, (m, v) = _int_inputs(4, 50, 70, 128)
  slots = (m.dequantize().astype(BF16), v.dequantize().astype(BF16))
  args = (x, dy, w, slots, EXACT_SCALARS, exact_rule)
  _bits_equal(fused_dw_update(*args, config=SMALL, interpret=True)[:2], fused_dw_update_reference(*args)[:2])


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(n=100), r"last axis must be a multiple of the quantization block=64"),
        (dict(config=TileConfig(32, 32, 16, 4, 2)), r"config.block_n=32 must be a multiple of the quantization block=64"),
        (dict(seed=None), "stochastic rounding needs both"),
        (dict(w_dtype=jnp.float16), "stochastic rounding to dtype=float16"),
    ],
)
def test_errors_name_the_value_and_the_fix(changes, match):
  n = changes.pop("n", 128)
  x, dy, w = jnp.ones((8, 16), BF16), jnp.ones((8, n), BF16), jnp.ones((16, n), changes.pop("w_dtype", BF16))
  m = nm.QuantizedArray(jnp.zeros((16, n), jnp.int8), jnp.zeros((n // 64, 16), F32), nm.BlockQuantized(LINEAR, 64))
  kwargs = dict(config=SMALL, seed=1, step=jnp.int32(0))
  kwargs.update(changes)
  rule = forge_jax.lion(1e-3).rule
  with pytest.raises(ValueError, match=match):
    fused_dw_update(x, dy, w, (m,), rule.scalars(jnp.int32(0)), rule.update, interpret=True,
                    weight_codec=nm.StochasticRound(), **kwargs)


# ----------------------------------------------------------------------------
# The real (non-interpret) path lowers to Triton IR, checked without a GPU.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("stacked", [False, True])
def test_gpu_path_with_sr_and_int8_states_lowers_to_a_triton_call(stacked):
  rule = adam_rule()
  t, k, n, layers = 1000, 384, 320, 2
  sds = jax.ShapeDtypeStruct
  w_shape = (layers, k, n) if stacked else (k, n)
  q = lambda c: nm.QuantizedArray(sds(w_shape, jnp.int8), sds(c.scale_shape(w_shape), F32), c)

  def step(x, dy, w, m, v, count, layer):
    return fused_dw_update(
        x, dy, w, (m, v), rule.scalars(count), rule.update, layer=layer if stacked else None,
        config=TileConfig(128, 128, 64, 8, 3), compute_grad_sq_norm=True,
        weight_codec=nm.StochasticRound(), seed=jnp.uint32(5), step=count,
    )

  args = (sds((t, k), BF16), sds((t, n), BF16), sds(w_shape, BF16),
          q(nm.BlockQuantized(LINEAR, 64)), q(nm.BlockQuantized(UFLOAT_SR, 64)),
          sds((), jnp.int32), sds((), jnp.int32))
  text = lower_for_cuda(step, *args)
  assert text.count("xla.gpu.triton") == 1
  # w, and codes + scales of both moments, are aliased in place.
  assert text.count("#stablehlo.output_operand_alias<") == 5


def test_stream_seed_on_the_host_equals_the_traced_one():
  """Every FORGE layer's seed and stream are ints, folded on the host; a traced seed folds on
  the device: the same uint32 bits either way."""
  for seed, stream in [(0, 0), (1, 2**32 - 1), (-5, 123456789), (2**31, 77)]:
    host = nm.stream_seed(seed, stream)
    traced = jax.jit(nm.stream_seed)(jnp.asarray(np.uint32(seed % 2**32)), jnp.asarray(np.uint32(stream)))
    assert host.dtype == traced.dtype == jnp.uint32
    assert int(host) == int(traced), (seed, stream)
