"""The Triton-lowered fused dW + update kernel against its jnp reference.

Everything runs in Pallas interpret mode on CPU, with 32x32 tiles and a token
step of 16 so that the odd shapes span several tiles in T, K and N and every
edge (masked loads and stores) is exercised.

Tolerance. The kernel and the reference both accumulate ``x.T @ dy`` in
float32; only the order of the sum over T differs (``block_t``-token dots
summed in a loop vs one XLA dot). Higham's worst-case bound for that
difference is ``2 * T * 2**-24 * sum_t |x||dy|`` per element (9e-6 of
``sum_t |x||dy|`` at T = 77); the differences seen here are about 3e-7 of
each array's largest value. float32 outputs are compared with ``rtol=2e-5``
and ``atol = 2e-5 * max|expected|`` (elements that cancel to near zero have
no meaningful relative error): ~60x the observed error, below anything a
wrong tile, mask or layer produces (order 1). A bfloat16 output may land one
bf16 ulp apart (a tiny float32 difference can flip round-to-nearest; 2 of
66k elements do in the bf16 case), so bf16 outputs get ``rtol=2**-7``.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from pallas_kernels import fused_dw
from pallas_kernels import TileConfig, fused_dw_update, fused_dw_update_reference
from tests._lowering import lower_for_cuda

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

SMALL = TileConfig(block_k=32, block_n=32, block_t=16, num_warps=4, num_stages=2)
F32, BF16 = jnp.float32, jnp.bfloat16


# ----------------------------------------------------------------------------
# Test-only update rules (inline, so the kernel is tested apart from forge_jax).
# ----------------------------------------------------------------------------


def sgd_momentum(g, w, slots, s):
  """Heavy-ball SGD; ``s`` is a dict (a pytree with named leaves)."""
  del w
  (m,) = slots
  m = s["mu"] * m + g
  return s["neg_lr"] * m, (m,)


class AdamScalars(NamedTuple):
  neg_lr: jax.Array
  betas: tuple  # nested: (b1, b2), so the kernel's unflatten is exercised
  eps: jax.Array
  wd: jax.Array


def adam_like(g, w, slots, s):
  """Adam with decoupled decay, no bias correction."""
  m, v = slots
  b1, b2 = s.betas
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * (g * g)
  return s.neg_lr * (m / (jnp.sqrt(v) + s.eps) + s.wd * w), (m, v)


def sgd_scalars():
  return {"neg_lr": jnp.float32(-0.05), "mu": jnp.float32(0.9)}


def adam_scalars():
  f = jnp.float32
  return AdamScalars(f(-1e-2), (f(0.9), f(0.99)), f(1e-8), f(0.1))


# ----------------------------------------------------------------------------
# Inputs and checks.
# ----------------------------------------------------------------------------


def _inputs(seed, t, k, n, *, in_dtype=F32, w_dtype=F32, slot_dtypes=(F32,), layers=None):
  """Random (never zero) x, dy, w and slots; the second moment-like slot > 0."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3 + len(slot_dtypes))
  w_shape = (k, n) if layers is None else (layers, k, n)
  x = jax.random.normal(keys[0], (t, k), F32).astype(in_dtype)
  dy = jax.random.normal(keys[1], (t, n), F32).astype(in_dtype)
  w = jax.random.normal(keys[2], w_shape, F32).astype(w_dtype)
  slots = []
  for i, (key, dtype) in enumerate(zip(keys[3:], slot_dtypes)):
    s = 0.1 * jax.random.normal(key, w_shape, F32)
    slots.append((jnp.abs(s) + 0.01 if i == 1 else s).astype(dtype))
  return x, dy, w, tuple(slots)


def _assert_close(actual, expected, name=""):
  actual, expected = jnp.asarray(actual), jnp.asarray(expected)
  assert actual.dtype == expected.dtype, name
  assert actual.shape == expected.shape, name
  rtol = 2.0**-7 if actual.dtype == BF16 else 2e-5
  a = np.asarray(actual.astype(F32))
  e = np.asarray(expected.astype(F32))
  np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * np.max(np.abs(e)), err_msg=name)


def _assert_same_result(got, want):
  (w, slots, norm), (w_ref, slots_ref, norm_ref) = got, want
  _assert_close(w, w_ref, "w")
  assert len(slots) == len(slots_ref)
  for i, (s, s_ref) in enumerate(zip(slots, slots_ref)):
    _assert_close(s, s_ref, f"slots[{i}]")
  if norm_ref is None:
    assert norm is None
  else:
    assert norm.dtype == F32 and norm.shape == ()
    np.testing.assert_allclose(float(norm), float(norm_ref), rtol=1e-5)


def _run_both(x, dy, w, slots, scalars, update_fn, **kwargs):
  got = fused_dw_update(x, dy, w, slots, scalars, update_fn, config=SMALL, interpret=True, **kwargs)
  want = fused_dw_update_reference(x, dy, w, slots, scalars, update_fn, **kwargs)
  return got, want


# ----------------------------------------------------------------------------
# Parity with the reference.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "in_dtype, w_dtype, slot_dtype",
    [
        (F32, F32, F32),
        (BF16, F32, F32),
        (BF16, BF16, BF16),
        (F32, BF16, F32),  # slots wider than the weight
        (BF16, F32, BF16),  # slots narrower than the weight
    ],
)
def test_sgd_momentum_matches_reference_odd_shape(in_dtype, w_dtype, slot_dtype):
  # 77 x 200 x 333: a partial tile in every one of T, K and N.
  x, dy, w, slots = _inputs(0, 77, 200, 333, in_dtype=in_dtype, w_dtype=w_dtype, slot_dtypes=(slot_dtype,))
  got, want = _run_both(x, dy, w, slots, sgd_scalars(), sgd_momentum)
  _assert_same_result(got, want)


@pytest.mark.parametrize(
    "t, k, n",
    [
        (5, 7, 3),  # smaller than one tile everywhere
        (1, 16, 17),  # one token
        (33, 48, 16),  # one column tile, partial row tile
        (64, 64, 96),  # exact multiples: no masks at all
    ],
)
def test_adam_like_matches_reference_small_shapes(t, k, n):
  x, dy, w, slots = _inputs(1, t, k, n, in_dtype=BF16, slot_dtypes=(F32, F32))
  got, want = _run_both(x, dy, w, slots, adam_scalars(), adam_like, compute_grad_sq_norm=True)
  _assert_same_result(got, want)


def test_mixed_x_dy_dtypes_promote():
  x, dy, w, slots = _inputs(2, 40, 50, 60)
  got, want = _run_both(x.astype(BF16), dy, w, slots, sgd_scalars(), sgd_momentum)
  _assert_same_result(got, want)


def test_grad_sq_norm_matches_reference_with_edges():
  x, dy, w, slots = _inputs(3, 77, 200, 333, in_dtype=BF16)
  got, want = _run_both(x, dy, w, slots, sgd_scalars(), sgd_momentum, compute_grad_sq_norm=True)
  _assert_same_result(got, want)


def test_forge_adamw_three_steps_match_reference():
  """Successive steps, each fed its own previous outputs, with the real rule."""
  rule = forge_jax.adamw(learning_rate=1e-2, weight_decay=0.1).rule
  update = functools.partial(rule.update, decay=True)
  x, dy, w, _ = _inputs(4, 45, 70, 90, in_dtype=BF16)
  kernel_state = ref_state = (w, rule.init_slots(w))
  for count in range(3):
    s = rule.scalars(jnp.int32(count))
    new_w, new_slots, _ = fused_dw_update(x, dy, *kernel_state, s, update, config=SMALL, interpret=True)
    kernel_state = (new_w, new_slots)
    new_w, new_slots, _ = fused_dw_update_reference(x, dy, *ref_state, s, update)
    ref_state = (new_w, new_slots)
    x = x * 1.01  # a different gradient each step
  _assert_same_result((*kernel_state, None), (*ref_state, None))


@pytest.mark.parametrize("name", ["lion", "sgd"])
def test_forge_rules_without_second_moment(name):
  """Lion (sign) and plain SGD (no slots at all) run through the kernel."""
  opt = forge_jax.lion(1e-3) if name == "lion" else forge_jax.sgd(1e-2)
  rule = opt.rule
  x, dy, w, _ = _inputs(5, 30, 40, 50)
  slots = tuple(0.1 * jnp.ones_like(s) + 0.01 * w for s in rule.init_slots(w))
  got, want = _run_both(x, dy, w, slots, rule.scalars(jnp.int32(0)), rule.update)
  _assert_same_result(got, want)


# ----------------------------------------------------------------------------
# Stacked weights.
# ----------------------------------------------------------------------------


def test_stacked_updates_one_layer_and_leaves_the_others_bit_identical():
  x, dy, w, slots = _inputs(6, 50, 40, 70, w_dtype=BF16, slot_dtypes=(F32, BF16), layers=3)
  traces = []

  @jax.jit
  def step(w, slots, layer):
    traces.append(None)
    return fused_dw_update(x, dy, w, slots, adam_scalars(), adam_like, layer=layer, config=SMALL, interpret=True)

  for layer in (1, 2):
    got = step(w, slots, jnp.int32(layer))
    want = fused_dw_update_reference(x, dy, w, slots, adam_scalars(), adam_like, layer=jnp.int32(layer))
    _assert_same_result(got, want)
    new_w, new_slots, _ = got
    for other in {0, 1, 2} - {layer}:
      for new, old in ((new_w, w), *zip(new_slots, slots)):
        np.testing.assert_array_equal(
            np.asarray(new[other]).view(np.uint16 if old.dtype == BF16 else np.uint32),
            np.asarray(old[other]).view(np.uint16 if old.dtype == BF16 else np.uint32),
        )
  assert len(traces) == 1, "a traced layer index must not retrace"


def test_stacked_layer_out_of_range_is_clamped_like_the_reference():
  x, dy, w, slots = _inputs(7, 20, 30, 40, layers=2)
  got, want = _run_both(x, dy, w, slots, sgd_scalars(), sgd_momentum, layer=jnp.int32(5))
  _assert_same_result(got, want)


# ----------------------------------------------------------------------------
# Poisoned buffers: an unwritten tile must show.
# ----------------------------------------------------------------------------


def overwrite_rule(g, w, slots, s):
  """Ignores the old slots; moves every weight by at least 1."""
  del w, slots
  return 1.0 + s["c"] * (g * g), (g, -g)


def test_every_tile_is_written():
  # The slots come in as NaN and the rule never reads them, so any slot tile
  # the kernel fails to store keeps its NaN (interpret mode initialises an
  # aliased output with its input); every weight moves by >= 1, so an
  # unwritten weight tile equals its input; an unwritten grad-norm partial is
  # NaN (interpret mode fills fresh outputs with NaN).
  x, dy, w, _ = _inputs(8, 45, 70, 90, in_dtype=BF16, w_dtype=BF16)
  poisoned = (jnp.full(w.shape, jnp.nan, F32), jnp.full(w.shape, jnp.nan, BF16))
  scalars = {"c": jnp.float32(1e-3)}
  (new_w, new_slots, norm), want = _run_both(
      x, dy, w, poisoned, scalars, overwrite_rule, compute_grad_sq_norm=True
  )
  for s in new_slots:
    assert bool(jnp.all(jnp.isfinite(s.astype(F32))))
  assert bool(jnp.all(new_w != w))
  assert bool(jnp.isfinite(norm))
  _assert_same_result((new_w, new_slots, norm), want)


# ----------------------------------------------------------------------------
# Configuration and errors.
# ----------------------------------------------------------------------------


def test_default_tile_config_fits_small_dims_and_fp32():
  cfg = fused_dw.default_tile_config(16384, 4096, 4096, BF16)
  assert cfg == fused_dw.TUNED_TILES["t>8192"]  # large dims: the tuned tile as is
  small = fused_dw.default_tile_config(40, 24, 5000, BF16)
  assert (small.block_k, small.block_t) == (32, 64)
  assert small.block_n == fused_dw.TUNED_TILES[fused_dw.shape_class(40, 24, 5000)].block_n
  f32 = fused_dw.default_tile_config(1024, 4096, 4096, F32)
  assert f32.block_t == fused_dw.default_tile_config(1024, 4096, 4096, BF16).block_t // 2


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("block_k", 48, "block_k=48 must be a power of two >= 16"),
        ("block_n", 8, "block_n=8 must be a power of two >= 16"),
        ("block_t", 0, "block_t=0 must be a power of two >= 16"),
        ("num_warps", 3, "num_warps=3 must be one of"),
        ("num_stages", 0, "num_stages=0 must be >= 1"),
    ],
)
def test_tile_config_rejects_bad_values(field, value, match):
  with pytest.raises(ValueError, match=match):
    TileConfig(**{field: value})


def _bad_call(**changes):
  x, dy, w, slots = _inputs(9, 8, 16, 24)
  args = dict(x=x, dy=dy, w=w, slots=slots, scalars=sgd_scalars(), update_fn=sgd_momentum)
  args.update(changes)
  return fused_dw_update(**args, config=SMALL, interpret=True)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(x=jnp.ones((8, 16, 1))), r"must be 2-d \[T, K\] and \[T, N\]"),
        (dict(dy=jnp.ones((9, 24))), "same number of tokens"),
        (dict(w=jnp.ones((16, 25))), r"must be \[K, N\]=\[16, 24\]"),
        (dict(slots=(jnp.ones((16, 23)),)), r"slots\[0\].shape=\(16, 23\) must equal w.shape"),
        (dict(x=jnp.ones((8, 16), jnp.float16)), "x and dy must be float32 or bfloat16"),
        (dict(dy=jnp.ones((8, 24), jnp.int32)), "dy.dtype=int32 is not supported"),
        (dict(w=jnp.ones((16, 24), jnp.int32)), "w.dtype=int32 must be a floating dtype"),
        (dict(slots=(jnp.ones((16, 24), jnp.int8),)), r"slots\[0\].dtype=int8 must be a floating"),
        (dict(w=jnp.ones((2, 16, 24)), slots=()), "pass layer="),
        (dict(layer=jnp.int32(0)), "is not stacked"),
        (dict(scalars={"neg_lr": jnp.ones(3), "mu": 0.9}), "must be a 0-d value"),
        (dict(update_fn=lambda g, w, s, c: (g, ())), "returned 0 slots for 1 slot inputs"),
    ],
)
def test_errors_name_the_value_and_the_fix(changes, match):
  with pytest.raises(ValueError, match=match):
    _bad_call(**changes)


def test_triton_deprecation_warning_is_silenced_and_nothing_else():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fused_dw._silence_triton_deprecation()
    warnings.warn("The Pallas Triton backend is deprecated and will be removed", DeprecationWarning)
    with pytest.raises(DeprecationWarning):
      warnings.warn("something else is deprecated", DeprecationWarning)


# ----------------------------------------------------------------------------
# The real (non-interpret) path lowers to Triton IR, checked without a GPU.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer, in_dtype, stacked",
    [
        (lambda: forge_jax.adamw(1e-3, weight_decay=0.1), BF16, True),
        (lambda: forge_jax.lion(1e-4), BF16, False),  # sign
        (lambda: forge_jax.rmsprop(1e-3, centered=True, momentum=0.9), F32, False),  # rsqrt, 3 slots
    ],
)
def test_gpu_path_lowers_to_a_triton_call(optimizer, in_dtype, stacked):
  rule = optimizer().rule
  t, k, n = 1000, 384, 320  # partial tiles on every axis

  def step(x, dy, w, slots, count, layer):
    return fused_dw_update(
        x, dy, w, slots, rule.scalars(count), rule.update, layer=layer if stacked else None,
        config=TileConfig(128, 128, 64, 8, 3), compute_grad_sq_norm=True,
    )

  sds = jax.ShapeDtypeStruct
  w_shape = (2, k, n) if stacked else (k, n)
  slots = tuple(sds(w_shape, d) for d in rule.slot_dtypes(F32))
  text = lower_for_cuda(
      step, sds((t, k), in_dtype), sds((t, n), in_dtype), sds(w_shape, F32), slots,
      sds((), jnp.int32), sds((), jnp.int32),
  )
  assert text.count("xla.gpu.triton") == 1
  # w and every slot are aliased to the kernel's outputs (in place).
  assert text.count("#stablehlo.output_operand_alias<") == 1 + len(slots)
