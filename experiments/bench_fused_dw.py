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
import dataclasses
import functools
import gc
import json
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
      carry = f(carry, x, dy)
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
            dict(warmup=1, iters=2, repeats=1, **extra))
  timing = dict(warmup=3, iters=args.iters, repeats=args.repeats, **extra)
  return interpret, args.tokens or TOKENS, args.shapes or list(SHAPES_KN), timing


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  parser.add_argument("--tokens", type=int, nargs="+", default=None, help=f"T values (default {TOKENS})")
  parser.add_argument("--shapes", type=_parse_kn, nargs="+", default=None, help="KxN shapes")
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
  args = parser.parse_args(argv)

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
  tree, out = tree.resolve(), out.resolve()
  if not (tree / "pallas_kernels").is_dir():
    raise ValueError(f"--baseline-tree {tree} has no pallas_kernels/: pass a checkout of this "
                     "repository (e.g. git archive COMMIT | tar -x -C DIR)")
  rest, skip = [], False
  for a in argv:  # the same run without --baseline-tree / --out
    if skip or a in ("--baseline-tree", "--out"):
      skip = not skip
      continue
    if not a.startswith(("--baseline-tree=", "--out=")):
      rest.append(a)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *rest, "--out", str(out)]
  _timing.log(f"baseline: {' '.join(cmd)} (PYTHONPATH={tree})")
  proc = subprocess.run(cmd, env=env, cwd=tree, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"the baseline run on {tree} ended with {proc.returncode}")
  return json.loads((out / "bench_fused_dw.json").read_text())


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


if __name__ == "__main__":
  sys.exit(main())
