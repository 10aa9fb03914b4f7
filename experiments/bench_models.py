"""Whole-model training steps on one GPU: FORGE vs optax, memory and speed.

Each row is one fresh process (peak memory is per process) training a preset
of ``models`` with random weights on random tokens:

* same model, batch, precision (``--dtype``: params, compute and optimizer
  states in that dtype), attention kernel and activation checkpointing
  (every block recomputed from its input: ``remat="full"``) in every row;
* implementations: ``optax`` (optax.adamw), ``optax_clip``
  (``clip_by_global_norm(1.0)`` + adamw), ``forge`` (forge_jax.adamw; its
  scanned stack is a forge_jax.ScannedStack); layers scanned by default
  (``--unrolled`` for unrolled rows);
* a row that runs out of memory is recorded as ``OOM``, not dropped.

    PYTHONPATH=$PWD python -m experiments.bench_models --out $OUT \\
        --models qwen3-0.6b,llama-3.1-8b --tokens 1024 --impls optax,optax_clip,forge

Writes ``bench_models.json`` and ``bench_models.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time

IMPLS = ("optax", "optax_clip", "forge")


def _loss(apply_fn, variables, tokens):
  import jax.numpy as jnp
  import optax
  logits = apply_fn(variables, tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def worker(model_name: str, impl: str, batch: int, tokens: int, dtype: str, scan: bool,
           attention: str, steps: int) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import forge_jax
  import models

  linear = "forge" if impl == "forge" else "flax"
  cfg = models.get_config(model_name, linear=linear, remat="full", scan_layers=scan,
                          param_dtype=dtype, dtype=dtype, attention=attention)
  row = {"model": model_name, "impl": impl, "batch": batch, "tokens": tokens, "dtype": dtype,
         "scan": scan, "attention": attention, "params_b": cfg.num_params / 1e9}
  opt = forge_jax.adamw(1e-5, weight_decay=0.0) if impl == "forge" else None
  model = models.CausalLM(cfg, optimizer=opt)
  data = jax.random.randint(jax.random.PRNGKey(0), (batch, tokens + 1), 0, cfg.vocab_size)
  t0 = time.perf_counter()
  variables = jax.jit(model.init)(jax.random.PRNGKey(1), data[:, :-1])
  loss_fn = functools.partial(_loss, model.apply)
  if opt is not None:
    state = forge_jax.TrainState.create(model.apply, variables, opt)
    compiled = forge_jax.train_step.lower(state, data, loss_fn).compile()
    step = lambda s: compiled(s, data)
  else:
    tx = optax.adamw(1e-5, weight_decay=0.0)
    if impl == "optax_clip":
      tx = optax.chain(optax.clip_by_global_norm(1.0), tx)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def optax_step(s, data):
      params, opt_state = s
      loss, grads = jax.value_and_grad(lambda p: loss_fn({"params": p}, data))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    state = (variables["params"], tx.init(variables["params"]))
    compiled = optax_step.lower(state, data).compile()
    step = lambda s: compiled(s, data)
  state, metrics = step(state)
  jax.block_until_ready(state)
  row["compile_and_first_s"] = time.perf_counter() - t0
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state)
  jax.block_until_ready(state)
  dt = (time.perf_counter() - start) / steps
  row["step_ms"] = dt * 1e3
  row["tokens_per_s"] = batch * tokens / dt
  row["loss"] = float(metrics["loss"])
  stats = jax.devices()[0].memory_stats() or {}
  row["peak_gib"] = stats.get("peak_bytes_in_use", float("nan")) / 2**30
  return row


def _run_row(args, model_name, impl, tokens) -> dict:
  cmd = [sys.executable, "-m", "experiments.bench_models", "--worker", impl, "--models", model_name,
         "--tokens", str(tokens), "--batch", str(args.batch), "--dtype", args.dtype,
         "--attention", args.attention, "--steps", str(args.steps)]
  if args.unrolled:
    cmd.append("--unrolled")
  base = {"model": model_name, "impl": impl, "batch": args.batch, "tokens": tokens,
          "dtype": args.dtype, "scan": not args.unrolled}
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
  except subprocess.TimeoutExpired:
    return {**base, "error": f"timeout {args.timeout}s"}
  for line in proc.stdout.splitlines():
    if line.startswith("ROW "):
      return json.loads(line[4:])
  err = proc.stderr.strip().splitlines()
  oom = any("RESOURCE_EXHAUSTED" in l or "out of memory" in l.lower() for l in err)
  return {**base, "error": "OOM" if oom else (err[-1][:300] if err else f"exit {proc.returncode}")}


def markdown(rows, meta) -> str:
  lines = [f"# Whole-model training steps ({meta['device']})", "",
           f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}; jax {meta['jax']}. Random weights and tokens; every block "
           "recomputed in the backward pass (remat='full') in every row.", "",
           "| model | tokens | impl | layers | peak GiB | step ms | tokens/s |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    layers = "scanned" if r.get("scan", True) else "unrolled"
    head = f"| {r['model']} | {r['batch']}x{r['tokens']} | {r['impl']} | {layers} |"
    if "error" in r:
      lines.append(f"{head} {r['error']} | | |")
    else:
      lines.append(f"{head} {r['peak_gib']:.2f} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  parser.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
  parser.add_argument("--impls", default=",".join(IMPLS))
  parser.add_argument("--tokens", default="1024")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--attention", default="auto")
  parser.add_argument("--unrolled", action="store_true")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--timeout", type=int, default=300)
  parser.add_argument("--worker", choices=IMPLS)
  args = parser.parse_args(argv)
  if args.worker:
    row = worker(args.models, args.worker, args.batch, int(args.tokens), args.dtype,
                 not args.unrolled, args.attention, args.steps)
    print("ROW " + json.dumps(row), flush=True)
    return
  import jax
  meta = {"command": "python -m experiments.bench_models " + " ".join(argv or sys.argv[1:]),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
  rows = []
  for model_name in args.models.split(","):
    for tokens in map(int, args.tokens.split(",")):
      for impl in args.impls.split(","):
        rows.append(_run_row(args, model_name, impl, tokens))
        print(json.dumps(rows[-1]), flush=True)
  os.makedirs(args.out, exist_ok=True)
  tag = os.environ.get("BENCH_TAG", "bench_models")
  with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  md = markdown(rows, meta)
  with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
