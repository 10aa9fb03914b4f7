"""Where the Mosaic kernel's time goes: Mosaic GPU's in-kernel profiler on one call (H200).

``pallas_kernels.fused_dw_mosaic`` marks its ping-pong schedule with named
regions: ``mainloop`` and ``epilogue`` per warpgroup tile, and inside the
epilogue, per sub-tile, ``epi_wait`` (the ring slot's TMA load),
``epi_load`` (issuing the shared-memory reads of W and the states; a read's
latency may show in ``epi_math``, where its value is first used; the first
H200 profile, results/h200/mosaic_profile/, had both in ``epi_math``),
``epi_decode`` (the values read converted to float32, int8 codes decoded;
with ``epi_read_ahead`` the reads are of the next sub-tile),
``epi_math`` (the rule's arithmetic), ``epi_write`` (results back
to shared memory), ``epi_store`` (fence + TMA stores + L2 lookahead),
``epi_store_read`` (waiting until the store has read the slot) and
``epi_refill`` (issuing the next load). With ``fused_dw_mosaic._PROFILE``
set, Mosaic GPU's profiler times every region on every warpgroup and writes a
Chrome trace per call. This script runs each problem once unprofiled (timed
the benchmarks' way: warm-up, back-to-back calls, median) and once profiled,
then sums each region over the warpgroups: mean microseconds per occurrence,
per tile, and its share of the warpgroups' busy time. The T=64 problem is
the sweep's epilogue probe (one token step: the time is the epilogue's).

    PYTHONPATH=$PWD python -m experiments.profile_mosaic --out $OUT/profile
    PYTHONPATH=$PWD python -m experiments.profile_mosaic --problems 1024x4096x4096 \\
        --config-json '{"schedule": "pingpong", "max_concurrent_steps": 3, "epi_n": 32}'
    PYTHONPATH=$PWD python -m experiments.profile_mosaic --problems 1024x4096x4096 \\
        --storage bf16_rtn_bf16 bf16_sr_bf16 fp32_int8    # low-precision epilogues
    PYTHONPATH=$PWD python -m experiments.profile_mosaic --problems 1024x4096x4096 \\
        --diagnose skip_reads skip_rule skip_compute    # + epilogues without reads / rule / both

``--diagnose`` adds diagnostic variants of the epilogue
(``fused_dw_mosaic._DIAGNOSE``): ``skip_reads`` (W and states taken as 1.0, not
read from shared memory), ``skip_rule`` (no optimizer arithmetic) and
``skip_compute`` (no reads, arithmetic or writes: the main loop and the
epilogue's TMA traffic only). Their results are not the optimizer step; their
region times and unprofiled times say how much of the epilogue is the reads'
latency, the rule, and the data movement that no epilogue can avoid.

``--storage`` names ``experiments.bench_lowp.CONFIGS`` (weight dtype and
``forge_jax.Precision``); the call goes through ``fused_linear_update`` with
``backend="mosaic"``, as in a model.

Writes ``profile_mosaic.json`` and ``profile_mosaic.md`` plus one gzipped raw
trace per problem under ``traces/`` (``--no-traces``: none). The device tool
returns at most 8 files of 16 MiB: an uncompressed trace of a 4096^2 call can
be bigger than that. GPU only (the profiler has no
interpreter); ``summarize_trace`` is tested on CPU with a synthetic trace.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import shutil
import sys
from typing import Any, Optional, Sequence

PROBLEMS = ("64x4096x4096", "1024x4096x4096", "4096x4096x4096")
# Ranges per warpgroup the profiler can hold. It keeps them in shared memory
# (16 bytes a range, for each of the block's 3 warpgroups) next to the
# kernel's own ~176-221 KiB, under the 227 KiB limit: 512 ranges take 24 KiB.
# Enough for 2 (main loop, epilogue) + 8 per sub-tile on each of the ~4
# tiles a warpgroup gets at 4096^2 (128x128 tiles, 132 SMs): 520 with 64x16
# sub-tiles (just over: profile those at T=64 only), 264 with 64x32. Too
# small a space fails the trace dump loudly.
PROFILE_SPACE = 512


def summarize_trace(trace: dict) -> dict[str, Any]:
  """Per-region totals of a Mosaic GPU profiler trace (Chrome ``B``/``E`` events).

  Returns ``{"regions": {name: {"count", "total_us", "mean_us"}}, "tracks": n,
  "busy_us": total over tracks of (last - first event), "span_us": the
  longest track}``. Nested regions are counted in full in each level, so
  ``epilogue`` includes its ``epi_*`` children.
  """
  stacks: dict[tuple, list] = collections.defaultdict(list)
  first: dict[tuple, float] = {}
  last: dict[tuple, float] = {}
  totals: dict[str, list[float]] = collections.defaultdict(list)
  for ev in trace.get("traceEvents", []):
    track = (ev.get("pid"), ev.get("tid"))
    ts = float(ev["ts"])
    first[track] = min(first.get(track, ts), ts)
    last[track] = max(last.get(track, ts), ts)
    if ev["ph"] == "B":
      stacks[track].append((ev["name"], ts))
    elif ev["ph"] == "E":
      if not stacks[track]:
        continue  # an end without its begin (trace cut short)
      name, start = stacks[track].pop()
      totals[name].append(ts - start)
  regions = {
      name: {"count": len(d), "total_us": sum(d), "mean_us": sum(d) / len(d)}
      for name, d in sorted(totals.items())
  }
  spans = [last[t] - first[t] for t in first]
  return {"regions": regions, "tracks": len(first), "busy_us": sum(spans),
          "span_us": max(spans) if spans else 0.0}


def _problem(spec: str, storage: str = "fp32"):
  """``(x, dy, w, state, optimizer)``: AdamW (lr 1e-3, weight decay 0.1) with the weight dtype and
  ``forge_jax.Precision`` of ``experiments.bench_lowp.CONFIGS[storage]``."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import bench_lowp  # pylint: disable=g-import-not-at-top

  t, k, n = (int(v) for v in spec.split("x"))
  w_dtype, precision = bench_lowp.CONFIGS[storage]
  opt = bench_lowp._optimizer(precision)
  kx, kd, kw = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (t, n), jnp.float32).astype(jnp.bfloat16)
  w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(w_dtype)
  return x, dy, w, opt.init(w), opt


def profiled_default_config(x, dy, w, slots):
  """The default tiling for these operands that leaves room for the profiler's
  ranges in shared memory (PROFILE_SPACE x 16 bytes x 3 warpgroups): the
  defaults fill up to the kernel's budget, so e.g. fp32 AdamW profiles with
  one stage fewer than it runs with (the region times per tile still say
  where the epilogue goes; the main loop may be slower)."""
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  saved = fm._SMEM_BUDGET_BYTES
  fm._SMEM_BUDGET_BYTES = saved - PROFILE_SPACE * 16 * 3
  try:
    return fm.default_config(x, dy, w, slots)
  finally:
    fm._SMEM_BUDGET_BYTES = saved


def profile_problem(spec: str, config: Optional[dict], trace_dir: pathlib.Path,
                    storage: str = "fp32", variant: str = "") -> dict[str, Any]:
  """One problem profiled; ``variant``: one of ``fused_dw_mosaic.DIAGNOSE_VARIANTS``
  (a diagnostic epilogue that computes something else, to split its time), or "" for
  the real kernel."""
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  with fm.diagnosing(*([variant] if variant else [])):
    row = _profile_problem(spec, config, trace_dir, storage)
  return dict(row, variant=variant or "kernel")


def _profile_problem(spec: str, config: Optional[dict], trace_dir: pathlib.Path,
                     storage: str) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import forge_jax  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  from experiments import bench_lowp  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  x, dy, w, state, opt = _problem(spec, storage)
  slots = tuple(state[1:])
  cfg = fm.MosaicTileConfig(**config) if config else profiled_default_config(x, dy, w, slots)
  ok, why = fm.supports(x, dy, w, slots, cfg)
  row: dict[str, Any] = {"problem": spec, "optimizer": "adamw", "dtypes": storage,
                         "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}}
  if ok and (codec_problem := bench_lowp.mosaic_problem(x, dy, w, storage, interpret=False)):
    ok, why = False, codec_problem
  if not ok:
    return dict(row, status="unsupported", error=why)

  def build():
    # fused_linear_update, so the optimizer's precision (stochastic rounding, int8 states)
    # reaches the kernel as it does in a model; backend="mosaic" warns if it falls back.
    return jax.jit(lambda w, st: forge_jax.fused_linear_update(x, dy, w, st, opt, "mosaic", config=cfg),
                   donate_argnums=(0, 1))

  plain = build()
  copy = lambda: jax.tree.map(lambda a: a.copy(), (w, state))
  timing, _ = _timing.time_steps(lambda c: plain(*c), copy())
  row["ms_unprofiled"] = timing.median_ms
  trace_dir.mkdir(parents=True, exist_ok=True)
  fm._PROFILE = (PROFILE_SPACE, str(trace_dir))
  try:
    profiled = build()  # a new trace: the compiler params differ (fused_dw_mosaic._trace_env)
    out = profiled(*copy())
    jax.block_until_ready(out)
    jax.effects_barrier()  # the trace is written by a debug callback
  finally:
    fm._PROFILE = None
  traces = sorted(trace_dir.glob("*.json"))
  if not traces:
    return dict(row, status="no_trace", error=f"the profiler wrote nothing to {trace_dir}")
  summary = summarize_trace(json.loads(traces[-1].read_text()))
  kept = compress(traces[-1])
  for extra in traces[:-1]:
    extra.unlink()
  tiles = summary["regions"].get("fdw_mainloop", {}).get("count", 0)
  for reg in summary["regions"].values():
    reg["per_tile_us"] = reg["total_us"] / tiles if tiles else float("nan")
    reg["share_of_busy"] = reg["total_us"] / summary["busy_us"] if summary["busy_us"] else float("nan")
  return dict(row, status="ok", tiles=tiles, trace=kept.name, **summary)


def compress(path: pathlib.Path) -> pathlib.Path:
  """``path`` gzipped beside itself (the original removed); returns the new path."""
  out = path.with_name(path.name + ".gz")
  with gzip.open(out, "wb") as f:
    f.write(path.read_bytes())
  path.unlink()
  return out


def markdown(info: dict, rows: Sequence[dict]) -> str:
  out = ["# Mosaic kernel profile: where a call's time goes", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
         "Per region: mean microseconds per occurrence, per warpgroup tile, and share of the warpgroups' "
         "busy time (nested: `epilogue` includes the `epi_*` regions). Profiling adds a few cycles per "
         "range; `ms unprofiled` is the same call timed without it.", ""]
  for r in rows:
    variant = r.get("variant", "kernel")
    out.append(f"## {r['problem']} (AdamW, storage {r['dtypes']})"
               + ("" if variant == "kernel" else f", diagnostic variant `{variant}`"))
    out.append("")
    if r["status"] != "ok":
      out += [f"{r['status']}: {r.get('error', '')}", ""]
      continue
    out.append(f"ms unprofiled {r['ms_unprofiled']:.3f}; {r['tiles']} warpgroup tiles over {r['tracks']} "
               f"tracks; longest track {r['span_us']:.1f} us.")
    out += ["", "| region | count | mean us | us per tile | share of busy |", "|---|---|---|---|---|"]
    for name, reg in r["regions"].items():
      out.append(f"| {name} | {reg['count']} | {reg['mean_us']:.2f} | {reg['per_tile_us']:.2f} | "
                 f"{100 * reg['share_of_busy']:.1f}% |")
    out.append("")
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--problems", default=",".join(PROBLEMS), help="TxKxN list (AdamW)")
  parser.add_argument("--storage", default=["fp32"], nargs="+",
                      help="weight/state storage, experiments.bench_lowp's CONFIGS names "
                           "(fp32, bf16_rtn_bf16, bf16_sr_bf16, fp32_int8, ...)")
  parser.add_argument("--config-json", default=None, help="MosaicTileConfig fields (default: default_config)")
  parser.add_argument("--no-traces", action="store_true", help="delete the raw traces afterwards")
  parser.add_argument("--diagnose", nargs="+", default=[], choices=fm.DIAGNOSE_VARIANTS,
                      help="also profile these diagnostic epilogues (fused_dw_mosaic._DIAGNOSE: "
                           "skip_reads, skip_rule, skip_compute; their results are not the "
                           "optimizer step)")
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  if jax.default_backend() != "gpu":
    parser.error("the Mosaic GPU profiler needs a Hopper GPU")
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.profile_mosaic", argv)
  config = json.loads(args.config_json) if args.config_json else None
  from experiments import bench_lowp  # pylint: disable=g-import-not-at-top

  for storage in args.storage:
    if storage not in bench_lowp.CONFIGS:
      parser.error(f"--storage {storage!r} is not one of {', '.join(bench_lowp.CONFIGS)}")
  rows = []
  runs = ((s, p, v) for s in args.storage for p in args.problems.split(",") for v in ["", *args.diagnose])
  for storage, spec, variant in runs:
    sub = (spec if storage == "fp32" else f"{storage}_{spec}") + (f"_{variant}" if variant else "")
    try:
      row = profile_problem(spec, config, folder / "traces" / sub, storage, variant)
    except Exception as e:  # pylint: disable=broad-except  (recorded, next problem)
      row = {"problem": spec, "dtypes": storage, "variant": variant or "kernel", "status": "error",
             "error": _timing.short_error(e)}
    rows.append(row)
    _timing.log(f"  {storage} {spec} {variant or 'kernel'}: {row['status']} "
                + " ".join(f"{n}={v['per_tile_us']:.1f}us" for n, v in row.get("regions", {}).items()))
    _timing.write_json(folder / "profile_mosaic.json", {"info": info, "rows": rows})
  (folder / "profile_mosaic.md").write_text(markdown(info, rows))
  if args.no_traces:
    shutil.rmtree(folder / "traces", ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
