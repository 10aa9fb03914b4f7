"""Why is an unrolled FORGE step slower than a scanned one? Copies, kernels, time.

On the H200 (``bench_models_unrolled_fixed``), qwen3-0.6b's FORGE step took
32.0 ms unrolled against 23.7 ms scanned, while optax's unrolled step was the
faster of its two (19.3 vs 20.7). This script compiles the same model at a few
layers (compiling the 28-layer unrolled step takes about three minutes) with
the layers scanned and unrolled, FORGE and optax, and per row records:

- the step time (device time: ``_timing.time_steps``, many steps back to back,
  blocked once, median of repeats) and its difference per layer;
- the compiled HLO's ``copy`` instructions, their shapes and bytes: a copy of a
  weight or state buffer means an update was not done in place;
- the number of custom calls (the fused kernels) and fusions;
- XLA's memory plan (``runlog.xla_memory``).

The compiled HLO text of each row goes to ``--out`` (gzipped) for reading.

    python -m experiments.diagnose_unrolled --out /tmp/diag --model qwen3-0.6b --layers 2 4

Runs on CPU too (FORGE then takes the xla backend), which is how it is tested.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import pathlib
import re
import sys

import jax
import numpy as np

from experiments import _timing, runlog
from experiments.bench_models import _forge_optimizer, _loss, forge_backend, optax_baseline

IMPLS = ("forge", "optax", "forge_xla", "forge_int8")  # bench_models' names
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "s32": 4, "u32": 4, "pred": 1,
          "s64": 8, "u64": 8, "f64": 8}


def copies(hlo_text: str) -> list[tuple[str, int]]:
  """``(shape, bytes)`` of every ``copy`` instruction in an HLO module's text."""
  return [(f"{i.dtype}[{','.join(map(str, i.dims))}]",
           int(np.prod(i.dims, dtype=np.int64)) * _BYTES.get(i.dtype, 4))
          for i in runlog.hlo_instructions(hlo_text) if i.opcode == "copy"]


def hlo_counts(hlo_text: str) -> dict:
  """Instructions of interest in a compiled module's text."""
  cps = copies(hlo_text)
  by_shape = collections.Counter(s for s, _ in cps)
  return {
      "copies": len(cps),
      "copy_mib": sum(b for _, b in cps) / 2**20,
      "copy_shapes": dict(by_shape.most_common(12)),
      "custom_calls": len(re.findall(r" custom-call\(", hlo_text)),
      "fusions": len(re.findall(r" fusion\(", hlo_text)),
      "while_loops": len(re.findall(r" while\(", hlo_text)),
  }


def row(model_name: str, impl: str, scan: bool, layers: int, *, tokens: int, dtype: str,
        out: pathlib.Path, iters: int) -> dict:
  import forge_jax
  import models

  base, backend = forge_backend(impl)
  linear = "forge" if base.startswith("forge") else "flax"
  cfg = models.get_config(model_name, linear=linear, remat="full", scan_layers=scan,
                          num_layers=layers, param_dtype=dtype, dtype=dtype, forge_backend=backend)
  data = jax.random.randint(jax.random.PRNGKey(0), (1, tokens + 1), 0, cfg.vocab_size)
  opt = _forge_optimizer(base)
  model = models.CausalLM(cfg, optimizer=opt)
  variables = jax.jit(model.init)(jax.random.PRNGKey(1), data[:, :-1])
  loss_fn = functools.partial(_loss, model.apply, kind="lean")
  if opt is not None:
    state = forge_jax.TrainState.create(model.apply, variables, opt)
    compiled = forge_jax.train_step.lower(state, data, loss_fn).compile()
  else:
    tx, optax_step = optax_baseline("optax", loss_fn)
    state = (variables["params"], tx.init(variables["params"]))
    compiled = optax_step.lower(state, data).compile()
  text = compiled.as_text()
  name = f"{impl}_{'scanned' if scan else 'unrolled'}_{layers}"
  with gzip.open(out / f"{name}.hlo.txt.gz", "wt") as f:
    f.write(text)
  step = lambda s: compiled(s, data)[0]
  timing, _ = _timing.time_steps(step, state, iters=iters)
  return {"impl": impl, "scan": scan, "layers": layers, "step_ms": timing.median_ms,
          "repeats_ms": timing.repeats_ms, **hlo_counts(text), **runlog.xla_memory(compiled)}


def markdown(rows: list[dict], meta: dict) -> str:
  lines = ["# Unrolled vs scanned FORGE steps: copies, kernels and time", "",
           f"`{meta['command']}`; {meta['date']}; {meta['device']}; jax {meta['jax']}.", "",
           f"Model {meta['model']} cut to the listed layer counts, 1x{meta['tokens']} tokens, "
           f"{meta['dtype']}, remat full, lean loss. Step time: device time (many steps back "
           "to back, blocked once, median of repeats). `ms/layer`: the step time's rise per "
           "layer between the smallest and largest layer count of the same implementation.",
           "", "| impl | layers | count | step ms | ms/layer | copies | copy MiB | custom calls "
           "| fusions | while | XLA step GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  slope = {}
  for key in {(r["impl"], r["scan"]) for r in rows}:
    rs = sorted((r for r in rows if (r["impl"], r["scan"]) == key), key=lambda r: r["layers"])
    if len(rs) > 1 and rs[-1]["layers"] > rs[0]["layers"]:
      slope[key] = (rs[-1]["step_ms"] - rs[0]["step_ms"]) / (rs[-1]["layers"] - rs[0]["layers"])
  for r in rows:
    key = (r["impl"], r["scan"])
    lines.append(
        f"| {r['impl']} | {'scanned' if r['scan'] else 'unrolled'} | {r['layers']} | "
        f"{r['step_ms']:.2f} | {slope[key]:.3f} |" if key in slope else
        f"| {r['impl']} | {'scanned' if r['scan'] else 'unrolled'} | {r['layers']} | "
        f"{r['step_ms']:.2f} | |")
    lines[-1] += (f" {r['copies']} | {r['copy_mib']:.1f} | {r['custom_calls']} | {r['fusions']} "
                  f"| {r['while_loops']} | {r.get('step_gib', float('nan')):.2f} |")
  lines += ["", "Copy shapes (most frequent) per row:", ""]
  for r in rows:
    lines.append(f"- {r['impl']} {'scanned' if r['scan'] else 'unrolled'} {r['layers']}: "
                 f"{r['copy_shapes'] or 'none'}")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--model", default="qwen3-0.6b")
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  parser.add_argument("--layouts", nargs="+", default=["scanned", "unrolled"],
                      choices=["scanned", "unrolled"])
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  meta = {**_timing.run_info("experiments.diagnose_unrolled", sys.argv[1:] if argv is None else argv),
          "model": args.model, "tokens": args.tokens,
          "dtype": args.dtype}
  rows = []
  for impl in args.impls:
    for scan in [layout == "scanned" for layout in args.layouts]:
      for layers in args.layers:
        r = row(args.model, impl, scan, layers, tokens=args.tokens, dtype=args.dtype, out=out,
                iters=args.iters)
        print(json.dumps({k: v for k, v in r.items() if k != "copy_shapes"}), flush=True)
        rows.append(r)
        _timing.write_json(out / "diagnose_unrolled.json", {"meta": meta, "rows": rows})
  (out / "diagnose_unrolled.md").write_text(markdown(rows, meta))
  print(markdown(rows, meta))
  return 0


if __name__ == "__main__":
  sys.exit(main())
