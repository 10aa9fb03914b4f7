"""What a training step (scanned or unrolled) hands the compiler, and how long it takes to compile.

From the repository root (CPU is enough: nothing runs, the step is traced, lowered and, with
``--compile``, compiled for the local backend):

    PYTHONPATH=$PWD python -m experiments.compile_cost --model qwen3-0.6b --layers 4 \\
        --impls forge_unrolled,forge_int8_unrolled --compile --out $OUT

For each ``bench_models`` implementation name (same model config: bf16, remat none, the
``"auto"`` FORGE backend, which off a GPU and for int8 states on one is the ``"xla"`` route),
it records the seconds to trace, lower and compile the step, the jaxpr's equations (nested
jaxprs included) and its most frequent primitives, the StableHLO ops, and after compiling the
optimized module's fusions and how many of them are distinct (bodies compared without names and
metadata: XLA emits a kernel once per distinct fusion). Writes ``compile_cost.json`` and
``compile_cost.md`` to ``--out``.

On a GPU, the compile seconds of a scanned against an unrolled Llama-3.1-8B step, with the attention
``bench_models`` uses there, each step traced and compiled in a new process, twice:

    PYTHONPATH=$PWD python -m experiments.compile_cost --model llama-3.1-8b --layers 32 \\
        --tokens 1024 --impls forge,forge_unrolled --attention auto --compile --fresh --repeats 2 \\
        --xla-timers --out $OUT

(``--xla-timers``: XLA's compile split into its HLO passes and its backend, from XLA's own timers;
``--trace-compile``: the compile under ``jax.profiler.trace``, its host events by name and each
Mosaic GPU kernel's compile time, which says which kernels a step's compile waits on;
``--kernel-compile parallel,serial``: each step with its Mosaic GPU kernels compiled on a thread
pool while XLA compiles the rest, forge_jax's default, and by XLA one after another.)
Compiled rows also count the optimized module's custom calls by target (on a GPU the Mosaic
kernels), and list those inside fused computations by computation: XLA's dynamic-slice fusion
hands a kernel a slice of a stacked buffer in place, and a kernel found both inside such a
fusion and outside it runs twice.

Without a GPU, the step a GPU compiles, Mosaic kernels included, traced and lowered for CUDA on
this host (``--lower-for cuda``: FORGE's backends resolve as on a Hopper GPU, ``"auto"`` from
its table; nothing is compiled). Tracing and lowering are host work, so their seconds are the
part of a GPU compile that a CPU measures (on a host as fast per core):

    PYTHONPATH=$PWD python -m experiments.compile_cost --model llama-3.1-8b --layers 32 \\
        --tokens 1024 --impls forge,forge_unrolled --lower-for cuda --fresh --repeats 3 --out $OUT

(Rows lowered for CUDA count the Mosaic GPU kernels in the lowered module: the distinct ones,
as a step lowers each once and calls it where it is used.) Wherever a step lowers Mosaic GPU
kernels (on a GPU, or for CUDA here), each kernel's lowering is timed on its own and listed
(``mosaic_lowering``): the host work of the step's lowering that is its kernels'.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from experiments import _timing
from experiments import bench_models


def count_eqns(jaxpr, counts: collections.Counter) -> collections.Counter:
  """Equations per primitive, nested jaxprs (jit, custom_vjp, cond branches) included."""
  for eqn in jaxpr.eqns:
    counts[eqn.primitive.name] += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
          count_eqns(sub.jaxpr, counts)
        elif hasattr(sub, "eqns"):
          count_eqns(sub, counts)
  return counts


def fusion_stats(hlo_text: str) -> dict:
  """Fused computations of an optimized HLO module, and how many are distinct."""
  bodies = collections.Counter()
  for block in re.split(r"\n(?=\S)", hlo_text):
    head, _, body = block.partition("\n")
    if not head.lstrip("%").startswith("fused_") or head.startswith("ENTRY"):
      continue
    body = re.sub(r"metadata=\{[^}]*\}", "", body)
    bodies[re.sub(r"%[\w.\-]+", "%v", body)] += 1
  return {"fusions": sum(bodies.values()), "distinct_fusions": len(bodies)}


def custom_call_stats(hlo_text: str) -> dict:
  """Custom calls of an optimized HLO module by target, and those inside fused computations
  (``"target in computation"``: e.g. XLA's dynamic-slice fusion of a kernel with the slice it
  reads or the update it writes)."""
  total, fused = collections.Counter(), collections.Counter()
  for block in re.split(r"\n(?=\S)", hlo_text):
    head = block.partition("\n")[0].lstrip("%")
    targets = re.findall(r'custom_call_target="([^"]+)"', block)
    total.update(targets)
    if not head.startswith("ENTRY") and "fusion" in head.split(" ", 1)[0]:
      fused.update(f"{t} in {head.split(' ', 1)[0]}" for t in targets)
  return {"custom_calls": dict(total.most_common()), "fused_custom_calls": dict(fused)}


# Host events of a compile under jax.profiler.trace: XLA's phases (GpuCompiler::RunHloPasses,
# GpuCompiler::RunBackend, ...) and, on a GPU, one "Compile" per Mosaic GPU kernel that the
# backend compiles (Mosaic GPU's TraceMe; "Compilation cache miss" wraps it). Python frames
# ("$file.py:line name") are left out.
MOSAIC_COMPILE_EVENT = "Compile"


def traced_compile(lowered, top: int = 25):
  """``(compiled, seconds, events)``: ``lowered.compile()`` under ``jax.profiler.trace``, and its
  host events by name (``{"name", "count", "ms"}``, the ``top`` longest in total) plus
  ``mosaic_compile_ms``, the duration of each Mosaic GPU kernel compile, longest first."""
  def timed():
    tick = time.perf_counter()
    return lowered.compile(), time.perf_counter() - tick

  (compiled, seconds), data = _timing.profiled(timed)
  return (compiled, seconds, host_event_totals(data, top) if data is not None else
          {"compile_events": [], "mosaic_compile_ms": []})


def host_event_totals(data, top: int = 25) -> dict:
  """Host events of a ``ProfileData`` by name (see :func:`traced_compile`), and how the Mosaic GPU
  kernel compiles lie in time: ``mosaic_compile_span_ms`` from the first one's start to the last
  one's end and ``mosaic_compile_threads``, the host threads they ran on (one thread and a span
  near their sum: they ran one after another)."""
  totals = {}
  mosaic, starts, ends, threads = [], [], [], set()
  for plane in data.planes:
    if not plane.name.startswith("/host"):
      continue
    for line_index, line in enumerate(plane.lines):
      for event in line.events:
        if event.name.startswith("$"):
          continue
        entry = totals.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.duration_ns / 1e6
        if event.name == MOSAIC_COMPILE_EVENT:
          mosaic.append(round(event.duration_ns / 1e6, 1))
          start = getattr(event, "start_ns", None)
          if start is not None:
            starts.append(start)
            ends.append(start + event.duration_ns)
          threads.add((plane.name, line_index))  # a line per thread; names repeat (pool threads)
  rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
  out = {"compile_events": [{"name": n[:120], "count": c, "ms": round(ms, 1)} for n, (c, ms) in rows],
         "mosaic_compile_ms": sorted(mosaic, reverse=True)}
  if starts:
    out["mosaic_compile_span_ms"] = round((max(ends) - min(starts)) / 1e6, 1)
    out["mosaic_compile_threads"] = len(threads)
  return out


@contextlib.contextmanager
def _as_on_a_hopper_gpu():
  """FORGE's backend choices as on a Hopper GPU, on this host: the platform said to be a GPU and
  the Mosaic kernel said to run here (``"auto"`` then reads its table). For lowering only: on the
  way out jax's caches are dropped, so that no trace made here (Mosaic kernels in a CPU process)
  serves a later call."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top

  saved = _fused._platform, _fused._mosaic_device_problem  # pylint: disable=protected-access
  _fused._platform, _fused._mosaic_device_problem = (lambda: "gpu"), (lambda: None)  # pylint: disable=protected-access
  try:
    yield
  finally:
    _fused._platform, _fused._mosaic_device_problem = saved  # pylint: disable=protected-access
    jax.clear_caches()


@contextlib.contextmanager
def mosaic_lowering_seconds():
  """Yields a list that fills with one ``{"kernel", "inputs", "s"}`` per Mosaic GPU kernel lowered
  inside the block: the seconds jax spends turning the kernel's jaxpr into its Mosaic GPU module
  (the Pallas lowering, layout inference, the dialect's lowering), host work that precedes any
  compile. ``kernel`` is the module's name (jax 0.10 names a warp-specialized kernel after its
  body, ``new_body``; 0.11 after the kernel), ``inputs`` its first two operands' shapes. Empty
  where this jax has no Mosaic GPU lowering to time."""
  records: list = []
  try:
    from jax._src.pallas.mosaic_gpu import lowering  # pylint: disable=g-import-not-at-top
  except ImportError:
    yield records
    return
  original = getattr(lowering, "lower_jaxpr_to_module", None)
  if original is None:
    yield records
    return

  signature = inspect.signature(original)

  @functools.wraps(original)
  def timed(*args, **kwargs):
    tick = time.perf_counter()
    result = original(*args, **kwargs)
    seconds = time.perf_counter() - tick
    bound = signature.bind_partial(*args, **kwargs).arguments
    name = None
    try:
      name = ir_string(result.module.operation.attributes["sym_name"])
    except Exception:  # pylint: disable=broad-except
      info = getattr(bound.get("jaxpr"), "debug_info", None)
      name = getattr(info, "func_name", None)
    shapes = ["x".join(map(str, a.shape)) for a in list(bound.get("in_shapes", ()))[:2]]
    records.append({"kernel": name or "?", "inputs": ", ".join(shapes), "s": seconds})
    return result

  lowering.lower_jaxpr_to_module = timed
  try:
    yield records
  finally:
    lowering.lower_jaxpr_to_module = original


def ir_string(attr) -> str:
  """The text of an MLIR string attribute (``StringAttr.value``; else its quoted printing)."""
  return getattr(attr, "value", None) or str(attr).strip('"')


def measure(model: str, impl: str, layers: int, tokens: int, compile_step: bool,
            attention: str = "xla", trace_compile: bool = False,
            kernel_compile: str = "parallel", guard: bool = True, remat: str = "none",
            lower_for: Optional[str] = None) -> dict:
  """One row (``remat``: the models' activation checkpointing); ``kernel_compile``: ``"parallel"`` (the default: the step's Mosaic GPU kernels
  compiled on a thread pool while XLA compiles the rest, pallas_kernels.mosaic.parallel_compile)
  or ``"serial"`` (XLA compiles them one after another); ``guard``: train_step's
  ``skip_nonfinite``; ``lower_for="cuda"``: traced and lowered as on a Hopper GPU, for CUDA
  (no compile)."""
  if lower_for is not None:
    if lower_for != "cuda" or compile_step:
      raise ValueError(f"lower_for={lower_for!r}: 'cuda' (or None), without compiling")
    with _as_on_a_hopper_gpu():
      return _measure(model, impl, layers, tokens, False, attention, False, kernel_compile, guard,
                      remat, ("cuda",))
  return _measure(model, impl, layers, tokens, compile_step, attention, trace_compile,
                  kernel_compile, guard, remat, None)


def _measure(model, impl, layers, tokens, compile_step, attention, trace_compile, kernel_compile,
             guard, remat, platforms) -> dict:
  import forge_jax  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from forge_jax import _train  # pylint: disable=g-import-not-at-top
  from pallas_kernels.mosaic import parallel_compile  # pylint: disable=g-import-not-at-top

  parallel_compile.set_enabled(kernel_compile == "parallel")

  base, scan = bench_models.parse_impl(impl)
  base, backend = bench_models.forge_backend(base)
  cfg = models.get_config(model, linear="forge", remat=remat, scan_layers=scan, forge_backend=backend,
                          param_dtype="bfloat16", dtype="bfloat16", attention=attention, num_layers=layers)
  opt = bench_models._forge_optimizer(base)  # pylint: disable=protected-access
  if opt is None:
    raise ValueError(f"impl={impl!r} is not a FORGE implementation (forge, forge_int8, ... _unrolled)")
  model_ = models.CausalLM(cfg, optimizer=opt)
  data = jax.ShapeDtypeStruct((1, tokens + 1), jnp.int32)
  loss_fn = functools.partial(bench_models._loss, model_.apply, kind="lean")  # pylint: disable=protected-access
  row = {"model": model, "impl": impl, "layers": layers, "tokens": tokens, "backend": backend,
         "attention": attention, "kernel_compile": kernel_compile, "guard": guard, "remat": remat}
  if platforms:
    row["lowered_for"] = ",".join(platforms)
  tick = time.perf_counter()
  state = jax.eval_shape(lambda: forge_jax.TrainState.create(
      model_.apply, model_.init(jax.random.PRNGKey(1), jnp.zeros((1, tokens), jnp.int32)), opt))
  row["abstract_s"] = time.perf_counter() - tick
  tick = time.perf_counter()
  traced = _train._train_step_jit.trace(state, data, loss_fn, False, guard)  # pylint: disable=protected-access
  row["trace_s"] = time.perf_counter() - tick
  counts = count_eqns(traced.jaxpr.jaxpr, collections.Counter())
  row.update(jaxpr_eqns=sum(counts.values()), top_primitives=counts.most_common(10))
  tick = time.perf_counter()
  # From here the kernel pool compiles the step's Mosaic GPU kernels (on a GPU).
  with mosaic_lowering_seconds() as kernels:
    lowered = traced.lower(lowering_platforms=platforms) if platforms else traced.lower()
  row["lower_s"] = time.perf_counter() - tick
  if kernels:
    row["mosaic_lowering"] = kernels
  if compile_step:
    if trace_compile:
      compiled, row["compile_s"], events = traced_compile(lowered)
      row.update(events)
    else:
      tick = time.perf_counter()
      compiled = lowered.compile()
      row["compile_s"] = time.perf_counter() - tick
    text = compiled.as_text()
    row.update(fusion_stats(text))
    row.update(custom_call_stats(text))
  # Counted after the compile: printing the StableHLO takes seconds, which would otherwise give
  # the kernel pool a head start a training run does not have.
  text = lowered.as_text()
  row["stablehlo_ops"] = len(re.findall(r"= \"?[a-z_]+\.[a-z_]+", text))
  if platforms:
    row["mosaic_kernels"] = len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text))
  return row


# XLA's GPU compiler times its two phases with scoped timers, logged at VLOG level 1 of
# gpu_compiler.cc: "GpuCompiler::RunHloPasses for jit__train_step time: 4.05 s (4054298 us) ...".
XLA_TIMER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "gpu_compiler=1"}
_XLA_PHASES = {"RunHloPasses": "xla_hlo_passes_s", "RunBackend": "xla_backend_s"}


def xla_phase_seconds(log: str, module: str = "jit__train_step") -> dict:
  """XLA's GPU compile phases for ``module`` from its timer lines in ``log`` (seconds, summed
  over repeated lines): HLO passes, and the backend (XLA's own kernels to PTX and cubin, the
  custom calls' compiles such as Mosaic GPU's ptxas runs, thunk emission)."""
  out = {}
  for phase, key in _XLA_PHASES.items():
    for us in re.findall(rf"GpuCompiler::{phase} for {re.escape(module)} time: .*?\((\d+) us\)", log):
      out[key] = out.get(key, 0.0) + int(us) / 1e6
  return out


def measure_fresh(model: str, impl: str, layers: int, tokens: int, compile_step: bool,
                  attention: str, xla_timers: bool = False, trace_compile: bool = False,
                  kernel_compile: str = "parallel", guard: bool = True,
                  remat: str = "none", lower_for: Optional[str] = None) -> dict:
  """:func:`measure` in a new Python process: nothing traced, lowered or compiled before it
  (jax's in-process caches, Mosaic GPU's compiled kernels) shortens its times. ``xla_timers``:
  also XLA's compile phases (:func:`xla_phase_seconds`; GPU only), from its log."""
  with tempfile.TemporaryDirectory() as folder:
    cmd = [sys.executable, "-m", "experiments.compile_cost", "--model", model, "--impls", impl,
           "--layers", str(layers), "--tokens", str(tokens), "--attention", attention,
           "--kernel-compile", kernel_compile, "--guard", "on" if guard else "off", "--remat", remat,
           "--out", folder]
    env = dict(os.environ, **(XLA_TIMER_ENV if xla_timers else {}))
    cmd += (["--compile"] if compile_step else []) + (["--trace-compile"] if trace_compile else [])
    cmd += ["--lower-for", lower_for] if lower_for else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} ended with {proc.returncode}: {proc.stderr[-2000:]}")
    with open(os.path.join(folder, "compile_cost.json")) as f:
      row = json.load(f)["rows"][0]
  return dict(row, **(xla_phase_seconds(proc.stderr) if xla_timers else {}))


def label(row: dict) -> str:
  """The impl, marked with its activation checkpointing other than none, and when its Mosaic GPU
  kernels compiled one after another or its step has no non-finite guard."""
  return (row["impl"] + (f" [remat {row['remat']}]" if row.get("remat", "none") != "none" else "")
          + (f" [lowered for {row['lowered_for']}]" if row.get("lowered_for") else "")
          + (" [serial kernels]" if row.get("kernel_compile") == "serial" else "")
          + (" [no guard]" if row.get("guard") is False else ""))


def total_s(row: dict) -> float:
  """Seconds from the abstract state to a compiled step (or a lowered one without --compile)."""
  return row["trace_s"] + row["lower_s"] + row.get("compile_s", 0.0)


def markdown(info: dict, rows: list[dict]) -> str:
  out = ["# What the training step hands the compiler", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}. Seconds on a "
         "shared host are indicative; the counts are exact.", "",
         "| impl | layers | jaxpr eqns | StableHLO ops | fusions (distinct) | custom calls (in fusions) "
         "| trace s | lower s | compile s (XLA: HLO passes + backend) | total s |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    fus = f"{r['fusions']} ({r['distinct_fusions']})" if "fusions" in r else "-"
    calls = (f"{sum(r['custom_calls'].values())} ({sum(r['fused_custom_calls'].values())})"
             if "custom_calls" in r else f"{r['mosaic_kernels']} Mosaic GPU" if "mosaic_kernels" in r
             else "-")
    comp = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
    if "xla_hlo_passes_s" in r or "xla_backend_s" in r:
      comp += f" ({r.get('xla_hlo_passes_s', 0):.1f} + {r.get('xla_backend_s', 0):.1f})"
    out.append(f"| {label(r)} | {r['layers']} | {r['jaxpr_eqns']} | {r['stablehlo_ops']} | {fus} | "
               f"{calls} | {r['trace_s']:.1f} | {r['lower_s']:.1f} | {comp} | {total_s(r):.1f} |")
  by_impl = collections.defaultdict(list)
  for r in rows:
    by_impl[label(r)].append(total_s(r))
  if any(len(v) > 1 for v in by_impl.values()):
    out += ["", "Total seconds, median of " + ("each impl's repeats, each in a new process:"
                                               if info.get("fresh") else "each impl's repeats:"), ""]
    out += [f"- {impl}: {statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})"
            for impl, v in by_impl.items()]
  # The lists below show each impl's first repeat (the counts do not change between repeats).
  firsts: dict = {}
  for r in rows:
    firsts.setdefault(label(r), r)
  first = list(firsts.values())
  out += ["", "Most frequent primitives:", ""]
  out += [f"- {label(r)}: " + ", ".join(f"{p} {n}" for p, n in r["top_primitives"]) for r in first]
  if any(r.get("compile_events") for r in first):
    out += ["", "Compile events on the host (first repeat; ms summed by name, longest first), and "
            "each Mosaic GPU kernel's compile (ms):", ""]
    for r in (r for r in first if r.get("compile_events")):
      out.append(f"- {label(r)}: " + ", ".join(f"{e['name']} {e['ms']:.0f} ({e['count']})"
                                                  for e in r["compile_events"][:12]))
      kernels = r.get("mosaic_compile_ms", [])
      span = (f" (from the first's start to the last's end {r['mosaic_compile_span_ms'] / 1e3:.1f} s, "
              f"on {r['mosaic_compile_threads']} host thread(s))" if "mosaic_compile_span_ms" in r else "")
      out.append(f"  - Mosaic GPU kernels: {len(kernels)}, {sum(kernels) / 1e3:.1f} s{span}: "
                 + ", ".join(f"{ms:.0f}" for ms in kernels))
  if any(r.get("mosaic_lowering") for r in first):
    out += ["", "Lowering the Mosaic GPU kernels (first repeat; the seconds each kernel's jaxpr took "
            "to become its Mosaic GPU module, part of `lower s`; kernels of one name and inputs "
            "summed, longest first):", ""]
    for r in (r for r in first if r.get("mosaic_lowering")):
      total = sum(k["s"] for k in r["mosaic_lowering"])
      out.append(f"- {label(r)}: {len(r['mosaic_lowering'])} kernels, {total:.2f} s of "
                 f"{r['lower_s']:.2f}")
      groups: dict = collections.defaultdict(list)
      for k in r["mosaic_lowering"]:
        groups[(k["kernel"], k["inputs"])].append(k["s"])
      for (kernel, inputs), secs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"  - {kernel} ({inputs}): {sum(secs):.3f} s" + (f" ({len(secs)})" if len(secs) > 1 else ""))
  if any(r.get("custom_calls") for r in first):
    out += ["", "Custom calls by target:", ""]
    for r in (r for r in first if r.get("custom_calls")):
      out.append(f"- {label(r)}: " + ", ".join(f"{t} {n}" for t, n in r["custom_calls"].items()))
      if r.get("fused_custom_calls"):
        out.append("  - inside fusions: " + ", ".join(f"{t} ({n})" for t, n in r["fused_custom_calls"].items()))
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="qwen3-0.6b")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--impls", default="forge_unrolled,forge_int8_unrolled")
  parser.add_argument("--compile", action="store_true", help="also compile (and count fusions)")
  parser.add_argument("--attention", default="xla", choices=("xla", "auto", "cudnn"),
                      help="the models' attention (auto: cuDNN on a GPU, as bench_models runs them)")
  parser.add_argument("--repeats", type=int, default=1, help="measurements per impl (default 1)")
  parser.add_argument("--fresh", action="store_true",
                      help="each measurement in a new Python process (compile seconds one at a time, "
                           "no cache shared between impls)")
  parser.add_argument("--xla-timers", action="store_true",
                      help="with --fresh --compile on a GPU: also XLA's compile phases (HLO passes, "
                           "backend) from its own timers")
  parser.add_argument("--trace-compile", action="store_true",
                      help="with --compile: the compile under jax.profiler.trace; records its host "
                           "events by name and each Mosaic GPU kernel's compile time")
  parser.add_argument("--kernel-compile", default="parallel",
                      help="parallel: the step's Mosaic GPU kernels compiled on a thread pool while "
                           "XLA compiles the rest (forge_jax's default); serial: by XLA, one after "
                           "another; parallel,serial: both, side by side (default parallel)")
  parser.add_argument("--remat", default="none",
                      help="the models' activation checkpointing: none (default), full or a "
                           "jax.checkpoint_policies name")
  parser.add_argument("--guard", default="on",
                      help="on: train_step's non-finite guard (its default, skip_nonfinite=True); "
                           "off: skip_nonfinite=False; on,off: both, side by side (default on)")
  parser.add_argument("--lower-for", default=None, choices=("cuda",),
                      help="cuda: trace and lower the step a Hopper GPU compiles (Mosaic kernels "
                           "included) on this host, without compiling it")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  def choices(flag: str, value: str, allowed: tuple) -> list:
    picked = value.split(",")
    if not picked or any(v not in allowed for v in picked):
      parser.error(f"{flag} {value}: {', '.join(allowed)} or both, comma-separated")
    return picked
  guards = choices("--guard", args.guard, ("on", "off"))
  modes = choices("--kernel-compile", args.kernel_compile, ("parallel", "serial"))
  if args.repeats < 1:
    parser.error(f"--repeats {args.repeats}: at least 1")
  if args.trace_compile and not args.compile:
    parser.error("--trace-compile traces the compile: give --compile with it")
  if args.lower_for and args.compile:
    parser.error("--lower-for cuda lowers for a GPU this host cannot compile for: drop --compile")
  if args.xla_timers and not (args.fresh and args.compile):
    parser.error("--xla-timers reads a new process's log: give --fresh --compile with it")
  folder = _timing.out_dir(args.out)
  info = dict(_timing.run_info("experiments.compile_cost", argv), fresh=args.fresh)
  rows = []
  for repeat in range(args.repeats):
    for impl, mode, guard in itertools.product(args.impls.split(","), modes, guards):
      if args.fresh:
        row = measure_fresh(args.model, impl, args.layers, args.tokens, args.compile, args.attention,
                            args.xla_timers, args.trace_compile, mode, guard == "on", args.remat,
                            args.lower_for)
      else:
        row = measure(args.model, impl, args.layers, args.tokens, args.compile, args.attention,
                      args.trace_compile, mode, guard == "on", args.remat, args.lower_for)
      rows.append(dict(row, repeat=repeat))
      _timing.log(f"  {impl}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in rows[-1].items() if k != "top_primitives"))
      _timing.write_json(folder / "compile_cost.json", {"info": info, "rows": rows})
  _timing.write_table(folder / "compile_cost.md", markdown(info, rows), folder / "compile_cost.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
