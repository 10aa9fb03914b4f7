"""Compile-only memory of a tensor-parallel FORGE train step, per device, from shapes alone.

For each model and tensor-parallel size P it builds the TrainState as ``jax.ShapeDtypeStruct``s
placed on a P-device mesh (``models.shard_train_state``'s layout: no weights exist), compiles
one ``forge_jax.train_step`` on fake CPU devices and reports, per device: the bytes of the
weights and optimizer states it holds (from the shardings) and XLA's memory analysis of the
step (arguments, temporaries). P=1 is the model without a mesh. It also counts the step's
collectives whose operand has the shape of a FORGE weight or state (whole, per layer, or a
device's slice): there should be none.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=$PWD \\
        python -m experiments.parallel_memory --models llama-3.1-8b,qwen3-32b --sizes 1,8 \\
        --out experiments/results/cpu/parallel_memory

CPU temporaries are XLA:CPU's buffer assignment, not the GPU's (no cuDNN attention, other
fusions): read them as an order of magnitude; weights and states are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import forge_jax
import models
from experiments import bench_models

GIB = 2**30
_COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all)(-start)?\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _per_device_gib(tree) -> float:
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
  return total / GIB


def _weight_shapes(tree) -> set:
  shapes = set()
  for leaf in jax.tree.leaves(tree):
    if len(leaf.shape) < 2:
      continue
    for s in (tuple(leaf.shape), tuple(leaf.sharding.shard_shape(leaf.shape))):
      shapes.update({s, s[-2:]})
  return shapes


# A 70B-class model: Llama-3.1-70B's shapes (Hugging Face config.json of
# meta-llama/Llama-3.1-70B), from the 8B preset's family settings.
SHAPES = {
    "llama-3.1-70b": ("llama-3.1-8b", dict(hidden_size=8192, intermediate_size=28672,
                                           num_layers=80, num_heads=64, num_kv_heads=8)),
}


def config(model_name: str, **kw):
  preset, shape = SHAPES.get(model_name, (model_name, {}))
  return models.get_config(preset, **shape, **kw)


def analyse(model_name: str, impl: str, p: int, batch: int, tokens: int, sp: bool,
            block_p: int | None = None) -> dict:
  """One row; int8 blocks are chosen to fit a split over ``block_p`` devices (default ``p``),
  so that rows of several sizes compare the same states."""
  base = impl
  cfg = config(model_name, linear="forge", remat=bench_models.REMAT, scan_layers=True,
               forge_backend="xla", param_dtype="bfloat16", dtype="bfloat16")
  opt = bench_models._forge_optimizer(base)  # pylint: disable=protected-access
  block = None
  if opt.precision.state_dtype == "int8":
    # A column split keeps whole quantization blocks only if the block divides every N/P
    # (the vocabulary-parallel head's V/P: Llama-3's 128256/8 = 16032 = 32 * 501, Qwen3's
    # 151936/8 = 18992 = 16 * 1187): the largest power of two up to the default 64 that does.
    splits = [n // (block_p or p) for n in (cfg.vocab_size, cfg.intermediate_size,
                               cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)]
    block = max(b for b in (1, 2, 4, 8, 16, 32, 64) if all(n % b == 0 for n in splits))
    opt = forge_jax.adamw(1e-5, weight_decay=0.0, precision=dataclasses.replace(
        opt.precision, block_size=block))
  tp = None
  if p > 1:
    mesh = Mesh(np.array(jax.devices()[:p]), ("tensor",))
    tp = forge_jax.TensorParallel(mesh, "tensor", sequence_parallel=sp)
  model = models.CausalLM(cfg, optimizer=opt, tensor_parallel=tp)
  ids = jnp.zeros((batch, tokens), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids)
  state = jax.eval_shape(lambda v: forge_jax.TrainState.create(model.apply, v, opt), variables)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = (forge_jax.shard_tree(tp, state, models.TENSOR_PARALLEL_LAYOUT) if tp is not None
               else jax.tree.map(lambda _: device, state))
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       state, shardings)
  data = jax.ShapeDtypeStruct((batch, tokens + 1), jnp.int32)
  loss_fn = functools.partial(bench_models._loss, model.apply)  # pylint: disable=protected-access
  compiled = forge_jax.train_step.lower(state, data, loss_fn).compile()
  ma = compiled.memory_analysis()
  forge_tree = (state.forge_state, [v for k, v in forge_jax._dense.flat_variables(state.params).items()  # pylint: disable=protected-access
                                    if k in forge_jax._train.forge_paths(state.forge_state)])  # pylint: disable=protected-access
  banned = _weight_shapes(forge_tree)
  weight_collectives = []
  for line in compiled.as_text().splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(m.group(1))]
      weight_collectives += [f"{m.group(2)} {s}" for s in shapes if s in banned]
  return {
      "model": model_name, "impl": impl, "p": p, "int8_block": block, "sequence_parallel": sp and p > 1,
      "batch": batch, "tokens": tokens, "params_b": cfg.num_params / 1e9,
      "params_gib": _per_device_gib(state.params),
      "forge_states_gib": _per_device_gib(state.forge_state),
      "optax_states_gib": _per_device_gib(state.opt_state),
      "argument_gib": ma.argument_size_in_bytes / GIB,
      "temp_gib": ma.temp_size_in_bytes / GIB,
      "weight_collectives": weight_collectives,
  }


def markdown(rows, meta) -> str:
  lines = [
      "# Tensor-parallel FORGE: memory per device, compile-only",
      "",
      f"`{meta['command']}`",
      "",
      f"{meta['date']}, jax {meta['jax']}, {meta['devices']} (fake devices: shapes only, no "
      "weights). Weights and states per device come from the shardings; arguments and "
      "temporaries from XLA:CPU's memory analysis of the compiled step (per device).",
      "",
      "| model | impl | int8 block | P | SP | weights GiB | FORGE states GiB | optax states GiB | "
      "weights+states GiB | x of P=1 | step arguments GiB | temporaries GiB | weight collectives |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  base = {}
  for r in rows:
    total = r["params_gib"] + r["forge_states_gib"] + r["optax_states_gib"]
    if r["p"] == 1:
      base[(r["model"], r["impl"])] = total
    ratio = total / base.get((r["model"], r["impl"]), float("nan"))
    lines.append(
        f"| {r['model']} | {r['impl']} | {r['int8_block'] or ''} | {r['p']} | {'on' if r['sequence_parallel'] else 'off'} | "
        f"{r['params_gib']:.2f} | {r['forge_states_gib']:.2f} | {r['optax_states_gib']:.2f} | "
        f"{total:.2f} | {ratio:.3f} | {r['argument_gib']:.2f} | {r['temp_gib']:.2f} | "
        f"{len(r['weight_collectives'])} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="llama-3.1-8b,qwen3-32b,llama-3.1-70b")
  parser.add_argument("--impls", default="forge,forge_int8")
  parser.add_argument("--sizes", default="1,8")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--no-sp", action="store_true", help="sequence parallelism off")
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  args = parser.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",")]
  if max(sizes) > jax.device_count():
    raise SystemExit(f"--sizes {args.sizes} needs {max(sizes)} devices, this jax has "
                     f"{jax.device_count()}: set XLA_FLAGS=--xla_force_host_platform_device_count=8")
  rows = []
  for model_name in args.models.split(","):
    for impl in args.impls.split(","):
      for p in sizes:
        row = analyse(model_name, impl, p, args.batch, args.tokens, not args.no_sp, max(sizes))
        print(json.dumps(row), flush=True)
        rows.append(row)
  meta = {"command": "python -m experiments.parallel_memory " + " ".join(argv or sys.argv[1:]),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "jax": jax.__version__, "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "parallel_memory.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  with open(os.path.join(args.out, "parallel_memory.md"), "w") as f:
    f.write(markdown(rows, meta))
  print(markdown(rows, meta))


if __name__ == "__main__":
  main()
