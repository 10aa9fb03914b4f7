"""GPU correctness check of the Mosaic GPU kernel (pallas_kernels/mosaic) against the reference.

Every forge_jax rule with float32 and bfloat16 weights and states, mixed states, int8 states
(round-to-nearest and stochastic maps), stochastically rounded bfloat16 weights, stacked weights
with the grad norm, small grids (64-row tiles), a shape only the fallback tiling takes, the
Llama-3.1-8B projection shapes, and odd shapes that the kernel must refuse with a reason. Each
case runs at the tiling users get (``default_config``) against ``fused_dw_update_reference``.
Exits 1 if any case fails or errors, so a script can gate on it.

On one H200, from the repository root (``--quick``: a few minutes; without it, longer):

    PYTHONPATH=$PWD python -m experiments.check_mosaic_gpu --quick --out $OUT

On a CPU (Mosaic GPU interpreter, tiny shapes and small tiles):

    PYTHONPATH=$PWD python -m experiments.check_mosaic_gpu --smoke --quick --out /tmp/check

Writes ``check_mosaic_gpu.json`` (after every case) and ``check_mosaic_gpu.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any, Optional, Sequence

LLAMA_8B_KN = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
ODD_SHAPES = ((4096, 4096, 4100), (4000, 4096, 4096), (4096, 4095, 4096), (1000, 1000, 3000))
QUICK_T, FULL_T = 1024, 4096
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


def cases(quick: bool, smoke: bool) -> list[tuple]:
  """``(label, rule, (t, k, n), w dtype, slot dtype, layers)``, most informative first."""
  t = QUICK_T if quick else FULL_T
  big, stacked = ((128, 64, 192), (128, 64, 128)) if smoke else ((t, 4096, 4096), (t, 4096, 4096))
  small_grid = (128, 64, 128) if smoke else (t, 1024, 1024)
  few_tiles = (128, 64, 128) if smoke else (t, 4096, 1024)  # int8: 64x128 tiles at short T
  fallback = (128, 64, 192) if smoke else (t, 1088, 1344)  # K, N multiples of 64, not of 128
  out = [("first_run", "adamw", big, "float32", "float32", None),
         ("stacked_norm", "adamw", stacked, "bfloat16", "bfloat16", 3),
         ("small_grid", "adamw", small_grid, "bfloat16", "bfloat16", None),
         ("fallback_tiling", "adamw", fallback, "float32", "float32", None),
         ("mixed", "adamw", big, "float32", "bfloat16", None),
         ("int8", "adamw", big, "float32", "int8", None),
         ("int8", "lion", big, "bfloat16", "int8", None),
         ("int8_sr", "adamw", big, "bfloat16", "int8_sr", None),
         ("int8_sr_few_tiles", "adamw", few_tiles, "bfloat16", "int8_sr", None),
         ("sr", "adamw", big, "bfloat16", "bfloat16", None),
         ("sr_stacked", "adamw", stacked, "bfloat16", "bfloat16", 3)]
  out += [("rule", name, big, dt, dt, None) for dt in ("float32", "bfloat16") for name in _rules()]
  if quick and not smoke:  # int8 states' long-T tiling (the loop on rotated slices)
    out.append(("int8_sr_long_t", "adamw", (FULL_T, 4096, 4096), "bfloat16", "int8_sr", None))
  if not quick and not smoke:
    out += [("llama_8b", "adamw", (t, k, n), w, s, None) for k, n in LLAMA_8B_KN
            for w, s in (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"))]
  return out


def smoke_tiling(slot_dtype: str):
  """The tiling of --smoke runs under the interpreter: one block of small tiles (132 simulated
  blocks take minutes); int8 sub-tiles are one 64-value block wide."""
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top

  int8 = slot_dtype.startswith("int8")
  return mosaic.MosaicTileConfig(tile_m=64, tile_n=64, max_concurrent_steps=2,
                                 epi_n=64 if int8 else 16, num_sms=1)


def check_case(label, name, shape, w_dt, s_dt, layers, *, smoke: bool) -> dict[str, Any]:
  """One case: the kernel (jitted, first call timed) against the reference."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_update_reference, mosaic  # pylint: disable=g-import-not-at-top

  t, k, n = shape
  row: dict[str, Any] = {"case": label, "rule": name, "shape": f"{t}x{k}x{n}", "w_dtype": w_dt,
                         "slot_dtype": s_dt, "layers": layers}
  norm = layers is not None
  rule = _rules()[name].rule
  x, dy, w, slots = _inputs(t, k, n, rule, jnp.dtype(w_dt), _slot_dtype(s_dt), layers=layers)
  layer = None if layers is None else jnp.int32(layers - 2)
  cfg = smoke_tiling(s_dt) if smoke else mosaic.default_config(x, dy, w, slots,
                                                               compute_grad_sq_norm=norm)
  row["config"] = cfg_text(cfg)
  rounding = _rounding(label, s_dt)
  codec = rounding.get("weight_codec")  # static; the seed and step are traced
  scalars = rule.scalars(jnp.int32(9))
  kernel = jax.jit(lambda *a, **kw: mosaic.fused_dw_update_mosaic(
      *a, rule.update, config=cfg, compute_grad_sq_norm=norm, interpret=smoke, weight_codec=codec,
      **kw))
  traced = {key: v for key, v in rounding.items() if key != "weight_codec"}
  start = time.perf_counter()
  new_w, new_slots, g2 = jax.block_until_ready(kernel(x, dy, w, slots, scalars, layer=layer,
                                                      **traced))
  row["first_call_s"] = round(time.perf_counter() - start, 2)
  ref_w, ref_slots, ref_g2 = fused_dw_update_reference(
      x, dy, w, slots, scalars, rule.update, layer=layer, compute_grad_sq_norm=norm, **rounding)
  untouched = True
  if layers is not None:  # the other layers must be untouched, bit for bit
    others = jnp.array([i for i in range(layers) if i != layers - 2])
    untouched = bool(jnp.array_equal(new_w[others], w[others]))
    pick = lambda tree: jax.tree.map(lambda a: a[layers - 2], tree)
    new_w, ref_w, w, new_slots, ref_slots = map(pick, (new_w, ref_w, w, new_slots, ref_slots))
  row.update(_errors(new_w, new_slots, w, ref_w, ref_slots))
  row["ok"] = row["ok"] and untouched
  if "weight_codec" in rounding:  # the same hashed bits: most rounded weights identical
    row["sr_same_bits"] = float(jnp.mean(new_w == ref_w))
    row["ok"] = row["ok"] and row["sr_same_bits"] >= 0.99
  if norm:
    row["err_norm"] = abs(float(g2) - float(ref_g2)) / max(abs(float(ref_g2)), 1e-30)
    row["ok"] = row["ok"] and row["err_norm"] <= 1e-4
  row["status"] = "ok" if row["ok"] else "check_failed"
  return row


def odd_shape_rows() -> list[dict[str, Any]]:
  """Shapes the kernel must refuse, with a reason (``fused_linear_update`` then falls back)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top

  rows = []
  for t, k, n in ODD_SHAPES:
    sds = jax.ShapeDtypeStruct
    w = sds((k, n), jnp.float32)
    ok, why = mosaic.supports(sds((t, k), jnp.bfloat16), sds((t, n), jnp.bfloat16), w, (w, w))
    rows.append({"case": "odd_shape", "rule": "adamw", "shape": f"{t}x{k}x{n}", "reason": why,
                 "status": "ok" if not ok and why else "unexpected_support"})
  return rows


def cfg_text(cfg) -> str:
  """The fields of ``cfg`` that differ from MosaicTileConfig's defaults (``default`` if none)."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  changed = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
             if getattr(cfg, f.name) != f.default]
  return ", ".join(changed) or "default"


def markdown(info: dict, rows: list[dict]) -> str:
  failed = [r for r in rows if r["status"] != "ok"]
  lines = [f"# Mosaic GPU kernel vs reference: {len(rows) - len(failed)}/{len(rows)} ok", "",
           f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
           "| case | rule | T x K x N | w / states | tiling | status | errors |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    detail = r.get("error") or r.get("reason") or _err_text(r)
    lines.append(f"| {r['case']} | {r['rule']} | {r['shape']} | {r.get('w_dtype', '-')} / "
                 f"{r.get('slot_dtype', '-')} | {r.get('config', '-')} | {r['status']} | {detail} |")
  return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--quick", action="store_true",
                      help=f"T={QUICK_T} (one int8 case at T={FULL_T}) and no Llama-3.1-8B shapes "
                           "(a few minutes on an H200)")
  parser.add_argument("--smoke", action="store_true", help="CPU: interpreter, tiny shapes")
  parser.add_argument("--cases", nargs="+", default=None, metavar="LABEL",
                      help="run only the cases with these labels (e.g. rule int8 sr)")
  args = parser.parse_args(argv)
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.check_mosaic_gpu", argv)
  rows: list[dict[str, Any]] = []
  save = lambda: _timing.write_json(folder / "check_mosaic_gpu.json", {"info": info, "rows": rows})
  for case in cases(args.quick, args.smoke):
    label, name, shape, w_dt, s_dt, layers = case
    if args.cases and label not in args.cases:
      continue
    try:
      row = check_case(*case, smoke=args.smoke)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the exit code says it)
      row = {"case": label, "rule": name, "shape": "x".join(map(str, shape)), "w_dtype": w_dt,
             "slot_dtype": s_dt, "status": "error", "error": _timing.short_error(e)}
    rows.append(row)
    save()
    _timing.log(f"  {label:<16} {name:<26} {row['shape']:>16} {w_dt}/{s_dt} "
                f"[{row.get('config', '-')}]: {row['status']} {row.get('error', _err_text(row))}")
    gc.collect()
  if not args.cases or "odd_shape" in args.cases:
    rows += odd_shape_rows()
  save()
  (folder / "check_mosaic_gpu.md").write_text(markdown(info, rows))
  failed = [r for r in rows if r["status"] != "ok"]
  _timing.log(f"{len(rows) - len(failed)}/{len(rows)} ok; wrote {folder / 'check_mosaic_gpu.md'}")
  return 1 if failed or not rows else 0


if __name__ == "__main__":
  sys.exit(main())
