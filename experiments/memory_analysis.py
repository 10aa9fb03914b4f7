"""Compile-only memory analysis of a model's init and train step (no allocation).

XLA's ``compiled.memory_analysis()`` splits a program's memory into
arguments, outputs, aliased (donated and reused) bytes and temporaries. This
script compiles ``jax.jit(model.init)`` and one training step for each
implementation of :mod:`experiments.bench_models` from abstract shapes only
(``jax.eval_shape``), so it runs in seconds even for 8B models and shows
*where* a peak comes from (states, temporaries, an init transient), which the
runtime peak of ``bench_models`` cannot. ``--hlo`` also writes each step's
optimized HLO and counts its weight-stack-sized buffers by opcode.

    PYTHONPATH=$PWD python -m experiments.memory_analysis --model qwen3-0.6b \\
        --impls forge,forge_int8 --out $OUT/memory_analysis --hlo
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import os
import sys
import time

import jax

import forge_jax
import models
from experiments import bench_models, runlog

GIB = 2**30


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _sizes(ma) -> dict:
  """XLA's buffer sizes of a compiled program in GiB, and ``step_gib``: arguments + outputs -
  aliased + temporaries (as ``runlog.xla_memory``), what it needs resident at its peak."""
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")
  sizes = {k.replace("_size_in_bytes", "_gib"): getattr(ma, k, float("nan")) / GIB for k in keys}
  sizes["step_gib"] = (sizes["argument_gib"] + sizes["output_gib"] - sizes["alias_gib"]
                       + sizes["temp_gib"])
  return sizes


def _nbytes(tree) -> float:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / GIB


def stack_buffers(hlo: str, shapes) -> dict:
  """Counts of ``opcode`` for instructions whose result is one of ``shapes`` (any dtype)."""
  shapes = {tuple(s) for s in shapes}
  counts = collections.Counter(f"{i.dtype} {i.opcode}" for i in runlog.hlo_instructions(hlo)
                               if i.dims in shapes)
  return dict(counts.most_common())


def analyse(model_name: str, impl: str, batch: int, tokens: int, dtype: str, hlo_dir=None,
            loss: str = "lean", layers: int | None = None, with_init: bool = True) -> dict:
  """One row: the compiled step's memory (and ``model.init``'s unless ``with_init`` is False)."""
  base, scan = bench_models.parse_impl(impl)
  base, backend = bench_models.forge_backend(base)
  linear = "forge" if base.startswith("forge") else "flax"
  cut = {} if layers is None else {"num_layers": layers}
  cfg = models.get_config(model_name, linear=linear, remat=bench_models.REMAT, scan_layers=scan,
                          forge_backend=backend, param_dtype=dtype, dtype=dtype, **cut)
  opt = bench_models._forge_optimizer(base)
  model = models.CausalLM(cfg, optimizer=opt)
  data = jax.ShapeDtypeStruct((batch, tokens + 1), jax.numpy.int32)
  key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.numpy.zeros((batch, tokens), "int32"))
  loss_fn = functools.partial(bench_models._loss, model.apply, kind=loss)
  row = {"model": model_name, "impl": impl, "batch": batch, "tokens": tokens, "dtype": dtype, "loss_fn": loss,
         "layers": cfg.num_layers,
         "params_gib": _nbytes(variables["params"])}
  if with_init:
    init = jax.jit(model.init).lower(key, jax.ShapeDtypeStruct((batch, tokens), jax.numpy.int32)).compile()
    row["init"] = _sizes(init.memory_analysis())
  if opt is not None:
    state = jax.eval_shape(lambda v: forge_jax.TrainState.create(model.apply, v, opt), variables)
    t0 = time.perf_counter()
    step = forge_jax.train_step.lower(state, data, loss_fn,
                                      skip_nonfinite=bench_models.skips_nonfinite(base)).compile()
    row["forge_state_gib"] = _nbytes(state.forge_state)
    row["opt_state_gib"] = _nbytes(state.opt_state)
  else:
    tx, optax_step = bench_models.optax_baseline(base, loss_fn)
    state = (variables["params"], jax.eval_shape(tx.init, variables["params"]))
    t0 = time.perf_counter()
    step = optax_step.lower(_abstract(state), data).compile()
    row["opt_state_gib"] = _nbytes(state[1])
  row["step_compile_s"] = time.perf_counter() - t0  # lowering + compiling the step
  row["step"] = _sizes(step.memory_analysis())
  row["state_gib"] = _nbytes(state)
  if hlo_dir is not None:
    text = step.as_text()
    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"{model_name}_{impl}_{loss}_L{cfg.num_layers}.hlo.txt"), "w") as f:
      f.write(text)
    shapes = {tuple(x.shape) for x in jax.tree.leaves(variables["params"]) if x.ndim == 3}
    row["stack_buffers"] = stack_buffers(text, shapes)
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="qwen3-0.6b")
  parser.add_argument("--impls", default="optax,forge,forge_int8")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  parser.add_argument("--hlo", action="store_true", help="write each step's HLO and count stack-sized buffers")
  parser.add_argument("--loss", default="lean", help="comma list of bench_models.LOSSES: each impl with each")
  parser.add_argument("--layers", default=None,
                      help="comma list of layer counts to cut the model to (default: its own); "
                           "the markdown then gives each impl's temporaries per layer")
  args = parser.parse_args(argv)
  layer_counts = [None] if args.layers is None else [int(l) for l in args.layers.split(",")]
  if any(l is not None and l < 1 for l in layer_counts):
    parser.error(f"--layers must be positive integers (got {args.layers})")
  os.makedirs(args.out, exist_ok=True)
  rows = []
  losses = args.loss.split(",")
  for kind in losses:
    if kind not in bench_models.LOSSES:
      parser.error(f"--loss {kind!r}: choose from {', '.join(bench_models.LOSSES)}")
  for impl, kind, layers in [(i, k, l) for i in args.impls.split(",") for k in losses
                             for l in layer_counts]:
    try:
      rows.append(analyse(args.model, impl, args.batch, args.tokens, args.dtype,
                          os.path.join(args.out, "hlo") if args.hlo else None, kind, layers))
    except Exception as e:  # recorded, not fatal: the other impls still run
      rows.append({"model": args.model, "impl": impl, "layers": layers, "loss_fn": kind,
                   "error": f"{type(e).__name__}: {e}"[:500]})
    print(json.dumps(rows[-1]), flush=True)
    meta = {"command": "python -m experiments.memory_analysis " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    with open(os.path.join(args.out, "memory_analysis.json"), "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "memory_analysis.md"), "w") as f:
      f.write(markdown(rows, meta))
  return rows


def fit_line(points: dict) -> tuple[float, float]:
  """``(intercept, slope)`` of the least-squares line through ``{x: y}`` (two or more points)."""
  xs = sorted(points)
  if len(xs) < 2:
    raise ValueError(f"fitting a line needs two points, got {xs}")
  n, sx, sy = len(xs), sum(xs), sum(points[x] for x in xs)
  sxx, sxy = sum(x * x for x in xs), sum(x * points[x] for x in xs)
  slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
  return (sy - slope * sx) / n, slope


def per_layer(rows) -> list[dict]:
  """Per (impl, loss): the step's temporaries (GiB) by layer count, and their rise per layer:
  the least-squares slope over all counts (and its intercept)."""
  groups = collections.defaultdict(dict)
  for r in rows:
    if "error" not in r:
      groups[(r["impl"], r["loss_fn"])][r["layers"]] = r["step"]["temp_gib"]
  out = []
  for (impl, loss), temps in groups.items():
    ls = sorted(temps)
    const, slope = fit_line(temps) if len(ls) > 1 else (float("nan"), float("nan"))
    out.append({"impl": impl, "loss_fn": loss, "temp_gib": {l: temps[l] for l in ls},
                "slope_gib_per_layer": slope, "constant_gib": const})
  return out


def markdown(rows, meta) -> str:
  lines = ["# Compile-only memory analysis", "",
           f"`{meta['command']}`; {meta['date']}; {meta['device']}; jax {meta['jax']}.", "",
           "Temporaries of the compiled train step (XLA's `temp_size`), GiB, by layer count; "
           "`per layer`: least-squares slope over the counts.", ""]
  groups = per_layer(rows)
  counts = sorted({l for g in groups for l in g["temp_gib"]})
  if groups:
    lines += ["| impl | loss | " + " | ".join(f"L={l}" for l in counts) + " | per layer | constant |",
              "|---|---|" + "---|" * (len(counts) + 2)]
  fmt = lambda x: "" if x != x else f"{x:.3f}"
  for g in groups:
    cells = [fmt(g["temp_gib"].get(l, float("nan"))) for l in counts]
    lines.append(f"| {g['impl']} | {g['loss_fn']} | " + " | ".join(cells)
                 + f" | {fmt(g['slope_gib_per_layer'])} | {fmt(g['constant_gib'])} |")
  for r in rows:
    if "error" in r:
      lines.append(f"\n* `{r['impl']}` L={r.get('layers')}: {r['error']}")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
