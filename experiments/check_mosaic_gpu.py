"""First GPU contact for the Mosaic GPU fused dW + optimizer kernel (pallas_kernels/fused_dw_mosaic.py).

On one H200, from the repository root (about 7 minutes):

    PYTHONPATH=$PWD python -m experiments.check_mosaic_gpu --out $OUT

Correctness only, a short list (every rule with bf16 w/slots, radam, the
sqrt rules in fp32, mixed and stacked; about a minute on an H200):

    PYTHONPATH=$PWD python -m experiments.check_mosaic_gpu --out $OUT --quick

On a CPU (Mosaic GPU interpreter, tiny shapes, about a minute; with
``--quick``, the quick list at tiny shapes, a few minutes):

    PYTHONPATH=$PWD python -m experiments.check_mosaic_gpu --smoke --out /tmp/check_mosaic

Four sections, each in its own subprocess with a time limit, so that a
compile error is recorded and a hang or a CUDA fault in one section (the
kernel has never run on a GPU before this script) cannot take the others
down; every section writes its JSON as it goes:

1. ``audit``: for every forge_jax rule, does the kernel lower on this jax
   with the rule as written (``sqrt`` included) and with the kernel's
   ``sqrt`` spelled from ``rsqrt`` (forced)? (lowering only, no compile).
2. ``correctness``: a tiny first run; every rule (adam, adamw, nadamw, radam,
   lion, rmsprop centered+momentum, adagrad, sgd, sgd+momentum) with fp32 and
   bf16 w/slots at 4096^3; AdamW with fp32, bf16 and fp32-w/bf16-slots on
   the four (K, N) shapes at T=4096; a stacked [L, K, N] layer with the grad
   norm; odd shapes, which must get a clean ``supports() == False``. Random
   w and slots (never zeros), step count 10, against
   ``fused_dw_update_reference``: fp32 results by relative Frobenius error,
   16-bit ones elementwise with an absolute floor (see ``BF16_TOL``).
3. ``sweep``: configs (cooperative vs ping-pong schedule, block tile,
   stages, epilogue sub-tile and ring, L2 prefetch, grid band) timed on
   AdamW fp32 at 4096x4096x4096 and
   1024x4096x4096; the fastest config that passed the check on both is
   reported as ``best`` (the timing section uses the kernel's per-operand
   ``default_config``, what users get, unless ``--config-json`` names one).
4. ``timing``: for T in {4096, 1024, 16384} (in that order) and (K, N) in
   {(4096, 4096), (4096, 14336), (14336, 4096), (5120, 17408)}, AdamW, Lion
   and SGD-momentum: the kernel vs XLA's GEMM alone vs XLA GEMM + optax in one
   donated jit, measured by ``experiments.bench_fused_dw`` (device-side:
   warm-up, 30 back-to-back calls blocked once, median of 3).

Each section keeps to a time budget (what is left is recorded as skipped), so
the whole run stays under about 8 minutes. Writes ``<section>.json`` for each
section plus ``check_mosaic_gpu.json`` (all merged, with run info) and
``check_mosaic_gpu.md`` (tables) to ``--out`` (default ``$OUT`` or ``./runs``);
6 files.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

SECTIONS = ("audit", "correctness", "sweep", "timing")
# Seconds: (soft budget inside the section, hard limit on its subprocess).
BUDGETS = {"audit": (25, 60), "correctness": (110, 170), "sweep": (150, 200), "timing": (160, 220)}
SMOKE_BUDGETS = {"audit": (60, 240), "correctness": (120, 400), "sweep": (60, 300), "timing": (60, 300)}
# --quick: the correctness section only, a short case list (QUICK_CASES).
QUICK_BUDGETS = {"correctness": (90, 150)}
QUICK_SMOKE_BUDGETS = {"correctness": (400, 600)}
TOKENS = (4096, 1024, 16384)
SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (5120, 17408))
ODD_SHAPES = ((4096, 4096, 4100), (4000, 4096, 4096), (4096, 4095, 4096), (1000, 1000, 3000))
FIRST_SHAPE = (512, 256, 512)  # T, K, N of the very first kernel call
RULE_SHAPE = (4096, 4096, 4096)  # every rule and dtype
SHAPE_T = 4096  # T for the (K, N) shapes
STACKED_SHAPE = (2048, 4096, 4096)  # [3, K, N] stacked weights, grad norm
SWEEP_PROBLEMS = ((4096, 4096, 4096), (1024, 4096, 4096))
# Timed in the sweep too, not ranked: one token step, so the time is the
# epilogue's (reported per warpgroup tile as "epilogue_us_per_tile").
EPILOGUE_PROBE = (64, 4096, 4096)
# Accepted errors. A float32 result: relative Frobenius error (of the update
# ``w_new - w`` for the weight; a sign-based rule such as Lion may flip where
# its argument is within rounding of 0, hence the looser update tolerance).
UPDATE_TOL = 1e-2
SLOT_TOL = 1e-4
# A 16-bit result, elementwise. Kernel and reference sum x.T @ dy in float32
# in different orders, so the float32 values they round differ in the last
# bits, and a value within that noise of a rounding boundary lands one bf16
# ulp apart (a few elements in 1e5 at 4096^3). Where the rule cancels (w + u,
# b * mu + (1 - b) * g near 0) the result is tiny while its noise is that of
# the terms, so a plain relative error explodes (the reference may even be
# exactly 0: "1e20"). Hence |a - b| <= BF16_TOL * (|b| + floor), with floor
# = BF16_FLOOR * rms(b), plus a cap on the fraction of elements that differ
# at all. A sign-based rule (Lion) may also flip an update where its argument
# is within that noise of 0 (an error of 2 lr, one element here and there),
# so a few elements in a million may exceed the bound. A misplaced or
# mis-rounded element is an error of order rms(b), thousands of times the
# bound, and a layout bug touches whole sub-tiles (2048 elements at least).
BF16_TOL = 2.0**-7  # one bf16 ulp, relative
BF16_FLOOR = 2.0**-4  # the absolute floor, as a fraction of the array's rms
BF16_MISMATCH_TOL = 1e-3  # fraction of elements allowed to differ at all
BF16_OUTLIER_TOL = 1e-6  # fraction of elements allowed beyond the bound
# int8 states: codes at most one step from the reference's, in at most this
# fraction of elements (a dW summed in another order crosses a rounding
# boundary now and then; stochastic rounding uses the same hashed bits).
INT8_CODE_TOL = 1
INT8_MISMATCH_TOL = 1e-3

def _rules() -> dict[str, Any]:
  import forge_jax  # pylint: disable=g-import-not-at-top

  return {
      "adam": forge_jax.adam(1e-3),
      "adamw": forge_jax.adamw(1e-3, weight_decay=0.1),
      "nadamw": forge_jax.nadamw(1e-3, weight_decay=0.1),
      "radam": forge_jax.radam(1e-3),
      "lion": forge_jax.lion(1e-4, weight_decay=0.1),
      "rmsprop_centered_momentum": forge_jax.rmsprop(1e-3, centered=True, momentum=0.9),
      "adagrad": forge_jax.adagrad(1e-2),
      "sgd": forge_jax.sgd(1e-2),
      "sgd_momentum": forge_jax.sgd(1e-2, momentum=0.9),
  }


def _sweep_configs(fm, state_dtype: str = "float32") -> list[Any]:
  """The tilings the sweep times (invalid ones for a problem are skipped)."""
  pp = functools.partial(fm.MosaicTileConfig, schedule="pingpong", l2_prefetch_steps=0,
                         mma_in_flight=True, epi_l2_lookahead=4)
  if state_dtype != "float32":
    # bf16 weights and states (the whole-model runs' setting). First sweep
    # (2026-11-30, results/h200/mosaic_bf16_sweep/): 5 stages fastest at
    # T=4096 (0.228 ms), 64x64 sub-tiles at T=1024 and 64 (0.112 / 0.083);
    # those are the bf16 defaults now. Second (results/h200/mosaic_bf16_sweep_read_ahead/):
    # both defaults fastest again; epi_read_ahead 4-21% slower (ptxas_report: it
    # raises the spills), 64-row tiles slower but at T=64.
    return [
        pp(max_concurrent_steps=4, epi_n=64, epi_l2_lookahead=0),  # the short-T default
        pp(max_concurrent_steps=5, epi_n=32, epi_l2_lookahead=0),  # the long-T default
        # The defaults without Pallas's automatic barriers around shared-memory stores.
        pp(max_concurrent_steps=4, epi_n=64, epi_l2_lookahead=0, no_auto_barriers=True),
        pp(max_concurrent_steps=5, epi_n=32, epi_l2_lookahead=0, no_auto_barriers=True),
        # Those (the defaults since the seventh session) in clusters of two blocks sharing x.
        pp(max_concurrent_steps=4, epi_n=64, epi_l2_lookahead=0, no_auto_barriers=True, cluster_n=2),
        pp(max_concurrent_steps=5, epi_n=32, epi_l2_lookahead=0, no_auto_barriers=True, cluster_n=2),
        pp(max_concurrent_steps=4, epi_n=64, epi_l2_lookahead=0, epi_read_ahead=True),
        pp(max_concurrent_steps=5, epi_n=32, epi_l2_lookahead=0, epi_read_ahead=True),
        pp(max_concurrent_steps=3, epi_n=64, epi_l2_lookahead=0, epi_read_ahead=True),
        pp(max_concurrent_steps=4, epi_n=32, epi_l2_lookahead=0),  # the fp32 default
        # 64-row tiles: half the accumulator's registers (64 of 232) left to the
        # epilogue, in case it spills (experiments.ptxas_report says).
        pp(tile_m=64, max_concurrent_steps=6, epi_n=32, epi_l2_lookahead=0),
    ]
  # Fifth H200 session (2026-11-30, results/h200/mosaic_timing_all_t/): the
  # default (4 stages + 64x32 sub-tiles, no lookahead) again fastest but for
  # approx_math (0.156 vs 0.161 ms at T=1024, inexact); 64x16 sub-tiles 30-40%
  # slower at short T. The profile (mosaic_profile_epi_load/) puts 17 of the
  # epilogue's 40 us per tile in the arithmetic's region: stalls on the
  # shared-memory reads or register spills. Sixth (mosaic_sweep_read_ahead/,
  # ptxas_report/): the default fastest again; read-ahead 3-14% slower with
  # 10-36x the spill bytes (the default spills 4 bytes, so spills do not explain
  # the slow arithmetic); 64-row tiles 3% slower at T=1024, 26% at T=4096.
  return [
      pp(max_concurrent_steps=4, epi_n=32, epi_l2_lookahead=0),  # the default for fp32 AdamW
      pp(max_concurrent_steps=4, epi_n=32, epi_l2_lookahead=0, no_auto_barriers=True),
      # That (the default since the seventh session) in clusters of two blocks sharing x.
      pp(max_concurrent_steps=4, epi_n=32, epi_l2_lookahead=0, no_auto_barriers=True, cluster_n=2),
      pp(max_concurrent_steps=4, epi_n=32, epi_l2_lookahead=0, epi_read_ahead=True),
      pp(max_concurrent_steps=4, epi_n=16, epi_l2_lookahead=0, epi_read_ahead=True),  # fewer registers
      pp(max_concurrent_steps=3, epi_n=32, epi_l2_lookahead=0, epi_read_ahead=True),
      pp(max_concurrent_steps=4, epi_n=32, epi_l2_lookahead=0, epi_read_ahead=True, approx_math=True),
      pp(max_concurrent_steps=4, epi_n=16),  # the 64x16 default (with the lookahead)
      pp(tile_m=64, max_concurrent_steps=5, epi_n=32, epi_l2_lookahead=0),  # half the accumulator
  ]


# ----------------------------------------------------------------------------
# Inputs and checks.
# ----------------------------------------------------------------------------


def _inputs(t, k, n, rule, w_dtype, slot_dtype, *, seed=0, layers=None):
  """bf16 x/dy; random w and slots with realistic scales (never zeros)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  keys = jax.random.split(jax.random.PRNGKey(seed), 3 + len(rule.slot_names))
  x = (jax.random.normal(keys[0], (t, k), jnp.float32) * 0.1).astype(jnp.bfloat16)
  dy = (jax.random.normal(keys[1], (t, n), jnp.float32) * 0.1).astype(jnp.bfloat16)
  shape = (k, n) if layers is None else (layers, k, n)
  w = (0.02 * jax.random.normal(keys[2], shape, jnp.float32)).astype(w_dtype)
  named = {}
  for i, name in enumerate(rule.slot_names):
    r = jax.random.normal(keys[3 + i], shape, jnp.float32)
    if name == "nu":  # >= mu**2 after rounding: centered RMSProp's variance stays positive
      # (from the stored, rounded mu, with a margin for nu's own rounding;
      # otherwise bf16 slots give nu < mu**2 somewhere and the reference NaN).
      stored = jnp.float32 if isinstance(slot_dtype, str) else slot_dtype  # int8: not a dtype here
      mu = named.get("mu", jnp.zeros(shape, jnp.float32)).astype(stored).astype(jnp.float32)
      named[name] = mu * mu * (1 + 2.0**-5) + 1e-4 * jnp.abs(r) + 1e-6
    elif name == "sum_of_squares":
      named[name] = 0.1 + jnp.abs(r)
    else:
      named[name] = 1e-2 * r
  if str(slot_dtype).startswith("int8"):
    # int8 states: "int8" with round-to-nearest maps, "int8_sr" with forge_jax's
    # default ones (the second moment's map rounds stochastically).
    import forge_jax  # pylint: disable=g-import-not-at-top
    from pallas_kernels import numerics  # pylint: disable=g-import-not-at-top
    precision = forge_jax.Precision(state_dtype="int8")
    if slot_dtype == "int8":
      nearest = lambda q: numerics.QuantMap(q.kind, q.signed, q.mantissa_bits, "nearest")
      precision = forge_jax.Precision(state_dtype="int8", signed_map=nearest(precision.signed_map),
                                      unsigned_map=nearest(precision.unsigned_map))
    return x, dy, w, tuple(precision.codec(name).quantize(named[name]) for name in rule.slot_names)
  slots = tuple(named[name].astype(slot_dtype) for name in rule.slot_names)
  return x, dy, w, slots


def _errors16(a, b) -> dict[str, Any]:
  """Elementwise check of a 16-bit result ``a`` against the reference ``b``.

  NaN in both at the same place counts as equal; anywhere else it fails.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  nan_a, nan_b = jnp.isnan(a), jnp.isnan(b)
  both = nan_a & nan_b
  a0, b0 = jnp.where(both, 0.0, a), jnp.where(both, 0.0, b)
  finite_b = jnp.where(jnp.isfinite(b0), b0, 0.0)
  floor = BF16_FLOOR * jnp.sqrt(jnp.mean(finite_b * finite_b))
  scaled = jnp.abs(a0 - b0) / (jnp.abs(b0) + jnp.maximum(floor, 1e-30))
  scaled = jnp.where(jnp.isnan(scaled), jnp.inf, scaled)  # NaN on one side only
  out = {
      "max": float(jnp.max(scaled)),
      "mismatch": float(jnp.mean(scaled > 0)),
      "outliers": float(jnp.mean(scaled > BF16_TOL)),
      "nan_kernel": int(jnp.sum(nan_a)),
      "nan_ref": int(jnp.sum(nan_b)),
  }
  out["ok"] = out["outliers"] <= BF16_OUTLIER_TOL and out["mismatch"] <= BF16_MISMATCH_TOL
  return out


def _errors(new_w, new_slots, w, ref_w, ref_slots) -> dict[str, Any]:
  """Errors of the w update and of each slot, and whether they pass.

  A float32 result is compared by relative Frobenius error (of the update
  ``new_w - w`` for the weight); a 16-bit one elementwise (``_errors16``:
  ``err_*`` is the largest ``|a - b| / (|b| + floor)``, ``mismatch_*`` the
  fraction of elements that differ, ``outliers_*`` the fraction beyond
  ``BF16_TOL``); its update error is reported, not
  checked (an update below an ulp is mostly rounded away in both).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  f32 = jnp.float32

  def rel(a, b):
    a, b = jnp.asarray(a, f32), jnp.asarray(b, f32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))

  out: dict[str, Any] = {}
  w32 = jnp.asarray(w, f32)
  out["err_update"] = rel(jnp.asarray(new_w, f32) - w32, jnp.asarray(ref_w, f32) - w32)
  if w.dtype == f32:
    ok = out["err_update"] <= UPDATE_TOL
  else:
    e = _errors16(new_w, ref_w)
    out["err_w_max"], out["mismatch_w"], out["outliers_w"] = e["max"], e["mismatch"], e["outliers"]
    if e["nan_kernel"] or e["nan_ref"]:
      out["nan_w"] = [e["nan_kernel"], e["nan_ref"]]
    ok = e["ok"]
  errs, mismatch, outliers = [], [], []
  for a, b in zip(new_slots, ref_slots):
    if hasattr(b, "codes"):  # int8: codes one step apart at most, rarely (summation order)
      diff = jnp.abs(a.codes.astype(jnp.int32) - b.codes.astype(jnp.int32))
      errs.append(float(jnp.max(diff)))
      mismatch.append(float(jnp.mean(diff > 0)))
      outliers.append(float(jnp.max(jnp.abs(a.scale - b.scale) / jnp.maximum(b.scale, 1e-30))))
      ok = ok and errs[-1] <= INT8_CODE_TOL and mismatch[-1] <= INT8_MISMATCH_TOL and outliers[-1] <= 1e-5
      continue
    if b.dtype == f32:
      errs.append(rel(a, b))
      mismatch.append(None)
      outliers.append(None)
      ok = ok and errs[-1] <= SLOT_TOL
    else:
      e = _errors16(a, b)
      errs.append(e["max"])
      mismatch.append(e["mismatch"])
      outliers.append(e["outliers"])
      ok = ok and e["ok"]
      if e["nan_kernel"] or e["nan_ref"]:
        out[f"nan_slot{len(errs) - 1}"] = [e["nan_kernel"], e["nan_ref"]]
  out["err_slots"] = errs
  if any(m is not None for m in mismatch):
    out["mismatch_slots"] = mismatch
    out["outliers_slots"] = outliers
  out["ok"] = bool(ok)
  return out


# ----------------------------------------------------------------------------
# Sections (each runs in a subprocess).
# ----------------------------------------------------------------------------


class _Section:
  """Rows of one section, written to ``<section>.json`` after every row."""

  def __init__(self, name: str, folder: pathlib.Path, budget_s: float, info: dict):
    from experiments import _timing  # pylint: disable=g-import-not-at-top

    self.name, self.path, self.budget_s = name, folder / f"{name}.json", budget_s
    self.start = time.perf_counter()
    self.payload: dict[str, Any] = {"section": name, "info": info, "rows": [], "skipped": []}
    self._timing = _timing

  def over_budget(self) -> bool:
    return time.perf_counter() - self.start > self.budget_s

  def add(self, row: dict) -> None:
    self.payload["rows"].append(row)
    self.save()

  def skip(self, what: str) -> None:
    self.payload["skipped"].append(what)
    self.save()

  def save(self) -> None:
    self.payload["elapsed_s"] = round(time.perf_counter() - self.start, 1)
    self._timing.write_json(self.path, self.payload)


def _slot_dtype(name: str):
  """A QUICK_CASES slot dtype: a jnp dtype, or "int8" / "int8_sr" (quantized states)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return name if name.startswith("int8") else jnp.dtype(name)


def _rounding(label: str, slot_dtype: str = "") -> dict:
  """Stochastic rounding of the weight for the cases labelled ``sr*``; the seed and step
  for int8 states that round stochastically (``int8_sr``); else none."""
  if slot_dtype == "int8_sr" and not label.startswith("sr"):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    return dict(seed=jnp.uint32(1234), step=jnp.int32(7))
  if not label.startswith("sr"):
    return {}
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels import numerics  # pylint: disable=g-import-not-at-top

  return dict(weight_codec=numerics.StochasticRound(), seed=jnp.uint32(1234), step=jnp.int32(7))


def _kernel_call(fm, x, dy, w, slots, rule, *, config=None, layer=None, norm=False, interpret=False,
                 rounding=None):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  fn = jax.jit(functools.partial(
      fm.fused_dw_update_mosaic, update_fn=rule.update, config=config,
      compute_grad_sq_norm=norm, interpret=interpret, **(rounding or {}),
  ))
  return fn(x, dy, w, slots, rule.scalars(jnp.int32(9)), layer=layer)


def section_audit(sec: _Section, smoke: bool, interpret: bool) -> None:
  """Lowering of every rule with and without the kernel's sqrt rewrite."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  platforms = ("cuda",) if interpret else None  # on a CPU: cross-lower for cuda
  t, k, n = (256, 128, 256) if smoke else (1024, 1024, 1024)
  sec.payload["rewrites_on_this_jax"] = sorted(p.name for p in fm._active_rewrites())
  for name, opt in _rules().items():
    if sec.over_budget():
      sec.skip(f"audit {name}")
      continue
    rule = opt.rule
    x = jax.ShapeDtypeStruct((t, k), jnp.bfloat16)
    dy = jax.ShapeDtypeStruct((t, n), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    slots = tuple(w for _ in rule.slot_names)
    row: dict[str, Any] = {"rule": name}
    # "rewritten" forces the kernel's portable spellings even where this
    # jax lowers the primitive (the kernel itself rewrites only what is
    # missing: sec.payload["rewrites_on_this_jax"]).
    for label, rewrites in (("as_written", {}), ("rewritten", dict(fm._REWRITES))):
      saved, saved_force = dict(fm._REWRITES), fm._FORCE_REWRITES
      fm._REWRITES.clear()
      fm._REWRITES.update(rewrites)
      fm._FORCE_REWRITES = True
      try:
        fn = jax.jit(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update))
        traced = fn.trace(x, dy, w, slots, rule.scalars(jnp.int32(0)))
        traced.lower(lowering_platforms=platforms) if platforms else traced.lower()
        row[label] = "ok"
      except Exception as e:  # the point of the audit
        row[label] = _timing.short_error(e, 300)
      finally:
        fm._REWRITES.clear()
        fm._REWRITES.update(saved)
        fm._FORCE_REWRITES = saved_force
    sec.add(row)
    _timing.log(f"  audit {name:<26} as written: {row['as_written'][:60]:<60} rewritten: {row['rewritten'][:40]}")


# --quick, in this order (the budget may cut the tail): what has not yet run on
# a GPU first (the bf16 defaults of 2026-11-30: 64x64 sub-tiles at short T, 5
# stages at long T; the epilogue's read-ahead), then the rows that passed on
# the H200 before: int8 states, stochastic rounding, the knobs the default
# leaves off, the cooperative schedule, every rule with bf16 w/slots, radam, the
# sqrt rules in fp32, mixed fp32 w / bf16 slots. (case, rule, w dtype name, slot
# dtype name, stacked, MosaicTileConfig fields or None for the default);
# shape RULE_SHAPE or STACKED_SHAPE.
_COOP_BF16 = {"schedule": "cooperative", "max_concurrent_steps": 3, "epi_n": 32}
_COOP_F32 = {"schedule": "cooperative", "max_concurrent_steps": 3, "epi_n": 16}
_TUNED_F32 = {"schedule": "pingpong", "max_concurrent_steps": 4, "epi_n": 16, "l2_prefetch_steps": 0,
              "mma_in_flight": True, "epi_l2_lookahead": 4}
_TUNED_BF16 = dict(_TUNED_F32, epi_n=32)  # bf16 rows of 64 bytes
_OUT_F32 = dict(_TUNED_F32, max_concurrent_steps=3, epi_out_slots=2)  # separate store buffers
_OUT_BF16 = dict(_OUT_F32, epi_n=32)
_WIDE_BF16 = dict(_TUNED_F32, epi_n=64, epi_l2_lookahead=0)  # 64x64 sub-tiles (bf16 short-T default)
_RA_F32 = dict(_TUNED_F32, epi_n=32, epi_l2_lookahead=0, epi_read_ahead=True)  # fp32 default + read-ahead
_RA_WIDE = dict(_WIDE_BF16, epi_read_ahead=True)
_RA_INT8 = dict(_RA_WIDE, max_concurrent_steps=3)  # epi_n = the block; fp32 w: 3 stages fit
# The defaults without Pallas's automatic warpgroup barriers around shared-memory stores.
_NB_F32 = dict(_TUNED_F32, epi_n=32, epi_l2_lookahead=0, no_auto_barriers=True)
_NB_WIDE = dict(_WIDE_BF16, no_auto_barriers=True)
_NB_LONG = dict(_WIDE_BF16, max_concurrent_steps=5, epi_n=32, no_auto_barriers=True)
# Clusters of two blocks sharing each x block by TMA multicast (cluster_n=2), on the defaults' tilings.
_CL_F32 = dict(_NB_F32, cluster_n=2)
_CL_WIDE = dict(_NB_WIDE, cluster_n=2)
_CL_LONG = dict(_NB_LONG, cluster_n=2)
# The cooperative schedule with a block's tiles as one pipeline of pipelines (2 stages: 4 do not fit
# beside its 128x256 x/dy blocks and the ring; 2 divide every T's steps).
_XT_F32 = {"schedule": "cooperative", "max_concurrent_steps": 2, "epi_n": 16, "l2_prefetch_steps": 0,
           "pipeline_across_tiles": True}
_XT_BF16 = dict(_XT_F32, epi_n=32)
QUICK_CASES = (
    # Not yet run on a GPU: pipeline_across_tiles (a wrong barrier phase across tiles shows as
    # wrong values or a hang; the interpreter hangs on it on 2 cores). Shapes with >= 2 tiles per
    # block of 132, where the knob applies (tests check that).
    ("across_tiles", "adamw", "float32", "float32", False, _XT_F32, (1024, 4096, 4096)),
    ("across_tiles", "adamw", "bfloat16", "bfloat16", False, _XT_BF16, (1024, 4096, 4096)),
    ("across_tiles", "lion", "bfloat16", "bfloat16", False, _XT_BF16, (4096, 4096, 4096)),
    ("across_tiles", "adamw", "bfloat16", "bfloat16", True, _XT_BF16, (2048, 4096, 4096)),
    # Not yet run on a GPU: cluster_n=2 (a wrong multicast or cluster barrier shows as
    # wrong values or a hang; fp32, both bf16 tilings, stacked with the norm, Lion).
    ("cluster", "adamw", "float32", "float32", False, _CL_F32),
    ("cluster", "adamw", "bfloat16", "bfloat16", False, _CL_WIDE),
    ("cluster", "adamw", "bfloat16", "bfloat16", False, _CL_LONG),
    ("cluster", "adamw", "bfloat16", "bfloat16", True, _CL_F32),
    ("cluster", "lion", "float32", "float32", False, _CL_F32),
    # Not yet run on a GPU: the defaults of 2026-11-30's second change, 64-row
    # tiles with no_auto_barriers for weights of few 128x128 tiles (a 7th
    # element: the T x K x N shape), and a stacked 3-layer weight of that kind.
    ("small_grid", "adamw", "float32", "float32", False, None, (1024, 1024, 1024)),
    ("small_grid", "adamw", "bfloat16", "bfloat16", False, None, (1024, 1024, 1024)),
    ("small_grid", "lion", "bfloat16", "bfloat16", False, None, (1024, 1024, 3072)),
    ("small_grid", "adamw", "bfloat16", "bfloat16", False, None, (4096, 3072, 1024)),
    ("small_grid", "adamw", "bfloat16", "bfloat16", True, None, (2048, 1024, 2048)),
    ("small_grid", "adamw", "bfloat16", "int8_sr", False, None, (1024, 1024, 1024)),
    # Passed on the H200 (results/h200/mosaic_barriers/quick, 2026-11-30):
    # no_auto_barriers (a race would show as wrong values; fp32 and bf16 with
    # both bf16 tilings, stacked with the grad norm, Lion), now the defaults'.
    ("no_barriers", "adamw", "float32", "float32", False, _NB_F32),
    ("no_barriers", "adamw", "bfloat16", "bfloat16", False, _NB_WIDE),
    ("no_barriers", "adamw", "bfloat16", "bfloat16", False, _NB_LONG),
    ("no_barriers", "adamw", "bfloat16", "bfloat16", True, _NB_F32),  # the stacked default's tiling
    ("no_barriers", "lion", "float32", "float32", False, _NB_F32),
    # Not yet run on a GPU: the new bf16 defaults (stacked_norm: T=2048, 64x64
    # sub-tiles; rule: T=4096, 5 stages), 64x64 at T=4096, SR with them, and
    # the epilogue's read-ahead (fp32, bf16, int8; stacked with the norm is
    # tested under the interpreter only: the smoke run's stacked K=64 is below
    # this tiling).
    ("stacked_norm", "adamw", "bfloat16", "bfloat16", True, None),
    ("rule", "adamw", "bfloat16", "bfloat16", False, None),
    ("wide", "adamw", "bfloat16", "bfloat16", False, _WIDE_BF16),
    ("sr_stacked", "adamw", "bfloat16", "bfloat16", True, None),
    ("read_ahead", "adamw", "float32", "float32", False, _RA_F32),
    ("read_ahead", "adamw", "bfloat16", "bfloat16", False, _RA_WIDE),
    ("read_ahead", "lion", "bfloat16", "bfloat16", False, _RA_WIDE),
    ("read_ahead", "adamw", "float32", "int8", False, _RA_INT8),
    # Passed on the H200 (results/h200/mosaic_int8_quick, 2026-11-30): int8
    # states, with nearest and with forge_jax's default (stochastic) maps.
    ("int8", "adamw", "float32", "int8", False, None),
    ("int8", "adamw", "float32", "int8_sr", False, None),
    ("int8", "adamw", "bfloat16", "int8_sr", True, None),
    ("sr_int8", "adamw", "bfloat16", "int8_sr", False, None),
    ("int8", "lion", "bfloat16", "int8", False, None),
    ("int8", "adagrad", "float32", "int8_sr", False, None),
    # Passed on the H200 (results/h200/mosaic_quick_sr_fixed): stochastic rounding of bf16 weights in the epilogue,
    # the tuned knobs, the stacked layer with norm, the cooperative schedule.
    ("sr", "adamw", "bfloat16", "bfloat16", False, None),
    ("sr", "adamw", "bfloat16", "float32", False, None),
    ("sr_schedule", "adamw", "bfloat16", "bfloat16", False, _COOP_BF16),
    ("sr_out", "adamw", "bfloat16", "bfloat16", False, _OUT_BF16),
    ("out", "adamw", "float32", "float32", False, _OUT_F32),
    ("tuned", "adamw", "float32", "float32", False, _TUNED_F32),
    ("tuned", "adamw", "bfloat16", "bfloat16", False, _TUNED_BF16),
    ("schedule", "adamw", "bfloat16", "bfloat16", False, _COOP_BF16),
    ("schedule", "adamw", "float32", "float32", False, _COOP_F32),
    # Passed on the H200 on 2026-11-29 (results/h200/mosaic_quick): re-checked
    # as the budget allows.
    ("rule", "sgd", "bfloat16", "bfloat16", False, None),
    ("rule", "radam", "float32", "float32", False, None),
    ("rule", "radam", "bfloat16", "bfloat16", False, None),
    ("rule", "rmsprop_centered_momentum", "bfloat16", "bfloat16", False, None),
    ("rule", "adagrad", "bfloat16", "bfloat16", False, None),
    ("rule", "sgd_momentum", "bfloat16", "bfloat16", False, None),
    ("rule", "lion", "bfloat16", "bfloat16", False, None),
    ("rule", "adamw", "float32", "float32", False, None),
    ("rule", "adam", "bfloat16", "bfloat16", False, None),
    ("rule", "nadamw", "bfloat16", "bfloat16", False, None),
    ("rule", "rmsprop_centered_momentum", "float32", "float32", False, None),
    ("mixed", "adamw", "float32", "bfloat16", False, None),
)


def smoke_tiling():
  """The tiling of --smoke runs under the Mosaic GPU interpreter: one block of small tiles
  (132 simulated blocks take minutes)."""
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  return fm.MosaicTileConfig(tile_m=64, tile_n=64, max_concurrent_steps=2, epi_n=16, num_sms=1)


def section_correctness(sec: _Section, smoke: bool, interpret: bool, quick: bool = False) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top
  from pallas_kernels.fused_dw import fused_dw_update_reference  # pylint: disable=g-import-not-at-top

  f32, bf16 = jnp.float32, jnp.bfloat16
  rules = _rules()
  cfg = smoke_tiling() if smoke else None
  big = (128, 128, 256) if smoke else RULE_SHAPE
  # (label, rule, (t, k, n), w dtype, slot dtype, layers, grad norm, config
  # fields or None); most informative first, since the time budget may cut
  # the list short.
  cases: list[tuple[str, str, tuple, Any, Any, Optional[int], bool, Optional[dict]]] = [
      ("first_run", "adamw", (128, 128, 256) if smoke else FIRST_SHAPE, f32, f32, None, False, None),
      ("norm", "lion", big, f32, f32, None, True, None),
      ("stacked_norm", "adamw", (64, 64, 128) if smoke else STACKED_SHAPE, bf16, bf16, 3, True, None),
  ]
  if quick:
    sec.payload["rewrites_on_this_jax"] = sorted(p.name for p in fm._active_rewrites())
    stacked = (64, 64, 128) if smoke else STACKED_SHAPE
    cases = [(label, name, shape[0] if shape and not smoke else stacked if layers else big,
              jnp.dtype(w_dt), _slot_dtype(s_dt), 3 if layers else None, bool(layers), fields)
             for label, name, w_dt, s_dt, layers, fields, *shape in QUICK_CASES]
  elif smoke:
    cases += [("rule", "sgd_momentum", big, f32, bf16, None, False, None)]
  else:
    cases += [("rule", name, big, f32, f32, None, False, None) for name in rules]
    cases += [("shape", "adamw", (SHAPE_T, k, n), f32, f32, None, False, None) for k, n in SHAPES_KN]
    cases += [("rule", name, big, bf16, bf16, None, False, None) for name in rules]
    cases += [("shape", "adamw", (SHAPE_T, k, n), bf16, bf16, None, False, None) for k, n in SHAPES_KN]
    cases += [("shape", "adamw", (SHAPE_T, k, n), f32, bf16, None, False, None) for k, n in SHAPES_KN]
    cases += [("sr", name, big, bf16, bf16, None, False, None) for name in ("adamw", "lion", "sgd")]
    cases += [("sr_stacked", "adamw", STACKED_SHAPE, bf16, bf16, 3, True, None)]

  for label, name, (t, k, n), w_dt, s_dt, layers, norm, fields in cases:
    row: dict[str, Any] = {
        "case": label, "rule": name, "shape": f"{t}x{k}x{n}", "w_dtype": jnp.dtype(w_dt).name,
        "slot_dtype": s_dt if isinstance(s_dt, str) else jnp.dtype(s_dt).name, "layers": layers,
        "grad_norm": norm,
    }
    row_cfg = cfg
    if fields is not None:
      row_cfg = fm.MosaicTileConfig(**fields, **({"num_sms": 1} if smoke else {}))
    elif smoke and isinstance(s_dt, str):  # int8: sub-tiles one 64-value block wide
      row_cfg = fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=2,
                                    epi_n=64, num_sms=1)
    if sec.over_budget():
      sec.skip(f"{label} {name} {row['shape']} {row['w_dtype']}/{row['slot_dtype']}")
      continue
    if interpret and (label.startswith("sr") or s_dt == "int8_sr"):
      sec.skip(f"{label} {name}: the Mosaic GPU interpreter cannot run stochastic rounding")
      continue
    if interpret and (fields or {}).get("pipeline_across_tiles", False):
      sec.skip(f"{label} {name}: the Mosaic GPU interpreter hangs on pipeline_across_tiles here "
               "(MOSAIC_NOTES, session 14)")
      continue
    if interpret and (fields or {}).get("cluster_n", 1) > 1:
      sec.skip(f"{label} {name}: the Mosaic GPU interpreter cannot allocate cluster barriers")
      continue
    rule = rules[name].rule
    try:
      x, dy, w, slots = _inputs(t, k, n, rule, w_dt, s_dt, layers=layers)
      layer = None if layers is None else jnp.int32(layers - 2)
      used = row_cfg or fm.default_config(x, dy, w, slots, compute_grad_sq_norm=norm)
      row["config"] = cfg_text(used)
      ok, why = fm.supports(x, dy, w, slots, used, compute_grad_sq_norm=norm)
      if not ok:
        raise ValueError(why)
      rounding = _rounding(label, s_dt if isinstance(s_dt, str) else "")
      start = time.perf_counter()
      new_w, new_slots, g2 = _kernel_call(
          fm, x, dy, w, slots, rule, config=row_cfg, layer=layer, norm=norm, interpret=interpret,
          rounding=rounding,
      )
      jax.block_until_ready((new_w, new_slots))
      row["first_call_s"] = round(time.perf_counter() - start, 2)
      ref_w, ref_slots, ref_g2 = fused_dw_update_reference(
          x, dy, w, slots, rule.scalars(jnp.int32(9)), rule.update, layer=layer,
          compute_grad_sq_norm=norm, **rounding,
      )
      if layers is not None:  # the other layers must be untouched
        others = [i for i in range(layers) if i != layers - 2]
        row["other_layers_untouched"] = bool(
            jnp.array_equal(new_w[jnp.array(others)], w[jnp.array(others)])
        )
        new_w, ref_w, w0 = new_w[layers - 2], ref_w[layers - 2], w[layers - 2]
        new_slots = tuple(jax.tree.map(lambda a: a[layers - 2], s) for s in new_slots)
        ref_slots = tuple(jax.tree.map(lambda a: a[layers - 2], s) for s in ref_slots)
      else:
        w0 = w
      row.update(_errors(new_w, new_slots, w0, ref_w, ref_slots))
      if "weight_codec" in rounding:  # the same hashed bits: most rounded weights identical
        row["sr_same_bits"] = float(jnp.mean(new_w == ref_w))
        row["ok"] = row["ok"] and row["sr_same_bits"] >= 0.99
      if norm:
        row["err_norm"] = abs(float(g2) - float(ref_g2)) / max(abs(float(ref_g2)), 1e-30)
        row["ok"] = row["ok"] and row["err_norm"] <= 1e-4
      if layers is not None:
        row["ok"] = row["ok"] and row["other_layers_untouched"]
      row["status"] = "ok" if row["ok"] else "check_failed"
    except Exception as e:  # record and go on
      row.update(status="error", error=_timing.short_error(e))
    sec.add(row)
    _timing.log(f"  {label:<12} {name:<26} {row['shape']:>16} {row['w_dtype']}/{row['slot_dtype']} "
                f"[{row.get('config', '-')}]: {row['status']} {_err_text(row)}")
    gc.collect()

  for t, k, n in () if quick else ODD_SHAPES:
    rule = rules["adamw"].rule
    x = jax.ShapeDtypeStruct((t, k), bf16)
    dy = jax.ShapeDtypeStruct((t, n), bf16)
    w = jax.ShapeDtypeStruct((k, n), f32)
    ok, why = fm.supports(x, dy, w, (w, w))
    row = {"case": "odd_shape", "rule": "adamw", "shape": f"{t}x{k}x{n}", "supports": ok, "reason": why,
           "status": "ok" if not ok and why else "unexpected_support"}
    sec.add(row)
    _timing.log(f"  odd_shape    {row['shape']:>16}: supports={ok} ({why})")


def _err_text(row: dict) -> str:
  parts = []
  for key in ("err_update", "err_w_max", "mismatch_w", "outliers_w", "err_norm"):
    if key in row:
      parts.append(f"{key}={row[key]:.2e}")
  if row.get("err_slots"):
    parts.append("err_slots=" + ",".join(f"{e:.2e}" for e in row["err_slots"]))
  for key in ("mismatch_slots", "outliers_slots"):
    if row.get(key):
      parts.append(f"{key}=" + ",".join("-" if m is None else f"{m:.1e}" for m in row[key]))
  parts += [f"{key}(kernel,ref)={v}" for key, v in row.items() if key.startswith("nan_")]
  if "error" in row:
    parts.append(row["error"][:200])
  return " ".join(parts)


def section_sweep(sec: _Section, smoke: bool, interpret: bool, state_dtype: str = "float32") -> None:
  import dataclasses as dc  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  from experiments import bench_fused_dw as bench  # pylint: disable=g-import-not-at-top

  problems = [(64, 64, 128)] if smoke else list(SWEEP_PROBLEMS)
  ranked = {f"{t}x{k}x{n}" for t, k, n in problems}
  if not smoke:
    problems.append(EPILOGUE_PROBE)
  configs = _sweep_configs(fm, state_dtype)
  sec.payload["state_dtype"] = state_dtype
  # Mosaic GPU's own limit, not the defaults' margin: a config over the real
  # limit fails to lower and is recorded as an error row.
  fm._SMEM_BUDGET_BYTES = fm._MOSAIC_SMEM_LIMIT
  if smoke:  # one config per schedule, one the kernel rejects (recorded, not run)
    configs = [
        fm.MosaicTileConfig(tile_m=64, tile_n=64, max_concurrent_steps=1, epi_n=32, epi_slots=1, num_sms=1),
        fm.MosaicTileConfig(schedule="pingpong", tile_m=64, tile_n=64, max_concurrent_steps=2, epi_n=32,
                            num_sms=1),
        fm.MosaicTileConfig(tile_m=96),
    ]
  timing = dict(warmup=1, iters=2, repeats=1) if smoke else dict(warmup=3, iters=30, repeats=3)
  # Every config on every problem before the next config: a budget cut then
  # leaves whole configs unmeasured rather than a problem with no configs.
  setups = []
  for (t, k, n) in problems:
    x, dy, w0 = bench.make_inputs(t, k, n, state_dtype=jnp.dtype(state_dtype))
    p = bench.make_problem(x, dy, w0, "adamw", interpret)
    setups.append((p, bench.reference_step(p)))
  ms_by_config: dict[int, list[float]] = {}
  for idx, cfg in enumerate(configs):
    for p, reference in setups:
      label = f"{p.name} config {idx}"
      if sec.over_budget():
        sec.skip(label)
        continue
      ok, why = fm.supports(p.x, p.dy, p.w0, [p.w0] * len(p.rule.slot_names), cfg)
      if not ok:
        sec.add({"problem": p.name, "config_index": idx, "config": dc.asdict(cfg), "status": "unsupported",
                 "error": why})
        continue
      builder = bench.fused_builder(functools.partial(fm.fused_dw_update_mosaic, config=cfg))
      row = bench.measure("mosaic", builder, p, reference, timing)
      row.update(problem=p.name, config_index=idx, config=dc.asdict(cfg))
      sec.add(row)
      if row["status"] == "ok" and p.name in ranked:
        ms_by_config.setdefault(idx, []).append(row["ms"])
      elif row["status"] == "ok":  # the probe: both compute warpgroups run epilogues side by side
        wg_tiles = (p.w0.shape[0] // cfg.tile_m) * (p.w0.shape[1] // cfg.tile_n)
        sms = cfg.num_sms or sec.payload["info"].get("sm_count") or 132
        row["epilogue_us_per_tile"] = round(row["ms"] * 1e3 * sms * 2 / wg_tiles, 2)
        sec.payload.setdefault("epilogue_us_per_tile", {})[idx] = row["epilogue_us_per_tile"]
        sec.save()
      _timing.log(f"  sweep {p.name:>16} cfg {idx:>2} {cfg_text(cfg):<52} {bench._cell(row)}")
      gc.collect()
    # Best so far after every config: a later hang (killed section) keeps it.
    complete = {i: v for i, v in ms_by_config.items() if len(v) == len(ranked)}
    if complete:
      best = min(complete, key=lambda i: statistics.geometric_mean(complete[i]))
      sec.payload["best"] = {"config_index": best, "config": dc.asdict(configs[best]),
                             "geomean_ms": statistics.geometric_mean(complete[best])}
      sec.payload["ranking"] = sorted(
          ({"config_index": i, "geomean_ms": statistics.geometric_mean(v), "config": cfg_text(configs[i])}
           for i, v in complete.items()), key=lambda r: r["geomean_ms"])
      sec.save()
  del setups
  gc.collect()


def cfg_text(cfg) -> str:
  """One line per config; ``cfg`` a MosaicTileConfig or its asdict."""
  get = (lambda f, d=None: cfg.get(f, d)) if isinstance(cfg, dict) else (lambda f, d=None: getattr(cfg, f, d))
  text = (f"{str(get('schedule'))[:4]} {get('tile_m')}x{get('tile_n')}x{get('tile_t')} "
          f"st{get('max_concurrent_steps')} epi{get('epi_m')}x{get('epi_n')}/{get('epi_slots')} "
          f"{get('grid_minor_dim')}{get('grid_tile_width')} l2pf{get('l2_prefetch_steps')}")
  if get("mma_in_flight", False):
    text += " mma1"
  if get("epi_l2_lookahead", 0):
    text += f" epila{get('epi_l2_lookahead')}"
  if get("epi_out_slots", 0):
    text += f" out{get('epi_out_slots')}"
  if get("lowering_semantics", "Warpgroup") != "Warpgroup":
    text += f" {str(get('lowering_semantics')).lower()}"
  if get("approx_math", False):
    text += " approx"
  if get("epi_read_ahead", False):
    text += " ra"
  if get("no_auto_barriers", False):
    text += " nb"
  if get("cluster_n", 1) > 1:
    text += f" cl{get('cluster_n')}"
  if get("pipeline_across_tiles", False):
    text += " xt"
  if get("epi_direct", False):
    text += " direct"
  if get("epi_shared_ring", False):
    text += " shr"
  if get("stage_l2_lookahead", 0):
    text += f" stla{get('stage_l2_lookahead')}"
  return text


def section_timing(sec: _Section, smoke: bool, interpret: bool, config: Optional[dict], kernel: bool,
                   state_dtype: str = "float32", tokens: Optional[Sequence[int]] = None,
                   shapes: Optional[Sequence[tuple[int, int]]] = None, calls: int = 1) -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  from experiments import bench_fused_dw as bench  # pylint: disable=g-import-not-at-top

  cfg = fm.MosaicTileConfig(**config) if config else None
  if smoke and not config:
    cfg = fm.MosaicTileConfig(tile_m=64, tile_n=64, max_concurrent_steps=1, epi_n=32, epi_slots=1, num_sms=1)

  def mosaic(x, dy, w, slots, scalars, update_fn, *, interpret=False):
    use = cfg
    if use is not None:
      ok, why = fm.supports(x, dy, w, slots, use)
      if not ok and config:  # a --config-json that does not fit: say so, never time another one
        raise ValueError(f"--config-json {config} does not fit {x.shape[0]}x{w.shape[-2]}x{w.shape[-1]} "
                         f"{w.dtype}: {why}")
      use = use if ok else None  # the smoke tiling where it does not fit: the kernel's default
    return fm.fused_dw_update_mosaic(x, dy, w, slots, scalars, update_fn, config=use, interpret=interpret)

  bench.IMPLEMENTATIONS["mosaic"] = bench.fused_builder(mosaic)
  impls = ["xla_gemm", "xla_gemm_optax", "mosaic"]
  sec.payload["impls"] = impls
  sec.payload["mosaic_config"] = config
  sec.payload["state_dtype"] = state_dtype
  sec.payload["info"]["state_dtype"] = state_dtype
  timing = dict(warmup=1, iters=2, repeats=1) if smoke else dict(warmup=3, iters=30, repeats=3)
  if calls > 1:
    timing["calls"] = calls
  sec.payload["timing"] = timing
  tokens = (64,) if smoke else tuple(tokens or TOKENS)
  shapes = tuple(shapes) if shapes else ((64, 128),) if smoke else SHAPES_KN
  optimizers = ["adamw"] if smoke else list(bench.OPTIMIZERS)
  if not kernel:
    impls.remove("mosaic")
  for t in tokens:
    for k, n in shapes:
      if sec.over_budget():
        sec.skip(f"{t}x{k}x{n}")
        continue
      try:
        rows = bench.bench_shape(t, k, n, optimizers, impls, interpret=interpret, timing=timing,
                                 state_dtype=jnp.dtype(state_dtype))
      except Exception as e:  # e.g. out of memory making the inputs
        rows = [{"impl": "-", "optimizer": "-", "shape": f"{t}x{k}x{n}", "status": "error",
                 "floor_ms": float("nan"), "error": _timing.short_error(e)}]
      for row in rows:
        sec.payload["rows"].append(row)
      sec.save()
      gc.collect()


def _budgets(smoke: bool, quick: bool) -> dict:
  if quick:
    return QUICK_SMOKE_BUDGETS if smoke else QUICK_BUDGETS
  return SMOKE_BUDGETS if smoke else BUDGETS


def run_section(name: str, folder: pathlib.Path, smoke: bool, config: Optional[dict], kernel: bool,
                quick: bool = False, state_dtype: str = "float32",
                tokens: Optional[Sequence[int]] = None,
                shapes: Optional[Sequence[tuple[int, int]]] = None, calls: int = 1) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  interpret = smoke or jax.default_backend() == "cpu"
  budget = _budgets(smoke, quick)[name][0]
  info = _timing.run_info("experiments.check_mosaic_gpu", sys.argv[1:])
  info.update(interpret=interpret, budget_s=budget)
  info["sm_count"] = getattr(jax.devices()[0], "core_count", None)
  sec = _Section(name, folder, budget, info)
  sec.save()
  _timing.log(f"[{name}] on {info['device']} (jax {info['jax']}), interpret={interpret}, budget {budget}s")
  if name == "audit":
    section_audit(sec, smoke, interpret)
  elif name == "correctness":
    section_correctness(sec, smoke, interpret, quick)
  elif name == "sweep" and kernel:
    section_sweep(sec, smoke, interpret, state_dtype)
  elif name == "sweep":
    sec.skip("the kernel did not return from its first run (hang?): no sweep")
  elif name == "timing":
    section_timing(sec, smoke, interpret, config, kernel, state_dtype, tokens, shapes, calls)
  sec.payload["done"] = True
  sec.save()
  return 0


# ----------------------------------------------------------------------------
# The parent: runs the sections, merges, reports.
# ----------------------------------------------------------------------------


def _read(path: pathlib.Path) -> Optional[dict]:
  try:
    return json.loads(path.read_text())
  except Exception:  # missing or cut short
    return None


def _spawn(name: str, folder: pathlib.Path, smoke: bool, config: Optional[dict], kernel: bool,
           quick: bool = False, state_dtype: str = "float32",
           tokens: Optional[Sequence[int]] = None,
           shapes: Optional[Sequence[tuple[int, int]]] = None, calls: int = 1) -> dict:
  limit = _budgets(smoke, quick)[name][1]
  cmd = [sys.executable, "-m", "experiments.check_mosaic_gpu", "--section", name, "--out", str(folder)]
  if smoke:
    cmd.append("--smoke")
  if quick:
    cmd.append("--quick")
  if config:
    cmd += ["--config-json", json.dumps(config)]
  if not kernel:
    cmd.append("--no-kernel")
  if state_dtype != "float32":
    cmd += ["--state-dtype", state_dtype]
  if tokens:
    cmd += ["--tokens", *map(str, tokens)]
  if shapes:
    cmd += ["--shapes", *(f"{k}x{n}" for k, n in shapes)]
  if calls > 1:
    cmd += ["--calls", str(calls)]
  start = time.perf_counter()
  try:
    proc = subprocess.run(cmd, timeout=limit, capture_output=True, text=True)
    rc, out, err = proc.returncode, proc.stdout, proc.stderr
  except subprocess.TimeoutExpired as e:
    rc = "timeout"
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
  sys.stdout.write(out)
  sys.stdout.flush()
  return {"section": name, "rc": rc, "elapsed_s": round(time.perf_counter() - start, 1),
          "limit_s": limit, "stderr_tail": err[-3000:] if rc != 0 else err[-500:]}


def _markdown(info: dict, runs: list[dict], parts: dict[str, Optional[dict]]) -> str:
  from experiments import bench_fused_dw as bench  # pylint: disable=g-import-not-at-top

  out = [
      "# Mosaic GPU fused dW + optimizer kernel: first GPU check", "",
      f"`{info.get('command', '')}`; {info.get('date', '')}; {info.get('device', '')}; "
      f"jax {info.get('jax', '')}, jaxlib {info.get('jaxlib', '')}; interpret={info.get('interpret')}.", "",
      "| section | exit | seconds | rows | skipped |", "|---|---|---|---|---|",
  ]
  for run in runs:
    part = parts.get(run["section"]) or {}
    out.append(f"| {run['section']} | {run['rc']} | {run['elapsed_s']} | {len(part.get('rows', []))} "
               f"| {len(part.get('skipped', []))} |")
  audit = parts.get("audit")
  if audit and audit.get("rows"):
    out += ["", "## Lowering of each rule (kernel lowered on this jax)", "",
            "| rule | as written | with sqrt -> x*rsqrt(x) |", "|---|---|---|"]
    for r in audit["rows"]:
      out.append(f"| {r['rule']} | {r['as_written'][:120]} | {r['rewritten'][:80]} |")
  corr = parts.get("correctness")
  if corr and corr.get("rows"):
    out += ["", "## Correctness against fused_dw_update_reference", "",
            f"Tolerances: fp32 update {UPDATE_TOL:g} and slots {SLOT_TOL:g} (relative Frobenius); bf16 "
            f"elementwise {BF16_TOL:g}.", "",
            "| case | rule | T x K x N | w / slots | config | status | first call s | errors |",
            "|---|---|---|---|---|---|---|---|"]
    for r in corr["rows"]:
      if r["case"] == "odd_shape":
        out.append(f"| odd shape | {r['rule']} | {r['shape']} | - | - | {r['status']} | - | {r['reason'][:100]} |")
      else:
        out.append(f"| {r['case']} | {r['rule']} | {r['shape']} | {r['w_dtype']} / {r['slot_dtype']} | "
                   f"{r.get('config', '-')} | {r['status']} | {r.get('first_call_s', '-')} | {_err_text(r)[:200]} |")
  sweep = parts.get("sweep")
  if sweep and sweep.get("rows"):
    sweep_dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(sweep.get("state_dtype", "float32"), "?")
    out += ["", f"## Tiling sweep (AdamW, {sweep_dtype} w/slots)", "",
            "| problem | config | status | ms | TF/s |", "|---|---|---|---|---|"]
    for r in sweep["rows"]:
      text = cfg_text(r.get("config", {}))
      ms = f"{r['ms']:.3f}" if "ms" in r else "-"
      tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
      status = r["status"] + (f": {r['error'][:100]}" if "error" in r else "")
      out.append(f"| {r['problem']} | {r['config_index']}: {text} | {status} | {ms} | {tf} |")
    if "best" in sweep:
      out += ["", f"Best (geometric mean over the problems): config {sweep['best']['config_index']} "
              f"`{sweep['best']['config']}`."]
  timing = parts.get("timing")
  if timing and timing.get("rows"):
    tinfo = dict(timing.get("info", {}), timing=timing.get("timing", {"iters": "?", "repeats": "?"}))
    tinfo.setdefault("triton", None)
    out += ["", "## Timing", "", f"Mosaic config: {timing.get('mosaic_config') or 'default_config per operands'}.", ""]
    table = bench.markdown(tinfo, timing["rows"], timing.get("impls", []))
    out.append(table.replace("# Fused dW + optimizer update vs XLA\n", "", 1))
  for name, part in parts.items():
    if part and part.get("skipped"):
      out += ["", f"Skipped in {name} (time budget): " + "; ".join(part["skipped"])]
  return "\n".join(out) + "\n"


def _summary(parts: dict[str, Optional[dict]]) -> str:
  lines = []
  corr = parts.get("correctness") or {}
  rows = [r for r in corr.get("rows", []) if r.get("case") != "odd_shape"]
  if rows:
    bad = [f"{r['rule']} {r['shape']} {r['w_dtype']}/{r['slot_dtype']}: {r['status']}" for r in rows
           if r["status"] != "ok"]
    lines.append(f"correctness: {len(rows) - len(bad)}/{len(rows)} ok" + (f"; not ok: {bad[:6]}" if bad else ""))
  audit = parts.get("audit") or {}
  if audit.get("rows"):
    raw_fail = [r["rule"] for r in audit["rows"] if r["as_written"] != "ok"]
    rw_fail = [r["rule"] for r in audit["rows"] if r["rewritten"] != "ok"]
    lines.append(f"audit: fail as written {raw_fail}; fail rewritten {rw_fail}")
  sweep = parts.get("sweep") or {}
  if "best" in sweep:
    lines.append(f"sweep best: {sweep['best']['config']} ({sweep['best']['geomean_ms']:.3f} ms geomean)")
  timing = parts.get("timing") or {}
  by = {}
  for r in timing.get("rows", []):
    if "ms" in r:
      by.setdefault((r["shape"], r["optimizer"]), {})[r["impl"]] = r["ms"]
  ratios = [v["xla_gemm_optax"] / v["mosaic"] for v in by.values() if "mosaic" in v and "xla_gemm_optax" in v]
  if ratios:
    lines.append(f"timing: mosaic vs xla_gemm_optax speedup min {min(ratios):.2f}x, "
                 f"geomean {statistics.geometric_mean(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} rows")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--smoke", action="store_true", help="CPU: interpreter, tiny shapes")
  parser.add_argument("--sections", nargs="+", default=None, choices=SECTIONS,
                      help=f"sections to run (default: all of {', '.join(SECTIONS)}; --quick: correctness)")
  parser.add_argument("--quick", action="store_true",
                      help="correctness only, QUICK_CASES at 4096^3 (about a minute on an H200)")
  parser.add_argument("--section", default=None, choices=SECTIONS, help=argparse.SUPPRESS)
  parser.add_argument("--no-kernel", action="store_true",
                      help="skip the kernel in sweep/timing (set by the parent after a hang)")
  parser.add_argument("--config-json", default=None,
                      help="MosaicTileConfig fields for the timing section (default: default_config per shape)")
  parser.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="weight and optimizer-state dtype of the timing (both sides) and sweep sections")
  parser.add_argument("--tokens", type=int, nargs="+", default=None,
                      help=f"T values of the timing section (default: {' '.join(map(str, TOKENS))})")
  parser.add_argument("--shapes", nargs="+", default=None, metavar="KxN",
                      help="K x N weight shapes of the timing section (default: the four 8B shapes "
                           f"{' '.join(f'{k}x{n}' for k, n in SHAPES_KN)})")
  parser.add_argument("--calls", type=int, default=1,
                      help="timing section: calls per dispatch (one jit), for shapes whose device work "
                           "is shorter than a dispatch (about 30-40 us on the H200)")
  args = parser.parse_args(argv)
  if args.calls < 1:
    parser.error(f"--calls must be >= 1; got {args.calls}")
  shapes = None
  if args.shapes:
    try:
      shapes = [tuple(int(v) for v in spec.split("x")) for spec in args.shapes]
      if any(len(kn) != 2 or min(kn) <= 0 for kn in shapes):
        raise ValueError
    except ValueError:
      parser.error(f"--shapes takes KxN pairs of positive ints, e.g. 1024x3072; got {args.shapes}")
  from experiments import _timing  # pylint: disable=g-import-not-at-top  (no jax backend touched)

  folder = _timing.out_dir(args.out)
  config = json.loads(args.config_json) if args.config_json else None
  if args.section:  # a child
    return run_section(args.section, folder, args.smoke, config, not args.no_kernel, args.quick,
                       args.state_dtype, args.tokens, shapes, args.calls)
  if args.sections is None:
    args.sections = ["correctness"] if args.quick else list(SECTIONS)
  if args.quick and args.sections != ["correctness"]:
    parser.error("--quick runs the correctness section only")

  start = time.perf_counter()
  runs = []
  kernel = True
  for name in args.sections:
    _timing.log(f"== {name} ==")
    runs.append(_spawn(name, folder, args.smoke, config if name == "timing" else None, kernel, args.quick,
                       args.state_dtype, args.tokens, shapes, args.calls))
    if name == "correctness":
      # A kernel that never came back from its first call (a hang) would eat
      # every later section's time limit: leave it out of sweep and timing.
      rows = (_read(folder / "correctness.json") or {}).get("rows", [])
      kernel = any(r.get("case") == "first_run" for r in rows)
    if runs[-1]["rc"] != 0:
      _timing.log(f"   section {name} ended with {runs[-1]['rc']}; stderr tail:\n{runs[-1]['stderr_tail'][-1500:]}")
  parts = {name: _read(folder / f"{name}.json") for name in args.sections}
  info = next((p["info"] for p in parts.values() if p and "info" in p), {})
  info["command"] = " ".join(["python -m experiments.check_mosaic_gpu", *argv])
  merged = {"info": info, "runs": runs, "sections": parts, "elapsed_s": round(time.perf_counter() - start, 1)}
  summary = _summary(parts)
  merged["summary"] = summary
  _timing.write_json(folder / "check_mosaic_gpu.json", merged)
  (folder / "check_mosaic_gpu.md").write_text(_markdown(info, runs, parts) + "\n" + summary + "\n")
  _timing.log("\n== summary ==\n" + summary)
  _timing.log(f"wrote {folder / 'check_mosaic_gpu.json'} and {folder / 'check_mosaic_gpu.md'} "
              f"({merged['elapsed_s']} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
