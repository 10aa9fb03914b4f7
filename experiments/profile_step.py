"""Where a whole training step's device time goes: kernels by class, side by side per implementation.

``bench_models`` says how long a step takes; this says on what. Each
implementation runs in its own process (as in ``bench_models``, with the same
model, batch, precision, attention and checkpointing: ``bench_models.build_step``),
warms up, then runs ``--steps`` steps back to back under ``jax.profiler.trace``
and blocks once. The trace's device events (kernels on the GPU's streams, read
with ``jax.profiler.ProfileData``) are summed per class and per kernel and
divided by the number of steps:

* ``forge kernel``: the fused dW + update kernels (``fused_dw_update*``);
* ``attention``: cuDNN / flash attention;
* ``gemm``: cuBLAS / cuBLASLt / XLA Triton GEMMs;
* ``dynamic-update-slice``: in-place slice writes (the scanned stacks' updates);
* ``copy / transpose``, ``reduction``, ``fusion``: XLA's own kernels;
* ``other custom call``, ``other``.

Written for the questions the step tables leave open (``RESULTS.md``): what
the ``"xla"`` backend's 46 ms over the kernel's step are, and why unrolled
steps are faster than scanned ones. The profiled step time is longer than
``bench_models``' (the profiler costs time, and XLA runs without CUDA-graph
command buffers while a profiler session is active, unless
``--xla_enable_command_buffers_during_profiling``): compare the classes, side
by side, not the absolute figure against other runs, and do not read launch
overhead from it. ``meta`` records ``XLA_FLAGS``.

On a GPU only events with kernel, memcpy or memset details count (CUPTI's
own overhead records, on a line of their own, do not).

    python -m experiments.profile_step --out $OUT --model llama-3.1-8b --impls optax,forge,forge_xla

On CPU (how it is tested) there is no device plane: the XLA:CPU client's
thunk events stand in, so the classes are CPU ones.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Iterable, NamedTuple

CLASSES = (
    ("forge kernel", ("fused_dw_update",)),
    ("attention", ("cudnn", "flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "xmma", "nvjet", "cublas", "cutlass", "matmul", "dot_general", "dot.")),
    ("dynamic-update-slice", ("dynamic_update_slice", "dynamic-update-slice")),
    ("copy / transpose", ("copy", "memcpy", "memset", "transpose")),
    ("reduction", ("reduce", "reduction")),
    ("fusion", ("fusion", "loop_", "triton", "ynn", "wrapped_")),
)
OTHER_CUSTOM, OTHER = "other custom call", "other"
CLASS_NAMES = tuple(c for c, _ in CLASSES) + (OTHER_CUSTOM, OTHER)
_HOST_MARKERS = ("ThreadpoolListener", "SlinkyThreadPool", "end: ")
# XLA:CPU events that enclose other thunks' events (counted through those).
_HOST_ENCLOSING = ("ThunkExecutor", "while", "conditional", "call")


class Event(NamedTuple):
  name: str
  hlo_op: str
  duration_ns: float


def classify(name: str, hlo_op: str = "") -> str:
  """The class of a kernel, from its name first, then its HLO op's name."""
  for text in (name.lower(), hlo_op.lower()):
    for cls, keys in CLASSES:
      if any(k in text for k in keys):
        return cls
  return OTHER_CUSTOM if hlo_op.startswith("custom-call") else OTHER


_DEVICE_WORK = ("kernel_details", "memcpy_details", "memset_details")


def device_events(profile) -> tuple[str, list[Event]]:
  """``(source, events)``: the kernels of a ``jax.profiler.ProfileData``.

  GPU: the events of the ``/device:*`` planes that carry kernel, memcpy or
  memset details (CUPTI's overhead records and counters do not); if no event
  carries them (another profiler format), every event of the ``Stream #``
  lines. Without a device plane (CPU), the XLA:CPU client's thunk events,
  markers and enclosing thunks left out.
  """
  planes = [p for p in profile.planes if p.name.startswith("/device:")]
  if planes:
    source = ",".join(p.name for p in planes)
    raw = [(l.name, e, dict(e.stats)) for p in planes for l in p.lines for e in l.events]
    work = [(e, st) for _, e, st in raw if any(k in st for k in _DEVICE_WORK)]
    if not work:
      work = [(e, st) for name, e, st in raw if name.startswith("Stream #")]
      source += " (Stream lines: no kernel details found)"
  else:
    source = "host (no device plane: XLA:CPU thunks)"
    skip = _HOST_MARKERS + _HOST_ENCLOSING
    work = [(e, dict(e.stats)) for p in profile.planes if p.name.startswith("/host:")
            for l in p.lines if "PjRtCpuClient" in l.name or "XLAEigen" in l.name
            for e in l.events if not e.name.startswith(skip)]
  return source, [Event(e.name, str(st.get("hlo_op", "")), float(e.duration_ns)) for e, st in work]


def summarize(events: Iterable[Event], steps: int, top: int = 20) -> dict:
  """Per-step milliseconds and calls by class and by kernel (name, HLO op)."""
  by_class = {c: [0.0, 0] for c in CLASS_NAMES}
  by_kernel: dict = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    cls = classify(e.name, e.hlo_op)
    by_class[cls][0] += e.duration_ns
    by_class[cls][1] += 1
    k = by_kernel[(e.name, e.hlo_op, cls)]
    k[0] += e.duration_ns
    k[1] += 1
  per_step = lambda ns: ns / 1e6 / steps
  kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])
  return {
      "device_busy_ms": per_step(sum(ns for ns, _ in by_class.values())),
      "classes": {c: {"ms": per_step(ns), "calls": n / steps} for c, (ns, n) in by_class.items()},
      "top": [{"name": name[:160], "hlo_op": op, "class": cls, "ms": per_step(ns), "calls": n / steps}
              for (name, op, cls), (ns, n) in kernels[:top]],
      "kernels": len(by_kernel),
  }


def _profile_data():
  """``ProfileData``: public as ``jax.profiler.ProfileData`` (jax 0.10.2), else jaxlib's own."""
  import jax
  if hasattr(jax.profiler, "ProfileData"):
    return jax.profiler.ProfileData
  from jaxlib import _profile_data  # pylint: disable=import-outside-toplevel
  return _profile_data.ProfileData


def worker(model: str, impl: str, batch: int, tokens: int, dtype: str, attention: str, loss: str,
           steps: int, trace_dir: str, layers: int | None = None) -> dict:
  import jax

  from experiments import bench_models

  row, step, carry = bench_models.build_step(model, impl, batch, tokens, dtype, attention, loss,
                                             layers=layers)
  for _ in range(3):  # warm-up, as bench_models
    carry = step(carry[0])
  jax.block_until_ready(carry)
  with jax.profiler.trace(trace_dir):
    t0 = time.perf_counter()
    for _ in range(steps):
      carry = step(carry[0])
    jax.block_until_ready(carry)
    row["profiled_step_ms"] = (time.perf_counter() - t0) * 1e3 / steps
  row["loss"] = float(carry[1]["loss"])
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
  source, events = device_events(_profile_data().from_file(max(paths, key=os.path.getmtime)))
  row["source"] = source
  row["steps"] = steps
  row.update(summarize(events, steps))
  return row


def markdown(rows: list[dict], meta: dict) -> str:
  ok = [r for r in rows if "error" not in r]
  out = ["# Where a training step's device time goes", "",
         f"Command: `{meta['command']}`  ",
         f"Date: {meta['date']}; device {meta['device']}; jax {meta['jax']}.  ",
         f"Model {meta['model']}" + (f" with {meta['layers']} layers" if meta.get("layers") else "")
         + f", {meta['batch']}x{meta['tokens']} tokens, {meta['dtype']}; XLA_FLAGS "
         f"`{meta.get('xla_flags') or '(none)'}`.  ",
         f"{meta['steps']} steps back to back under `jax.profiler.trace` after 3 warm-up steps, blocked "
         "once; per-step milliseconds of kernels summed per class (kernels on concurrent streams can "
         "sum to more than the step). `profiled step`: host clock over the traced steps / steps "
         "(the profiler slows the step: compare classes side by side, not with bench_models).", ""]
  for r in rows:
    if "error" in r:
      out.append(f"* `{r['impl']}`: {r['error']}")
  if not ok:
    return "\n".join(out) + "\n"
  out += ["", "| class | " + " | ".join(r["impl"] for r in ok) + " |",
          "|---|" + "---|" * len(ok)]
  out.append("| profiled step ms | " + " | ".join(f"{r['profiled_step_ms']:.1f}" for r in ok) + " |")
  out.append("| device busy ms | " + " | ".join(f"{r['device_busy_ms']:.1f}" for r in ok) + " |")
  for c in CLASS_NAMES:
    if any(r["classes"][c]["calls"] for r in ok):
      cells = [f"{r['classes'][c]['ms']:.2f} ({r['classes'][c]['calls']:.0f})" for r in ok]
      out.append(f"| {c} ms (calls) | " + " | ".join(cells) + " |")
  for r in ok:
    out += ["", f"## {r['impl']}: the {len(r['top'])} longest kernels of {r['kernels']} "
            f"({r['source']})", "", "| kernel | HLO op | class | ms per step | calls per step |",
            "|---|---|---|---|---|"]
    for k in r["top"]:
      name = k["name"].replace("|", "/")
      out.append(f"| `{name[:90]}` | {k['hlo_op']} | {k['class']} | {k['ms']:.3f} | {k['calls']:.0f} |")
  return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str):
  ok = [r for r in rows if "error" not in r]
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  if not ok:
    return None
  fig, ax = plt.subplots(figsize=(8, 0.6 * len(ok) + 1.5))
  left = [0.0] * len(ok)
  for c in CLASS_NAMES:
    widths = [r["classes"][c]["ms"] for r in ok]
    if any(widths):
      ax.barh([r["impl"] for r in ok], widths, left=left, label=c)
      left = [a + b for a, b in zip(left, widths)]
  ax.set_xlabel("device ms per step (kernels summed per class)")
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  parser.add_argument("--model", default="qwen3-0.6b")
  parser.add_argument("--impls", default="optax,forge",
                      help="comma list of experiments.bench_models implementations")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--attention", default="auto")
  parser.add_argument("--loss", default="lean", choices=("lean", "optax"))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--layers", type=int, default=None,
                      help="give the model this many layers (an unrolled 32-layer step compiles "
                           "for minutes; per-layer kernels show at a few)")
  parser.add_argument("--timeout", type=int, default=300, help="seconds per implementation")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  from experiments import bench_models
  impls = args.impls.split(",")
  for impl in impls:
    bench_models.parse_impl(impl)  # unknown names fail here, before any run
  if args.steps < 1 or args.batch < 1 or args.tokens < 1 or (args.layers or 1) < 1:
    raise SystemExit(f"--steps, --batch, --tokens and --layers must be >= 1 (got {args.steps}, "
                     f"{args.batch}, {args.tokens}, {args.layers})")
  if args.worker:
    with tempfile.TemporaryDirectory() as d:
      row = worker(args.model, args.worker, args.batch, args.tokens, args.dtype, args.attention,
                   args.loss, args.steps, d, args.layers)
    print("ROW " + json.dumps(row), flush=True)
    return row

  os.makedirs(args.out, exist_ok=True)
  import importlib.metadata
  meta = {"command": "python -m experiments.profile_step " + " ".join(argv),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": "unknown", "jax": importlib.metadata.version("jax"), "steps": args.steps,
          "model": args.model, "layers": args.layers, "batch": args.batch, "tokens": args.tokens,
          "dtype": args.dtype,
          "xla_flags": os.environ.get("XLA_FLAGS", "")}
  rows = []
  for impl in impls:
    cmd = [sys.executable, "-m", "experiments.profile_step", "--worker", impl, *argv]
    env = bench_models.worker_env(None)
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
      row = {"impl": impl, "error": f"timeout {args.timeout}s"}
    else:
      found = [l for l in proc.stdout.splitlines() if l.startswith("ROW ")]
      row = (json.loads(found[-1][4:]) if found else
             {"impl": impl, "error": bench_models._error(proc.stderr, proc.returncode)})
    rows.append(row)
    if "device" in row:
      meta["device"] = row["device"]
    print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
    # Written after every implementation: a call cut short keeps the rows it finished.
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = markdown(rows, meta)
    with open(os.path.join(args.out, "profile_step.md"), "w") as f:
      f.write(md)
    plot(rows, os.path.join(args.out, "profile_step.png"))
  print(md)
  return rows


if __name__ == "__main__":
  main()
