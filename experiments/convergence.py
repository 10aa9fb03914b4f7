"""Convergence: FORGE vs optax.adamw on real text, same model, seed, data order and schedule.

The paper reports that FORGE tracks fused AdamW within 0.001 nat (mean loss
gap) in continued pre-training. This script trains one model twice with
:mod:`experiments.train` (``--impl forge`` and ``--impl optax``, plus a
control, each in its own process so that each has its own peak-memory
figure) and writes, under ``--out``:

* ``convergence.json``: every run's loss curve (every step) and eval curve,
  the per-step gaps forge-optax and optax_ulp-optax: mean |gap| (the paper's
  figure), its mean over the second half, max and signed mean; each run's summary (step time, tokens/s, peak
  memory), the data fingerprint, command, date, device and versions;
* ``convergence.md``: the same as a small table;
* ``convergence.png``: the curves and the gap;
* ``forge/``, ``optax/``, ``optax_ulp/``: each run's ``log.jsonl``, ``summary.json``.

What the gap measures. FORGE and optax compute the same update; their
weight gradients differ in rounding:

* bfloat16 compute (the default, as in the paper): flax's ``Dense`` backward
  rounds the weight gradient to bfloat16 before optax sees it; FORGE
  consumes it in float32 inside the kernel.
* ``--dtype float32`` on a recent GPU: XLA computes float32 dots in TF32 by
  default (optax's gradients too), while FORGE's fused kernel computes dW at
  HIGHEST precision. ``--matmul-precision highest`` makes both true float32,
  so that only the order of sums differs (as on CPU, where the losses agree
  to ~1e-7 nat for hundreds of steps).

Training amplifies any such difference (and every other rounding) until the
runs decorrelate. The control run ``optax_ulp`` (optax again, from an init
moved by one ulp in half its elements) measures that amplification alone:
a forge-optax gap of the control's size is rounding, not a different update.

``--pretrain-steps N`` measures in the paper's setting, continued
pre-training: optax first trains the model from scratch for N steps (saved
as a Hugging Face checkpoint), then every run starts from those weights
with a fresh optimizer and another data order. Early from-scratch training
is the most chaotic phase, where any rounding difference grows fastest.

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
# The runs: name -> how it differs. optax_ulp is the control: optax again, from
# an init moved by one ulp in half its elements, so its gap to optax is what
# rounding-level differences grow into on their own in this training.
RUNS = {"forge": ["--impl", "forge"], "optax": ["--impl", "optax"],
        "optax_ulp": ["--impl", "optax", "--perturb-init"]}
PRETRAIN = ["--impl", "optax"]  # --pretrain-steps: the run the others continue from
SMOKE = dict(model="tiny-qwen3", set=[], steps=12, pretrain_steps=12, batch=2, seq=32, lr=3e-3,
             warmup=1,
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
  a("--pretrain-steps", type=int, default=0,
    help="first train optax from scratch for N steps, then start every run from its weights on "
    "another data order: continued pre-training, the paper's setting (0: all from scratch)")
  a("--batch", type=int, default=4)
  a("--seq", type=int, default=1024)
  a("--lr", type=float, default=3e-4)
  a("--warmup", type=int, default=100)
  a("--weight-decay", type=float, default=0.1)
  a("--dtype", default="bfloat16", help="compute dtype")
  a("--param-dtype", default="float32", help="params and optimizer states")
  a("--matmul-precision", default=None,
    help="float32 dots (e.g. highest; default: the platform's, TF32 on recent GPUs)")
  a("--tokenizer", default="bpe", choices=data_lib.TOKENIZERS)
  a("--vocab-size", type=int, default=8192)
  a("--corpus-bytes", type=int, default=0)
  a("--eval-every", type=int, default=100)
  a("--eval-batches", type=int, default=8)
  a("--seed", type=int, default=0)
  a("--runs", default=",".join(RUNS), help=f"which of {', '.join(RUNS)} (optax_ulp: the control)")
  a("--time-limit", type=float, default=0, help="seconds per run before it checkpoints and stops")
  a("--data-cache", default=None)
  a("--out", default="runs/convergence")
  a("--in-process", action="store_true", help="run both in this process (peak memory is shared)")
  a("--progress", action=argparse.BooleanOptionalAction, default=None,
    help="progress bars (default: when stderr is a terminal)")
  a("--smoke", action="store_true",
    help="a tiny CPU run in seconds; these defaults, which other flags override: " + json.dumps(SMOKE))
  if p.parse_args(argv).smoke:
    p.set_defaults(**SMOKE)
  args = p.parse_args(argv)
  if args.progress is None:
    args.progress = sys.stderr.isatty()
  return args


def _hf_dir(args: argparse.Namespace) -> str:
  return os.path.join(args.out, "pretrain", "hf")


def train_argv(args: argparse.Namespace, name: str, resume: bool) -> list[str]:
  spec = PRETRAIN if name == "pretrain" else RUNS[name]
  steps = args.pretrain_steps if name == "pretrain" else args.steps
  argv = [*spec, "--model", args.model, "--optimizer", args.optimizer,
          "--steps", steps, "--batch", args.batch, "--seq", args.seq, "--lr", args.lr,
          "--warmup", args.warmup, "--weight-decay", args.weight_decay, "--dtype", args.dtype,
          "--param-dtype", args.param_dtype, "--tokenizer", args.tokenizer,
          "--vocab-size", args.vocab_size, "--corpus-bytes", args.corpus_bytes,
          "--eval-every", args.eval_every, "--eval-batches", args.eval_batches,
          "--seed", args.seed, "--time-limit", args.time_limit,
          "--out", os.path.join(args.out, name),
          "--progress" if args.progress else "--no-progress"]
  for item in args.set:
    argv += ["--set", item]
  if args.data_cache:
    argv += ["--data-cache", args.data_cache]
  if args.matmul_precision:
    argv += ["--matmul-precision", args.matmul_precision]
  if name == "pretrain":
    argv += ["--save-hf", _hf_dir(args)]
  elif args.pretrain_steps:
    argv += ["--init-from", _hf_dir(args), "--data-seed", args.seed + 1]
  if resume:
    argv.append("--resume")
  return [str(x) for x in argv]


def _summary_of(run_dir: pathlib.Path):
  path = run_dir / "summary.json"
  return json.loads(path.read_text()) if path.exists() else None


def _check_same_run(args: argparse.Namespace, name: str, run_dir: pathlib.Path) -> None:
  """A finished run is reused only if these arguments would have trained it."""
  theirs = json.loads((run_dir / "config.json").read_text())["trajectory"]
  mine = train.parse_args(train_argv(args, name, resume=True))
  # init_from is the pretraining run's export under --out: its spelling may differ
  # (a relative --out, a moved folder); the pretraining run itself is checked by name.
  diff = {k: (theirs.get(k), getattr(mine, k)) for k in train.TRAJECTORY_KEYS
          if k != "init_from" and theirs.get(k) != getattr(mine, k)}
  if diff:
    raise ValueError(f"{run_dir} holds a finished run with other arguments (saved, given): {diff}. "
                     "Use another --out for these settings.")


def check_runs(args: argparse.Namespace) -> None:
  """Every run's arguments, checked before the first one trains."""
  for name in args.runs.split(","):
    if name not in RUNS:
      raise ValueError(f"--runs: {name!r} is not one of {', '.join(RUNS)}")
  for name in (["pretrain"] if args.pretrain_steps else []) + args.runs.split(","):
    train.check_args(train.parse_args(train_argv(args, name, resume=False)))


def run_one(args: argparse.Namespace, name: str, data) -> dict:
  """One run (reused when finished, resumed when not); returns its summary."""
  run_dir = pathlib.Path(args.out) / name
  done = _summary_of(run_dir)
  if done and done.get("complete"):
    _check_same_run(args, name, run_dir)
    print(f"{name}: reusing the finished run in {run_dir}")
    return done
  argv = train_argv(args, name, resume=(run_dir / "config.json").exists())
  print(f"{name}: python -m experiments.train {' '.join(argv)}", flush=True)
  if args.in_process:
    return train.run(train.parse_args(argv), data)
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  subprocess.run([sys.executable, "-m", "experiments.train", *argv], check=True, env=env)
  return _summary_of(run_dir)


def analyze(args: argparse.Namespace, summaries: dict, meta: dict) -> dict:
  runs = {name: plots.curves(train.read_log(pathlib.Path(args.out) / name / "log.jsonl"))
          for name in summaries}
  result = {"meta": meta, "config": dict(vars(args)), "paper_mean_abs_gap": PAPER_MEAN_GAP,
            "summaries": summaries,
            "curves": {n: {k: v.tolist() for k, v in c.items()} for n, c in runs.items()}}
  pairs = [p for p in (("forge", "optax"), ("optax_ulp", "optax")) if set(p) <= set(runs)]
  result["gaps"] = {f"{a}-{b}": {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                 for k, v in plots.loss_gap(runs[a], runs[b]).items()}
                    for a, b in pairs}
  if pairs:
    first = next(iter(summaries.values()))
    title = (f"{args.model} ({first['num_params'] / 1e6:.0f}M params), {args.optimizer}, "
             f"{args.batch}x{args.seq} tokens/step, compute {args.dtype}, {meta['device']}")
    result["plot"] = plots.plot_runs(runs, pathlib.Path(args.out) / "convergence.png", title,
                                     smooth=10 if args.steps >= 200 else 1, gaps=pairs)
  return result


def markdown(result: dict) -> str:
  meta, cfg = result["meta"], result["config"]
  lines = [f"# Convergence: FORGE vs optax ({meta['device']})", "",
           f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}; jax {meta['jax']}; Python {meta['python']}. Data: the Python "
           f"{result['data']['python']} stdlib, {result['data']['corpus_bytes']:,} bytes, sha256 "
           f"{result['data']['corpus_sha256'][:16]}, {cfg['tokenizer']} tokens; {cfg['steps']} "
           f"steps of {cfg['batch']}x{cfg['seq']}, lr {cfg['lr']}, compute {cfg['dtype']}, "
           f"params/states {cfg['param_dtype']}. optax_ulp: optax from an init moved by one ulp "
           "(the control)." + (f" Every run continues from {cfg['pretrain_steps']} steps of optax "
           "pre-training (another data order)." if cfg["pretrain_steps"] else " From scratch."),
           *([f"Gaps recomputed from the stored curves by `{result['report']['command']}` "
              f"({result['report']['date']})."] if "report" in result else []),
           "",
           "| run | final train loss (mean of 10) | final eval loss | ms/step | tokens/s | "
           "peak GiB | XLA step GiB |", "|---|---|---|---|---|---|---|"]
  for name, s in result["summaries"].items():
    lines.append(f"| {name} | {s['final_loss_mean10']:.4f} | {s['final_eval_loss']:.4f} | "
                 f"{s['step_s_median'] * 1e3:.1f} | {s['tokens_per_s']:.0f} | "
                 f"{s['peak_gib']:.2f} ({s['mem_source']}) | "
                 f"{s['xla_memory'].get('step_gib', float('nan')):.2f} |")
  if result["gaps"]:
    lines += ["", "| per-step train loss gap | steps | mean abs | 2nd half mean abs | max abs | "
              "signed mean | eval mean abs |", "|---|---|---|---|---|---|---|"]
    for pair, g in result["gaps"].items():
      lines.append(f"| {pair} | {len(g['steps'])} | {g['mean_abs_gap']:.2e} | "
                   f"{g['mean_abs_gap_2nd_half']:.2e} | {g['max_abs_gap']:.2e} | "
                   f"{g['mean_gap']:.2e} | {g['mean_abs_eval_gap']:.2e} |")
    windows = {pair: g.get("windows") for pair, g in result["gaps"].items()}
    first = next(iter(windows.values()))
    if first:
      lines += ["", "Mean |train loss gap| by steps (when the runs part):", "",
                "| pair | " + " | ".join(f"{w['from_step']}-{w['to_step']}" for w in first) + " |",
                "|---|" + "---|" * len(first)]
      for pair, ws in windows.items():
        lines.append(f"| {pair} | " + " | ".join(f"{w['mean_abs_gap']:.2e}" for w in ws) + " |")
    lines += ["", f"Paper: mean |gap| {PAPER_MEAN_GAP} nat (FORGE vs fused AdamW, continued "
              "pre-training). A forge-optax gap no larger than optax_ulp-optax is rounding "
              "amplified by the training dynamics, not a difference in the update."]
  return "\n".join(lines) + "\n"


def report_from(folder: pathlib.Path) -> dict:
  """Recomputes the gaps of a finished ``convergence.json`` from its stored curves (e.g. after
  the gap table gained a column) and rewrites it and ``convergence.md``; no training."""
  path = folder / "convergence.json"
  result = json.loads(path.read_text())
  runs = {n: {k: np.asarray(v) for k, v in c.items()} for n, c in result["curves"].items()}
  for pair in result["gaps"]:
    a, b = pair.split("-")
    result["gaps"][pair] = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                            for k, v in plots.loss_gap(runs[a], runs[b]).items()}
  result["report"] = {"command": f"python -m experiments.convergence --report-from {folder}",
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  path.write_text(json.dumps(result, indent=1))
  md = markdown(result)
  (folder / "convergence.md").write_text(md)
  print(md)
  return result


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--report-from"]:
    if len(argv) != 2:
      raise SystemExit("usage: python -m experiments.convergence --report-from RESULTS_DIR")
    return report_from(pathlib.Path(argv[1]))
  args = parse_args(argv)
  check_runs(args)
  command = "python -m experiments.convergence " + " ".join(sys.argv[1:] if argv is None else argv)
  # No jax backend in this process unless it trains here: on a GPU it would
  # reserve memory that the runs' own processes need.
  data = data_lib.load(args.tokenizer, args.vocab_size, max_bytes=args.corpus_bytes,
                       cache_dir=args.data_cache)  # built once here, so the runs never race
  t0 = time.perf_counter()
  summaries, pretrained = {}, None
  if args.pretrain_steps:
    pretrained = run_one(args, "pretrain", data)
    if not pretrained or not pretrained.get("complete"):
      print("pretrain: stopped before the end; run the same command again to continue")
      return {"complete": False}
  for name in args.runs.split(","):
    s = run_one(args, name, data)
    if not s or not s.get("complete"):
      print(f"{name}: stopped before the end; run the same command again to continue")
      return {"complete": False}
    summaries[name] = s
  first = next(iter(summaries.values()))
  meta = {"command": command,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": first["device"], "jax": first["jax"], "python": first["python"]}
  result = analyze(args, summaries, meta) | {"data": data.info, "pretrain": pretrained,
                                             "wall_s": time.perf_counter() - t0}
  out = pathlib.Path(args.out)
  (out / "convergence.json").write_text(json.dumps(result, indent=1))
  md = markdown(result)
  (out / "convergence.md").write_text(md)
  print(md)
  return result


if __name__ == "__main__":
  main()
