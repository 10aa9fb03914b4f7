"""Convergence: FORGE vs optax.adamw on real text, same model, seed, data order and schedule.

The paper reports that FORGE tracks fused AdamW within 0.001 nat (mean loss
gap) in continued pre-training. This script trains one model twice with
:mod:`experiments.train` (``--impl forge`` and ``--impl optax``, each in its
own process so that each has its own peak-memory figure) and writes, under
``--out``:

* ``convergence.json``: both loss curves (every step) and eval curves, the
  per-step gap's mean |gap| (the paper's figure), its mean over the second
  half, max and signed mean, each run's summary (step time, tokens/s, peak
  memory), the data fingerprint, command, date, device and versions;
* ``convergence.md``: the same as a small table;
* ``convergence.png``: the curves and the gap;
* ``forge/``, ``optax/``: each run's ``log.jsonl``, ``summary.json``.

What the gap measures: with ``--dtype float32`` the two runs differ only in
the order of floating-point sums (losses agree to ~1e-7 nat until, at high
learning rates, the trajectories drift apart chaotically). With bfloat16
compute (the default, as in the paper) they also differ on purpose: flax's
``Dense`` backward rounds the weight gradient to bfloat16 before optax sees
it, while FORGE consumes it in float32 inside the kernel.

Re-running the same command reuses a finished run and resumes an unfinished
one (``--time-limit`` stops each run with a checkpoint, for machines that
limit one command's time).

On one H200 (defaults: qwen3-0.6b with an 8192-token BPE vocabulary, fp32
weights and optimizer states, bf16 compute, 1000 steps of 4 x 1024 tokens,
about 1.5 epochs of the stdlib)::

    PYTHONPATH=$PWD python -m experiments.convergence --out $OUT/convergence

On a CPU, in seconds (a tiny model, bytes, a slice of the corpus)::

    python -m experiments.convergence --smoke --out runs/convergence_smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from experiments import data as data_lib
from experiments import plots
from experiments import train

PAPER_MEAN_GAP = 1e-3  # nat, FORGE vs fused AdamW (paper, continued pre-training)
SMOKE = dict(model="tiny-qwen3", set=[], steps=12, batch=2, seq=32, lr=3e-3, warmup=1,
             dtype="float32", tokenizer="bytes", corpus_bytes=300_000, eval_every=4,
             eval_batches=2, in_process=True)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--model", default="qwen3-0.6b")
  a("--set", action="append", default=[], metavar="FIELD=VALUE", help="ModelConfig overrides")
  a("--optimizer", default="adamw", choices=train.OPTIMIZERS)
  a("--steps", type=int, default=1000)
  a("--batch", type=int, default=4)
  a("--seq", type=int, default=1024)
  a("--lr", type=float, default=3e-4)
  a("--warmup", type=int, default=100)
  a("--weight-decay", type=float, default=0.1)
  a("--dtype", default="bfloat16", help="compute dtype")
  a("--param-dtype", default="float32", help="params and optimizer states")
  a("--tokenizer", default="bpe", choices=data_lib.TOKENIZERS)
  a("--vocab-size", type=int, default=8192)
  a("--corpus-bytes", type=int, default=0)
  a("--eval-every", type=int, default=100)
  a("--eval-batches", type=int, default=8)
  a("--seed", type=int, default=0)
  a("--impls", default="forge,optax")
  a("--time-limit", type=float, default=0, help="seconds per run before it checkpoints and stops")
  a("--data-cache", default=None)
  a("--out", default="runs/convergence")
  a("--in-process", action="store_true", help="run both in this process (peak memory is shared)")
  a("--progress", action=argparse.BooleanOptionalAction, default=None,
    help="progress bars (default: when stderr is a terminal)")
  a("--smoke", action="store_true", help="a tiny CPU run in seconds: " + json.dumps(SMOKE))
  args = p.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE.items():
      setattr(args, k, v)
  if args.progress is None:
    args.progress = sys.stderr.isatty()
  return args


def train_argv(args: argparse.Namespace, impl: str, resume: bool) -> list[str]:
  argv = ["--impl", impl, "--model", args.model, "--optimizer", args.optimizer,
          "--steps", args.steps, "--batch", args.batch, "--seq", args.seq, "--lr", args.lr,
          "--warmup", args.warmup, "--weight-decay", args.weight_decay, "--dtype", args.dtype,
          "--param-dtype", args.param_dtype, "--tokenizer", args.tokenizer,
          "--vocab-size", args.vocab_size, "--corpus-bytes", args.corpus_bytes,
          "--eval-every", args.eval_every, "--eval-batches", args.eval_batches,
          "--seed", args.seed, "--time-limit", args.time_limit,
          "--out", os.path.join(args.out, impl),
          "--progress" if args.progress else "--no-progress"]
  for item in args.set:
    argv += ["--set", item]
  if args.data_cache:
    argv += ["--data-cache", args.data_cache]
  if resume:
    argv.append("--resume")
  return [str(x) for x in argv]


def _summary_of(run_dir: pathlib.Path):
  path = run_dir / "summary.json"
  return json.loads(path.read_text()) if path.exists() else None


def run_impl(args: argparse.Namespace, impl: str, data) -> dict:
  """One run (reused when finished, resumed when not); returns its summary."""
  run_dir = pathlib.Path(args.out) / impl
  done = _summary_of(run_dir)
  if done and done.get("complete"):
    print(f"{impl}: reusing the finished run in {run_dir}")
    return done
  argv = train_argv(args, impl, resume=(run_dir / "config.json").exists())
  print(f"{impl}: python -m experiments.train {' '.join(argv)}", flush=True)
  if args.in_process:
    return train.run(train.parse_args(argv), data)
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  subprocess.run([sys.executable, "-m", "experiments.train", *argv], check=True, env=env)
  return _summary_of(run_dir)


def analyze(args: argparse.Namespace, summaries: dict, meta: dict) -> dict:
  runs = {impl: plots.curves(train.read_log(pathlib.Path(args.out) / impl / "log.jsonl"))
          for impl in summaries}
  result = {"meta": meta, "config": {k: v for k, v in vars(args).items()},
            "paper_mean_abs_gap": PAPER_MEAN_GAP, "summaries": summaries,
            "curves": {impl: {k: v.tolist() for k, v in c.items()} for impl, c in runs.items()}}
  if {"forge", "optax"} <= set(runs):
    gap = plots.loss_gap(runs["forge"], runs["optax"])
    result["gap"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in gap.items()}
    title = (f"{args.model} ({summaries['forge']['num_params'] / 1e6:.0f}M params), "
             f"{args.optimizer}, {args.batch}x{args.seq} tokens/step, {meta['device']}")
    result["plot"] = plots.plot_runs(runs, pathlib.Path(args.out) / "convergence.png", title,
                                     smooth=10 if args.steps >= 200 else 1,
                                     gap_of=("forge", "optax"))
  return result


def markdown(result: dict) -> str:
  meta, cfg = result["meta"], result["config"]
  lines = [f"# Convergence: FORGE vs optax ({meta['device']})", "",
           f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}; jax {meta['jax']}; Python {meta['python']}. Data: the Python "
           f"{result['data']['python']} stdlib, {result['data']['corpus_bytes']:,} bytes, sha256 "
           f"{result['data']['corpus_sha256'][:16]}, {cfg['tokenizer']} tokens; {cfg['steps']} "
           f"steps of {cfg['batch']}x{cfg['seq']}, lr {cfg['lr']}, compute {cfg['dtype']}, "
           f"params/states {cfg['param_dtype']}.", "",
           "| impl | final train loss (mean of 10) | final eval loss | ms/step | tokens/s | "
           "peak GiB | XLA step GiB |", "|---|---|---|---|---|---|---|"]
  for impl, s in result["summaries"].items():
    lines.append(f"| {impl} | {s['final_loss_mean10']:.4f} | {s['final_eval_loss']:.4f} | "
                 f"{s['step_s_median'] * 1e3:.1f} | {s['tokens_per_s']:.0f} | "
                 f"{s['peak_gib']:.2f} ({s['mem_source']}) | "
                 f"{s['xla_memory'].get('step_gib', float('nan')):.2f} |")
  if "gap" in result:
    g = result["gap"]
    lines += ["", f"Per-step train loss gap forge - optax over {len(g['steps'])} steps: mean "
              f"|gap| {g['mean_abs_gap']:.2e} nat (second half {g['mean_abs_gap_2nd_half']:.2e}, "
              f"max {g['max_abs_gap']:.2e}, signed mean {g['mean_gap']:.2e}); eval mean |gap| "
              f"{g['mean_abs_eval_gap']:.2e}. Paper: {PAPER_MEAN_GAP} nat."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  args = parse_args(argv)
  command = "python -m experiments.convergence " + " ".join(sys.argv[1:] if argv is None else argv)
  # No jax backend in this process unless it trains here: on a GPU it would
  # reserve memory that the runs' own processes need.
  data = data_lib.load(args.tokenizer, args.vocab_size, max_bytes=args.corpus_bytes,
                       cache_dir=args.data_cache)  # built once here, so the runs never race
  t0 = time.perf_counter()
  summaries = {}
  for impl in args.impls.split(","):
    s = run_impl(args, impl, data)
    if not s or not s.get("complete"):
      print(f"{impl}: stopped before the end; run the same command again to continue")
      return {"complete": False}
    summaries[impl] = s
  first = next(iter(summaries.values()))
  meta = {"command": command,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": first["device"], "jax": first["jax"], "python": first["python"]}
  result = analyze(args, summaries, meta) | {"data": data.info,
                                             "wall_s": time.perf_counter() - t0}
  out = pathlib.Path(args.out)
  (out / "convergence.json").write_text(json.dumps(result, indent=1))
  md = markdown(result)
  (out / "convergence.md").write_text(md)
  print(md)
  return result


if __name__ == "__main__":
  main()
