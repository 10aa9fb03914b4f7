"""A scanned model's GEMMs on one layer of a stacked weight: XLA against ``stacked_matmul``.

On the GPU (one H200, about 3 minutes), from the repository root:

    PYTHONPATH=$PWD python -m experiments.bench_stacked_matmul --out $OUT

On a CPU (seconds, the Mosaic GPU interpreter, tiny shapes):

    PYTHONPATH=$PWD python -m experiments.bench_stacked_matmul --smoke --out /tmp/sgemm

Inside ``lax.scan``, XLA copies ``W_stack[l]`` out of the stack before each GEMM (its GEMMs take
no dynamic-slice operand). For T in {1024, 4096} tokens and the Llama-3.1-8B projections
W [K, N] in {4096x4096, 4096x1024, 4096x14336, 14336x4096}, 32 layers, bf16, it times one
dispatch of all 32 layers' GEMMs, in two directions: ``forward`` ``y = x @ W[l]`` (x [T, K])
and ``transposed`` ``dX = dy @ W[l].T`` (dy [T, N]). Programs:

* ``xla_scan``: ``lax.scan`` over the layers, ``jnp.dot(x, W_stack[l])`` (the copy + GEMM);
* ``xla_unrolled``: 32 separate weight arrays, one ``jnp.dot`` each (no copy: the floor);
* ``stacked``: ``lax.scan`` over the layers, :func:`stacked_matmul` reading the stack in place;
  with several ``--config`` tilings, one row per tiling (its ``tile`` column), side by side.

Layer ``l`` of the stack is random, scaled by ``(l + 1) / L``. Each layer's output is consumed by
a sum of its absolute values (the same fused reduction in every program, so no GEMM is dead code),
carried into the next call. Device time as :mod:`experiments._timing` measures it: warm-up, many
calls back to back, one block, median of repeats. Checks: ``stacked_matmul`` against XLA at layers
0, L/2 and L-1 (max error relative to the result's largest value), and each program's sum against
``xla_scan``'s. Writes ``bench_stacked_matmul.json`` and ``.md`` under ``--out``. ``--profile``
also traces each program and splits its device time by kernel kind (XLA's copies of ``W[l]``, the
GEMMs, the sums; about a second more per program).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from experiments import _timing
from pallas_kernels.mosaic.stacked_matmul import StackedMatmulConfig, default_config, stacked_matmul

TOKENS = (1024, 4096)
SHAPES_KN = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
LAYERS = 32
DIRECTIONS = ("forward", "transposed")
IMPLS = ("xla_scan", "xla_unrolled", "stacked")
# A bf16 result may be one bf16 ulp (2**-8 relative) from another f32-accumulated one.
LAYER_TOL = 2**-7
SUM_TOL = 1e-2  # sums of |y| over all layers, between programs
PROFILE_CALLS = 2  # calls traced per program with --profile
# Smoke: 64x64 tiles on one block, so the interpreter runs the pipeline in a few seconds.
SMOKE_CONFIG = StackedMatmulConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                                   grid_tile_width=2, num_sms=1)


def _layer_dot(x, w_l, transposed: bool):
  return jnp.dot(x, w_l.T if transposed else w_l)


def config_label(cfg: StackedMatmulConfig) -> str:
  """``TMxTNxTK/STAGES``, then ``/m`` for a shared tile and ``/eN`` for chunked stores."""
  label = f"{cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k}/{cfg.max_concurrent_steps}"
  return label + (f"/{cfg.wg_split}" if cfg.wg_split else "") + (f"/e{cfg.epi_n}" if cfg.epi_n else "")


def programs(transposed: bool, cfg: StackedMatmulConfig, interpret: bool):
  """name -> jitted ``run(x, weights, acc) -> acc + sum over layers of sum(|y_l|)``."""
  absum = lambda y: jnp.sum(jnp.abs(y), dtype=jnp.float32)

  def scanned(layer_matmul):
    def run(x, w_stack, acc):
      def step(carry, _):
        total, l = carry
        return (total + absum(layer_matmul(x, w_stack, l)), l + 1), None
      return lax.scan(step, (acc, jnp.int32(0)), length=w_stack.shape[0])[0][0]
    return jax.jit(run)

  def unrolled(x, ws, acc):
    for w_l in ws:
      acc = acc + absum(_layer_dot(x, w_l, transposed))
    return acc

  kernel = functools.partial(stacked_matmul, transpose_w=transposed, config=cfg,
                             interpret=interpret)
  return {
      "xla_scan": scanned(lambda x, w, l: _layer_dot(x, w[l], transposed)),
      "xla_unrolled": jax.jit(unrolled),
      "stacked": scanned(kernel),
  }


def layer_errors(x, w_stack, transposed, cfg, interpret) -> dict:
  """``stacked_matmul`` against XLA (f32 accumulation, bf16 result) at three layers."""
  errs = {}
  for l in sorted({0, w_stack.shape[0] // 2, w_stack.shape[0] - 1}):
    want = jnp.dot(x, w_stack[l].T if transposed else w_stack[l],
                   preferred_element_type=jnp.float32)
    got = stacked_matmul(x, w_stack, l, transpose_w=transposed, config=cfg, interpret=interpret)
    errs[l] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  return errs


def bench_shape(t, k, n, *, layers, cfgs, interpret, timing, impls, profile=False) -> list[dict]:
  """Rows of every impl (``stacked`` once per tiling in ``cfgs``; ``None``: default_config's)."""
  kw, kx = jax.random.split(jax.random.key(t * 7 + k * 3 + n))
  # Layer l scaled by (l + 1) / L: a program that reads a wrong layer changes the sum of |y|.
  scale = (jnp.arange(1, layers + 1, dtype=jnp.float32) / layers * k**-0.5)[:, None, None]
  w_stack = (jax.random.normal(kw, (layers, k, n), jnp.float32) * scale).astype(jnp.bfloat16)
  rows = []
  for direction in DIRECTIONS:
    transposed = direction == "transposed"
    x = jax.random.normal(kx, (t, n if transposed else k), jnp.bfloat16)
    n_out = k if transposed else n
    base = dict(shape=f"{t}x{k}x{n}", t=t, k=k, n=n, layers=layers, direction=direction)
    flops = 2 * t * k * n * layers
    sums, first = {}, len(rows)
    runs = [(impl, None) for impl in impls if impl != "stacked"]
    runs += [("stacked", cfg) for cfg in cfgs] if "stacked" in impls else []
    for impl, cfg in runs:
      row = dict(base, impl=impl)
      if impl == "stacked":
        row["tile"] = config_label(cfg or default_config(t, n_out))
        try:
          errs = layer_errors(x, w_stack, transposed, cfg, interpret)
          row.update(layer_rel_err=errs, layer_ok=max(errs.values()) <= LAYER_TOL)
        except Exception as e:  # pylint: disable=broad-except  (recorded; still timed)
          row.update(layer_error=_timing.short_error(e), layer_ok=False)
      try:
        weights = list(w_stack) if impl == "xla_unrolled" else w_stack  # 32 separate arrays
        run = lambda acc, f=programs(transposed, cfg, interpret)[impl], w=weights: f(x, w, acc)
        # Each call adds its sum of |y| to the carry: the timed calls' mean is the check.
        t_ms, total = _timing.time_steps(run, jnp.zeros((), jnp.float32), **timing)
        abs_sum = float(total) / (timing["warmup"] + t_ms.iters * timing["repeats"])
        sums.setdefault(impl, abs_sum)
        row.update(status="ok", ms=t_ms.median_ms, min_ms=t_ms.min_ms, repeats_ms=t_ms.repeats_ms,
                   iters=t_ms.iters, per_layer_ms=t_ms.median_ms / layers,
                   tflops=flops / (t_ms.median_ms * 1e-3) / 1e12, abs_sum=abs_sum)
        if profile:  # where the device time goes: GEMMs, XLA's copies of W[l], the sums
          row["profile"] = _timing.device_profile(
              lambda: jax.block_until_ready(functools.reduce(
                  lambda acc, _: run(acc), range(PROFILE_CALLS), jnp.zeros((), jnp.float32))),
              PROFILE_CALLS, top=6)
        del weights
      except Exception as e:  # pylint: disable=broad-except  (recorded, the next one runs)
        row.update(status="error", error=_timing.short_error(e))
      rows.append(row)
      _timing.log(" ".join(f"{k_}={v}" for k_, v in row.items() if k_ != "repeats_ms"))
    ref = sums.get("xla_scan")
    for row in rows[first:]:
      if ref and row.get("status") == "ok":
        row["sum_rel_diff"] = abs(row["abs_sum"] - ref) / abs(ref)
        row["sum_ok"] = row["sum_rel_diff"] <= SUM_TOL
  return rows


def markdown(info: dict, rows: list[dict]) -> str:
  by = {(r["shape"], r.get("direction"), r.get("impl")): r for r in rows if r.get("impl") != "stacked"}
  keys = sorted({(r["t"], r["k"], r["n"], r["shape"], r["direction"]) for r in rows if "t" in r})
  ok = lambda r: r is not None and r.get("status") == "ok"
  cell = lambda r: f"{r['ms']:.3f}" if ok(r) else (r or {}).get("status", "-")
  ratio = lambda a, b: f"{a['ms'] / b['ms']:.2f}x" if ok(a) and ok(b) else "-"
  out = ["# stacked_matmul in a scan over layers, against XLA", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}; "
         f"interpret={info['interpret']}. ms per dispatch of {info['layers']} layers' GEMMs "
         "(each output summed, the same in every program); median of repeats. `tile`: "
         "TMxTNxTK/stages, `/m` where both warpgroups share a tile twice as tall, "
         "`/eN` for results stored N columns at a time.", "",
         "| T x K x N | direction | xla_scan ms | xla_unrolled ms | stacked ms | stacked tile "
         "| stacked / xla_scan | stacked / unrolled | stacked TFLOP/s | layer err | checks |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for _, _, _, shape, direction in keys:
    xs, xu = by.get((shape, direction, "xla_scan")), by.get((shape, direction, "xla_unrolled"))
    stacked = [r for r in rows if r.get("impl") == "stacked" and r["shape"] == shape
               and r.get("direction") == direction] or [None]
    for st in stacked:
      st_ = st or {}
      errs = st_.get("layer_rel_err")
      checks = ("-" if st is None else "FAILED" if not st_.get("layer_ok") or st_.get("sum_ok") is False
                else "ok" if "sum_ok" in st_ else "layers ok (no xla_scan sum)")
      tflops = f"{st_['tflops']:.0f}" if ok(st) else "-"
      out.append(f"| {shape} | {direction} | {cell(xs)} | {cell(xu)} | {cell(st)} | "
                 f"{st_.get('tile', '-')} | {ratio(st, xs)} | {ratio(st, xu)} | {tflops} | "
                 f"{f'{max(errs.values()):.1e}' if errs else '-'} | {checks} |")
  profiled = [r for r in rows if "profile" in r]
  if profiled:
    out += ["", f"Device time by kernel kind (`--profile`, ms per dispatch, {PROFILE_CALLS} "
            "dispatches traced; `copy`: XLA's copies, of `W[l]` in `xla_scan`):", "",
            "| T x K x N | direction | impl | device ms | by kind |", "|---|---|---|---|---|"]
    for r in profiled:
      p = r["profile"]
      kinds = ", ".join(f"{kind} {ms:.3f}" for kind, ms in p["by_kind"].items()) or "-"
      out.append(f"| {r['shape']} | {r['direction']} | {r['impl']} | {p['device_ms']:.3f} | {kinds} |")
  errors = [r for r in rows if r.get("status") == "error" or r.get("layer_error")]
  if errors:
    out += ["", "Errors:", ""] + [f"- {r['shape']} {r.get('direction', '')} {r.get('impl', '')}: "
                                  f"{r.get('error') or r.get('layer_error')}" for r in errors]
  return "\n".join(out) + "\n"


def _parse_kn(text: str) -> tuple[int, int]:
  k, n = text.lower().split("x")
  return int(k), int(n)


def _parse_config(text: str) -> StackedMatmulConfig:
  """``TM,TN,TK,STAGES[,SPLIT[,EPI_N]]``; SPLIT ``m`` (both warpgroups on one tile) or ``-``
  (each warpgroup its own tiles)."""
  parts = text.split(",")
  if not 4 <= len(parts) <= 6:
    raise argparse.ArgumentTypeError(f"{text!r}: expected TM,TN,TK,STAGES[,SPLIT[,EPI_N]]")
  tm, tn, tk, stages = (int(v) for v in parts[:4])
  split = parts[4] if len(parts) > 4 and parts[4] != "-" else None
  epi_n = int(parts[5]) if len(parts) > 5 else None
  return StackedMatmulConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=stages,
                             wg_split=split, epi_n=epi_n)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter (CPU)")
  parser.add_argument("--tokens", type=int, nargs="+", default=None, help=f"T values (default {TOKENS})")
  parser.add_argument("--shapes", type=_parse_kn, nargs="+", default=None, help="KxN weight shapes")
  parser.add_argument("--layers", type=int, default=None, help=f"stack depth (default {LAYERS})")
  parser.add_argument("--config", type=_parse_config, nargs="+", default=None,
                      metavar="TM,TN,TK,STAGES[,SPLIT[,EPI_N]]",
                      help="stacked_matmul tilings, each timed (default: default_config per "
                           "product); SPLIT m: both warpgroups on one tile, EPI_N: store width")
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  parser.add_argument("--iters", type=int, default=None, help="calls per repeat (default: ~20 ms)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--profile", action="store_true",
                      help="also trace each program: device ms by kernel kind (copies, GEMMs)")
  args = parser.parse_args(argv)
  argv = list(argv) if argv is not None else __import__("sys").argv[1:]

  interpret = args.smoke or jax.default_backend() == "cpu"
  if args.smoke:
    tokens, shapes, layers = args.tokens or (64,), args.shapes or [(128, 128)], args.layers or 2
    # On one block, as SMOKE_CONFIG: the interpreter runs every block of the grid.
    cfgs = [dataclasses.replace(c, num_sms=1, grid_tile_width=2) for c in args.config or [SMOKE_CONFIG]]
    timing = dict(warmup=0, iters=1, repeats=1)
  else:
    tokens, shapes, layers = args.tokens or TOKENS, args.shapes or list(SHAPES_KN), args.layers or LAYERS
    cfgs = args.config or [None]  # None: the kernel's default_config per product
    timing = dict(warmup=3, iters=args.iters, repeats=args.repeats)
  if layers < 1:
    raise ValueError(f"--layers must be >= 1; got {layers}")
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.bench_stacked_matmul", argv)
  info.update(interpret=interpret, timing=timing, layers=layers,
              configs=[dataclasses.asdict(c) if c else "default_config per product" for c in cfgs],
              layer_tol=LAYER_TOL, sum_tol=SUM_TOL)
  _timing.log(f"bench_stacked_matmul on {info['device']} (jax {info['jax']}), interpret={interpret}")
  json_path = folder / "bench_stacked_matmul.json"
  rows = _timing.run_shapes(
      json_path, info, tokens, shapes,
      lambda t, k, n: bench_shape(t, k, n, layers=layers, cfgs=cfgs, interpret=interpret,
                                  timing=timing, impls=args.impls, profile=args.profile),
      {"impl": "-", "direction": "-"})
  _timing.write_table(folder / "bench_stacked_matmul.md", markdown(info, rows), json_path)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
