"""The in-kernel non-finite guard: an element whose gradient is NaN or infinite keeps its weight
and optimizer state, on every backend, and is counted.

The gradients are crafted so that only chosen elements of dW are not finite: a token whose x row
is 2**100 at one feature (zero elsewhere) and whose dy row is +-2**100 at one output contributes
+-2**200 (+-inf in float32) to one element of dW and exact zeros to every other; a token whose dy
holds one NaN (x zero) makes one column of dW NaN (0 * NaN is NaN). The run without those tokens
(their rows zero) computes the same dW everywhere else, bit for bit: a normal update to compare
with.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from forge_jax import _fused
import pallas_kernels
from pallas_kernels import numerics
from tests._gpu import gpu_marks

pytestmark = [
    pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter"),  # tests/conftest.py
    # The crafted 2**100 * 2**100 overflows on purpose (the Mosaic interpreter's numpy matmul).
    pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning"),
]

BF16, F32 = jnp.bfloat16, jnp.float32
BIG = 2.0**100
INF_AT, NEG_INF_AT, NAN_COLUMN = (5, 7), (40, 50), 30


def _bits(a) -> np.ndarray:
  """The stored bits of an array (NaN payloads and the sign of zero included)."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bits(a, b, where=None):
  a, b = _bits(a), _bits(b)
  if where is not None:
    a, b = a[where], b[where]
  np.testing.assert_array_equal(a, b)


def _crafted(t=64, k=64, n=64, seed=0):
  """(clean x, dy), (poisoned x, dy) in bfloat16 and the mask of the non-finite elements of dW."""
  kx, kd = jax.random.split(jax.random.PRNGKey(seed))
  x = np.array(jax.random.normal(kx, (t, k), F32))
  dy = np.array(jax.random.normal(kd, (t, n), F32)) / np.sqrt(t)
  x[:3], dy[:3] = 0.0, 0.0
  bad_x, bad_dy = x.copy(), dy.copy()
  (ki, ni), (kn, nn) = INF_AT, NEG_INF_AT
  bad_x[0, ki], bad_dy[0, ni] = BIG, BIG  # 2**200: inf
  bad_x[1, kn], bad_dy[1, nn] = BIG, -BIG
  bad_dy[2, NAN_COLUMN] = np.nan
  cast = lambda *a: tuple(jnp.asarray(v, BF16) for v in a)
  clean, bad = cast(x, dy), cast(bad_x, bad_dy)
  g = np.asarray(jnp.dot(bad[0].astype(F32).T, bad[1].astype(F32),
                         precision=jax.lax.Precision.HIGHEST))
  mask = ~np.isfinite(g)
  assert g[INF_AT] == np.inf and g[NEG_INF_AT] == -np.inf and np.isnan(g[:, NAN_COLUMN]).all()
  assert mask.sum() == 2 + k  # nothing else
  return clean, bad, mask


def _adamw(precision=None):
  return forge_jax.adamw(1e-2, weight_decay=0.1, precision=precision)


def _state(opt, w):
  state = opt.init(w)
  # A step in already: non-zero moments, so keeping them is visible.
  g = jax.random.normal(jax.random.PRNGKey(7), w.shape, F32)
  return opt.update(g, state, w)[1]


def _runner(backend, opt):
  """The jitted update, for both the poisoned and the clean inputs (same shapes: one compile)."""
  step = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=opt, backend=backend,
                                   return_grad_sq_norm=True))

  def run(x, dy, w, state):
    with warnings.catch_warnings():
      warnings.simplefilter("error", _fused.BackendFallbackWarning)  # the kernel itself ran
      return step(x, dy, w, state)

  return run


def _slots(state):
  return [s for s in state[1:]]


def _check_guard(backend, precision, w_dtype, exact_states=True):
  opt = _adamw(precision)
  clean, bad, mask = _crafted(n=128 if precision and precision.state_dtype == "int8" else 64)
  w = jax.random.normal(jax.random.PRNGKey(1), mask.shape, F32).astype(w_dtype)
  state = _state(opt, w)
  run = _runner(backend, opt)
  new_w, new_state, sq = run(*bad, w, state)
  want_w, want_state, want_sq = run(*clean, w, state)
  assert np.isnan(float(sq)) and np.isfinite(float(want_sq))
  _assert_bits(new_w, w, mask)  # guarded: the old weight, bit for bit
  _assert_bits(new_w, want_w, ~mask)  # the others: the normal update
  assert int(new_state.count) == int(want_state.count)
  for got, old, want in zip(_slots(new_state), _slots(state), _slots(want_state)):
    if exact_states:
      _assert_bits(got, old, mask)
      _assert_bits(got, want, ~mask)
    else:  # int8: blocks of 64 along N
      block = got.codec.block
      poisoned = mask.reshape(mask.shape[0], -1, block).any(-1)
      elem = np.repeat(poisoned, block, axis=1)
      _assert_bits(got.codes, want.codes, ~elem)
      _assert_bits(got.scale, want.scale, ~poisoned.T)  # block-major: [N / block, K]
      # The guarded element is re-encoded from its old value with its block's new scale:
      # within one code step of it (stochastic rounding; half a step to nearest).
      dec, dec_old = np.asarray(got.dequantize())[mask], np.asarray(old.dequantize())[mask]
      qmap = got.codec.qmap
      if qmap.kind == "linear":
        step = np.repeat(np.asarray(got.scale).T, block, axis=1)[mask] / qmap.max_code
      else:
        step = np.abs(dec_old) * 2.0**-qmap.mantissa_bits
      assert np.all(np.abs(dec - dec_old) <= step * (1 + 1e-6)), np.abs(dec - dec_old) / step
  if backend == "mosaic_interpret" and not exact_states:
    return  # the interpreter is slow; its float case runs the guard off
  # The guard off: the same kernel writes what the rule computes there.
  off = _adamw(dataclasses.replace(precision or forge_jax.Precision(), nonfinite="propagate"))
  run_off = _runner(backend, off)
  prop_w, _, prop_sq = run_off(*bad, w, state)
  assert np.isnan(np.asarray(prop_w, F32)[mask]).all() and np.isnan(float(prop_sq))
  _assert_close(prop_w, new_w, ~mask)
  # And a finite step is the same with the guard on and off.
  got = run_off(*clean, w, state)
  _assert_close(got[0], want_w)
  for a, b in zip(_slots(got[1]), _slots(want_state)):
    for pa, pb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      _assert_close(pa, pb)
  np.testing.assert_allclose(float(got[2]), float(want_sq), rtol=1e-6)


def _assert_close(a, b, where=None):
  """Float32 rounding apart (int8 codes: within one step). The guard adds selects after the
  rule's results and nothing before them, but XLA, which runs the "xla" backend and the
  kernels' bodies under both interpreters, fuses the guarded graph differently (it recomputes
  the new slots inside the weight's fusion, which may take its products as FMAs or its dot in
  another order): seen up to 3 ulp, and 267 ulp on one first moment near zero."""
  a, b = np.asarray(a), np.asarray(b)
  if where is not None:
    a, b = a[where], b[where]
  if a.dtype == np.int8:
    assert np.abs(a.astype(np.int64) - b.astype(np.int64)).max() <= 1
    return
  a, b = a.astype(np.float32), b.astype(np.float32)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


_GPU = gpu_marks("the compiled Triton and Mosaic kernels")
_COMPILED = [pytest.param("pallas", marks=_GPU), pytest.param("mosaic", marks=_GPU)]
# The interpreters' cases are CPU tests: on a GPU their thousands of small ops each go to the
# device (one mosaic_interpret case ran past 200 s on the H200), and the compiled kernels run.
_CPU = pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpreters: the CPU's cases")
_INTERPRETED = [pytest.param("interpret", marks=_CPU), pytest.param("mosaic_interpret", marks=_CPU)]


@pytest.mark.parametrize("backend", ["xla"] + _INTERPRETED + _COMPILED)
def test_guard_float_states(backend):
  _check_guard(backend, None, F32)


# The default maps: the second moment's rounds stochastically.
_INT8 = forge_jax.Precision(state_dtype="int8", min_quantized_size=0)


@pytest.mark.parametrize("backend", ["xla"] + _INTERPRETED + _COMPILED)
def test_guard_int8_states(backend):
  _check_guard(backend, _INT8, F32, exact_states=False)


@pytest.mark.parametrize("backend", ["xla"] + _INTERPRETED + _COMPILED)
def test_guard_stochastically_rounded_bf16_weights(backend):
  _check_guard(backend, forge_jax.Precision("stochastic", state_dtype="float32"), BF16)


_SR_BF16 = forge_jax.Precision("stochastic", state_dtype="float32")


@pytest.mark.parametrize("backend, precision, w_dtype, stacked", [
    ("xla", None, F32, False), ("xla", _INT8, BF16, True), ("xla", _SR_BF16, BF16, False),
    pytest.param("interpret", _INT8, F32, False, marks=_CPU),
    pytest.param("interpret", _SR_BF16, BF16, True, marks=_CPU),
    pytest.param("mosaic_interpret", _INT8, F32, True, marks=_CPU),
    pytest.param("mosaic_interpret", None, BF16, False, marks=_CPU),
    pytest.param("mosaic_interpret", _SR_BF16, BF16, False, marks=_CPU),
    pytest.param("pallas", _INT8, BF16, True, marks=_GPU),
    pytest.param("mosaic", _INT8, BF16, True, marks=_GPU),
    pytest.param("mosaic", _SR_BF16, BF16, False, marks=_GPU)])
def test_apply_false_stores_nothing(backend, precision, w_dtype, stacked):
  """``apply=False`` (train_step's skip of a non-finite loss): the weight and every state,
  int8 codes and scales and the count included, come back bit for bit (also under a NaN
  gradient); ``apply=True`` is the update without the flag, bit for bit."""
  opt = _adamw(precision)
  clean, bad, mask = _crafted(n=128)
  w = jax.random.normal(jax.random.PRNGKey(1), mask.shape, F32).astype(w_dtype)
  state = _state(opt, w)
  layer = None
  if stacked:  # the middle layer of three
    w = jnp.stack([w * 0.5, w, w * 2.0])
    state = jax.tree.map(lambda a: jnp.stack([a] * 3) if jnp.ndim(a) else a, state)
    layer = jnp.int32(1)
  step = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=opt, backend=backend,
                                   return_grad_sq_norm=True))
  with warnings.catch_warnings():
    warnings.simplefilter("error", _fused.BackendFallbackWarning)  # the kernel itself ran
    for inputs in (clean, bad):
      new_w, new_state, _ = step(*inputs, w, state, layer=layer, apply=jnp.bool_(False))
      _assert_bits(new_w, w)
      for got, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True):
        _assert_bits(got, old)
    want = step(*clean, w, state, layer=layer)
    got = step(*clean, w, state, layer=layer, apply=jnp.bool_(True))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    _assert_bits(a, b)


def test_precision_nonfinite_is_checked():
  with pytest.raises(ValueError, match=r"nonfinite='drop' must be one of \('skip', 'propagate'\)"):
    forge_jax.Precision(nonfinite="drop")


def test_optax_face_is_optax_for_non_finite_gradients():
  """The optax face (train_step's other parameters) keeps optax's arithmetic: NaN in, NaN out."""
  w = jax.random.normal(jax.random.PRNGKey(0), (4, 8), F32)
  g = jax.random.normal(jax.random.PRNGKey(1), (4, 8), F32).at[1, 2].set(jnp.nan)
  opt = _adamw()
  u, _ = opt.update(g, _state(opt, w), w)
  assert np.isnan(np.asarray(u)[1, 2]) and np.isfinite(np.delete(np.asarray(u).ravel(), 10)).all()


def test_guarded_rule_lowers_for_cuda_in_the_mosaic_kernel():
  """abs, lt and select in the epilogue: what Mosaic GPU's warpgroup lowering has (it has no
  is_finite), with the NaN-marking norm, float and int8 states, and the stores under a traced
  ``apply`` flag."""
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
  from tests._lowering import skip_if_cuda_lowering_needs_a_gpu  # pylint: disable=g-import-not-at-top
  rule = _adamw().rule
  sds = jax.ShapeDtypeStruct
  x, dy = sds((256, 256), BF16), sds((256, 256), BF16)
  w = sds((256, 256), F32)
  update = pallas_kernels.skip_non_finite(_fused._RuleUpdate(rule, True))  # pylint: disable=protected-access
  for slots in [tuple(sds((256, 256), F32) for _ in rule.slot_names),
                tuple(numerics.QuantizedArray(sds((256, 256), jnp.int8), sds((4, 256), F32),
                                              _INT8.codec(name)) for name in rule.slot_names)]:
    cfg = mosaic.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
    kernel = jax.jit(functools.partial(mosaic.fused_dw_update_mosaic, update_fn=update,
                                       config=cfg, compute_grad_sq_norm=True))
    with skip_if_cuda_lowering_needs_a_gpu():
      text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)), seed=jnp.uint32(1),
                          step=jnp.int32(2), apply=jnp.bool_(True)
                          ).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_int8_scales_reach_the_mosaic_kernel_untransposed():
  """Block-major scales ([L, N // block, K]) are the kernel's own view (a reshape): lowered for
  CUDA, a stacked int8 update has no transpose around the kernel (four per call when the
  scales were stored [L, K, N // block])."""
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
  from tests._lowering import skip_if_cuda_lowering_needs_a_gpu  # pylint: disable=g-import-not-at-top
  rule = _adamw().rule
  sds = jax.ShapeDtypeStruct
  x, dy = sds((256, 256), BF16), sds((256, 512), BF16)
  w = sds((3, 256, 512), BF16)
  slots = tuple(numerics.QuantizedArray(sds((3, 256, 512), jnp.int8), sds((3, 8, 256), F32),
                                        _INT8.codec(name)) for name in rule.slot_names)
  cfg = mosaic.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
  kernel = jax.jit(functools.partial(mosaic.fused_dw_update_mosaic, update_fn=_fused._RuleUpdate(rule, True),  # pylint: disable=protected-access
                                     config=cfg, compute_grad_sq_norm=True))
  with skip_if_cuda_lowering_needs_a_gpu():
    text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)), layer=jnp.int32(1),
                        seed=jnp.uint32(1), step=jnp.int32(2)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "stablehlo.transpose" not in text


def test_xla_route_evaluates_the_guarded_rule_once_for_a_gpu():
  """The "xla" route with the guard, lowered for CUDA: the rule once, which XLA:GPU fuses into
  one pass updating W and the slots in place (two passes over the gradient, W and the slots
  cost a layer up to a third more on the H200). Lowered for a CPU: the weight's update, then
  the slots' after it (XLA:CPU copies every state otherwise: tests/test_flax_binding.py).
  The guard's finiteness test (an ``abs`` over the layer's shape; AdamW has none) counts the
  evaluations."""
  from tests._lowering import skip_if_cuda_lowering_needs_a_gpu  # pylint: disable=g-import-not-at-top
  opt = _adamw()
  (x, dy), _, _ = _crafted()
  w = jnp.zeros((64, 64), F32)
  state = _state(opt, w)
  update = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=opt, backend="xla"))
  counts = {}
  for platform in ("cuda", "cpu"):
    with skip_if_cuda_lowering_needs_a_gpu():
      text = update.trace(x, dy, w, state).lower(lowering_platforms=(platform,)).as_text()
    counts[platform] = len(re.findall(r"stablehlo\.abs %\S+ : tensor<64x64xf32>", text))
  assert counts == {"cuda": 1, "cpu": 2}, counts


def test_benchmarks_time_the_guard_against_its_absence():
  """bench_lowp's NAME_noguard configurations and bench_models' forge*_noguard rows are their
  twins with the guard off, and nothing else changed."""
  from experiments import bench_lowp, bench_models  # pylint: disable=g-import-not-at-top
  for name in ("fp32", "bf16_sr_int8"):
    (w, on), (w_off, off) = bench_lowp.CONFIGS[name], bench_lowp.CONFIGS[name + "_noguard"]
    assert w == w_off and on.nonfinite == "skip" and off == dataclasses.replace(on, nonfinite="propagate")
  for name in ("forge", "forge_int8"):
    on = bench_models._forge_optimizer(name).precision  # pylint: disable=protected-access
    off = bench_models._forge_optimizer(name + "_noguard").precision  # pylint: disable=protected-access
    assert on.nonfinite == "skip" and off == dataclasses.replace(on, nonfinite="propagate")
    assert bench_models.skips_nonfinite(name) and not bench_models.skips_nonfinite(name + "_noguard")


def test_benchmarks_time_the_norm_against_its_absence():
  """bench_lowp's NAME_nonorm configurations: the same storage and the same update, the layers'
  gradient norm left out (and the Mosaic kernel told so)."""
  from experiments import _timing, bench_lowp  # pylint: disable=g-import-not-at-top
  assert bench_lowp.CONFIGS["bf16_sr_int8_nonorm"] == bench_lowp.CONFIGS["bf16_sr_int8"]
  assert bench_lowp._with_norm("fp32") and not bench_lowp._with_norm("fp32_nonorm")  # pylint: disable=protected-access
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 128), jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(1), (64, 256), jnp.bfloat16)
  w0 = jax.random.normal(jax.random.PRNGKey(2), (128, 256), jnp.float32)
  out = {}
  for norm in (True, False):
    update = _timing.layer_update(forge_jax.adamw(1e-3), "xla", jnp.float32, calls=2, grad_norm=norm)
    text = update.run.lower(update.init(x, dy, w0)).as_text()
    w, state, sq = update.run(update.init(x, dy, w0))[:3]
    out[norm] = (w, state.mu, state.nu, sq, text.count("stablehlo.reduce"))
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(out[True][:3], out[False][:3]))
  assert float(out[True][3]) > 0 and float(out[False][3]) == 0
  assert out[False][4] < out[True][4]  # the norm's sums are gone


def test_benchmarks_time_the_apply_flag():
  """bench_lowp's NAME_applied configurations: the same storage and, with the flag true at every
  call, the same update as without it."""
  from experiments import _timing, bench_lowp  # pylint: disable=g-import-not-at-top
  assert bench_lowp.CONFIGS["bf16_rtn_bf16_applied"] == bench_lowp.CONFIGS["bf16_rtn_bf16"]
  assert "fp32_nonorm_applied" not in bench_lowp.CONFIGS
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 128), jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(1), (64, 256), jnp.bfloat16)
  w0 = jax.random.normal(jax.random.PRNGKey(2), (128, 256), jnp.float32)
  out, selects = {}, {}
  for applied in (False, True):
    update = _timing.layer_update(forge_jax.adamw(1e-3), "xla", jnp.float32, calls=2,
                                  applied=applied)
    selects[applied] = update.run.lower(update.init(x, dy, w0)).as_text().count("stablehlo.select")
    w, state, sq = update.run(update.init(x, dy, w0))[:3]
    out[applied] = (w, state.mu, state.nu, sq)
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(out[True], out[False]))
  assert not bool(jnp.array_equal(out[True][0], w0))  # the update ran
  assert selects[True] > selects[False]  # the flag reached the update (kept where it is false)
