"""Stack-sized copies in a compiled ScannedStack train step with the "xla" backend.

A FORGE step updates stacked weights and optimizer states in place; any copy
of a whole ``[L, K, N]`` stack inside the step is memory and traffic the
design should not have. This compiles one ``forge_jax.train_step`` of a small
ScannedStack (``--layers`` blocks of two FORGE Dense layers, ``K x N`` and
``N x K``) per optimizer and counts the HLO ``copy`` instructions whose
result has a stack's shape, next to XLA's temporary bytes and the state's.
The count is per instruction in the program, not per executed layer: a copy
inside the backward loop runs once per layer.

    python -m experiments.stack_copies --out experiments/results/cpu/stack_copies
    python -m experiments.stack_copies --dtype bfloat16

Writes ``stack_copies.json`` and ``stack_copies.md``. Compile-only: runs on
any backend (the CPU numbers are XLA:CPU's).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

import forge_jax
from experiments import _timing, runlog

OPTIMIZERS = {
    "adamw": "forge_jax.adamw(1e-3)",
    "rmsprop_centered_momentum": "forge_jax.rmsprop(1e-3, centered=True, momentum=0.9)",
    "sgd_momentum": "forge_jax.sgd(1e-2, momentum=0.9)",
    "sgd": "forge_jax.sgd(1e-2)",
    "adamw_int8": "forge_jax.adamw(1e-3, precision=forge_jax.Precision(state_dtype='int8'))",
}


def measure(opt_expr: str, layers: int, k: int, n: int, dtype: str) -> dict:
  opt = eval(opt_expr, {"forge_jax": forge_jax})  # pylint: disable=eval-used  (the table's own strings)
  param_dtype = jnp.dtype(dtype)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jax.nn.gelu(forge_jax.Dense(n, use_bias=False, optimizer=opt, param_dtype=param_dtype,
                                      backend="xla", name="up")(x))
      return x + forge_jax.Dense(k, use_bias=False, optimizer=opt, param_dtype=param_dtype,
                                 backend="xla", name="down")(h)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedStack(Block, layers, name="stack")(x)

  model = Model()
  x = jnp.ones((2, 16, k), param_dtype)
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), x), opt)

  def loss_fn(variables, batch):
    return jnp.mean(state.apply_fn(variables, batch).astype(jnp.float32) ** 2)

  compiled = forge_jax.train_step.lower(state, x, loss_fn).compile()
  stacks = {(layers, k, n), (layers, n, k)}
  copies = [i.line for i in runlog.hlo_instructions(compiled.as_text())
            if i.opcode == "copy" and i.dims in stacks]
  stats = compiled.memory_analysis()
  return {"stack_copies": len(copies), "temp_bytes": int(stats.temp_size_in_bytes),
          "state_bytes": int(sum(a.nbytes for a in jax.tree.leaves((state.params, state.forge_state)))),
          "copies": copies[:16]}


def markdown(info: dict, rows: list[dict]) -> str:
  out = ["# Stack-sized copies in a compiled ScannedStack train step (xla backend)", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
         "| optimizer | stack-sized copies | XLA temp bytes | state bytes |", "|---|---|---|---|"]
  out += [f"| {r['optimizer']} | {r['stack_copies']} | {r['temp_bytes']:,} | {r['state_bytes']:,} |"
          for r in rows]
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--k", type=int, default=64)
  p.add_argument("--n", type=int, default=128)
  p.add_argument("--dtype", default="float32", help="weights and states")
  p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
  args = p.parse_args(argv)
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.stack_copies", argv)
  rows = [{"optimizer": name, "dtype": args.dtype,
           **measure(OPTIMIZERS[name], args.layers, args.k, args.n, args.dtype)}
          for name in args.optimizers]
  _timing.write_json(folder / "stack_copies.json", {"info": info, "rows": rows})
  (folder / "stack_copies.md").write_text(markdown(info, rows))
  print(markdown(info, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
