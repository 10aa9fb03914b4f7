"""The update of a parameter whose gradient is in memory (an embedding): XLA against one kernel pass.

On the GPU, from the repository root (Llama-3.1-8B's embedding, 128256 x 4096, bf16 gradient):

    PYTHONPATH=$PWD python -m experiments.bench_update --out $OUT

On a CPU (seconds, Pallas interpret mode, a tiny shape):

    PYTHONPATH=$PWD python -m experiments.bench_update --smoke --out /tmp/bench_update

For each storage configuration (``bench_lowp``'s: weight dtype and :class:`forge_jax.Precision`)
it times one AdamW update of a ``--shape`` parameter from a bfloat16 gradient, the weight and
state donated, one update per dispatch, many dispatches back to back (experiments/_timing.py):

* ``xla``: the optax form ``forge_jax.train_step`` applies to the parameters FORGE does not
  manage, ``optimizer.update`` and ``optax.apply_updates`` in one jit. With int8 states XLA makes
  two passes over the matrix (the blocks' maxima, then the codes, each running the rule again);
* ``kernel``: :func:`pallas_kernels.fused_dw.fused_update`, the Triton kernel's epilogue on
  the gradient read from memory, one pass, in place; once per ``--tiles`` entry.

Before timing, every kernel row is compared with the ``xla`` row after one update from the same
state: the number of weight elements and int8 codes (or float state elements) that differ, and
the largest scale difference. Writes ``bench_update.json`` and ``bench_update.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from experiments import _timing
from experiments import bench_lowp
import forge_jax
from forge_jax import _fused
from pallas_kernels import fused_dw
from pallas_kernels import numerics

DEFAULT_CONFIGS = ("bf16_rtn_bf16", "bf16_sr_bf16", "bf16_rtn_int8", "bf16_sr_int8")
DEFAULT_TILES = ("128x64w4", "64x64w2", "256x64w4", "64x128w4", "128x128w8")
STREAM = 0  # which leaf of the optax form's tree: its rounding stream


def parse_tile(text: str) -> fused_dw.TileConfig:
  """``'128x64w4'``: block_k x block_n, num_warps."""
  kn, warps = text.split("w")
  k, n = (int(v) for v in kn.split("x"))
  return fused_dw.UPDATE_TILE.replace(block_k=k, block_n=n, num_warps=int(warps))


def xla_update(opt):
  """One optax-form update, as ``forge_jax.train_step`` applies it to a non-FORGE parameter."""
  def run(carry):
    w, state, g = carry
    u, state = opt.update({"w": g}, state, {"w": w})
    return optax.apply_updates({"w": w}, u)["w"], state, g
  return jax.jit(run, donate_argnums=0)


def kernel_update(opt, precision, tile, interpret: bool):
  """The same update through :func:`fused_update`, the state in the optax form's layout."""
  rule = opt.rule
  update_fn = _fused._update_fn(rule, True, precision)  # pylint: disable=protected-access

  def run(carry):
    w, state, g = carry
    slots = tuple(s["w"] for s in rule.slots_of(state))
    new_w, new_slots = fused_dw.fused_update(
        g, w, slots, rule.scalars(state.count), update_fn, config=tile, interpret=interpret,
        weight_codec=forge_jax._lowp.weight_codec(precision, w.dtype),  # pylint: disable=protected-access
        seed=numerics.stream_seed(precision.seed, STREAM), step=state.count)
    fields = [state.count + 1] + [{"w": s} for s in new_slots]
    return new_w, rule.state_cls(*fields), g
  return jax.jit(run, donate_argnums=0)


def _differences(a, b) -> dict:
  """Elements of the new weight and of each stored slot part that differ between two results."""
  (wa, sa, _), (wb, sb, _) = a, b
  out = {"weight": int(jnp.sum(wa != wb))}
  for i, (x, y) in enumerate(zip(jax.tree.leaves(sa), jax.tree.leaves(sb))):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.shape != wa.shape:  # int8 scales
      out[f"state{i}_max_abs"] = float(jnp.max(jnp.abs(x - y))) if x.size else 0.0
    else:
      out[f"state{i}"] = int(jnp.sum(x != y))
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--smoke", action="store_true", help="a tiny shape in interpret mode (CPU)")
  parser.add_argument("--shape", default="128256x4096", help="K x N of the parameter")
  parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                      choices=sorted(c for c in bench_lowp.CONFIGS if "_" in c))
  parser.add_argument("--tiles", nargs="+", default=DEFAULT_TILES,
                      help="kernel tiles, block_k x block_n w num_warps")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  out = _timing.out_dir(args.out)
  k, n = (256, 128) if args.smoke else (int(v) for v in args.shape.split("x"))
  tiles = [parse_tile(t) for t in (args.tiles[:1] if args.smoke else args.tiles)]
  iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
  info = _timing.run_info("experiments.bench_update", argv)
  rows = []
  g = (jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  for config in args.configs:
    w_dtype, precision = bench_lowp.CONFIGS[config]
    opt = bench_lowp._optimizer(precision)  # pylint: disable=protected-access
    w0 = (jax.random.normal(jax.random.PRNGKey(0), (k, n), jnp.float32) * 0.02).astype(w_dtype)
    fresh = lambda: (jnp.copy(w0), opt.init({"w": w0}), jnp.copy(g))  # pylint: disable=cell-var-from-loop
    programs = [("xla", None, xla_update(opt))]
    programs += [(f"kernel {t.block_k}x{t.block_n} w{t.num_warps}", t,
                  kernel_update(opt, precision, t, interpret=args.smoke)) for t in tiles]
    reference = None
    for name, tile, run in programs:
      row = {"config": config, "impl": name, "shape": f"{k}x{n}"}
      try:
        result = jax.block_until_ready(run(run(fresh())))  # two updates: the state is not trivial
        if reference is None:
          reference = result
        else:
          row["differs_from_xla"] = _differences(reference, result)
        timing, carry = _timing.time_steps(run, fresh(), warmup=2, iters=iters, repeats=repeats)
        row.update(ms=timing.median_ms, repeats_ms=list(timing.repeats_ms))
        del carry
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = _timing.short_error(e)
      rows.append(row)
      _timing.log(config, name, f"{row.get('ms', float('nan')):.3f} ms", row.get("differs_from_xla", ""),
                  row.get("error", ""))
      _timing.write_json(out / "bench_update.json", {"info": info, "rows": rows})
    reference = None
  lines = [f"# One update of a {k}x{n} parameter from a bf16 gradient ({info.get('device', '')})", "",
           f"Command: `python -m experiments.bench_update {' '.join(argv)}`  ",
           f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; "
           f"jax {jax.__version__}. Median of {repeats} repeats of {iters} updates back to back.", "",
           "| config | impl | ms | vs xla | differs from xla |", "|---|---|---|---|---|"]
  xla_ms = {r["config"]: r.get("ms") for r in rows if r["impl"] == "xla"}
  for r in rows:
    ms, base = r.get("ms"), xla_ms.get(r["config"])
    ratio = f"{ms / base:.2f}" if ms and base else ""
    lines.append(f"| {r['config']} | {r['impl']} | {'' if ms is None else f'{ms:.3f}'} | {ratio} | "
                 f"{r.get('differs_from_xla', r.get('error', ''))} |")
  (out / "bench_update.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
