"""Peak memory and step time of a layer stack: optax vs FORGE, unrolled vs scanned.

Each row runs in a fresh process (peak memory is per process), with the same
model, batch, precision and activation checkpointing:

* the stack: ``--blocks`` residual blocks ``x + Dense(d)(gelu(Dense(hidden)(x)))``
  (two linear layers per block), fp32 weights, bf16 activations, every block
  checkpointed at its boundary (``nothing_saveable``) in every variant;
* variants: ``optax`` (optax.adamw, blocks unrolled), ``optax_scan``
  (optax.adamw, ``nn.scan``), ``optax_clip`` (``clip_by_global_norm(1.0)`` +
  adamw, unrolled), ``forge`` (forge_jax.adamw, unrolled), ``forge_scan``
  (forge_jax.ScannedStack).

For FORGE variants the compiled step's HLO is also searched for copies of
weight- or state-sized buffers (an in-place failure would show there).

    PYTHONPATH=$PWD python -m experiments.bench_memory --out $OUT

Writes ``bench_memory.json`` and ``bench_memory.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import subprocess
import sys
import time

VARIANTS = ("optax", "optax_scan", "optax_clip", "forge", "forge_scan")


def _build(variant: str, d: int, hidden: int, blocks: int):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax

  import forge_jax

  forge = variant.startswith("forge")
  opt = forge_jax.adamw(1e-4, weight_decay=0.0) if forge else None

  def dense(features, name):
    if forge:
      return forge_jax.Dense(features, use_bias=False, dtype=jnp.bfloat16, optimizer=opt, name=name)
    return nn.Dense(features, use_bias=False, dtype=jnp.bfloat16, name=name)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + dense(d, "down")(jax.nn.gelu(dense(hidden, "up")(x)))

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      if variant in ("optax_scan", "forge_scan"):
        return forge_jax.ScannedStack(Block, blocks, name="stack")(x)
      for i in range(blocks):
        x = nn.remat(Block, policy=jax.checkpoint_policies.nothing_saveable)(name=f"block_{i}")(x)
      return x

  if variant == "optax_clip":
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.0))
  else:
    tx = optax.adamw(1e-4, weight_decay=0.0)
  return Stack(), opt, tx


def _loss(apply_fn, variables, x):
  import jax.numpy as jnp
  y = apply_fn(variables, x)
  return jnp.mean(jnp.square(y.astype(jnp.float32)))


def worker(variant: str, d: int, hidden: int, blocks: int, tokens: int, steps: int) -> dict:
  """Runs one row in this process and returns its measurements."""
  import jax
  import jax.numpy as jnp
  import optax

  import forge_jax

  model, opt, tx = _build(variant, d, hidden, blocks)
  x = jax.random.normal(jax.random.PRNGKey(0), (1, tokens, d), jnp.bfloat16)
  variables = jax.jit(model.init)(jax.random.PRNGKey(1), x)
  loss_fn = functools.partial(_loss, model.apply)
  row = {"variant": variant, "d": d, "hidden": hidden, "blocks": blocks, "tokens": tokens}
  if opt is not None:
    state = forge_jax.TrainState.create(model.apply, variables, opt)
    compiled = forge_jax.train_step.lower(state, x, loss_fn).compile()
    step = lambda s: compiled(s, x)[0]
    sizes = {f"[{blocks},{d},{hidden}]", f"[{blocks},{hidden},{d}]", f"[{d},{hidden}]", f"[{hidden},{d}]"}
    copies = [l.strip()[:160] for l in compiled.as_text().splitlines()
              if re.search(r"= \S+ copy\(", l) and any(s in l.split("copy(")[0] for s in sizes)]
    row["weight_sized_copies"] = len(copies)
    row["copy_examples"] = copies[:4]
  else:
    params = variables["params"]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def optax_step(params, opt_state):
      loss, grads = jax.value_and_grad(lambda p: loss_fn({"params": p}, x))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    state = (params, tx.init(params))
    step = lambda s: optax_step(*s)[:2]
  # Warm up (compile + one step), then time `steps` back-to-back steps.
  state = step(state)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state = step(state)
  jax.block_until_ready(state)
  row["step_ms"] = (time.perf_counter() - start) / steps * 1e3
  stats = jax.devices()[0].memory_stats() or {}
  row["peak_gib"] = stats.get("peak_bytes_in_use", float("nan")) / 2**30
  n_params = blocks * 2 * d * hidden
  row["weights_gib"] = n_params * 4 / 2**30
  row["state_gib"] = n_params * 12 / 2**30  # fp32 W + m + v
  row["grad_gib"] = n_params * 4 / 2**30
  return row


def _run_row(args, variant, hidden, tokens) -> dict:
  cmd = [sys.executable, "-m", "experiments.bench_memory", "--worker", variant,
         "--d", str(args.d), "--hidden", str(hidden), "--blocks", str(args.blocks),
         "--tokens", str(tokens), "--steps", str(args.steps)]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
  except subprocess.TimeoutExpired:
    return {"variant": variant, "hidden": hidden, "tokens": tokens, "error": "timeout"}
  for line in proc.stdout.splitlines():
    if line.startswith("ROW "):
      return json.loads(line[4:])
  err = proc.stderr.strip().splitlines()
  oom = any("RESOURCE_EXHAUSTED" in l or "out of memory" in l.lower() for l in err)
  return {"variant": variant, "hidden": hidden, "tokens": tokens,
          "error": "OOM" if oom else (err[-1][:300] if err else f"exit {proc.returncode}")}


def _markdown(rows, meta) -> str:
  lines = [f"# Layer-stack memory and step time ({meta['device']})", "",
           f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; jax {meta['jax']}, "
           f"jaxlib {meta['jaxlib']}.", "",
           "| d x hidden | tokens | variant | peak GiB | step ms | W+m+v GiB | grad GiB | weight-sized copies |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {meta['d']} x {r['hidden']} | {r['tokens']} | {r['variant']} | {r['error']} | | | | |")
      continue
    lines.append(
        f"| {r['d']} x {r['hidden']} | {r['tokens']} | {r['variant']} | {r['peak_gib']:.2f} | "
        f"{r['step_ms']:.1f} | {r['state_gib']:.2f} | {r['grad_gib']:.2f} | {r.get('weight_sized_copies', '')} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  parser.add_argument("--d", type=int, default=4096)
  parser.add_argument("--hiddens", default="4096,14336")
  parser.add_argument("--blocks", type=int, default=8, help="two linear layers per block")
  parser.add_argument("--tokens", default="512,4096")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--timeout", type=int, default=240)
  parser.add_argument("--worker", choices=VARIANTS)
  parser.add_argument("--hidden", type=int)
  args = parser.parse_args(argv)
  if args.worker:
    row = worker(args.worker, args.d, args.hidden, args.blocks, int(args.tokens), args.steps)
    print("ROW " + json.dumps(row), flush=True)
    return
  import jax
  meta = {
      "command": "python -m experiments.bench_memory " + " ".join(argv or sys.argv[1:]),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
      "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "", "d": args.d,
  }
  rows = []
  for hidden in map(int, args.hiddens.split(",")):
    for tokens in map(int, args.tokens.split(",")):
      for variant in args.variants.split(","):
        row = _run_row(args, variant, hidden, tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_memory.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  md = _markdown(rows, meta)
  with open(os.path.join(args.out, "bench_memory.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
