"""Whole-model training steps on one GPU: FORGE vs optax, memory and speed.

Each row is one fresh process (peak memory is per process) training a preset
of ``models`` with random weights on random tokens:

* the same next-token loss (``--loss``: ``lean``, :func:`models.cross_entropy`,
  the default; ``optax``, optax's cross-entropy on float32 logits, as every
  run before 2026-11-30);
* same model, batch, precision (``--dtype``: params, compute and optimizer
  states in that dtype, except the int8 states of ``forge_int8*``;
  ``--master-dtype float32`` keeps weights and states in float32 and computes
  in ``--dtype``), attention kernel and activation checkpointing (``--remat``:
  ``full``, every block recomputed from its input, the default; ``none``; a
  ``jax.checkpoint_policies`` name; or ``save_all_but_elementwise``) in every row, unless the
  row says otherwise (below);
* implementations (``--impls``, a comma list):

  - ``optax``: optax.adamw, a donated ``jax.jit`` step (the baseline);
  - ``optax_clip``: ``clip_by_global_norm(1.0)`` + adamw, the same step;
  - ``forge``: forge_jax.adamw (the scanned stack is a forge_jax.ScannedStack);
  - ``forge_sr``: forge_jax.adamw, bfloat16 weights written back with
    stochastic rounding (``Precision(weight_rounding="stochastic")``);
  - ``forge_int8``: forge_jax.adamw with int8 optimizer states
    (``Precision(state_dtype="int8")``, blocks of 64 along N);
  - ``forge_int8_sr``: int8 states and stochastically rounded weights;
  - ``forge_noguard``, ``forge_int8_noguard``: ``forge``, ``forge_int8`` with the non-finite
    guard off (``train_step(skip_nonfinite=False)`` and the kernels'
    ``Precision(nonfinite="propagate")``): what the guard costs a step;
  - a FORGE implementation with the suffix ``_xla``, ``_pallas`` or
    ``_mosaic`` (``forge_xla``, ``forge_int8_xla``, ...): that
    ``ModelConfig.forge_backend`` (default ``"auto"``): ``_xla`` is FORGE's
    update order (each layer updated in the backward pass, no gradient pool)
    with XLA's GEMM and a fused elementwise update instead of the fused kernel;
  - any of them with the suffix ``_unrolled`` (``optax_unrolled``,
    ``forge_unrolled``, ...): layers unrolled (``scan_layers=False``) instead
    of scanned. ``--unrolled`` appends it to every implementation.

* a row's own settings, after its name: ``:remat=X`` (``none``, ``full`` or
  a policy name), ``:master=float32`` (weights and optimizer states in that
  dtype, compute in ``--dtype``), ``:mem=0.95`` (that row's allocator limit,
  as ``--mem-fraction``), ``:api=nnx`` (a FORGE row's model in Flax NNX:
  ``models.nnx.CausalLM`` trained by ``forge_jax.nnx.train_step``, against the
  default ``api=linen``), ``:mesh=P`` (a FORGE row on a P-device mesh, tensor-parallel
  over it: docs/parallel.md; ``:mesh=1`` measures what a 1-device mesh costs), ``:xla=dsf``
  (XLA flags for that row's worker, by name: ``XLA_FLAG_SETS``; several joined by ``+``),
  ``:stacked=N`` (a scanned FORGE row's ``forge_jax._fused.STACKED_GEMM_MAX_ROWS``: the most
  rows for which its stacked layers' products run on the Mosaic stacked GEMM; ``0``: XLA's slice
  and dot), e.g. ``optax_unrolled:remat=none:master=float32:mem=0.95``.
  The row's ``impl`` is the whole name; its ``remat``, ``param_dtype`` and
  ``mem_fraction`` are recorded. The model config validates the combination
  (e.g. a name policy without names): a refused one is an error row.

* a row that runs out of memory is recorded as ``OOM``, not dropped; a worker
  that runs past ``--timeout`` seconds is killed and recorded as a timeout.

Table mode (the default) runs every model x ``--batch`` x ``--tokens`` x
``--impls`` row (``--batch`` and ``--tokens`` are comma lists) and writes
``<tag>.json``, ``<tag>.md`` and (with matplotlib) ``<tag>.png`` under
``--out``; the tag is ``$BENCH_TAG`` or ``bench_models``. The markdown compares
every row with the same model/batch/tokens row of ``optax_clip`` (peak
memory ratio) and of ``optax`` (step-time ratio).

``--capacity`` instead finds, for each model x impl at one ``--tokens``, the
largest batch that runs: batches 1, 2, 4, ... up to ``--max-batch`` until the
first OOM or error, every tried batch recorded. Writes ``capacity.json``,
``capacity.md`` and ``capacity.png``.

``--time-budget SECONDS``: a row is launched only while the elapsed time plus
the median wall time of the rows so far fits the budget (the longest skipped
too many rows on the H200: one slow row shut out the rest); the others are
recorded as ``skipped: time budget``, and a worker's timeout is cut to what is
left of the budget. Results are rewritten after every row, so a killed run
still leaves them. Each row records ``wall_s``, its worker's wall seconds.

The full table on one H200 (one command, under the 600 s limit of a call)::

    PYTHONPATH=$PWD python -m experiments.bench_models --out $OUT \\
        --models qwen3-0.6b,qwen3-1.7b,qwen3-4b,qwen3-8b,llama-3.1-8b,qwen3-14b \\
        --batch 1 --tokens 1024 \\
        --impls optax,optax_unrolled,optax_clip,forge,forge_unrolled,forge_int8 \\
        --time-budget 560

and the capacity table::

    PYTHONPATH=$PWD python -m experiments.bench_models --out $OUT --capacity \\
        --models qwen3-0.6b,qwen3-8b --tokens 1024 --impls optax_clip,forge,forge_int8 \\
        --max-batch 64 --time-budget 560 --steps 1

Compile time: each row records ``compile_s``, the seconds to trace, lower and
compile its step in the process that compiled it (with ``--precompile``, the
precompile process, running beside the others: ``compile_parallel``).

Step times are device time: ``--steps`` steps back to back, blocked once, the
median of 3 such repeats after 3 warm-up steps (so a row runs 3 + 3 x steps
steps after compiling; ``--steps 1`` where only the memory matters, as in the
capacity table). Rows before 2026-11-30 took the mean of 5 steps after one
warm-up step (``results_tables`` marks them).

The parent process never initializes a JAX backend (the device name comes
from the workers), so it holds no GPU memory of its own.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

IMPLS = ("optax", "optax_clip", "forge", "forge_sr", "forge_int8", "forge_int8_sr",
         "forge_noguard", "forge_int8_noguard")
UNROLLED = "_unrolled"
FORGE_BACKENDS = ("xla", "pallas", "mosaic")  # optional "_<backend>" suffix of a forge impl
REMAT = "full"  # --remat's default
ROW_OPTIONS = ("remat", "master", "mem", "api", "mesh", "xla", "stacked")
# ":xla=NAME[+NAME]": XLA flags a row's worker runs with (appended to $XLA_FLAGS), by name.
XLA_FLAG_SETS = {
    # cuBLAS GEMMs and copies read a dynamic slice of a stacked operand in place (a scanned
    # stack's per-layer weight) instead of copying it out first.
    "dsf": "--xla_gpu_enable_dynamic_slice_fusion=true",
    # a while loop's body unrolled by two (the scanned stack's layers), so that one layer's work
    # can overlap the next's.
    "dbuf": "--xla_gpu_enable_while_loop_double_buffering=true",
    # every GEMM to cuBLAS (no Triton GEMM fusions): with dsf, a cuBLAS GEMM can read its
    # operand from the stack in place.
    "notriton": "--xla_gpu_enable_triton_gemm=false",
    # jax's default on GPU is on: the latency-hiding scheduler's view of a row, off.
    "nolhs": "--xla_gpu_enable_latency_hiding_scheduler=false",
    # while loops and conditionals recorded into CUDA graphs with the rest (a scanned stack's
    # loop over layers one graph launch, not one per layer).
    "cbw": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    # the LLVM module split and compiled in parallel (an unrolled model's compile_s, and its
    # model.init's compile, which --precompile records in phases_s).
    "par": "--xla_gpu_enable_llvm_module_compilation_parallelism=true",
}  # ":key=value" after a row's implementation name
APIS = ("linen", "nnx")  # the front end of a row (":api=nnx")
SKIPPED = "skipped: time budget"
TIMING = "median3"  # meta["timing"]: how step_ms was taken (absent: mean of 5 after 1 warm-up)


def parse_impl(impl: str) -> tuple[str, bool]:
  """``(base implementation, scan_layers)`` of an ``--impls`` name.

  The base keeps a FORGE backend suffix (``forge_xla``); see :func:`forge_backend`.
  """
  impl = impl.split(":", 1)[0]  # a row's own settings follow its name (parse_spec)
  base = impl[:-len(UNROLLED)] if impl.endswith(UNROLLED) else impl
  if forge_backend(base)[0] not in IMPLS:
    names = ", ".join(IMPLS)
    raise ValueError(
        f"Unknown implementation {impl!r}: one of {names}, a forge one optionally + "
        f"'_' + one of {FORGE_BACKENDS}, then optionally + {UNROLLED!r}.")
  return base, not impl.endswith(UNROLLED)


def parse_spec(spec: str) -> tuple[str, dict]:
  """``(implementation, {option: value})`` of a row name such as
  ``optax_unrolled:remat=none:master=float32:mem=0.95``.

  Options (``ROW_OPTIONS``) override the run's ``--remat``, ``--master-dtype`` and
  ``--mem-fraction`` for that row. Values are passed through to the model config, which
  validates them (a combination it refuses becomes an error row); ``mem`` is
  checked here, since it sets the worker's environment.
  """
  name, *parts = spec.split(":")
  parse_impl(name)
  options = {}
  for part in parts:
    key, eq, value = part.partition("=")
    if key not in ROW_OPTIONS or not eq or not value:
      raise ValueError(f"Bad row option {part!r} in {spec!r}: use key=value with key one of "
                       f"{ROW_OPTIONS}, e.g. {name}:remat=none:master=float32:mem=0.95")
    if key in options:
      raise ValueError(f"Row option {key!r} given twice in {spec!r}")
    options[key] = value
  if "mem" in options:
    try:
      mem = float(options["mem"])
    except ValueError:
      mem = math.nan
    if not 0 < mem <= 1:
      raise ValueError(f"mem={options['mem']!r} in {spec!r} must be a fraction in (0, 1], e.g. 0.95")
    options["mem"] = mem
  if options.get("api", "linen") not in APIS:
    raise ValueError(f"api={options['api']!r} in {spec!r} must be one of {APIS}")
  if options.get("api") == "nnx" and not name.startswith("forge"):
    raise ValueError(f"api=nnx in {spec!r} is for FORGE rows (forge_jax.nnx.train_step); "
                     "the optax rows are Linen")
  if "mesh" in options and options.get("api") == "nnx":
    raise ValueError(f"{spec!r}: :mesh= is for Linen rows (models.CausalLM(tensor_parallel=...)); "
                     "the NNX models take no mesh")
  if "mesh" in options:
    if not options["mesh"].isdigit() or int(options["mesh"]) < 1 or not name.startswith("forge"):
      raise ValueError(f"mesh={options['mesh']!r} in {spec!r}: a FORGE row's tensor-parallel size, "
                       "an int >= 1 (mesh=1: the model on a 1-device mesh), e.g. forge:mesh=1")
    options["mesh"] = int(options["mesh"])
  if "stacked" in options:
    if not options["stacked"].isdigit() or not name.startswith("forge"):
      raise ValueError(f"stacked={options['stacked']!r} in {spec!r}: a FORGE row's most rows for "
                       "the Mosaic stacked GEMM, an int >= 0 (0: off), e.g. forge:stacked=0")
    options["stacked"] = int(options["stacked"])
  if "xla" in options:
    unknown = [f for f in options["xla"].split("+") if f not in XLA_FLAG_SETS]
    if unknown:
      raise ValueError(f"xla={options['xla']!r} in {spec!r}: unknown flag set(s) {unknown}; "
                       f"one or more of {sorted(XLA_FLAG_SETS)} joined by '+', e.g. xla=dsf+dbuf")
  return name, options


def xla_flags(spec: str) -> str:
  """The XLA flags of a row's ``:xla=`` option ("" without one)."""
  names = parse_spec(spec)[1].get("xla")
  return " ".join(XLA_FLAG_SETS[n] for n in names.split("+")) if names else ""


def row_settings(spec: str, remat: str = REMAT, master_dtype: str | None = None,
                 mem_fraction: float | None = None) -> dict:
  """A row's ``remat``, ``param_dtype`` (None: the compute dtype) and ``mem_fraction``: its
  own options where it has them, else the run's."""
  _, options = parse_spec(spec)
  settings = {"remat": options.get("remat", remat), "param_dtype": options.get("master", master_dtype),
              "mem_fraction": options.get("mem", mem_fraction)}
  for key in ("mesh", "stacked"):
    if key in options:
      settings[key] = options[key]
  return settings


def forge_backend(base: str) -> tuple[str, str]:
  """``("forge_int8", "xla")`` for ``"forge_int8_xla"``; backend ``"auto"`` without a suffix."""
  head, _, tail = base.rpartition("_")
  if head.startswith("forge") and tail in FORGE_BACKENDS:
    return head, tail
  return base, "auto"


LOSSES = ("lean", "optax")


def _loss(apply_fn, variables, tokens, kind: str = "lean"):
  """Next-token cross-entropy in float32: ``models.cross_entropy`` ("lean", no
  float32 copy of the logits) or optax's on upcast logits (the spelling of
  every run before 2026-11-30, whose float32 logits XLA materializes)."""
  import jax.numpy as jnp
  import models
  import optax
  logits = apply_fn(variables, tokens[:, :-1])
  if kind == "lean":
    return models.cross_entropy(logits, tokens[:, 1:])
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def skips_nonfinite(base: str) -> bool:
  """Whether a FORGE row's train_step skips steps with a non-finite loss (all but ``_noguard``)."""
  return "noguard" not in base


def _forge_optimizer(base: str):
  import forge_jax
  precision = {
      "forge": {},
      "forge_sr": {"weight_rounding": "stochastic"},
      "forge_int8": {"state_dtype": "int8"},
      "forge_int8_sr": {"state_dtype": "int8", "weight_rounding": "stochastic"},
      "forge_noguard": {"nonfinite": "propagate"},
      "forge_int8_noguard": {"state_dtype": "int8", "nonfinite": "propagate"},
  }
  if base not in precision:
    return None
  return forge_jax.adamw(1e-5, weight_decay=0.0, precision=forge_jax.Precision(**precision[base]))


def _memory_gib(jax, key: str) -> float:
  """A device memory statistic in GiB, NaN where the backend does not report it (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get(key, float("nan")) / 2**30


def _peak_gib(jax) -> float:
  return _memory_gib(jax, "peak_bytes_in_use")


def _limit_gib(jax) -> float:
  """The allocator's limit: what "OOM" is measured against (jax's default: a fraction of the
  device's memory, ``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""
  return _memory_gib(jax, "bytes_limit")


def optax_baseline(base: str, loss_fn):
  """``(tx, step)``: the optax baseline's transformation and its donated jit step.

  ``step((params, opt_state), data) -> ((params, opt_state), {"loss": ...})``.
  """
  import jax
  import optax

  tx = optax.adamw(1e-5, weight_decay=0.0)
  if base == "optax_clip":
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(s, data):
    params, opt_state = s
    loss, grads = jax.value_and_grad(lambda p: loss_fn({"params": p}, data))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

  return tx, step


def build_step(model_name: str, impl: str, batch: int, tokens: int, dtype: str,
               attention: str, loss: str = "lean", on_compiled=None, layers: int | None = None,
               compile_first: bool = False, compile_only: bool = False, remat: str = REMAT,
               master_dtype: str | None = None):
  """``(row, step, carry)``: one row's model, initialised state and compiled step.

  ``step(state) -> (state, metrics)`` runs one training step on random tokens
  (the state is donated); ``carry`` is the ``(state, metrics)`` of a first step,
  so ``step(carry[0])`` chains. ``row`` holds the row's settings,
  ``init_peak_gib``, ``xla_step_gib``, ``limit_gib`` and ``compile_and_first_s``, with its parts in
  ``phases_s`` (``abstract_state``, ``trace_lower``, ``compile``, ``init_compile``, ``init``,
  ``make_state``, ``first_step``; seconds); ``step_from_cache`` and ``init_from_cache`` say whether
  jax's persistent compilation cache supplied the step and the init.
  ``layers`` cuts the model to that many layers (default: the preset's).
  ``on_compiled(row)`` is called once the step is compiled, before it first runs
  (the worker reports XLA's plan then, so that a step that runs out of memory
  still says how much it planned).

  ``compile_first`` compiles the step from the state's shapes before the state exists, as
  ``experiments.train`` does; otherwise it is compiled from the initialised state. XLA's GEMM
  autotuner allocates buffers while it compiles: on the H200 they add 2.04 GiB to the peak of a
  Llama-3.1-8B ``forge_xla`` step compiled next to its state
  (results/h200/unrolled_diag_gpu/noautotune at commit 2b67016), and compiling first removes them at the same step
  time (results/h200/compile_first). ``row["compile_first"]`` records which.
  ``compile_only`` (implies ``compile_first``) stops once the step and the init are compiled: ``(row, None,
  None)`` (with a persistent compilation cache, this fills it). ``row["compile_s"]``: seconds to trace,
  lower and compile the step, absent where the step came from the cache.
  ``impl`` may carry the row's own ``remat``/``master`` (:func:`parse_spec`), over ``remat`` and
  ``master_dtype`` (weights and optimizer states; None: ``dtype``, the compute dtype).
  """
  import jax

  from experiments import runlog

  import forge_jax
  import models

  base, scan = parse_impl(impl)
  base, backend = forge_backend(base)
  settings = row_settings(impl, remat, master_dtype)
  remat, param_dtype = settings["remat"], settings["param_dtype"] or dtype
  linear = "forge" if base.startswith("forge") else "flax"
  cut = {} if layers is None else {"num_layers": layers}
  cfg = models.get_config(model_name, linear=linear, remat=remat, scan_layers=scan,
                          forge_backend=backend,
                          param_dtype=param_dtype, dtype=dtype, attention=attention, **cut)
  row = {"model": model_name, "impl": impl, "batch": batch, "tokens": tokens, "dtype": dtype,
         "param_dtype": param_dtype,
         "layers": cfg.num_layers, "scan": scan, "attention": attention, "remat": remat, "loss_fn": loss,
         "forge_backend": backend if linear == "forge" else None, "params_b": cfg.num_params / 1e9,
         "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
  if linear == "forge" and backend == "auto" and jax.devices()[0].platform == "gpu":
    from experiments import _timing  # pylint: disable=g-import-not-at-top

    row["auto_table"] = _timing.auto_table_used(row["device"])
  opt = _forge_optimizer(base)
  if "stacked" in settings:  # this worker's limit for the stacked GEMM (one row per process)
    from forge_jax import _fused  # pylint: disable=g-import-not-at-top
    _fused.STACKED_GEMM_MAX_ROWS = row["stacked_gemm_max_rows"] = settings["stacked"]
  tp = None
  if "mesh" in settings:  # tensor parallelism over the first `mesh` devices
    import numpy as np  # pylint: disable=g-import-not-at-top
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:settings["mesh"]]), ("tensor",))
    tp = forge_jax.TensorParallel(mesh, "tensor")
    row["mesh"] = settings["mesh"]
  data = jax.random.randint(jax.random.PRNGKey(0), (batch, tokens + 1), 0, cfg.vocab_size)
  if parse_spec(impl)[1].get("api") == "nnx":
    row["api"] = "nnx"
    return _build_nnx_step(cfg, row, opt, data, loss, on_compiled, compile_first, compile_only)
  model = models.CausalLM(cfg, optimizer=opt, tensor_parallel=tp)
  loss_fn = functools.partial(_loss, model.apply, kind=loss)
  if opt is not None and tp is not None:
    def make_state(v):
      state = forge_jax.TrainState.create(model.apply, v, opt)
      shardings = forge_jax.shard_tree(tp, state, models.TENSOR_PARALLEL_LAYOUT)
      if isinstance(jax.tree.leaves(state)[0], jax.ShapeDtypeStruct):  # compile_first: shapes
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            state, shardings)
      return jax.device_put(state, shardings)
    lower = lambda s: forge_jax.train_step.lower(s, data, loss_fn)
  elif opt is not None:
    make_state = lambda v: forge_jax.TrainState.create(model.apply, v, opt)
    lower = lambda s: forge_jax.train_step.lower(s, data, loss_fn,
                                                 skip_nonfinite=skips_nonfinite(base))
  else:
    tx, optax_step = optax_baseline(base, loss_fn)
    make_state = lambda v: (v["params"], tx.init(v["params"]))
    lower = lambda s: optax_step.lower(s, data)
  row["compile_first"] = compile_first = compile_first or compile_only
  t0 = time.perf_counter()
  compiled = None
  hits = count_cache_hits()
  phases = row["phases_s"] = {}  # where compile_and_first_s goes

  def compile_step(state):
    tick = time.perf_counter()
    lowered = lower(state)  # tracing and lowering: never cached
    phases["trace_lower"] = time.perf_counter() - tick
    before, tick = len(hits), time.perf_counter()
    out = lowered.compile()  # XLA's compile, or a load from jax's persistent cache
    phases["compile"] = time.perf_counter() - tick
    row["step_from_cache"] = len(hits) > before
    if not row["step_from_cache"]:
      row["compile_s"] = phases["trace_lower"] + phases["compile"]
    return out

  if compile_first:
    tick = time.perf_counter()
    abstract = jax.eval_shape(lambda: make_state(model.init(jax.random.PRNGKey(1), data[:, :-1])))
    phases["abstract_state"] = time.perf_counter() - tick
    compiled = compile_step(abstract)
  init_args = (jax.random.PRNGKey(1), data[:, :-1])
  tick, before = time.perf_counter(), len(hits)
  # model.init compiled on its own, so that --precompile caches it too: an unrolled model's
  # init is one program per layer's parameters, slower to compile than to run (qwen3-0.6b
  # unrolled on XLA:CPU: 45 s of init, most of it compiling).
  init = jax.jit(model.init).lower(*init_args).compile()
  phases["init_compile"] = time.perf_counter() - tick
  row["init_from_cache"] = len(hits) > before
  if compile_only:
    return row, None, None
  tick = time.perf_counter()
  variables = init(*init_args)
  jax.block_until_ready(variables)
  phases["init"] = time.perf_counter() - tick
  # The process peak so far: init's (random normal draws in float32, state
  # construction), and with compile_first the compiler's. If it equals the final
  # peak, init set it, not the step.
  row["init_peak_gib"] = _peak_gib(jax)
  tick = time.perf_counter()
  state = make_state(variables)
  jax.block_until_ready(state)
  phases["make_state"] = time.perf_counter() - tick
  if compiled is None:
    compiled = compile_step(state)
  step = lambda s: compiled(s, data)
  # XLA's plan for one step: arguments + outputs - donated + temporaries.
  row["xla_step_gib"] = runlog.xla_memory(compiled).get("step_gib", float("nan"))
  row["limit_gib"] = _limit_gib(jax)
  if on_compiled is not None:
    on_compiled(row)
  tick = time.perf_counter()
  carry = step(state)
  jax.block_until_ready(carry)
  phases["first_step"] = time.perf_counter() - tick
  row["compile_and_first_s"] = time.perf_counter() - t0
  return row, step, carry


def _nnx_loss(model, tokens, kind: str = "lean"):
  """:func:`_loss` for an NNX model (``loss_fn(model, batch)``)."""
  return _loss(lambda _, t: model(t), None, tokens, kind)


def _build_nnx_step(cfg, row, opt, data, loss: str, on_compiled, compile_first: bool,
                    compile_only: bool):
  """:func:`build_step` for an ``api=nnx`` row: the NNX model (``models.nnx.CausalLM``) and its
  ``forge_jax.nnx.Optimizer``, built under ``nnx.jit`` (as the Linen rows' ``jax.jit(model.init)``:
  XLA plans the initializers' temporaries, which eager construction would add to the process
  peak), and the step compiled for
  them (``forge_jax.nnx.train_step.lower``; with ``compile_first`` from their shapes,
  ``nnx.eval_shape``); ``step((model, optimizer))`` runs it and writes the result into the
  model, as ``forge_jax.nnx.train_step`` does."""
  import jax
  from flax import nnx

  from experiments import runlog

  import forge_jax.nnx
  import models.nnx

  def make():
    model = models.nnx.CausalLM(cfg, opt, rngs=nnx.Rngs(1))
    return model, forge_jax.nnx.Optimizer(model, opt, wrt=nnx.Param)

  row["compile_first"] = compile_first = compile_first or compile_only
  phases = row["phases_s"] = {}
  hits = count_cache_hits()
  loss_fn = functools.partial(_nnx_loss, kind=loss)
  t0 = time.perf_counter()

  def compile_step(model, optimizer):
    tick = time.perf_counter()
    lowered = forge_jax.nnx.train_step.lower(model, optimizer, data, loss_fn)
    phases["trace_lower"] = time.perf_counter() - tick
    before, tick = len(hits), time.perf_counter()
    out = lowered.compile()
    phases["compile"] = time.perf_counter() - tick
    row["step_from_cache"] = len(hits) > before
    if not row["step_from_cache"]:
      row["compile_s"] = phases["trace_lower"] + phases["compile"]
    return out

  compiled = None
  if compile_first:
    tick = time.perf_counter()
    abstract = nnx.eval_shape(make)
    phases["abstract_state"] = time.perf_counter() - tick
    compiled = compile_step(*abstract)
  if compile_only:
    return row, None, None
  tick = time.perf_counter()
  model, optimizer = nnx.jit(make)()
  jax.block_until_ready((nnx.state(model), nnx.state(optimizer)))
  phases["init"] = time.perf_counter() - tick
  row["init_peak_gib"] = _peak_gib(jax)
  if compiled is None:
    compiled = compile_step(model, optimizer)
  row["xla_step_gib"] = runlog.xla_memory(compiled).get("step_gib", float("nan"))
  row["limit_gib"] = _limit_gib(jax)
  if on_compiled is not None:
    on_compiled(row)
  step = lambda s: (s, compiled(*s, data))
  tick = time.perf_counter()
  carry = step((model, optimizer))
  jax.block_until_ready(carry[1])
  phases["first_step"] = time.perf_counter() - tick
  row["compile_and_first_s"] = time.perf_counter() - t0
  return row, step, carry


def worker(model_name: str, impl: str, batch: int, tokens: int, dtype: str,
           attention: str, steps: int, loss: str = "lean", compile_first: bool = False,
           remat: str = REMAT, master_dtype: str | None = None, profile: bool = False) -> dict:
  import jax

  from experiments import _timing

  def plan(row):  # read by Runner.run if the worker dies before its ROW line
    print(PLAN + json.dumps({k: row[k] for k in ("init_peak_gib", "xla_step_gib", "limit_gib")}),
          flush=True)

  row, step, (state, metrics) = build_step(model_name, impl, batch, tokens, dtype, attention, loss,
                                           on_compiled=plan, compile_first=compile_first,
                                           remat=remat, master_dtype=master_dtype)
  # Device time: `steps` steps back to back, blocked once, median of 3 repeats,
  # after 3 warm-up steps. (Until 2026-11-30 this was one warm-up step and the mean
  # of 5 steps, which read forge_unrolled on qwen3-0.6b as 32.0 ms where this
  # reads 22.0: results/h200/diagnose_unrolled_28.)
  start = time.time()
  timing, (state, metrics) = _timing.time_steps(lambda c: step(c[0]), (state, metrics),
                                                warmup=3, iters=steps, repeats=3)
  # The timed steps' wall-clock window (warm-up included), where GPU clock samples are matched
  # to this row (experiments.reproduce --clocks).
  row["steps_window"] = [start, time.time()]
  row["step_ms"] = timing.median_ms
  row["step_ms_repeats"] = list(timing.repeats_ms)
  row["tokens_per_s"] = batch * tokens / (timing.median_ms / 1e3)
  row["loss"] = float(metrics["loss"])
  row["peak_gib"] = _peak_gib(jax)
  if profile:  # after the timing, so that the trace costs it nothing
    def run():
      nonlocal state, metrics
      for _ in range(steps):
        state, metrics = step(state)
      jax.block_until_ready((state, metrics))
    try:
      row["profile"] = _timing.device_profile(run, steps)
    except Exception as e:  # pylint: disable=broad-except  (the timed row stands without it)
      row["profile"] = {"error": _timing.short_error(e)}
  return row


def count_cache_hits() -> list:
  """A list that grows by one each time jax loads a program from its persistent compilation cache."""
  import jax
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
  return hits


class Runner:
  """Runs rows in worker processes within ``--time-budget``."""

  def __init__(self, args):
    self.args = args
    self.start = time.monotonic()
    self.walls: list = []  # wall seconds of the rows so far: their median is the next row's estimate
    self.device = None
    self.limit = float("nan")  # the allocator's limit the rows report (GiB)
    self._probed = False
    self.compiled: dict = {}  # --precompile's record per (model, impl, batch, tokens)

  def device_name(self) -> str:
    """The device the rows ran on. If no row reported one (every row so far failed, e.g. OOM),
    jax is asked once in a subprocess (this process never initialises a backend)."""
    if self.device is None and not self._probed:
      self._probed = True
      probe = [sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"]
      try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
      except subprocess.TimeoutExpired:
        proc = None
      if proc is not None and proc.returncode == 0 and proc.stdout.strip():
        self.device = proc.stdout.strip().splitlines()[-1]
    return self.device or "unknown"

  def elapsed(self) -> float:
    return time.monotonic() - self.start

  def worker_cmd(self, model_name: str, impl: str, batch: int, tokens: int) -> list:
    args = self.args
    return ([sys.executable, "-m", "experiments.bench_models", "--worker", impl,
             "--models", model_name, "--tokens", str(tokens), "--batch", str(batch),
             "--dtype", args.dtype, "--attention", args.attention, "--steps", str(args.steps),
             "--loss", args.loss, "--remat", args.remat]
            + (["--master-dtype", args.master_dtype] if args.master_dtype else [])
            + (["--compile-first"] if args.compile_first else [])
            + (["--profile"] if args.profile else []))

  def row_env(self, impl: str, preallocate: bool) -> dict:
    """The environment of a row's worker: its own allocator limit (``:mem=``) or the run's."""
    mem = row_settings(impl, mem_fraction=self.args.mem_fraction)["mem_fraction"]
    env = worker_env(mem, preallocate, self.args.compile_cache)
    if xla_flags(impl):
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags(impl)).strip()
    return env

  def precompile(self, cells) -> list:
    """Compiles every (model, impl, batch, tokens) of ``cells`` into the persistent compilation
    cache, ``--precompile`` worker processes at a time, before any row runs: the timed workers
    that follow load their step and their ``model.init`` from the cache instead of compiling them
    (an unrolled 8B step takes 110-180 s to compile on the H200's host, one core at a time; a
    row that compiles its init itself still takes 105-125 s to its first step: ``phases_s`` in
    each row says where the time goes).
    The compiles autotune on the device concurrently, so a cached step may hold other GEMM choices
    than one compiled alone, and at large batches the autotuners' operands (the logits: 15.7 GiB at
    Llama-3.1-8B's 64x1024) can run the device out of memory: such a cell's record says so, and its
    timed row compiles alone. Returns one record per cell: seconds, exit status and, on failure,
    the last line and ``compile_s``, the step's compile seconds."""
    import concurrent.futures

    left = (None if self.args.time_budget is None else self.args.time_budget - self.elapsed())
    timeout = self.args.timeout if left is None else max(1, min(self.args.timeout, int(left)))

    def compile_one(cell):
      cmd = self.worker_cmd(*cell) + ["--compile-only"]
      # Never preallocated: several compile processes share the device at once (with
      # --preallocate each would reserve the whole limit and all but the first would fail).
      env = self.row_env(cell[1], False)
      t0 = time.monotonic()
      row = None
      try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, err = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1][:300]
        row = parse_worker_output(proc.stdout)[0]
      except subprocess.TimeoutExpired:
        rc, err = None, f"timeout after {timeout} s"
      record = dict(zip(("model", "impl", "batch", "tokens"), cell), seconds=time.monotonic() - t0, rc=rc)
      if row is not None and "compile_s" in row:
        record["compile_s"] = row["compile_s"]
      if row is not None and "phases_s" in row:  # where the rest of `seconds` went (model.init's compile)
        record["phases_s"] = row["phases_s"]
      return record if rc == 0 else {**record, "error": err}

    with concurrent.futures.ThreadPoolExecutor(max_workers=self.args.precompile) as pool:
      self.compiled = {(r["model"], r["impl"], r["batch"], r["tokens"]): r
                       for r in pool.map(compile_one, cells)}
    return list(self.compiled.values())

  def run(self, model_name: str, impl: str, batch: int, tokens: int) -> dict:
    args = self.args
    settings = row_settings(impl, args.remat, args.master_dtype, args.mem_fraction)
    base = {"model": model_name, "impl": impl, "batch": batch, "tokens": tokens,
            "dtype": args.dtype, "param_dtype": settings["param_dtype"] or args.dtype,
            "scan": parse_impl(impl)[1], "attention": args.attention, "remat": settings["remat"]}
    timeout = args.timeout
    if args.time_budget is not None:
      left = args.time_budget - self.elapsed()
      if left - (statistics.median(self.walls) if self.walls else 0.0) < 0:
        return {**base, "error": SKIPPED, "wall_s": 0.0}
      timeout = max(1, min(timeout, int(left)))
    cmd = self.worker_cmd(model_name, impl, batch, tokens)
    env = self.row_env(impl, args.preallocate)
    t0 = time.monotonic()
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
      cut = " (time budget)" if timeout < args.timeout else ""
      row = {**base, "error": f"timeout {timeout}s{cut}",
             **parse_worker_output(e.stdout or "")[1]}
    else:
      row, plan = parse_worker_output(proc.stdout)
      if row is None:
        row = {**base, "error": _error(proc.stderr, proc.returncode), **plan}
        if row["error"] == "OOM":
          row["error_detail"] = _oom_detail(proc.stderr)
    row["wall_s"] = time.monotonic() - t0
    row["mem_fraction"] = settings["mem_fraction"]
    if xla_flags(impl):
      row["xla_flags"] = xla_flags(impl)
    pre = self.compiled.get((model_name, impl, batch, tokens), {})
    if "compile_s" in pre and "compile_s" not in row:  # the step came from the precompile's cache
      row["compile_s"] = pre["compile_s"]
      row["compile_parallel"] = args.precompile
    self.walls.append(row["wall_s"])
    self.device = self.device or row.get("device")
    if _finite(row.get("limit_gib")):
      self.limit = row["limit_gib"]
    return row


def _error(stderr: str, returncode: int) -> str:
  """``OOM``, else the exception line of a failed worker's traceback (300 characters)."""
  err = stderr.strip().splitlines()
  if any("RESOURCE_EXHAUSTED" in l or "out of memory" in l.lower() for l in err):
    return "OOM"
  # JAX appends a note on its filtered frames after the exception line.
  err = [l for l in err if l.strip() and not l.startswith("-----")
         and "JAX_TRACEBACK_FILTERING" not in l]
  exc = [l for l in err if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", l)]
  line = (exc or err or [f"exit {returncode}"])[-1]
  return line[:300]


PLAN = "PLAN "


def worker_env(mem_fraction: float | None, preallocate: bool = False,
               compile_cache: str | None = None) -> dict:
  """A worker's environment: the allocator's limit as a fraction of the device's memory when
  ``mem_fraction`` is given (jax's default otherwise); no preallocation unless ``preallocate``.

  Either way a row's peak is its own (one process per row) and ``peak_bytes_in_use`` counts what
  the step used. What differs is where an OOM falls: without preallocation the allocator grows
  its pool region by region, and a request for XLA's temporaries (one contiguous buffer) can
  fail below the limit (on the H200: optax+clip at 40x1024 failed on a 44.5 GiB request while its
  planned step, 89.4 GiB, was under the 104.9 GiB limit). jax's default is to preallocate the whole limit as one region."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="true" if preallocate else "false")
  if compile_cache is not None:  # jax's persistent compilation cache, every program kept
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.abspath(compile_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  if mem_fraction is not None:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:g}"
  return env


def parse_worker_output(stdout) -> tuple[dict | None, dict]:
  """``(row, plan)`` from a worker's stdout: its ``ROW`` (None if it died first) and its ``PLAN``
  (XLA's planned step memory and the allocator's limit; empty if it died before compiling)."""
  if isinstance(stdout, bytes):
    stdout = stdout.decode(errors="replace")
  row, plan = None, {}
  for line in stdout.splitlines():
    if line.startswith("ROW "):
      row = json.loads(line[4:])
    elif line.startswith(PLAN):
      plan = json.loads(line[len(PLAN):])
  return row, plan


def _oom_detail(stderr: str) -> str:
  """The allocator's own line of an OOM (what it tried to allocate and against which limit), 300
  characters: the ``OOM`` label alone cannot tell a batch that misses by 1 GiB from one that misses
  by 50."""
  lines = [l.strip() for l in stderr.splitlines()]
  # The allocator's own line names the size; else the last error line (an earlier "out of
  # memory" can be a warning that did not fail the run, e.g. from the autotuner).
  alloc = [l for l in lines if "ran out of memory trying to allocate" in l]
  exhausted = [l for l in lines if "RESOURCE_EXHAUSTED" in l or "out of memory" in l.lower()]
  return (alloc[-1:] or exhausted[-1:] or [""])[0][:300]


def _write(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _ok(r: dict) -> bool:
  return "error" not in r


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def _cell(text) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _ratio(a, b) -> str:
  return f"{a / b:.2f}x" if _finite(a) and _finite(b) and b > 0 else ""


def _fmt(x, spec: str) -> str:
  return format(x, spec) if _finite(x) else "n/a"


def _loss_text(meta) -> str:
  if meta.get("loss") != "lean":
    return "optax CE on float32 logits"
  if meta.get("loss_backward") == "over_logits":
    return "models.cross_entropy, its gradient written over the logits"
  return "models.cross_entropy, its gradient in one pass beside the logits"


def _settings(meta) -> list[str]:
  budget = meta.get("time_budget_s")
  lines = [
      f"Command: `{meta['command']}`  ",
      f"Date: {meta['date']}; device {meta['device']}; jax {meta['jax']}"
      + (f"; FORGE's `\"auto\"` read {meta['auto_table']}" if meta.get("auto_table") else "") + ".  ",
      f"Settings: dtype {meta['dtype']} (compute; "
      + (f"weights and optimizer states {meta['master_dtype']}" if meta.get("master_dtype") else
         "also weights and optimizer states")
      + f"; int8 states for forge_int8*), attention {meta['attention']}, remat {meta['remat']} "
      + ("(every block recomputed from its input in the backward pass)" if meta["remat"] == "full"
         else "") + " unless a row says otherwise (its `remat` and `weights` columns), "
      f"loss {meta.get('loss', 'optax')} "
      f"({_loss_text(meta)}), " +
      (f"step time: {meta['steps']} steps back to back, blocked once, median of 3 repeats, "
       f"after compiling and 3 warm-up steps; " if meta.get("timing") == TIMING else
       f"{meta['steps']} timed steps after compiling and one warm-up step (their mean); ") +
      "random weights and tokens; one process per row; the step compiled "
      + ("from the state's shapes before the state exists (--compile-first).  " if meta.get("compile_first")
         else "next to the initialised state (the compiler's autotuning buffers count on top of it).  "),
      (f"Steps compiled first, {meta['precompile']} processes at a time, into jax's persistent "
       "compilation cache (their autotuning ran concurrently on the device); the workers then load "
       "their step from it where they can (`step_from_cache` per row in the JSON).  " if meta.get("precompile") else ""),
      f"Time budget: {'none' if budget is None else f'{budget:g} s'}; elapsed "
      f"{meta.get('elapsed_s', 0):.0f} s; worker timeout {meta['timeout_s']} s.  ",
      "Allocator limit (what OOM means): "
      + (f"{meta['limit_gib']:.1f} GiB" if _finite(meta.get("limit_gib")) else "not reported")
      + (f" (XLA_PYTHON_CLIENT_MEM_FRACTION={meta['mem_fraction']:g})" if meta.get("mem_fraction")
         else " (jax's default fraction of the device's memory)")
      + ("; the whole limit preallocated (jax's default)." if meta.get("preallocate") else
         "; allocated on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false), so a large request can "
         "fail below the limit."),
  ]
  return [line for line in lines if line]


def markdown(rows, meta) -> str:
  lines = [f"# Whole-model training steps ({meta['device']})", "", *_settings(meta), "",
           "`vs optax_clip`: peak memory / the same model, batch and tokens' `optax_clip` "
           "peak; `vs optax`: step time / `optax`'s step time.", "",
           "`init peak`: the process peak right after `model.init` (if it equals `peak`, init set "
           "the peak); `XLA step`: the compiled step's arguments + outputs - donated + "
           "temporaries.", "",
           "`compile s`: tracing, lowering and compiling the step, in the process that compiled it "
           "(with --precompile, beside the other compiles).", "",
           "| model | tokens | impl | layers | remat | weights | peak GiB | vs optax_clip | init peak GiB "
           "| XLA step GiB | step ms | vs optax | tokens/s | loss | compile s | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  index = {(r["model"], r["batch"], r["tokens"], r["impl"]): r for r in rows if _ok(r)}
  for r in rows:
    layers = "scanned" if r.get("scan", True) else "unrolled"
    head = (f"| {r['model']} | {r['batch']}x{r['tokens']} | {r['impl']} | {layers} "
            f"| {r.get('remat', REMAT)} | {r.get('param_dtype', r.get('dtype', ''))} |")
    wall = f"{r['wall_s']:.0f}" if _finite(r.get("wall_s")) else ""
    comp = f"{r['compile_s']:.0f}" if _finite(r.get("compile_s")) else ""
    if not _ok(r):
      # A worker that compiled before it failed reported XLA's plan for the step.
      init = _fmt(r["init_peak_gib"], ".2f") if "init_peak_gib" in r else ""
      plan = _fmt(r["xla_step_gib"], ".2f") if "xla_step_gib" in r else ""
      lines.append(f"{head} {_cell(r['error'])} | | {init} | {plan} | | | | | {comp} | {wall} |")
      continue
    key = (r["model"], r["batch"], r["tokens"])
    clip = index.get((*key, "optax_clip"), {})
    opt = index.get((*key, "optax"), {})
    lines.append(
        f"{head} {_fmt(r['peak_gib'], '.2f')} | {_ratio(r['peak_gib'], clip.get('peak_gib'))} "
        f"| {_fmt(r.get('init_peak_gib'), '.2f')} | {_fmt(r.get('xla_step_gib'), '.2f')} "
        f"| {r['step_ms']:.1f} | {_ratio(r['step_ms'], opt.get('step_ms'))} "
        f"| {r['tokens_per_s']:.0f} | {_fmt(r['loss'], '.3f')} | {comp} | {wall} |")
  return "\n".join(lines) + "\n"


def profile_markdown(rows, meta, kinds: int = 14, ops: int = 25) -> str:
  """Each profiled row's device time per step: by HLO op kind, then its longest ops."""
  out = [f"# Where a step's device time goes\n\n`{meta['command']}`  \n{meta['date']}, "
         f"{meta['device']}, jax {meta['jax']}\n"]
  for r in rows:
    prof = r.get("profile")
    if not prof or "top" not in prof:
      if prof:
        out.append(f"## {r['model']} {r['impl']}: no profile ({prof.get('error')})\n")
      continue
    out.append(f"## {r['model']} {r['impl']} {r['batch']}x{r['tokens']}: step {_fmt(r.get('step_ms'), '.1f')} ms, "
               f"kernels {prof['device_ms']:.1f} ms/step\n")
    if "launches" in prof:
      gaps = ", ".join(f"{k}: {n:g} gaps, {ms:.2f} ms" for k, (n, ms) in prof.get("gaps", {}).items())
      out.append(f"{prof['launches']:g} kernel launches per step; the device busy {prof['busy_ms']:.1f} ms, "
                 f"idle {prof['idle_ms']:.2f} ms between its first and last kernel ({gaps}).\n")
    out.append("| op kind | ms/step |\n|---|---:|")
    out += [f"| {k} | {v:.2f} |" for k, v in list(prof["by_kind"].items())[:kinds]]
    out.append("\n| kernel | ms/step | calls/step | us per call (calls/step) | HLO ops |\n"
               "|---|---:|---:|---|---|")
    classes = lambda t: ", ".join(f"{us:g} ({n:g})" for us, n in t.get("durations", [])[:4]) or "-"
    out += [f"| {_cell(t['kernel'][:70])} | {t['ms']:.2f} | {t['count']:g} | {classes(t)} | "
            f"{_cell(', '.join(t['ops'])[:60])} |" for t in prof["top"][:ops]]
    out.append("")
  return "\n".join(out) + "\n"


def capacity_summary(model_name: str, impl: str, tokens: int, tried: list[dict]) -> dict:
  fits = [r for r in tried if _ok(r)]
  failed = [r for r in tried if not _ok(r) and r["error"] != SKIPPED]
  best = max(fits, key=lambda r: r["batch"]) if fits else None
  return {"model": model_name, "impl": impl, "tokens": tokens,
          "largest_batch": best["batch"] if best else 0,
          "peak_gib": best["peak_gib"] if best else None,
          "tokens_per_s": best["tokens_per_s"] if best else None,
          "first_fail_batch": failed[0]["batch"] if failed else None,
          "first_fail_error": failed[0]["error"] if failed else None,
          "skipped": any(r.get("error") == SKIPPED for r in tried),
          "tried": tried}


def capacity_markdown(results, meta) -> str:
  lines = [f"# Largest batch per implementation ({meta['device']})", "", *_settings(meta), "",
           f"Batches tried: 1, 2, 4, ... up to {meta['max_batch']}, until the first failure.", "",
           "| model | impl | layers | tokens | largest batch | peak GiB | tokens/s "
           "| first failing batch | its error | tried |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for s in results:
    layers = "scanned" if parse_impl(s["impl"])[1] else "unrolled"
    tried = ", ".join(f"{r['batch']}" + ("" if _ok(r) else f" ({_cell(r['error'])[:40]})")
                      for r in s["tried"])
    if s["first_fail_batch"] is not None:
      fail, err = str(s["first_fail_batch"]), _cell(s["first_fail_error"])
    elif s["skipped"]:
      fail, err = "", SKIPPED
    else:
      fail, err = f"none up to {meta['max_batch']}", ""
    lines.append(
        f"| {s['model']} | {s['impl']} | {layers} | {s['tokens']} | {s['largest_batch']} "
        f"| {_fmt(s['peak_gib'], '.2f')} | {_fmt(s['tokens_per_s'], '.0f')} | {fail} "
        f"| {err} | {tried} |")
  return "\n".join(lines) + "\n"


def _pyplot():
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt


def _label(r: dict | None) -> str:
  if r is None:
    return ""
  err = r.get("error", "")
  if err == "OOM":
    return "OOM"
  if err == SKIPPED:
    return "skipped"
  if err.startswith("timeout"):
    return "timeout"
  return "error" if err else "n/a"


def _grouped_bars(ax, groups, impls, value, title, annotate=False):
  """Bars of ``value(group, impl) -> (height or None, row)``; a missing height: an empty bar."""
  import matplotlib.patches
  width = 0.8 / max(1, len(impls))
  heights = [value(g, i)[0] for g in groups for i in impls]
  top = max([h for h in heights if _finite(h)], default=1.0) or 1.0
  for k, impl in enumerate(impls):
    for x, g in enumerate(groups):
      h, row = value(g, impl)
      pos = x - 0.4 + width * (k + 0.5)
      if _finite(h):
        ax.bar(pos, h, width, color=f"C{k}")
        if annotate:
          ax.text(pos, h, f"{h:g}", ha="center", va="bottom", fontsize=7)
      else:
        ax.bar(pos, top, width, fill=False, edgecolor=f"C{k}", linestyle="--")
        ax.text(pos, top / 2, _label(row), rotation=90, ha="center", va="center", fontsize=7)
  ax.set_xticks(range(len(groups)))
  ax.set_title(title)
  ax.grid(axis="y", alpha=0.3)
  handles = [matplotlib.patches.Patch(color=f"C{k}", label=impl) for k, impl in enumerate(impls)]
  ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_table(rows, path: str) -> str | None:
  """Peak GiB and step ms per impl, grouped by model/batch/tokens (None without matplotlib)."""
  plt = _pyplot()
  if plt is None or not rows:
    return None
  groups = list(dict.fromkeys((r["model"], r["batch"], r["tokens"]) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  index = {(r["model"], r["batch"], r["tokens"], r["impl"]): r for r in rows}

  def value(key):
    def get(g, impl):
      r = index.get((*g, impl))
      return (r.get(key) if r is not None and _ok(r) else None), r
    return get

  fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 0.25 * len(groups) * len(impls) + 3), 7))
  _grouped_bars(axes[0], groups, impls, value("peak_gib"), "peak GiB")
  _grouped_bars(axes[1], groups, impls, value("step_ms"), "step ms")
  for ax in axes:
    ax.set_xticklabels([f"{m}\n{b}x{t}" for m, b, t in groups], fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_capacity(results, path: str) -> str | None:
  """The largest batch per impl, grouped by model (None without matplotlib)."""
  plt = _pyplot()
  if plt is None or not results:
    return None
  models_ = list(dict.fromkeys(s["model"] for s in results))
  impls = list(dict.fromkeys(s["impl"] for s in results))
  index = {(s["model"], s["impl"]): s for s in results}

  def value(model_name, impl):
    s = index.get((model_name, impl))
    if s is None:
      return None, None
    fail = next((r for r in s["tried"] if not _ok(r)), None)
    return (s["largest_batch"] or None), fail

  fig, ax = plt.subplots(figsize=(max(7.0, 0.4 * len(models_) * len(impls) + 3), 4))
  _grouped_bars(ax, models_, impls, value, "largest batch that fits", annotate=True)
  ax.set_xticklabels(models_, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _meta(args, argv) -> dict:
  return {"command": "python -m experiments.bench_models " + " ".join(argv),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": "unknown", "jax": importlib.metadata.version("jax"), "dtype": args.dtype,
          "attention": args.attention, "remat": args.remat, "master_dtype": args.master_dtype,
          "loss": args.loss,
          # models.cross_entropy's backward writes its gradient over the logits since 2026-11-30
          # (results_tables marks these rows; earlier "lean" runs held both at once).
          **({"loss_backward": "over_logits"} if args.loss == "lean" else {}), "steps": args.steps,
          "timing": TIMING,
          "timeout_s": args.timeout, "time_budget_s": args.time_budget,
          "max_batch": args.max_batch, "mem_fraction": args.mem_fraction,
          "preallocate": args.preallocate, "compile_first": args.compile_first,
          "compile_cache": args.compile_cache is not None, "precompile": args.precompile,
          "profile": args.profile}


def _table(args, impls, meta, runner):
  tag = os.environ.get("BENCH_TAG", "bench_models")
  paths = {ext: os.path.join(args.out, f"{tag}.{ext}") for ext in ("json", "md", "png")}
  rows = []
  cells = [(model_name, impl, batch, tokens) for model_name in args.models.split(",")
           for batch in map(int, args.batch.split(",")) for tokens in map(int, args.tokens.split(","))
           for impl in impls]
  if args.precompile:
    meta["precompiled"] = runner.precompile(cells)
    print(json.dumps(meta["precompiled"]), flush=True)
  for model_name, impl, batch, tokens in cells:
    rows.append(runner.run(model_name, impl, batch, tokens))
    print(json.dumps(rows[-1]), flush=True)
    meta.update(device=runner.device_name(), elapsed_s=runner.elapsed(), limit_gib=runner.limit)
    meta["auto_table"] = meta.get("auto_table") or rows[-1].get("auto_table")
    _write(paths["json"], json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(rows, meta)
    _write(paths["md"], md)
    plot_table(rows, paths["png"])
    if args.profile:
      _write(os.path.join(args.out, f"{tag}.profile.md"), profile_markdown(rows, meta))
  print(md)
  return rows


def _capacity(args, impls, meta, runner):
  if "," in args.tokens:
    raise SystemExit("--capacity takes a single --tokens value.")
  tokens = int(args.tokens)
  paths = {ext: os.path.join(args.out, f"capacity.{ext}") for ext in ("json", "md", "png")}
  results = []
  for model_name in args.models.split(","):
    for impl in impls:
      tried = []
      batch = 1
      while batch <= args.max_batch:
        tried.append(runner.run(model_name, impl, batch, tokens))
        print(json.dumps(tried[-1]), flush=True)
        summary = capacity_summary(model_name, impl, tokens, tried)
        if len(tried) == 1:
          results.append(summary)
        else:
          results[-1] = summary
        meta.update(device=runner.device_name(), elapsed_s=runner.elapsed(), limit_gib=runner.limit)
        _write(paths["json"], json.dumps({"meta": meta, "results": results}, indent=1))
        md = capacity_markdown(results, meta)
        _write(paths["md"], md)
        plot_capacity(results, paths["png"])
        if not _ok(tried[-1]):
          break
        batch *= 2
  print(md)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  parser.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
  parser.add_argument("--impls", default="optax,optax_clip,forge",
                      help=f"comma list of {', '.join(IMPLS)}, each optionally + {UNROLLED}, then "
                           "optionally the row's own :remat=X, :master=DTYPE, :mem=FRACTION, :mesh=P")
  parser.add_argument("--tokens", default="1024", help="comma list (one value with --capacity)")
  parser.add_argument("--batch", default="1", help="comma list")
  parser.add_argument("--dtype", default="bfloat16",
                      help="compute dtype; also the weights' and optimizer states' unless --master-dtype")
  parser.add_argument("--master-dtype", default=None,
                      help="weights and optimizer states in this dtype (e.g. float32 master weights "
                           "with --dtype bfloat16 compute); a row's :master= overrides it")
  parser.add_argument("--remat", default=REMAT,
                      help="activation checkpointing of each block: none, full, a "
                           "jax.checkpoint_policies name or save_all_but_elementwise (passed to "
                           "the model config, which validates it); a row's :remat= overrides it")
  parser.add_argument("--attention", default="auto")
  parser.add_argument("--unrolled", action="store_true",
                      help=f"append {UNROLLED} to every implementation")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--loss", default="lean", choices=LOSSES,
                      help="lean: models.cross_entropy; optax: optax's CE on float32 logits (earlier runs)")
  parser.add_argument("--timeout", type=int, default=300, help="seconds per worker")
  parser.add_argument("--time-budget", type=float, default=None,
                      help="seconds for the whole run; rows that would not fit are skipped")
  parser.add_argument("--capacity", action="store_true",
                      help="the largest batch per model and impl instead of the table")
  parser.add_argument("--max-batch", type=int, default=64)
  parser.add_argument("--mem-fraction", type=float, default=None,
                      help="XLA_PYTHON_CLIENT_MEM_FRACTION for the workers: the allocator's limit "
                           "as a fraction of the device's memory (default: jax's); each row "
                           "records the limit it ran under (limit_gib)")
  parser.add_argument("--preallocate", action="store_true",
                      help="preallocate the allocator's whole limit in the workers, as jax does by "
                           "default (XLA_PYTHON_CLIENT_PREALLOCATE=true); without it they allocate "
                           "on demand, where a large request can fail below the limit")
  parser.add_argument("--compile-first", action="store_true",
                      help="compile each step from the state's shapes before the state exists (as "
                           "experiments.train does), so the compiler's autotuning buffers are not "
                           "counted on top of the state")
  parser.add_argument("--compile-cache", default=None,
                      help="a folder for jax's persistent compilation cache, shared by the workers")
  parser.add_argument("--precompile", type=int, default=0,
                      help="compile every row's step first, this many processes at a time, into "
                           "--compile-cache (implies --compile-first); then time the rows one by one")
  parser.add_argument("--profile", action="store_true",
                      help="after timing, trace --steps more steps with jax.profiler and record "
                           "where the device time goes (row['profile']: ms per step by HLO op kind "
                           "and the longest ops; <tag>.profile.md)")
  parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--worker")
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.mem_fraction is not None and not 0 < args.mem_fraction <= 1:
    parser.error(f"--mem-fraction must be in (0, 1] (got {args.mem_fraction})")
  if args.precompile < 0:
    parser.error(f"--precompile must be >= 0 (got {args.precompile})")
  if args.precompile and args.compile_cache is None:
    parser.error("--precompile needs --compile-cache DIR (where the compiled steps are kept)")
  if args.precompile and args.capacity:
    parser.error("--precompile works on the table, not --capacity (its batches depend on results)")
  if args.precompile:
    args.compile_first = True  # the timed workers must lower the step exactly as the compiles did
  if args.worker and args.compile_only:
    row, _, _ = build_step(args.models, args.worker, int(args.batch), int(args.tokens), args.dtype,
                           args.attention, args.loss, compile_only=True, remat=args.remat,
                           master_dtype=args.master_dtype)
    print("ROW " + json.dumps(row), flush=True)
    return
  if args.worker:
    row = worker(args.models, args.worker, int(args.batch), int(args.tokens), args.dtype,
                 args.attention, args.steps, args.loss, args.compile_first, args.remat,
                 args.master_dtype, args.profile)
    print("ROW " + json.dumps(row), flush=True)
    return
  try:
    impls = [(i if not args.unrolled or not parse_impl(i)[1]
              else i.replace(":", UNROLLED + ":", 1) if ":" in i else i + UNROLLED)
             for i in args.impls.split(",")]
    for impl in impls:
      parse_spec(impl)
  except ValueError as e:
    parser.error(str(e))
  os.makedirs(args.out, exist_ok=True)
  runner = Runner(args)
  meta = _meta(args, argv)
  if args.capacity:
    return _capacity(args, impls, meta, runner)
  return _table(args, impls, meta, runner)


if __name__ == "__main__":
  main()
