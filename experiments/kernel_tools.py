"""The Mosaic GPU kernel engineer's tools: in-kernel profile, Nsight Compute counters, ptxas report, SASS.

One call of ``pallas_kernels.mosaic.fused_dw_update_mosaic`` (bf16 x/dy, a T x K x N problem,
an optimizer, weight and state storage, the default tiling or ``--config-json`` fields; the rule
guarded against non-finite gradient elements as forge_jax's layers run it, or bare with
``--no-guard``) examined three ways, on a Hopper GPU, from the repository root:

    # Mosaic GPU's in-kernel profiler: time per named region (fdw_mainloop, fdw_epilogue,
    # fdw_epi_wait, ...) per warpgroup, from its Chrome traces (kept gzipped in --out).
    PYTHONPATH=$PWD python -m experiments.kernel_tools profile --out $OUT/profile --shape 1024x4096x4096
    # Nsight Compute on that one call (between cuProfilerStart/Stop, the fused kernel only):
    # duration, DRAM bytes, tensor pipe and SM throughput, and the warp-state samples per SASS
    # instruction summed by stall reason for the epilogue's loop and the main loop; the
    # .ncu-rep stays in --out.
    PYTHONPATH=$PWD python -m experiments.kernel_tools ncu --out $OUT/ncu --states bfloat16
    # ptxas -v on the kernel (MOSAIC_GPU_DUMP_PTXAS=1): registers per thread and spill bytes.
    PYTHONPATH=$PWD python -m experiments.kernel_tools ptxas --out $OUT/ptxas --states int8
    # The kernel's SASS (its PTX, then ptxas and nvdisasm): instructions by opcode and class, for
    # the whole kernel and its loops (the largest without wgmma: the epilogue's); kernel.sass
    # and kernel.ptx stay in --out. Compare two runs (e.g. --states bfloat16 and int8, or
    # --no-guard) opcode by opcode.
    PYTHONPATH=$PWD python -m experiments.kernel_tools sass --out $OUT/sass --states bfloat16
    # The Mosaic GPU module (no GPU needed: lowered for sm_90), without locations, to diff
    # against another checkout's (this file, that checkout's kernel):
    PYTHONPATH=$PWD python -m experiments.kernel_tools mlir --out /tmp/mlir --states bfloat16
    PYTHONPATH=/tmp/old python experiments/kernel_tools.py mlir --out /tmp/mlir_old --states bfloat16

``ptxas`` and ``sass`` also run without a GPU, with ``--compile-only``: the call is compiled for a
compile-only H200 (jax's CUDA PJRT plugin, installed as ``experiments.gpu_hlo`` says, and the
``nvidia-cuda-nvcc-cu12`` wheel's ptxas), and Mosaic GPU assembles its kernel as on a GPU host;
``sass`` also needs an ``nvdisasm`` on PATH. The host's jax is not the GPU machine's: its SASS
and register counts are close to, not equal to, what the GPU runs.

Each writes ``kernel_<tool>.json`` and ``.md`` to ``--out``. ``run`` is the bare call the other
tools wrap (``--interpret`` runs it under the Mosaic GPU interpreter, for a CPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import dataclasses
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

OPTIMIZERS = ("adamw", "lion", "sgd_momentum")
STATES = ("float32", "bfloat16", "bf16_sr", "int8", "bf16_sr_int8")
PROFILE_SPACE = 512  # profiler ranges per warpgroup (a block's producer waits ~120 times at T=1024)
_USED = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# ncu raw metric -> short name, for the summary.
NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
}


def problem(shape: str, states: str, optimizer: str, seed: int = 0):
  """``(x, dy, w, slots, scalars, rule)`` on the default device: random bf16 x/dy,
  a weight (and states) of ``states`` storage (int8: float32 weight, int8 states; bf16_sr:
  bfloat16 weight rounded stochastically, bfloat16 states; bf16_sr_int8: the same weight, int8
  states)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import forge_jax  # pylint: disable=g-import-not-at-top

  t, k, n = (int(v) for v in shape.lower().split("x"))
  precision = (forge_jax.Precision(state_dtype="int8", min_quantized_size=0)
               if states in ("int8", "bf16_sr_int8") else None)
  ctor = {"adamw": lambda: forge_jax.adamw(1e-3, weight_decay=0.1, precision=precision),
          "lion": lambda: forge_jax.lion(1e-4, weight_decay=0.1, precision=precision),
          "sgd_momentum": lambda: forge_jax.sgd(1e-2, momentum=0.9, precision=precision)}[optimizer]
  opt = ctor()
  kx, kd, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (t, n), jnp.float32).astype(jnp.bfloat16)
  w_dtype = jnp.bfloat16 if states in ("bfloat16", "bf16_sr", "bf16_sr_int8") else jnp.float32
  w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(w_dtype)
  state = opt.init(w)
  slots = tuple(state[1:])
  return x, dy, w, slots, opt.rule.scalars(jnp.int32(3)), opt.rule


def kernel_call(args, profile: Optional[tuple[int, str]] = None):
  """``(step, operands, config)``: the jitted kernel call (W and states donated) and its inputs."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  from pallas_kernels import numerics  # pylint: disable=g-import-not-at-top
  try:
    from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
  except ImportError:  # a checkout from before pallas_kernels/mosaic/ (same entry points)
    from pallas_kernels import fused_dw_mosaic as mosaic  # pylint: disable=g-import-not-at-top

  x, dy, w, slots, scalars, rule = problem(args.shape, args.states, args.optimizer)
  cfg = mosaic.default_config(x, dy, w, slots)
  if args.config_json:
    cfg = dataclasses.replace(cfg, **json.loads(args.config_json))
  if args.interpret:
    cfg = dataclasses.replace(cfg, num_sms=1)

  # As forge_jax runs it: elements with a non-finite gradient skipped, unless --no-guard.
  update_fn = rule.update if args.no_guard else pallas_kernels.skip_non_finite(rule.update)

  codec = numerics.StochasticRound() if args.states.startswith("bf16_sr") else None

  def step(w, slots, x, dy, scalars):
    # The seed and step feed stochastic rounding (forge_jax's default int8 maps use it).
    return mosaic.fused_dw_update_mosaic(x, dy, w, slots, scalars, update_fn, config=cfg,
                                         interpret=args.interpret, weight_codec=codec,
                                         seed=jnp.uint32(1),
                                         step=jnp.int32(3),
                                         **({} if profile is None else {"profile": profile}))[:2]

  return jax.jit(step, donate_argnums=(0, 1)), (w, slots, x, dy, scalars), cfg


def _cuda_profiler(start: bool) -> None:
  """cuProfilerStart/Stop on the primary context (the one XLA uses), made current here."""
  import ctypes  # pylint: disable=g-import-not-at-top

  cuda = ctypes.CDLL("libcuda.so.1")
  dev, ctx = ctypes.c_int(), ctypes.c_void_p()
  for call, call_args in (("cuDeviceGet", (ctypes.byref(dev), 0)),
                          ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
                          ("cuCtxSetCurrent", (ctx,)),
                          ("cuProfilerStart" if start else "cuProfilerStop", ())):
    if (rc := getattr(cuda, call)(*call_args)) != 0:
      raise RuntimeError(f"{call} returned CUDA error {rc}")


def run(args, profile: Optional[tuple[int, str]] = None) -> dict[str, Any]:
  """Compiles and runs the call once, then once more (inside the CUDA profiler range with
  ``--cuda-profiler-range``, for ncu); returns the config used. With ``--compile-only``, compiles
  it for a compile-only H200 (:func:`experiments.gpu_hlo.compile_only_device`) and runs nothing:
  Mosaic GPU still writes the dumps its variables ask for (PTX, ptxas' report)."""
  import jax  # pylint: disable=g-import-not-at-top

  if args.compile_only:
    from experiments import gpu_hlo  # pylint: disable=g-import-not-at-top
    device = gpu_hlo.compile_only_device()  # before any array: jax's backends start once
    step, operands, cfg = kernel_call(args, profile)
    step.trace(*gpu_hlo.on_device(device, operands)).lower().compile(gpu_hlo.COMPILE_OPTIONS)
    return dataclasses.asdict(cfg)
  step, (w, slots, *rest), cfg = kernel_call(args, profile)
  w, slots = jax.block_until_ready(step(w, slots, *rest))
  if args.cuda_profiler_range:
    _cuda_profiler(True)
  jax.block_until_ready(step(w, slots, *rest))
  if args.cuda_profiler_range:
    _cuda_profiler(False)
  return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------
# Reading the tools' output.
# ----------------------------------------------------------------------------


def summarize_trace(trace: dict) -> dict[str, Any]:
  """Per-region totals of a Mosaic GPU profiler trace (Chrome ``B``/``E`` events):
  ``{"regions": {name: {"count", "total_us", "mean_us"}}, "tracks", "span_us"}``. Nested regions
  count in full at each level (``fdw_epilogue`` includes its ``fdw_epi_*``)."""
  stacks: dict[tuple, list] = collections.defaultdict(list)
  first: dict[tuple, float] = {}
  last: dict[tuple, float] = {}
  totals: dict[str, list[float]] = collections.defaultdict(list)
  for ev in trace.get("traceEvents", []):
    track, ts = (ev.get("pid"), ev.get("tid")), float(ev["ts"])
    first[track], last[track] = min(first.get(track, ts), ts), max(last.get(track, ts), ts)
    if ev["ph"] == "B":
      stacks[track].append((ev["name"], ts))
    elif ev["ph"] == "E" and stacks[track]:  # (an end without its begin: a trace cut short)
      name, start = stacks[track].pop()
      totals[name].append(ts - start)
  regions = {name: {"count": len(d), "total_us": sum(d), "mean_us": sum(d) / len(d)}
             for name, d in sorted(totals.items())}
  spans = [last[t] - first[t] for t in first]
  return {"regions": regions, "tracks": len(first), "span_us": max(spans, default=0.0)}


def profile_table(summary: dict) -> list[str]:
  """Markdown rows of :func:`summarize_trace`'s regions: count, mean and total microseconds, and
  microseconds per warpgroup tile (a region's total over the ``fdw_mainloop`` count)."""
  regions = summary.get("regions") or {}
  tiles = regions.get("fdw_mainloop", {}).get("count")
  rows = ["| region | count | mean us | total us | us per tile |", "|---|---|---|---|---|"]
  for name, r in regions.items():
    per_tile = f"{r['total_us'] / tiles:.2f}" if tiles else "-"
    rows.append(f"| {name} | {r['count']} | {r['mean_us']:.2f} | {r['total_us']:.1f} | {per_tile} |")
  return rows if regions else []


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def parse_ptxas_functions(text: str) -> list[dict[str, Any]]:
  """ptxas ``-v`` figures per compiled function, in the order ptxas reports them: name,
  registers, stack frame and spill bytes (a function's lines follow its "Compiling entry
  function" line)."""
  starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(text)]
  out = []
  for (start, name), (end, _) in zip(starts, starts[1:] + [(len(text), "")]):
    part = text[start:end]
    regs, frame = _USED.search(part), _FRAME.search(part)
    out.append({"function": name, "registers": int(regs.group(1)) if regs else None,
                **dict(zip(("stack_frame_bytes", "spill_store_bytes", "spill_load_bytes"),
                           (int(g) for g in frame.groups()) if frame else (None,) * 3))})
  return out


def parse_ptxas(text: str) -> dict[str, Any]:
  """ptxas ``-v`` figures in a process's output, maxima over its functions (None if absent)."""
  regs = [int(m.group(1)) for m in _USED.finditer(text)]
  frames = [tuple(int(g) for g in m.groups()) for m in _FRAME.finditer(text)]
  top = lambda i: max(f[i] for f in frames) if frames else None
  return {"registers": max(regs, default=None), "stack_frame_bytes": top(0),
          "spill_store_bytes": top(1), "spill_load_bytes": top(2), "functions": len(regs)}


# An instruction: its predicate (dropped), opcode and modifiers.
_SASS_OP = r"(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)"
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+" + _SASS_OP + r"([^;]*);")
_SASS_LABEL = re.compile(r"^\s*(\.L_[\w]+):")
_SASS_TARGET = re.compile(r"`\((\.L_[\w]+)\)")
# Opcode classes of sm_90 SASS (the rest: "other").
SASS_CLASSES = {
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD"),
    "special": ("MUFU",),
    "int": ("IMAD", "IADD3", "IADD", "LOP3", "SHF", "SHL", "SHR", "LEA", "IMNMX", "ISETP", "SEL",
            "PRMT", "IABS", "POPC", "FLO", "BMSK", "SGXT", "LOP", "IMUL", "VIADD", "VIMNMX", "PLOP3",
            "P2R", "R2P"),
    "convert": ("F2F", "F2I", "I2F", "F2FP", "I2IP", "FRND", "I2I"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "global": ("LDG", "STG", "LD", "ST", "ATOMG", "RED", "LDL", "STL"),
    "tensor": ("HGMMA", "WARPGROUP", "UTMALDG", "UTMASTG", "UBLKCP", "UTMACMDFLUSH", "UTMAPF"),
    "sync": ("BAR", "SYNCS", "WARPSYNC", "BSSY", "BSYNC", "MEMBAR", "FENCE", "DEPBAR", "ELECT",
             "NANOSLEEP", "ERRBAR", "CCTL", "YIELD"),
    "move": ("MOV", "S2R", "S2UR", "CS2R", "SHFL", "VOTE", "LDC", "ULDC", "R2UR", "UMOV", "MOVM"),
    "branch": ("BRA", "BRX", "EXIT", "RET", "CALL", "JMP", "BPT", "WARPGROUPSET"),
}
_SASS_CLASS_OF = {op: cls for cls, ops in SASS_CLASSES.items() for op in ops}


def sass_class(opcode: str) -> str:
  """The class (SASS_CLASSES) of an opcode without its modifiers; uniform-datapath forms
  (UIADD3, ULOP3, ...) count with their vector counterpart."""
  if opcode in _SASS_CLASS_OF:
    return _SASS_CLASS_OF[opcode]
  if opcode.startswith("U") and opcode[1:] in _SASS_CLASS_OF:
    return _SASS_CLASS_OF[opcode[1:]]
  return "other"


def parse_sass(text: str) -> dict[str, Any]:
  """Instructions of nvdisasm output (``-c``, one function or several): counts by opcode and by
  class for all of it, for its largest loop (the span from a label to the last backward branch to
  it: in the fused kernel, the persistent loop over tiles) and for its largest loop without a
  ``wgmma`` (``HGMMA``: in the fused kernel, the epilogue's loop over sub-tiles), and the sizes of
  every loop. A loop that picks with a switch (an indirect branch, ``BRX``, to blocks of register
  moves that each end in a branch) runs one of those blocks an iteration: its ``executed`` counts
  one, of average length, and ``switch_cases`` how many there are."""
  instructions, labels, branches, moves = [], {}, [], []
  pending = []
  for line in text.splitlines():
    if (m := _SASS_LABEL.match(line)):
      pending.append(m.group(1))
      continue
    if not (m := _SASS_LINE.search(line)):
      continue
    index = len(instructions)
    for label in pending:
      labels[label] = index
    pending = []
    opcode = m.group(2)
    instructions.append(opcode)
    moves.append(opcode in ("MOV", "BRA") or (opcode == "IMAD" and m.group(3).startswith(".MOV")))
    if opcode == "BRA" and (t := _SASS_TARGET.search(m.group(4))):
      branches.append((index, t.group(1)))

  def counts(ops: Sequence[str]) -> dict[str, Any]:
    by_op = collections.Counter(ops)
    by_class = collections.Counter()
    for op, n in by_op.items():
      by_class[sass_class(op)] += n
    return {"instructions": len(ops), "by_class": dict(by_class.most_common()),
            "by_opcode": dict(by_op.most_common(30))}

  spans = loop_spans((index, labels.get(label)) for index, label in branches)
  out = {"all": counts(instructions), "loops": [end - start + 1 for start, end in spans]}
  if spans:
    out["largest_loop"] = counts(instructions[spans[0][0]:spans[0][1] + 1])
  no_mma = [(start, end) for start, end in spans if "HGMMA" not in instructions[start:end + 1]]
  if no_mma:
    start, end = no_mma[0]
    out["largest_loop_without_mma"] = loop = counts(instructions[start:end + 1])
    brx = [i for i in range(start, end + 1) if instructions[i].startswith("BRX")]
    targets = dict(branches)
    after = [i for i in range(brx[0] + 1, end + 1) if instructions[i] == "BRA"] if brx else []
    join = labels.get(targets.get(after[0])) if after else None
    if join is not None and brx[0] < join <= end:
      # The switch's cases: the blocks between the indirect branch and the label their branches
      # join at, each its moves (and a branch; the last one falls through).
      starts = sorted({brx[0] + 1, join, *(i for i in labels.values() if brx[0] < i < join)})
      cases = [b - a for a, b in zip(starts, starts[1:]) if all(moves[a:b])]
      if cases and sum(cases) == join - brx[0] - 1:
        loop.update(switch_cases=len(cases),
                    executed=loop["instructions"] - sum(cases) + round(sum(cases) / len(cases)))
  return out


def loop_spans(back_edges) -> list[tuple[int, int]]:
  """Loops of a listing from its branches ``(branch index, target index or None)``: each target
  at or before its branch starts a loop that ends at the latest branch back to it. ``(first,
  last)`` instruction indices, largest first."""
  loops: dict[int, int] = {}
  for index, start in back_edges:
    if start is not None and start <= index:
      loops[start] = max(loops.get(start, index), index)
  return sorted(loops.items(), key=lambda span: (span[1] - span[0], span[0]), reverse=True)


def ncu_command(ncu: str, report: pathlib.Path, run_args: Sequence[str]) -> list[str]:
  """Nsight Compute on ``kernel_tools run`` between cuProfilerStart/Stop, clocks left alone, the
  fused kernel only (an int8 call's operand transposes would take a full replay each)."""
  return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes",
          "all", "--kernel-name", f"regex:{FUSED_KERNEL}", "--set", "full", "-f", "-o",
          str(report), sys.executable, "-m",
          "experiments.kernel_tools", "run", "--cuda-profiler-range", *run_args]


def summarize_ncu_raw(raw_csv: str) -> list[dict[str, Any]]:
  """One dict per kernel of ``ncu --import R --page raw --csv``: its name and NCU_METRICS."""
  rows = list(csv.reader(io.StringIO(raw_csv)))
  if len(rows) < 3:
    return []
  header, data = rows[0], rows[2:]  # rows[1]: units
  out = []
  for row in data:
    values = dict(zip(header, row))
    kernel = {"name": values.get("Kernel Name", "?")}
    for metric, short in NCU_METRICS.items():
      if metric in values:
        try:
          kernel[short] = float(values[metric].replace(",", ""))
        except ValueError:
          kernel[short] = values[metric]
    out.append(kernel)
  return out


# ----------------------------------------------------------------------------
# The tools.
# ----------------------------------------------------------------------------


def _run_args(args) -> list[str]:
  out = ["--shape", args.shape, "--states", args.states, "--optimizer", args.optimizer]
  return (out + (["--config-json", args.config_json] if args.config_json else [])
          + (["--no-guard"] if args.no_guard else [])
          + (["--compile-only"] if args.compile_only else []))


def tool_profile(args, out: pathlib.Path) -> dict[str, Any]:
  """Runs the call with the profiler; the profiler's buffers take shared memory, so a config
  that no longer fits is retried with one stage fewer."""
  traces = out / "traces"
  traces.mkdir(parents=True, exist_ok=True)
  config = json.loads(args.config_json) if args.config_json else {}
  while True:
    args.config_json = json.dumps(config) if config else None
    try:
      cfg = run(args, profile=(PROFILE_SPACE, str(traces)))
      break
    except Exception as e:  # pylint: disable=broad-except
      stages = config.get("max_concurrent_steps")
      if "shared memory" not in str(e) or stages == 2:
        raise
      config["max_concurrent_steps"] = (stages or 5) - 1
  files = sorted(glob.glob(str(traces / "*.json")))
  summary = summarize_trace(json.loads(pathlib.Path(files[-1]).read_text())) if files else {}
  for f in files:  # kept, compressed
    pathlib.Path(f + ".gz").write_bytes(gzip.compress(pathlib.Path(f).read_bytes()))
    os.remove(f)
  return {"config": cfg, "trace_files": len(files), **summary}


def tool_ncu(args, out: pathlib.Path) -> dict[str, Any]:
  """Nsight Compute's full set on the call: the raw page's figures per kernel, and the fused
  kernel's source page (SASS with warp-state samples per instruction, kept gzipped as
  ``kernel_source.csv.gz``) summarized by :func:`summarize_ncu_source`."""
  ncu = shutil.which("ncu") or max(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), default=None)
  if ncu is None:
    raise RuntimeError("ncu (Nsight Compute) is neither on PATH nor under /opt/nvidia/nsight-compute")
  report = out / "kernel"
  subprocess.run(ncu_command(ncu, report, _run_args(args)), check=True)
  read = lambda *page: subprocess.run([ncu, "--import", f"{report}.ncu-rep", *page, "--csv"],
                                      check=True, capture_output=True, text=True).stdout
  result = {"report": f"{report}.ncu-rep", "kernels": summarize_ncu_raw(read("--page", "raw"))}
  block = ncu_source_block(read("--page", "source", "--print-source", "sass"), FUSED_KERNEL)
  if block:
    (out / "kernel_source.csv.gz").write_bytes(gzip.compress(block.encode()))
    result["source"] = summarize_ncu_source(block)
  return result


FUSED_KERNEL = "fused_dw_update_mosaic"  # the name Mosaic GPU gives the fused kernel's function
_HEX_TARGET = re.compile(r"\bBRA\s+(0x[0-9a-fA-F]+)")


def ncu_source_block(text: str, kernel: str) -> str:
  """The CSV block of ``ncu --page source --csv`` that belongs to the last kernel whose name
  contains ``kernel`` (the page holds one block per kernel, each after a "Kernel Name" line), or
  "" if none."""
  blocks, current = [], None
  for line in text.splitlines():
    if line.startswith('"Kernel Name",'):
      current = [line.split(",")[1].strip('"'), []]
      blocks.append(current)
    elif current is not None:
      current[1].append(line)
  found = [lines for name, lines in blocks if kernel in name]
  return "\n".join(found[-1]) + "\n" if found else ""


def sass_opcode(text: str) -> str:
  """``FMNMX`` of ``@!P1 FMNMX.NAN R1, R2, R3, !PT``: the opcode without predicate and modifiers,
  as :func:`parse_sass` reads it ("" for a line that is not an instruction)."""
  m = re.match(_SASS_OP, text.strip())
  return m.group(1) if m else ""


def summarize_ncu_source(block: str, top: int = 20) -> dict[str, Any]:
  """Warp-state samples of one kernel's source page (SASS): totals by stall reason for the whole
  kernel, for its largest loop without ``HGMMA`` (in the fused kernel, the epilogue's loop over
  sub-tiles) and for its smallest loop with one (the main loop), those two also by opcode (the
  ``top`` most sampled), and the ``top`` instructions by samples with their index, text and
  main reasons. Loops are spans from a branch's target address back to the branch; the
  out-of-line spin-waits of barrier waits sit outside them."""
  rows = list(csv.reader(io.StringIO(block)))
  if len(rows) < 2:
    return {}
  header, rows = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
  col = {name: i for i, name in enumerate(header)}
  reasons = [name for name in header if name.startswith("stall_") and "(Not Issued)" not in name]
  number = lambda v: float(v.replace(",", "")) if v not in ("", "-") else 0.0
  addresses = [int(r[col["Address"]], 16) for r in rows]
  texts = [r[col["Source"]].strip() for r in rows]
  stalls = [{name[len("stall_"):]: number(r[col[name]]) for name in reasons} for r in rows]
  index_of = {a: i for i, a in enumerate(addresses)}
  spans = loop_spans((i, index_of.get(int(m.group(1), 16)))
                     for i, t in enumerate(texts) if (m := _HEX_TARGET.search(t)))
  has_mma = lambda start, end: any("HGMMA" in t for t in texts[start:end + 1])

  def region(start: int, end: int, by_opcode: bool = False) -> dict[str, Any]:
    total = collections.Counter()
    for s in stalls[start:end + 1]:
      total.update(s)
    n = sum(total.values())
    out_ = {"instructions": end - start + 1, "first": start, "samples": int(n),
            "reasons_pct": {k: round(100 * v / n, 1) for k, v in total.most_common() if v} if n else {}}
    if by_opcode:  # where a loop's samples sit, by instruction (predicates and modifiers dropped)
      ops: dict = collections.defaultdict(lambda: [0, collections.Counter()])
      for i in range(start, end + 1):
        entry = ops[sass_opcode(texts[i])]
        entry[0] += 1
        entry[1].update(stalls[i])
      ranked = sorted(ops.items(), key=lambda kv: -sum(kv[1][1].values()))[:top]
      out_["by_opcode"] = [{"opcode": op, "instructions": count, "samples": int(sum(c.values())),
                            "reasons": {k: int(v) for k, v in c.most_common(3) if v}}
                           for op, (count, c) in ranked]
    return out_

  out = {"instructions": len(rows), "all": region(0, len(rows) - 1)}
  no_mma = [(s, e) for s, e in spans if not has_mma(s, e)]
  with_mma = [(s, e) for s, e in reversed(spans) if has_mma(s, e)]
  if no_mma:
    out["largest_loop_without_mma"] = region(*no_mma[0], by_opcode=True)
  if with_mma:
    out["smallest_loop_with_mma"] = region(*with_mma[0], by_opcode=True)
  order = sorted(range(len(rows)), key=lambda i: -sum(stalls[i].values()))[:top]
  out["top"] = [{"index": i, "sass": texts[i], "samples": int(sum(stalls[i].values())),
                 "reasons": {k: int(v) for k, v in sorted(stalls[i].items(), key=lambda kv: -kv[1])[:3] if v}}
                for i in order if sum(stalls[i].values())]
  return out


def _run_dumping(args, **dump_env: Optional[str]) -> subprocess.CompletedProcess:
  """``kernel_tools run`` in a new process with Mosaic GPU's dump variables ``dump_env`` (a None
  value unsets one). Without MOSAIC_GPU_DUMP_TO the dump goes to stdout; with it, to files, and
  Mosaic GPU skips ``ptxas -v``."""
  env = dict(os.environ)
  env.pop("MOSAIC_GPU_DUMP_TO", None)
  env.update({k: v for k, v in dump_env.items() if v is not None})
  proc = subprocess.run([sys.executable, "-m", "experiments.kernel_tools", "run", *_run_args(args)],
                        env=env, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"the kernel call ended with {proc.returncode}: {proc.stderr[-1500:]}")
  return proc


def tool_ptxas(args, out: pathlib.Path) -> dict[str, Any]:
  proc = _run_dumping(args, MOSAIC_GPU_DUMP_PTXAS="1")
  (out / "ptxas.log").write_text(proc.stdout + proc.stderr)
  return parse_ptxas(proc.stdout + proc.stderr)


def tool_sass(args, out: pathlib.Path) -> dict[str, Any]:
  """The kernel's PTX (MOSAIC_GPU_DUMP_PTX into a folder), assembled by ``ptxas`` as Mosaic GPU
  assembles it and disassembled by ``nvdisasm`` (both from PATH: Mosaic GPU's own SASS dump looks
  for nvdisasm only in its own CUDA folder); ``kernel.ptx`` and ``kernel.sass`` stay in ``out``."""
  dump = out / "ptx_dump"
  shutil.rmtree(dump, ignore_errors=True)
  dump.mkdir(parents=True)
  _run_dumping(args, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(dump))
  ptx = sorted(dump.rglob("*.ptx"), key=lambda f: f.stat().st_size)
  if not ptx:
    raise RuntimeError(f"no PTX under {dump} (MOSAIC_GPU_DUMP_PTX); found: "
                       f"{[f.name for f in dump.rglob('*')][:20]}")
  shutil.copy(ptx[-1], out / "kernel.ptx")  # the largest module: the fused kernel
  shutil.rmtree(dump)
  ptxas, nvdisasm = cuda_tool("ptxas"), cuda_tool("nvdisasm")
  arch = re.search(r"^\.target\s+(sm_\w+)", (out / "kernel.ptx").read_text(), re.M)
  subprocess.run([ptxas, "--opt-level", "3", "--gpu-name", arch.group(1) if arch else "sm_90a",
                  "--output-file", str(out / "kernel.cubin"), str(out / "kernel.ptx")], check=True)
  dis = subprocess.run([nvdisasm, "-ndf", "-c", str(out / "kernel.cubin")], capture_output=True,
                       text=True, check=True)
  (out / "kernel.cubin").unlink()
  sass = "\n".join(l for l in dis.stdout.splitlines() if _SASS_LINE.search(l) or _SASS_LABEL.match(l))
  if not sass:
    raise RuntimeError(f"no SASS in nvdisasm's output: {dis.stdout[-500:]}{dis.stderr[-500:]}")
  (out / "kernel.sass").write_text(sass + "\n")
  return {"sass": str(out / "kernel.sass"), "ptx": str(out / "kernel.ptx"), **parse_sass(sass)}


def cuda_tool(name: str) -> str:
  """The path of a CUDA toolkit program: from PATH, else beside the ``ptxas`` that Mosaic GPU
  uses off a GPU host (the ``nvidia-cuda-nvcc-cu12`` wheel's ``bin`` folder)."""
  if found := shutil.which(name):
    return found
  try:
    import nvidia.cuda_nvcc  # pylint: disable=g-import-not-at-top
    for folder in nvidia.cuda_nvcc.__path__:
      if (path := pathlib.Path(folder) / "bin" / name).is_file():
        return str(path)
  except ImportError:
    pass
  raise RuntimeError(f"{name} is not on PATH (the CUDA toolkit's bin folder; pip's "
                     f"nvidia-cuda-nvcc-cu12 has ptxas, not nvdisasm)")


@contextlib.contextmanager
def mosaic_modules():
  """Collects, into the list it yields, each Mosaic GPU module lowered inside it, as Mosaic GPU
  serializes it, printed without locations (jax-internal hook: ``mosaic.gpu.core._run_serde_pass``)."""
  from jax.experimental.mosaic.gpu import core as mgpu_core  # pylint: disable=g-import-not-at-top

  modules, real = [], mgpu_core._run_serde_pass  # pylint: disable=protected-access
  mgpu_core._run_serde_pass = lambda module, **kw: (  # pylint: disable=protected-access
      modules.append(module.operation.get_asm(enable_debug_info=False)) or real(module, **kw))
  try:
    yield modules
  finally:
    mgpu_core._run_serde_pass = real  # pylint: disable=protected-access


def tool_mlir(args, out: pathlib.Path) -> dict[str, Any]:
  """Lowers the call for sm_90 (on any host) and keeps the Mosaic GPU module (:func:`mosaic_modules`)."""
  import jax  # pylint: disable=g-import-not-at-top

  step, operands, cfg = kernel_call(args)
  with mosaic_modules() as modules:
    step.trace(*jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), operands)).lower(
        lowering_platforms=("cuda",))
  (out / "kernel.mlir").write_text(modules[-1])
  return {"config": dataclasses.asdict(cfg), "module": str(out / "kernel.mlir"),
          "lines": modules[-1].count("\n")}


TOOLS = {"profile": tool_profile, "ncu": tool_ncu, "ptxas": tool_ptxas, "sass": tool_sass,
         "mlir": tool_mlir}


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("tool", choices=("run", *TOOLS))
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--shape", default="1024x4096x4096", help="T x K x N")
  parser.add_argument("--states", default="float32", choices=STATES,
                      help="weight and state storage (int8: float32 weight, int8 states; "
                           "bf16_sr: bfloat16 weight rounded stochastically, bfloat16 states; "
                           "bf16_sr_int8: that weight, int8 states)")
  parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
  parser.add_argument("--no-guard", action="store_true",
                      help="the rule alone, without the per-element non-finite guard that "
                           "forge_jax's layers run (pallas_kernels.skip_non_finite)")
  parser.add_argument("--config-json", default=None, help="MosaicTileConfig fields over the default")
  parser.add_argument("--compile-only", action="store_true",
                      help="ptxas, sass: no GPU needed; the call is compiled for a compile-only "
                           "H200 (jax's CUDA PJRT plugin, as experiments.gpu_hlo) and not run")
  parser.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--cuda-profiler-range", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if not re.fullmatch(r"\d+x\d+x\d+", args.shape):
    parser.error(f"--shape takes T x K x N, e.g. 1024x4096x4096; got {args.shape!r}")
  if args.compile_only and args.tool not in ("run", "ptxas", "sass"):
    parser.error(f"--compile-only is for ptxas and sass (what a compile tells); {args.tool} runs the kernel")
  if args.tool == "run":
    print(json.dumps(run(args)))
    return 0
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  out = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.kernel_tools", argv)
  result = {"info": info, args.tool: TOOLS[args.tool](args, out)}
  _timing.write_json(out / f"kernel_{args.tool}.json", result)
  guard = ", no guard" if args.no_guard else ""
  guard += ", compiled for a compile-only H200 (not run)" if args.compile_only else ""
  table = profile_table(result[args.tool]) if args.tool == "profile" else []
  lines = [f"# kernel_tools {args.tool}: {args.shape} {args.optimizer}, {args.states} states{guard}", "",
           f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
           *table, *([""] if table else []), "```", json.dumps(result[args.tool], indent=1, default=str)[:6000], "```"]
  (out / f"kernel_{args.tool}.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
