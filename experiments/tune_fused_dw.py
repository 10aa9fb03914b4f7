"""Tile sweep for the Triton-lowered fused dW + update kernel (pallas_kernels/fused_dw.py).

On the GPU, from the repository root:

    PYTHONPATH=$PWD python -m experiments.tune_fused_dw --out $OUT

On a CPU (a few seconds, Pallas interpret mode, tiny shapes):

    PYTHONPATH=$PWD python -m experiments.tune_fused_dw --smoke --out /tmp/tune

For T in {1024, 4096, 16384} and (K, N) in {(4096, 4096), (4096, 14336),
(14336, 4096), (5120, 17408)}, with bf16 x/dy and fp32 w + AdamW slots, it
times configurations of (block_k, block_n, block_t, num_warps, num_stages):

1. a coarse grid on (4096, 4096) at each T (tile shapes x token steps);
2. neighbours of the three best (warps, stages, token step moved one notch);
3. the four best of 1-2 plus the FINDINGS default on the other three (K, N).

Configs that cannot fit (shared memory of the pipeline, accumulator
registers) are skipped without compiling; a config that fails to compile or
run is recorded with its error and the sweep goes on. Every config is checked
against the jnp reference before it is timed. The sweep keeps to
``--budget-s`` seconds (split evenly over the T values; what is left is
recorded as skipped), so the whole run stays within about four minutes.

Before the sweep, a self-check runs the kernel on the device on odd shapes
(partial tiles in T, K and N), stacked [L, K, N] weights, fp32 and bf16
inputs and the grad-norm output, against the reference.

Writes ``tune_fused_dw.json`` (run info, self-check, every row, the best
config per shape and per shape class, and the ``TUNED_TILES`` table to paste
into pallas_kernels/fused_dw.py) and ``tune_fused_dw.md`` (summary) to
``--out`` (default ``$OUT`` or ``./runs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax
from experiments import _timing
import pallas_kernels
from pallas_kernels import fused_dw
from pallas_kernels.fused_dw import TileConfig

TOKENS = (1024, 4096, 16384)
SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (5120, 17408))
# The tile FINDINGS measured first (128x128, 8 warps, 3 stages): always timed.
BASELINE = TileConfig(block_k=128, block_n=128, block_t=64, num_warps=8, num_stages=3)
# Relative Frobenius errors accepted before timing. The first AdamW step is
# nearly sign(g): where |g| is within float32 rounding of 0, the kernel and
# the reference may pick opposite signs (a few elements in millions), so the
# update gets a loose bound; the moments are continuous in g and get a tight
# one. A wrong tile, layer or mask gives errors of order 1.
UPDATE_TOL = 1e-2
SLOT_TOL = 1e-4
F32, BF16 = jnp.float32, jnp.bfloat16


# ----------------------------------------------------------------------------
# The search space.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepSpace:
  """Candidate values and the static limits used to prune them."""

  tiles: tuple[tuple[int, int], ...]
  block_ts: tuple[int, ...]
  warps: tuple[int, ...]
  stages: tuple[int, ...]
  default_stages: int
  smem_bytes: int  # usable shared memory per block (H200: 227 KiB)
  max_acc_regs: int  # float32 accumulator registers per thread
  top_coarse: int = 3  # configs whose neighbours are tried
  top_transfer: int = 4  # configs carried to the other (K, N)


GPU_SPACE = SweepSpace(
    tiles=((128, 128), (128, 256), (256, 128), (64, 128), (128, 64), (64, 256)),
    block_ts=(32, 64, 128),
    warps=(4, 8),
    stages=(2, 3, 4),
    default_stages=3,
    smem_bytes=227 * 1024,
    # The epilogue also holds the w and slot tiles: leave it half the file.
    max_acc_regs=128,
)
SMOKE_SPACE = SweepSpace(
    tiles=((16, 32), (32, 32)),
    block_ts=(16, 32),
    warps=(4,),
    stages=(2, 3),
    default_stages=2,
    smem_bytes=227 * 1024,
    max_acc_regs=128,
    top_coarse=1,
    top_transfer=2,
)


def infeasible(cfg: TileConfig, space: SweepSpace, in_bytes: int = 2) -> Optional[str]:
  """Why ``cfg`` cannot fit, or None. Static estimates: nothing is compiled."""
  smem = cfg.num_stages * cfg.block_t * (cfg.block_k + cfg.block_n) * in_bytes
  if smem > space.smem_bytes:
    return f"shared memory estimate {smem} B > {space.smem_bytes} B"
  regs = cfg.block_k * cfg.block_n // (32 * cfg.num_warps)
  if regs > space.max_acc_regs:
    return f"accumulator needs {regs} registers/thread > {space.max_acc_regs}"
  return None


def coarse_configs(space: SweepSpace) -> list[TileConfig]:
  """Stage 1: every tile shape x token step, with warps fitted to the tile."""
  configs = []
  for bk, bn in space.tiles:
    for bt in space.block_ts[:2]:
      warps = next((w for w in space.warps if bk * bn // (32 * w) <= space.max_acc_regs), space.warps[-1])
      configs.append(TileConfig(bk, bn, bt, warps, space.default_stages))
  return configs


def neighbours(cfg: TileConfig, space: SweepSpace) -> list[TileConfig]:
  """Stage 2: ``cfg`` with one of warps, stages or token step moved."""
  out = [cfg.replace(num_warps=w) for w in space.warps if w != cfg.num_warps]
  out += [cfg.replace(num_stages=s) for s in space.stages if s != cfg.num_stages]
  out += [cfg.replace(block_t=b) for b in space.block_ts if b != cfg.block_t]
  return out


# ----------------------------------------------------------------------------
# One problem and one measurement.
# ----------------------------------------------------------------------------


def _rel_err(a, b) -> jax.Array:
  a, b = a.astype(F32), b.astype(F32)
  return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


@jax.jit
def _errors(w, slots, w0, ref_w, ref_slots):
  return {
      "err_update": _rel_err(w.astype(F32) - w0.astype(F32), ref_w.astype(F32) - w0.astype(F32)),
      "err_slots": jnp.max(jnp.stack([_rel_err(s, r) for s, r in zip(slots, ref_slots)])),
  }


def _fused_step(carry, x, dy, *, rule, config, interpret):
  """One optimizer step of one layer; ``carry`` = (w, slots, count), donated."""
  w, slots, count = carry
  new_w, new_slots, _ = fused_dw.fused_dw_update(
      x, dy, w, slots, rule.scalars(count), rule.update, config=config, interpret=interpret
  )
  return new_w, new_slots, count + 1


class Problem:
  """Inputs of one T x K x N and the reference result of its first step."""

  def __init__(self, t: int, k: int, n: int, rule, seed: int = 0):
    self.t, self.k, self.n, self.rule = t, k, n, rule
    kx, kd, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    self.x = jax.random.normal(kx, (t, k), F32).astype(BF16)
    self.dy = jax.random.normal(kd, (t, n), F32).astype(BF16)
    self.w0 = 0.02 * jax.random.normal(kw, (k, n), F32)
    self.slots0 = rule.init_slots(self.w0)
    reference = jax.jit(
        functools.partial(pallas_kernels.fused_dw_update_reference, update_fn=rule.update)
    )
    self.ref_w, self.ref_slots, _ = reference(
        self.x, self.dy, self.w0, self.slots0, rule.scalars(jnp.int32(0))
    )
    jax.block_until_ready(self.ref_w)

  @property
  def name(self) -> str:
    return f"{self.t}x{self.k}x{self.n}"

  @property
  def flops(self) -> float:
    return 2.0 * self.t * self.k * self.n

  def fresh_carry(self):
    """Copies of the initial state: the timed step donates (consumes) them."""
    return jnp.copy(self.w0), tuple(jnp.copy(s) for s in self.slots0), jnp.int32(0)

  def errors(self, carry) -> dict[str, float]:
    w, slots, _ = carry
    errs = _errors(w, slots, self.w0, self.ref_w, self.ref_slots)
    return {k: float(v) for k, v in errs.items()}


def evaluate(problem: Problem, cfg: TileConfig, space: SweepSpace, *, interpret: bool, timing: dict) -> dict:
  """Checks, then times one config on one problem. Never raises."""
  row: dict[str, Any] = {
      "shape": problem.name, "t": problem.t, "k": problem.k, "n": problem.n,
      "config": dataclasses.asdict(cfg), "status": "ok",
  }
  reason = infeasible(cfg, space)
  if reason:
    row.update(status="skipped", error=reason)
    return row
  step = jax.jit(
      functools.partial(_fused_step, rule=problem.rule, config=cfg, interpret=interpret),
      donate_argnums=(0,),
  )
  carry = problem.fresh_carry()
  try:
    start = time.perf_counter()
    compiled = step.lower(carry, problem.x, problem.dy).compile()
    row["compile_s"] = round(time.perf_counter() - start, 3)
    carry = compiled(carry, problem.x, problem.dy)
    row.update(problem.errors(carry))
    if not (row["err_update"] <= UPDATE_TOL and row["err_slots"] <= SLOT_TOL):
      row.update(status="wrong", error=f"relative error above {UPDATE_TOL} (update) / {SLOT_TOL} (slots)")
      return row
    result, carry = _timing.time_steps(lambda c: compiled(c, problem.x, problem.dy), carry, **timing)
    row.update(
        ms=result.median_ms, min_ms=result.min_ms, repeats_ms=list(result.repeats_ms),
        iters=result.iters, tflops=problem.flops / (result.median_ms * 1e-3) / 1e12,
    )
  except Exception as e:  # one bad config must not end the sweep
    row.update(status="error", error=_timing.short_error(e))
  finally:
    del carry
  return row


# ----------------------------------------------------------------------------
# The device self-check (odd shapes, stacked weights, fp32, grad norm).
# ----------------------------------------------------------------------------


def _max_scaled_err(a, b) -> float:
  a, b = np.asarray(a.astype(F32)), np.asarray(b.astype(F32))
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def selfcheck(configs: Sequence[TileConfig], shape: tuple[int, int, int], *, interpret: bool) -> list[dict]:
  """Kernel vs reference on partial tiles, stacked layers, both input dtypes.

  SGD with momentum (linear in g) keeps the comparison tight: max |diff| /
  max |ref| must stay under 1e-4 for fp32 outputs and 2**-7 for bf16 ones;
  the layers not selected must come back bit-identical.
  """
  rule = forge_jax.sgd(learning_rate=0.05, momentum=0.9).rule
  t, k, n = shape
  rows = []
  for in_dtype in (BF16, F32):
    kx, kd, kw, km = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(kx, (t, k), F32).astype(in_dtype)
    dy = jax.random.normal(kd, (t, n), F32).astype(in_dtype)
    w = jax.random.normal(kw, (3, k, n), F32).astype(BF16)
    slots = (0.1 * jax.random.normal(km, (3, k, n), F32),)
    scalars = rule.scalars(jnp.int32(3))
    want = pallas_kernels.fused_dw_update_reference(
        x, dy, w, slots, scalars, rule.update, layer=jnp.int32(1), compute_grad_sq_norm=True
    )
    for cfg in configs:
      row = {"in_dtype": jnp.dtype(in_dtype).name, "shape": list(shape), "layers": 3,
             "config": dataclasses.asdict(cfg), "status": "ok"}
      try:
        run = jax.jit(functools.partial(
            fused_dw.fused_dw_update, update_fn=rule.update, config=cfg,
            compute_grad_sq_norm=True, interpret=interpret,
        ))
        new_w, new_slots, norm = run(x, dy, w, slots, scalars, layer=jnp.int32(1))
        row["err_w"] = _max_scaled_err(new_w[1], want[0][1])
        row["err_slot"] = _max_scaled_err(new_slots[0][1], want[1][0][1])
        row["err_norm"] = abs(float(norm) - float(want[2])) / float(want[2])
        row["other_layers_untouched"] = bool(
            jnp.all(new_w[jnp.array([0, 2])] == w[jnp.array([0, 2])])
            & jnp.all(new_slots[0][jnp.array([0, 2])] == slots[0][jnp.array([0, 2])])
        )
        ok = (row["err_w"] <= 2.0**-7 and row["err_slot"] <= 1e-4 and row["err_norm"] <= 1e-4
              and row["other_layers_untouched"])
        row["status"] = "ok" if ok else "wrong"
      except Exception as e:
        row.update(status="error", error=_timing.short_error(e))
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------
# Choosing the winners.
# ----------------------------------------------------------------------------


def _key(cfg: dict) -> tuple:
  return tuple(cfg[f] for f in ("block_k", "block_n", "block_t", "num_warps", "num_stages"))


def best_per_shape(rows: list[dict]) -> dict[str, dict]:
  best: dict[str, dict] = {}
  for row in rows:
    if row["status"] == "ok" and (row["shape"] not in best or row["ms"] < best[row["shape"]]["ms"]):
      best[row["shape"]] = row
  return best


def best_per_class(rows: list[dict]) -> dict[str, dict]:
  """Per shape class, the config with the lowest mean slowdown vs each shape's best.

  Only configs timed on every shape of the class compete (stage 3 times the
  same candidates on all of them).
  """
  best = best_per_shape(rows)
  by_class: dict[str, dict[tuple, dict[str, float]]] = {}
  shapes_of: dict[str, set] = {}
  for row in rows:
    if row["status"] != "ok":
      continue
    cls = fused_dw.shape_class(row["t"], row["k"], row["n"])
    shapes_of.setdefault(cls, set()).add(row["shape"])
    by_class.setdefault(cls, {}).setdefault(_key(row["config"]), {})[row["shape"]] = row["ms"]
  table = {}
  for cls, per_cfg in by_class.items():
    scored = []
    for key, times in per_cfg.items():
      if set(times) == shapes_of[cls]:
        slowdown = statistics.geometric_mean([times[s] / best[s]["ms"] for s in times])
        scored.append((slowdown, key))
    if scored:
      slowdown, key = min(scored)
      fields = ("block_k", "block_n", "block_t", "num_warps", "num_stages")
      table[cls] = {"config": dict(zip(fields, key)), "mean_slowdown_vs_best": slowdown,
                    "shapes": sorted(shapes_of[cls])}
  return table


def table_python(table: dict[str, dict], source: str) -> str:
  lines = [f"# Source: {source}", "TUNED_TILES: dict[str, TileConfig] = {"]
  for cls, entry in sorted(table.items()):
    c = entry["config"]
    lines.append(
        f'    "{cls}": TileConfig(block_k={c["block_k"]}, block_n={c["block_n"]}, '
        f'block_t={c["block_t"]}, num_warps={c["num_warps"]}, num_stages={c["num_stages"]}),'
    )
  lines.append("}")
  return "\n".join(lines)


def _cfg_str(cfg: dict) -> str:
  return f'{cfg["block_k"]}x{cfg["block_n"]} t{cfg["block_t"]} w{cfg["num_warps"]} s{cfg["num_stages"]}'


def summary_markdown(info: dict, rows: list[dict], checks: list[dict], table: dict,
                     baseline: TileConfig) -> str:
  best = best_per_shape(rows)
  base_key = _key(dataclasses.asdict(baseline))
  out = [
      "# Fused dW + AdamW tile sweep (Triton-lowered Pallas)", "",
      f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}, "
      f"jaxlib {info['jaxlib']}, triton {info['triton']}.", "",
      f"Self-check (odd shapes, stacked, fp32/bf16): "
      f"{sum(c['status'] == 'ok' for c in checks)}/{len(checks)} ok.", "",
      f"| T x K x N | best config | ms | TF/s | baseline {_cfg_str(dataclasses.asdict(baseline))} ms | evaluated / ok |",
      "|---|---|---|---|---|---|",
  ]
  for shape in dict.fromkeys(r["shape"] for r in rows):
    mine = [r for r in rows if r["shape"] == shape]
    base = next((r for r in mine if _key(r["config"]) == base_key and r["status"] == "ok"), None)
    b = best.get(shape)
    out.append(
        f"| {shape} | {_cfg_str(b['config']) if b else '-'} | {b['ms']:.3f} | {b['tflops']:.0f} | "
        f"{base['ms'] if base else float('nan'):.3f} | {len(mine)} / {sum(r['status'] == 'ok' for r in mine)} |"
        if b else f"| {shape} | - | - | - | - | {len(mine)} / 0 |"
    )
  out += ["", "Per shape class (lowest mean slowdown against each shape's best):", ""]
  for cls, entry in sorted(table.items()):
    out.append(f"- `{cls}`: {_cfg_str(entry['config'])} (mean slowdown {entry['mean_slowdown_vs_best']:.3f})")
  return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# The sweep.
# ----------------------------------------------------------------------------


def _unique(configs: Sequence[TileConfig], seen: set) -> list[TileConfig]:
  out = []
  for cfg in configs:
    if cfg not in seen:
      seen.add(cfg)
      out.append(cfg)
  return out


def _ranked(rows: list[dict], shape: str) -> list[TileConfig]:
  ok = sorted((r for r in rows if r["shape"] == shape and r["status"] == "ok"), key=lambda r: r["ms"])
  return [TileConfig(**r["config"]) for r in ok]


def sweep_one_t(t: int, shapes_kn, space: SweepSpace, rule, *, interpret: bool, timing: dict,
                deadline: float, baseline: TileConfig) -> list[dict]:
  """Stages 1-3 for one token count; stops at ``deadline`` (rest: skipped).

  Stages 1-2 may use 60% of the time left, so that stage 3 (the other
  (K, N), which the per-class table needs) always gets its share.
  """
  rows: list[dict] = []

  def run(problem: Problem, configs: Sequence[TileConfig], until: float):
    for cfg in configs:
      if time.perf_counter() > until:
        rows.append({"shape": problem.name, "t": problem.t, "k": problem.k, "n": problem.n,
                     "config": dataclasses.asdict(cfg), "status": "skipped", "error": "time budget"})
        continue
      row = evaluate(problem, cfg, space, interpret=interpret, timing=timing)
      rows.append(row)
      _timing.log(f"  {problem.name:>18} {_cfg_str(row['config']):<22} {row['status']:<7} "
                  + (f"{row['ms']:.3f} ms {row['tflops']:.0f} TF/s" if row["status"] == "ok" else row.get("error", "")))

  first, *others = shapes_kn
  now = time.perf_counter()
  first_deadline = now + (0.6 * (deadline - now) if others else deadline - now)
  problem = Problem(t, *first, rule)
  seen: set = set()
  run(problem, _unique([baseline, *coarse_configs(space)], seen), first_deadline)
  top = _ranked(rows, problem.name)[: space.top_coarse]
  run(problem, _unique([c for cfg in top for c in neighbours(cfg, space)], seen), first_deadline)
  # Best first: if time runs short, the best candidates are the ones timed.
  carried = _unique([*_ranked(rows, problem.name)[: space.top_transfer], baseline], set())
  del problem
  for kn in others:
    gc.collect()
    problem = Problem(t, *kn, rule)
    run(problem, carried, deadline)
    del problem
  gc.collect()
  return rows


def _parse_kn(text: str) -> tuple[int, int]:
  k, n = text.lower().split("x")
  return int(k), int(n)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  parser.add_argument("--budget-s", type=float, default=None, help="sweep time budget (default 200; smoke 60)")
  parser.add_argument("--tokens", type=int, nargs="+", default=None, help=f"T values (default {TOKENS})")
  parser.add_argument("--shapes", type=_parse_kn, nargs="+", default=None,
                      help="KxN shapes, the first one gets the full sweep (default: the four model shapes)")
  args = parser.parse_args(argv)

  interpret = args.smoke or jax.default_backend() == "cpu"
  if args.smoke:
    space, tokens, shapes = SMOKE_SPACE, args.tokens or (48,), args.shapes or [(40, 72), (72, 40)]
    baseline, check_shape, budget = TileConfig(32, 32, 16, 4, 2), (21, 40, 50), args.budget_s or 60.0
    timing = dict(warmup=0, iters=1, repeats=1)
  else:
    space, tokens, shapes = GPU_SPACE, args.tokens or TOKENS, args.shapes or list(SHAPES_KN)
    baseline, check_shape, budget = BASELINE, (77, 200, 333), args.budget_s or 200.0
    timing = dict(warmup=2, iters=None, repeats=3)
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.tune_fused_dw", argv)
  info.update(interpret=interpret, budget_s=budget, update_tol=UPDATE_TOL, slot_tol=SLOT_TOL)
  _timing.log(f"tune_fused_dw on {info['device']} (jax {info['jax']}), interpret={interpret}, budget {budget:.0f} s")
  rule = forge_jax.adamw(learning_rate=1e-3, weight_decay=0.1).rule

  check_configs = [TileConfig(32, 32, 16, 4, 2)]
  if not args.smoke:
    check_configs += [TileConfig(64, 128, 32, 4, 3), fused_dw.default_tile_config(*check_shape, BF16)]
  checks = selfcheck(check_configs, check_shape, interpret=interpret)
  for c in checks:
    _timing.log(f"  self-check {c['in_dtype']:>8} {_cfg_str(c['config']):<22} {c['status']} {c.get('error', '')}")

  rows: list[dict] = []
  start = time.perf_counter()
  payload: dict[str, Any] = {"info": info, "selfcheck": checks, "rows": rows}
  for i, t in enumerate(tokens):
    remaining = budget - (time.perf_counter() - start)
    deadline = time.perf_counter() + remaining / (len(tokens) - i)
    _timing.log(f"T={t}: {remaining:.0f} s of budget left")
    try:
      rows += sweep_one_t(t, shapes, space, rule, interpret=interpret, timing=timing,
                          deadline=deadline, baseline=baseline)
    except Exception as e:  # e.g. out of memory making the inputs
      rows.append({"shape": f"{t}x*", "t": t, "status": "error", "error": _timing.short_error(e)})
    _timing.write_json(folder / "tune_fused_dw.json", payload)

  table = best_per_class(rows)
  payload.update(
      best_per_shape=best_per_shape(rows),
      table=table,
      table_python=table_python(table, f"tune_fused_dw.json, {info['date']}, {info['device']}"),
      elapsed_s=time.perf_counter() - start,
  )
  _timing.write_json(folder / "tune_fused_dw.json", payload)
  markdown = summary_markdown(info, rows, checks, table, baseline)
  (folder / "tune_fused_dw.md").write_text(markdown)
  _timing.log("\n" + markdown)
  _timing.log(payload["table_python"])
  _timing.log(f"wrote {folder / 'tune_fused_dw.json'} and {folder / 'tune_fused_dw.md'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
