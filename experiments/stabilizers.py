"""Stabilizers without the gradient pool, against optax + clip_by_global_norm: a convergence ablation.

One process trains one model from one init on one data order, once per row:

* ``optax_adamw``: optax.adamw, unclipped;
* ``optax_clip``: ``optax.chain(clip_by_global_norm(--clip), adamw)``, the
  usual recipe (it keeps the whole gradient until the norm is known);
* ``forge_adamw``: forge_jax.adamw, unclipped;
* ``forge_clip_prev_norm``: clipped by the previous step's global norm;
* ``forge_layer_clip``: each weight by its own previous norm against an EMA (AdaGC-style);
* ``forge_update_clip``: each update element clipped to ``--update-clip`` learning rates;
* ``forge_adam_atan2``: Adam-atan2 (bounded, no epsilon).

First a learning-rate sweep of optax.adamw (one compiled step, the learning
rate fed in each step) finds the smallest of ``--sweep-lrs`` at which
unclipped optax spikes; every row then trains at it (``--lr`` skips the sweep).
A spike is a step whose train loss exceeds the minimum of the previous
``--spike-window`` steps by more than ``--spike-nat``; consecutive such steps
are one spike, sized by its largest excess.

Writes under ``--out``: ``stabilizers.json`` (every row's per-step loss, grad
norm and clip scale; the sweep; spikes; final eval loss; XLA's planned step
memory; median step time; command, date, device, versions; rewritten after
each row, so a cut-off run keeps what finished), ``stabilizers.md`` (the
tables) and ``stabilizers.png`` (the loss curves).

Memory is XLA's plan of each row's compiled step (arguments + outputs -
donated + temporaries), not the device's peak: the rows share one process.

On one H200, qwen3-0.6b (byte tokens, 4 x 512 tokens per step; estimated at
8 minutes, mostly the eight compilations; rows that would end past the limit
are skipped and listed)::

    PYTHONPATH=$PWD python -m experiments.stabilizers --time-limit 540 --out $OUT/stabilizers

On a CPU, in about 50 s of one core (tiny-qwen3)::

    python -m experiments.stabilizers --smoke --out runs/stabilizers_smoke
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import forge_jax
import models
from experiments import data as data_lib
from experiments import plots
from experiments import runlog
from experiments import train

ROWS = ("optax_adamw", "optax_clip", "forge_adamw", "forge_clip_prev_norm", "forge_layer_clip",
        "forge_update_clip", "forge_adam_atan2")
SMOKE = dict(model="tiny-qwen3", corpus_bytes=300_000, batch=4, seq=32, steps=20, warmup=2,
             sweep_steps=20, sweep_lrs="0.01,0.05", eval_batches=2, dtype="float32")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--model", default="qwen3-0.6b")
  a("--set", action="append", default=[], metavar="FIELD=VALUE", help="ModelConfig overrides")
  a("--rows", default=",".join(ROWS), help=f"which of {', '.join(ROWS)}")
  a("--steps", type=int, default=150)
  a("--batch", type=int, default=4)
  a("--seq", type=int, default=512)
  a("--warmup", type=int, default=10)
  a("--weight-decay", type=float, default=0.1)
  a("--lr", type=float, default=0.0, help="every row's peak learning rate (0: from the sweep)")
  a("--sweep-lrs", default="0.003,0.01,0.03", help="peak learning rates tried with optax.adamw")
  a("--sweep-steps", type=int, default=80)
  a("--clip", type=float, default=1.0, help="max norm of optax_clip and forge_clip_prev_norm")
  a("--layer-clip", type=float, default=1.05, help="AdaGC's relative threshold")
  a("--update-clip", type=float, default=1.0, help="forge_update_clip's bound, in learning rates")
  a("--spike-window", type=int, default=10)
  a("--spike-nat", type=float, default=0.5)
  a("--dtype", default="bfloat16", help="compute dtype")
  a("--param-dtype", default="float32")
  a("--tokenizer", default="bytes", choices=data_lib.TOKENIZERS)
  a("--vocab-size", type=int, default=8192)
  a("--corpus-bytes", type=int, default=0)
  a("--eval-batches", type=int, default=8)
  a("--seed", type=int, default=0)
  a("--data-cache", default=None)
  a("--out", default="runs/stabilizers")
  a("--plan-only", action="store_true",
    help="no training: compile each row's step from abstract shapes and report XLA's memory "
    "plan (stabilizers_plan.json/.md; any machine, e.g. a CPU for a GPU-sized model)")
  a("--time-limit", type=float, default=0,
    help="seconds: a row that would end past it (judged by the last row's time) is skipped and "
    "listed as such (0: no limit)")
  a("--smoke", action="store_true",
    help="a tiny CPU run; these defaults, which other flags override: " + json.dumps(SMOKE))
  if p.parse_args(argv).smoke:
    p.set_defaults(**SMOKE)
  args = p.parse_args(argv)
  for name in args.rows.split(","):
    if name not in ROWS:
      raise ValueError(f"--rows: {name!r} is not one of {', '.join(ROWS)}")
  if args.warmup >= args.steps or args.warmup >= args.sweep_steps:
    raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps} and "
                     f"--sweep-steps {args.sweep_steps}")
  return args


def spikes(losses, window: int, nat: float) -> list[dict]:
  """Spikes of a loss curve: runs of steps more than ``nat`` above the previous ``window``'s
  minimum (a non-finite loss counts, with size inf); each with its first step and size."""
  losses = np.asarray(losses, np.float64)
  events, current = [], None
  for t in range(1, len(losses)):
    excess = losses[t] - np.min(losses[max(0, t - window):t])
    if not np.isfinite(losses[t]):
      excess = np.inf
    if excess > nat:
      if current is None:
        current = {"step": t, "size": float(excess)}
        events.append(current)
      current["size"] = max(current["size"], float(excess))
    else:
      current = None
  return events


def _schedule(args, lr):
  return optax.warmup_cosine_decay_schedule(0.0, lr, args.warmup, args.steps, end_value=lr * 0.1)


def _optimizer(args, name: str, lr: float):
  sched = _schedule(args, lr)
  wd = args.weight_decay
  return {
      "optax_adamw": lambda: optax.adamw(sched, weight_decay=wd),
      "optax_clip": lambda: optax.chain(optax.clip_by_global_norm(args.clip),
                                        optax.adamw(sched, weight_decay=wd)),
      "forge_adamw": lambda: forge_jax.adamw(sched, weight_decay=wd),
      "forge_clip_prev_norm": lambda: forge_jax.adamw(sched, weight_decay=wd,
                                                      clip_prev_norm=args.clip),
      "forge_layer_clip": lambda: forge_jax.adamw(sched, weight_decay=wd,
                                                  layer_clip=args.layer_clip),
      "forge_update_clip": lambda: forge_jax.adamw(sched, weight_decay=wd,
                                                   update_clip=args.update_clip),
      "forge_adam_atan2": lambda: forge_jax.adam_atan2(sched, weight_decay=wd),
  }[name]()


def _config(args, impl: str, vocab_size: int):
  ns = argparse.Namespace(model=args.model, set=args.set, impl=impl, remat="full", scan=True,
                          dtype=args.dtype, param_dtype=args.param_dtype, attention="auto")
  return train.model_config(ns, vocab_size)


def _build(args, impl: str, opt, vocab_size: int, example):
  """(initial state, compiled step, eval fn) of one row; every row has the same init."""
  cfg = _config(args, impl, vocab_size)
  model = models.CausalLM(cfg, optimizer=opt if impl == "forge" else None)
  key = jax.random.PRNGKey(args.seed)
  loss_fn = functools.partial(train._loss, model.apply)  # pylint: disable=protected-access
  if impl == "forge":
    init = jax.jit(lambda: forge_jax.TrainState.create(
        model.apply, model.init(key, example[:, :-1]), opt))
    lower = lambda s: forge_jax.train_step.lower(s, example, loss_fn)
    variables = lambda s: s.variables
  else:
    def init_fn():
      params = model.init(key, example[:, :-1])["params"]
      return train.OptaxState(jnp.zeros([], jnp.int32), params, opt.init(params))
    init = jax.jit(init_fn)
    step = jax.jit(functools.partial(train._optax_step, model.apply, opt),  # pylint: disable=protected-access
                   donate_argnums=(0,))
    lower = lambda s: step.lower(s, example)
    variables = lambda s: {"params": s.params}
  t0 = time.perf_counter()
  compiled = lower(jax.eval_shape(init)).compile()
  compile_s = time.perf_counter() - t0
  eval_fn = jax.jit(lambda s, b: loss_fn(variables(s), b))
  return init, compiled, eval_fn, compile_s, cfg


def _train(state, step_fn, sampler, steps: int, lr_at=None) -> tuple:
  """Runs ``steps`` steps; per-step loss, grad norm, clip scale and wall time."""
  out = {"loss": [], "grad_norm": [], "clip_scale": [], "step_s": []}
  for t in range(steps):
    batch = jnp.asarray(sampler.batch_at(t))
    t0 = time.perf_counter()
    state, m = step_fn(state, batch) if lr_at is None else step_fn(state, batch, lr_at(t))
    m = jax.device_get(m)  # waits for the step
    out["step_s"].append(time.perf_counter() - t0)
    out["loss"].append(float(m["loss"]))
    out["grad_norm"].append(float(m["grad_norm"]))
    out["clip_scale"].append(float(m.get("clip_scale", 1.0)))
  return state, out


def _eval(eval_fn, state, eval_set) -> float:
  return float(np.mean([float(eval_fn(state, b)) for b in eval_set]))


def sweep(args, data, example) -> list[dict]:
  """optax.adamw at each ``--sweep-lrs`` peak, one compiled step (the rate is an input)."""
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=args.weight_decay)
  cfg = _config(args, "optax", data.vocab_size)
  model = models.CausalLM(cfg)
  key = jax.random.PRNGKey(args.seed)

  def step(state, batch, lr):
    hyper = {**state.opt_state.hyperparams, "learning_rate": lr}
    state = state.replace(opt_state=state.opt_state._replace(hyperparams=hyper))
    return train._optax_step(model.apply, tx, state, batch)  # pylint: disable=protected-access

  step = jax.jit(step, donate_argnums=(0,))

  @jax.jit
  def init():
    params = model.init(key, example[:, :-1])["params"]
    return train.OptaxState(jnp.zeros([], jnp.int32), params, tx.init(params))

  sched_args = argparse.Namespace(warmup=args.warmup, steps=args.sweep_steps)
  results = []
  for lr in (float(x) for x in args.sweep_lrs.split(",")):
    sched = jax.jit(jax.vmap(_schedule(sched_args, lr)))(jnp.arange(args.sweep_steps))
    sampler = data_lib.BatchSampler(data.train, args.batch, args.seq, args.seed)
    _, out = _train(init(), step, sampler, args.sweep_steps, lambda t, s=sched: s[t])
    events = spikes(out["loss"], args.spike_window, args.spike_nat)
    results.append({"lr": lr, "loss": out["loss"], "spikes": events,
                    "final_loss": out["loss"][-1]})
    print(f"sweep lr {lr:g}: {len(events)} spikes, final loss {out['loss'][-1]:.3f}", flush=True)
  return results


def run_row(args, name: str, lr: float, data, example, eval_set) -> dict:
  impl = "optax" if name.startswith("optax") else "forge"
  opt = _optimizer(args, name, lr)
  init, compiled, eval_fn, compile_s, cfg = _build(args, impl, opt, data.vocab_size, example)
  sampler = data_lib.BatchSampler(data.train, args.batch, args.seq, args.seed)
  state, out = _train(init(), compiled, sampler, args.steps)
  if name == "optax_clip":  # clip_by_global_norm's factor, from the norm it clipped by
    out["clip_scale"] = [min(1.0, args.clip / n) if n > 0 else 1.0 for n in out["grad_norm"]]
  eval_loss = _eval(eval_fn, state, eval_set)
  events = spikes(out["loss"], args.spike_window, args.spike_nat)
  steady = out["step_s"][min(5, len(out["step_s"]) - 1):]
  row = {"name": name, "impl": impl, "lr": lr, **out, "spikes": events,
         "num_spikes": len(events), "max_spike": max((e["size"] for e in events), default=0.0),
         "final_loss_mean10": float(np.mean(out["loss"][-10:])), "final_eval_loss": eval_loss,
         "min_clip_scale": float(np.min(out["clip_scale"])),
         "clipped_steps": int(np.sum(np.asarray(out["clip_scale"]) < 1.0)),
         "step_s_median": float(np.median(steady)), "compile_s": compile_s,
         "xla_memory": runlog.xla_memory(compiled), "num_params": cfg.num_params}
  print(f"{name}: {len(events)} spikes (max {row['max_spike']:.2f} nat), final loss "
        f"{row['final_loss_mean10']:.3f}, eval {eval_loss:.3f}, "
        f"{row['step_s_median'] * 1e3:.1f} ms/step, XLA step "
        f"{row['xla_memory'].get('step_gib', float('nan')):.3f} GiB", flush=True)
  return row


def markdown(result: dict) -> str:
  meta, cfg = result["meta"], result["config"]
  lines = [f"# Stabilizers without the gradient pool ({meta['device']})", "",
           f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}; jax {meta['jax']}. {cfg['model']}, {cfg['steps']} steps of "
           f"{cfg['batch']}x{cfg['seq']} {cfg['tokenizer']} tokens, compute {cfg['dtype']}, "
           f"params/states {cfg['param_dtype']}, warmup {cfg['warmup']} + cosine, weight decay "
           f"{cfg['weight_decay']}; one init and one data order for every row. A spike: train "
           f"loss more than {cfg['spike_nat']} nat above the minimum of the previous "
           f"{cfg['spike_window']} steps.", ""]
  if result.get("sweep"):
    lines += [f"Learning-rate sweep, unclipped optax.adamw, {cfg['sweep_steps']} steps:", "",
              "| peak lr | spikes | largest (nat) | final loss |", "|---|---|---|---|"]
    for s in result["sweep"]:
      lines.append(f"| {s['lr']:g} | {len(s['spikes'])} | "
                   f"{max((e['size'] for e in s['spikes']), default=0.0):.2f} | "
                   f"{s['final_loss']:.3f} |")
    lines += ["", f"Rows at peak lr {result['lr']:g} ({result['lr_reason']}).", ""]
  lines += ["| row | spikes | largest (nat) | final train loss (mean of 10) | final eval loss | "
            "steps clipped | min clip scale | ms/step | XLA step GiB |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in result["rows"].values():
    lines.append(f"| {r['name']} | {r['num_spikes']} | {r['max_spike']:.2f} | "
                 f"{r['final_loss_mean10']:.4f} | {r['final_eval_loss']:.4f} | "
                 f"{r['clipped_steps']} | {r['min_clip_scale']:.3f} | "
                 f"{r['step_s_median'] * 1e3:.1f} | "
                 f"{r['xla_memory'].get('step_gib', float('nan')):.3f} |")
  if result.get("skipped"):
    lines += ["", f"Skipped for time: {', '.join(result['skipped'])}."]
  lines += ["", "Clip scale: the factor on the step's gradient (optax_clip: min(1, clip / "
            "this step's norm); forge_clip_prev_norm: min(1, clip / the previous step's norm); "
            "forge_layer_clip: the smallest over weights). Update clipping and Adam-atan2 bound "
            "each element and have no per-step factor (their columns read 0 and 1). Memory is "
            "XLA's plan of the compiled step."]
  return "\n".join(lines) + "\n"


def _write(out: pathlib.Path, result: dict, plot: bool) -> None:
  out.mkdir(parents=True, exist_ok=True)
  if plot and result["rows"]:
    runs = {n: {"step": np.arange(1, len(r["loss"]) + 1), "loss": np.asarray(r["loss"]),
                "eval_step": np.asarray([len(r["loss"])]),
                "eval_loss": np.asarray([r["final_eval_loss"]])}
            for n, r in result["rows"].items()}
    first = next(iter(result["rows"].values()))
    title = (f"{result['config']['model']} ({first['num_params'] / 1e6:.0f}M params), peak lr "
             f"{result['lr']:g}, {result['meta']['device']}")
    result["plot"] = plots.plot_runs(runs, out / "stabilizers.png", title,
                                     smooth=5 if result["config"]["steps"] >= 100 else 1)
  (out / "stabilizers.json").write_text(json.dumps(result, indent=1))
  (out / "stabilizers.md").write_text(markdown(result))


def plan(args, argv, vocab_size: int) -> dict:
  """XLA's memory plan of each row's compiled step; nothing is allocated or trained."""
  example = jnp.zeros((args.batch, args.seq + 1), jnp.int32)
  result = {"meta": {"command": "python -m experiments.stabilizers " + " ".join(argv),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     **runlog.versions()},
            "config": dict(vars(args)), "rows": {}}
  lines = [f"# XLA's memory plan of one step per row ({result['meta']['device']})", "",
           f"Command: `{result['meta']['command']}`  ",
           f"Date: {result['meta']['date']}; jax {result['meta']['jax']}. {args.model}, "
           f"{args.batch}x{args.seq} tokens, compute {args.dtype}, params/states "
           f"{args.param_dtype}; compiled from abstract shapes (no allocation).", "",
           "| row | XLA step GiB | arguments GiB | temporaries GiB | compile s |",
           "|---|---|---|---|---|"]
  for name in args.rows.split(","):
    opt = _optimizer(args, name, args.lr or 1e-3)
    impl = "optax" if name.startswith("optax") else "forge"
    _, compiled, _, compile_s, cfg = _build(args, impl, opt, vocab_size, example)
    mem = runlog.xla_memory(compiled)
    result["rows"][name] = {"xla_memory": mem, "compile_s": compile_s, "num_params": cfg.num_params}
    lines.append(f"| {name} | {mem.get('step_gib', float('nan')):.4f} | "
                 f"{mem.get('argument_gib', float('nan')):.4f} | "
                 f"{mem.get('temp_gib', float('nan')):.4f} | {compile_s:.0f} |")
    print(lines[-1], flush=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "stabilizers_plan.json").write_text(json.dumps(result, indent=1))
  (out / "stabilizers_plan.md").write_text("\n".join(lines) + "\n")
  return result


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.plan_only:
    vocab = 257 if args.tokenizer == "bytes" else args.vocab_size
    return plan(args, argv, vocab)
  t_start = time.perf_counter()
  data = data_lib.load(args.tokenizer, args.vocab_size, max_bytes=args.corpus_bytes,
                       cache_dir=args.data_cache)
  example = jnp.zeros((args.batch, args.seq + 1), jnp.int32)
  eval_set = [jnp.asarray(b) for b in
              data_lib.eval_batches(data.eval, args.batch, args.seq, args.eval_batches)]
  meta = {"command": "python -m experiments.stabilizers " + " ".join(argv),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          **runlog.versions()}
  result = {"meta": meta, "config": dict(vars(args)), "data": data.info, "sweep": [], "rows": {}}
  if args.lr > 0:
    result["lr"], result["lr_reason"] = args.lr, "given"
  else:
    result["sweep"] = sweep(args, data, example)
    spiking = [s["lr"] for s in result["sweep"] if s["spikes"]]
    if spiking:
      result["lr"], result["lr_reason"] = min(spiking), "the smallest at which optax.adamw spiked"
    else:
      result["lr"] = max(s["lr"] for s in result["sweep"])
      result["lr_reason"] = "no swept rate made optax.adamw spike: the largest"
  out = pathlib.Path(args.out)
  result["skipped"], last = [], 0.0
  for name in args.rows.split(","):
    elapsed = time.perf_counter() - t_start
    if args.time_limit and elapsed + last > args.time_limit:
      result["skipped"].append(name)
      print(f"{name}: skipped (--time-limit {args.time_limit:g} s; {elapsed:.0f} s spent)")
      continue
    result["rows"][name] = run_row(args, name, result["lr"], data, example, eval_set)
    result["wall_s"] = time.perf_counter() - t_start
    last = result["wall_s"] - elapsed
    _write(out, result, plot=False)  # what finished survives a cut-off run
  _write(out, result, plot=True)
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
