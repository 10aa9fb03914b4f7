"""Host time to lower an unrolled FORGE train step with the Mosaic kernel (CPU, cuda cross-lowering).

On the H200 the unrolled qwen3-0.6b FORGE row timed out at 280 s
(results/h200/bench_models_unrolled_mosaic.md) while optax's ran. The cause: every call of the
Mosaic kernel was traced and lowered on its own (about 1.7 s each: the measurement below), and an
unrolled model calls it once per projection per layer. Since commit 1c5b8c1 the kernel goes
through one ``jax.jit`` per (shapes, rule, tiling), so a module lowers one kernel per distinct
shape. This script measures both on the host, without a GPU: it fakes a Hopper GPU for
``backend="auto"``, builds ``models.CausalLM`` (qwen3-0.6b, unrolled, bf16, full remat) with
abstract weights, and lowers ``forge_jax.train_step`` for ``cuda``. ``per_call`` reproduces the
old path by calling the kernel's uncached launch.

    PYTHONPATH=$PWD python -m experiments.lowering_time --out experiments/results/cpu/unrolled_lowering

Each case runs in its own process. Writes ``lowering_time.json`` and ``.md``: trace and lowering
seconds, module size and the number of Mosaic custom calls in it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

CASES = ((4, "per_call"), (4, "cached"), (28, "cached"), (28, "per_call"))


def worker(layers: int, mode: str, model: str) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import forge_jax  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from forge_jax import _fused, _train  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  _fused._platform = lambda: "gpu"  # "auto" then takes the Mosaic kernel ...
  fm._device_problem = lambda: None  # ... which then sees a Hopper GPU
  if mode == "per_call":
    fm._launch_cached = fm._launch  # the path before the trace cache
  cfg = models.get_config(model, linear="forge", remat="full", scan_layers=False, forge_backend="auto",
                          param_dtype="bfloat16", dtype="bfloat16", attention="xla", num_layers=layers)
  opt = forge_jax.adamw(1e-5, weight_decay=0.0)
  lm = models.CausalLM(cfg, optimizer=opt)
  tokens = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  variables = jax.eval_shape(lm.init, jax.random.PRNGKey(1), tokens)
  state = jax.eval_shape(lambda v: forge_jax.TrainState.create(lm.apply, v, opt), variables)
  data = jax.ShapeDtypeStruct((1, 1025), jnp.int32)

  def loss_fn(v, d):
    return models.cross_entropy(lm.apply(v, d[:, :-1]), d[:, 1:])

  t0 = time.perf_counter()
  traced = _train._train_step_jit.trace(state, data, loss_fn, False)
  t1 = time.perf_counter()
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  t2 = time.perf_counter()
  return {"model": model, "layers": layers, "mode": mode, "trace_s": round(t1 - t0, 2),
          "lower_s": round(t2 - t1, 2), "module_mb": round(len(text) / 1e6, 2),
          "mosaic_custom_calls": len(re.findall(r"custom_call @mosaic_gpu", text)),
          "jax": jax.__version__}


def markdown(info: dict, rows: Sequence[dict]) -> str:
  out = ["# Lowering an unrolled FORGE step with the Mosaic kernel (host time)", "",
         f"`{info['command']}`; {info['date']}; {info['device']} ({info['platform']}, cross-lowering for "
         f"cuda); jax {info['jax']}.", "",
         "`per_call`: every kernel call traced and lowered on its own (before the trace cache); `cached`: "
         "one lowering per distinct shape.", "",
         "| model | layers | mode | status | trace s | lower s | module MB | Mosaic custom calls |",
         "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r.get("status") != "ok":
      out.append(f"| {r['model']} | {r['layers']} | {r['mode']} | {r.get('status')}: {r.get('error', '')[:80]} "
                 "| | | | |")
      continue
    out.append(f"| {r['model']} | {r['layers']} | {r['mode']} | ok | {r['trace_s']} | {r['lower_s']} | "
               f"{r['module_mb']} | {r['mosaic_custom_calls']} |")
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--model", default="qwen3-0.6b")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
  parser.add_argument("--cases", nargs="+", default=[f"{n}:{m}" for n, m in CASES],
                      help="LAYERS:MODE pairs, MODE per_call or cached")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    layers, mode = args.worker.split(":")
    print("ROW " + json.dumps(worker(int(layers), mode, args.model)), flush=True)
    return 0
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.lowering_time", argv)
  rows = []
  for case in args.cases:
    layers, mode = case.split(":")
    if mode not in ("per_call", "cached"):
      parser.error(f"--cases {case!r}: MODE must be per_call or cached")
    base = {"model": args.model, "layers": int(layers), "mode": mode}
    cmd = [sys.executable, "-m", "experiments.lowering_time", "--worker", case, "--model", args.model]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
      row = dict(base, status="timeout", error=f"over {args.timeout:.0f} s")
    else:
      found = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
      row = dict(found[0], status="ok") if found else dict(
          base, status="error", error=(proc.stderr.strip().splitlines() or [""])[-1][:300])
    rows.append(row)
    _timing.log(f"  {case}: {row}")
    _timing.write_json(folder / "lowering_time.json", {"info": info, "rows": rows})
  (folder / "lowering_time.md").write_text(markdown(info, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
