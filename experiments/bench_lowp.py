"""Low-precision FORGE on the GPU: the fused kernel per storage configuration.

On the GPU, from the repository root:

    PYTHONPATH=$PWD python -m experiments.bench_lowp --out $OUT

On a CPU (seconds, Pallas interpret mode, tiny shapes):

    PYTHONPATH=$PWD python -m experiments.bench_lowp --smoke --out /tmp/bench

At the shapes of ``bench_fused_dw`` (T in {1024, 4096, 16384}, (K, N) in
{(4096, 4096), (4096, 14336), (14336, 4096), (5120, 17408)}), bf16 x/dy and
AdamW, for each storage configuration (:data:`CONFIGS`: weight dtype and
:class:`forge_jax.Precision`) it times one layer's update as a model step runs
it (:func:`experiments._timing.layer_update`, the program ``bench_fused_dw
--auto-table`` times too: ``fused_linear_update`` as ``forge_jax.Dense``'s
backward calls it, weight and state donated and updated in place, int8 codes in
their float view as ``forge_jax.train_step`` hands them over,
``_timing.LAYER_CALLS`` calls per dispatch, each feeding the next):

* ``pallas``: the Triton-lowered fused kernel (codecs in its epilogue);
* ``xla``: the XLA backend with the same codecs (one float32 dot, then the
  decode/update/encode as XLA fuses it): the unfused reference;
* ``mosaic`` (opt-in, ``--impls ... mosaic``): the Mosaic GPU kernel
  (``backend="mosaic"``; under its interpreter on a CPU). A configuration it
  cannot take is recorded as ``unsupported`` with the reason, never timed as
  the fallback it would run;

plus ``optax_fp32`` and ``optax_bf16``: the GEMM + ``optax.adamw`` +
``apply_updates`` in one donated jit, float32 and bfloat16 params.
Every fused row is first checked against the ``xla`` row of its
configuration after one dispatch from the same state (relative Frobenius error of
the weight update and of the decoded slots). Reported per row: ms (device
time, experiments/_timing.py), TFLOP/s at 2 T K N, bytes per parameter of
weight + state (from the real arrays), and the speed relative to the fp32
kernel. Writes ``bench_lowp.json`` (after every shape) and ``bench_lowp.md``.

``--baseline-tree DIR`` times another checkout's kernels side by side: this
script first runs in a subprocess with ``DIR`` first on ``PYTHONPATH`` (its
``pallas_kernels`` and ``forge_jax``, this harness) for ``--baseline-configs``
(default: all of ``--configs``), then on this tree, and writes
``bench_lowp_compare.md`` (ms per shape, configuration and implementation, and
the ratio). The Mosaic kernel's storage configurations for the Llama-3.1-8B
projections on the H200, against a checkout of an older commit in /tmp/old::

    PYTHONPATH=$PWD python -m experiments.bench_lowp --out $OUT --tokens 1024 4096 \
      --shapes 4096x4096 4096x1024 4096x14336 14336x4096 --impls mosaic \
      --configs fp32_bf16 fp32_int8 bf16_rtn_bf16 bf16_sr_bf16 bf16_rtn_int8 bf16_sr_int8 \
      --baseline-tree /tmp/old --baseline-configs fp32_int8 bf16_sr_bf16 bf16_sr_int8

``--cold-states``: the FORGE rows cycle each dispatch's calls through enough optimizer states
(at least 256 MB, at most one per call) that a layer's state is not in the L2 cache from its call
before, as in a model step, where the other layers' work evicts it; the weight, x and dy stay
shared, as the dX product has just read them. Only shapes whose state fits L2 change (on an
H100, the 4096x1024 k/v projection), e.g.::

    PYTHONPATH=$PWD python -m experiments.bench_lowp --out $OUT --tokens 1024 \
      --shapes 4096x1024 4096x4096 --impls mosaic xla --configs bf16_rtn_bf16 bf16_sr_int8 --cold-states

``--with-dx``: each FORGE call is the layer's whole backward, the dX product ``dy @ W.T`` and then
the update ordered after it, as ``forge_jax.Dense`` runs it; column ``dx`` times the product
alone, to subtract. Back to back, the updates of one layer meet each other's writes; in a model
step a GEMM runs between them. On an H100 the back-to-back program put the bf16-state update of
Llama-3.1-8B's layers 7.5% above what the step's profile shows and the int8 one 2% below; after
the dX product, within 3% and 0.4% (experiments/results/h100/2026-12-06_decomposition). Compare
storages with it.

What the kernels' non-finite guard costs: each configuration beside its ``_noguard`` twin
(``Precision(nonfinite="propagate")``; ``_nonorm``: without the gradient norm; ``_applied``:
with train_step's apply flag, which a non-finite loss sets false), e.g.::

    PYTHONPATH=$PWD python -m experiments.bench_lowp --out $OUT --tokens 1024 4096 \
      --shapes 4096x4096 4096x14336 14336x4096 --impls pallas mosaic \
      --configs fp32 fp32_noguard bf16_rtn_bf16 bf16_rtn_bf16_noguard bf16_sr_int8 bf16_sr_int8_noguard
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import pathlib
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import forge_jax
from experiments import _timing
from experiments import bench_fused_dw
from forge_jax import _lowp

F32, BF16 = jnp.float32, jnp.bfloat16
P = forge_jax.Precision
LR, WD = 1e-3, 0.1
# name -> (weight dtype, Precision).
CONFIGS: dict[str, tuple[Any, forge_jax.Precision]] = {
    "fp32": (F32, P()),
    "fp32_bf16": (F32, P(state_dtype="bfloat16")),
    "bf16_rtn_bf16": (BF16, P()),
    "bf16_sr_bf16": (BF16, P("stochastic")),
    "bf16_sr_fp32": (BF16, P("stochastic", state_dtype="float32")),
    "fp32_int8": (F32, P(state_dtype="int8")),
    "bf16_rtn_int8": (BF16, P(state_dtype="int8")),
    "bf16_sr_int8": (BF16, P("stochastic", state_dtype="int8")),
    "bf16_sr_int8_b256": (BF16, P("stochastic", state_dtype="int8", block_size=256)),
}
# Each configuration with the kernels' non-finite guard off (Precision(nonfinite="propagate")),
# to time what the guard costs side by side: opt-in (--configs fp32 fp32_noguard ...). A tree
# whose Precision has no guard (--baseline-tree) gets none of them.
NOGUARD = "_noguard"
if "nonfinite" in {f.name for f in dataclasses.fields(P)}:
  CONFIGS.update({name + NOGUARD: (w, dataclasses.replace(p, nonfinite="propagate"))
                  for name, (w, p) in list(CONFIGS.items())})
# Each configuration without the gradient norm the layers return (the train step reports it and
# clips by it), to time what it costs side by side: opt-in (--configs fp32 fp32_nonorm ...).
NONORM = "_nonorm"
CONFIGS.update({name + NONORM: cfg for name, cfg in list(CONFIGS.items())})
# Each configuration with train_step's apply flag (a non-finite loss stores nothing) passed to
# the kernels, to time what it costs side by side: opt-in (--configs fp32 fp32_applied ...).
APPLIED = "_applied"
CONFIGS.update({name + APPLIED: cfg for name, cfg in list(CONFIGS.items())
                if not name.endswith(NONORM)})
BASELINES = {"optax_fp32": F32, "optax_bf16": BF16}
REFERENCE = "fp32"  # speed-up column: against the fp32 fused kernel
UPDATE_TOL = 1e-2  # relative Frobenius error of the weight update vs the xla row
SLOT_TOL = 2e-2  # ... of the decoded slots (int8: rare one-code flips)


def _optimizer(precision):
  return forge_jax.adamw(LR, weight_decay=WD, precision=precision)


def _with_norm(config: str) -> bool:
  return not config.endswith(NONORM)


def mosaic_problem(x, dy, w0, config: str,
                   fields: Optional[dict] = None) -> tuple[Optional[str], Any]:
  """``(why, None)`` if the Mosaic kernel cannot run this configuration (its own checks), else
  ``(None, tiling)``: the default tiling, or ``fields`` over it (``--mosaic-variants``)."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top

  w_dtype, precision = CONFIGS[config]
  opt = _optimizer(precision)
  w = jax.ShapeDtypeStruct(w0.shape, w_dtype)
  state = jax.eval_shape(opt.init, w)
  slots = tuple(getattr(state, name) for name in opt.rule.slot_names)
  tiling = None
  if fields:
    from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
    tiling = dataclasses.replace(mosaic.default_config(x, dy, w, slots,
                                                       compute_grad_sq_norm=_with_norm(config)), **fields)
  # With the grad norm (as a model step asks for it) unless the configuration leaves it out.
  why = _fused._mosaic_problem(x, dy, w, slots, tiling, _with_norm(config))[0]
  return why, tiling


def fused_runner(x, dy, w0, config: str, backend: str, *, tile=None, calls: Optional[int] = None,
                 state_sets: int = 1, with_dx: bool = False):
  """(init, layer update, result) of one configuration: the shared per-layer program
  (``calls`` per dispatch, default ``_timing.LAYER_CALLS``; ``state_sets``: see
  ``_timing.layer_update``, as ``with_dx``)."""
  w_dtype, precision = CONFIGS[config]
  update = _timing.layer_update(_optimizer(precision), backend, w_dtype, config=tile,
                                calls=calls or _timing.LAYER_CALLS, grad_norm=_with_norm(config),
                                applied=config.endswith(APPLIED), state_sets=state_sets,
                                with_dx=with_dx)
  return (lambda: update.init(x, dy, w0)), update, update.result


def optax_runner(x, dy, w0, dtype):
  tx = optax.adamw(LR, weight_decay=WD)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(carry, x, dy):
    w, state = carry
    g = jnp.dot(x.T, dy, preferred_element_type=F32).astype(dtype)
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  def init():
    w = jnp.array(w0, dtype)  # a copy: the step donates it
    return w, tx.init(w)

  return init, (lambda c: step(c, x, dy)), None


def _rel(a, b):
  a, b = a.astype(F32), b.astype(F32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def measure(name: str, runner, shape, flops: float, timing: dict, reference=None, w0=None) -> dict:
  """Check against ``reference`` (after one dispatch) then time. Never raises.

  ``runner[1]`` is a :class:`_timing.LayerUpdate` (timed per layer update) or a plain step."""
  init, step, result = runner
  update = step if isinstance(step, _timing.LayerUpdate) else None
  if update is not None:
    step = update.run
  row: dict[str, Any] = {"impl": name, "shape": shape, "status": "ok"}
  carry = None
  try:
    carry = init()
    start = time.perf_counter()
    carry = step(carry)
    jax.block_until_ready(carry)
    row["first_call_s"] = round(time.perf_counter() - start, 3)
    # Copies: the timed steps donate (delete) the carry.
    first = None if result is None else jax.tree.map(jnp.copy, result(carry))
    if reference is not None and first is not None:
      (w, slots), (w_ref, slots_ref) = first, reference
      row["err_update"] = _rel(w.astype(F32) - w0, w_ref.astype(F32) - w0)
      row["err_slots"] = max((_rel(s, r) for s, r in zip(slots, slots_ref)), default=0.0)
      if not (row["err_update"] <= UPDATE_TOL and row["err_slots"] <= SLOT_TOL):
        row["status"] = "check_failed"
    if update is not None:
      t, carry = _timing.time_layer_update(update, carry, **timing)
      row["calls_per_dispatch"] = update.calls
    else:
      t, carry = _timing.time_steps(step, carry, **timing)
    row.update(ms=t.median_ms, min_ms=t.min_ms, repeats_ms=list(t.repeats_ms), iters=t.iters,
               tflops=flops / (t.median_ms * 1e-3) / 1e12)
    row["_result"] = first
  except Exception as e:  # one failure must not end the run
    row.update(status="error", error=_timing.short_error(e))
  finally:
    del carry
  return row


def bench_shape(t, k, n, configs, impls, *, interpret: bool, timing: dict, tile=None,
                variants: Optional[dict[str, dict]] = None, calls: Optional[int] = None,
                cold_states: bool = False, with_dx: bool = False) -> list[dict]:
  """Rows of one T x K x N; ``variants``: name -> MosaicTileConfig fields over the Mosaic
  kernel's default tiling, each timed as impl ``mosaic_<name>``; ``cold_states``: the FORGE
  rows cycle through enough optimizer states that none is in L2 from its call before
  (``_timing.state_sets_for``); ``with_dx``: each FORGE call is the layer's backward (dX product,
  then the update), and impl ``dx`` times the product alone."""
  x, dy, w0 = bench_fused_dw.make_inputs(t, k, n)
  shape, flops = f"{t}x{k}x{n}", 2.0 * t * k * n
  kernel = "interpret" if interpret else "pallas"
  rows = []
  for name, dtype in BASELINES.items():
    if name in impls:
      row = measure(name, optax_runner(x, dy, w0, dtype), shape, flops, timing)
      row.update(config=name, bytes_per_param=_optax_bytes(dtype, (k, n)))
      rows.append(row)
      _timing.log(f"  {shape:>18} {name:<18} {'':<11} {_cell(row)}")
  products = {}  # weight dtype -> the dX product's row (with_dx)
  for config in configs:
    w_dtype, precision = CONFIGS[config]
    try:
      per_param = _lowp.bytes_per_param(_optimizer(precision), (k, n), w_dtype)
    except ValueError as e:  # e.g. N not a multiple of the quantization block
      rows.append({"impl": "-", "config": config, "shape": shape, "status": "error",
                   "bytes_per_param": float("nan"), "error": _timing.short_error(e)})
      continue
    bpp = per_param["total"]
    sets = (_timing.state_sets_for(int(per_param["states"] * k * n), calls or _timing.LAYER_CALLS)
            if cold_states else 1)
    runner = functools.partial(fused_runner, x, dy, w0, config, calls=calls, state_sets=sets,
                               with_dx=with_dx)
    if with_dx:  # the product depends on the weight's dtype only: timed once per dtype
      if w_dtype not in products:
        init, product = _timing.dx_product(w_dtype, calls or _timing.LAYER_CALLS)
        products[w_dtype] = measure("dx", (lambda: init(x, dy, w0), product, None), shape, flops,
                                    timing)
      row = dict(products[w_dtype], config=config, bytes_per_param=bpp)
      rows.append(row)
      _timing.log(f"  {shape:>18} {config:<18} {'dx':<11} {_cell(row)}")
    ref_row = measure("xla", runner("xla"), shape, flops,
                      timing if "xla" in impls else dict(warmup=0, iters=1, repeats=1))
    reference = ref_row.pop("_result", None)
    todo = [("xla", None)] if "xla" in impls else []
    if "pallas" in impls:
      todo.append(("pallas", runner(kernel, tile=tile)))
    mosaic_impls = [("mosaic", None)] if "mosaic" in impls else []
    mosaic_impls += [(f"mosaic_{name}", fields) for name, fields in (variants or {}).items()]
    for impl, fields in mosaic_impls:
      why, tiling = mosaic_problem(x, dy, w0, config, fields)
      if why is None:
        backend = "mosaic_interpret" if interpret else "mosaic"
        todo.append((impl, runner(backend, tile=tiling)))
      else:
        rows.append({"impl": impl, "config": config, "shape": shape, "status": "unsupported",
                     "bytes_per_param": bpp, "error": why})
        _timing.log(f"  {shape:>18} {config:<18} {impl:<11} unsupported: {why}")
    for impl, runner in todo:
      row = ref_row if impl == "xla" else measure(impl, runner, shape, flops, timing, reference, w0)
      row.pop("_result", None)
      row.update(config=config, bytes_per_param=bpp, state_sets=sets)
      rows.append(row)
      _timing.log(f"  {shape:>18} {config:<18} {impl:<11} {_cell(row)}")
    gc.collect()
  for row in rows:
    row.pop("_result", None)
  return rows


def _optax_bytes(dtype, shape) -> float:
  return jnp.dtype(dtype).itemsize * 3.0  # weight + mu + nu in the param dtype


def _cell(row: Optional[dict]) -> str:
  if row is None:
    return "-"
  if "ms" not in row:
    return row["status"]
  flag = "" if row["status"] == "ok" else f" **{row['status']}**"
  return f"{row['ms']:.3f} ms ({row['tflops']:.0f} TF/s){flag}"


def markdown(info: dict, rows: list[dict], impls: Sequence[str]) -> str:
  out = [
      "# Low-precision FORGE: fused dW + AdamW per storage configuration", "",
      f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}, jaxlib {info['jaxlib']}, "
      f"triton {info['triton']}.", "",
      f"Each cell: median ms per layer update (device time; {info.get('calls_per_dispatch', 1)} per dispatch, each "
      "feeding the next, as experiments/_timing.layer_update runs them), TFLOP/s at 2TKN. bytes/param: "
      "weight + optimizer state. `pallas vs X`: X's ms over this row's pallas ms (above 1: faster). optax rows show their time in the first column.", "",
  ]
  sets = sorted({row.get("state_sets", 1) for row in rows if row.get("state_sets", 1) > 1})
  if sets:
    out += ["Cold states (--cold-states): the FORGE rows cycle through 1 to "
            f"{max(sets)} optimizer states per dispatch (`state_sets` per row in the JSON), so that "
            "a layer's state is not in L2 from its call before.", ""]
  if any(row.get("impl") == "dx" for row in rows):
    out += ["With dX (--with-dx): each FORGE cell times the layer's whole backward, the dX product "
            "and then the update, as a model step runs it; column `dx` times the product alone.", ""]
  out += [
      "| T x K x N | config | bytes/param | " + " | ".join(impls)
      + f" | pallas vs {REFERENCE} | pallas vs optax_fp32 |",
      "|---|---|---|" + "---|" * (len(impls) + 2),
  ]
  groups: dict[tuple, dict[str, dict]] = {}
  for row in rows:
    groups.setdefault((row["shape"], row["config"]), {})[row["impl"]] = row
  for (shape, config), by_impl in groups.items():
    bpp = next(iter(by_impl.values()))["bytes_per_param"]
    mine = by_impl.get("pallas", {})
    speeds = []
    for ref in (groups.get((shape, REFERENCE), {}).get("pallas", {}),
                groups.get((shape, "optax_fp32"), {}).get("optax_fp32", {})):
      speeds.append(f"{ref['ms'] / mine['ms']:.2f}x" if "ms" in ref and "ms" in mine else "-")
    cells = [_cell(by_impl.get(i)) for i in impls]
    if config in BASELINES:
      cells = [_cell(by_impl.get(config))] + ["-"] * (len(impls) - 1)
    out.append(f"| {shape} | {config} | {bpp:.3f} | " + " | ".join(cells + speeds) + " |")
  bad = [r for r in rows if r["status"] != "ok"]
  if bad:
    out += ["", "Not ok:", ""]
    out += [f"- {r['shape']} {r['config']} {r['impl']}: {r['status']} {r.get('error', '')}"
            + (f" err_update={r['err_update']:.2e} err_slots={r['err_slots']:.2e}" if "err_update" in r else "")
            for r in bad]
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  parser.add_argument("--tokens", type=int, nargs="+", default=None,
                      help=f"T values (default {bench_fused_dw.TOKENS})")
  parser.add_argument("--shapes", type=bench_fused_dw._parse_kn, nargs="+", default=None, help="KxN shapes")
  parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                      default=[c for c in CONFIGS if not c.endswith((NOGUARD, NONORM, APPLIED))],
                      help=f"storage configurations; NAME{NOGUARD}: NAME with the non-finite guard "
                           f"off; NAME{NONORM}: NAME without the gradient norm; NAME{APPLIED}: "
                           "NAME with train_step's apply flag passed")
  impls_default = ["xla", "pallas", *BASELINES]
  parser.add_argument("--impls", nargs="+", default=impls_default, choices=impls_default + ["mosaic"],
                      help="mosaic: the Mosaic GPU kernel too (opt-in)")
  parser.add_argument("--tile", type=bench_fused_dw._parse_tile, default=None,
                      help="pallas tile 'block_k,block_n,block_t,num_warps,num_stages' (default: tuned table)")
  parser.add_argument("--iters", type=int, default=None,
                      help="dispatches per repeat (default: about 20 ms of device work, 3 to 30)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cold-states", action="store_true",
                      help="the FORGE rows cycle through enough optimizer states (>= 256 MB, up to "
                           "one per call) that a layer's state is not in L2 from its call before, "
                           "as in a model step (optax rows unchanged)")
  parser.add_argument("--with-dx", action="store_true",
                      help="each FORGE call is the layer's whole backward (the dX product, then the "
                           "update), as a model step runs it between GEMMs; impl dx: the product alone")
  parser.add_argument("--baseline-tree", default=None, type=pathlib.Path, metavar="DIR",
                      help="another checkout whose kernels to time side by side (module docstring)")
  parser.add_argument("--baseline-configs", nargs="+", default=None, choices=list(CONFIGS),
                      help="the configurations the baseline runs (default: --configs)")
  parser.add_argument("--mosaic-variants", nargs="+", default=[], metavar="NAME=JSON",
                      help="Mosaic tilings to time beside the default: MosaicTileConfig fields over "
                           "it, e.g. n64='{\"tile_n\": 64}' (impl mosaic_n64; not in the baseline)")
  args = parser.parse_args(argv)
  variants = {}
  for spec in args.mosaic_variants:
    name, _, fields = spec.partition("=")
    try:
      variants[name] = json.loads(fields)
    except json.JSONDecodeError as e:
      parser.error(f"--mosaic-variants {spec!r}: expected NAME=JSON fields ({e})")
    if not name.isidentifier() or not isinstance(variants[name], dict):
      parser.error(f"--mosaic-variants {spec!r}: expected NAME=JSON with a name and a JSON object")
  if args.baseline_configs and args.baseline_tree is None:
    parser.error("--baseline-configs needs --baseline-tree")

  # Smoke N = 256: int8 states need whole quantization blocks along N.
  interpret, tokens, shapes, timing = bench_fused_dw.run_plan(args, smoke_shape=(40, 256))
  folder = _timing.out_dir(args.out)
  baseline = None
  if args.baseline_tree is not None:
    baseline = run_baseline(args.baseline_tree, argv, args.baseline_configs, folder / "baseline")
  info = _timing.run_info("experiments.bench_lowp", argv)
  info.update(interpret=interpret, timing=timing, lr=LR, weight_decay=WD,
              calls_per_dispatch=1 if interpret else _timing.LAYER_CALLS,
              configs={k: {"w_dtype": jnp.dtype(d).name, "precision": repr(p)} for k, (d, p) in CONFIGS.items()},
              update_tol=UPDATE_TOL, slot_tol=SLOT_TOL)
  _timing.log(f"bench_lowp on {info['device']} (jax {info['jax']}), interpret={interpret}")
  rows = _timing.run_shapes(
      folder / "bench_lowp.json", info, tokens, shapes,
      lambda t, k, n: bench_shape(t, k, n, args.configs, args.impls, interpret=interpret,
                                  timing=timing, tile=args.tile, variants=variants,
                                  calls=1 if interpret else _timing.LAYER_CALLS,
                                  cold_states=args.cold_states, with_dx=args.with_dx),
      {"impl": "-", "config": "-", "bytes_per_param": float("nan")},
  )
  impls = [i for i in ("xla", "pallas", "mosaic") if i in args.impls]
  impls = (["dx"] if args.with_dx else []) + impls
  impls += [f"mosaic_{name}" for name in variants]
  if any(b in args.impls for b in BASELINES):
    impls = impls or ["pallas"]
  _timing.write_table(folder / "bench_lowp.md", markdown(info, rows, impls), folder / "bench_lowp.json")
  if baseline is not None:
    _timing.write_table(folder / "bench_lowp_compare.md",
                        compare_markdown(info, baseline, rows, args.baseline_tree),
                        folder / "bench_lowp.json")
  return 0


def run_baseline(tree: pathlib.Path, argv: Sequence[str], configs: Optional[Sequence[str]],
                 out: pathlib.Path) -> dict:
  """This script's run on another checkout: a subprocess with the tree's ``pallas_kernels`` and
  ``forge_jax`` and this tree's ``experiments`` (the harness for both), for ``configs``."""
  dropped = {"--baseline-tree": 1, "--out": 1, "--baseline-configs": None, "--mosaic-variants": None}
  dropped |= {"--configs": None} if configs else {}
  rest = _timing.drop_options(argv, dropped)  # the same run without the baseline's own options
  if configs:
    rest += ["--configs", *configs]
  # This harness (with the program _timing.layer_update times) over the tree's kernels.
  return _timing.run_harness_on_tree(__file__, rest, out, tree, "bench_lowp.json")


def compare_markdown(info: dict, baseline: dict, rows: list[dict], tree: pathlib.Path) -> str:
  """Baseline vs this tree per (shape, configuration, implementation): ms and the ratio; rows
  the baseline did not run show this tree's time alone."""
  key = lambda r: (r["shape"], r["config"], r["impl"])
  old = {key(r): r for r in baseline["rows"]}
  out = ["# Low-precision FORGE: baseline tree vs this tree", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}. Baseline: "
         f"`{tree}` (its kernels, this harness), run first. Median ms per call (see "
         "bench_lowp.md).", "",
         "| T x K x N | config | impl | baseline ms | this tree ms | this / baseline |",
         "|---|---|---|---|---|---|"]
  cell = lambda row: f"{row['ms']:.4f}" if "ms" in row else row.get("status", "-")
  for r in rows:
    o = old.get(key(r), {})
    ratio = f"{r['ms'] / o['ms']:.3f}" if "ms" in r and "ms" in o else "-"
    out.append(f"| {r['shape']} | {r['config']} | {r['impl']} | {cell(o)} | {cell(r)} | {ratio} |")
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  sys.exit(main())
