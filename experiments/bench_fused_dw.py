"""Fused dW + optimizer update against XLA: the harness every fused kernel is measured with.

On the GPU, from the repository root:

    PYTHONPATH=$PWD python -m experiments.bench_fused_dw --out $OUT

On a CPU (seconds, Pallas interpret mode, tiny shapes):

    PYTHONPATH=$PWD python -m experiments.bench_fused_dw --smoke --out /tmp/bench

For T in {1024, 4096, 16384}, (K, N) in {(4096, 4096), (4096, 14336),
(14336, 4096), (5120, 17408)} and the optimizers AdamW, Lion and SGD with
momentum (bf16 x/dy, fp32 w and slots), on the same inputs, it times:

* ``xla_gemm``: the weight gradient alone, ``jnp.dot(x.T, dy)`` with float32
  output, in a jit (the GEMM ceiling; no update);
* ``xla_gemm_optax``: that GEMM plus ``optax``'s own update and
  ``apply_updates`` in one jit with params and optimizer state donated (the
  unfused baseline: the gradient is written and read back);
* ``pallas``: the fused Triton-lowered kernel, w and slots donated;
* ``mosaic``: the fused Mosaic GPU kernel (Hopper) at its default tiling, w and
  slots donated (left out of the default list off GPUs: the interpreter is slow).

Implementations are a dict of name -> builder (:data:`IMPLEMENTATIONS`); a new
fused kernel with :func:`pallas_kernels.fused_dw_update`'s signature is added
with one line (``fused_builder``).

``--baseline-tree DIR`` times another checkout of this repository (e.g. an older
commit) side by side: this script runs first in a subprocess with ``DIR`` on
``PYTHONPATH`` (its kernels, this harness), then on this tree, and writes
``bench_fused_dw_compare.md`` with both times per row. For the Llama-3.1-8B
projections on the H200::

    PYTHONPATH=$PWD python -m experiments.bench_fused_dw --out $OUT --tokens 1024 4096 \
      --shapes 4096x4096 4096x1024 4096x14336 14336x4096 --optimizers adamw \
      --impls xla_gemm xla_gemm_optax mosaic --state-dtype bfloat16 --baseline-tree /tmp/old

``--auto-table`` measures the table ``backend="auto"`` reads (one per GPU in ``forge_jax/``,
:mod:`forge_jax._auto`): for each shape class of the presets' block projections (Qwen3
0.6B-32B, Llama-3.1-8B: 27 distinct (K, N), grouped by the nearest whole octave of K*N and of
N/K into 20 classes, one representative each), T in {512, 1024, 4096, 16384} and the storage
configurations of :data:`AUTO_CONFIGS` (float32 / bfloat16 weights, their float states or int8
states, bfloat16 weights stochastically rounded), AdamW, it times one layer's update as a model
step runs it, with ``backend="mosaic"`` and ``backend="xla"``, and records the faster: the
program of :func:`experiments._timing.layer_update` (``bench_lowp`` times the same one):
``fused_linear_update`` as ``forge_jax.Dense``'s backward calls it (grad norm out, a barrier
after it), weight and state donated and updated in place, ``_timing.LAYER_CALLS`` calls per
dispatch at every size, each consuming the previous one's outputs. 480 cases in one GPU call:
``--workers`` processes compile the Mosaic kernels side by side and take turns on the GPU (one
at a time holds it for its first launches and timing); ``--estimate-only`` prints the plan and
its estimate; ``--time-limit`` starts no case that would end past it (the Llama-3.1-8B classes
come first, then the class farthest from those measured); ``--merge ROWS.json`` keeps the cases an
earlier run on the same device and jax measured and measures the rest, so a plan longer than one
call is split over several (e.g. ``--tokens 512 1024`` first, then the whole plan with ``--merge``),
and ``--remeasure CONFIG...`` drops the named configurations' earlier rows, so that a kernel
change to one storage (e.g. int8) is measured again while the other rows are kept;
``--dry-run`` runs it on CPU with the interpreted Triton kernel in seconds. The table measures
one representative per class; ``--auto-table --members`` checks it on the others: it measures
the classes' other members (7 of the presets' 27 projections) and writes ``auto_regret.md``,
each case's time under the pick of the table ``"auto"`` reads on this device over the faster
backend's (``--regret TABLE ROWS...`` does the same for any table and measured rows), and on a
GPU ``auto_table_with_members.json``, that table with the measured cases joined (``--union TABLE
MEMBERS_TABLE --out DIR`` does the same for any tables of one device). On the H200::

    PYTHONPATH=$PWD python -m experiments.bench_fused_dw --auto-table --time-limit 500 --out $OUT

writes ``auto_table.json`` (for ``"auto"`` to read it, set ``FORGE_JAX_AUTO_TABLE`` to its path,
or ship it in ``forge_jax/`` as :data:`forge_jax._auto.DEVICE_TABLES` says), ``auto_table.md`` and
every row with its errors in ``auto_table_rows.json``. ``--compare-lowp LOWP.json ... --out DIR`` then writes
``DIR/auto_vs_lowp.md``: each case both measured, the table's ms beside ``bench_lowp``'s (the same
program, so the ratios should be run-to-run noise; ``--before ROWS LOWP`` adds an earlier pair).

Every implementation that updates weights is checked against
``fused_dw_update_reference`` after one step from the common initial state,
before it is timed. Timing: warm-up, 30 back-to-back calls blocked once,
median of 3 repeats (experiments/_timing.py). Reported per row: ms, TFLOP/s
(2 T K N flops), and the fraction of the roofline floor
``max(flops / 790e12, bytes / 4.3e12)`` reached, where ``bytes`` is the least
traffic any implementation needs: x and dy read once, w and the slots read
and written once (the unfused baseline moves the gradient too, but the floor
is the same). Writes ``bench_fused_dw.json`` and ``bench_fused_dw.md`` to
``--out`` (default ``$OUT`` or ``./runs``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import forge_jax
from experiments import _timing
import pallas_kernels
from pallas_kernels import TileConfig

TOKENS = (1024, 4096, 16384)
SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (5120, 17408))
PEAK_FLOPS = 790e12  # H200 bf16 dense matmul (device notes, FINDINGS.md)
PEAK_BYTES = 4.3e12  # H200 device-memory copy bandwidth, bytes/s
# name -> (forge_jax constructor, optax constructor, shared hyperparameters).
OPTIMIZERS: dict[str, tuple[Callable, Callable, dict]] = {
    "adamw": (forge_jax.adamw, optax.adamw, dict(learning_rate=1e-3, weight_decay=0.1)),
    "lion": (forge_jax.lion, optax.lion, dict(learning_rate=1e-4, weight_decay=0.1)),
    "sgd_momentum": (forge_jax.sgd, optax.sgd, dict(learning_rate=1e-2, momentum=0.9)),
}
# Relative Frobenius errors accepted by the check (see tune_fused_dw.py: the
# first AdamW / Lion step is nearly sign(g), which may flip where |g| is
# within float32 rounding of 0; the moments are continuous in g).
UPDATE_TOL = 1e-2
SLOT_TOL = 1e-4
# 16-bit weight and states (--state-dtype bfloat16): the optax baseline gets
# the gradient in bf16, as from a bf16 model, so it differs from the float32-
# gradient reference by that rounding (CPU smoke, AdamW: 8.2e-3 update,
# 4.4e-3 slots); the fused kernels keep the float32 tile and match it to the
# last-bit flips of their own rounding. Loose on purpose: the elementwise check
# of the kernels' 16-bit results is check_mosaic_gpu's correctness section.
UPDATE_TOL_16 = 2.0**-5
SLOT_TOL_16 = 2.0**-6
F32, BF16 = jnp.float32, jnp.bfloat16


# ----------------------------------------------------------------------------
# Problems.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
  """One T x K x N with one optimizer: the inputs every implementation gets."""

  t: int
  k: int
  n: int
  optimizer: str
  x: jax.Array
  dy: jax.Array
  w0: jax.Array
  forge: Any  # forge_jax.ForgeOptimizer (its .rule drives the fused kernels)
  optax_opt: optax.GradientTransformation
  interpret: bool
  # n -> n distinct copies of (x, dy), for timing n calls per dispatch (_input_copies).
  input_copies: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def name(self) -> str:
    return f"{self.t}x{self.k}x{self.n}"

  @property
  def rule(self):
    return self.forge.rule

  @property
  def flops(self) -> float:
    return 2.0 * self.t * self.k * self.n

  @property
  def floor_bytes(self) -> int:
    """x and dy read once; w and every slot read and written once."""
    state = self.w0.nbytes + sum(s.nbytes for s in self.rule.init_slots(self.w0))
    return self.x.nbytes + self.dy.nbytes + 2 * state

  @property
  def floor_ms(self) -> float:
    return max(self.flops / PEAK_FLOPS, self.floor_bytes / PEAK_BYTES) * 1e3


def make_inputs(t: int, k: int, n: int, seed: int = 0,
                state_dtype=F32) -> tuple[jax.Array, jax.Array, jax.Array]:
  """bf16 ``x``/``dy`` and a ``w0`` of ``state_dtype`` (the slots follow the weight's dtype)."""
  kx, kd, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (t, k), F32).astype(BF16)
  dy = jax.random.normal(kd, (t, n), F32).astype(BF16)
  w0 = (0.02 * jax.random.normal(kw, (k, n), F32)).astype(state_dtype)
  return x, dy, w0


def tolerances(state_dtype) -> tuple[float, float]:
  """(update, slots) tolerances of the check for a weight and states of ``state_dtype``."""
  return (UPDATE_TOL, SLOT_TOL) if jnp.dtype(state_dtype).itemsize >= 4 else (UPDATE_TOL_16, SLOT_TOL_16)


def make_problem(x, dy, w0, optimizer: str, interpret: bool,
                 optimizers: Optional[dict] = None) -> Problem:
  """``optimizer`` names an entry of ``optimizers`` (default :data:`OPTIMIZERS`)."""
  forge_ctor, optax_ctor, kwargs = (OPTIMIZERS if optimizers is None else optimizers)[optimizer]
  t, k = x.shape
  return Problem(t, k, dy.shape[1], optimizer, x, dy, w0, forge_ctor(**kwargs), optax_ctor(**kwargs), interpret)


# ----------------------------------------------------------------------------
# Implementations: builder(problem) -> Runner.
# ----------------------------------------------------------------------------


class Runner(NamedTuple):
  """How to run one implementation on one problem.

  ``init()`` makes a fresh carry (copies: ``step`` may donate it);
  ``step(carry) -> carry`` is the timed call; ``result(carry)`` gives
  ``(w, slots)`` in the rule's slot order for the check, or is None for
  implementations that do not update weights.
  """

  init: Callable[[], Any]
  step: Callable[[Any], Any]
  result: Optional[Callable[[Any], tuple[jax.Array, tuple[jax.Array, ...]]]]
  # ``calls(carry, n) -> carry``: ``n`` steps in one dispatch (see _dispatched).
  calls: Optional[Callable[[Any, int], Any]] = None


def _dispatched(f: Callable[[Any, jax.Array, jax.Array], Any]):
  """``run(carry, xs, dys)``: ``carry = f(carry, xs[i], dys[i])`` for each i, in one donated jit.

  Timing one jit call per step measures the host's dispatch wherever the device
  work is shorter (small shapes: a 1024^3 GEMM reads 36 us that way on the H200).
  ``len(xs)`` calls in one executable take one dispatch. The calls are unrolled
  (no while loop and its per-iteration predicate) and each gets its own copy of
  the inputs: with one ``x`` and ``dy`` XLA merges the calls' identical GEMMs
  into one (common-subexpression elimination; tests/test_experiments_smoke.py).
  For the GEMM alone, the carry collects every call's output, so that none is
  dead code. Use it for small shapes: the copies take ``n`` times the inputs'
  memory.
  """

  @functools.partial(jax.jit, donate_argnums=(0,))
  def run(carry, xs, dys):
    for x, dy in zip(xs, dys, strict=True):
      # The barrier keeps XLA from fusing one call's update into the next (it would then never
      # write the intermediate weight and state): each call's work, as one call alone does it.
      carry = jax.lax.optimization_barrier(f(carry, x, dy))
    return carry

  return run


def _input_copies(p: "Problem", n: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """``n`` distinct buffers of ``p.x`` and of ``p.dy`` (see :func:`_dispatched`), made once per ``n``."""
  if n not in p.input_copies:
    p.input_copies[n] = (tuple(jnp.copy(p.x) for _ in range(n)), tuple(jnp.copy(p.dy) for _ in range(n)))
  return p.input_copies[n]


Builder = Callable[[Problem], Runner]


def _gemm(x, dy):
  return jnp.dot(x.T, dy, preferred_element_type=F32)


def build_xla_gemm(p: Problem) -> Runner:
  """The weight gradient alone; the carry is the last gradient (dropped)."""
  gemm = jax.jit(_gemm)
  # n calls: the carry collects every call's gradient, so none is dead code.
  many = _dispatched(lambda grads, x, dy: (*grads, _gemm(x, dy)))
  return Runner(init=lambda: jnp.zeros((), F32), step=lambda _: gemm(p.x, p.dy), result=None,
                calls=lambda _, n: many((), *_input_copies(p, n)))


def build_xla_optax(p: Problem) -> Runner:
  """GEMM + optax update + apply_updates in one jit; params and state donated."""
  opt = p.optax_opt

  def update(carry, x, dy):
    params, state = carry
    # The gradient in the parameter's dtype, as autodiff of a model gives it
    # (the optax states then keep that dtype too).
    updates, state = opt.update(_gemm(x, dy).astype(params.dtype), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(update, donate_argnums=(0,))
  many = _dispatched(update)

  def init():
    params = jnp.copy(p.w0)
    return params, opt.init(params)

  def result(carry):
    params, state = carry
    return params, tuple(optax.tree_utils.tree_get(state, name) for name in p.rule.slot_names)

  return Runner(init=init, step=lambda c: step(c, p.x, p.dy), result=result,
                calls=lambda c, n: many(c, *_input_copies(p, n)))


def fused_builder(fused_fn: Callable) -> Builder:
  """A builder for any kernel with ``fused_dw_update``'s signature.

  ``fused_fn(x, dy, w, slots, scalars, update_fn, interpret=...)`` must return
  ``(new_w, new_slots, _)``; w and slots are donated.
  """

  def build(p: Problem) -> Runner:
    rule = p.rule

    def update(carry, x, dy):
      w, slots, count = carry
      new_w, new_slots, _ = fused_fn(x, dy, w, slots, rule.scalars(count), rule.update, interpret=p.interpret)
      return new_w, tuple(new_slots), count + 1

    step = jax.jit(update, donate_argnums=(0,))
    many = _dispatched(update)

    def init():
      w = jnp.copy(p.w0)
      return w, rule.init_slots(w), jnp.int32(0)

    return Runner(init=init, step=lambda c: step(c, p.x, p.dy), result=lambda c: (c[0], c[1]),
                  calls=lambda c, n: many(c, *_input_copies(p, n)))

  return build


def mosaic_update(x, dy, w, slots, scalars, update_fn, *, interpret: bool):
  """The Mosaic GPU kernel at its default tiling (one block of small tiles when interpreted).

  Also runs against an older tree whose kernel lives in ``pallas_kernels.fused_dw_mosaic``
  (``--baseline-tree``): same entry point, same default tiling.
  """
  try:
    from pallas_kernels.mosaic import MosaicTileConfig, fused_dw_update_mosaic  # pylint: disable=g-import-not-at-top
  except ImportError:
    from pallas_kernels.fused_dw_mosaic import MosaicTileConfig, fused_dw_update_mosaic  # pylint: disable=g-import-not-at-top
  config = None
  if interpret:
    config = MosaicTileConfig(tile_m=64, tile_n=64, max_concurrent_steps=2, epi_n=16, num_sms=1)
  return fused_dw_update_mosaic(x, dy, w, slots, scalars, update_fn, config=config,
                                interpret=interpret)


IMPLEMENTATIONS: dict[str, Builder] = {
    "xla_gemm": build_xla_gemm,
    "xla_gemm_optax": build_xla_optax,
    "pallas": fused_builder(pallas_kernels.fused_dw_update),
    "mosaic": fused_builder(mosaic_update),
}
# Left out of the default list when interpreting (CPU): minutes per shape under the interpreter.
GPU_ONLY = {"mosaic"}
# Implementations whose work does not depend on the optimizer: timed once per shape.
OPTIMIZER_FREE = {"xla_gemm"}
BASELINE = "xla_gemm_optax"


# ----------------------------------------------------------------------------
# Check and measurement.
# ----------------------------------------------------------------------------


def _rel_err(a, b) -> jax.Array:
  a, b = a.astype(F32), b.astype(F32)
  return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


@jax.jit
def _errors(w, slots, w0, ref_w, ref_slots):
  errs = [_rel_err(s, r) for s, r in zip(slots, ref_slots)]
  return {
      "err_update": _rel_err(w - w0, ref_w - w0),
      "err_slots": jnp.max(jnp.stack(errs)) if errs else jnp.zeros((), F32),
  }


def reference_step(p: Problem):
  """The first step from the common initial state, by the jnp reference."""
  run = jax.jit(functools.partial(pallas_kernels.fused_dw_update_reference, update_fn=p.rule.update))
  slots = p.rule.init_slots(p.w0)
  w, new_slots, _ = run(p.x, p.dy, p.w0, slots, p.rule.scalars(jnp.int32(0)))
  return w, new_slots


def measure(impl: str, builder: Builder, p: Problem, reference, timing: dict) -> dict:
  """Check (one step from init) then time one implementation. Never raises."""
  row: dict[str, Any] = {
      "impl": impl, "optimizer": p.optimizer, "shape": p.name, "t": p.t, "k": p.k, "n": p.n,
      "flops": p.flops, "floor_bytes": p.floor_bytes, "floor_ms": p.floor_ms, "status": "ok",
  }
  carry = None
  try:
    runner = builder(p)
    carry = runner.init()
    start = time.perf_counter()
    carry = runner.step(carry)
    jax.block_until_ready(carry)
    row["first_call_s"] = round(time.perf_counter() - start, 3)  # compile + one step
    if runner.result is not None:
      w, slots = runner.result(carry)
      errs = _errors(w, tuple(slots), p.w0, reference[0], tuple(reference[1]))
      row.update({k: float(v) for k, v in errs.items()})
      update_tol, slot_tol = tolerances(p.w0.dtype)
      if not (row["err_update"] <= update_tol and row["err_slots"] <= slot_tol):
        # Still timed, but flagged everywhere it is reported.
        row["status"] = "check_failed"
    timing = dict(timing)
    calls = timing.pop("calls", 1)
    step = runner.step
    if calls > 1:
      if runner.calls is None:
        raise ValueError(f"{impl} cannot run {calls} calls per dispatch")
      step = lambda c: runner.calls(c, calls)
    result, carry = _timing.time_steps(step, carry, **timing)
    ms = result.median_ms / calls
    row.update(
        ms=ms, min_ms=result.min_ms / calls, repeats_ms=[r / calls for r in result.repeats_ms],
        iters=result.iters, calls_per_dispatch=calls,
        tflops=p.flops / (ms * 1e-3) / 1e12, frac_floor=p.floor_ms / ms,
    )
  except Exception as e:  # one failure must not end the run
    row.update(status="error", error=_timing.short_error(e))
  finally:
    del carry
  return row


def _for_optimizer(row: dict, p: Problem) -> dict:
  """A row of an optimizer-free implementation, restated against ``p``'s floor."""
  out = dict(row, optimizer=p.optimizer, floor_bytes=p.floor_bytes, floor_ms=p.floor_ms, shared_measurement=True)
  if "ms" in out:
    out["frac_floor"] = p.floor_ms / out["ms"]
  return out


def bench_shape(t: int, k: int, n: int, optimizers: Sequence[str], impls: Sequence[str], *,
                interpret: bool, timing: dict, state_dtype=F32) -> list[dict]:
  rows: list[dict] = []
  x, dy, w0 = make_inputs(t, k, n, state_dtype=state_dtype)
  shared: dict[str, dict] = {}
  for optimizer in optimizers:
    p = make_problem(x, dy, w0, optimizer, interpret)
    reference = reference_step(p)
    for impl in impls:
      if impl in OPTIMIZER_FREE:
        if impl not in shared:
          shared[impl] = measure(impl, IMPLEMENTATIONS[impl], p, reference, timing)
        row = _for_optimizer(shared[impl], p)
      else:
        row = measure(impl, IMPLEMENTATIONS[impl], p, reference, timing)
      rows.append(row)
      _timing.log(f"  {p.name:>18} {optimizer:<13} {impl:<15} {_cell(row)}")
      gc.collect()
    del reference, p
  return rows


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def _cell(row: Optional[dict]) -> str:
  if row is None:
    return "-"
  if "ms" not in row:
    return f"{row['status']}"
  flag = "" if row["status"] == "ok" else f" **{row['status']}**"
  return f"{row['ms']:.3f} ms ({row['tflops']:.0f} TF/s, {100 * row['frac_floor']:.0f}%){flag}"


def markdown(info: dict, rows: list[dict], impls: Sequence[str]) -> str:
  fused = [i for i in impls if i not in OPTIMIZER_FREE and i != BASELINE]
  out = [
      "# Fused dW + optimizer update vs XLA", "",
      f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}, jaxlib {info['jaxlib']}, "
      f"triton {info['triton']}. Weight and optimizer states: {info.get('state_dtype', 'float32')}.", "",
      f"Each cell: median ms per call (device time: {info['timing']['iters']} back-to-back "
      + (f"dispatches of {info['timing']['calls']} calls each (one jit)"
         if info['timing'].get('calls', 1) > 1 else "calls")
      + f", blocked once, median of {info['timing']['repeats']}), "
      "TFLOP/s at 2TKN flops, and % of the roofline floor max(flops / 790e12, bytes / 4.3e12) with bytes = "
      "x, dy read once + w, slots read and written once.", "",
      "| T x K x N | optimizer | floor ms | " + " | ".join(impls)
      + "".join(f" | {f} vs {BASELINE}" for f in fused) + " |",
      "|---|---|---|" + "---|" * (len(impls) + len(fused)),
  ]
  groups: dict[tuple, dict[str, dict]] = {}
  for row in rows:
    groups.setdefault((row["shape"], row["optimizer"]), {})[row["impl"]] = row
  for (shape, optimizer), by_impl in groups.items():
    floor = next(iter(by_impl.values()))["floor_ms"]
    cells = [_cell(by_impl.get(i)) for i in impls]
    base = by_impl.get(BASELINE, {})
    for f in fused:
      mine = by_impl.get(f, {})
      cells.append(f"{base['ms'] / mine['ms']:.2f}x" if "ms" in base and "ms" in mine else "-")
    out.append(f"| {shape} | {optimizer} | {floor:.3f} | " + " | ".join(cells) + " |")
  failed = [r for r in rows if r["status"] != "ok"]
  if failed:
    out += ["", "Not ok:", ""]
    out += [f"- {r['shape']} {r['optimizer']} {r['impl']}: {r['status']} {r.get('error', '')}"
            f"{' err_update=%.2e err_slots=%.2e' % (r['err_update'], r['err_slots']) if 'err_update' in r else ''}"
            for r in failed]
  return "\n".join(out) + "\n"


def _parse_kn(text: str) -> tuple[int, int]:
  k, n = text.lower().split("x")
  return int(k), int(n)


def _parse_tile(text: str) -> TileConfig:
  return TileConfig(*(int(v) for v in text.split(",")))


def run_plan(args, smoke_shape):
  """(interpret, tokens, shapes, timing) from a benchmark's common flags.

  ``--smoke`` is one tiny shape in interpret mode with a single timed call;
  otherwise the model shapes and ``--iters``/``--repeats``. ``--tokens`` and
  ``--shapes`` override either.
  """
  interpret = args.smoke or jax.default_backend() == "cpu"
  calls = getattr(args, "calls", 1)
  if calls < 1:
    raise ValueError(f"--calls must be >= 1; got {calls}")
  extra = {"calls": calls} if calls > 1 else {}
  if args.smoke:
    return (interpret, args.tokens or (48,), args.shapes or [smoke_shape],
            dict(warmup=0, iters=1, repeats=1, **extra))
  timing = dict(warmup=3, iters=args.iters, repeats=args.repeats, **extra)
  return interpret, args.tokens or TOKENS, args.shapes or list(SHAPES_KN), timing


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  parser.add_argument("--tokens", type=int, nargs="+", default=None, help=f"T values (default {TOKENS})")
  parser.add_argument("--shapes", type=_parse_kn, nargs="+", default=None,
                      help="KxN shapes (with --auto-table: each one measured, in place of the presets' classes)")
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
  parser.add_argument("--impls", nargs="+", default=None, choices=list(IMPLEMENTATIONS),
                      help="default: all (without the GPU-only ones when interpreting)")
  parser.add_argument("--tile", type=_parse_tile, default=None,
                      help="pallas tile 'block_k,block_n,block_t,num_warps,num_stages' (default: the tuned table)")
  parser.add_argument("--iters", type=int, default=30)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--calls", type=int, default=1,
                      help="calls per dispatch (one jit): device time for shapes shorter than a dispatch")
  parser.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="dtype of the weight and of every optimizer state (both sides)")
  parser.add_argument("--baseline-tree", default=None, type=pathlib.Path, metavar="DIR",
                      help="another checkout to time side by side (see the module docstring)")
  auto = parser.add_argument_group("the \"auto\" backend's table (see the module docstring)")
  auto.add_argument("--auto-table", action="store_true",
                    help="measure the Mosaic kernel against XLA per shape class; write auto_table.json")
  auto.add_argument("--dry-run", action="store_true",
                    help="--auto-table on tiny shapes with the interpreted kernel (CPU, seconds)")
  auto.add_argument("--configs", nargs="+", default=None, choices=list(AUTO_CONFIGS),
                    help="storage configurations (default: all)")
  auto.add_argument("--time-limit", type=float, default=None,
                    help="seconds: no case starts that would end past it; the table keeps what was measured")
  auto.add_argument("--estimate-only", action="store_true", help="print the plan and its estimate, measure nothing")
  auto.add_argument("--merge", type=pathlib.Path, nargs="+", default=None, metavar="ROWS",
                    help="auto_table_rows.json of earlier runs (same device and jax): their measured "
                    "cases are kept, not measured again; the table written holds both")
  auto.add_argument("--remeasure", nargs="+", default=(), choices=list(AUTO_CONFIGS), metavar="CONFIG",
                    help="with --merge: these configurations are measured again, their earlier "
                    "rows dropped (e.g. the int8 ones after an int8 kernel change)")
  auto.add_argument("--workers", type=int, default=None,
                    help="processes that compile side by side, taking turns on the device (default: 8 "
                    "on a GPU, 1 interpreted)")
  auto.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  auto.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
  auto.add_argument("--commit", default=None, help="the tree's commit for the provenance (default: git rev-parse HEAD)")
  auto.add_argument("--compare-lowp", type=pathlib.Path, nargs="+", default=None, metavar="JSON",
                    help="bench_lowp.json files: write auto_vs_lowp.md beside --out's auto_table_rows.json "
                    "(each measured case they share, both programs' ms) and exit")
  auto.add_argument("--before", type=pathlib.Path, nargs=2, default=None, metavar=("ROWS", "LOWP"),
                    help="with --compare-lowp: an earlier auto_table_rows.json and bench_lowp.json, as "
                    "two more columns each")
  auto.add_argument("--regret", type=pathlib.Path, nargs="+", default=None, metavar=("TABLE", "ROWS"),
                    help="TABLE (an auto_table.json) and auto_table_rows.json files measured on other "
                    "shapes (e.g. --auto-table --shapes with the classes' other members): write "
                    "auto_regret.md in --out, each case's time under TABLE's choice against the "
                    "faster backend's, and exit")
  auto.add_argument("--members", action="store_true",
                    help="measure the classes' other members (of the presets, or of --shapes) instead "
                    "of their representatives, then write auto_regret.md: each case's time under the "
                    "table \"auto\" reads on this device against the faster backend's")
  auto.add_argument("--union", type=pathlib.Path, nargs="+", default=None, metavar="TABLE",
                    help="auto_table.json files of one device and jax (a table, then e.g. a --members "
                    "run's): write their union to --out's auto_table.json (a later file's entry wins "
                    "on the same case) and exit")
  auto.add_argument("--rule-table", type=pathlib.Path, default=None, metavar="PATH",
                    help="write the unmeasured table of the rule without one to PATH and exit")
  args = parser.parse_args(argv)
  args.argv = argv
  if args.rule_table is not None:
    _write_text(args.rule_table, rule_table().dumps())
    return 0
  if args.regret:
    if len(args.regret) < 2:
      parser.error("--regret takes a table and at least one auto_table_rows.json")
    write_regret(_timing.out_dir(args.out), args.regret[0], args.regret[1:])
    return 0
  if args.union:
    try:
      joined = union_table(args.union)
    except ValueError as e:
      parser.error(f"--union: {e}")
    folder = _timing.out_dir(args.out)
    _write_text(folder / "auto_table.json", joined.dumps())
    _timing.log(f"wrote {folder / 'auto_table.json'}")
    return 0
  if args.compare_lowp:
    folder = _timing.out_dir(args.out)
    text = compare_lowp(folder / "auto_table_rows.json", args.compare_lowp, *(args.before or (None, None)))
    _timing.write_table(folder / "auto_vs_lowp.md", text, folder / "auto_table_rows.json")
    return 0
  if args.auto_table or args.dry_run:
    args.dry_run = args.dry_run or args.smoke
    return auto_table_run(args)

  interpret, tokens, shapes, timing = run_plan(args, smoke_shape=(40, 72))
  if args.impls is None:
    args.impls = [i for i in IMPLEMENTATIONS if not (interpret and i in GPU_ONLY)]
  if args.tile is not None:
    IMPLEMENTATIONS["pallas"] = fused_builder(functools.partial(pallas_kernels.fused_dw_update, config=args.tile))
  folder = _timing.out_dir(args.out)
  baseline = None
  if args.baseline_tree is not None:
    baseline = run_baseline(args.baseline_tree, argv, folder / "baseline")
  info = _timing.run_info("experiments.bench_fused_dw", argv)
  update_tol, slot_tol = tolerances(args.state_dtype)
  info.update(interpret=interpret, timing=timing, peak_flops=PEAK_FLOPS, peak_bytes=PEAK_BYTES,
              optimizers={k: v[2] for k, v in OPTIMIZERS.items()}, state_dtype=args.state_dtype,
              update_tol=update_tol, slot_tol=slot_tol,
              pallas_tile=dataclasses.asdict(args.tile) if args.tile else "default_tile_config")
  _timing.log(f"bench_fused_dw on {info['device']} (jax {info['jax']}), interpret={interpret}")

  rows = _timing.run_shapes(
      folder / "bench_fused_dw.json", info, tokens, shapes,
      lambda t, k, n: bench_shape(t, k, n, args.optimizers, args.impls, interpret=interpret,
                                  timing=timing, state_dtype=jnp.dtype(args.state_dtype)),
      {"impl": "-", "optimizer": "-", "floor_ms": float("nan")},
  )
  _timing.write_table(folder / "bench_fused_dw.md", markdown(info, rows, args.impls),
                      folder / "bench_fused_dw.json")
  if baseline is not None:
    _timing.write_table(folder / "bench_fused_dw_compare.md",
                        compare_markdown(info, baseline, rows, args.baseline_tree),
                        folder / "bench_fused_dw.json")
  return 0


def run_baseline(tree: pathlib.Path, argv: Sequence[str], out: pathlib.Path) -> dict:
  """This script's run on another checkout: a subprocess with ``tree`` first on PYTHONPATH, so
  ``pallas_kernels`` and ``forge_jax`` are the tree's (this file is the harness for both)."""
  tree, out = _timing.check_tree(tree), out.resolve()
  rest = _timing.drop_options(argv, {"--baseline-tree": 1, "--out": 1})  # the same run otherwise
  return _timing.run_on_tree(__file__, rest, out, tree, [tree], "bench_fused_dw.json")


def compare_markdown(info: dict, baseline: dict, rows: list[dict], tree: pathlib.Path) -> str:
  """Baseline vs this tree, per (shape, optimizer, implementation): ms and the ratio."""
  key = lambda r: (r["shape"], r["optimizer"], r["impl"])
  old = {key(r): r for r in baseline["rows"]}
  out = ["# Fused dW + update: baseline tree vs this tree", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}. Baseline: "
         f"`{tree}` (its kernels, this harness), run first. Weight and optimizer states: "
         f"{info.get('state_dtype', 'float32')}. Median ms per call (see bench_fused_dw.md).", "",
         "| T x K x N | optimizer | impl | baseline ms | this tree ms | this / baseline |",
         "|---|---|---|---|---|---|"]
  for r in rows:
    o = old.get(key(r), {})
    cell = lambda row: f"{row['ms']:.4f}" if "ms" in row else row.get("status", "-")
    ratio = f"{r['ms'] / o['ms']:.3f}" if "ms" in r and "ms" in o else "-"
    out.append(f"| {r['shape']} | {r['optimizer']} | {r['impl']} | {cell(o)} | {cell(r)} | {ratio} |")
  return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# The "auto" backend's table (--auto-table): the Mosaic kernel against XLA per shape class.
# ----------------------------------------------------------------------------

AUTO_TOKENS = (512, 1024, 4096, 16384)
# name -> (weight dtype, forge_jax.Precision fields): the storage configurations "auto" tells apart.
AUTO_CONFIGS: dict[str, tuple[Any, dict]] = {
    "fp32": (F32, {}),
    "fp32_int8": (F32, {"state_dtype": "int8"}),
    "bf16": (BF16, {}),
    "bf16_int8": (BF16, {"state_dtype": "int8"}),
    "bf16_sr": (BF16, {"weight_rounding": "stochastic"}),
    "bf16_sr_int8": (BF16, {"weight_rounding": "stochastic", "state_dtype": "int8"}),
}
# Seconds to trace, compile and run one step (the H200's first_call_s in
# results/h200/lowp_mosaic/bench_lowp.json, AdamW, 4096x4096 and 4096x14336, rounded up; bf16_int8,
# not measured there, as the other int8 rows; XLA: its bf16 and int8 rows, the dot's autotuning
# shared by a (shape, T) group): the plan's estimate, and what --time-limit keeps in hand.
FIRST_CALL_S = {"mosaic": {"fp32": 3.3, "bf16": 4.3, "bf16_sr": 5.9, "fp32_int8": 8.0,
                           "bf16_int8": 7.5, "bf16_sr_int8": 7.0},
                "xla": 0.4}
AUTO_SMOKE_SHAPES = ((64, 128), (128, 64))


def block_shapes(model: str) -> list[tuple[int, int]]:
  """Distinct (K, N) of a model preset's seven block projections: q, k/v, o, gate/up, down."""
  import models  # pylint: disable=g-import-not-at-top

  cfg = models.get_config(model)
  d, f = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return list(dict.fromkeys(((d, q), (d, kv), (q, d), (d, f), (f, d))))


def preset_shapes() -> list[tuple[int, int]]:
  """Distinct (K, N) of the seven block projections over the model presets (the tiny ones aside)."""
  import models  # pylint: disable=g-import-not-at-top

  names = [name for name in models.PRESETS if not name.startswith("tiny")]
  return list(dict.fromkeys(kn for name in names for kn in block_shapes(name)))


def _class_key(k: int, n: int) -> tuple[int, int]:
  """The nearest whole octave of size K*N (GEMM work per token, state stream) and of aspect N/K
  (the tiling): the presets' 27 projections fall into 20 classes, each member within 0.61
  octaves of its representative."""
  return round(math.log2(k * n)), round(math.log2(n / k))


def _distance(a: tuple[int, int], b: tuple[int, int]) -> float:
  return math.hypot(math.log2(a[0] * a[1] / (b[0] * b[1])), math.log2(a[1] / a[0] * b[0] / b[1]))


def shape_classes(shapes: Sequence[tuple[int, int]], first: Sequence[tuple[int, int]] = ()
                  ) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
  """``[(representative, members)]`` in measuring order.

  The representative is the member closest to the others (a medoid). The classes of
  ``first`` come first; then, greedily, the class farthest from every representative so far,
  so that a run cut short by its time limit has spread its measurements over the shapes.
  """
  groups: dict[tuple, list] = {}
  for kn in shapes:
    groups.setdefault(_class_key(*kn), []).append(tuple(kn))
  classes = [(min(m, key=lambda a: (sum(_distance(a, b) for b in m), a)), sorted(m))
             for m in groups.values()]
  order = [c for c in classes if any(kn in c[1] for kn in first)]
  rest = [c for c in classes if c not in order]
  while rest:
    far = max(rest, key=lambda c: (min((_distance(c[0], o[0]) for o in order), default=0.0), c[0]))
    order.append(far)
    rest.remove(far)
  return order


def _auto_optimizer(config: str):
  return forge_jax.adamw(1e-3, weight_decay=0.1, precision=forge_jax.Precision(**AUTO_CONFIGS[config][1]))


def auto_case_key(config: str, w_dtype, t: int, k: int, n: int) -> dict:
  """The table entry's lookup fields for one measured case (as fused_linear_update forms them)."""
  from forge_jax import _auto  # pylint: disable=g-import-not-at-top

  opt = _auto_optimizer(config)
  state = jax.eval_shape(opt.init, jax.ShapeDtypeStruct((k, n), w_dtype))
  slots = opt.rule.slots_of(state)
  from forge_jax import _lowp  # pylint: disable=g-import-not-at-top

  sr = _lowp.weight_codec(opt.precision, w_dtype).needs_bits  # as fused_linear_update decides it
  return {"t": t, "k": k, "n": n, "weight": jnp.dtype(w_dtype).name,
          "states": _auto.state_format(slots), "sr": bool(sr)}


def auto_runner(t: int, k: int, n: int, config: str, backend: str, calls: int):
  """``(compile, warm, init, update, result)``: the shared per-layer program
  (:func:`experiments._timing.layer_update`, the one ``bench_lowp`` times), ``calls`` per dispatch.

  ``compile()`` lowers and compiles from shapes alone (no device work: workers compile side by
  side, see :func:`auto_table_run`); ``init(x, dy, w0)`` makes a fresh carry (copies of the
  inputs, weight and state), which every dispatch donates.
  """
  update = _timing.layer_update(_auto_optimizer(config), backend, AUTO_CONFIGS[config][0], calls=calls)
  shapes = update.carry_shapes(t, k, n)
  compiled = []

  def compile_():
    compiled.append(update.run.lower(shapes).compile())
    return compiled[0]

  def warm():
    """One dispatch on zeros: whatever the runtime compiles at a first launch (a Mosaic GPU
    kernel's module) is compiled here, not in the timed loop."""
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    jax.block_until_ready(compiled[0](zeros))

  timed = dataclasses.replace(update, run=lambda c: compiled[0](c))
  return compile_, warm, lambda x, dy, w0: update.init(x, dy, w0), timed, update.result


def _auto_measure(runner, inputs, timing: dict, gpu_lock, reference=None,
                  compile_on_gpu: bool = False) -> dict:
  """Compile (timed) outside ``gpu_lock`` unless ``compile_on_gpu`` (XLA's GEMM autotuner runs
  candidate kernels on the device); then, holding it, a first dispatch on zeros (the Mosaic
  runtime's module compile, a few ms) unless compiled there, one checked dispatch and the device
  time per layer update. No other worker's work reaches the device meanwhile. Never raises."""
  compile_, warm, init, update, result = runner
  row: dict[str, Any] = {"status": "ok", "calls_per_dispatch": update.calls}
  carry = None
  try:
    with gpu_lock() if compile_on_gpu else contextlib.nullcontext():
      start = time.perf_counter()
      compile_()
      row["compile_s"] = round(time.perf_counter() - start, 3)
    with gpu_lock():
      if not compile_on_gpu:
        start = time.perf_counter()
        warm()
        row["warm_s"] = round(time.perf_counter() - start, 3)
      x, dy, w0 = inputs()
      carry = init(x, dy, w0)
      start = time.perf_counter()
      carry = update.run(carry)
      jax.block_until_ready(carry)
      row["first_call_s"] = round(time.perf_counter() - start, 3)
      first = jax.tree.map(jnp.copy, result(carry))
      if reference is not None:
        (w, slots), (w_ref, slots_ref) = first, reference
        w0f = w0.astype(F32)
        row["err_update"] = float(_rel_err(w.astype(F32) - w0f, w_ref.astype(F32) - w0f))
        row["err_slots"] = max((float(_rel_err(s, r)) for s, r in zip(slots, slots_ref)), default=0.0)
        if not (row["err_update"] <= UPDATE_TOL_16 and row["err_slots"] <= AUTO_SLOT_TOL):
          row["status"] = "check_failed"
      t, carry = _timing.time_layer_update(update, carry, **timing)
    row.update(ms=t.median_ms, min_ms=t.min_ms, iters=t.iters)
    row["_result"] = first
  except Exception as e:  # one failure must not end the run
    row.update(status="error", error=_timing.short_error(e))
  finally:
    del carry
  return row


# The decoded int8 slots after ``calls`` steps from the same state: rare one-code flips where the
# kernel's float32 tile and XLA's dot round differently (bench_lowp's tolerance).
AUTO_SLOT_TOL = 2e-2


def _auto_choice(kernel: dict, xla: dict) -> Optional[str]:
  """The faster (the kernel on a tie: it never writes the float32 gradient); None if unmeasured."""
  if "ms" not in xla:
    return None
  if "ms" not in kernel or kernel["status"] != "ok":
    return "xla" if kernel.get("status") in ("check_failed", "error") else None
  return "mosaic" if kernel["ms"] <= xla["ms"] else "xla"


def auto_plan(classes, tokens, configs) -> list[tuple]:
  """Every case in measuring order: ``(representative, members, t, config)``."""
  return [(rep, members, t, config) for rep, members in classes for t in tokens for config in configs]


def _device_s(t: int, k: int, n: int, config: str) -> float:
  """Seconds of device work to time one backend on one case: the first dispatches (on zeros,
  checked, warm-up) and 3 repeats of at least 10 ms and 3 dispatches, at twice the roofline
  floor per layer update (AUTO_CONFIGS' bytes: x, dy once; weight and states twice)."""
  w_dtype, fields = AUTO_CONFIGS[config]
  state_bytes = 2 * (1.03 if fields.get("state_dtype") == "int8" else jnp.dtype(w_dtype).itemsize)
  nbytes = 2 * t * (k + n) + 2 * k * n * (jnp.dtype(w_dtype).itemsize + state_bytes)
  dispatch_ms = _timing.LAYER_CALLS * 2 * max(2.0 * t * k * n / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3
  return (3 * dispatch_ms + 3 * max(10.0, 3 * dispatch_ms)) / 1e3


def _case_s(config: str, kernel: str, t: int, k: int, n: int) -> float:
  """Seconds one case takes: the kernel's compile, then the GPU turn (XLA's compile, both timings)."""
  return ((FIRST_CALL_S["mosaic"][config] if kernel == "mosaic" else 1.0) + _turn_s(t, k, n, config))


def _turn_s(t: int, k: int, n: int, config: str) -> float:
  # 0.2 s: the inputs, the check and its copies (host work under the lock).
  return FIRST_CALL_S["xla"] + 0.2 + 2 * _device_s(t, k, n, config)


def auto_estimate_s(plan, kernel: str, workers: int = 1) -> float:
  """Seconds the plan takes by FIRST_CALL_S and :func:`_device_s`: the kernel's compiles split
  over the workers, or the GPU's turns (XLA's compiles, first calls, timing) one after another,
  whichever is longer."""
  kernels = sum(FIRST_CALL_S["mosaic"][c] if kernel == "mosaic" else 1.0 for *_, c in plan)
  turns = sum(_turn_s(t, *rep, c) for rep, _, t, c in plan)
  return max(kernels / workers, turns) if workers > 1 else kernels + turns


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  """One worker at a time on the GPU (inputs, first call, timing); compiles run beside it."""
  import fcntl  # pylint: disable=g-import-not-at-top

  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def measure_cases(plan, indices, *, kernel: str, interpret: bool, timing: dict, deadline: Optional[float],
                  gpu_lock, sink) -> None:
  """Measures ``plan[i]`` for ``i`` in ``indices`` (in order); ``sink(i, row)`` gets each row.

  A case that would end past ``deadline`` (``time.time()``) and every later one is recorded as
  skipped."""
  made: dict = {}

  def inputs_of(t, k, n):
    def get():
      if (t, k, n) not in made:
        made.clear()
        gc.collect()
        made[(t, k, n)] = make_inputs(t, k, n)
      return made[(t, k, n)]
    return get

  stopped = False
  for i in indices:
    rep, members, t, config = plan[i]
    k, n = rep
    w_dtype = AUTO_CONFIGS[config][0]
    key = auto_case_key(config, w_dtype, t, k, n)
    row = dict(key, config=config, members=[list(m) for m in members], kernel=kernel)
    stopped = stopped or (deadline is not None and time.time() + _case_s(config, kernel, t, k, n) > deadline)
    if stopped:
      sink(i, dict(row, status="skipped: time limit"))
      continue
    calls = 1 if interpret else _timing.LAYER_CALLS
    inputs = inputs_of(t, k, n)
    xla = _auto_measure(auto_runner(t, k, n, config, "xla", calls), inputs, timing, gpu_lock,
                        compile_on_gpu=True)
    reference = xla.pop("_result", None)
    why = None if interpret else _auto_mosaic_problem(k, n, t, config)
    if why is None:
      mine = _auto_measure(auto_runner(t, k, n, config, kernel, calls), inputs, timing,
                           gpu_lock, reference)
      mine.pop("_result", None)
    else:
      mine = {"status": "unsupported", "error": why}
    row.update(kernel_row=mine, xla_row=xla, choice=_auto_choice(mine, xla))
    _timing.log(f"  {t:>6}x{k}x{n:<6} {config:<13} {kernel} {_ms(mine)}  xla {_ms(xla)}  -> {row['choice']}")
    sink(i, row)


def auto_table_run(args) -> int:
  """Measures the table, writes ``auto_table.json`` (the package's format) and ``auto_table.md``.

  On a GPU, ``--workers`` processes split the cases ((shape class, T) groups round robin, in
  measuring order): each compiles its next Mosaic kernel while another holds the GPU (a file
  lock around XLA's compiles, inputs, the first call and the timing), so the kernel's compiles,
  which dominate, run side by side on the host's cores.
  """
  # Before the backend starts: this process and its workers share one GPU, none may take 75% of it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  interpret = args.dry_run or jax.default_backend() == "cpu"
  kernel = "interpret" if interpret else "mosaic"
  configs = args.configs or list(AUTO_CONFIGS)
  if args.dry_run:
    tokens, shapes, first = args.tokens or (32,), args.shapes or list(AUTO_SMOKE_SHAPES), ()
    timing = dict(warmup=0, iters=1, repeats=1)
  else:
    tokens, shapes = args.tokens or AUTO_TOKENS, args.shapes or preset_shapes()
    first = block_shapes("llama-3.1-8b")
    # The warm-up dispatch picks the dispatches per repeat (the checked one compiled and warmed).
    timing = dict(warmup=1, iters=None, repeats=3, target_repeat_ms=10.0)
  workers = args.workers or (1 if interpret else 8)
  if workers < 1:
    raise ValueError(f"--workers={workers} must be >= 1")
  # The presets' shapes by class, one representative each; shapes given by --shapes each measured;
  # with --members, each shape of a class but its representative (the shapes the table reads
  # through its nearest entry), measured to check the table on them.
  if args.members:
    shapes = class_members(shapes, first)
    if not shapes:
      raise SystemExit("--members: every class has one shape; nothing to check the table on")
  classes = (shape_classes(shapes, first) if args.shapes is None and not args.members
             else [(tuple(kn), [tuple(kn)]) for kn in dict.fromkeys(map(tuple, shapes))])
  plan = auto_plan(classes, tokens, configs)
  folder = _timing.out_dir(args.out)
  if args.remeasure and not args.merge:
    raise SystemExit("--remeasure drops configurations from --merge's rows: pass --merge ROWS too")
  merged, earlier = merged_rows(args.merge or (), plan, remeasure=args.remeasure)
  if args.worker is not None:  # one of the processes below
    index, deadline = args.worker, args.deadline
    rows_path = folder / f"auto_rows_{index}.jsonl"
    with open(rows_path, "a") as out:
      def sink(i, row):
        out.write(json.dumps({"index": i, **row}, default=str) + "\n")
        out.flush()
      # Whole (class, T) groups per worker: their configurations share the inputs and XLA's
      # autotuning of the dot.
      mine = [i for i in range(len(plan))
              if (i // len(configs)) % workers == index and i not in merged]
      measure_cases(plan, mine, kernel=kernel, interpret=interpret,
                    timing=timing, deadline=deadline, gpu_lock=lambda: _file_lock(folder / "gpu.lock"),
                    sink=sink)
    return 0

  info = _timing.run_info("experiments.bench_fused_dw", args.argv)
  for run in earlier:
    for field in ("device", "jax"):
      if run[field] != info[field]:
        raise SystemExit(f"--merge {run['path']}: measured with {field} {run[field]!r}, this run has "
                         f"{info[field]!r}: merge only runs of one device and jax")
  info.update(commit=args.commit or _git_commit(), kernel=kernel, interpret=interpret, timing=timing,
              calls_per_dispatch=1 if interpret else _timing.LAYER_CALLS,
              time_limit_s=args.time_limit, workers=workers, cases=len(plan),
              classes=[{"representative": list(r), "members": [list(m) for m in ms]} for r, ms in classes],
              merged=earlier)
  todo = [p for i, p in enumerate(plan) if i not in merged]
  info["estimate_s"] = round(auto_estimate_s(todo, "mosaic" if not args.dry_run else kernel, workers))
  _timing.log(f"auto table on {info['device']} (jax {info['jax']}): {len(classes)} shape classes x "
              f"{len(tokens)} T x {len(configs)} configs = {len(plan)} cases ({len(merged)} merged from "
              f"earlier runs), {workers} workers, estimated {info['estimate_s']} s; time limit "
              f"{args.time_limit} s")
  if args.estimate_only:
    return 0
  start = time.time()
  # The last seconds go to merging and writing.
  deadline = None if args.time_limit is None else start + args.time_limit - 15.0
  rows: dict[int, dict] = {}
  if workers == 1:
    measure_cases(plan, [i for i in range(len(plan)) if i not in merged], kernel=kernel,
                  interpret=interpret, timing=timing, deadline=deadline,
                  gpu_lock=contextlib.nullcontext, sink=rows.__setitem__)
  else:
    rows = _run_workers(args, folder, workers, deadline)
  rows.update(merged)
  all_rows = [rows.get(i) or dict(auto_case_key(c, AUTO_CONFIGS[c][0], t, *r), config=c,
                                  status="skipped: worker ended")
              for i, (r, _, t, c) in enumerate(plan)]
  info["elapsed_s"] = round(time.time() - start, 1)
  table = _auto_table(info, all_rows, interpret, len(plan))
  _write_text(folder / "auto_table.json", table.dumps())
  _timing.write_json(folder / "auto_table_rows.json", {"info": info, "rows": all_rows})
  _timing.write_table(folder / "auto_table.md", auto_markdown(info, all_rows), folder / "auto_table.json")
  for worker_rows in folder.glob("auto_rows_*.jsonl"):  # all in auto_table_rows.json now
    worker_rows.unlink()
  if args.members:  # what the table "auto" reads on this device costs on these shapes
    from forge_jax import _auto  # pylint: disable=g-import-not-at-top
    used = _auto.table_path(info["device"])
    write_regret(folder, used, [folder / "auto_table_rows.json"])
    try:  # the table with these cases joined (--union), to ship for this GPU
      joined = union_table([used, folder / "auto_table.json"])
    except ValueError as e:  # the table read was measured on another device (or a CPU run)
      _timing.log(f"no auto_table_with_members.json: {e}")
    else:
      _write_text(folder / "auto_table_with_members.json", joined.dumps())
  return 0


def class_members(shapes: Sequence[tuple[int, int]], first: Sequence[tuple[int, int]] = ()
                  ) -> list[tuple[int, int]]:
  """The shapes of :func:`shape_classes` other than their class's representative, in its
  measuring order: the shapes a table of representatives serves through a nearest entry."""
  return [m for rep, members in shape_classes(shapes, first) for m in members if m != rep]


def merged_rows(paths: Sequence[pathlib.Path], plan,
                remeasure: Sequence[str] = ()) -> tuple[dict[int, dict], list[dict]]:
  """``({plan index: row}, [each run's provenance])``: the cases of ``plan`` measured in the
  earlier runs whose ``auto_table_rows.json`` are ``paths`` (a later file's row wins), each
  row marked with its run's commit and date; rows of the configurations in ``remeasure`` are
  left out (measured again)."""
  index = {(t, tuple(rep), config): i for i, (rep, _, t, config) in enumerate(plan)}
  merged, earlier = {}, []
  for path in paths:
    payload = json.loads(pathlib.Path(path).read_text())
    info = payload["info"]
    run = {"path": str(path),
           **{f: info.get(f) for f in ("device", "jax", "commit", "date", "elapsed_s")}}
    taken = 0
    for row in payload["rows"]:
      i = index.get((row["t"], (row["k"], row["n"]), row["config"]))
      if i is not None and row.get("choice") is not None and row["config"] not in remeasure:
        merged[i] = dict(row, measured_in={"commit": run["commit"], "date": run["date"]})
        taken += 1
    earlier.append(dict(run, cases=taken))
  return merged, earlier


def _run_workers(args, folder: pathlib.Path, workers: int, deadline: Optional[float]) -> dict[int, dict]:
  """Runs the worker processes (killed at ``deadline`` plus a grace period); their rows by case."""
  for old in folder.glob("auto_rows_*.jsonl"):
    old.unlink()
  rest, skip = [], False
  for a in args.argv:  # the same run, as worker i
    if skip or a in ("--out", "--workers"):
      skip = not skip
      continue
    rest.append(a)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  procs = []
  for i in range(workers):
    cmd = [sys.executable, "-m", "experiments.bench_fused_dw", *rest, "--out", str(folder),
           "--workers", str(workers), "--worker", str(i)]
    if deadline is not None:
      cmd += ["--deadline", repr(deadline)]
    procs.append(subprocess.Popen(cmd, env=env))
  for p in procs:
    try:
      p.wait(timeout=None if deadline is None else max(1.0, deadline + 10.0 - time.time()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  (folder / "gpu.lock").unlink(missing_ok=True)
  rows: dict[int, dict] = {}
  for path in folder.glob("auto_rows_*.jsonl"):
    for line in path.read_text().splitlines():
      if line.strip():
        row = json.loads(line)
        rows[row.pop("index")] = row
  return rows


def _auto_table(info: dict, rows: list[dict], interpret: bool, planned: int):
  from forge_jax import _auto  # pylint: disable=g-import-not-at-top

  fields = ("t", "k", "n", "weight", "states", "sr")
  entries = [dict({f: r[f] for f in fields}, choice=r["choice"], kernel_ms=r["kernel_row"].get("ms"),
                  xla_ms=r["xla_row"].get("ms"))
             for r in rows if r.get("choice") is not None]
  provenance = {k: info[k] for k in ("device", "date", "jax", "jaxlib", "commit", "command")}
  provenance.update(measured=not interpret, elapsed_s=info["elapsed_s"], cases_measured=len(entries),
                    cases_planned=planned)
  if info.get("merged"):
    provenance["merged"] = [{f: run[f] for f in ("commit", "date", "elapsed_s", "cases")}
                            for run in info["merged"]]
  return _auto.Table.from_json({"provenance": provenance, "entries": entries})


def union_table(paths: Sequence[pathlib.Path]):
  """The tables at ``paths`` (one device and jax) as one: every entry of each, a later table's
  winning on the same case (t, k, n and storage); the first table's provenance, with the others'
  under ``"added"`` (after the first's own, where it is a union already). How a ``--members``
  run's measurements join the table they checked, and a re-measured storage a shipped table."""
  from forge_jax import _auto  # pylint: disable=g-import-not-at-top

  tables = [_auto.read_table(p) for p in paths]
  first = tables[0].provenance
  for path, table in zip(paths[1:], tables[1:]):
    for field in ("device", "jax"):
      if table.provenance.get(field) != first.get(field):
        raise ValueError(f"{path} was measured with {field} {table.provenance.get(field)!r}, "
                         f"{paths[0]} with {first.get(field)!r}: join only tables of one device and jax")
  entries = {}
  for table in tables:
    entries.update(((e.t, e.k, e.n) + e.key, e) for e in table.entries)
  keep = ("date", "commit", "command", "cases_measured")
  # A table that is itself a union keeps its additions: its own, then each later table's.
  added = list(first.get("added", ())) + [{f: t.provenance.get(f) for f in keep} for t in tables[1:]]
  provenance = dict(first, added=added)
  return _auto.Table(provenance, tuple(entries.values()))


def _write_text(path: pathlib.Path, text: str) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(text)
  tmp.replace(path)


def _ms(row: dict) -> str:
  return f"{row['ms']:.4f} ms" if "ms" in row else row["status"]


def _auto_mosaic_problem(k: int, n: int, t: int, config: str) -> Optional[str]:
  """Why the Mosaic kernel cannot take this configuration (its own checks), or None."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top

  w_dtype = AUTO_CONFIGS[config][0]
  opt = _auto_optimizer(config)
  x, dy = jax.ShapeDtypeStruct((t, k), BF16), jax.ShapeDtypeStruct((t, n), BF16)
  w = jax.ShapeDtypeStruct((k, n), w_dtype)
  slots = opt.rule.slots_of(jax.eval_shape(opt.init, w))
  return _fused._mosaic_problem(x, dy, w, slots, None, True)[0]  # the grad norm too


def _git_commit() -> str:
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parent)
    return out.stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown (pass --commit)"


def auto_markdown(info: dict, rows: list[dict]) -> str:
  out = ["# backend=\"auto\": the Mosaic kernel against XLA's dot + fused update", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}, jaxlib "
         f"{info['jaxlib']}; commit {info['commit']}; {info['elapsed_s']} s. AdamW, bf16 x/dy; ms per "
         f"layer update, device time ({info.get('calls_per_dispatch', '?')} per dispatch, each feeding the "
         "next: experiments/_timing.layer_update, the program bench_lowp times). "
         "Each shape stands for its class (members listed)."
         + "".join(f" {run['cases']} cases measured earlier (commit {run['commit']}, {run['date']}, "
                   f"{run['elapsed_s']} s: `{run['path']}`)." for run in info.get("merged") or ()), "",
         "| T | K x N (class members) | config | kernel ms | xla ms | kernel / xla | auto |",
         "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "kernel_row" not in r:
      continue
    kr, xr = r["kernel_row"], r["xla_row"]
    ratio = f"{kr['ms'] / xr['ms']:.2f}" if "ms" in kr and "ms" in xr else "-"
    members = ", ".join(f"{a}x{b}" for a, b in r["members"])
    out.append(f"| {r['t']} | {r['k']}x{r['n']} ({members}) | {r['config']} | {_ms(kr)} | {_ms(xr)} | "
               f"{ratio} | {r['choice'] or '-'} |")
  skipped = sum(1 for r in rows if "kernel_row" not in r)
  if skipped:
    out += ["", f"{skipped} cases not measured (time limit): \"auto\" takes the nearest measured one."]
  return "\n".join(out) + "\n"


# AUTO_CONFIGS name -> bench_lowp.CONFIGS name: the same weight dtype and Precision.
LOWP_CONFIGS = {"fp32": "fp32", "fp32_int8": "fp32_int8", "bf16": "bf16_rtn_bf16",
                "bf16_int8": "bf16_rtn_int8", "bf16_sr": "bf16_sr_bf16", "bf16_sr_int8": "bf16_sr_int8"}


def write_regret(folder: pathlib.Path, table_path: pathlib.Path,
                 rows_paths: Sequence[pathlib.Path]) -> None:
  """:func:`auto_regret`'s markdown, logged and written to ``folder``'s ``auto_regret.md``."""
  text, _ = auto_regret(table_path, rows_paths)
  (folder / "auto_regret.md").write_text(text)
  _timing.log("\n" + text + f"\nwrote {folder / 'auto_regret.md'}")


def auto_regret(table_path: pathlib.Path, rows_paths: Sequence[pathlib.Path],
                limit: float = 1.03) -> tuple[str, list[dict]]:
  """What ``"auto"`` reading the table at ``table_path`` costs on measured cases it was not
  built from: for each case of ``rows_paths`` (``auto_table_rows.json``) with both times, the
  backend the table picks (off the table: the kernel, ``"auto"``'s rule) and its time over the
  faster one's. Returns the markdown and the cases, worst first."""
  from forge_jax import _auto  # pylint: disable=g-import-not-at-top

  table = _auto.read_table(table_path)
  cases = []
  for path in rows_paths:
    for r in json.loads(pathlib.Path(path).read_text())["rows"]:
      kernel_ms = r.get("kernel_row", {}).get("ms")
      xla_ms = r.get("xla_row", {}).get("ms")
      if kernel_ms is None or xla_ms is None:
        continue
      entry = table.lookup(r["t"], r["k"], r["n"], r["weight"], r["states"], r["sr"])
      pick = entry.choice if entry is not None else "mosaic"
      cases.append(dict(t=r["t"], k=r["k"], n=r["n"], config=r["config"], kernel_ms=kernel_ms,
                        xla_ms=xla_ms, pick=pick,
                        entry=None if entry is None else f"{entry.t}x{entry.k}x{entry.n}",
                        regret=(kernel_ms if pick == "mosaic" else xla_ms) / min(kernel_ms, xla_ms)))
  cases.sort(key=lambda c: (-c["regret"], c["t"], c["k"], c["n"], c["config"]))
  over = [c for c in cases if c["regret"] > limit]
  out = [f"# What \"auto\" reading `{table_path}` costs on other measured cases", "",
         f"Cases: {', '.join(f'`{p}`' for p in rows_paths)}. For each, the backend the table picks "
         "(by its nearest entry; off the table, the kernel) and its time over the faster backend's.", ""]
  if not cases:
    return "\n".join(out + ["No case with both times."]) + "\n", cases
  by_t = {}
  for c in cases:
    by_t.setdefault(c["t"], []).append(c["regret"])
  out += [f"{len(cases)} cases; {len(over)} more than {limit:.2f}x the faster backend; worst "
          f"{cases[0]['regret']:.3f}x.", "", "| T | cases | median | max | over |", "|---|---|---|---|---|"]
  for t in sorted(by_t):
    v = sorted(by_t[t])
    out.append(f"| {t} | {len(v)} | {v[len(v) // 2]:.3f} | {v[-1]:.3f} | {sum(x > limit for x in v)} |")
  out += ["", "| T | K x N | config | kernel ms | xla ms | entry read | picks | time / faster |",
          "|---|---|---|---|---|---|---|---|"]
  for c in cases:
    out.append(f"| {c['t']} | {c['k']}x{c['n']} | {c['config']} | {c['kernel_ms']:.4f} | "
               f"{c['xla_ms']:.4f} | {c['entry'] or 'off the table'} | {c['pick']} | {c['regret']:.3f} |")
  return "\n".join(out) + "\n", cases


def compare_lowp(rows_path: pathlib.Path, lowp_paths: Sequence[pathlib.Path],
                 before_rows: Optional[pathlib.Path] = None,
                 before_lowp: Optional[pathlib.Path] = None) -> str:
  """The table's cases beside bench_lowp's rows of the same case (kernel: its ``mosaic`` row):
  since both time _timing.layer_update, each ratio should be within run-to-run noise. With
  ``before_*``: an earlier table and bench_lowp run as two more columns per backend."""
  def table(path):
    rows = json.loads(pathlib.Path(path).read_text())["rows"]
    return {(f"{r['t']}x{r['k']}x{r['n']}", LOWP_CONFIGS[r["config"]]): r for r in rows
            if "kernel_row" in r}

  def lowp(paths):
    out = {}
    for path in paths:
      for r in json.loads(pathlib.Path(path).read_text())["rows"]:
        if r.get("impl") in ("xla", "mosaic") and "ms" in r:
          out.setdefault((r["shape"], r["config"]), {})[r["impl"]] = r["ms"]
    return out

  now, now_lowp = table(rows_path), lowp(lowp_paths)
  old = table(before_rows) if before_rows else {}
  old_lowp = lowp([before_lowp]) if before_lowp else {}
  ms = lambda v: f"{v:.4f}" if v is not None else "-"
  ratio = lambda a, b: f"{a / b:.2f}" if a is not None and b is not None else "-"
  head = ["table", "bench_lowp", "table / bench_lowp"]
  if old:
    head += ["table before", "bench_lowp before"]
  out = ["# The auto table's timings beside bench_lowp's (the same program: _timing.layer_update)", "",
         f"Table: `{rows_path}`; bench_lowp: {', '.join(f'`{p}`' for p in lowp_paths)}"
         + (f"; before: `{before_rows}`, `{before_lowp}`" if old else "") + ". ms per layer update.", "",
         "| T x K x N | config | backend | " + " | ".join(head) + " |",
         "|---|---|---|" + "---|" * len(head)]
  for key in sorted(set(now) & set(now_lowp)):
    for backend, impl, row_key in (("mosaic", "mosaic", "kernel_row"), ("xla", "xla", "xla_row")):
      a, b = now[key][row_key].get("ms"), now_lowp[key].get(impl)
      cells = [ms(a), ms(b), ratio(a, b)]
      if old:
        cells += [ms(old.get(key, {}).get(row_key, {}).get("ms")), ms(old_lowp.get(key, {}).get(impl))]
      out.append(f"| {key[0]} | {key[1]} | {backend} | " + " | ".join(cells) + " |")
  if len(out) == 6:
    out.append("\nNo case in both.")
  return "\n".join(out) + "\n"


def rule_table(tokens=AUTO_TOKENS, shapes=None, configs=None):
  """The table that reproduces the rule without one (the kernel) over the planned cases,
  unmeasured: what ships until a GPU run replaces it."""
  from forge_jax import _auto  # pylint: disable=g-import-not-at-top

  classes = shape_classes(shapes or preset_shapes())
  entries = []
  for rep, _ in classes:
    for t in tokens:
      for config in configs or AUTO_CONFIGS:
        key = auto_case_key(config, AUTO_CONFIGS[config][0], t, *rep)
        entries.append(dict(key, choice="mosaic", kernel_ms=None, xla_ms=None))
  provenance = {"measured": False, "source": "the rule without a table (forge_jax._fused._resolve_backend), "
                "over the cases experiments.bench_fused_dw --auto-table measures",
                "device": None, "date": None, "jax": None, "commit": None}
  return _auto.Table.from_json({"provenance": provenance, "entries": entries})


if __name__ == "__main__":
  sys.exit(main())
