"""The largest batch whose compiled train step fits an allocator limit, from XLA's plans alone.

With the allocator's pool preallocated (jax's default), every capacity run on the H200 peaked at
exactly XLA's plan for its step (arguments + outputs - aliased + temporaries:
``experiments/results/h200/capacity_prealloc``), so the plan decides what fits, and a plan needs
only a compile (no allocation, no step). Per implementation this compiles the step at the
``--probes`` batches, fits the plan as a line in the batch (a step's temporaries grow linearly
with it: FORGE's Llama-3.1-8B step by 0.748 GiB per 1024-token sequence from 32 to 64), predicts
the edge, and then compiles batches around the prediction until it has the largest batch whose
plan fits and the next one (``--multiple`` apart) that does not. A run at the edge
(``bench_models --preallocate``) confirms it on the device.

    python -m experiments.capacity_plan --model llama-3.1-8b --impls optax_clip,forge \\
        --tokens 1024 --probes 32,64 --out $OUT/capacity_plan        # limit: the device's

``--limit-gib`` sets the limit (default: the allocator's ``bytes_limit`` on this device, which
``XLA_PYTHON_CLIENT_MEM_FRACTION`` sets; a CPU reports none, so give it there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import jax

from experiments import memory_analysis


def find_edge(plan, limit_gib: float, probes, multiple: int = 1, max_compiles: int = 12,
              on_compile=None) -> dict:
  """The largest batch (a multiple of ``multiple``) with ``plan(batch) <= limit_gib``.

  ``plan(batch) -> GiB`` compiles, or returns ``None`` when the compile failed: that says nothing
  about fitting (on the GPU a compile fails when the autotuner cannot allocate its operands, for
  example beside other processes), so the search stops there with ``error``. The probes' plans
  give a line and a predicted edge; then it compiles the prediction and its neighbour, galloping
  up or bisecting down where the line was wrong, until a batch that fits and the next multiple
  that does not are both compiled. Returns the plans in compile order, the line, the prediction
  and ``edge`` (``None`` if not even ``multiple`` fits, with ``error`` if the compiles ran out).
  ``on_compile(result_so_far)`` is called after every compile."""
  plans, order = {}, []

  def fits(batch):
    if batch not in plans:
      if len(plans) >= max_compiles:
        raise _OutOfCompiles
      plans[batch] = plan(batch)
      order.append(batch)
      if on_compile is not None:
        on_compile(out)
      if plans[batch] is None:
        raise _CompileFailed(batch)
    return plans[batch] <= limit_gib

  out = {"limit_gib": limit_gib, "multiple": multiple, "plans": plans, "order": order, "edge": None}
  align = lambda b: max(multiple, b // multiple * multiple)
  try:
    for b in probes:
      fits(b)
    guess = min(probes)
    if len(plans) >= 2:
      intercept, slope = memory_analysis.fit_line(plans)
      out.update(intercept_gib=intercept, slope_gib=slope)
      if slope > 0:
        guess = math.floor((limit_gib - intercept) / slope)
    out["predicted"] = guess = align(guess)
    ok = [b for b in plans if b % multiple == 0 and fits(b)]
    bad = [b for b in plans if b % multiple == 0 and not fits(b)]
    lo, hi = max(ok, default=0), min(bad, default=None)
    if (hi is None or guess < hi) and guess > lo:
      if fits(guess):
        lo = guess
      else:
        hi = guess
    step = multiple
    while hi is None:  # gallop up from the largest batch that fits
      if fits(lo + step):
        lo += step
        step *= 2
      else:
        hi = lo + step
    while hi - lo > multiple:  # bisect on multiples
      mid = align((lo + hi) // 2)
      mid = mid if lo < mid < hi else lo + multiple
      if fits(mid):
        lo = mid
      else:
        hi = mid
    if lo >= multiple:
      out["edge"] = lo
  except _OutOfCompiles:
    out["error"] = f"no edge within {max_compiles} compiles"
  except _CompileFailed as e:
    out["error"] = f"the compile at batch {e.args[0]} failed, so the edge is unknown (see the log)"
  return out


class _OutOfCompiles(Exception):
  pass


class _CompileFailed(Exception):
  pass


def device_limit_gib() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return None if limit is None else limit / 2**30


def markdown(results, meta) -> str:
  lines = ["# Capacity from XLA's plans (compile-only)", "",
           f"`{meta['command']}`; {meta['date']}; {meta['device']}; jax {meta['jax']}.", "",
           f"Model {meta['model']}, {meta['tokens']}-token sequences, {meta['dtype']}, loss "
           f"{meta['loss']}; limit {meta['limit_gib']:.2f} GiB ({meta['limit_source']}). `plan`: the "
           "step's arguments + outputs - aliased + temporaries, which preallocated runs on the H200 "
           "peaked at. `edge`: the largest batch whose plan fits, with the next one compiled and "
           "over the limit. `GiB per sequence` and `fixed GiB`: the least-squares line through the "
           "probes' plans, from which the search starts; a fixed part below 0 means the plans jump "
           "between the probes rather than lie on a line.", "",
           "| impl | edge | plan at edge GiB | next batch: plan GiB | GiB per sequence | fixed GiB | compiles |",
           "|---|---|---|---|---|---|---|"]
  fmt = lambda x: "" if x is None or x != x else (f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}")
  fixed = lambda x: f"{fmt(x)} (a jump, not a line)" if x is not None and x < 0 else fmt(x)
  for r in results:
    edge, plans = r.get("edge"), r["plans"]
    nxt = None if edge is None else edge + r["multiple"]
    lines.append(f"| {r['impl']} | {edge if edge is not None else r.get('error', 'none fits')} | "
                 f"{fmt(plans.get(edge))} | {'' if nxt is None else f'{nxt}: '}{fmt(plans.get(nxt))} | "
                 f"{fmt(r.get('slope_gib'))} | {fixed(r.get('intercept_gib'))} | {len(plans)} |")
  for r in results:
    lines += ["", f"{r['impl']}: " + ", ".join(
        f"{b} -> {fmt(r['plans'][b]) or 'failed'}" for b in r["order"])]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="llama-3.1-8b")
  parser.add_argument("--impls", default="optax_clip,forge")
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--loss", default="lean")
  parser.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
  parser.add_argument("--probes", default="32,64", help="batches to fit the line through")
  parser.add_argument("--multiple", type=int, default=1, help="search batches in steps of this")
  parser.add_argument("--limit-gib", type=float, default=None,
                      help="the allocator's limit (default: this device's bytes_limit)")
  parser.add_argument("--max-compiles", type=int, default=12, help="per implementation")
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  probes = [int(b) for b in args.probes.split(",")]
  if len(probes) < 2 or min(probes) < 1 or args.multiple < 1:
    parser.error(f"--probes needs two or more positive batches (got {args.probes}) and "
                 f"--multiple a positive step (got {args.multiple})")
  limit, source = args.limit_gib, "--limit-gib"
  if limit is None:
    limit, source = device_limit_gib(), "the device's bytes_limit"
    if limit is None:
      parser.error("this device reports no memory limit: give --limit-gib")
  os.makedirs(args.out, exist_ok=True)
  meta = {"command": "python -m experiments.capacity_plan " + " ".join(argv),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "model": args.model,
          "tokens": args.tokens, "dtype": args.dtype, "loss": args.loss, "layers": args.layers,
          "limit_gib": limit, "limit_source": source}
  results = []

  def save(rows):
    with open(os.path.join(args.out, "capacity_plan.json"), "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "capacity_plan.md"), "w") as f:
      f.write(markdown(rows, meta))

  for impl in args.impls.split(","):
    def plan(batch, impl=impl):
      try:
        row = memory_analysis.analyse(args.model, impl, batch, args.tokens, args.dtype,
                                      loss=args.loss, layers=args.layers, with_init=False)
      except Exception as e:  # reported; find_edge stops: a failed compile is not "too large"
        print(f"{impl} at batch {batch}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
      print(f"{impl} at batch {batch}: plan {row['step']['step_gib']:.2f} GiB", flush=True)
      return row["step"]["step_gib"]

    # Saved after every compile, so a run cut short (a device call's time limit) keeps its plans.
    cut_short = lambda out, impl=impl: save(
        results + [{"impl": impl, **out, "error": "cut short: the search did not finish"}])
    result = {"impl": impl, **find_edge(plan, limit, probes, args.multiple, args.max_compiles,
                                        on_compile=cut_short)}
    result["plans"] = dict(result["plans"])
    results.append(result)
    save(results)
  print(markdown(results, meta))
  return results


if __name__ == "__main__":
  main()
