"""Which 8-bit map for which AdamW state: round-trip and tracking errors, measured.

Two measurements on the states of a real (small) training run, the MLP of
``experiments/lowp_fidelity.py`` trained in float32 with AdamW:

1. **Round trip.** The final first and second moments of its three weights
   are quantized with each candidate map and block size and read back:
   relative error of the whole state (``||Q(x) - x|| / ||x||``), median and
   99th-percentile elementwise relative error, the fraction of nonzero values
   that read back as 0, and for the second moment the error of
   ``1 / sqrt(v)`` (what AdamW divides by).
2. **Tracking.** The second moment is carried through the 400 steps in each
   format, fed the float32 run's gradients (``v <- Q(b2 v + (1 - b2) g^2)``),
   and compared with the float32 ``v`` at the end: the mean and spread of
   ``log(v_q / v)``. A mean below 0 means the stored moment lags (AdamW's
   steps come out too large).

Candidates: ours (``pallas_kernels.numerics``: linear and minifloat maps,
block 64 along N, round to nearest or stochastic) and, for reference, a
dynamic-tree map in the style of bitsandbytes' and torchao's 8-bit
optimizers (signed for the first moment, unsigned for the second: 7 decades
below the block maximum, more linear steps in the upper decades), decoded by
table lookup, with their block sizes 256 and 2048 over the flattened array.

    PYTHONPATH=$PWD python -m experiments.lowp_maps        # ~30 s on a 2-core CPU
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _timing
from experiments import lowp_fidelity
from pallas_kernels import numerics as nm

F32 = jnp.float32
Q = nm.QuantMap


def dynamic_tree_map(signed: bool, decades: int = 7) -> np.ndarray:
  """A dynamic-tree code book on [-1, 1] (signed) or [0, 1]: decade ``i``
  below the maximum gets ``2**(decades-1-i)`` (x2 unsigned) linear bins on
  [0.1, 1] * 10**-i, represented by their midpoints; plus 0 and 1."""
  values = [0.0, 1.0]
  for i in range(decades):
    bins = 2 ** (decades - 1 - i) * (1 if signed else 2)
    edges = np.linspace(0.1, 1.0, bins + 1)
    mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** -i
    values += list(mids)
  values = np.array(sorted(set(values)))
  if signed:
    values = np.concatenate([-values[::-1][:-1], values])
  return values[:256]


def _lut_round_trip(x, table, block):
  """Blockwise absmax over the flattened array, nearest table entry."""
  flat = x.reshape(-1)
  pad = (-flat.size) % block
  flat = jnp.pad(flat, (0, pad)).reshape(-1, block)
  absmax = jnp.max(jnp.abs(flat), axis=1, keepdims=True)
  rel = jnp.where(absmax > 0, flat / absmax, 0.0)
  t = jnp.asarray(table, F32)
  idx = jnp.clip(jnp.searchsorted(t, rel), 1, t.size - 1)
  lo, hi = t[idx - 1], t[idx]
  q = jnp.where(jnp.abs(rel - lo) <= jnp.abs(hi - rel), lo, hi)
  return (q * absmax).reshape(-1)[: x.size].reshape(x.shape)


def _ours(qmap, block):
  """Our codec; blocks along the flattened array (= along N when N % block == 0)."""
  codec = nm.BlockQuantized(qmap, block)

  def round_trip(x, key):
    flat = x.reshape(-1, block)
    bits = jax.random.bits(key, flat.shape, jnp.uint32) if codec.needs_bits else None
    return codec.rebuild(codec.encode(flat, bits=bits)).dequantize().reshape(x.shape)

  return round_trip


def candidates(signed: bool) -> dict[str, Callable]:
  if signed:
    ours = {
        "linear, block 64 (default)": _ours(Q("linear", True), 64),
        "linear, block 64, SR": _ours(Q("linear", True, rounding="stochastic"), 64),
        "float e4m3, block 64": _ours(Q("float", True, 3), 64),
        "linear, block 256 (flattened)": _ours(Q("linear", True), 256),
    }
  else:
    ours = {
        "float e4m4, block 64, SR (default)": _ours(Q("float", False, 4, "stochastic"), 64),
        "float e4m4, block 64": _ours(Q("float", False, 4), 64),
        "float e5m3, block 64": _ours(Q("float", False, 3), 64),
        "float e5m3, block 64, SR": _ours(Q("float", False, 3, "stochastic"), 64),
        "linear, block 64, SR": _ours(Q("linear", False, rounding="stochastic"), 64),
        "linear, block 64": _ours(Q("linear", False), 64),
    }
  table = dynamic_tree_map(signed)
  for block in (256, 2048):
    ours[f"dynamic tree (bnb/torchao style), block {block}"] = (
        lambda x, key, b=block: _lut_round_trip(x, table, b))
  return ours


def train_states(setup: lowp_fidelity.Setup):
  """fp32 AdamW on the fidelity MLP: the gradients of every step and the final moments."""
  xs, ys = lowp_fidelity.make_data(setup)
  model = lowp_fidelity.MLP(setup)
  params = model.init(jax.random.PRNGKey(setup.seed), xs[0])["params"]
  tx = optax.adamw(setup.lr, weight_decay=setup.weight_decay)
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(lambda p: lowp_fidelity._mse(model.apply({"params": p}, x), y))(params)
    updates, state = tx.update(grads, state, params)
    kernels = {k: v["kernel"] for k, v in grads.items()}
    return optax.apply_updates(params, updates), state, kernels

  grads = []
  for i in range(setup.steps):
    params, state, g = step(params, state, xs[i], ys[i])
    grads.append(g)
  adam = state[0]
  kernels = lambda t: [t[k]["kernel"] for k in sorted(t)]
  return kernels(adam.mu), kernels(adam.nu), grads


def round_trip_rows(states, signed: bool) -> list[dict]:
  rows = []
  for name, fn in candidates(signed).items():
    num = den = 0.0
    rels, inv_rels, zeros, nonzero = [], [], 0, 0
    for i, x in enumerate(states):
      y = fn(x, jax.random.PRNGKey(i))
      x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
      num += ((y64 - x64) ** 2).sum()
      den += (x64**2).sum()
      nz = x64 != 0
      rels.append(np.abs(y64 - x64)[nz] / np.abs(x64[nz]))
      zeros += int(((y64 == 0) & nz).sum())
      nonzero += int(nz.sum())
      if not signed:
        pos = (x64 > 0) & (y64 > 0)
        inv_rels.append(np.abs(np.sqrt(x64[pos] / y64[pos]) - 1))
    rel = np.concatenate(rels)
    row = {"map": name, "state_rel_err": float(np.sqrt(num / den)), "median_rel": float(np.median(rel)),
           "p99_rel": float(np.quantile(rel, 0.99)), "to_zero": zeros / max(nonzero, 1)}
    if not signed:
      inv = np.concatenate(inv_rels)
      row.update(inv_sqrt_median=float(np.median(inv)), inv_sqrt_p99=float(np.quantile(inv, 0.99)))
    rows.append(row)
  return rows


def tracking_rows(grads, b2: float = 0.999) -> list[dict]:
  rows = []
  for name, fn in candidates(False).items():
    v32 = [jnp.zeros_like(g) for g in grads[0].values()]
    vq = [jnp.zeros_like(g) for g in grads[0].values()]

    @jax.jit
    def step(v32, vq, g, key):
      g = list(g.values())
      v32 = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(v32, g)]
      vq = [fn(b2 * v + (1 - b2) * gi * gi, jax.random.fold_in(key, j)) for j, (v, gi) in enumerate(zip(vq, g))]
      return v32, vq

    for t, g in enumerate(grads):
      v32, vq = step(v32, vq, g, jax.random.PRNGKey(t))
    logs = []
    for a, b in zip(vq, v32):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      ok = (a > 0) & (b > 0)
      logs.append(np.log(a[ok] / b[ok]))
    logs = np.concatenate(logs)
    rows.append({"map": name, "mean_log_ratio": float(logs.mean()), "std_log_ratio": float(logs.std()),
                 "steps": len(grads)})
  return rows


def markdown(info, signed_rows, unsigned_rows, tracking) -> str:
  out = [f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}; "
         f"states of the lowp_fidelity MLP after {info['setup']['steps']} fp32 AdamW steps "
         f"(lr {info['setup']['lr']}).", "",
         "First moment (signed):", "",
         "| map | state rel. error | median elem. rel. error | p99 elem. rel. error | nonzero -> 0 |",
         "|---|---|---|---|---|"]
  for r in signed_rows:
    out.append(f"| {r['map']} | {r['state_rel_err']:.2e} | {r['median_rel']:.2e} | {r['p99_rel']:.2e} | "
               f"{100 * r['to_zero']:.2f}% |")
  out += ["", "Second moment (non-negative); `1/sqrt(v)` is what AdamW divides by:", "",
          "| map | state rel. error | median elem. rel. error | p99 elem. rel. error | nonzero -> 0 | "
          "median 1/sqrt(v) error | p99 1/sqrt(v) error |",
          "|---|---|---|---|---|---|---|"]
  for r in unsigned_rows:
    out.append(f"| {r['map']} | {r['state_rel_err']:.2e} | {r['median_rel']:.2e} | {r['p99_rel']:.2e} | "
               f"{100 * r['to_zero']:.2f}% | {r['inv_sqrt_median']:.2e} | {r['inv_sqrt_p99']:.2e} |")
  out += ["", "Second moment carried in 8 bits through the run (same gradients), against float32 at the end:", "",
          "| map | mean log(v_q / v) | std log(v_q / v) |", "|---|---|---|"]
  for r in tracking:
    out.append(f"| {r['map']} | {r['mean_log_ratio']:+.3f} | {r['std_log_ratio']:.3f} |")
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--lr", type=float, default=1e-4)
  args = parser.parse_args(argv)
  setup = lowp_fidelity.Setup(steps=args.steps, lr=args.lr)
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.lowp_maps", argv)
  info["setup"] = {"steps": setup.steps, "lr": setup.lr}
  mu, nu, grads = train_states(setup)
  signed_rows, unsigned_rows = round_trip_rows(mu, True), round_trip_rows(nu, False)
  tracking = tracking_rows(grads)
  _timing.write_json(folder / "lowp_maps.json", {"info": info, "first_moment": signed_rows,
                                                 "second_moment": unsigned_rows, "tracking": tracking})
  table = markdown(info, signed_rows, unsigned_rows, tracking)
  (folder / "lowp_maps.md").write_text(table)
  _timing.log(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
