"""The Mosaic kernel's main loop against GEMMs alone: is its gap to cuBLAS the tile shape?

At T=16384 the fused kernel with its epilogue's work taken out (the
``skip_compute`` diagnostic variant: main loop plus the W/state ring's TMA
traffic) took 0.794 ms where cuBLAS's GEMM alone takes 0.734 (bf16 AdamW,
4096x4096; ``results/h200/mosaic_profile_diagnose/``). Our reading, not yet
measured: the ping-pong schedule gives each warpgroup its own 128x128 tile,
so per k-step the SM reads a 64x128 block of ``x`` and one of ``dy`` (32 KiB)
for 2 MFLOP, 64 FLOP per byte of L2 traffic; jax's Hopper GEMM
(``hopper_matmul_mgpu``, which beat cuBLAS in ``../shared/FINDINGS.md``)
puts both warpgroups on one 128x256 tile: 85 FLOP per byte. Per implementation,
on the same bf16 ``x [T, K]`` and ``dy [T, N]``, side by side:

* ``xla_gemm``: ``jnp.dot(x.T, dy)`` with float32 output (cuBLAS);
* ``xla_optax``: that GEMM + optax's update in one donated jit (issue #4's baseline,
  checked against the reference);
* ``mgpu_gemm``: ``hopper_matmul_mgpu`` on ``x.T`` (transposed once, outside
  the timed call) and ``dy``, bf16 output, its best config of FINDINGS: 128x128
  per warpgroup, both on one 128x256 tile, 4 stages;
* ``mgpu_gemm_m``: the same with the warpgroups stacked along M (128x128 tile
  per block, 64x128 per warpgroup: our kernel's L2 traffic per FLOP);
* ``mgpu_gemm_cluster``: 128x256 tiles in clusters of two along M, each
  ``dy`` block multicast to both (the traffic per FLOP of a 256x256 tile);
* ``mosaic_main_loop``: the fused kernel's default tiling, ``skip_compute``
  (no epilogue reads or arithmetic, and one write per row band of a tile that
  keeps the MMAs: its results are not checked). Before session 17 it had no
  use of the accumulator at all, and ptxas dropped every wgmma as dead code
  (Nsight Compute read its tensor pipe idle: results/h200/ncu/): the
  ``mosaic_main_loop`` rows of earlier results (mosaic_cluster, mosaic_ring_1024,
  mosaic_stream, mosaic_profile_diagnose and others) timed the x/dy and W/state
  data movement without the GEMM;
* ``mosaic_stream``: the fused kernel as ``skip_mainloop`` (ping-pong only): no
  main loop and no x/dy loads, the whole epilogue on a zero accumulator, i.e.
  the W/state stream through the ring alone (results not checked);
* ``mosaic_copy``: ``skip_mainloop`` with ``skip_compute``: the ring's TMA round
  trip alone (each sub-tile loaded into its slot and stored back as loaded, nothing
  read into registers; W and the states come back unchanged, not checked);
* ``xla_stream``: XLA's in-place rule on a zero gradient (the rule of ``mosaic_stream``
  on the same bytes, one donated jit, not checked): what device memory gives an
  elementwise pass over W and the states outside our kernel;
* ``mosaic``: the fused kernel as it is (checked against the reference).

``--optimizer`` picks the rule of the ``mosaic*`` and ``xla_optax`` rows (AdamW by default;
``sgd``, plain SGD, streams W alone: how much of the main loop's gap the W/state stream is).

``--configs`` adds, per entry ``i`` (MosaicTileConfig field overrides of the
default tiling), a row ``name@i`` for each ``mosaic*`` row asked for: e.g. how
fast the W/state ring alone streams (``skip_compute`` at T=1024, where that
stream, not the epilogue's arithmetic, bounds the kernel) with more ring slots
or L2 prefetch. An entry that does not fit a shape is an error row naming why.

If ``mgpu_gemm_m`` is as slow as ``mosaic_main_loop`` and ``mgpu_gemm`` /
``mgpu_gemm_cluster`` as fast as cuBLAS, the tile's L2 traffic is the gap, and
the fix is a wider tile per block (clusters with multicast of ``x``, since one
warpgroup cannot hold a 128x256 accumulator next to the epilogue).

Measured on the H200 (2026-11-30, results/h200/mosaic_cluster/, bf16, T=16384,
4096x4096): ``xla_gemm`` 0.719 ms, ``mgpu_gemm`` 0.716, ``mgpu_gemm_m`` 0.770
(our tile size costs the plain GEMM 7%), ``mgpu_gemm_cluster`` 0.704;
``mosaic_main_loop`` 0.876, with ``cluster_n=2`` 0.734; ``mosaic`` 0.795, with
``cluster_n=2`` 0.790. The clusters recover the stream but not the kernel.
(Those ``mosaic_main_loop`` rows ran without MMAs, see above: 0.876 ms is x/dy and
W/state data movement alone, which took longer than the whole kernel.)
With the MMAs live (2026-12-01, results/h200/mma_live/ and rules/), the main loop with the
ring's traffic takes as long as the kernel (bf16 AdamW 0.232 / 0.231 ms at T=4096), and with
plain SGD's W-only stream it takes ``mgpu_gemm_m``'s time (0.198 against 0.197): the W/state
stream, not the tile, is the main loop's gap to the GEMM; each bf16 state adds about 0.02 ms.

    PYTHONPATH=$PWD python -m experiments.main_loop --out $OUT            # GPU (~2 min)
    PYTHONPATH=$PWD python -m experiments.main_loop --tokens 16384 4096 --shapes 4096x4096
    PYTHONPATH=$PWD python -m experiments.main_loop --tokens 1024 --impls xla_gemm mosaic_main_loop \
        --configs '[{"epi_slots": 3, "max_concurrent_steps": 3}, {"l2_prefetch_steps": 8}]'

Writes ``main_loop.json`` and ``main_loop.md``. Timing as in
``experiments.bench_fused_dw`` (warm-up, 30 back-to-back calls blocked once,
median of 3). The ``mgpu_gemm*`` rows need a Hopper GPU; a config this jax's
``hopper_matmul_mgpu`` does not take is an error row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import forge_jax

from experiments import _timing
from experiments import bench_fused_dw as bench
from experiments import check_mosaic_gpu
from experiments import l2_hints as l2_hint_ctx
from pallas_kernels import fused_dw
from pallas_kernels import fused_dw_mosaic as fm
from pallas_kernels import numerics

TOKENS = (16384, 4096, 1024)
SHAPES_KN = ((4096, 4096),)
OPTIMIZER = "adamw"  # the default of --optimizer
# bench_fused_dw's rules and plain SGD: W alone, no state (the smallest W/state stream).
OPTIMIZERS = dict(bench.OPTIMIZERS, sgd=(forge_jax.sgd, optax.sgd, dict(learning_rate=1e-2)))
# hopper_matmul_mgpu.TuningConfig fields per implementation (FINDINGS: 128x128x64, 4 stages,
# grid_tile_width 8 were its best on the H200). wg_dimension / cluster_dimension are
# MatmulDimension names, resolved against the installed module.
MGPU_CONFIGS = {
    "mgpu_gemm": dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_tile_width=8,
                      wg_dimension="N"),
    "mgpu_gemm_m": dict(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_tile_width=8,
                        wg_dimension="M"),
    "mgpu_gemm_cluster": dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_tile_width=8,
                              wg_dimension="N", cluster_dimension="M"),
}
IMPLS = ("xla_gemm", "xla_optax", *MGPU_CONFIGS, "xla_stream", "mosaic_main_loop", "mosaic_stream", "mosaic_copy",
         "mosaic")
_MOSAIC_IMPLS = ("mosaic_main_loop", "mosaic_stream", "mosaic_copy", "mosaic")  # rows --configs repeats
_NEEDS_PINGPONG = ("mosaic_stream", "mosaic_copy")  # skip_mainloop: not in --smoke's cooperative tiling


def mgpu_tuning_config(fields: dict) -> Any:
  """``hopper_matmul_mgpu.TuningConfig`` from ``fields`` (dimension names resolved)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top

  fields = dict(fields)
  for key in ("wg_dimension", "cluster_dimension"):
    if key in fields:
      fields[key] = hm.MatmulDimension[fields[key]]
  return hm.TuningConfig(**fields)


def build_mgpu_gemm(fields: dict):
  """A builder: ``hopper_matmul_mgpu.matmul(x.T, dy)`` (x transposed once, untimed)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top

  def build(p: bench.Problem) -> bench.Runner:
    config = mgpu_tuning_config(fields)
    xt = jnp.copy(p.x.T)  # a real [K, T] buffer
    gemm = jax.jit(lambda a, b: hm.matmul(a, b, None, config))
    return bench.Runner(init=lambda: jnp.zeros((), jnp.float32), step=lambda _: gemm(xt, p.dy),
                        result=None)

  return build


def resolve_config(x, dy, w, slots, *, interpret: bool, overrides: Optional[dict] = None):
  """The tiling a ``mosaic*`` row runs: the default for these operands (under the interpreter,
  ``check_mosaic_gpu.smoke_tiling``) with ``overrides`` (``--configs``) replaced; one that does
  not fit raises, naming why."""
  base = check_mosaic_gpu.smoke_tiling() if interpret else fm.default_config(x, dy, w, slots)
  config = dataclasses.replace(base, **(overrides or {}))
  ok, why = fm.supports(x, dy, w, slots, config)
  if not ok:
    raise ValueError(f"config {overrides} does not fit {x.shape[0]}x{w.shape[-2]}x{w.shape[-1]}: {why}")
  return config


def _mosaic_call(x, dy, w, slots, scalars, update_fn, *, interpret=False, variants=(), overrides=None):
  config = resolve_config(x, dy, w, slots, interpret=interpret, overrides=overrides)
  with fm.diagnosing(*variants):  # read while tracing, i.e. inside the first call of a new jit
    return fm.fused_dw_update_mosaic(x, dy, w, slots, scalars, update_fn, config=config,
                                     interpret=interpret)


def build_diagnostic(p: bench.Problem, variants: tuple[str, ...],
                     overrides: Optional[dict] = None) -> bench.Runner:
  """The fused kernel as the diagnostic ``variants`` (fused_dw_mosaic.DIAGNOSE_VARIANTS); its
  results compute something else on purpose, so they are not checked."""
  call = functools.partial(_mosaic_call, variants=variants, overrides=overrides)
  return bench.fused_builder(call)(p)._replace(result=None)


# skip_compute: main loop + ring traffic; skip_mainloop: the W/state stream alone; both: the
# ring's TMA round trip alone.
build_main_loop = functools.partial(build_diagnostic, variants=("skip_compute",))
build_stream = functools.partial(build_diagnostic, variants=("skip_mainloop",))
build_copy = functools.partial(build_diagnostic, variants=("skip_mainloop", "skip_compute"))


def _xla_stream_call(x, dy, w, slots, scalars, update_fn, *, interpret=False):
  """The rule on a zero gradient in XLA (``fused_dw_update``'s signature; x and dy unused
  beyond the zero, which XLA cannot fold away: fused_dw.zero_after)."""
  del dy, interpret
  g = jnp.broadcast_to(fused_dw.zero_after(x), w.shape)
  w32, s32 = w.astype(jnp.float32), tuple(s.astype(jnp.float32) for s in slots)
  u, new = update_fn(g, w32, s32, scalars)
  return (numerics.store_cast(w32 + u, w.dtype),
          tuple(numerics.store_cast(n, s.dtype) for n, s in zip(new, slots)), None)


def build_xla_stream(p: bench.Problem) -> bench.Runner:
  return bench.fused_builder(_xla_stream_call)(p)._replace(result=None)


def implementations(configs: Sequence[dict] = ()) -> dict:
  """name -> builder; per ``--configs`` entry ``i``, ``name@i`` for each ``mosaic*`` row."""
  impls = {"xla_gemm": bench.build_xla_gemm, "xla_optax": bench.build_xla_optax,
           "xla_stream": build_xla_stream,
           "mosaic_main_loop": build_main_loop, "mosaic_stream": build_stream,
           "mosaic_copy": build_copy, "mosaic": bench.fused_builder(_mosaic_call)}
  impls.update({name: build_mgpu_gemm(fields) for name, fields in MGPU_CONFIGS.items()})
  for i, overrides in enumerate(configs):
    impls[f"mosaic_main_loop@{i}"] = functools.partial(build_main_loop, overrides=overrides)
    impls[f"mosaic_stream@{i}"] = functools.partial(build_stream, overrides=overrides)
    impls[f"mosaic_copy@{i}"] = functools.partial(build_copy, overrides=overrides)
    impls[f"mosaic@{i}"] = bench.fused_builder(functools.partial(_mosaic_call, overrides=overrides))
  return impls


def _overrides(impl: str, configs: Sequence[dict]) -> Optional[dict]:
  return configs[int(impl.split("@")[1])] if "@" in impl else None


def bench_shape(t: int, k: int, n: int, impls: Sequence[str], *, interpret: bool, timing: dict,
                state_dtype, configs: Sequence[dict] = (), optimizer: str = OPTIMIZER,
                l2_hints: Optional[dict] = None) -> list[dict]:
  """``l2_hints``: ``experiments.l2_hints.hints`` arguments for the ``mosaic*`` rows (each
  compiled and timed inside them), or None."""
  x, dy, w0 = bench.make_inputs(t, k, n, state_dtype=state_dtype)
  p = bench.make_problem(x, dy, w0, optimizer, interpret, OPTIMIZERS)
  reference = bench.reference_step(p)
  builders = implementations(configs)
  # W and the states, read once and written once: what every row but the GEMMs moves.
  state_bytes = 2 * sum(a.nbytes for a in (p.w0, *p.rule.init_slots(p.w0)))
  rows = []
  for impl in impls:
    hinted = impl.startswith("mosaic") and l2_hints
    with (l2_hint_ctx.hints(**l2_hints) if hinted else contextlib.nullcontext()):
      row = bench.measure(impl, builders[impl], p, reference, timing)
    row["state_bytes"] = state_bytes
    if impl.startswith("mosaic"):
      try:
        used = resolve_config(p.x, p.dy, p.w0, p.rule.init_slots(p.w0), interpret=interpret,
                              overrides=_overrides(impl, configs))
        row["config"] = check_mosaic_gpu.cfg_text(used)
      except ValueError:
        pass  # the row's error says why
    rows.append(row)
    _timing.log(f"  {p.name:>18} {impl:<18} {bench._cell(row)}")  # pylint: disable=protected-access
  return rows


def markdown(info: dict, rows: list[dict], impls: Sequence[str]) -> str:
  out = [
      "# The Mosaic kernel's main loop against GEMMs alone", "",
      f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}. "
      f"{info.get('optimizer', OPTIMIZER)}, bf16 x/dy, "
      f"{info['state_dtype']} w/slots (`mosaic*` rows); `mgpu_gemm*` write bf16, `xla_gemm` float32.", "",
      f"Each cell: median ms per call ({info['timing']['iters']} back-to-back calls blocked once, median of "
      f"{info['timing']['repeats']}), TFLOP/s at 2TKN; "
      "`vs xla_gemm`: the GEMM's time / this row's; `W/state TB/s`: W and the states read and "
      "written once (2 x their bytes) / this row's time (for the GEMM rows, which move none of "
      "them, a scale only).", "",
  ]
  if info.get("l2_hints"):
    out += [f"L2 policies on the `mosaic*` rows' TMA copies (experiments.l2_hints): "
            f"{json.dumps(info['l2_hints'])}", ""]
  if info.get("configs"):
    out += ["`@i`: the default tiling with `--configs` entry i replaced: "
            + "; ".join(f"{i}: `{json.dumps(c)}`" for i, c in enumerate(info["configs"])), ""]
  out += ["| T x K x N | impl | config | status | ms | TF/s | vs xla_gemm | W/state TB/s |",
          "|---|---|---|---|---|---|---|---|"]
  by_shape: dict[str, dict[str, dict]] = {}
  for row in rows:
    by_shape.setdefault(row["shape"], {})[row["impl"]] = row
  for shape, by_impl in by_shape.items():
    base = by_impl.get("xla_gemm", {})
    for impl in impls:
      row = by_impl.get(impl)
      if row is None:
        continue
      cfg = row.get("config", "")
      if "ms" not in row:
        out.append(f"| {shape} | {impl} | {cfg} | {row['status']}: {row.get('error', '')[:160]} | - | - | - | - |")
        continue
      ratio = f"{base['ms'] / row['ms']:.2f}x" if "ms" in base else "-"
      tbs = f"{row['state_bytes'] / (row['ms'] * 1e-3) / 1e12:.2f}" if "state_bytes" in row else "-"
      out.append(f"| {shape} | {impl} | {cfg} | {row['status']} | {row['ms']:.3f} | {row['tflops']:.0f} | "
                 f"{ratio} | {tbs} |")
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--tokens", type=int, nargs="+", default=None,
                      help=f"default {' '.join(map(str, TOKENS))} (--smoke: 128)")
  parser.add_argument("--shapes", nargs="+", default=None, metavar="KxN",
                      help=f"default {' '.join(f'{k}x{n}' for k, n in SHAPES_KN)} (--smoke: 128x256)")
  parser.add_argument("--impls", nargs="+", default=None, choices=list(IMPLS),
                      help="default: all (--smoke: those a CPU runs)")
  parser.add_argument("--state-dtype", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--configs", default=None, metavar="JSON",
                      help="a JSON list of MosaicTileConfig field overrides; each adds a row "
                           "name@i per mosaic* row asked for, e.g. '[{\"epi_slots\": 3}]'")
  parser.add_argument("--optimizer", default=OPTIMIZER, choices=list(OPTIMIZERS),
                      help="the rule of the mosaic*/xla_optax rows (sgd: W only, no state)")
  parser.add_argument("--l2-store-hint", default=None, choices=l2_hint_ctx.POLICIES,
                      help="an L2 policy on every TMA store of the mosaic* rows (experiments.l2_hints)")
  parser.add_argument("--l2-load-hint", default=None, choices=l2_hint_ctx.POLICIES,
                      help="an L2 policy on every TMA load of the mosaic* rows")
  parser.add_argument("--smoke", action="store_true",
                      help="CPU: the interpreter, tiny shapes, 2 calls (the mgpu rows need a GPU)")
  args = parser.parse_args(argv)
  tokens = args.tokens or ([128] if args.smoke else list(TOKENS))
  shapes = ([bench._parse_kn(s) for s in args.shapes] if args.shapes  # pylint: disable=protected-access
            else [(128, 256)] if args.smoke else list(SHAPES_KN))
  # (--smoke's tiling is cooperative: no skip_mainloop rows there, which need ping-pong)
  impls = args.impls or [i for i in IMPLS
                         if not (args.smoke and (i.startswith("mgpu") or i in _NEEDS_PINGPONG))]
  try:
    configs = json.loads(args.configs) if args.configs else []
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
      raise ValueError("not a list of objects")
    for c in configs:
      fm.MosaicTileConfig(**c)  # unknown fields fail here, before any device work
  except (ValueError, TypeError) as e:
    parser.error(f"--configs must be a JSON list of MosaicTileConfig field overrides; got "
                 f"{args.configs!r} ({e})")
  impls = impls + [f"{name}@{i}" for i in range(len(configs)) for name in _MOSAIC_IMPLS if name in impls]
  interpret = args.smoke or jax.default_backend() == "cpu"
  timing = dict(warmup=1, iters=2, repeats=1) if args.smoke else dict(warmup=3, iters=30, repeats=3)
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.main_loop", argv)
  hints = ({"store": args.l2_store_hint, "load": args.l2_load_hint}
           if args.l2_store_hint or args.l2_load_hint else None)
  info.update(state_dtype=args.state_dtype, timing=timing, interpret=interpret, configs=configs,
              optimizer=args.optimizer, l2_hints=hints)
  state_dtype = jnp.dtype(args.state_dtype)
  json_path = folder / "main_loop.json"
  rows = _timing.run_shapes(
      json_path, info, tokens, shapes,
      lambda t, k, n: bench_shape(t, k, n, impls, interpret=interpret, timing=timing,
                                  state_dtype=state_dtype, configs=configs, optimizer=args.optimizer,
                                  l2_hints=hints),
      {"impl": "-", "optimizer": args.optimizer})
  _timing.write_table(folder / "main_loop.md", markdown(info, rows, impls), json_path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
