"""The Mosaic GPU (Hopper) fused dW + update kernel, checked on a CPU.

Two checks stand in for the GPU here:

* Interpret mode: the Mosaic GPU interpreter runs the whole kernel (the ping-pong pipeline, the
  persistent tile loop, the TMA epilogue ring, barriers, in-place aliasing) and the results are
  compared with ``fused_dw_update_reference`` on random inputs. One instruction differs from the
  GPU path: the interpreter cannot read a transposed ``wgmma`` operand, so under ``interpret=``
  the kernel transposes the ``x`` block through registers into a scratch buffer.
* Cross-lowering: the real kernel (transposed ``wgmma`` operand included) is lowered to Mosaic
  GPU MLIR for ``cuda`` on the CPU, for every forge_jax rule. That catches primitives and
  layouts Mosaic GPU cannot lower; it does not run ptxas or the GPU.

Tolerance: kernel and reference both accumulate ``x.T @ dy`` in float32 and differ only in the
order of the sum over T, so float32 outputs are compared with ``rtol=2e-5`` (plus an ``atol``
of that size against the array's scale); bfloat16 outputs may land one bf16 ulp apart, so they
get ``rtol=2**-7``. Slots are random (never zeros); nu-like slots positive.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
import pallas_kernels
from pallas_kernels import fused_dw_update_reference
from pallas_kernels import mosaic
from pallas_kernels import numerics as nm
from pallas_kernels.mosaic import common as mcommon
from pallas_kernels.mosaic import config as mcfg
from pallas_kernels.mosaic import kernel as mkernel
from pallas_kernels.mosaic import rule_eval
from tests._lowering import lower_for_cuda, skip_if_cuda_lowering_needs_a_gpu

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")

F32, BF16 = jnp.float32, jnp.bfloat16
# 64x64 tiles and 64x16 epilogue sub-tiles: four sub-tiles per tile, so the two-slot ring
# refills within a tile, and the persistent loop gives the block several tiles.
SMALL = mosaic.MosaicTileConfig(tile_m=64, tile_n=64, max_concurrent_steps=2, epi_n=16,
                                grid_tile_width=2, num_sms=1)
# The fallback rows of the default table: one wgmma at a time, Pallas's store barriers.
PLAIN = dataclasses.replace(SMALL, mma_in_flight=False, no_auto_barriers=False)
# int8 as the default table runs it: one block per sub-tile row, no store barriers.
INT8 = dataclasses.replace(SMALL, tile_n=128, epi_n=64)


def _rules():
  return {
      "adamw": forge_jax.adamw(1e-3, weight_decay=0.1).rule,
      "lion": forge_jax.lion(1e-3, weight_decay=0.1).rule,
      "sgd_momentum": forge_jax.sgd(1e-2, momentum=0.9).rule,
  }


def _all_rules():
  return {
      "adam": forge_jax.adam(1e-3),
      "adamw": forge_jax.adamw(1e-3, weight_decay=0.1),
      "nadamw": forge_jax.nadamw(1e-3),
      "radam": forge_jax.radam(1e-3),
      "lion": forge_jax.lion(1e-3),
      "rmsprop_centered_momentum": forge_jax.rmsprop(1e-3, centered=True, momentum=0.9),
      "rmsprop_eps_outside": forge_jax.rmsprop(1e-3, eps_in_sqrt=False),
      "adagrad": forge_jax.adagrad(1e-2),
      "sgd": forge_jax.sgd(1e-2),
      "sgd_nesterov": forge_jax.sgd(1e-2, momentum=0.9, nesterov=True),
  }


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _inputs(seed, t, k, n, rule, *, w_dtype=F32, slot_dtype=F32, layers=None):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3 + len(rule.slot_names))
  x = jax.random.normal(ks[0], (t, k), F32).astype(BF16)
  dy = jax.random.normal(ks[1], (t, n), F32).astype(BF16)
  shape = (k, n) if layers is None else (layers, k, n)
  w = jax.random.normal(ks[2], shape, F32).astype(w_dtype)
  slots = []
  for i, name in enumerate(rule.slot_names):
    s = jax.random.normal(ks[3 + i], shape, F32)
    if name in ("nu", "sum_of_squares"):
      s = jnp.abs(s) + 0.1  # second moments are positive
    slots.append(s.astype(slot_dtype))
  return x, dy, w, tuple(slots)


def _assert_close(actual, expected, what):
  a = np.asarray(jnp.asarray(actual, F32))
  e = np.asarray(jnp.asarray(expected, F32))
  rtol = 2e-5 if jnp.asarray(expected).dtype == F32 else 2.0**-7
  scale = float(np.max(np.abs(e))) or 1.0
  np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=what)


def _run_both(x, dy, w, slots, rule, *, layer=None, norm=False, config=SMALL):
  scalars = rule.scalars(jnp.int32(3))
  update_fn = functools.partial(rule.update, decay=True)
  kernel = jax.jit(functools.partial(
      mosaic.fused_dw_update_mosaic, update_fn=update_fn, config=config,
      compute_grad_sq_norm=norm, interpret=True,
  ))
  got = kernel(x, dy, w, slots, scalars, layer=layer)
  want = fused_dw_update_reference(x, dy, w, slots, scalars, update_fn, layer=layer,
                                   compute_grad_sq_norm=norm)
  return got, want


def _check(x, dy, w, slots, rule, *, layer=None, norm=False, config=SMALL):
  (new_w, new_slots, g2), (ref_w, ref_slots, ref_g2) = _run_both(
      x, dy, w, slots, rule, layer=layer, norm=norm, config=config)
  assert new_w.dtype == w.dtype and new_w.shape == w.shape
  _assert_close(new_w, ref_w, "w")
  for i, (a, e) in enumerate(zip(new_slots, ref_slots)):
    assert a.dtype == slots[i].dtype
    _assert_close(a, e, f"slot {rule.slot_names[i]}")
  if norm:
    np.testing.assert_allclose(float(g2), float(ref_g2), rtol=1e-4)
  else:
    assert g2 is None
  return new_w, new_slots


# ----------------------------------------------------------------------------
# Interpret mode: the kernel against the reference.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("opt, w_dtype, slot_dtype, config", [
    ("adamw", F32, F32, SMALL),
    ("lion", BF16, BF16, SMALL),
    ("sgd_momentum", F32, BF16, PLAIN),
])
def test_matches_reference(opt, w_dtype, slot_dtype, config):
  """K = tile_m and N = 3 tile_n: three tiles on one block, alternating between the compute
  warpgroups (one gets two); two pipeline steps per tile through a 2-stage ring that wraps
  across tiles; two ring refills per tile."""
  rule = _rules()[opt]
  x, dy, w, slots = _inputs(0, 128, 64, 192, rule, w_dtype=w_dtype, slot_dtype=slot_dtype)
  _check(x, dy, w, slots, rule, config=config)


def test_tiles_on_two_blocks_with_norm_and_l2_lookahead():
  """3 tiles on 2 blocks: one gets 1 (an idle warpgroup), one gets 2 (2 steps each through a
  3-stage ring); the grad norm's partials start as NaN, so a tile the kernel skipped would
  show. The L2 lookahead is a hint the interpreter skips: here it must change nothing."""
  rule = _rules()["adamw"]
  cfg = dataclasses.replace(SMALL, max_concurrent_steps=3, num_sms=2, epi_l2_lookahead=2)
  x, dy, w, slots = _inputs(4, 128, 192, 64, rule, slot_dtype=BF16)
  _check(x, dy, w, slots, rule, norm=True, config=cfg)


def test_float_epilogue_loop_is_bit_identical_to_the_unrolled_one():
  """Float states at short T run the sub-tiles as a loop (one copy of their code, the gradient
  picked by bit masks); with an L2 lookahead (a hint the interpreter skips) or at long T they
  stay unrolled. Both write the same weights and states, bit for bit, with a NaN in one
  sub-tile's gradient (the masks keep it out of the others). The loop's gradient norm is checked
  against the reference by the other tests with ``norm=True`` and no lookahead."""
  plan = lambda t, cfg: mkernel._Plan(cfg=cfg, t=t, k=64, n=64, num_sms=1, num_scalars=0,
                                      with_norm=False, interpreting=True, stochastic=False,
                                      gated=False, codecs=(None,))
  assert plan(mcfg.SHORT_T, SMALL).loop and not plan(mcfg.SHORT_T + 64, SMALL).loop
  assert not plan(64, dataclasses.replace(SMALL, epi_l2_lookahead=2)).loop
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(12, 64, 128, 64, rule, w_dtype=BF16, slot_dtype=BF16)
  dy = dy.at[5, 3].set(jnp.nan)
  update_fn = pallas_kernels.skip_non_finite(rule.update)  # the guard, as forge_jax passes it
  run = lambda cfg: mosaic.fused_dw_update_mosaic(
      x, dy, w, slots, rule.scalars(jnp.int32(3)), update_fn, config=cfg,
      compute_grad_sq_norm=True, interpret=True)
  cfg = dataclasses.replace(SMALL, num_sms=2)
  looped, unrolled = run(cfg), run(dataclasses.replace(cfg, epi_l2_lookahead=2))
  for a, b in zip(jax.tree.leaves(looped[:2]), jax.tree.leaves(unrolled[:2])):
    np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32))
  assert np.isnan(float(looped[2])) and np.isnan(float(unrolled[2]))
  kept = np.asarray(looped[0], F32)[:, 3]  # column 3's gradient is NaN in every row: W kept
  np.testing.assert_array_equal(kept, np.asarray(w, F32)[:, 3])


def test_stacked_wide_sub_tiles_update_only_their_layer():
  """64x64 sub-tiles (the bf16 short-T default), stacked bf16 weights and states, the grad norm,
  and steps of 128 tokens: the other layers stay untouched bit for bit."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(11, 256, 64, 128, rule, w_dtype=BF16, slot_dtype=BF16, layers=3)
  cfg = dataclasses.replace(SMALL, epi_n=64, tile_t=128)
  new_w, new_slots = _check(x, dy, w, slots, rule, layer=jnp.int32(1), norm=True, config=cfg)
  for other in (0, 2):
    np.testing.assert_array_equal(np.asarray(new_w[other], F32), np.asarray(w[other], F32))
    for a, s in zip(new_slots, slots):
      np.testing.assert_array_equal(np.asarray(a[other], F32), np.asarray(s[other], F32))


@pytest.mark.parametrize("state, stacked", [("float32", True), ("int8", False)])
def test_stochastic_rounding_matches_reference(state, stacked):
  """bf16 weights rounded stochastically in the epilogue, with float32 states (the middle layer
  of a stack) or int8 states in forge_jax's default maps (the second moment rounds
  stochastically too; the int8 sub-tile loop): the reference's bits, since both hash (seed,
  step, layer, element index) alike. The sums over T may differ in order, so a weight may
  round the other way where its float32 values differ; none did here."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(13, 128, 64, 256, rule, w_dtype=BF16, layers=3 if stacked else None)
  if state == "int8":
    slots = _int8_slots(rule, slots, stochastic=True)
  layer = jnp.int32(1) if stacked else None
  scalars = rule.scalars(jnp.int32(3))
  update_fn = functools.partial(rule.update, decay=True)
  rounding = dict(seed=jnp.uint32(1234), step=jnp.int32(7))
  kernel = jax.jit(functools.partial(
      mosaic.fused_dw_update_mosaic, update_fn=update_fn, config=INT8 if state == "int8" else SMALL,
      interpret=True, weight_codec=nm.StochasticRound()))
  new_w, new_slots, _ = kernel(x, dy, w, slots, scalars, layer=layer, **rounding)
  ref_w, ref_slots, _ = fused_dw_update_reference(x, dy, w, slots, scalars, update_fn, layer=layer,
                                                  weight_codec=nm.StochasticRound(), **rounding)
  assert new_w.dtype == BF16
  np.testing.assert_array_equal(np.asarray(new_w, F32), np.asarray(ref_w, F32))
  nearest_w = fused_dw_update_reference(x, dy, w, slots, scalars, update_fn, layer=layer,
                                        **rounding)[0]
  assert np.mean(np.asarray(new_w, F32) != np.asarray(nearest_w, F32)) > 0.02  # not to nearest
  for name, a, e in zip(rule.slot_names, new_slots, ref_slots):
    if state == "int8":
      _assert_int8_close(a, e, name)
    else:
      _assert_close(a, e, name)


@pytest.mark.gpu  # runs everywhere: the compiled kernel on a GPU, the interpreter elsewhere
def test_stochastic_rounding_in_the_kernel_is_unbiased():
  """The kernel's stochastic rounding of bf16 weights (the compiled kernel with its default
  tiling on a GPU, the interpreter on small tiles elsewhere): SGD moves every weight of a column group from 1.0 by a fixed fraction
  ``f`` of the bf16 spacing below 1.0 (2**-8), so round to nearest would move none (f < 1/2) or
  all (f > 1/2); rounded stochastically, each lands on 1.0 or 1 - 2**-8, a fraction ``f`` of
  them on the latter (within 4 standard deviations over 4096 weights), and two steps' bits are
  independent."""
  t, k, n, groups = 64, 64, 256, 4
  fractions = (np.arange(groups) * 2 + 1) / (2 * groups)  # 1/8, 3/8, 5/8, 7/8
  lr = 2.0**-8
  x = jnp.ones((t, k), BF16)
  # dW[:, j] = sum over T of dy[:, j] = f_j (dy exact in bf16: f_j / 64 is a multiple of 2**-9).
  dy = jnp.asarray(np.repeat(fractions / t, n // groups)[None, :].repeat(t, 0), BF16)
  w = jnp.ones((k, n), BF16)
  rule = forge_jax.sgd(lr).rule
  interpret = jax.default_backend() != "gpu"  # on a GPU, the compiled kernel's default tiling
  kernel = jax.jit(functools.partial(
      mosaic.fused_dw_update_mosaic, update_fn=rule.update, config=SMALL if interpret else None,
      interpret=interpret, weight_codec=nm.StochasticRound()))
  downs = []
  for step in (1, 2):
    new_w, _, _ = kernel(x, dy, w, (), rule.scalars(jnp.int32(0)), seed=jnp.uint32(5),
                         step=jnp.int32(step))
    new = np.asarray(new_w, F32)
    assert np.isin(new, [1.0, 1.0 - 2.0**-8]).all()
    downs.append(new < 1.0)
    per_group = downs[-1].reshape(k, groups, n // groups).mean(axis=(0, 2))
    sigma = np.sqrt(fractions * (1 - fractions) / (k * n // groups))
    np.testing.assert_array_less(np.abs(per_group - fractions), 4 * sigma)
  # Independent steps: the two steps agree where both round down about f**2 of the time.
  both = (downs[0] & downs[1]).reshape(k, groups, n // groups).mean(axis=(0, 2))
  sigma = np.sqrt(fractions**2 * (1 - fractions**2) / (k * n // groups))
  np.testing.assert_array_less(np.abs(both - fractions**2), 4 * sigma)


# ----------------------------------------------------------------------------
# The rule as the kernel evaluates it.
# ----------------------------------------------------------------------------


def _divisors(fn, *args):
  """The shapes of the divisors of every division in ``fn``'s jaxpr."""
  return [tuple(e.invars[1].aval.shape) for e in jax.make_jaxpr(fn)(*args).eqns
          if e.primitive is jax.lax.div_p]


def test_scalar_divisions_become_reciprocal_products():
  """``array / scalar`` becomes ``array * (1 / scalar)`` (Adam's bias corrections; on the GPU
  the same value as Mosaic GPU's div.full.f32); divisions by an array stay, and the values stay
  within a few ulp of the rule's."""
  rule = _rules()["adamw"]
  scalars = rule.scalars(jnp.int32(3))
  leaves = jax.tree.leaves(scalars)
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  g, w, m = (jax.random.normal(k, (64, 16)) for k in ks[:3])
  v = jnp.abs(jax.random.normal(ks[3], (64, 16)))
  traced = rule_eval.trace_rule(rule.update, (64, 16), 2, scalars)
  divs = _divisors(lambda *a: traced(a[0], a[1], a[2:4], a[4:]), g, w, m, v, *leaves)
  assert divs.count((64, 16)) == 1 and divs.count(()) == 2, divs  # 1 / bc1, 1 / bc2, mu_hat / denom
  for a, e in zip(jax.tree.leaves(traced(g, w, (m, v), leaves)),
                  jax.tree.leaves(rule.update(g, w, (m, v), scalars))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)


def test_sqrt_is_rewritten_where_mosaic_lacks_it():
  """Mosaic GPU (jax 0.10.2, 0.11.1) lowers rsqrt, not sqrt: the rewrite applies exactly where
  this jax has no sqrt rule, and the rewritten rule has no sqrt and the rule's values."""
  sqrt_p = jax.lax.sqrt_p
  assert (sqrt_p in rule_eval.active_rewrites()) == (not rule_eval.lowers_natively(sqrt_p))
  assert rule_eval.lowers_natively(jax.lax.rsqrt_p)  # the probe sees the rule table
  assert sqrt_p in rule_eval.active_rewrites(force=True)
  rule = forge_jax.adamw(1e-3, weight_decay=0.1).rule
  tile = _sds((64, 16), F32)
  traced = rule_eval.trace_rule(rule.update, (64, 16), 2, rule.scalars(jnp.int32(0)),
                                force_rewrites=True)
  leaves = jax.tree.leaves(rule.scalars(jnp.int32(5)))
  rewritten = jax.make_jaxpr(lambda g, w, m, v, *s: traced(g, w, (m, v), s))(
      tile, tile, tile, tile, *leaves)
  assert "sqrt" not in str(rewritten).replace("rsqrt", "")
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  g, w, m = (jax.random.normal(k, (64, 16)) for k in ks[:3])
  v = jnp.abs(jax.random.normal(ks[3], (64, 16))).at[0, 0].set(0.0)  # sqrt(0) must stay 0
  got = traced(g, w, (m, v), leaves)
  want = rule.update(g, w, (m, v), rule.scalars(jnp.int32(5)))
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)


def test_fast_math_rewrites_sqrt_and_tile_division_only(monkeypatch):
  """On the GPU the rule's sqrt and tile / tile divisions become PTX's ftz approximations; the
  division by a scalar (already a product), integer math and non-tile shapes keep theirs."""
  rule = _rules()["adamw"]
  scalars = rule.scalars(jnp.int32(3))
  traced = rule_eval.trace_rule(rule.update, (64, 16), 2, scalars, fast_math=True)
  picked = []
  monkeypatch.setattr(rule_eval, "ptx_pointwise",
                      lambda instr, *xs: picked.append((instr, xs[0].shape)) or xs[0])
  tile = _sds((64, 16), F32)
  jax.make_jaxpr(lambda g, w, m, v, *s: traced(g, w, (m, v), s))(
      tile, tile, tile, tile, *jax.tree.leaves(scalars))
  assert sorted(picked) == [("div.approx.ftz.f32", (64, 16)), ("sqrt.approx.ftz.f32", (64, 16))]
  eqn = jax.make_jaxpr(lambda a, b: a / b)(jnp.ones((64,)), jnp.ones((64,))).eqns[0]
  assert rule_eval.fast_math_rewrite(eqn, [jnp.ones((64,))] * 2) is None  # a row, not a tile
  assert rule_eval._has_inline_ptx()  # pylint: disable=protected-access  # this jax has it
  monkeypatch.setattr(rule_eval, "_has_inline_ptx", lambda: False)  # a jax without it: exact forms
  tile_eqn = jax.make_jaxpr(lambda a, b: a / b)(jnp.ones((64, 16)), jnp.ones((64, 16))).eqns[0]
  assert rule_eval.fast_math_rewrite(tile_eqn, [jnp.ones((64, 16))] * 2) is None


@pytest.mark.parametrize("fast_math", [True, False])
def test_fast_math_reaches_the_cuda_module(fast_math):
  """The default config lowers the epilogue's sqrt and division to the ftz forms (inline PTX in
  the Mosaic GPU module); ``fast_math=False`` keeps Mosaic GPU's own lowering."""
  from experiments import kernel_tools  # pylint: disable=g-import-not-at-top

  rule = _rules()["adamw"]
  x, dy = _sds((512, 256), BF16), _sds((512, 512), BF16)
  w = _sds((256, 512), BF16)
  slots = (w, w)
  config = dataclasses.replace(mosaic.default_config(x, dy, w, slots, num_sms=132),
                               fast_math=fast_math)
  with kernel_tools.mosaic_modules() as modules:
    _lower(config, rule, x, dy, w, slots)
  text = "\n".join(modules)
  assert text, "no Mosaic GPU module captured"
  for instr in ("sqrt.approx.ftz.f32", "div.approx.ftz.f32"):
    assert (instr in text) == fast_math, instr


def test_portable_sqrt_special_values():
  """Same as sqrt at +-0, inf, negatives (NaN) and NaN; a few ulp elsewhere."""
  x = jnp.array([0.0, -0.0, jnp.inf, -1.0, -jnp.inf, jnp.nan, 4.0, 2.0, 1e-30, 3e30], F32)
  got, want = np.asarray(rule_eval.portable_sqrt(x)), np.asarray(jnp.sqrt(x))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_array_equal(np.signbit(got[:2]), [False, True])


def test_rule_that_is_not_elementwise_is_refused():
  with pytest.raises(ValueError, match="elementwise"):
    rule_eval.trace_rule(lambda g, w, s, sc: (jnp.sum(g, axis=1), s), (64, 16), 0, ())
  with pytest.raises(ValueError, match="returned 0 slots for 1"):
    rule_eval.trace_rule(lambda g, w, s, sc: (g, ()), (64, 16), 1, ())


# ----------------------------------------------------------------------------
# Cross-lowering for cuda: the real (transposed-operand) kernel.
# ----------------------------------------------------------------------------


def _lower(config, rule, x, dy, w, slots, **kw):
  kernel = jax.jit(functools.partial(mosaic.fused_dw_update_mosaic, update_fn=rule.update,
                                     config=config, **kw))
  with skip_if_cuda_lowering_needs_a_gpu():
    text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0))).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  return text


@pytest.mark.parametrize(
    "name, state_dtype, plain",
    [(name, F32, False) for name in sorted(_all_rules())]
    + [("adamw", BF16, False), ("lion", BF16, False), ("adamw", F32, True)],
)
def test_lowers_for_cuda(name, state_dtype, plain):
  """Every rule at its default tiling (and AdamW at a fallback row's options) with the grad
  norm: the rule's primitives and the epilogue's layouts lower for sm_90, and W, every state
  and the norm partials are aliased to the kernel's outputs (updated in place)."""
  rule = _all_rules()[name].rule
  x, dy = _sds((512, 256), BF16), _sds((512, 512), BF16)
  w = _sds((256, 512), state_dtype)
  slots = tuple(_sds((256, 512), state_dtype) for _ in rule.slot_names)
  config = mosaic.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
  if plain:
    config = dataclasses.replace(config, mma_in_flight=False, no_auto_barriers=False,
                                 epi_l2_lookahead=4)
  text = _lower(config, rule, x, dy, w, slots, compute_grad_sq_norm=True)
  assert text.count("custom_call @mosaic_gpu") == 1
  assert text.count("#stablehlo.output_operand_alias<") == 2 + len(slots)


def test_default_configs_in_the_smem_margin_lower_for_cuda():
  """The budget admits configs up to 3 KiB under Mosaic GPU's 227 KiB limit by smem_bytes'
  count; Mosaic's own accounting (checked while lowering, also cross-lowering) must agree for
  every default it picks near the budget."""
  margin_low = mcfg.MOSAIC_SMEM_LIMIT - 4 * 1024
  lowered = []
  for name, dt, t, norm in itertools.product(("adamw", "rmsprop_centered_momentum", "lion"),
                                             (F32, BF16), (1024, 4096), (False, True)):
    rule = _all_rules()[name].rule
    x, dy, w = _sds((t, 4096), BF16), _sds((t, 4096), BF16), _sds((4096, 4096), dt)
    slots = tuple(_sds((4096, 4096), dt) for _ in rule.slot_names)
    cfg = mosaic.default_config(x, dy, w, slots, compute_grad_sq_norm=norm, num_sms=132)
    assert mosaic.supports(x, dy, w, slots, cfg, compute_grad_sq_norm=norm) == (True, "")
    smem = mcfg.smem_bytes(cfg, BF16, dt, [dt] * len(slots), norm)
    if smem > margin_low:
      _lower(cfg, rule, x, dy, w, slots, compute_grad_sq_norm=norm)
      lowered.append((name, jnp.dtype(dt).name))
  # fp32 AdamW's default (4 stages, 64x32) and bf16's at short T (64x64) are in the margin.
  assert set(lowered) >= {("adamw", "float32"), ("adamw", "bfloat16")}, lowered


@pytest.mark.parametrize("w_dtype, stacked, t",
                         [(BF16, True, 1024), (F32, False, 4096), (BF16, False, 1024)])
def test_stochastic_rounding_and_int8_states_lower_for_cuda(w_dtype, stacked, t):
  """The SR epilogue (uint32 hash on WGMMA-layout iotas) with forge_jax's default int8 maps
  (the second moment rounds stochastically; 128x64 tiles at short T under an fp32 weight,
  128x128 otherwise) or
  stacked bf16 states, the sub-tiles as a loop: the default tiling lowers for sm_90 (the
  interpreter runs these epilogues on small tiles only)."""
  rule = _all_rules()["adamw"].rule
  lead = (3,) if stacked else ()
  x, dy = _sds((t, 4096), BF16), _sds((t, 4096), BF16)
  w = _sds(lead + (4096, 4096), w_dtype)
  if stacked:
    slots = tuple(_sds(lead + (4096, 4096), BF16) for _ in rule.slot_names)
  else:
    precision = forge_jax.Precision(state_dtype="int8")
    slots = tuple(nm.QuantizedArray(_sds((4096, 4096), jnp.int8), _sds((64, 4096), F32),
                                    precision.codec(name)) for name in rule.slot_names)
  cfg = mosaic.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
  assert cfg.no_auto_barriers and (stacked or cfg.epi_n == 64)
  kw = dict(weight_codec=nm.StochasticRound()) if w_dtype == BF16 else {}
  kernel = jax.jit(functools.partial(mosaic.fused_dw_update_mosaic, update_fn=rule.update,
                                     config=cfg, compute_grad_sq_norm=True, **kw))
  args = dict(seed=jnp.uint32(1), step=jnp.int32(2), layer=jnp.int32(1) if stacked else None)
  with skip_if_cuda_lowering_needs_a_gpu():
    text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)), **args).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_config_reaches_the_compiler_params(monkeypatch, tmp_path):
  """no_auto_barriers and the profiler argument reach plgpu.CompilerParams, with warpgroup
  lowering semantics on every jax. Lowering the profiled kernel builds the instrumented module
  for sm_90; only the trace-dumping host callback, lowered after it, needs a CUDA backend."""
  rule = _rules()["adamw"]
  x, dy, w = _sds((128, 256), BF16), _sds((128, 256), BF16), _sds((256, 256), F32)
  built = []
  real = plgpu.CompilerParams
  monkeypatch.setattr(mkernel.plgpu, "CompilerParams", lambda **kw: built.append(kw) or real(**kw))
  for cfg, profile in ((mosaic.MosaicTileConfig(num_sms=132), None),
                       # The profiler's buffers take shared memory: fewer stages.
                       (mosaic.MosaicTileConfig(max_concurrent_steps=2, no_auto_barriers=False,
                                                num_sms=132), (64, str(tmp_path)))):
    kernel = jax.jit(functools.partial(mosaic.fused_dw_update_mosaic, update_fn=rule.update,
                                       config=cfg, profile=profile))
    traced = kernel.trace(x, dy, w, (w, w), rule.scalars(jnp.int32(0)))
    try:
      traced.lower(lowering_platforms=("cuda",))
    except ValueError as e:  # the dump callback: see the docstring
      assert profile is not None and "platform for the specified backend" in str(e)
    except RuntimeError as e:
      if "GPU" not in str(e):
        raise
  assert [kw["unsafe_no_auto_barriers"] for kw in built] == [True, False], built
  assert all(kw["lowering_semantics"] == plgpu.LoweringSemantics.Warpgroup for kw in built)
  assert "profile_space" not in built[0] and built[1]["profile_space"] == 64
  assert built[1]["profile_dir"] == str(tmp_path)


def test_calls_with_the_same_shapes_lower_once(monkeypatch):
  """An unrolled model calls the kernel once per layer: calls with the same shapes, rule and
  tiling share one trace, so a jit module holds one kernel per shape (lowering one takes about
  1.7 s on the host: experiments/results/cpu/unrolled_lowering/). A rule that cannot be hashed
  (an array hyperparameter) still works, lowered at every call."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  monkeypatch.setattr(mcfg, "device_problem", lambda: None)

  def kernels(opt):
    def f(x, dy, ws, dy2, w2):
      outs = [forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="mosaic") for w in ws]
      outs.append(forge_jax.fused_linear_update(x, dy2, w2, opt.init(w2), opt, backend="mosaic"))
      return outs

    args = (_sds((128, 128), BF16), _sds((128, 256), BF16), [_sds((128, 256), BF16)] * 3,
            _sds((128, 128), BF16), _sds((128, 128), BF16))
    return len(re.findall(r"custom_call @mosaic_gpu", lower_for_cuda(f, *args)))

  assert kernels(forge_jax.adamw(1e-3)) == 2  # 3 calls at one shape + 1 at another
  assert kernels(forge_jax.adamw(jnp.float32(1e-3))) == 4


# ----------------------------------------------------------------------------
# What the kernel accepts, and the default table.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, dy, w, n_slots, fragment",
    [
        ((4096, 4095), (4096, 4096), (4095, 4096), 2, "K=4095"),
        ((4096, 4096), (4096, 4100), (4096, 4100), 2, "N=4100"),
        ((4000, 4096), (4000, 4096), (4096, 4096), 2, "T=4000"),
        ((4096, 4096), (4096, 4096), (4096, 4096), 5, "at most 4"),
        ((4096, 4096), (4096, 4096), (4096, 2048), 2, "must be [K, N]=[4096, 4096]"),
    ],
)
def test_supports_rejects_shapes(x, dy, w, n_slots, fragment):
  slots = [_sds(w, F32)] * n_slots
  ok, reason = mosaic.supports(_sds(x, BF16), _sds(dy, BF16), _sds(w, F32), slots)
  assert not ok and fragment in reason, reason
  cfg, why = mosaic.select_config(_sds(x, BF16), _sds(dy, BF16), _sds(w, F32), slots)
  assert cfg is None and why == reason


def test_supports_rejects_dtypes_and_configs():
  x, dy, w = _sds((1024, 1024), BF16), _sds((1024, 1024), BF16), _sds((1024, 1024), F32)
  ok, reason = mosaic.supports(_sds((1024, 1024), F32), _sds((1024, 1024), F32), w, [w])
  assert not ok and "bfloat16" in reason
  ok, reason = mosaic.supports(x, dy, _sds((1024, 1024), jnp.int8), [])
  assert not ok and "w dtype" in reason
  big = mosaic.MosaicTileConfig(tile_m=64, tile_n=256, epi_n=64, max_concurrent_steps=6)
  ok, reason = mosaic.supports(x, dy, w, [w, w], big)
  assert not ok and "shared memory" in reason
  ok, reason = mosaic.supports(x, dy, w, [w], mosaic.MosaicTileConfig(tile_n=256, epi_n=64))
  assert not ok and "128x256 float32 accumulator takes 256 of the 232 registers" in reason
  for change, fragment in [(dict(tile_m=96), "tile_m=96"), (dict(max_concurrent_steps=1), ">= 2"),
                           (dict(epi_n=24), "epi_n=24"), (dict(epi_l2_lookahead=-1), ">= 0")]:
    ok, reason = mosaic.supports(x, dy, w, [w], mosaic.MosaicTileConfig(**change))
    assert not ok and fragment in reason, (change, reason)
  with pytest.raises(ValueError, match="T=1000"):
    mosaic.fused_dw_update_mosaic(
        jnp.zeros((1000, 1024), BF16), jnp.zeros((1000, 1024), BF16), jnp.zeros((1024, 1024)),
        (), (), lambda g, w, s, sc: (g, ()))
  with pytest.raises(ValueError, match="not a MosaicTileConfig"):
    mosaic.select_config(x, dy, w, [w], config=object())


def _int8_slots(rule, slots, stochastic=False):
  p = forge_jax.Precision(state_dtype="int8")
  if not stochastic:
    nearest = lambda q: nm.QuantMap(q.kind, q.signed, q.mantissa_bits, "nearest")
    p = forge_jax.Precision(state_dtype="int8", signed_map=nearest(p.signed_map),
                            unsigned_map=nearest(p.unsigned_map))
  return tuple(p.codec(name).quantize(s.astype(F32)) for name, s in zip(rule.slot_names, slots))


@pytest.mark.parametrize("t, fp32_want, bf16_want", [(1024, (4, 32), (4, 64)), (4096, (4, 32), (5, 32))])
def test_default_tiling_follows_the_sweeps(t, fp32_want, bf16_want):
  """(stages, sub-tile width) of the defaults: the fp32 sweeps' best for float32 (and mixed)
  states, the bf16 sweep's best when the weight and every state take 2 bytes; the field
  defaults are float32 AdamW's pick."""
  x, dy = _sds((t, 4096), BF16), _sds((t, 4096), BF16)
  pick = lambda w_dt, s_dt, n_slots: mosaic.default_config(
      x, dy, _sds((4096, 4096), w_dt), [_sds((4096, 4096), s_dt)] * n_slots)
  picks = lambda *a: (lambda c: (c.max_concurrent_steps, c.epi_n))(pick(*a))
  assert pick(F32, F32, 2) == mosaic.MosaicTileConfig()
  assert picks(BF16, F32, 2) == fp32_want
  assert picks(F32, F32, 1) == fp32_want  # Lion fp32 would fit 5 stages: never timed, not taken
  assert picks(BF16, BF16, 2) == bf16_want
  assert picks(BF16, BF16, 1) == bf16_want


@pytest.mark.parametrize("k, n, small", [(1024, 1024, True), (1024, 3072, True), (3072, 1024, True),
                                         (2048, 2048, False), (2048, 6144, False), (4096, 4096, False)])
def test_default_tiling_takes_64_row_tiles_for_small_grids(k, n, small):
  """Weights of at most 1.5 128x128 tiles per SM (132 on an H200) take 64-row tiles; every
  float-state default drops Pallas's store barriers, int8 states keep them (they need them)."""
  x, dy = _sds((1024, k), BF16), _sds((1024, n), BF16)
  for dt in (F32, BF16):
    w = _sds((k, n), dt)
    cfg = mosaic.default_config(x, dy, w, [w, w], num_sms=132)
    assert (cfg.tile_m == 64) == small, (k, n, dt, cfg)
    assert cfg.no_auto_barriers and mosaic.supports(x, dy, w, [w, w], cfg) == (True, "")
  # The count is per SM: with 32 SMs none of these (64 tiles or more, > 1.5 x 32) is small.
  assert mosaic.default_config(x, dy, _sds((k, n), BF16), [_sds((k, n), BF16)], num_sms=32).tile_m == 128


def test_default_table_rows_for_odd_shapes_and_int8():
  """Shapes the 128x128 rows do not divide fall back to smaller tiles (one wgmma at a time,
  Pallas's store barriers); when nothing fits, the reason names the loosest row's requirement."""
  x, dy = _sds((1024, 192), BF16), _sds((1024, 320), BF16)
  w = _sds((192, 320), F32)
  cfg = mosaic.default_config(x, dy, w, [w, w])
  assert (cfg.tile_m, cfg.tile_n, cfg.mma_in_flight, cfg.no_auto_barriers) == (64, 64, False, False)
  assert mosaic.supports(x, dy, w, [w, w]) == (True, "")
  ok, why = mosaic.supports(x, _sds((1024, 100), BF16), _sds((192, 100), F32), [])
  assert not ok and "N=100 must be a multiple of tile_n=64" in why
  rule = _rules()["adamw"]
  q = _int8_slots(rule, rule.init_slots(jnp.zeros((128, 256), F32)))
  cfg = mosaic.default_config(_sds((128, 128), BF16), _sds((128, 256), BF16), _sds((128, 256), F32), q)
  assert cfg.epi_n == q[0].codec.block and cfg.no_auto_barriers


@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_int8_default_tiles_follow_the_sweeps(w_dtype):
  """int8 states: 128x128 tiles, 4 stages and one ring slot at long T (the main loop bounds),
  and at short T under a 2-byte weight; an fp32 weight keeps 128x64 tiles with two slots at
  short T, where 128x128 lost; the loop on rotated slices at long T (H100,
  docs/mosaic_kernel.md)."""
  w, precision = _sds((4096, 4096), w_dtype), forge_jax.Precision(state_dtype="int8")
  q = [nm.QuantizedArray(_sds((4096, 4096), jnp.int8), _sds((64, 4096), F32), precision.codec(name))
       for name in ("mu", "nu")]
  pick = lambda t: mosaic.default_config(_sds((t, 4096), BF16), _sds((t, 4096), BF16), w, q,
                                         compute_grad_sq_norm=True, num_sms=132)
  picks = [(pick(t).tile_n, pick(t).max_concurrent_steps, pick(t).epi_slots, pick(t).epi_rotate)
           for t in (1024, 2048, 4096)]
  short = (64, 4, 2, False) if w_dtype == F32 else (128, 4, 1, False)
  assert picks == [short, short, (128, 4, 1, True)]
  for t in (1024, 4096):
    x = _sds((t, 4096), BF16)
    assert mosaic.supports(x, x, w, q, pick(t), compute_grad_sq_norm=True) == (True, "")


@pytest.mark.parametrize("t, k, n, few", [(512, 1024, 1024, True), (1024, 4096, 1024, True),
                                         (2048, 5120, 1024, True), (1024, 4096, 2048, False),
                                         (4096, 4096, 1024, False)])
def test_int8_takes_64_row_tiles_where_128x128_gives_few_per_sm(t, k, n, few):
  """int8 states under a 2-byte weight at short T on at most 2.5 tiles of 128x128 per SM (the
  k/v projections): 64x128 tiles with 6 stages and two ring slots, which fit with the grad norm;
  more tiles or long T keep 128x128 tiles, an fp32 weight its 128-row tiles."""
  precision = forge_jax.Precision(state_dtype="int8")
  q = [nm.QuantizedArray(_sds((k, n), jnp.int8), _sds((n // 64, k), F32), precision.codec(name))
       for name in ("mu", "nu")]
  x, dy = _sds((t, k), BF16), _sds((t, n), BF16)
  for w_dtype in (BF16, F32):
    w = _sds((k, n), w_dtype)
    cfg = mosaic.default_config(x, dy, w, q, compute_grad_sq_norm=True, num_sms=132)
    got = (cfg.tile_m, cfg.tile_n, cfg.max_concurrent_steps, mcfg.ring_depth(cfg))
    assert got == ((64, 128, 6, 2) if few and w_dtype == BF16 else (128,) + got[1:]), (w_dtype, got)
    assert mosaic.supports(x, dy, w, q, cfg, compute_grad_sq_norm=True) == (True, "")


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("n_slots", [0, 1, 2, 3])
def test_default_config_fits(state_dtype, n_slots):
  x, dy = _sds((4096, 4096), BF16), _sds((4096, 14336), BF16)
  w = _sds((4096, 14336), state_dtype)
  cfg = mosaic.default_config(x, dy, w, [w] * n_slots, compute_grad_sq_norm=True)
  assert mosaic.supports(x, dy, w, [w] * n_slots, cfg, compute_grad_sq_norm=True) == (True, "")


def test_planar_snake_visits_every_tile_once_in_plgpus_order():
  for m, n, width in [(5, 7, 3), (4, 8, 8), (6, 6, 4), (3, 9, 2)]:
    lin = jnp.arange(m * n, dtype=jnp.int32)
    mi, ni = (np.asarray(v) for v in mcommon.planar_snake(lin, m, n, width))
    assert sorted(zip(mi.tolist(), ni.tolist())) == [(i, j) for i in range(m) for j in range(n)]
    if n % width:  # plgpu's version divides by zero otherwise
      ref = plgpu.planar_snake(lin, (m, n), 1, width)
      np.testing.assert_array_equal(mi, np.asarray(ref[0]))
      np.testing.assert_array_equal(ni, np.asarray(ref[1]))


# ----------------------------------------------------------------------------
# int8 states in the kernel.
# ----------------------------------------------------------------------------


def _assert_int8_close(got, want, what):
  diff = np.abs(np.asarray(got.codes, np.int32) - np.asarray(want.codes, np.int32))
  assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3, (what, diff.max(), np.mean(diff > 0))
  np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), rtol=1e-5, err_msg=what)
  assert got.codes.dtype == jnp.int8 and got.scale.shape == want.scale.shape


@pytest.mark.parametrize("name, w_dtype, layers", [("adamw", F32, None), ("lion", BF16, 3)])
def test_int8_slots_match_reference(name, w_dtype, layers):
  """Codes + per-row scales through the ring (2 slots, 2 sub-tiles per tile, 2 tiles on one
  block: the ring wraps within and across tiles), decoded, updated and re-encoded in the
  epilogue: the reference codec's codes (round-to-nearest maps here; the default, stochastic
  maps in test_stochastic_rounding_matches_reference)."""
  rule = _rules()[name]
  x, dy, w, slots = _inputs(8, 64, 64, 256, rule, w_dtype=w_dtype, layers=layers)
  slots = _int8_slots(rule, slots)
  layer = None if layers is None else jnp.int32(1)
  (new_w, new_slots, _), (ref_w, ref_slots, _) = _run_both(x, dy, w, slots, rule, layer=layer,
                                                           config=INT8)
  _assert_close(new_w, ref_w, "w")
  for i, (a, e) in enumerate(zip(new_slots, ref_slots)):
    assert isinstance(a, nm.QuantizedArray) and a.codec == slots[i].codec
    _assert_int8_close(a, e, rule.slot_names[i])
    if name == "lion":  # no division in the rule: the same float32 values reach both codecs
      np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(e.codes))
      np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(e.scale))
  if layers is not None:  # the other layers untouched, bit for bit
    for other in (0, 2):
      np.testing.assert_array_equal(np.asarray(new_w[other], F32), np.asarray(w[other], F32))
      for a, s in zip(new_slots, slots):
        np.testing.assert_array_equal(np.asarray(a.codes[other]), np.asarray(s.codes[other]))
        np.testing.assert_array_equal(np.asarray(a.scale[other]), np.asarray(s.scale[other]))


def test_int8_epilogue_loop_matches_reference():
  """int8 states: one copy of the sub-tile code runs once per sub-tile (its gradient picked from
  the accumulator's slices by bit masks), through ring refills within and across tiles, with
  the grad norm summed from the whole accumulator; the loop prefetches nothing into L2."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(11, 64, 64, 256, rule)
  slots = _int8_slots(rule, slots)
  (new_w, new_slots, norm), (ref_w, ref_slots, ref_norm) = _run_both(x, dy, w, slots, rule,
                                                                     norm=True, config=INT8)
  _assert_close(new_w, ref_w, "w")
  for name, a, e in zip(rule.slot_names, new_slots, ref_slots):
    _assert_int8_close(a, e, name)
  np.testing.assert_allclose(float(norm), float(ref_norm), rtol=1e-5)
  ok, why = mosaic.supports(x, dy, w, slots, dataclasses.replace(INT8, epi_l2_lookahead=2))
  assert not ok and "epi_l2_lookahead=2 must be 0" in why


def test_int8_epilogue_ring_slots_and_rotated_loop_are_bit_identical():
  """On a 128x128 tile's four 64x64 sub-tiles, with a stochastically rounded bf16 weight and a NaN
  in one sub-tile's gradient: one ring slot (each sub-tile waits for its own refill) and the
  loop on rotated slices (``epi_rotate``: the int8 default at long T) give W, the int8 states and
  the grad norm bit for bit as two slots picking each slice from the accumulator."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(13, 64, 128, 128, rule, w_dtype=BF16)
  dy = dy.at[7, 70].set(jnp.nan)
  slots = _int8_slots(rule, slots, stochastic=True)
  base = dataclasses.replace(INT8, tile_m=128, epi_slots=2)
  assert mcfg.ring_depth(base) == 2
  run = lambda cfg: jax.jit(functools.partial(
      mosaic.fused_dw_update_mosaic, update_fn=pallas_kernels.skip_non_finite(
          functools.partial(rule.update, decay=True)), config=cfg, interpret=True,
      compute_grad_sq_norm=True, weight_codec=nm.StochasticRound()))(
          x, dy, w, slots, rule.scalars(jnp.int32(3)), seed=jnp.uint32(5), step=jnp.int32(2))
  want = jax.tree.leaves(run(base))
  for cfg in (dataclasses.replace(base, epi_slots=1),
              dataclasses.replace(base, epi_slots=1, epi_rotate=True)):
    for a, b in zip(want, jax.tree.leaves(run(cfg))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_int8_slots_refusals():
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(9, 64, 64, 128, rule)
  q = _int8_slots(rule, slots)
  ok, why = mosaic.supports(x, dy, w, q, dataclasses.replace(INT8, epi_n=32))
  assert not ok and "epi_n=32 must equal the block" in why
  bad = (nm.QuantizedArray(q[0].codes, q[0].scale.T, q[0].codec), q[1])  # not block-major
  ok, why = mosaic.supports(x, dy, w, bad, INT8)
  assert not ok and "slots[0].scale.shape=(64, 2) must be (2, 64)" in why
  sr = _int8_slots(rule, slots, stochastic=True)
  with pytest.raises(ValueError, match="seed="):  # SR maps need the seed and step
    mosaic.fused_dw_update_mosaic(x, dy, w, sr, rule.scalars(jnp.int32(1)), rule.update, config=INT8)
