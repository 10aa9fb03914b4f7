"""The Mosaic GPU (Hopper) fused dW + update kernel, checked on a CPU.

Two checks stand in for the GPU here:

* Interpret mode: the Mosaic GPU interpreter runs the whole kernel (the
  warp-specialized pipeline, the persistent tile loop, the TMA epilogue ring,
  barriers, in-place aliasing) and the results are compared with
  ``fused_dw_update_reference`` on random inputs. One instruction differs from
  the GPU path: the interpreter cannot read a transposed ``wgmma`` operand
  (its ``to_range`` understands only indexer transforms, jax 0.10.2 and 0.11),
  so under ``interpret=`` the kernel transposes the ``x`` block through
  registers into a scratch buffer instead of passing
  ``plgpu.transpose_ref(x_smem)`` to ``wgmma``.
* Cross-lowering: the real kernel (transposed ``wgmma`` operand included) is
  lowered to Mosaic GPU MLIR for ``cuda`` on the CPU, for every forge_jax
  rule. That catches primitives and layouts Mosaic GPU cannot lower; it does
  not run ptxas or the GPU.

Tolerance: kernel and reference both accumulate ``x.T @ dy`` in float32 and
differ only in the order of the sum over T, so float32 outputs are compared
with ``rtol=2e-5`` (plus an ``atol`` of that size against the array's scale);
bfloat16 outputs may land one bf16 ulp apart, so they get ``rtol=2**-7``.
Slots are random (never zeros); nu-like slots positive.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import itertools
import json
import os
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from pallas_kernels import fused_dw_mosaic as fm
from pallas_kernels import numerics as nm
from pallas_kernels.fused_dw import fused_dw_update_reference
from tests._lowering import lower_for_cuda, skip_if_cuda_lowering_needs_a_gpu

F32, BF16 = jnp.float32, jnp.bfloat16
# 64x(2*64) block tiles and 64x16 epilogue sub-tiles: four sub-tiles per
# warpgroup tile, so the two-slot epilogue ring refills within a tile, and the
# persistent loop gives each block several tiles.
SMALL = fm.MosaicTileConfig(
    tile_m=64, tile_n=64, tile_t=64, max_concurrent_steps=2, epi_m=64, epi_n=16,
    epi_slots=2, grid_tile_width=2, num_sms=1,
)


def _rules():
  return {
      "adamw": forge_jax.adamw(1e-3, weight_decay=0.1).rule,
      "lion": forge_jax.lion(1e-3, weight_decay=0.1).rule,
      "sgd_momentum": forge_jax.sgd(1e-2, momentum=0.9).rule,
  }


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
      fm.fused_dw_update_mosaic, update_fn=update_fn, config=config,
      compute_grad_sq_norm=norm, interpret=True,
  ))
  got = kernel(x, dy, w, slots, scalars, layer=layer)
  want = fused_dw_update_reference(
      x, dy, w, slots, scalars, update_fn, layer=layer, compute_grad_sq_norm=norm
  )
  return got, want


# ----------------------------------------------------------------------------
# Interpret mode: the kernel against the reference.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opt, w_dtype, slot_dtype",
    [("adamw", F32, F32), ("lion", BF16, BF16), ("sgd_momentum", F32, BF16)],
)
def test_matches_reference(opt, w_dtype, slot_dtype):
  rule = _rules()[opt]
  # K = 2 tile_m and N = 2 * (2 tile_n): four block tiles on one block.
  x, dy, w, slots = _inputs(0, 128, 128, 256, rule, w_dtype=w_dtype, slot_dtype=slot_dtype)
  (new_w, new_slots, norm), (ref_w, ref_slots, _) = _run_both(x, dy, w, slots, rule)
  assert norm is None
  assert new_w.dtype == w.dtype and new_w.shape == w.shape
  _assert_close(new_w, ref_w, "w")
  for i, (a, e) in enumerate(zip(new_slots, ref_slots)):
    assert a.dtype == slots[i].dtype
    _assert_close(a, e, f"slot {rule.slot_names[i]}")


def test_stochastic_rounding_under_the_interpreter_is_a_clear_error():
  """jax 0.10.2's Mosaic GPU interpreter hangs on the SR epilogue (iota, uint32 bitcast):
  refused up front instead; the real path is covered by lowering for cuda (below)."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(4, 64, 128, 128, rule, w_dtype=BF16)
  with pytest.raises(NotImplementedError, match="interpreter"):
    fm.fused_dw_update_mosaic(
        x, dy, w, slots, rule.scalars(jnp.int32(3)), rule.update, config=SMALL, interpret=True,
        weight_codec=nm.StochasticRound(), seed=jnp.uint32(1), step=jnp.int32(2),
    )


def test_grad_sq_norm_and_every_tile_written():
  """The norm partials start as NaN, so a tile the kernel skipped would show."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(1, 64, 128, 128, rule)
  (new_w, new_slots, norm), (ref_w, ref_slots, ref_norm) = _run_both(x, dy, w, slots, rule, norm=True)
  np.testing.assert_allclose(float(norm), float(ref_norm), rtol=2e-5)
  _assert_close(new_w, ref_w, "w")
  for a, e in zip(new_slots, ref_slots):
    _assert_close(a, e, "slot")


def _assert_matches_reference_with_norm(x, dy, w, slots, rule, cfg):
  (new_w, new_slots, norm), (ref_w, ref_slots, ref_norm) = _run_both(
      x, dy, w, slots, rule, norm=True, config=cfg
  )
  np.testing.assert_allclose(float(norm), float(ref_norm), rtol=2e-5)
  _assert_close(new_w, ref_w, "w")
  for a, e in zip(new_slots, ref_slots):
    _assert_close(a, e, "slot")


def test_pingpong_schedule_matches_reference(tuned=True):
  """Each warpgroup owns whole tiles; 3 tiles on 2 blocks: one gets 1 (one idle warpgroup),
  one gets 2 (4 steps through a 3-stage ring: it wraps across tiles)."""
  # tuned=False (the default knobs) ran on the H200 (sweep rows, checked);
  # here the knobs it leaves off, which have not.
  rule = _rules()["adamw"]
  cfg = fm.MosaicTileConfig(
      schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=3, epi_n=16, num_sms=2,
      # one wgmma in flight: stages released a step late (barrier counts);
      # the L2 lookahead is skipped by the interpreter.
      mma_in_flight=tuned, epi_l2_lookahead=2 if tuned else 0,
  )
  x, dy, w, slots = _inputs(4, 128, 192, 64, rule, slot_dtype=BF16)
  _assert_matches_reference_with_norm(x, dy, w, slots, rule, cfg)


def test_whole_tile_ring_matches_reference():
  """epi_slots = the sub-tiles of a warpgroup tile (4 of 64x16 in 64x64): the whole tile's W and
  states are loaded at the tile's start, while its main loop runs, and no slot is refilled within
  a tile (the configs of h200_session.sh's whole_tile part, at T=1024 on the H200)."""
  rule = _rules()["adamw"]
  cfg = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=2,
                            epi_n=16, epi_slots=4, num_sms=2)
  assert fm._ring_depth(cfg) == 4
  x, dy, w, slots = _inputs(5, 128, 128, 256, rule, slot_dtype=BF16)  # 8 warpgroup tiles, 2 blocks
  _assert_matches_reference_with_norm(x, dy, w, slots, rule, cfg)


@pytest.mark.parametrize("epi_slots, k, state_dtype", [(1, 128, BF16), (2, 128, F32), (2, 192, BF16)])
def test_shared_ring_matches_reference(epi_slots, k, state_dtype):
  """epi_shared_ring: one ring of 2 x epi_slots slots for both warpgroups, each slot refilled
  with the sub-tile 2 x epi_slots ahead in the block's order, which near a tile's end is the
  next tile's (the other warpgroup's). 64x64 tiles of 4 sub-tiles on 2 blocks: K=128 gives 4
  tiles per block (the ring passes between the warpgroups three times), K=192 gives 6 and 6
  with 2 slots, i.e. every fill of a tile's sub-tiles from the other warpgroup's epilogue."""
  rule = _rules()["adamw"]
  cfg = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=2,
                            epi_n=16, epi_slots=epi_slots, num_sms=2, mma_in_flight=True,
                            epi_shared_ring=True)
  x, dy, w, slots = _inputs(8, 128, k, 256, rule, w_dtype=state_dtype, slot_dtype=state_dtype)
  _assert_matches_reference_with_norm(x, dy, w, slots, rule, cfg)


def test_shared_ring_config_problems():
  """What epi_shared_ring cannot take is named, with the fix."""
  base = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=2,
                             epi_n=16, epi_slots=2, epi_shared_ring=True)
  assert fm._config_problem(base) is None
  cases = {
      "needs schedule='pingpong'": dict(schedule="cooperative"),
      "the 4 epilogue sub-tiles of a 64x64 tile to be a multiple of 2 x epi_slots = 6": dict(epi_slots=3),
      "needs epi_out_slots=0 (got 2)": dict(epi_out_slots=2, no_auto_barriers=False),
      "needs epi_l2_lookahead=0 (got 2)": dict(epi_l2_lookahead=2),
      "needs epi_direct=False": dict(epi_direct=True),
      "needs cluster_n=1 (got 2)": dict(cluster_n=2),
  }
  for want, change in cases.items():
    problem = fm._config_problem(dataclasses.replace(base, **change))
    assert problem is not None and want in problem, (change, problem)


def test_steps_of_128_tokens_match_reference():
  """tile_t=128 (two 64-token wgmma K-chunks per stage, h200_session.sh tile_t128): ping-pong
  over 4 steps and 2 tiles per block, stacked layer and grad norm."""
  rule = _rules()["adamw"]
  cfg = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, tile_t=128,
                            max_concurrent_steps=2, epi_n=16, num_sms=2, mma_in_flight=True)
  x, dy, w, slots = _inputs(10, 512, 128, 256, rule)
  _assert_matches_reference_with_norm(x, dy, w, slots, rule, cfg)


def test_stage_l2_lookahead_config_problems():
  """stage_l2_lookahead is a ping-pong producer's hint: negative or cooperative configs are
  named. The interpreter has no L2 and skips the prefetch, so parity there would not test it:
  its GPU code is checked by lowering (test_lowers_for_cuda: the module changes) and on the
  H200 (main_loop rows are checked against the reference before they are timed)."""
  base = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=2,
                             epi_n=16, num_sms=2, mma_in_flight=True, stage_l2_lookahead=3)
  assert fm._config_problem(base) is None
  problem = fm._config_problem(dataclasses.replace(base, stage_l2_lookahead=-1))
  assert problem is not None and "stage_l2_lookahead=-1 must be >= 0" in problem
  problem = fm._config_problem(dataclasses.replace(base, schedule="cooperative", mma_in_flight=False))
  assert problem is not None and "stage_l2_lookahead=3 needs schedule='pingpong'" in problem


def test_pipeline_across_tiles_applies_where_jax_allows():
  """pipeline_across_tiles runs a block's cooperative tiles as one pipeline of pipelines (START,
  STEADY..., STOP) where every block gets two tiles or more and the stages divide the steps;
  elsewhere each tile runs its own pipeline. Under the Mosaic GPU interpreter on this 2-core
  machine the kernel hangs with the knob on (MOSAIC_NOTES, session 14), so its values are
  checked on the GPU (check_mosaic_gpu --quick) and its lowering below."""
  cfg = fm.MosaicTileConfig(schedule="cooperative", tile_m=64, tile_n=64, max_concurrent_steps=2,
                            epi_n=16, num_sms=2, pipeline_across_tiles=True)
  assert fm._across_tiles(cfg, 256, 192, 256, 2)  # 6 tiles of 64x128 on 2 blocks, 4 steps, 2 stages
  assert not fm._across_tiles(cfg, 192, 192, 256, 2)  # 3 steps, 2 stages
  assert not fm._across_tiles(cfg, 256, 192, 256, 4)  # a block with 1 tile
  assert not fm._across_tiles(dataclasses.replace(cfg, pipeline_across_tiles=False), 256, 192, 256, 2)
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(7, 256, 192, 256, rule, slot_dtype=BF16)
  ok, why = fm.supports(x, dy, w, slots, dataclasses.replace(cfg, schedule="pingpong"))
  assert not ok and "pipeline_across_tiles=True needs schedule='cooperative'" in why


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_separate_store_buffers_match_reference(schedule):
  """epi_out_slots: results staged in their own buffers, the ring slot refilled
  before the store; 8 sub-tiles per warpgroup tile through 2 slots and 2
  buffers (both reused within a tile and across tiles)."""
  rule = _rules()["adamw"]
  cfg = fm.MosaicTileConfig(
      schedule=schedule, tile_m=64, tile_n=128, max_concurrent_steps=2, epi_n=16, num_sms=1,
      epi_out_slots=2,
  )
  n = 256 if schedule == "pingpong" else 512
  # T = 2 steps: under the interpreter the cooperative pipeline hangs at T = tile_t
  # (one step, fewer than its stages; it ran on the H200: the sweep's T=64 probe).
  x, dy, w, slots = _inputs(6, 128, 128, n, rule, w_dtype=BF16, slot_dtype=F32)
  _assert_matches_reference_with_norm(x, dy, w, slots, rule, cfg)


def test_stacked_layer_updates_only_its_slice():
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(2, 64, 64, 128, rule, w_dtype=BF16, slot_dtype=BF16, layers=3)
  (new_w, new_slots, _), (ref_w, ref_slots, _) = _run_both(x, dy, w, slots, rule, layer=jnp.int32(1))
  _assert_close(new_w, ref_w, "w")
  for a, e in zip(new_slots, ref_slots):
    _assert_close(a, e, "slot")
  for other in (0, 2):  # untouched bit for bit
    np.testing.assert_array_equal(np.asarray(new_w[other], F32), np.asarray(w[other], F32))
    for a, s in zip(new_slots, slots):
      np.testing.assert_array_equal(np.asarray(a[other], F32), np.asarray(s[other], F32))


# ----------------------------------------------------------------------------
# Cross-lowering for cuda: the real (transposed-operand) kernel, every rule.
# ----------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "name, state_dtype, schedule",
    [(name, F32, "default") for name in sorted(_all_rules())]
    + [(name, BF16, "default") for name in ("adamw", "lion", "rmsprop_centered_momentum")]
    + [(name, dt, "cooperative") for name in ("adamw", "rmsprop_centered_momentum") for dt in (F32, BF16)]
    + [("adamw", dt, "across_tiles") for dt in (F32, BF16)]
    + [(name, dt, "pingpong_tuned") for name in ("adamw", "sgd") for dt in (F32, BF16)]
    + [("adamw", dt, "out_slots") for dt in (F32, BF16)]
    + [("adamw", dt, "shared_ring") for dt in (F32, BF16)]
    + [("adamw", dt, "stage_lookahead") for dt in (F32, BF16)]
    + [(name, F32, "approx") for name in ("adamw", "nadamw", "radam", "rmsprop_centered_momentum", "adagrad")],
)
def test_lowers_for_cuda(name, state_dtype, schedule):
  rule = _all_rules()[name].rule
  x = jax.ShapeDtypeStruct((512, 256), BF16)
  dy = jax.ShapeDtypeStruct((512, 512), BF16)
  w = jax.ShapeDtypeStruct((256, 512), state_dtype)
  slots = tuple(jax.ShapeDtypeStruct((256, 512), state_dtype) for _ in rule.slot_names)
  config = fm.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
  if schedule == "cooperative":
    config = fm.MosaicTileConfig(max_concurrent_steps=2, epi_n=16, num_sms=132)
  elif schedule == "across_tiles":  # a block's tiles as one pipeline of pipelines (4 tiles per block)
    config = fm.MosaicTileConfig(max_concurrent_steps=2, epi_n=16, num_sms=2,
                                 pipeline_across_tiles=True)
  elif schedule == "pingpong_tuned":  # the knobs the default leaves off
    config = fm.MosaicTileConfig(
        schedule="pingpong", max_concurrent_steps=4, epi_n=16, num_sms=132, mma_in_flight=True,
        epi_l2_lookahead=4,
    )
  elif schedule == "out_slots":  # separate epilogue store buffers
    config = fm.MosaicTileConfig(
        schedule="pingpong", max_concurrent_steps=3, epi_n=16, num_sms=132, mma_in_flight=True,
        epi_out_slots=2,
    )
  elif schedule == "shared_ring":  # one epilogue ring for both warpgroups, at the default tiling
    config = dataclasses.replace(config, epi_shared_ring=True)
  elif schedule == "approx":  # approximate math (a sweep knob)
    config = dataclasses.replace(config, approx_math=True)
  elif schedule == "stage_lookahead":  # the producer prefetches x/dy into L2, 4 steps ahead
    config = dataclasses.replace(config, stage_l2_lookahead=4)
  kernel = jax.jit(functools.partial(
      fm.fused_dw_update_mosaic, update_fn=rule.update, compute_grad_sq_norm=True, config=config,
  ))
  lower = lambda kernel: kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0))).lower(
      lowering_platforms=("cuda",)
  ).as_text()
  text = lower(kernel)
  assert "mosaic_gpu" in text
  if schedule in ("across_tiles", "shared_ring", "stage_lookahead"):  # the knob changes the kernel
    off = dataclasses.replace(config, pipeline_across_tiles=False, epi_shared_ring=False,
                              stage_l2_lookahead=0)
    assert text != lower(jax.jit(functools.partial(
        fm.fused_dw_update_mosaic, update_fn=rule.update, compute_grad_sq_norm=True, config=off)))


def test_default_configs_in_the_smem_margin_lower_for_cuda():
  """The budget admits configs up to 3 KiB under Mosaic GPU's 227 KiB limit by
  _smem_bytes' count; Mosaic's own accounting (checked while lowering, also
  cross-lowering) must agree for every default it picks near the budget."""
  margin_low = fm._MOSAIC_SMEM_LIMIT - 4 * 1024
  lowered = []
  for name, dt, t, norm in itertools.product(("adamw", "rmsprop_centered_momentum", "lion"), (F32, BF16),
                                             (1024, 4096), (False, True)):
    rule = _all_rules()[name].rule
    x = jax.ShapeDtypeStruct((t, 4096), BF16)
    dy = jax.ShapeDtypeStruct((t, 4096), BF16)
    w = jax.ShapeDtypeStruct((4096, 4096), dt)
    slots = tuple(jax.ShapeDtypeStruct((4096, 4096), dt) for _ in rule.slot_names)
    cfg = fm.default_config(x, dy, w, slots, compute_grad_sq_norm=norm, num_sms=132)
    smem = fm._smem_bytes(cfg, BF16, dt, [dt] * len(slots), norm)
    assert fm.supports(x, dy, w, slots, cfg, compute_grad_sq_norm=norm)[0]
    if smem <= margin_low:
      continue
    kernel = jax.jit(functools.partial(
        fm.fused_dw_update_mosaic, update_fn=rule.update, compute_grad_sq_norm=norm, config=cfg,
    ))
    text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0))).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    lowered.append((name, jnp.dtype(dt).name, t, norm, smem))
  # fp32 AdamW's default (4 stages, 64x32) and bf16's at short T (64x64) are in the
  # margin: the test is not vacuous.
  assert {(name, dt) for name, dt, *_ in lowered} >= {("adamw", "float32"), ("adamw", "bfloat16")}, lowered


@pytest.mark.parametrize("t, fp32_want, bf16_want", [(1024, (4, 32), (4, 64)), (4096, (4, 32), (5, 32))])
def test_default_tiling_follows_the_sweeps(t, fp32_want, bf16_want):
  """(stages, sub-tile width) of the defaults: the fp32 sweeps' best for float32 (and mixed)
  states, the bf16 sweep's best when the weight and every state take 2 bytes."""
  x, dy = _sds((t, 4096), BF16), _sds((t, 4096), BF16)
  picks = lambda w_dt, s_dt, n_slots: (
      lambda c: (c.max_concurrent_steps, c.epi_n))(fm.default_config(
          x, dy, _sds((4096, 4096), w_dt), [_sds((4096, 4096), s_dt)] * n_slots))
  assert picks(F32, F32, 2) == fp32_want
  assert picks(BF16, F32, 2) == fp32_want
  assert picks(F32, F32, 1) == fp32_want  # Lion fp32 would fit 5 stages: never timed, not taken
  assert picks(BF16, BF16, 2) == bf16_want
  assert picks(BF16, BF16, 1) == bf16_want


def test_wide_sub_tiles_match_reference_stacked_with_norm():
  """64x64 epilogue sub-tiles (the bf16 short-T default), stacked bf16 weights and states, and
  the grad norm, under the interpreter."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(11, 128, 128, 256, rule, w_dtype=BF16, slot_dtype=BF16, layers=3)
  cfg = dataclasses.replace(SMALL, tile_n=64, epi_n=64)
  (new_w, new_slots, g2), (ref_w, ref_slots, ref_g2) = _run_both(
      x, dy, w, slots, rule, layer=jnp.int32(1), norm=True, config=cfg)
  _assert_close(new_w, ref_w, "w")
  for a, e in zip(new_slots, ref_slots):
    _assert_close(a, e, "slot")
  np.testing.assert_allclose(float(g2), float(ref_g2), rtol=1e-4)
  np.testing.assert_array_equal(np.asarray(new_w[0]), np.asarray(w[0]))


def test_scalar_divisions_become_reciprocal_products_and_match_reference():
  """The kernel's rule: ``array / scalar`` becomes ``array * (1 / scalar)`` (Adam's bias
  corrections; on the GPU the same value as Mosaic GPU's div.full.f32, see _eval_for_mosaic),
  divisions by an array stay; results within the tolerances, at the default config (where it
  is always on) for AdamW and NAdamW."""
  rule = _rules()["adamw"]
  scalars = rule.scalars(jnp.int32(3))
  leaves = jax.tree.leaves(scalars)
  tile = jnp.ones((64, 16), F32)

  def divisions(reciprocal):
    traced = fm._trace_rule(rule.update, (64, 16), 2, scalars, scalar_reciprocal=reciprocal)
    jaxpr = jax.make_jaxpr(lambda *a: traced(a[0], a[1], a[2:4], a[4:]))(
        tile, tile, tile, tile, *leaves)
    return [tuple(v.aval.shape) for e in jaxpr.eqns if e.primitive is jax.lax.div_p for v in e.invars[1:]]

  plain, products = divisions(False), divisions(True)
  assert plain.count(()) == 2 and plain.count((64, 16)) == 1, plain  # mu / bc1, nu / bc2, mu_hat / denom
  assert products.count((64, 16)) == 1 and products.count(()) == 2, products  # now 1 / bc1, 1 / bc2 only
  assert fm._trace_rule(rule.update, (64, 16), 2, scalars).scalar_reciprocal  # the kernel's default
  for name in ("adamw", "nadamw"):  # nadamw: more scalar divisors (mu / bc1_next, g / bc1)
    rule = _rules()[name] if name in _rules() else _all_rules()[name].rule
    x, dy, w, slots = _inputs(7, 128, 128, 256, rule)
    (new_w, new_slots, _), (ref_w, ref_slots, _) = _run_both(x, dy, w, slots, rule, config=SMALL)
    _assert_close(new_w, ref_w, f"{name} w")
    for a, e in zip(new_slots, ref_slots):
      _assert_close(a, e, f"{name} slot")


@pytest.mark.parametrize("schedule", ["default", "cooperative"])
def test_stochastic_rounding_lowers_for_cuda(schedule):
  """The SR epilogue (uint32 hash on WGMMA-layout iotas) lowers for sm_90, stacked."""
  rule = _all_rules()["adamw"].rule
  x = jax.ShapeDtypeStruct((512, 256), BF16)
  dy = jax.ShapeDtypeStruct((512, 512), BF16)
  w = jax.ShapeDtypeStruct((3, 256, 512), BF16)
  slots = tuple(jax.ShapeDtypeStruct((3, 256, 512), BF16) for _ in rule.slot_names)
  config = fm.default_config(x, dy, w, slots, num_sms=132)
  if schedule == "cooperative":
    config = fm.MosaicTileConfig(max_concurrent_steps=2, epi_n=16, num_sms=132)
  kernel = jax.jit(functools.partial(
      fm.fused_dw_update_mosaic, update_fn=rule.update, config=config,
      weight_codec=nm.StochasticRound(),
  ))
  lowered = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)), layer=jnp.int32(1),
                         seed=jnp.uint32(5), step=jnp.int32(2)).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_sqrt_is_rewritten_for_mosaic(monkeypatch):
  """Mosaic GPU (jax 0.10.2, 0.11.1) lowers rsqrt, not sqrt: rewritten, the rule has no sqrt."""
  monkeypatch.setattr(fm, "_FORCE_REWRITES", True)
  rule = forge_jax.adamw(1e-3, weight_decay=0.1).rule
  tile = jax.ShapeDtypeStruct((64, 16), F32)
  traced = fm._trace_rule(rule.update, (64, 16), 2, rule.scalars(jnp.int32(0)))
  leaves = jax.tree.leaves(rule.scalars(jnp.int32(5)))
  rewritten = jax.make_jaxpr(
      lambda g, w, m, v, *s: traced(g, w, (m, v), s)
  )(tile, tile, tile, tile, *leaves)
  assert "sqrt" not in str(rewritten).replace("rsqrt", "")
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  g, w, m = (jax.random.normal(k, (64, 16)) for k in ks[:3])
  v = jnp.abs(jax.random.normal(ks[3], (64, 16))).at[0, 0].set(0.0)  # sqrt(0) must stay 0
  got = traced(g, w, (m, v), leaves)
  want = rule.update(g, w, (m, v), rule.scalars(jnp.int32(5)))
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)


def test_sqrt_rewrite_only_where_missing(monkeypatch):
  """The rewrite applies exactly when this jax's Mosaic GPU has no sqrt rule."""
  sqrt_p = jax.lax.sqrt_p
  assert (sqrt_p in fm._active_rewrites()) == (not fm._lowers_natively(sqrt_p))
  assert fm._lowers_natively(jax.lax.rsqrt_p)  # the probe sees the rule table
  monkeypatch.setattr(fm, "_lowers_natively", lambda prim, semantics="Warpgroup": True)
  assert fm._active_rewrites() == {}
  monkeypatch.setattr(fm, "_FORCE_REWRITES", True)
  assert sqrt_p in fm._active_rewrites()


def test_portable_sqrt_special_values():
  """Same as sqrt at +-0, inf, negatives (NaN) and NaN; a few ulp elsewhere."""
  x = jnp.array([0.0, -0.0, jnp.inf, -1.0, -jnp.inf, jnp.nan, 4.0, 2.0, 1e-30, 3e30], F32)
  got, want = np.asarray(fm._portable_sqrt(x)), np.asarray(jnp.sqrt(x))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_array_equal(np.signbit(got[:2]), [False, True])


def test_check_script_bf16_metric():
  """experiments/check_mosaic_gpu's 16-bit check: summation-order rounding passes
  (one-ulp flips, cancellation to ~0, NaN where both are NaN), a misplaced
  sub-tile does not (the H200 bf16 'failures' were the old metric's)."""
  from experiments import check_mosaic_gpu as check  # pylint: disable=g-import-not-at-top

  b32 = 0.02 * jax.random.normal(jax.random.PRNGKey(0), (256, 256), F32)
  b = b32.at[0, 0].set(0.0).at[1, 1].set(jnp.nan).astype(BF16)
  a = b.at[0, 0].set(7.7e-10)  # cancellation: reference exactly 0, kernel 7.7e-10
  bits = jax.lax.bitcast_convert_type(b[2:4, 2], jnp.uint16) + 1  # one ulp away
  a = a.at[2:4, 2].set(jax.lax.bitcast_convert_type(bits, BF16))  # rounding flips
  e = check._errors16(a, b)
  assert e["ok"] and e["nan_kernel"] == e["nan_ref"] == 1, e
  swapped = a.at[:64, :32].set(a[:64, :32].reshape(64, 16, 2)[:, :, ::-1].reshape(64, 32))
  assert not check._errors16(swapped, b)["ok"]
  assert not check._errors16(b.at[1, 1].set(0.5), b)["ok"]  # NaN on one side only
  assert not check._errors16(a.at[3, 3].set(a[3, 3] + 0.01), b)["ok"]  # one wrong element in 65536


# ----------------------------------------------------------------------------
# What the kernel accepts.
# ----------------------------------------------------------------------------


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "x, dy, w, n_slots, fragment",
    [
        ((4096, 4095), (4096, 4096), (4095, 4096), 2, "K=4095"),
        ((4096, 4096), (4096, 4100), (4096, 4100), 2, "N=4100"),
        ((4000, 4096), (4000, 4096), (4096, 4096), 2, "T=4000"),
        ((4096, 4096), (4096, 4096), (4096, 4096), 5, "at most 4"),
        ((4096, 4096), (4096, 4096), (4096, 2048), 2, "w must be"),
    ],
)
def test_supports_rejects_shapes(x, dy, w, n_slots, fragment):
  slots = [_sds(w, F32)] * n_slots
  ok, reason = fm.supports(_sds(x, BF16), _sds(dy, BF16), _sds(w, F32), slots, fm.default_config(
      _sds(x, BF16), _sds(dy, BF16), _sds(w, F32), slots))
  assert not ok and fragment in reason, reason


def test_supports_rejects_dtypes_and_oversized_configs():
  x, dy, w = _sds((1024, 1024), BF16), _sds((1024, 1024), BF16), _sds((1024, 1024), F32)
  ok, reason = fm.supports(_sds((1024, 1024), F32), _sds((1024, 1024), F32), w, [w])
  assert not ok and "bfloat16" in reason
  ok, reason = fm.supports(x, dy, _sds((1024, 1024), jnp.int8), [])
  assert not ok and "w dtype" in reason
  big = fm.MosaicTileConfig(tile_n=256, max_concurrent_steps=4, epi_n=64)
  ok, reason = fm.supports(x, dy, w, [w, w], big)
  assert not ok and "shared memory" in reason
  ok, reason = fm.supports(x, dy, w, [w], fm.MosaicTileConfig(tile_m=96))
  assert not ok and "tile_m" in reason
  with pytest.raises(ValueError, match="T=1000"):
    fm.fused_dw_update_mosaic(
        jnp.zeros((1000, 1024), BF16), jnp.zeros((1000, 1024), BF16), jnp.zeros((1024, 1024)),
        (), (), lambda g, w, s, sc: (g, ()),
    )


@pytest.mark.parametrize("k, n, small", [(1024, 1024, True), (1024, 3072, True), (3072, 1024, True),
                                         (2048, 2048, False), (2048, 6144, False), (4096, 4096, False)])
def test_default_tiling_takes_64_row_tiles_for_small_grids(k, n, small):
  """Weights of at most 1.5 128x128 tiles per SM (132 on an H200) take 64-row tiles (faster
  on the H200 for qwen3-0.6b's projections, slower from 256 tiles); every float-state default
  drops Pallas's automatic store barriers, int8 states keep them (they need them)."""
  x, dy = _sds((1024, k), BF16), _sds((1024, n), BF16)
  for dt in (F32, BF16):
    w = _sds((k, n), dt)
    cfg = fm.default_config(x, dy, w, [w, w], num_sms=132)
    assert (cfg.tile_m == 64) == small, (k, n, dt, cfg)
    assert cfg.no_auto_barriers and fm.supports(x, dy, w, [w, w], cfg) == (True, "")
  # The count is per SM: with 32 SMs none of these (64 tiles or more, > 1.5 x 32) is small.
  assert fm.default_config(x, dy, _sds((k, n), BF16), [_sds((k, n), BF16)], num_sms=32).tile_m == 128
  rule = _rules()["adamw"]
  qslots = _int8_slots(rule, rule.init_slots(jnp.zeros((128, 256), F32)))
  cfg = fm.default_config(_sds((128, 128), BF16), _sds((128, 256), BF16), _sds((128, 256), F32), qslots)
  assert not cfg.no_auto_barriers


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("n_slots", [0, 1, 2, 3])
def test_default_config_fits(state_dtype, n_slots):
  x, dy = _sds((4096, 4096), BF16), _sds((4096, 14336), BF16)
  w = _sds((4096, 14336), state_dtype)
  cfg = fm.default_config(x, dy, w, [w] * n_slots, compute_grad_sq_norm=True)
  assert fm.supports(x, dy, w, [w] * n_slots, cfg, compute_grad_sq_norm=True) == (True, "")


def test_planar_snake_visits_every_tile_once():
  for m, n, minor, width in [(5, 7, "n", 3), (4, 8, "n", 8), (6, 6, "m", 4), (3, 9, "m", 2)]:
    lin = jnp.arange(m * n, dtype=jnp.int32)
    mi, ni = (np.asarray(v) for v in fm._planar_snake(lin, m, n, minor, width))
    assert sorted(zip(mi.tolist(), ni.tolist())) == [(i, j) for i in range(m) for j in range(n)]
    minor_size = n if minor == "n" else m
    if minor_size % width:  # plgpu's helper divides by zero otherwise
      ref = plgpu.planar_snake(lin, (m, n), 1 if minor == "n" else 0, width)
      np.testing.assert_array_equal(mi, np.asarray(ref[0]))
      np.testing.assert_array_equal(ni, np.asarray(ref[1]))


def test_profiled_kernel_lowers_for_cuda(monkeypatch, tmp_path):
  """With the in-kernel profiler on (experiments.profile_mosaic), the named regions become
  timed ranges and the Mosaic GPU module (instrumentation included) is built for sm_90. Only
  the trace-dumping host callback, lowered after it, needs a CUDA backend, which this CPU
  lacks: that is the one error allowed."""
  from experiments import profile_mosaic  # pylint: disable=g-import-not-at-top

  space = profile_mosaic.PROFILE_SPACE
  monkeypatch.setattr(fm, "_PROFILE", (space, str(tmp_path)))
  rule = _all_rules()["adamw"].rule
  # The script's largest tiling (fp32 AdamW, T=64, room left for the profiler's ranges);
  # Mosaic GPU checks kernel + profiler shared memory against 227 KiB while lowering.
  x = jax.ShapeDtypeStruct((64, 4096), BF16)
  dy = jax.ShapeDtypeStruct((64, 4096), BF16)
  w = jax.ShapeDtypeStruct((4096, 4096), F32)
  slots = tuple(jax.ShapeDtypeStruct((4096, 4096), F32) for _ in rule.slot_names)
  config = dataclasses.replace(profile_mosaic.profiled_default_config(x, dy, w, slots), num_sms=132)
  kernel = jax.jit(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update, config=config))
  built = []
  real = fm.plgpu.CompilerParams
  monkeypatch.setattr(fm.plgpu, "CompilerParams", lambda **kw: built.append(kw) or real(**kw))
  traced = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)))
  try:
    traced.lower(lowering_platforms=("cuda",))
  except ValueError as e:  # the dump callback: see the docstring
    assert "platform for the specified backend" in str(e)
  assert built and built[0]["profile_space"] == space and built[0]["profile_dir"] == str(tmp_path)


def test_profile_trace_summary(tmp_path):
  from experiments import profile_mosaic  # pylint: disable=g-import-not-at-top

  ev = lambda name, ph, ts, tid: {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}
  trace = {"traceEvents": [
      ev("fdw_mainloop", "B", 0.0, 1), ev("fdw_mainloop", "E", 10.0, 1),
      ev("fdw_epilogue", "B", 10.0, 1), ev("fdw_epi_wait", "B", 10.0, 1), ev("fdw_epi_wait", "E", 13.0, 1),
      ev("fdw_epi_wait", "B", 14.0, 1), ev("fdw_epi_wait", "E", 15.0, 1), ev("fdw_epilogue", "E", 20.0, 1),
      ev("fdw_mainloop", "B", 5.0, 2), ev("fdw_mainloop", "E", 9.0, 2),
  ]}
  path = tmp_path / "1-trace.json"
  path.write_text(json.dumps(trace))
  packed = profile_mosaic.compress(path)
  assert not path.exists() and json.loads(gzip.decompress(packed.read_bytes())) == trace
  s = profile_mosaic.summarize_trace(trace)
  assert s["tracks"] == 2 and s["span_us"] == 20.0 and s["busy_us"] == 24.0
  assert s["regions"]["fdw_mainloop"] == {"count": 2, "total_us": 14.0, "mean_us": 7.0}
  assert s["regions"]["fdw_epi_wait"]["total_us"] == 4.0
  assert s["regions"]["fdw_epilogue"]["total_us"] == 10.0


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_check_script_sweep_configs_lower_for_cuda(state_dtype):
  """Every tiling experiments/check_mosaic_gpu's next sweep times builds for sm_90 at Mosaic
  GPU's own shared-memory limit (the sweep's), so H200 time is not spent on lowering errors."""
  from experiments import check_mosaic_gpu as check  # pylint: disable=g-import-not-at-top

  rule = _all_rules()["adamw"].rule
  dt = jnp.dtype(state_dtype)
  x = jax.ShapeDtypeStruct((1024, 4096), BF16)
  dy = jax.ShapeDtypeStruct((1024, 4096), BF16)
  w = jax.ShapeDtypeStruct((4096, 4096), dt)
  slots = (w, w)
  saved = fm._SMEM_BUDGET_BYTES
  fm._SMEM_BUDGET_BYTES = fm._MOSAIC_SMEM_LIMIT
  try:
    for cfg in check._sweep_configs(fm, state_dtype):
      cfg = dataclasses.replace(cfg, num_sms=132)
      assert fm.supports(x, dy, w, slots, cfg)[0], check.cfg_text(cfg)
      kernel = jax.jit(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update, config=cfg))
      text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0))).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text, check.cfg_text(cfg)
  finally:
    fm._SMEM_BUDGET_BYTES = saved


# ----------------------------------------------------------------------------
# int8 states in the kernel.
# ----------------------------------------------------------------------------


def _int8_precision(stochastic: bool):
  p = forge_jax.Precision(state_dtype="int8")
  if stochastic:
    return p
  nearest = lambda q: nm.QuantMap(q.kind, q.signed, q.mantissa_bits, "nearest")
  return forge_jax.Precision(state_dtype="int8", signed_map=nearest(p.signed_map),
                             unsigned_map=nearest(p.unsigned_map))


def _int8_slots(rule, slots, stochastic=False):
  precision = _int8_precision(stochastic)
  return tuple(precision.codec(name).quantize(s.astype(F32)) for name, s in zip(rule.slot_names, slots))


INT8 = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=128, max_concurrent_steps=2, epi_n=64,
                           num_sms=1)


def _assert_int8_close(got, want, what):
  diff = np.abs(np.asarray(got.codes, np.int32) - np.asarray(want.codes, np.int32))
  assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3, (what, diff.max(), np.mean(diff > 0))
  np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), rtol=1e-5, err_msg=what)
  assert got.codes.dtype == jnp.int8 and got.scale.shape == want.scale.shape


@pytest.mark.parametrize("name, w_dtype, layers", [("adamw", F32, None), ("lion", BF16, 3)])
def test_int8_slots_match_reference(name, w_dtype, layers):
  """Codes + per-row scales through the ring (2 slots, 2 sub-tiles per tile, 4 tiles on one
  block: the ring wraps within and across tiles), decoded, updated and re-encoded in the
  epilogue: the reference codec's codes (round-to-nearest maps; SR needs the GPU)."""
  rule = _rules()[name]
  x, dy, w, slots = _inputs(8, 128, 128, 256, rule, w_dtype=w_dtype, layers=layers)
  slots = _int8_slots(rule, slots)
  layer = None if layers is None else jnp.int32(1)
  (new_w, new_slots, _), (ref_w, ref_slots, _) = _run_both(x, dy, w, slots, rule, layer=layer, config=INT8)
  _assert_close(new_w, ref_w, "w")
  for i, (a, e) in enumerate(zip(new_slots, ref_slots)):
    assert isinstance(a, nm.QuantizedArray) and a.codec == slots[i].codec
    _assert_int8_close(a, e, rule.slot_names[i])
  if layers is not None:  # the other layers untouched, bit for bit
    for other in (0, 2):
      np.testing.assert_array_equal(np.asarray(new_w[other], F32), np.asarray(w[other], F32))
      for a, s in zip(new_slots, slots):
        np.testing.assert_array_equal(np.asarray(a.codes[other]), np.asarray(s.codes[other]))
        np.testing.assert_array_equal(np.asarray(a.scale[other]), np.asarray(s.scale[other]))


@pytest.mark.parametrize("w_dtype, stacked", [(F32, False), (BF16, True)])
def test_int8_slots_with_stochastic_rounding_lower_for_cuda(w_dtype, stacked):
  """forge_jax's default int8 maps (the second moment rounds stochastically), with a
  stochastically rounded bf16 weight, stacked, with the grad norm: the default config lowers
  for sm_90 (the interpreter cannot run stochastic rounding)."""
  rule = _all_rules()["adamw"].rule
  precision = forge_jax.Precision(state_dtype="int8")
  lead = (3,) if stacked else ()
  x = jax.ShapeDtypeStruct((1024, 4096), BF16)
  dy = jax.ShapeDtypeStruct((1024, 4096), BF16)
  w = jax.ShapeDtypeStruct(lead + (4096, 4096), w_dtype)
  slots = tuple(nm.QuantizedArray(jax.ShapeDtypeStruct(lead + (4096, 4096), jnp.int8),
                                  jax.ShapeDtypeStruct(lead + (4096, 64), F32), precision.codec(name))
                for name in rule.slot_names)
  cfg = fm.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
  assert (cfg.schedule, cfg.epi_n) == ("pingpong", 64)
  kw = dict(weight_codec=nm.StochasticRound()) if w_dtype == BF16 else {}
  kernel = jax.jit(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update, config=cfg,
                                     compute_grad_sq_norm=True, **kw))
  args = dict(seed=jnp.uint32(1), step=jnp.int32(2), layer=jnp.int32(1) if stacked else None)
  text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)), **args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_int8_slots_refusals():
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(9, 64, 64, 128, rule)
  q = _int8_slots(rule, slots)
  ok, why = fm.supports(x, dy, w, q, dataclasses.replace(INT8, epi_n=32))
  assert not ok and "epi_n=32 must equal the block" in why
  ok, why = fm.supports(x, dy, w, q, dataclasses.replace(INT8, schedule="cooperative"))
  assert not ok and "schedule='pingpong'" in why
  bad = (nm.QuantizedArray(q[0].codes, q[0].scale[:, :1], q[0].codec), q[1])
  ok, why = fm.supports(x, dy, w, bad, INT8)
  assert not ok and "scale has shape" in why
  with pytest.raises(NotImplementedError, match="interpreter"):  # SR maps need the GPU
    fm.fused_dw_update_mosaic(x, dy, w, _int8_slots(rule, slots, stochastic=True), rule.scalars(jnp.int32(1)),
                              rule.update, config=INT8, interpret=True, seed=jnp.uint32(0), step=jnp.int32(1))
  with pytest.raises(ValueError, match="seed="):  # SR maps need the seed and step
    fm.fused_dw_update_mosaic(x, dy, w, _int8_slots(rule, slots, stochastic=True), rule.scalars(jnp.int32(1)),
                              rule.update, config=INT8)


def test_calls_with_the_same_shapes_lower_once(monkeypatch):
  """An unrolled model calls the kernel once per layer: calls with the same shapes, rule and
  tiling share one trace, so a jit module holds one kernel per shape (lowering one takes about
  1.7 s on the host: experiments/results/cpu/unrolled_lowering/), called from each layer. A
  rule that cannot be hashed (an array hyperparameter) still works, lowered at every call."""
  import re
  from forge_jax import _fused
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  sds = jax.ShapeDtypeStruct

  def kernels(opt):
    def f(x, dy, ws, dy2, w2):
      outs = [forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="mosaic") for w in ws]
      outs.append(forge_jax.fused_linear_update(x, dy2, w2, opt.init(w2), opt, backend="mosaic"))
      return outs

    args = (sds((128, 128), BF16), sds((128, 256), BF16), [sds((128, 256), BF16)] * 3,
            sds((128, 128), BF16), sds((128, 128), BF16))
    return len(re.findall(r"custom_call @mosaic_gpu", lower_for_cuda(f, *args)))

  assert kernels(forge_jax.adamw(1e-3)) == 2  # 3 calls at one shape + 1 at another
  assert kernels(forge_jax.adamw(jnp.float32(1e-3))) == 4


@pytest.mark.parametrize("storage", ["bf16_sr_bf16", "fp32_int8"])
def test_profiled_low_precision_epilogues_lower_for_cuda(monkeypatch, tmp_path, storage):
  """experiments.profile_mosaic --storage: the optimizer's precision reaches the profiled
  kernel through fused_linear_update (SR weight write-back, int8 states), and the module
  builds for sm_90 with the profiler's ranges (only the trace dump needs a CUDA backend)."""
  from experiments import bench_lowp, profile_mosaic  # pylint: disable=g-import-not-at-top
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  x, dy, w, state, opt = profile_mosaic._problem("64x256x512", storage)
  slots = tuple(state[1:])
  assert any(isinstance(s, nm.QuantizedArray) for s in slots) == storage.endswith("int8")
  assert bench_lowp.mosaic_problem(x, dy, w, storage, interpret=False) is None
  cfg = dataclasses.replace(profile_mosaic.profiled_default_config(x, dy, w, slots), num_sms=132)
  monkeypatch.setattr(fm, "_PROFILE", (profile_mosaic.PROFILE_SPACE, str(tmp_path)))
  built = []
  real = fm.plgpu.CompilerParams
  monkeypatch.setattr(fm.plgpu, "CompilerParams", lambda **kw: built.append(kw) or real(**kw))
  step = jax.jit(lambda w, st: forge_jax.fused_linear_update(x, dy, w, st, opt, "mosaic", config=cfg))
  with warnings.catch_warnings():
    warnings.simplefilter("error", _fused.BackendFallbackWarning)  # the Mosaic kernel, no fallback
    traced = step.trace(w, state)
  try:
    traced.lower(lowering_platforms=("cuda",))
  except ValueError as e:  # the dump callback, as in test_profiled_kernel_lowers_for_cuda
    assert "platform for the specified backend" in str(e)
  assert built and built[0]["profile_space"] == profile_mosaic.PROFILE_SPACE


@pytest.mark.parametrize("case", ["fp32_coop", "fp32_pingpong", "bf16_stacked_norm", "int8"])
def test_epilogue_read_ahead_matches_reference(case):
  """epi_read_ahead (the next sub-tile's W/states read before this one's arithmetic): the
  same results, with the ring wrapping within and across tiles, under the interpreter."""
  rule = _rules()["adamw"]
  layer, norm, cfg = None, False, dataclasses.replace(SMALL, epi_read_ahead=True)
  if case == "fp32_pingpong":
    cfg = dataclasses.replace(cfg, schedule="pingpong", mma_in_flight=True)
  if case == "bf16_stacked_norm":
    x, dy, w, slots = _inputs(12, 128, 128, 256, rule, w_dtype=BF16, slot_dtype=BF16, layers=3)
    layer, norm = jnp.int32(2), True
  else:
    x, dy, w, slots = _inputs(12, 128, 128, 256, rule)
  if case == "int8":
    slots, cfg = _int8_slots(rule, slots), dataclasses.replace(INT8, epi_read_ahead=True)
  (new_w, new_slots, g2), (ref_w, ref_slots, ref_g2) = _run_both(
      x, dy, w, slots, rule, layer=layer, norm=norm, config=cfg)
  _assert_close(new_w, ref_w, "w")
  for i, (a, e) in enumerate(zip(new_slots, ref_slots)):
    if case == "int8":
      _assert_int8_close(a, e, rule.slot_names[i])
    else:
      _assert_close(a, e, rule.slot_names[i])
  if norm:
    np.testing.assert_allclose(float(g2), float(ref_g2), rtol=1e-4)


@pytest.fixture
def diagnose(monkeypatch):
  """Sets fused_dw_mosaic._DIAGNOSE for one test (restored after)."""
  return lambda *variants: monkeypatch.setattr(fm, "_DIAGNOSE", frozenset(variants))


@pytest.mark.parametrize("variant, direct", [(v, False) for v in fm.DIAGNOSE_VARIANTS]
                         + [("skip_reads", True), ("skip_mainloop+skip_compute", False)])
def test_diagnostic_variants_compute_what_they_say(variant, direct, diagnose):
  """The profiler's diagnostic epilogues (fused_dw_mosaic._DIAGNOSE) under the interpreter:
  "skip_reads" is the rule's step from w = 1 and states = 1 (with the ring, and with epi_direct's
  reads from device memory); "skip_rule" adds the gradient tile to w and writes the states back
  unchanged; "skip_compute" stores W and the states back as loaded, except that the first
  sub-tile of each row band of a warpgroup tile gets the gradient (x.T @ dy cast to W's dtype: the
  one use of the accumulator that keeps ptxas from dropping the MMAs); "skip_mainloop" (ping-pong)
  is the rule's step from a zero gradient, and with "skip_compute" (experiments.main_loop's
  ``mosaic_copy``: the ring's TMA round trip alone) leaves W and the states as they were. The real
  kernel's results differ from all of them."""
  rule = _rules()["adamw"]
  x, dy, w, slots = _inputs(14, 128, 128, 256, rule, w_dtype=BF16, slot_dtype=BF16)
  variants = variant.split("+")
  diagnose(*variants)
  scalars = rule.scalars(jnp.int32(3))
  update_fn = functools.partial(rule.update, decay=True)
  config = dataclasses.replace(SMALL, epi_direct=direct)
  if "skip_mainloop" in variants:
    config = dataclasses.replace(config, schedule="pingpong", mma_in_flight=True)
  kernel = jax.jit(functools.partial(fm.fused_dw_update_mosaic, update_fn=update_fn, config=config,
                                     interpret=True))
  new_w, new_slots, _ = kernel(x, dy, w, slots, scalars)
  if variant == "skip_mainloop":
    want_w, want_slots, _ = fused_dw_update_reference(x, jnp.zeros_like(dy), w, slots, scalars,
                                                      update_fn)
  elif variant == "skip_reads":
    ones = lambda a: jnp.ones(a.shape, a.dtype)
    want_w, want_slots, _ = fused_dw_update_reference(x, dy, ones(w), [ones(s) for s in slots],
                                                      scalars, update_fn)
  elif variant == "skip_rule":
    grad = jnp.dot(x.T, dy, preferred_element_type=F32)
    want_w, want_slots = (w.astype(F32) + grad).astype(w.dtype), slots
  elif variant == "skip_compute":
    grad = jnp.dot(x.T, dy, preferred_element_type=F32).astype(w.dtype)
    first = (jnp.arange(w.shape[-1]) % config.tile_n) < config.epi_n  # c == 0 sub-tiles
    assert 0 < int(first.sum()) < w.shape[-1]
    want_w, want_slots = jnp.where(first[None, :], grad, w), slots
  else:
    want_w, want_slots = w, slots
  _assert_close(new_w, want_w, "w")
  for a, e, name in zip(new_slots, want_slots, rule.slot_names):
    _assert_close(a, e, name)
  real_w, _, _ = fused_dw_update_reference(x, dy, w, slots, scalars, update_fn)
  assert not np.allclose(np.asarray(new_w, F32), np.asarray(real_w, F32), rtol=1e-2)


def test_diagnostic_variants_lower_for_cuda_and_reject_misuse(diagnose):
  """Both variants build for sm_90 at the default tiling (what profile_mosaic runs on the GPU);
  an unknown variant or int8 states are errors naming the problem."""
  rule = _rules()["adamw"]
  x, dy = _sds((1024, 4096), BF16), _sds((1024, 4096), BF16)
  w = _sds((4096, 4096), BF16)
  # A new function per lowering: jit's cache does not see module state (nor does a user's
  # jitted step: profile_mosaic builds a new one per variant).
  kernel = lambda: functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update)
  scalars = rule.scalars(jnp.int32(0))
  for variant in fm.DIAGNOSE_VARIANTS:
    diagnose(variant)
    assert "mosaic_gpu" in lower_for_cuda(kernel(), x, dy, w, (w, w), scalars), variant
  diagnose("skip_everything")
  with pytest.raises(ValueError, match=r"_DIAGNOSE has \['skip_everything'\]"):
    lower_for_cuda(kernel(), x, dy, w, (w, w), scalars)
  with pytest.raises(ValueError, match=r"unknown diagnostic variants \['skip_everything'\]"):
    with fm.diagnosing("skip_everything"):
      pass
  diagnose("skip_mainloop")
  with pytest.raises(ValueError, match=r"skip_mainloop'\] needs schedule='pingpong' \(got 'cooperative'\)"):
    lower_for_cuda(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update,
                                     config=fm.MosaicTileConfig()), x, dy, w, (w, w), scalars)
  diagnose("skip_rule")
  qslots = _int8_slots(rule, rule.init_slots(jnp.zeros((128, 256), F32)))
  with pytest.raises(ValueError, match="float states only"):
    fm.fused_dw_update_mosaic(jnp.zeros((128, 128), BF16), jnp.zeros((128, 256), BF16),
                              jnp.zeros((128, 256), F32), qslots, scalars, rule.update,
                              config=INT8, interpret=True)


def test_profile_script_runs_diagnostic_variants_and_restores_the_kernel(monkeypatch, tmp_path):
  """experiments.profile_mosaic --diagnose: each variant is profiled with _DIAGNOSE set to it
  alone, recorded in its row and table, and the real kernel is restored afterwards."""
  from experiments import profile_mosaic  # pylint: disable=g-import-not-at-top

  seen = []
  monkeypatch.setattr(profile_mosaic, "_profile_problem",
                      lambda *a: seen.append(fm._DIAGNOSE) or {"problem": a[0], "dtypes": a[3],
                                                                "status": "unsupported", "error": "-"})
  rows = [profile_mosaic.profile_problem("64x256x512", None, tmp_path, "fp32", v)
          for v in ("", *fm.DIAGNOSE_VARIANTS)]
  assert seen == [frozenset(), *(frozenset([v]) for v in fm.DIAGNOSE_VARIANTS)]
  assert fm._DIAGNOSE == frozenset()
  assert [r["variant"] for r in rows] == ["kernel", *fm.DIAGNOSE_VARIANTS]
  table = profile_mosaic.markdown({"command": "c", "date": "d", "device": "e", "jax": "f"}, rows)
  assert "diagnostic variant `skip_reads`" in table and "diagnostic variant `skip_rule`" in table


@pytest.mark.parametrize("case", ["fp32", "bf16_stacked_norm"])
def test_no_auto_barriers_matches_reference(case):
  """no_auto_barriers (Pallas's automatic warpgroup barriers around shared-memory stores left
  out) computes the same under the interpreter; whether the GPU agrees is check_mosaic_gpu's
  --quick (a race would show as wrong values there, not here)."""
  rule = _rules()["adamw"]
  cfg, layer, norm = dataclasses.replace(SMALL, no_auto_barriers=True), None, False
  if case == "bf16_stacked_norm":
    x, dy, w, slots = _inputs(15, 128, 128, 256, rule, w_dtype=BF16, slot_dtype=BF16, layers=3)
    layer, norm = jnp.int32(1), True
  else:
    x, dy, w, slots = _inputs(15, 128, 128, 256, rule)
  (new_w, new_slots, g2), (ref_w, ref_slots, ref_g2) = _run_both(
      x, dy, w, slots, rule, layer=layer, norm=norm, config=cfg)
  _assert_close(new_w, ref_w, "w")
  for a, e, name in zip(new_slots, ref_slots, rule.slot_names):
    _assert_close(a, e, name)
  if norm:
    np.testing.assert_allclose(float(g2), float(ref_g2), rtol=1e-4)


def test_no_auto_barriers_drops_the_store_barriers_and_refuses_int8(monkeypatch):
  """The knob reaches plgpu.CompilerParams, and the kernel lowered for sm_90 then has fewer
  warpgroup barriers (bar.sync; experiments.barrier_count) than with Pallas's automatic ones;
  int8 states and store buffers are refused, naming why."""
  from experiments import barrier_count  # pylint: disable=g-import-not-at-top

  rule = _rules()["adamw"]
  x, dy = _sds((1024, 4096), BF16), _sds((1024, 4096), BF16)
  w = _sds((4096, 4096), F32)
  base = dataclasses.replace(fm.default_config(x, dy, w, (w, w)), num_sms=132)
  built = []
  real_params = fm.plgpu.CompilerParams
  monkeypatch.setattr(fm.plgpu, "CompilerParams", lambda **kw: built.append(kw) or real_params(**kw))
  with skip_if_cuda_lowering_needs_a_gpu():
    rows = [barrier_count.count("bfloat16", 1024, flag) for flag in (False, True)]
  assert [kw.get("unsafe_no_auto_barriers", False) for kw in built] == [False, True]
  assert 0 < rows[1]["bar_sync"] < rows[0]["bar_sync"], rows
  qslots = _int8_slots(rule, rule.init_slots(jnp.zeros((128, 256), F32)))
  ok, why = fm.supports(_sds((128, 128), BF16), _sds((128, 256), BF16), _sds((128, 256), F32), qslots,
                        dataclasses.replace(INT8, no_auto_barriers=True))
  assert not ok and "no_auto_barriers=True needs float states" in why
  ok, why = fm.supports(x, dy, w, (w, w), dataclasses.replace(base, no_auto_barriers=True, epi_out_slots=2))
  assert not ok and "needs epi_out_slots=0" in why


def test_epilogue_read_ahead_needs_two_ring_slots():
  x, dy, w = _sds((128, 128), BF16), _sds((128, 256), BF16), _sds((128, 256), F32)
  ok, reason = fm.supports(x, dy, w, [w, w], dataclasses.replace(SMALL, epi_slots=1, epi_read_ahead=True))
  assert not ok and "epi_read_ahead" in reason and "epi_slots" in reason
  assert fm.supports(x, dy, w, [w, w], dataclasses.replace(SMALL, epi_read_ahead=True))[0]


def test_ptxas_report_parses_ptxas_and_lists_its_cases(monkeypatch):
  """experiments.ptxas_report (GPU): its parser on ptxas -v output, and its cases on CPU (the
  default tiling per storage, and the same with epi_read_ahead)."""
  from experiments import ptxas_report  # pylint: disable=g-import-not-at-top

  text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_gpu_kernel
    16 bytes stack frame, 24 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 400 bytes cmem[0]
"""
  got = ptxas_report.parse_ptxas("unrelated line\n" + text)
  assert (got["registers"], got["stack_frame_bytes"], got["spill_store_bytes"], got["spill_load_bytes"],
          got["functions"]) == (168, 16, 24, 40, 1)
  assert all("ptxas" in ln or "stack frame" in ln for ln in got["lines"])
  assert ptxas_report.parse_ptxas("no report")["registers"] is None
  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  rows = ptxas_report.cases(["fp32", "bf16_rtn_bf16", "fp32_int8"], 1024, read_ahead=True)
  assert [(r["storage"], r["config"]["epi_n"], r["config"]["epi_read_ahead"]) for r in rows] == [
      ("fp32", 32, False), ("fp32", 32, True), ("bf16_rtn_bf16", 64, False), ("bf16_rtn_bf16", 64, True),
      ("fp32_int8", 64, False), ("fp32_int8", 64, True)]
  info = {"command": "c", "date": "d", "device": "cpu", "jax": jax.__version__}
  md = ptxas_report.markdown(info, [dict(rows[0], status="ok", **got), dict(rows[1], status="timeout",
                                                                             error="no result")])
  assert "| fp32 | 1024 | ping 128x128x64 st4 epi64x32/2 n8 l2pf0 mma1 nb | ok | 168 | 16 | 24 | 40 |" in md
  assert "ra nb | timeout: no result | - | - | - | - |" in md


def test_ptxas_report_counts_sass_and_compiles_diagnostic_variants(monkeypatch):
  """experiments.ptxas_report --sass --diagnose: SASS (nvdisasm's lines, predicated or not)
  counted by opcode and class; one extra case per variant with the default tiling, and its
  worker sets _DIAGNOSE to that variant."""
  from experiments import ptxas_report  # pylint: disable=g-import-not-at-top

  sass = """        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/               @P0 LDS.64 R4, [R2+0x10] ;
        /*0030*/                   FFMA R3, R4, R5, R6 ;
        /*0040*/              @!P1 IMAD.SHL.U32 R7, R0, 0x4, RZ ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/                   MUFU.RSQ R9, R8 ;
        /*0070*/                   STS.64 [R2], R4 ;
        /*0080*/                   FFMA R3, R4, R5, R3 ;
"""
  got = ptxas_report.parse_sass("ptxas info : Used 168 registers\n" + sass)
  assert got["sass_instructions"] == 9 and got["sass_top"][0] == ["FFMA", 2]
  assert got["sass_classes"] == {"other": 1, "integer": 2, "shared_load": 1, "float": 3, "mma": 1,
                                 "shared_store": 1}
  assert ptxas_report.parse_sass("no sass")["sass_instructions"] == 0
  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  rows = ptxas_report.cases(["fp32"], 1024, read_ahead=False, diagnose=["skip_reads", "skip_compute"])
  assert [r["variant"] for r in rows] == ["", "skip_reads", "skip_compute"]
  assert rows[1]["config"] == rows[0]["config"]
  traced_as = []  # _DIAGNOSE when the worker's step is built (no compile on CPU)
  monkeypatch.setattr(jax, "jit", lambda f: traced_as.append(fm._DIAGNOSE) or (lambda *a: None))
  monkeypatch.setattr(jax, "block_until_ready", lambda x: x)
  assert ptxas_report.worker(rows[2]) == 0 and traced_as == [frozenset(["skip_compute"])]
  assert fm._DIAGNOSE == frozenset()  # restored
  info = {"command": "c", "date": "d", "device": "cpu", "jax": jax.__version__}
  md = ptxas_report.markdown(info, [dict(rows[0], status="ok", registers=168, **got),
                                    dict(rows[1], status="ok", sass_instructions=0,
                                         sass_error="nvdisasm invocation failed")])
  assert "| fp32 | 1024 | kernel | 9 | 1 | 1 | 0 | 3 | 2 | 1 | 0 | 1 |" in md
  assert "| fp32 | 1024 | skip_reads | nvdisasm invocation failed |" in md


def test_ptxas_report_counts_the_ptx_division_and_sqrt(monkeypatch, tmp_path):
  """experiments.ptxas_report --ptx: the float32 division / special-function instructions of a
  PTX dump are counted by opcode (the kernel's epilogue: div.full and sqrt.approx, session 17),
  other f32 arithmetic is not, and the dump is saved gzipped beside the report."""
  from experiments import ptxas_report  # pylint: disable=g-import-not-at-top

  ptx = """\tadd.f32 \t%r620, %r184, %r589;
\tdiv.full.f32 \t%r622, %r494, %r591;
\tdiv.full.f32 \t%r623, %r493, %r590;
\tsqrt.approx.f32 \t%r7, %r6;
\trcp.approx.ftz.f32 \t%r9, %r8;
\tdiv.rn.f32 \t%r10, %r1, %r2;
\tmul.f32 \t%r11, %r1, %r2;
"""
  assert ptxas_report.parse_ptx_math(ptx) == {"div.full.f32": 2, "div.rn.f32": 1,
                                              "rcp.approx.ftz.f32": 1, "sqrt.approx.f32": 1}
  assert ptxas_report.parse_ptx_math("no ptx") == {}
  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  case = ptxas_report.cases(["bf16_rtn_bf16"], 1024, read_ahead=False)[0]
  envs = []

  def fake_run(cmd, env, **kwargs):
    envs.append(env)
    return subprocess.CompletedProcess(cmd, 0, ptx + "ptxas info : Used 168 registers\n", "")

  monkeypatch.setattr(ptxas_report.subprocess, "run", fake_run)
  row = ptxas_report.run_case(case, 10.0, ptx_path=tmp_path / "ptx_0.txt.gz")
  assert envs[0]["MOSAIC_GPU_DUMP_PTX"] == "1" and row["status"] == "ok"
  assert row["ptx_math"]["div.full.f32"] == 2 and row["ptx_file"] == "ptx_0.txt.gz"
  assert "sqrt.approx.f32" in gzip.open(tmp_path / "ptx_0.txt.gz", "rt").read()
  plain = ptxas_report.run_case(case, 10.0)  # without --ptx: no dump asked for, none counted
  assert "ptx_math" not in plain and "MOSAIC_GPU_DUMP_PTX" not in envs[1]
  info = {"command": "c", "date": "d", "device": "cpu", "jax": jax.__version__}
  md = ptxas_report.markdown(info, [row])
  assert "- bf16_rtn_bf16 T=1024 kernel: `div.full.f32` 2, `div.rn.f32` 1" in md


def test_check_script_times_the_shapes_it_is_given(tmp_path):
  """experiments.check_mosaic_gpu --shapes (e.g. a small model's projections) and --calls
  (several calls per dispatch) reach the timing section, which runs in its own process:
  smoke run under the interpreter."""
  root = pathlib.Path(__file__).resolve().parents[1]
  cmd = [sys.executable, "-m", "experiments.check_mosaic_gpu", "--smoke", "--sections", "timing",
         "--calls", "2", "--shapes", "64x128", "128x128", "--out", str(tmp_path)]
  env = dict(os.environ, PYTHONPATH=str(root))
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "check_mosaic_gpu.json").read_text())["sections"]["timing"]["rows"]
  assert {r["shape"] for r in rows} == {"64x64x128", "64x128x128"}
  assert all(r["status"] == "ok" and r["calls_per_dispatch"] == 2 for r in rows), rows
  assert "dispatches of 2 calls each" in (tmp_path / "check_mosaic_gpu.md").read_text()
  bad = subprocess.run(cmd[:-4] + ["--shapes", "64x", "--out", str(tmp_path)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
  assert bad.returncode == 2 and "KxN" in bad.stderr
  # A --config-json that does not fit a shape is an error row naming why, not a
  # silent timing of the default tiling.
  cmd = [*cmd[:-5], "--shapes", "64x128", "--config-json", '{"max_concurrent_steps": 64}',
         "--out", str(tmp_path / "unfit")]
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "unfit" / "check_mosaic_gpu.json").read_text())["sections"]["timing"]["rows"]
  mosaic = [r for r in rows if r["impl"] == "mosaic"]
  assert mosaic and all(r["status"] == "error" and "does not fit 64x64x128" in r["error"]
                        and "must be a multiple of tile_m=128" in r["error"] for r in mosaic), mosaic


def test_unrolled_model_step_lowers_one_kernel_per_shape(monkeypatch):
  """experiments.lowering_time's worker: an unrolled 2-layer qwen3-0.6b FORGE step, lowered for
  cuda with the Mosaic kernel ("auto" on a faked Hopper GPU), holds one kernel per distinct
  projection shape (q, k/v, o, gate/up, down: 5), not one per call (14)."""
  from experiments import lowering_time  # pylint: disable=g-import-not-at-top
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top

  # Set here first, so that monkeypatch restores them after the worker's own assignments.
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  with skip_if_cuda_lowering_needs_a_gpu():
    row = lowering_time.worker(2, "cached", "qwen3-0.6b")
  assert row["mosaic_custom_calls"] == 5, row


def test_check_script_quick_configs_fit_their_cases(monkeypatch):
  """Every tiling experiments/check_mosaic_gpu --quick sets explicitly takes its case's operands
  at the real (H200) shapes: shared memory, divisibility, int8 block = epi_n. A config that does
  not would cost GPU time as an error row."""
  from experiments import check_mosaic_gpu as check  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(fm, "_device_problem", lambda: None)
  rules = check._rules()
  checked = 0
  for label, name, w_dt, s_dt, layers, fields, *shape in check.QUICK_CASES:
    if fields is None:
      continue
    t, k, n = shape[0] if shape else check.STACKED_SHAPE if layers else check.RULE_SHAPE
    x, dy, w, slots = jax.eval_shape(lambda: check._inputs(  # pylint: disable=cell-var-from-loop
        t, k, n, rules[name].rule, jnp.dtype(w_dt), check._slot_dtype(s_dt), layers=3 if layers else None))
    cfg = fm.MosaicTileConfig(**fields)
    ok, why = fm.supports(x, dy, w, slots, cfg, compute_grad_sq_norm=bool(layers))
    assert ok, (label, name, w_dt, s_dt, why)
    if cfg.pipeline_across_tiles:  # the case checks the knob only where it applies (132 blocks)
      assert fm._across_tiles(cfg, t, k, n, 132), (label, shape)
    checked += 1
  assert checked >= 10, checked


def test_cluster_n_multicasts_x_and_says_what_it_needs():
  """cluster_n=2 (pairs of blocks sharing each x block): the Mosaic GPU module lowered for sm_90
  has a multicast TMA load and remote (mapa) barrier arrivals, and the kernel without it has
  neither; what it cannot take is refused, naming the value (the interpreter cannot run it, so
  its correctness is the GPU's --quick)."""
  from experiments import barrier_count  # pylint: disable=g-import-not-at-top

  rule = _rules()["adamw"]
  x, dy, w = _sds((1024, 4096), BF16), _sds((1024, 4096), BF16), _sds((4096, 4096), BF16)
  base = dataclasses.replace(fm.default_config(x, dy, w, (w, w)), num_sms=132)
  assert fm.supports(x, dy, w, (w, w), dataclasses.replace(base, cluster_n=2)) == (True, "")
  with skip_if_cuda_lowering_needs_a_gpu():
    plain, clustered = (barrier_count.lowered_module("bfloat16", 1024, cluster_n=c)[0] for c in (1, 2))
  assert "multicast_mask" not in plain and "mapa" not in plain
  assert clustered.count("multicast_mask") >= 1 and "mapa" in clustered
  # What it cannot take.
  ok, why = fm.supports(x, dy, w, (w, w), dataclasses.replace(base, schedule="cooperative", mma_in_flight=False,
                                                                cluster_n=2))
  assert not ok and "cluster_n=2 needs schedule='pingpong'" in why
  ok, why = fm.supports(x, dy, w, (w, w), dataclasses.replace(base, cluster_n=4))
  assert not ok and "cluster_n=4 must be 1 or 2" in why
  ok, why = fm.supports(x, dy, w, (w, w), dataclasses.replace(base, cluster_n=2, num_sms=131))
  assert not ok and "num_sms=131 to be a multiple" in why
  dy_odd, w_odd = _sds((1024, 4224), BF16), _sds((4096, 4224), BF16)  # 33 tiles of 128 columns
  ok, why = fm.supports(x, dy_odd, w_odd, (w_odd, w_odd), dataclasses.replace(base, cluster_n=2))
  assert not ok and "N=4224 must be a multiple of cluster_n * tile_n = 256" in why
  small = dataclasses.replace(SMALL, schedule="pingpong", cluster_n=2, num_sms=2)
  xs, dys, ws = jnp.ones((128, 128), BF16), jnp.ones((128, 256), BF16), jnp.zeros((128, 256), F32)
  with pytest.raises(ValueError, match="cluster_n=2 cannot run under the Mosaic GPU interpreter"):
    fm.fused_dw_update_mosaic(xs, dys, ws, (ws, ws), rule.scalars(jnp.int32(0)), rule.update,
                              config=small, interpret=True)


@pytest.mark.parametrize("cluster", [1, 2])
def test_pingpong_tiles_cover_the_grid_once_and_clusters_share_x(cluster):
  """Every (m, n) tile goes to exactly one block; with clusters, the two blocks of a cluster
  take the same m (the multicast x block) and adjacent n, at every local step i."""
  m_iters, n_iters, num_sms = 6, 8, 10
  num_units = num_sms // cluster
  num_tiles = m_iters * n_iters // cluster
  seen = []
  for unit in range(num_units):
    num_local = -(-(num_tiles - unit) // num_units)
    for i in range(num_local):
      pair = [tuple(int(v) for v in fm._pingpong_tile(
          jnp.int32(unit), jnp.int32(block), jnp.int32(i), m_iters=m_iters, n_iters=n_iters,
          num_units=num_units, cluster=cluster, minor_dim="n", width=3)) for block in range(cluster)]
      assert len({m for m, _ in pair}) == 1 and [n for _, n in pair] == list(range(pair[0][1], pair[0][1] + cluster))
      seen += pair
  assert sorted(seen) == [(m, n) for m in range(m_iters) for n in range(n_iters)]


# ----------------------------------------------------------------------------
# epi_direct: the epilogue reads and writes device memory from registers.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["fp32_pingpong_read_ahead", "bf16_coop_stacked_norm"])
def test_direct_epilogue_matches_reference(case):
  """epi_direct (W/states read from device memory into registers and written back, no ring):
  the same results under the interpreter, ping-pong with the next sub-tile read ahead, and
  cooperative on a stacked layer with the grad norm (which still leaves through shared memory)."""
  rule = _rules()["adamw"]
  cfg = dataclasses.replace(SMALL, epi_direct=True)
  layer, norm = None, False
  if case == "fp32_pingpong_read_ahead":
    cfg = dataclasses.replace(cfg, schedule="pingpong", mma_in_flight=True, epi_read_ahead=True)
    x, dy, w, slots = _inputs(15, 128, 128, 256, rule)
  else:
    x, dy, w, slots = _inputs(15, 128, 128, 256, rule, w_dtype=BF16, slot_dtype=BF16, layers=3)
    layer, norm = jnp.int32(2), True
  (new_w, new_slots, g2), (ref_w, ref_slots, ref_g2) = _run_both(
      x, dy, w, slots, rule, layer=layer, norm=norm, config=cfg)
  _assert_close(new_w, ref_w, "w")
  for i, (a, e) in enumerate(zip(new_slots, ref_slots)):
    _assert_close(a, e, rule.slot_names[i])
  if norm:
    np.testing.assert_allclose(float(g2), float(ref_g2), rtol=1e-4)
  else:
    assert g2 is None


def test_direct_epilogue_frees_the_ring_lowers_and_refuses_what_it_cannot_take(diagnose):
  """Without the ring its shared memory goes to stages (fp32 AdamW: 7 stages fill the 224 KiB
  budget that 4 stages and the ring fill); the kernel lowers for sm_90 with device-memory
  reads (Mosaic GPU's unoptimized transfer plan); int8 states, store buffers and the
  skip_compute diagnostic are refused, naming the fix."""
  cfg = fm.MosaicTileConfig(schedule="pingpong", mma_in_flight=True, max_concurrent_steps=7,
                            epi_n=32, epi_direct=True, no_auto_barriers=True, l2_prefetch_steps=0)
  assert fm._ring_depth(cfg) == 0
  assert fm._smem_bytes(cfg, BF16, F32, [F32, F32], False) == fm._SMEM_BUDGET_BYTES
  assert fm._smem_bytes(dataclasses.replace(cfg, max_concurrent_steps=4, epi_direct=False),
                        BF16, F32, [F32, F32], False) == fm._SMEM_BUDGET_BYTES
  rule = _rules()["adamw"]
  x, dy = _sds((1024, 4096), BF16), _sds((1024, 4096), BF16)
  w = _sds((4096, 4096), F32)
  assert fm.supports(x, dy, w, (w, w), cfg) == (True, "")
  text = lower_for_cuda(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update, config=cfg),
                        x, dy, w, (w, w), rule.scalars(jnp.int32(0)))
  assert "mosaic_gpu" in text
  ok, why = fm.supports(x, dy, w, (w, w), dataclasses.replace(cfg, epi_out_slots=2, no_auto_barriers=False))
  assert not ok and "epi_direct=True needs epi_out_slots=0 (got 2)" in why
  qslots = _int8_slots(rule, rule.init_slots(jnp.zeros((128, 256), F32)))
  ok, why = fm.supports(jnp.zeros((128, 128), BF16), jnp.zeros((128, 256), BF16), jnp.zeros((128, 256), F32),
                        qslots, dataclasses.replace(INT8, epi_direct=True))
  assert not ok and "epi_direct=True needs float states" in why
  diagnose("skip_compute")
  small = jnp.zeros((128, 128), BF16), jnp.zeros((128, 256), BF16), jnp.zeros((128, 256), F32)
  with pytest.raises(ValueError, match="skip_compute'] with epi_direct=True times no main loop"):
    fm.fused_dw_update_mosaic(*small, (small[2], small[2]), rule.scalars(jnp.int32(0)), rule.update,
                              config=dataclasses.replace(SMALL, epi_direct=True), interpret=True)


def test_l2_hints_add_cache_policies_to_the_kernels_tma_copies():
  """experiments.l2_hints (results/h200/l2_hints/): inside hints(), every TMA store and load the
  kernel lowers is written with an L2 cache policy (inline PTX), so the lowered module differs;
  outside, launch_context's own nvvm is back. A name that is no L2 policy is refused."""
  from experiments import l2_hints  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic.gpu import launch_context  # pylint: disable=g-import-not-at-top

  rule = _rules()["adamw"]
  x = jax.ShapeDtypeStruct((1024, 256), BF16)
  w = jax.ShapeDtypeStruct((256, 512), BF16)
  cfg = fm.default_config(x, x, w, (w, w), num_sms=132)
  lower = lambda: lower_for_cuda(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update,
                                                   config=cfg), x, jax.ShapeDtypeStruct((1024, 512), BF16),
                                 w, (w, w), rule.scalars(jnp.int32(0)))
  plain = lower()
  base = launch_context.nvvm
  with l2_hints.hints(store="evict_first", load="evict_last") as used:
    hinted = lower()
  assert launch_context.nvvm is base
  assert used.hinted["store"] > 0 and used.hinted["load"] > 0, used.hinted
  assert hinted != plain and lower() == plain
  with pytest.raises(ValueError, match="store='evict_sometimes' is not an L2 policy"):
    with l2_hints.hints(store="evict_sometimes"):
      pass
