"""Device-side timing and run metadata shared by the tuning and benchmark scripts.

Timing a jitted call with a host clock around each call adds the dispatch
(0.1 to 0.2 ms on the H200) to every figure; see /work/shared/FINDINGS.md. So
:func:`time_steps` runs a step many times back to back, blocks once at the
end, and divides: as long as the device work of one call takes longer than
its dispatch, the device never waits for the host and the figure is device
time. The median of a few such repeats is reported.

:func:`layer_update` is the one program every FORGE-update benchmark times
(``bench_lowp``, ``bench_fused_dw --auto-table``): a layer's
``fused_linear_update`` as ``forge_jax.Dense``'s backward runs it in a model
step, :data:`LAYER_CALLS` of them per dispatch at every size, each consuming
the previous one's weight and state. Two harnesses that built their own
programs once disagreed threefold on the same case: chained calls without the
Dense backward's barrier let XLA fuse one call's update into the next (the
intermediate weight and int8 codes never written, their arithmetic recomputed),
which no model step does, where every layer's update is written.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import re
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Timing:
  """Per-call milliseconds of one timed step."""

  median_ms: float
  min_ms: float
  repeats_ms: tuple[float, ...]
  iters: int


def time_steps(
    step: Callable[[Any], Any],
    carry: Any,
    *,
    warmup: int = 3,
    iters: Optional[int] = 30,
    repeats: int = 3,
    target_repeat_ms: float = 20.0,
    max_iters: int = 30,
) -> tuple[Timing, Any]:
  """Times ``carry = step(carry)`` run back to back; returns (timing, carry).

  The carry threads each call's output into the next call, so a step that
  donates its state (an optimizer step) can run any number of times. With
  ``iters=None`` the count per repeat is picked from the warm-up so that one
  repeat lasts about ``target_repeat_ms`` (between 3 and ``max_iters`` calls).
  ``warmup=0`` (with ``iters`` given) times the first call with its compile: the smoke runs under
  an interpreter, whose times mean nothing and whose every call costs seconds.
  """
  if warmup < 0 or (warmup == 0 and iters is None):
    raise ValueError(f"warmup={warmup}: needs warmup >= 1 to pick iters, else >= 0")
  start = time.perf_counter()
  for _ in range(warmup):
    carry = step(carry)
  jax.block_until_ready(carry)
  if iters is None:
    per_call_ms = (time.perf_counter() - start) * 1e3 / warmup
    iters = int(min(max_iters, max(3, math.ceil(target_repeat_ms / max(per_call_ms, 1e-3)))))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      carry = step(carry)
    jax.block_until_ready(carry)
    per_call.append((time.perf_counter() - start) * 1e3 / iters)
  timing = Timing(
      median_ms=statistics.median(per_call),
      min_ms=min(per_call),
      repeats_ms=tuple(per_call),
      iters=iters,
  )
  return timing, carry


# Layer updates per dispatch, at every size: enough that the device work of the
# smallest preset layer (a few tens of us) outlasts the host's dispatch (0.1 to
# 0.2 ms on the H200), without per-size variants of the program.
LAYER_CALLS = 16
# The stochastic-rounding stream of the timed layer (forge_jax.Dense passes a
# hash of its module path; any fixed value times the same work).
LAYER_STREAM = 1


@dataclasses.dataclass(frozen=True)
class LayerUpdate:
  """A jitted ``run(carry) -> carry``: ``calls`` updates of one layer in one dispatch.

  ``carry = (w, state, grad_sq_norm_sum, x, dy)``, all donated: the weight and
  state are updated in place (as a model step's donated train state), and x/dy
  ride along so that the loop neither copies them in nor can hoist the GEMM out
  of it. With ``state_sets > 1`` the carry's state is a tuple of that many
  states, call ``j`` updating set ``j % state_sets``; with ``with_dx`` the carry
  ends with the dX buffer each call writes. Make it with :meth:`init`;
  :meth:`result` gives ``(w, decoded slots)`` (of the first set).
  """

  run: Callable[[Any], Any]
  optimizer: Any
  w_dtype: Any
  calls: int
  state_sets: int = 1
  with_dx: bool = False

  def init(self, x, dy, w0):
    from forge_jax import _lowp  # pylint: disable=g-import-not-at-top

    w = jnp.array(w0, self.w_dtype)  # copies: run donates them
    # int8 codes travel as their float view, as forge_jax.train_step hands them to a layer.
    state = _lowp.to_float_view(self.optimizer.init(w))
    if self.state_sets > 1:
      state = tuple(jax.tree.map(jnp.copy, state) for _ in range(self.state_sets))
    dx = (jnp.zeros_like(x),) if self.with_dx else ()
    return (w, state, jnp.zeros((), jnp.float32), jnp.copy(x), jnp.copy(dy)) + dx

  def carry_shapes(self, t: int, k: int, n: int):
    """The carry's shapes and dtypes (lower and compile without device work)."""
    x = jax.ShapeDtypeStruct((t, k), jnp.bfloat16)
    dy = jax.ShapeDtypeStruct((t, n), jnp.bfloat16)
    return jax.eval_shape(self.init, x, dy, jax.ShapeDtypeStruct((k, n), self.w_dtype))

  def result(self, carry):
    from forge_jax import _lowp  # pylint: disable=g-import-not-at-top

    w, state = carry[:2]
    if self.state_sets > 1:
      state = state[0]
    slots = _lowp.from_float_view(tuple(self.optimizer.rule.slots_of(state)))
    return w, tuple(_lowp.decode_slot(s, jnp.float32) for s in slots)


def state_sets_for(state_bytes: int, calls: int = LAYER_CALLS, cold_bytes: float = 256e6) -> int:
  """How many state sets :func:`layer_update` cycles through so that a set is evicted from the
  L2 cache (50 MB on an H100 or H200) before its next call: the smallest power of two whose sets
  hold ``cold_bytes``, at most ``calls``."""
  sets = 1
  while sets < calls and sets * state_bytes < cold_bytes:
    sets *= 2
  return sets


def layer_update(optimizer, backend: str, w_dtype, *, calls: int = LAYER_CALLS,
                 config: Any = None, grad_norm: bool = True, applied: bool = False,
                 state_sets: int = 1, with_dx: bool = False) -> LayerUpdate:
  """What a model step runs per FORGE layer, ``calls`` times per dispatch.

  Each call is ``forge_jax.Dense``'s backward update: ``fused_linear_update``
  with the grad norm returned (the train step consumes it), then the same
  ``optimization_barrier`` over its outputs, so that no fusion reaches from one
  call into the next and every call writes its weight and state. The calls run
  in a ``fori_loop`` (a static trip count: no host round trip per iteration),
  like a scanned model's layers; the same program at every size and backend.
  ``grad_norm=False`` leaves the norm out (its cost, side by side); ``applied`` passes
  ``apply=True`` as a value the kernel reads (train_step's flag for a non-finite loss).

  ``state_sets > 1`` (a divisor of ``calls``) cycles the calls through that many optimizer
  states, so that a layer whose state fits the L2 cache does not find it there from the call
  before, as in a model step, where the other layers' work evicts it (:func:`state_sets_for`).
  The weight, ``x`` and ``dy`` stay shared: in a step, the dX product has just read them.

  ``with_dx``: each call is the whole backward of the layer, the dX product ``dy @ W.T`` with the
  old weight, then the update ordered after it (``Dense``'s ``after=dx``); dX is written to a
  carry buffer. A model step runs the update between GEMMs, not back to back with the next
  layer's update; :func:`dx_product` times the product alone.
  """
  import forge_jax  # pylint: disable=g-import-not-at-top

  if calls < 1:
    raise ValueError(f"calls={calls} must be >= 1 (layer updates per dispatch)")
  if state_sets < 1 or calls % state_sets:
    raise ValueError(f"state_sets={state_sets} must be a divisor of calls={calls}")

  def update(i, w, state, sq_sum, x, dy, *dx):  # dx: () or the dX buffer, overwritten
    # A traced flag (true at every call), as train_step's isfinite(loss): not folded away.
    flag = {"apply": i >= 0} if applied else {}
    if with_dx:
      dx = (_dx(w, dy, x.dtype),)
      flag["after"] = dx[0]  # the update reads the old weight after the product, as Dense's
    if backend in ("mosaic", "mosaic_interpret"):
      _check_mosaic(optimizer, backend, x, dy, w, state, config)
    out = forge_jax.fused_linear_update(
        x, dy, w, state, optimizer, backend, config=config, return_grad_sq_norm=grad_norm,
        stream=LAYER_STREAM, **flag)
    new_w, new_state, sq = out if grad_norm else (*out, jnp.zeros((), jnp.float32))
    return jax.lax.optimization_barrier((new_w, new_state, sq_sum + sq, x, dy, *dx))

  def layer(i, carry):
    return update(i, *carry)

  def cycle(i, carry):  # one call per state set
    w, states, sq_sum, x, dy, *dx = carry
    states = list(states)
    for j in range(state_sets):
      w, states[j], sq_sum, x, dy, *dx = update(i, w, states[j], sq_sum, x, dy, *dx)
    return (w, tuple(states), sq_sum, x, dy, *dx)

  if state_sets == 1:
    loop = lambda carry: jax.lax.fori_loop(0, calls, layer, carry)
  else:
    loop = lambda carry: jax.lax.fori_loop(0, calls // state_sets, cycle, carry)
  run = jax.jit(loop, donate_argnums=(0,))
  return LayerUpdate(run, optimizer, w_dtype, calls, state_sets, with_dx)


def _dx(w, dy, dtype):
  """``Dense``'s dX product with the weight: ``dy @ w.T`` in the compute dtype."""
  return jax.lax.dot_general(dy, w.astype(dtype), (((1,), (1,)), ((), ()))).astype(dtype)


def dx_product(w_dtype, calls: int = LAYER_CALLS):
  """The dX product of :func:`layer_update` ``(with_dx=True)`` alone, ``calls`` per dispatch:
  ``(init(x, dy, w0), update)``, ``update.run`` over ``carry = (w, dx, dy)`` (its ``init`` and
  ``result`` unused), timed by :func:`time_layer_update`."""
  def layer(_, carry):
    w, dx, dy = carry
    return jax.lax.optimization_barrier((w, _dx(w, dy, dx.dtype), dy))

  run = jax.jit(lambda carry: jax.lax.fori_loop(0, calls, layer, carry), donate_argnums=(0,))
  init = lambda x, dy, w0: (jnp.array(w0, w_dtype), jnp.zeros_like(x), jnp.copy(dy))
  return init, LayerUpdate(run, None, w_dtype, calls)


def _check_mosaic(optimizer, backend, x, dy, w, state, config) -> None:
  """Refuses a case the Mosaic kernel cannot take: fused_linear_update would run (and this would
  time) its fallback under the kernel's name."""
  from forge_jax import _fused, _lowp  # pylint: disable=g-import-not-at-top

  slots = tuple(_lowp.from_float_view(s) for s in optimizer.rule.slots_of(state))
  why = _fused._mosaic_problem(x, dy, w, slots, config, True)[0]
  if why is not None:
    raise ValueError(f"backend={backend!r} cannot run this layer ({why}): it would time the "
                     "fallback; leave this case out or time another backend")


def time_layer_update(update: LayerUpdate, carry: Any, **timing) -> tuple[Timing, Any]:
  """:func:`time_steps` of ``update.run``, per layer update (ms divided by ``update.calls``)."""
  t, carry = time_steps(update.run, carry, **timing)
  per = update.calls
  return Timing(t.median_ms / per, t.min_ms / per, tuple(r / per for r in t.repeats_ms), t.iters), carry


_NOT_KERNELS = ("XLA Modules", "XLA Ops", "Steps", "Source code", "Launch Stats", "TensorFlow Ops",
                "Framework Ops", "XLA TraceMe")  # derived lines of a device plane: not kernels


_GEMM_KERNELS = ("nvjet", "cutlass", "xmma", "gemm", "sm90_", "cublas")


def _kernel_kind(name: str) -> str:
  """A kernel's kind, for totals: ``gemm`` (cuBLAS/CUTLASS library kernels and XLA's Triton GEMM
  fusions), ``copy`` (memcpy and XLA copy kernels), else the kernel's name without its numbers
  (``loop_fusion_12`` -> ``loop_fusion``, ``input_reduce_fusion`` ...)."""
  low = name.lower()
  if any(k in low for k in _GEMM_KERNELS):
    return "gemm"
  if "memcpy" in low or "memset" in low or re.match(r"(wrapped_)?copy", low):
    return "copy" if "memset" not in low else "memset"
  return re.sub(r"(_?\d+)+$", "", re.split(r"[.(<]", name, maxsplit=1)[0]) or name


GAP_BUCKETS_US = (10.0, 100.0)  # idle gaps by length: < 10 us (launch to launch), < 100 us, longer


def busy_and_gaps(intervals: list[tuple[int, int]]) -> dict[str, Any]:
  """The union of ``(start_ns, end_ns)`` kernel intervals (one device, all its streams): ``busy_ms``
  (time with at least one kernel running), ``span_ms`` (first start to last end), and the idle gaps
  between busy stretches, ``gaps`` ({bucket: [count, ms]}, buckets by :data:`GAP_BUCKETS_US`)."""
  names = [f"<{GAP_BUCKETS_US[0]:g}us"] + [f"{a:g}-{b:g}us" for a, b in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:])]
  names.append(f">={GAP_BUCKETS_US[-1]:g}us")
  gaps = {name: [0, 0.0] for name in names}
  if not intervals:
    return {"busy_ms": 0.0, "span_ms": 0.0, "gaps": gaps}
  busy, end = 0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      if end is not None:
        gap_us = (start - end) / 1e3
        name = names[sum(gap_us >= b for b in GAP_BUCKETS_US)]
        gaps[name][0] += 1
        gaps[name][1] += gap_us / 1e3
      busy += stop - start
      end = stop
    elif stop > end:
      busy += stop - end
      end = stop
  span = max(e for _, e in intervals) - min(s for s, _ in intervals)
  return {"busy_ms": busy / 1e6, "span_ms": span / 1e6, "gaps": gaps}


def profiled(run: Callable[[], Any]) -> tuple[Any, Any]:
  """``(run(), data)``: ``run()`` under ``jax.profiler.trace``, and the trace read back as a
  ``jax.profiler.ProfileData`` (None if no trace was written)."""
  import tempfile
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      result = run()
    paths = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))
    return result, (ProfileData.from_file(str(paths[-1])) if paths else None)


def device_profile(run: Callable[[], Any], calls: int, *, top: int = 40) -> dict[str, Any]:
  """Where the device time of ``calls`` calls goes: ``run()`` (which runs them and blocks) under
  ``jax.profiler.trace``, read back with ``jax.profiler.ProfileData``.

  Returns ``{"calls", "device_ms" (per call, kernels of every GPU stream summed), "by_kind"
  ({kind: ms per call}: :func:`_kernel_kind`), "top" ([{"kernel", "ops", "ms", "count"}] per
  call, longest first), "launches" (kernels per call), "busy_ms" / "idle_ms" (per call: time
  with a kernel running on the device, and the rest of the kernels' span) and "gaps" (the idle
  time per call by gap length, :func:`busy_and_gaps`)}``, grouped by kernel name (XLA runs most of a step inside command
  buffers, so the profiler's ``hlo_op`` of a kernel is often its command buffer; ``ops`` lists up
  to four). Empty totals on a backend without device planes (CPU).
  """
  _, data = profiled(run)
  if data is None:
    return {"calls": calls, "device_ms": float("nan"), "by_kind": {}, "top": [],
            "error": "no trace written"}
  kernels: dict[str, list] = {}  # kernel name -> [ms, count, the HLO ops it ran for, durations]
  timeline = {"busy_ms": 0.0, "span_ms": 0.0, "gaps": {}}
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    intervals = []
    for line in plane.lines:
      if line.name in _NOT_KERNELS:
        continue
      for event in line.events:
        intervals.append((event.start_ns, event.end_ns))
        entry = kernels.setdefault(event.name, [0.0, 0, set(), []])
        entry[0] += event.duration_ns / 1e6
        entry[1] += 1
        entry[3].append(event.duration_ns / 1e3)
        op = dict(event.stats).get("hlo_op")
        if op and len(entry[2]) < 4:
          entry[2].add(str(op))
    if intervals:  # the busiest device (one per process here)
      timeline = max(timeline, busy_and_gaps(intervals), key=lambda t: t["busy_ms"])
  by_kind: dict[str, float] = {}
  for name, (ms, _, _, _) in kernels.items():
    by_kind[_kernel_kind(name)] = by_kind.get(_kernel_kind(name), 0.0) + ms / calls
  rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
  return {"calls": calls, "device_ms": sum(v[0] for v in kernels.values()) / calls,
          "launches": sum(v[1] for v in kernels.values()) / calls,
          "busy_ms": timeline["busy_ms"] / calls,
          "idle_ms": (timeline["span_ms"] - timeline["busy_ms"]) / calls,
          "gaps": {k: [n / calls, ms / calls] for k, (n, ms) in timeline["gaps"].items()},
          "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
          "top": [{"kernel": name[:160], "ops": sorted(ops), "ms": ms / calls, "count": n / calls,
                   "durations": duration_classes(us, calls)}
                  for name, (ms, n, ops, us) in rows]}


def duration_classes(durations_us, calls: int, *, width: float = 0.08, top: int = 6) -> list:
  """A kernel's launches grouped by duration: ``[[median us, launches per call], ...]`` for the
  ``top`` groups with the most time, longest first. Sorted durations start a new group where one
  exceeds its group's first by more than ``width`` (relative): one kernel run on several shapes
  (a GEMM on each product of a layer) shows one group per shape."""
  groups: list[list[float]] = []
  for d in sorted(durations_us):
    if groups and d <= groups[-1][0] * (1 + width):
      groups[-1].append(d)
    else:
      groups.append([d])
  groups.sort(key=lambda g: -sum(g))
  return sorted(([round(g[len(g) // 2], 1), len(g) / calls] for g in groups[:top]),
                key=lambda c: -c[0])


def out_dir(path: Optional[str]) -> pathlib.Path:
  """The results folder: ``--out``, else ``$OUT``, else ``./runs``; created."""
  folder = pathlib.Path(path or os.environ.get("OUT") or "runs")
  folder.mkdir(parents=True, exist_ok=True)
  return folder


def run_info(module: str, argv: Sequence[str]) -> dict[str, Any]:
  """Command, date, device and versions, to store beside every number."""
  import jaxlib  # pylint: disable=g-import-not-at-top

  try:
    import triton  # pylint: disable=g-import-not-at-top

    triton_version = triton.__version__
  except Exception:  # not installed (CPU machines)
    triton_version = None
  device = jax.devices()[0]
  return {
      "command": " ".join(["python", "-m", module, *map(shlex.quote, argv)]),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device": getattr(device, "device_kind", str(device)),
      "platform": device.platform,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "triton": triton_version,
      "python": platform.python_version(),
      "host": platform.node(),
      "auto_table": auto_table_used(getattr(device, "device_kind", "")) if device.platform == "gpu" else None,
  }


def auto_table_used(device_kind: str) -> str:
  """Which measured table ``backend="auto"`` reads on this GPU, and where it comes from."""
  from forge_jax import _auto  # pylint: disable=g-import-not-at-top

  path = _auto.table_path(device_kind)
  try:
    prov = _auto.read_table(path).provenance
  except ValueError as e:
    return f"{path} (unreadable: {e})"
  return f"{path.name} ({prov.get('device')}, {str(prov.get('date'))[:10]}, commit {str(prov.get('commit'))[:7]})"


def write_json(path: pathlib.Path, payload: Any) -> None:
  """Writes ``payload`` atomically (a killed run never leaves half a file)."""
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  tmp.replace(path)


def run_shapes(
    path: pathlib.Path,
    info: dict,
    tokens: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    bench: Callable[[int, int, int], list],
    error_row: dict,
) -> list[dict]:
  """``bench(t, k, n)`` for every T x (K, N); returns all rows.

  A shape that fails (e.g. out of memory making its inputs) becomes one
  ``error_row`` with its shape and error. ``{"info", "rows"}`` is rewritten
  to ``path`` after every shape, so a run cut short keeps what it measured,
  and once more at the end with ``elapsed_s``.
  """
  rows: list[dict] = []
  payload = {"info": info, "rows": rows}
  start = time.perf_counter()
  for t in tokens:
    for k, n in shapes:
      try:
        rows += bench(t, k, n)
      except Exception as e:  # pylint: disable=broad-except  (recorded, the next shape runs)
        rows.append({**error_row, "shape": f"{t}x{k}x{n}", "status": "error", "error": short_error(e)})
      gc.collect()
      write_json(path, payload)
  payload["elapsed_s"] = time.perf_counter() - start
  write_json(path, payload)
  return rows


def write_table(path: pathlib.Path, table: str, json_path: pathlib.Path) -> None:
  """Writes a run's markdown table and logs it."""
  path.write_text(table)
  log("\n" + table)
  log(f"wrote {json_path} and {path}")


def short_error(exc: BaseException, limit: int = 600) -> str:
  """A one-line description of a failed config, for the results file."""
  text = " ".join(f"{type(exc).__name__}: {exc}".split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def log(*args: Any) -> None:
  print(*args, flush=True, file=sys.stdout)


def check_tree(tree: pathlib.Path) -> pathlib.Path:
  """``tree`` resolved, or a ValueError if it is not a checkout of this repository."""
  tree = tree.resolve()
  if not (tree / "pallas_kernels").is_dir():
    raise ValueError(f"--baseline-tree {tree} has no pallas_kernels/: pass a checkout of this "
                     "repository (e.g. git archive COMMIT | tar -x -C DIR)")
  return tree


def drop_options(argv: Sequence[str], names: dict) -> list[str]:
  """``argv`` without the options ``names`` maps to their number of values (``None``: every
  value up to the next option), in either form, ``--name value`` or ``--name=value``: a
  script's own command line for its run on a baseline tree."""
  rest, skip = [], 0  # values still to drop; -1: up to the next option
  for a in argv:
    if a.startswith("--"):
      name, skip = a.split("=")[0], 0
      if name in names:
        skip = 0 if "=" in a else (-1 if names[name] is None else names[name])
        continue
    elif skip:
      skip -= skip > 0
      continue
    rest.append(a)
  return rest


def run_harness_on_tree(script: str, args: Sequence[str], out: pathlib.Path, tree: pathlib.Path,
                        result: str) -> dict:
  """:func:`run_on_tree` with another checkout's ``pallas_kernels`` and ``forge_jax`` under this
  tree's ``experiments`` (the harness for both): a folder holding only a link to this
  ``experiments/`` comes first on PYTHONPATH, then the tree."""
  tree, out = check_tree(tree), out.resolve()
  shim = out / "harness"
  shim.mkdir(parents=True, exist_ok=True)
  link = shim / "experiments"
  harness = pathlib.Path(__file__).resolve().parent
  if link.is_symlink() and link.resolve() != harness:  # left by a run from another checkout
    link.unlink()
  if not link.exists():
    link.symlink_to(harness, target_is_directory=True)
  return run_on_tree(script, args, out, tree, [shim, tree], result)


def run_on_tree(script: str, args: Sequence[str], out: pathlib.Path, tree: pathlib.Path,
                path: Sequence[pathlib.Path], result: str) -> dict:
  """Runs ``script`` with ``args --out out`` in a subprocess whose PYTHONPATH starts with
  ``path`` (a baseline tree's kernels), from ``tree``; returns its ``out/result`` JSON."""
  import subprocess  # pylint: disable=g-import-not-at-top
  paths = [str(p) for p in path]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, str(pathlib.Path(script).resolve()), *args, "--out", str(out)]
  log(f"baseline: {' '.join(cmd)} (PYTHONPATH={':'.join(paths)})")
  proc = subprocess.run(cmd, env=env, cwd=tree, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"the baseline run on {tree} ended with {proc.returncode}")
  return json.loads((out / result).read_text())
