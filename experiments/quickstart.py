"""Quickstart: a small LM trained with FORGE and with optax, side by side, on real text.

Both runs share everything but the implementation of the linear layers and
their optimizer: model, init seed, data (the Python standard library's
source, byte-level tokens), batch order, learning-rate schedule. ``forge``
updates each weight inside its backward GEMM (``forge_jax.adamw``);
``optax`` materializes the gradient and calls ``optax.adamw``. In float32
the two differ only by the order of floating-point sums, so their losses
should agree to a few 1e-4 nat or better.

Prints a table (final train and eval loss, mean |loss gap|, step time, XLA's
memory plan of one step) and writes ``quickstart_loss.png`` and
``quickstart.json`` under ``--out``.

    python -m experiments.quickstart                  # ~1-2 minutes on a 2-core CPU
    python -m experiments.quickstart --steps 20       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time

import jax

from experiments import data as data_lib
from experiments import plots
from experiments import train

IMPLS = ("forge", "optax")
# A ~0.8M-parameter Qwen3-style model (4 layers, width 128): big enough to
# learn Python's syntax in a hundred steps, small enough for a laptop CPU.
MODEL = ["hidden_size=128", "intermediate_size=384", "num_layers=4", "num_heads=4",
         "num_kv_heads=2", "head_dim=32"]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--optimizer", default="adamw", choices=train.OPTIMIZERS)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--model", default="tiny-qwen3")
  p.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE",
                 help=f"ModelConfig overrides, replacing the quickstart's own for tiny-qwen3 "
                      f"({' '.join(MODEL)}; other --model presets have none)")
  p.add_argument("--tokenizer", default="bytes", choices=data_lib.TOKENIZERS)
  p.add_argument("--corpus-bytes", type=int, default=0, help="0: the whole stdlib")
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--data-cache", default=None)
  p.add_argument("--out", default="runs/quickstart")
  p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
  args = p.parse_args(argv)
  if args.set is None:  # the quickstart's model: tiny-qwen3 widened; other presets as they are
    args.set = list(MODEL) if args.model == "tiny-qwen3" else []
  return args


def train_args(args: argparse.Namespace, impl: str) -> argparse.Namespace:
  argv = ["--impl", impl, "--model", args.model, "--optimizer", args.optimizer,
          "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
          "--lr", str(args.lr), "--warmup", str(min(max(1, args.steps // 10), args.steps - 1)),
          "--tokenizer", args.tokenizer, "--corpus-bytes", str(args.corpus_bytes),
          "--eval-every", str(args.eval_every), "--eval-batches", "4",
          "--out", os.path.join(args.out, impl),
          "--progress" if args.progress else "--no-progress"]
  for item in args.set:
    argv += ["--set", item]
  if args.data_cache:
    argv += ["--data-cache", args.data_cache]
  return train.parse_args(argv)


def table(summaries: dict[str, dict], gap: dict) -> str:
  head = (f"{'impl':<6} {'train loss':>10} {'eval loss':>10} {'ms/step':>8} {'tokens/s':>9} "
          f"{'XLA step MiB':>12}")
  lines = [head, "-" * len(head)]
  for impl, s in summaries.items():
    mib = s["xla_memory"].get("step_gib", float("nan")) * 1024
    lines.append(f"{impl:<6} {s['final_loss_mean10']:>10.4f} {s['final_eval_loss']:>10.4f} "
                 f"{s['step_s_median'] * 1e3:>8.1f} {s['tokens_per_s']:>9,.0f} {mib:>12.2f}")
  lines.append(f"mean |loss gap| forge - optax over {gap['steps'].size} steps: "
               f"{gap['mean_abs_gap']:.2e} nat (max {gap['max_abs_gap']:.2e}); "
               f"eval: {gap['mean_abs_eval_gap']:.2e}")
  return "\n".join(lines)


def main(argv=None) -> dict:
  args = parse_args(argv)
  t0 = time.perf_counter()
  data = data_lib.load(args.tokenizer, max_bytes=args.corpus_bytes, cache_dir=args.data_cache)
  info = data.info
  print(f"{jax.default_backend()}: {args.steps} steps x {args.batch}x{args.seq} tokens of the "
        f"Python {info['python']} stdlib ({info['corpus_bytes']:,} bytes, sha256 "
        f"{info['corpus_sha256'][:12]}, {args.tokenizer} tokens), {args.optimizer}, lr {args.lr}")
  summaries, runs = {}, {}
  for impl in IMPLS:
    run_args = train_args(args, impl)
    shutil.rmtree(run_args.out, ignore_errors=True)  # the quickstart's own previous run
    summaries[impl] = train.run(run_args, data)
    runs[impl] = plots.curves(train.read_log(pathlib.Path(run_args.out) / "log.jsonl"))
  gap = plots.loss_gap(runs["forge"], runs["optax"])
  text = table(summaries, gap)
  params = summaries["forge"]["num_params"]
  png = plots.plot_runs(runs, pathlib.Path(args.out) / "quickstart_loss.png",
                        f"{params / 1e6:.2f}M-param Qwen3-style LM on the Python stdlib "
                        f"({jax.default_backend()}, {args.optimizer})",
                        smooth=5, gaps=[("forge", "optax")])
  result = {"args": vars(args), "data": info, "summaries": summaries,
            "gap": {k: v for k, v in gap.items() if not hasattr(v, "shape")},
            "table": text, "plot": png, "wall_s": time.perf_counter() - t0}
  pathlib.Path(args.out, "quickstart.json").write_text(json.dumps(result, indent=1))
  print(text)
  print("XLA step MiB: arguments + outputs - donated + temporaries of one compiled step.")
  print(f"plot: {png}" if png else "no plot (matplotlib missing)")
  print(f"total {result['wall_s']:.0f} s; logs under {args.out}/{{forge,optax}}/log.jsonl")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
