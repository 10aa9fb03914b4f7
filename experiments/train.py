"""Train a model preset on real text with FORGE or with optax.

``--impl forge`` builds every linear layer as ``forge_jax.Dense``
(``linear="forge"``) and trains with forge_jax's optimizer, whose update runs
inside the backward GEMM; ``--impl optax`` builds ``flax.linen.Dense`` and
trains with the optax optimizer of the same name. Everything else is shared:
model config, init seed, data order, learning-rate schedule, activation
checkpointing (``--remat full`` by default; FORGE and optax runs with the same
``--remat`` save the same activations, so the comparison is matched).

The data is the Python standard library's source (:mod:`experiments.data`);
its fingerprint is in the log's first record. Outputs under ``--out``:
``config.json``, ``log.jsonl`` (a ``start`` record, one ``train`` record per
step, ``eval`` and ``ckpt`` records, an ``end`` record), ``ckpt/step_*``
(orbax; ``--resume`` continues bit for bit from the newest) and
``summary.json``.

    python -m experiments.train --model tiny-qwen3 --impl forge --steps 200 --out runs/forge
    python -m experiments.train --model qwen3-0.6b --impl optax --batch 4 --seq 1024 --lr 3e-4 \\
        --dtype bfloat16 --steps 1000 --eval-every 100 --ckpt-every 500 --out runs/q06_optax

Global-norm clipping (``--clip``) exists only for ``--impl optax``: it needs
the whole gradient before any update, and FORGE never forms it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import pathlib
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

import forge_jax
from forge_jax import _checkpoint as ckpt_lib
import models
from experiments import data as data_lib
from experiments import runlog
# read_log and latest_checkpoint are re-exported: scripts read runs through this module.
from experiments.runlog import device_memory, latest_checkpoint, read_log  # noqa: F401
from experiments.runlog import save_checkpoint, versions, xla_memory

IMPLS = ("forge", "optax")
OPTIMIZERS = ("adam", "adamw", "nadam", "nadamw", "radam", "lion", "rmsprop", "adagrad", "sgd")
DEFAULT_WARMUP = 20

# Arguments that change the trajectory: a resumed run must have the same.
TRAJECTORY_KEYS = ("model", "set", "impl", "optimizer", "steps", "batch", "seq", "lr", "warmup",
                   "schedule", "min_lr_ratio", "weight_decay", "clip", "dtype", "param_dtype", "matmul_precision",
                   "scan", "remat", "attention", "seed", "init_from", "perturb_init", "data_seed", "tokenizer", "vocab_size",
                   "corpus_bytes", "eval_fraction", "weight_rounding", "state_dtype")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--model", default="tiny-qwen3", help=f"a models preset: {', '.join(models.PRESETS)}")
  a("--set", action="append", default=[], metavar="FIELD=VALUE",
    help="override a ModelConfig field, e.g. --set num_layers=4 (repeatable)")
  a("--impl", choices=IMPLS, default="forge", help="FORGE layers or flax.linen.Dense + optax")
  a("--optimizer", choices=OPTIMIZERS, default="adamw", help="the update rule")
  a("--steps", type=int, default=200, help="training steps")
  a("--batch", type=int, default=8, help="rows per step")
  a("--seq", type=int, default=128, help="tokens per row (inputs; rows hold seq + 1)")
  a("--lr", type=float, default=3e-3, help="peak learning rate")
  a("--warmup", type=int, default=None,
    help=f"linear warmup steps; if not given, {DEFAULT_WARMUP} or --steps - 1 when fewer "
    "(default: %(default)s)")
  a("--schedule", choices=("cosine", "constant"), default="cosine", help="after the warmup")
  a("--min-lr-ratio", type=float, default=0.1, help="cosine end value / peak")
  a("--weight-decay", type=float, default=0.1, help="for optimizers that take one")
  a("--clip", type=float, default=0.0, help="global-norm clipping (optax only; 0: off)")
  a("--weight-rounding", choices=("nearest", "stochastic"), default=None,
    help="FORGE only (forge_jax.Precision): write-back rounding of bfloat16 weights")
  a("--state-dtype", default=None,
    help="FORGE only (forge_jax.Precision): optimizer-state storage, a float dtype or int8")
  a("--dtype", default="float32", help="compute dtype (activations, matmul inputs)")
  a("--matmul-precision", default=None,
    help="jax_default_matmul_precision for float32 dots, e.g. highest (default: the platform's, "
    "TF32 on recent GPUs; FORGE's fused dW kernel computes float32 dW at HIGHEST regardless)")
  a("--param-dtype", default="float32", help="storage dtype of params and optimizer states")
  a("--scan", action=argparse.BooleanOptionalAction, default=True, help="scan over layers")
  a("--remat", default="full", help="activation checkpointing of each block")
  a("--attention", default="auto", choices=("auto", "xla", "cudnn"), help="attention implementation")
  a("--seed", type=int, default=0, help="init seed")
  a("--init-from", default=None, metavar="DIR",
    help="start from the weights of a Hugging Face checkpoint (e.g. another run's --save-hf), "
    "with fresh optimizer state: continued pre-training")
  a("--perturb-init", action="store_true",
    help="move half the elements of every parameter by one float ulp after init: a control "
    "run that shows how far rounding-level differences grow in training")
  a("--data-seed", type=int, default=None, help="data order seed (default: --seed)")
  a("--tokenizer", choices=data_lib.TOKENIZERS, default="bpe", help="byte tokens or a local BPE")
  a("--vocab-size", type=int, default=8192, help="BPE vocabulary")
  a("--corpus-bytes", type=int, default=0, help="use the first files up to this size (0: all)")
  a("--eval-fraction", type=float, default=0.02, help="share of files held out")
  a("--data-cache", default=None, help="tokenizer/token cache (default ~/.cache/forge_jax/data)")
  a("--eval-every", type=int, default=100, help="held-out eval every N steps and at the end (0: end only)")
  a("--eval-batches", type=int, default=8, help="held-out batches per eval")
  a("--ckpt-every", type=int, default=0, help="checkpoint every N steps and at the end (0: never)")
  a("--keep-ckpts", type=int, default=2, help="newest checkpoints kept")
  a("--log-every", type=int, default=10, help="fetch metrics / refresh the bar every N steps")
  a("--out", default="runs/train", help="run directory (log, checkpoints, summary)")
  a("--save-hf", default=None, metavar="DIR",
    help="at the end, write the weights as a Hugging Face checkpoint (for --init-from)")
  a("--resume", action="store_true", help="continue from the newest checkpoint in --out")
  a("--stop-at", type=int, default=0,
    help="end this invocation after this step, with a checkpoint (0: run to --steps)")
  a("--time-limit", type=float, default=0,
    help="end this invocation, with a checkpoint, once it has run this many seconds, loading "
    "and compiling included (0: no limit)")
  a("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm bar")
  args = p.parse_args(argv)
  if args.data_seed is None:
    args.data_seed = args.seed
  if args.warmup is None:
    args.warmup = max(0, min(DEFAULT_WARMUP, args.steps - 1))
  check_args(args)
  return args


class UsageError(ValueError):
  """Arguments that cannot run, or do not match the run in --out: the CLI prints it as argparse
  does (one line, exit status 2) instead of a traceback."""


def check_args(args: argparse.Namespace) -> None:
  """Clear errors (:class:`UsageError`) for combinations that cannot run."""
  try:
    _check_args(args)
  except ValueError as e:
    raise UsageError(str(e)) from None


def _check_args(args: argparse.Namespace) -> None:
  if args.impl == "forge" and args.clip > 0:
    raise ValueError(
        f"--clip {args.clip} (optax.clip_by_global_norm) is not available with --impl forge: "
        "clipping scales every gradient by the norm of the whole gradient, but FORGE applies "
        "each weight tile's update inside the backward GEMM, before the other tiles' gradients "
        "exist. Use --impl optax for clipped runs, or --clip 0.")
  lowp = {k: v for k, v in (("weight_rounding", args.weight_rounding),
                            ("state_dtype", args.state_dtype)) if v is not None}
  if lowp and args.impl != "forge":
    raise ValueError(f"{lowp} are FORGE storage options (forge_jax.Precision): use --impl forge "
                     "(optax's own knob is mu_dtype, not exposed here)")
  if lowp and not hasattr(forge_jax, "Precision"):
    raise ValueError(f"{lowp}: this forge_jax has no Precision (low-precision storage) yet")
  if args.schedule == "cosine" and args.warmup >= args.steps:
    raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps} for the cosine "
                     "schedule (or use --schedule constant)")
  if args.steps < 1 or args.batch < 1 or args.seq < 1:
    raise ValueError(f"--steps, --batch and --seq must be positive, got {args.steps}, "
                     f"{args.batch}, {args.seq}")
  for flag, value, low in (("--log-every", args.log_every, 1), ("--eval-batches", args.eval_batches, 1),
                           ("--keep-ckpts", args.keep_ckpts, 1), ("--warmup", args.warmup, 0),
                           ("--stop-at", args.stop_at, 0), ("--eval-every", args.eval_every, 0),
                           ("--ckpt-every", args.ckpt_every, 0)):
    if value < low:
      raise ValueError(f"{flag} {value} must be at least {low}")


def _parse_value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return {"true": True, "false": False}.get(text.lower(), text)


def model_config(args: argparse.Namespace, vocab_size: int) -> models.ModelConfig:
  """The preset with the run's switches; the vocabulary is the tokenizer's, rounded up to 128."""
  overrides = {}
  own_flags = {"linear": "--impl", "remat": "--remat", "scan_layers": "--scan/--no-scan",
               "dtype": "--dtype", "param_dtype": "--param-dtype", "attention": "--attention",
               "vocab_size": "--vocab-size (the tokenizer's, rounded up to 128)"}
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  for item in args.set:
    field, sep, value = item.partition("=")
    field = field.strip()
    if not sep:
      raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
    if field in own_flags:
      raise ValueError(f"--set {field}=...: this field is set by {own_flags[field]}")
    if field not in fields:
      raise ValueError(f"--set {field}=...: ModelConfig has no field {field!r}; its fields are "
                       f"{', '.join(sorted(fields - set(own_flags)))}")
    overrides[field] = _parse_value(value.strip())
  return models.get_config(
      args.model, linear="forge" if args.impl == "forge" else "flax", remat=args.remat,
      scan_layers=args.scan, dtype=args.dtype, param_dtype=args.param_dtype,
      attention=args.attention, vocab_size=-(-vocab_size // 128) * 128, **overrides)


def lr_schedule(args: argparse.Namespace) -> optax.Schedule:
  if args.schedule == "constant":
    warm = optax.linear_schedule(0.0, args.lr, max(args.warmup, 1))
    return optax.join_schedules([warm, optax.constant_schedule(args.lr)], [args.warmup])
  return optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps,
                                            end_value=args.lr * args.min_lr_ratio)


def make_optimizer(args: argparse.Namespace, schedule: optax.Schedule):
  """forge_jax's or optax's optimizer of that name, with the same arguments."""
  lib = forge_jax if args.impl == "forge" else optax
  fn = getattr(lib, args.optimizer)
  kwargs = {}
  if "weight_decay" in inspect.signature(fn).parameters:
    kwargs["weight_decay"] = args.weight_decay
  lowp = {k: v for k, v in (("weight_rounding", args.weight_rounding),
                            ("state_dtype", args.state_dtype)) if v is not None}
  if lowp:  # check_args made sure this is FORGE and forge_jax has Precision
    kwargs["precision"] = forge_jax.Precision(**lowp)
  opt = fn(schedule, **kwargs)
  if args.impl == "optax" and args.clip > 0:
    opt = optax.chain(optax.clip_by_global_norm(args.clip), opt)
  return opt


def load_pretrained(path: str, cfg: models.ModelConfig):
  """The ``params`` of a Hugging Face checkpoint (``--save-hf``), laid out and typed for ``cfg``."""
  loaded_cfg, params = models.load_checkpoint(
      path, linear=cfg.linear, scan_layers=cfg.scan_layers, remat=cfg.remat,
      param_dtype=cfg.param_dtype, dtype=cfg.dtype, attention=cfg.attention)
  if loaded_cfg != cfg:
    diff = {f.name: (getattr(loaded_cfg, f.name), getattr(cfg, f.name))
            for f in dataclasses.fields(cfg) if getattr(loaded_cfg, f.name) != getattr(cfg, f.name)}
    raise ValueError(f"--init-from {path}: another model (checkpoint, this run): {diff}")
  # Kept on the host: the run holds it for its whole life (init_state), and
  # on the device it would count in the run's peak memory.
  return jax.tree.map(lambda a: np.asarray(a, jnp.dtype(cfg.param_dtype)), params)


def perturb_ulp(params, seed: int):
  """``params`` with a random half of each float array's elements moved up by one ulp.

  The smallest change a float can make: runs that differ only by it show how
  much the training dynamics amplify rounding, the yardstick for FORGE vs
  optax (whose updates differ by the order of floating-point sums).
  """
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), max(len(leaves), 1))
  out = []
  for k, x in zip(keys, leaves):
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = jnp.where(jax.random.bernoulli(k, 0.5, x.shape), jnp.nextafter(x, jnp.inf), x)
    out.append(x)
  return jax.tree.unflatten(treedef, out)


class OptaxState(struct.PyTreeNode):
  """The optax baseline's whole state (checkpointed like a forge_jax.TrainState)."""

  step: jax.Array
  params: Any
  opt_state: Any


def _loss(apply_fn: Callable, variables, tokens_BxL1) -> jax.Array:
  # float32 cross-entropy without a float32 copy of the logits (models.cross_entropy).
  return models.cross_entropy(apply_fn(variables, tokens_BxL1[:, :-1]), tokens_BxL1[:, 1:])


def _optax_step(apply_fn, tx, state: OptaxState, batch):
  loss, grads = jax.value_and_grad(lambda p: _loss(apply_fn, {"params": p}, batch))(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state)
  return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


@dataclasses.dataclass
class Trainer:
  """The model, its initial state, and the compiled train and eval steps of one run."""

  cfg: models.ModelConfig
  model: Any
  init_state: Callable[[], Any]
  step_fn: Callable
  eval_fn: Callable
  variables_of: Callable[[Any], Any]
  compile_s: float
  memory: dict


def build_trainer(args: argparse.Namespace, vocab_size: int, compile_step: bool = True) -> Trainer:
  """Model, initial state and (unless ``compile_step=False``) the compiled step of a run."""
  cfg = model_config(args, vocab_size)
  schedule = lr_schedule(args)
  opt = make_optimizer(args, schedule)
  model = models.CausalLM(cfg, optimizer=opt if args.impl == "forge" else None)
  example = jnp.zeros((args.batch, args.seq + 1), jnp.int32)
  key = jax.random.PRNGKey(args.seed)
  pretrained = load_pretrained(args.init_from, cfg) if args.init_from else None

  def prepare(variables, pretrained):
    if pretrained is not None:
      variables = {**variables, "params": pretrained}
    if args.perturb_init:
      variables = {**variables, "params": perturb_ulp(variables["params"], args.seed + 1)}
    return variables

  # One program for the whole initial state: built eagerly, the optimizer's
  # init alone would compile one small program per slot, and in pieces the
  # random init and the state would be resident together (a peak above the
  # step's). Pretrained weights come in as an argument, not baked-in constants.
  if args.impl == "forge":
    @jax.jit
    def build_state(pretrained):
      variables = prepare(model.init(key, example[:, :-1]), pretrained)
      return forge_jax.TrainState.create(model.apply, variables, opt)
    loss_fn = functools.partial(_loss, model.apply)
    lower = lambda s: forge_jax.train_step.lower(s, example, loss_fn)
    variables_of = lambda s: s.variables
  else:
    @jax.jit
    def build_state(pretrained):
      params = prepare(model.init(key, example[:, :-1]), pretrained)["params"]
      return OptaxState(jnp.zeros([], jnp.int32), params, opt.init(params))
    step = jax.jit(functools.partial(_optax_step, model.apply, opt), donate_argnums=(0,))
    lower = lambda s: step.lower(s, example)
    variables_of = lambda s: {"params": s.params}

  init_state = lambda: build_state(pretrained)
  eval_fn = jax.jit(functools.partial(_loss, model.apply))
  if not compile_step:
    return Trainer(cfg, model, init_state, None, eval_fn, variables_of, 0.0, {})
  t0 = time.perf_counter()
  # Compiled ahead of the loop: step times exclude compilation, and XLA's
  # memory plan of the step is known before it runs.
  compiled = lower(jax.eval_shape(init_state)).compile()
  compile_s = time.perf_counter() - t0
  return Trainer(cfg, model, init_state, compiled, eval_fn, variables_of, compile_s,
                 xla_memory(compiled))


def _check_out(args: argparse.Namespace, out: pathlib.Path) -> None:
  """Refuses to mix two runs in one --out, or to resume with other trajectory arguments."""
  config_path = out / "config.json"
  if not config_path.exists():
    return
  if not args.resume:
    raise UsageError(f"{out} already holds a run: pass --resume to continue it, or another --out")
  theirs = json.loads(config_path.read_text())["trajectory"]
  mine = {k: getattr(args, k) for k in TRAJECTORY_KEYS}
  diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
  if diff:
    raise UsageError(f"--resume with arguments that change the run (saved, given): {diff}")


def _write_config(args: argparse.Namespace, out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  mine = {k: getattr(args, k) for k in TRAJECTORY_KEYS}
  (out / "config.json").write_text(json.dumps({"trajectory": mine, "args": vars(args)}, indent=1))


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


def evaluate(trainer: Trainer, state, batches) -> float:
  variables = trainer.variables_of(state)
  losses = [trainer.eval_fn(variables, b) for b in batches]
  return float(np.mean(jax.device_get(losses)))


def _complete_summary(out: pathlib.Path) -> Optional[dict]:
  """The summary of a finished run in ``out``, else None."""
  path = out / "summary.json"
  summary = json.loads(path.read_text()) if path.exists() else None
  return summary if summary and summary.get("complete") else None


def _checkpoints(out: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  """The complete checkpoints in ``out``, newest first. orbax writes each into a temporary
  directory and renames it when complete, so a write killed midway leaves no ``step_N``."""
  ckpts = sorted((out / "ckpt").glob("step_*"), reverse=True) if (out / "ckpt").exists() else []
  return [(int(c.name[5:]), c) for c in ckpts if c.name[5:].isdigit()]


def _restore(trainer: Trainer, out: pathlib.Path, resume: bool):
  """(state, first step): the newest readable checkpoint's with ``resume``, else a fresh state
  at 0. A checkpoint that cannot be read back is reported and the one before it used."""
  found = _checkpoints(out) if resume else []
  if not found:
    if resume and (out / "log.jsonl").exists():
      print(f"--resume: {out} has no checkpoint (--ckpt-every 0 and no --time-limit?): "
            "starting again from step 0; its log is rewritten", file=sys.stderr)
    return trainer.init_state(), 0
  # Restored into shapes only: a materialized fresh state would double peak memory.
  like = jax.eval_shape(trainer.init_state)
  for start, path in found:
    try:
      state = forge_jax.restore_train_state(path, like)
    except ckpt_lib.CheckpointReadError as e:
      print(f"--resume: skipping {path}: {e}", file=sys.stderr)
      continue
    except ValueError as e:
      raise UsageError(f"--resume: {e}") from None
    # A FORGE step skipped for a non-finite loss leaves state.step as it was (and counts in
    # state.skipped_steps); the checkpoint's name counts the loop's steps.
    taken = int(state.step) + int(getattr(state, "skipped_steps", None) or 0)
    if taken != start:
      raise UsageError(f"checkpoint {path} holds step {taken}, not {start}")
    return state, start
  raise UsageError(f"--resume: no checkpoint in {out / 'ckpt'} can be read (see above)")


def run(args: argparse.Namespace, data: Optional[data_lib.TokenData] = None) -> dict:
  """Trains as ``args`` say; returns the summary (also written to ``summary.json``).

  ``data`` may be passed in to share one loaded corpus between runs.
  """
  if args.matmul_precision is None:
    return _run(args, data)
  # Read when each program is traced: everything compiled in the run gets it.
  with jax.default_matmul_precision(args.matmul_precision):
    return _run(args, data)


def _run(args: argparse.Namespace, data: Optional[data_lib.TokenData]) -> dict:
  t_begin = time.perf_counter()  # --time-limit counts loading and compiling too
  check_args(args)
  out = pathlib.Path(args.out)
  _check_out(args, out)
  if data is None:
    data = data_lib.load(args.tokenizer, args.vocab_size, max_bytes=args.corpus_bytes,
                         eval_fraction=args.eval_fraction, cache_dir=args.data_cache)
  sampler = data_lib.BatchSampler(data.train, args.batch, args.seq, args.data_seed)
  eval_set = [jnp.asarray(b) for b in
              data_lib.eval_batches(data.eval, args.batch, args.seq, args.eval_batches)]
  trainer = build_trainer(args, data.vocab_size)
  # Every step's learning rate in one call (eagerly, each call would compile).
  lrs = np.asarray(jax.jit(jax.vmap(lr_schedule(args)))(jnp.arange(args.steps)))
  _write_config(args, out)  # only once the run is known to build
  done = _complete_summary(out) if args.resume else None
  if done is not None and not args.save_hf:
    print(f"{out}: the run is complete; its summary is unchanged", file=sys.stderr)
    return done
  state, start = _restore(trainer, out, args.resume)
  if done is not None:  # complete, and --save-hf asks for its weights
    if start < args.steps:
      raise ValueError(f"--save-hf: {out} holds a complete run but not its final checkpoint "
                       "(run it with --ckpt-every or --time-limit to keep one)")
    models.save_checkpoint(args.save_hf, trainer.cfg, jax.device_get(state.params))
    return done | {"saved_hf": args.save_hf}
  log = runlog.RunLog(out / "log.jsonl", start)
  log.write({"event": "start", "step": start, "resumed_from": start or None, "impl": args.impl,
             "data": data.info, "model": dataclasses.asdict(trainer.cfg),
             "num_params": trainer.cfg.num_params, "compile_s": trainer.compile_s,
             "xla_memory": trainer.memory, **versions()})

  bar = _progress(args, start)
  pending, step_times, last_eval = [], [], None
  tokens_per_step = args.batch * args.seq
  t_run = t_mark = time.perf_counter()
  stop = min(args.stop_at or args.steps, args.steps)
  for step in range(start, stop):
    state, metrics = trainer.step_fn(state, jnp.asarray(sampler.batch_at(step)))
    pending.append(metrics)
    done = step + 1
    out_of_time = args.time_limit and time.perf_counter() - t_begin > args.time_limit
    early = done == stop < args.steps or out_of_time
    eval_now = done == args.steps or (args.eval_every and done % args.eval_every == 0)
    ckpt_now = early or (args.ckpt_every and (done == args.steps or done % args.ckpt_every == 0))
    if not (eval_now or ckpt_now or done % args.log_every == 0):
      continue
    fetched = jax.device_get(pending)  # waits for the steps: the interval is their time
    dt = (time.perf_counter() - t_mark) / len(fetched)
    step_times += [dt] * len(fetched)
    mem = device_memory()
    for i, m in enumerate(fetched):
      k = done - len(fetched) + i + 1
      log.write({"event": "train", "step": k, "loss": float(m["loss"]),
                 "grad_norm": float(m["grad_norm"]), "lr": float(lrs[k - 1]), "step_s": dt,
                 "tokens_per_s": tokens_per_step / dt, "epoch": sampler.epoch_of(k)}
                | ({"skipped": True} if m.get("skipped", False) else {})
                | (mem if k == done else {}))
    pending = []
    if eval_now:
      t0 = time.perf_counter()
      last_eval = evaluate(trainer, state, eval_set)
      log.write({"event": "eval", "step": done, "eval_loss": last_eval,
                 "eval_s": time.perf_counter() - t0})
    if ckpt_now:
      t0 = time.perf_counter()
      path = save_checkpoint(out, done, state, args.keep_ckpts)
      log.write({"event": "ckpt", "step": done, "path": str(path),
                 "ckpt_s": time.perf_counter() - t0})
    bar.set_postfix_str(_postfix(float(fetched[-1]["loss"]), last_eval, tokens_per_step / dt, mem),
                        refresh=False)
    bar.update(len(fetched))
    t_mark = time.perf_counter()  # eval and checkpoint time stay out of the step times
    if early:
      break
  bar.close()
  summary = _summary(args, out, data, trainer, start, step_times, time.perf_counter() - t_run)
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  if summary["complete"] and args.save_hf:
    models.save_checkpoint(args.save_hf, trainer.cfg, jax.device_get(state.params))
    summary["saved_hf"] = args.save_hf
  if summary["complete"]:
    log.write({"event": "end", **summary})
  log.close()
  return summary


def _progress(args, start):
  # Plain tqdm (not tqdm.auto): text bars in notebooks too, without ipywidgets.
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=args.steps, initial=start, disable=not args.progress, desc=args.impl,
              unit="step", dynamic_ncols=True, file=sys.stderr)


def _postfix(loss, eval_loss, tps, mem) -> str:
  parts = [f"loss {loss:.3f}"]
  if eval_loss is not None:
    parts.append(f"eval {eval_loss:.3f}")
  parts.append(f"{tps:,.0f} tok/s")
  if "mem_gib" in mem:
    parts.append(f"mem {mem['mem_gib']:.2f}/{mem['peak_gib']:.2f} GiB")
  else:
    parts.append(f"rss {mem['peak_gib']:.2f} GiB")
  return " ".join(parts)


def _summary(args, out, data, trainer, start, step_times, wall_s) -> dict:
  records = read_log(out / "log.jsonl")
  train = [r for r in records if r["event"] == "train"]
  evals = [r for r in records if r["event"] == "eval"]
  # The first interval after a (re)start includes one-time work; skip it when there are others.
  steady = step_times[args.log_every:] or step_times
  step_s = float(np.median(steady)) if steady else float("nan")
  return {
      "impl": args.impl, "optimizer": args.optimizer, "model": args.model,
      "num_params": trainer.cfg.num_params, "steps": args.steps, "resumed_from": start or None,
      "step": train[-1]["step"] if train else start,
      "complete": bool(train) and train[-1]["step"] == args.steps,
      "tokens": args.steps * args.batch * args.seq,
      "final_loss": train[-1]["loss"] if train else None,
      "final_loss_mean10": float(np.mean([r["loss"] for r in train[-10:]])) if train else None,
      "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
      "step_s_median": step_s, "tokens_per_s": args.batch * args.seq / step_s,
      "compile_s": trainer.compile_s, "wall_s": wall_s, "xla_memory": trainer.memory,
      **device_memory(), "data": data.info, **versions(),
  }


def main(argv=None) -> int:
  try:
    args = parse_args(argv)
    s = run(args)
  except UsageError as e:
    print(f"{pathlib.Path(sys.argv[0]).name or 'train'}: error: {e}", file=sys.stderr)
    return 2
  if not s["complete"]:
    print(f"stopped at step {s['step']} of {s['steps']} (checkpointed): continue with --resume")
    return 0
  mem = f"{s['peak_gib']:.2f} GiB ({s['mem_source']})"
  print(f"{s['impl']}/{s['optimizer']} {s['model']}: {s['steps']} steps, final loss "
        f"{s['final_loss']:.4f}, eval {s['final_eval_loss']:.4f}, "
        f"{s['step_s_median'] * 1e3:.1f} ms/step, {s['tokens_per_s']:,.0f} tok/s, peak {mem}, "
        f"XLA step {s['xla_memory'].get('step_gib', float('nan')):.3f} GiB; corpus "
        f"{s['data']['corpus_sha256'][:12]} ({s['data']['corpus_bytes']:,} bytes, Python "
        f"{s['data']['python']}); log {args.out}/log.jsonl")
  return 0


if __name__ == "__main__":
  sys.exit(main())
