"""Hardware counters of the fused kernel and of XLA's GEMM and update beside it (Nsight Compute, H200).

The in-kernel profiler (``experiments.profile_mosaic``) says where a warpgroup's time goes; it
cannot say why: whether the main loop's x/dy reads miss L2 once the W/state stream passes
through it, how many bytes each kernel moves to and from device memory, and what the epilogue's
warps stall on (a shared-memory read's latency, a math pipe, a barrier). Nsight Compute reads
those counters. The H200 machines run Firecracker, where ``ncu`` works (device/KINDS.md; give it
``--clock-control none``).

This script has two halves. Run plainly, it starts ``ncu`` on itself (``--child``): the child
builds each case's problem and each implementation's runner (``experiments.main_loop``'s rows:
``xla_gemm``, ``xla_optax``, ``xla_stream``, ``mgpu_gemm*``, ``mosaic``, ``mosaic_main_loop``,
``mosaic_stream``, ``mosaic_copy``), compiles and warms every one (3 calls each), then opens
the profiler (``cuProfilerStart``) and runs each once, in order, blocking after each, so that only
those calls' kernels are profiled (the compiles and XLA's autotuning are not). Then this script
exports the report: ``raw.csv.gz`` (every metric, one row per kernel), ``source.csv.gz`` (stall
samples per SASS instruction, where ncu can print them), and ``ncu_kernel.md`` / ``.json`` (the
kernels in order with the child's list of which implementation ran when, duration, DRAM bytes,
L2 hit rates, the tensor pipe's activity and the largest stall reasons).

ncu replays each kernel many times to collect the counters, restoring the memory it writes
between passes, and by default flushes the caches before each pass (``--cache-control all``):
L2 hit rates are those of a kernel started on a cold L2. Durations are from the profiled
passes, under ncu's serialization: use them for ratios between kernels, and the benchmarks'
timings for speed.

    PYTHONPATH=$PWD python -m experiments.ncu_kernel --out $OUT/ncu
    PYTHONPATH=$PWD python -m experiments.ncu_kernel --cases bf16:1024 fp32:1024 bf16:4096 \\
        --impls xla_gemm xla_optax mosaic mosaic_main_loop --set full

GPU only; the CSV summary (``summarize_raw``) and the command line (``ncu_command``) are tested
on CPU.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import gzip
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any, Optional, Sequence

CASES = ("bf16:1024", "fp32:1024", "bf16:4096")
IMPLS = ("xla_gemm", "xla_optax", "xla_stream", "mgpu_gemm", "mgpu_gemm_m", "mosaic",
         "mosaic_main_loop", "mosaic_copy")
K = N = 4096
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# The metrics the summary reads from the raw page, when the collected sections provide them.
SUMMARY_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "lts__t_sector_op_read_hit_rate.pct": "l2_read_hit_pct",
    "lts__t_bytes.sum": "l2_bytes",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "smsp__inst_executed.sum": "instructions",
}
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_TENSOR = re.compile(r"^sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_(active|elapsed)$")
_UNIT_SCALE = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
               "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
               "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3}


def find_ncu() -> Optional[str]:
  """``ncu`` on PATH, else the newest under /opt/nvidia/nsight-compute (None if neither)."""
  found = shutil.which("ncu")
  if found:
    return found
  candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
  return candidates[-1] if candidates else None


def ncu_command(ncu: str, report: pathlib.Path, child_args: Sequence[str], sections: str) -> list[str]:
  """The profiling command: the child between cuProfilerStart/Stop only, clocks left alone."""
  cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
         "--import-source", "no", "-f", "-o", str(report)]
  if sections in ("full", "detailed", "basic"):
    cmd += ["--set", sections]
  else:
    for name in sections.split(","):
      cmd += ["--section", name]
  return cmd + [sys.executable, "-m", "experiments.ncu_kernel", "--child", *child_args]


def _number(text: str) -> Optional[float]:
  text = text.strip().replace(",", "")
  try:
    return float(text)
  except ValueError:
    return None


def summarize_raw(raw_csv: str) -> list[dict[str, Any]]:
  """One dict per kernel from ``ncu --page raw --csv``: id, name, the ``SUMMARY_METRICS`` present
  (bytes in bytes, duration in microseconds), the tensor pipe's activity and the six largest
  stall reasons (warps stalled per issued instruction)."""
  rows = list(csv.reader(io.StringIO(raw_csv)))
  rows = [r for r in rows if r and not r[0].startswith("==")]  # ncu's own messages
  if len(rows) < 2:
    return []
  header, units, body = rows[0], rows[1], rows[2:]
  index = {name: i for i, name in enumerate(header)}
  kernels = []
  for r in body:
    get = lambda name: r[index[name]] if name in index and index[name] < len(r) else ""
    k: dict[str, Any] = {"id": get("ID"), "name": get("Kernel Name")}
    for metric, key in SUMMARY_METRICS.items():
      value = _number(get(metric))
      if value is None:
        continue
      unit = units[index[metric]] if index[metric] < len(units) else ""
      scale = _UNIT_SCALE.get(unit, 1.0)
      if key == "duration":
        value = value * scale / 1e-6  # microseconds
      elif key in ("dram_read", "dram_write", "l2_bytes"):
        value = value * scale  # bytes
      k[key] = value
    for metric in header:
      if _TENSOR.match(metric) and _number(get(metric)) is not None:
        k.setdefault("tensor_pct", _number(get(metric)))
    stalls = {}
    for metric in header:
      m = _STALL.match(metric)
      value = _number(get(metric)) if m else None
      if m and value:
        stalls[m.group(1)] = value
    k["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
    kernels.append(k)
  return kernels


def markdown(info: dict, kernels: list[dict], order: list[dict]) -> str:
  fmt = lambda v, spec: "" if v is None else format(v, spec)
  lines = [
      "# Hardware counters: the fused kernel beside XLA's GEMM and update (Nsight Compute)", "",
      f"`{info['command']}`; {info['date']}; {info.get('device', '')}; jax {info.get('jax', '')}.", "",
      "Each implementation ran once after warm-up, in this order, with the profiler open "
      "(its kernels follow in the table below in the same order):", "",
  ]
  lines += [f"- {o['case']} `{o['impl']}`" + (f" ({o['config']})" if o.get("config") else "")
            + (f": {o['error']}" if o.get("error") else "") for o in order]
  lines += [
      "", "Per kernel: duration under ncu (cold L2, serialized), DRAM bytes read and written, L2 hit "
      "rate (all sectors / reads), the tensor pipe's active share, and the largest stall reasons "
      "(warps stalled per issued instruction, all warps of the kernel averaged).", "",
      "| id | kernel | us | DRAM read MB | DRAM write MB | L2 hit % | L2 read hit % | tensor % | top stalls |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for k in kernels:
    stalls = ", ".join(f"{n} {v:.2f}" for n, v in k.get("stalls", {}).items())
    name = k["name"] if len(k["name"]) <= 60 else k["name"][:57] + "..."
    lines.append(
        f"| {k['id']} | `{name}` | {fmt(k.get('duration'), '.1f')} "
        f"| {fmt(k.get('dram_read') and k['dram_read'] / 1e6, '.1f')} "
        f"| {fmt(k.get('dram_write') and k['dram_write'] / 1e6, '.1f')} "
        f"| {fmt(k.get('l2_hit_pct'), '.1f')} | {fmt(k.get('l2_read_hit_pct'), '.1f')} "
        f"| {fmt(k.get('tensor_pct'), '.1f')} | {stalls} |")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# The child: runs under ncu.
# ----------------------------------------------------------------------------


def _profiler(start: bool) -> None:
  """cuProfilerStart/Stop on the primary context (the one XLA uses), made current here."""
  cuda = ctypes.CDLL("libcuda.so.1")
  dev, ctx = ctypes.c_int(), ctypes.c_void_p()
  for call, args in (("cuDeviceGet", (ctypes.byref(dev), 0)),
                     ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
                     ("cuCtxSetCurrent", (ctx,)),
                     ("cuProfilerStart" if start else "cuProfilerStop", ())):
    rc = getattr(cuda, call)(*args)
    if rc != 0:
      raise RuntimeError(f"{call} returned CUDA error {rc}")


def _parse_case(case: str) -> tuple[str, int, str]:
  """``STORAGE:T[:OPTIMIZER]`` -> (storage, T, optimizer); the optimizer defaults to AdamW."""
  from experiments import main_loop  # pylint: disable=g-import-not-at-top

  parts = case.split(":")
  if len(parts) not in (2, 3) or parts[0] not in _DTYPES or not parts[1].isdigit():
    raise ValueError(f"case {case!r} is not STORAGE:T[:OPTIMIZER] with STORAGE in {sorted(_DTYPES)}")
  optimizer = parts[2] if len(parts) == 3 else main_loop.OPTIMIZER
  if optimizer not in main_loop.OPTIMIZERS:
    raise ValueError(f"case {case!r}: optimizer {optimizer!r} is not one of {sorted(main_loop.OPTIMIZERS)}")
  return parts[0], int(parts[1]), optimizer


def child(cases: Sequence[str], impls: Sequence[str], order_path: pathlib.Path) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from experiments import bench_fused_dw as bench  # pylint: disable=g-import-not-at-top
  from experiments import check_mosaic_gpu, main_loop  # pylint: disable=g-import-not-at-top

  builders = main_loop.implementations()
  ready, order = [], []
  for case in cases:
    storage, t, optimizer = _parse_case(case)
    x, dy, w0 = bench.make_inputs(int(t), K, N, state_dtype=jnp.dtype(_DTYPES[storage]))
    p = bench.make_problem(x, dy, w0, optimizer, False, main_loop.OPTIMIZERS)
    for impl in impls:
      entry = {"case": case, "impl": impl}
      try:
        runner = builders[impl](p)
        carry = runner.init()
        for _ in range(3):
          carry = runner.step(carry)
        jax.block_until_ready(carry)
        if impl.startswith("mosaic"):
          used = main_loop.resolve_config(p.x, p.dy, p.w0, p.rule.init_slots(p.w0), interpret=False)
          entry["config"] = check_mosaic_gpu.cfg_text(used)
        ready.append((entry, runner, carry))
      except Exception as e:  # pylint: disable=broad-except  (recorded, next row)
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      order.append(entry)
  _profiler(True)
  for entry, runner, carry in ready:
    jax.block_until_ready(runner.step(carry))
    print(f"ncu_kernel: ran {entry['case']} {entry['impl']}", flush=True)
  _profiler(False)
  order_path.write_text(json.dumps(order, indent=1))
  return 0


def _export(ncu: str, report: pathlib.Path, page: str, extra: Sequence[str] = ()) -> tuple[int, str, str]:
  proc = subprocess.run([ncu, "-i", str(report), "--page", page, "--csv", *extra],
                        capture_output=True, text=True, check=False)
  return proc.returncode, proc.stdout, proc.stderr


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--cases", nargs="+", default=list(CASES),
                      help="STORAGE:T[:OPTIMIZER], STORAGE bf16 (W and states) or fp32, OPTIMIZER "
                           "an experiments.main_loop rule (default adamw; sgd streams W alone); "
                           "K = N = 4096")
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), help="experiments.main_loop rows")
  parser.add_argument("--set", default="full",
                      help="ncu section set (full, detailed, basic) or a comma list of sections")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--order", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  for case in args.cases:
    try:
      _parse_case(case)
    except ValueError as e:
      parser.error(str(e))
  if args.child:
    return child(args.cases, args.impls, pathlib.Path(args.order))
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  ncu = find_ncu()
  if ncu is None:
    parser.error("no ncu: not on PATH nor under /opt/nvidia/nsight-compute")
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.ncu_kernel", argv)
  report, order_path = folder / "kernels", folder / "order.json"
  cmd = ncu_command(ncu, report, ["--cases", *args.cases, "--impls", *args.impls,
                                  "--order", str(order_path)], args.set)
  _timing.log("  " + " ".join(cmd))
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # room for ncu's save/restore
  proc = subprocess.run(cmd, env=env, check=False)
  rep = report.with_suffix(".ncu-rep")
  if not rep.exists():
    _timing.log(f"  ncu wrote no report (rc {proc.returncode})")
    return 1
  rc, raw, err = _export(ncu, rep, "raw")
  with gzip.open(folder / "raw.csv.gz", "wt") as f:
    f.write(raw)
  kernels = summarize_raw(raw) if rc == 0 else []
  if rc != 0:
    _timing.log(f"  raw export failed (rc {rc}): {err[-500:]}")
  rc, src, err = _export(ncu, rep, "source", ["--print-source", "sass"])
  with gzip.open(folder / "source.csv.gz", "wt") as f:
    f.write(src if rc == 0 else f"export failed (rc {rc}): {err[-2000:]}")
  order = json.loads(order_path.read_text()) if order_path.exists() else []
  _timing.write_json(folder / "ncu_kernel.json", {"info": info, "order": order, "kernels": kernels,
                                                  "ncu_rc": proc.returncode})
  (folder / "ncu_kernel.md").write_text(markdown(info, kernels, order))
  if rep.stat().st_size > 6 * 2**20:
    rep.unlink()  # the device tool returns one tarball of at most 16 MiB; the CSVs hold its data
  _timing.log(f"  {len(kernels)} kernels; ncu rc {proc.returncode}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
