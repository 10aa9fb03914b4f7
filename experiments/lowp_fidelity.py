"""Low-precision fidelity: bf16 weights with stochastic rounding, int8 states, vs fp32.

A small MLP (64 -> 256 -> 256 -> 64, GELU) learns a fixed random teacher
network (MSE, Gaussian inputs) with AdamW at a small learning rate, the
regime where a bfloat16 weight (8 significant bits) cannot absorb one
update: AdamW's step is about ``lr`` per weight, below half a bfloat16 ulp
of a weight of magnitude > ``~256 lr``. Every run shares init (float32 init,
cast where stored lower), data and batch order; only the storage differs:

* ``fp32``: FORGE, float32 weights and states: the master-weight reference.
* ``optax_fp32``: ``flax.linen.Dense`` + ``optax.adamw``, float32 (sanity:
  equals ``fp32`` up to summation order).
* ``optax_bf16``: what optax does with bf16 params: ``jax.grad`` gives bf16
  gradients, optax keeps bf16 moments, ``apply_updates`` rounds to nearest.
* ``bf16_rtn``: FORGE, bf16 weights rounded to nearest (the gradient is
  consumed in float32), bf16 states.
* ``bf16_sr``: FORGE, bf16 weights, stochastic rounding, float32 states
  (isolates the weight rounding).
* ``bf16_sr_bf16``: the same with bf16 states (6 bytes/param, like optax bf16).
* ``fp32_int8``: float32 weights, int8 states (isolates the states).
* ``bf16_sr_int8``: bf16 + stochastic rounding + int8 states (4.125 bytes/param).
* ``fp32_int8_rtn_v``: ablation: the second moment's minifloat map rounded
  to nearest instead of stochastically (it sticks: v lags, steps too large).
* ``fp32_int8_linear_v``: ablation: a linear map for the second moment
  (stochastic rounding): small values round to 0 now and then.

Reported per run: the final loss (mean of the last 10% of steps), its gap
relative to ``fp32``, and the fraction of weights that ever moved from their
initial value (``optax_bf16``/``bf16_rtn`` leave many untouched: updates below
half an ulp are rounded away). Writes ``lowp_fidelity.json`` (+ ``.png`` if
matplotlib is installed) to ``--out`` (default ``$OUT`` or ``./runs``).

    PYTHONPATH=$PWD python -m experiments.lowp_fidelity            # ~30-60 s on a 2-core CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import forge_jax
from experiments import _timing

F32, BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Setup:
  """The task and the training run every configuration shares."""

  d_in: int = 64
  hidden: int = 256
  d_out: int = 64
  batch: int = 128
  steps: int = 400
  lr: float = 1e-4
  weight_decay: float = 0.0
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class Config:
  """One storage configuration."""

  impl: str  # "forge" or "optax"
  param_dtype: Any = F32
  precision: Optional[forge_jax.Precision] = None


CONFIGS: dict[str, Config] = {
    "fp32": Config("forge"),
    "optax_fp32": Config("optax"),
    "optax_bf16": Config("optax", BF16),
    "bf16_rtn": Config("forge", BF16),
    "bf16_sr": Config("forge", BF16, forge_jax.Precision("stochastic", state_dtype="float32")),
    "bf16_sr_bf16": Config("forge", BF16, forge_jax.Precision("stochastic")),
    "fp32_int8": Config("forge", F32, forge_jax.Precision(state_dtype="int8", min_quantized_size=0)),
    "bf16_sr_int8": Config("forge", BF16, forge_jax.Precision("stochastic", state_dtype="int8", min_quantized_size=0)),
    "fp32_int8_rtn_v": Config("forge", F32, forge_jax.Precision(
        state_dtype="int8", min_quantized_size=0,
        unsigned_map=forge_jax.QuantMap("float", signed=False, mantissa_bits=4))),
    "fp32_int8_linear_v": Config("forge", F32, forge_jax.Precision(
        state_dtype="int8", min_quantized_size=0,
        unsigned_map=forge_jax.QuantMap("linear", signed=False, rounding="stochastic"))),
}
DEFAULT_RUNS = tuple(k for k in CONFIGS)


class MLP(nn.Module):
  setup_: Setup
  optimizer: Optional[forge_jax.ForgeOptimizer] = None  # None: flax.linen.Dense
  param_dtype: Any = F32

  @nn.compact
  def __call__(self, x):
    s = self.setup_
    for i, width in enumerate((s.hidden, s.hidden, s.d_out)):
      if self.optimizer is None:
        layer = nn.Dense(width, param_dtype=self.param_dtype, name=f"dense{i}")
      else:
        layer = forge_jax.Dense(width, optimizer=self.optimizer, param_dtype=self.param_dtype,
                                backend="xla", name=f"dense{i}")
      x = layer(x)
      if i < 2:
        x = jax.nn.gelu(x)
    return x


def make_data(s: Setup):
  """A fixed teacher and one fixed batch sequence (the same for every run)."""
  key = jax.random.PRNGKey(1000 + s.seed)
  k_t, k_x, k_n = jax.random.split(key, 3)
  teacher = MLP(s)
  t_params = teacher.init(k_t, jnp.zeros((1, s.d_in)))
  xs = jax.random.normal(k_x, (s.steps, s.batch, s.d_in))
  ys = jax.vmap(lambda x: teacher.apply(t_params, x))(xs)
  ys = ys + 0.01 * jax.random.normal(k_n, ys.shape)
  return xs, ys


def _mse(pred, y):
  return jnp.mean((pred.astype(F32) - y) ** 2)


def _forge_loss(apply_fn, variables, batch):
  return _mse(apply_fn(variables, batch["x"]), batch["y"])


def _cast_params(params, dtype):
  return jax.tree.map(lambda p: jnp.array(p, dtype), params)  # a copy, even in the same dtype


def _kernels(params) -> list:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return [leaf for path, leaf in flat if "kernel" in jax.tree_util.keystr(path)]


def run_config(name: str, s: Setup, data) -> dict:
  """Trains one configuration; returns its loss curve and moved-weight fraction."""
  cfg = CONFIGS[name]
  xs, ys = data
  init_params = MLP(s).init(jax.random.PRNGKey(s.seed), xs[0])["params"]  # float32 init
  # Host copies: the FORGE train step donates (and so deletes) its input buffers.
  init_k = [np.asarray(k) for k in _kernels(_cast_params(init_params, cfg.param_dtype))]
  losses = []
  start = time.perf_counter()
  if cfg.impl == "optax":
    model = MLP(s, None, cfg.param_dtype)
    params = _cast_params(init_params, cfg.param_dtype)
    tx = optax.adamw(s.lr, weight_decay=s.weight_decay)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
      loss, grads = jax.value_and_grad(lambda p: _mse(model.apply({"params": p}, x), y))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    for i in range(s.steps):
      params, opt_state, loss = step(params, opt_state, xs[i], ys[i])
      losses.append(loss)
    final = params
  else:
    opt = forge_jax.adamw(s.lr, weight_decay=s.weight_decay, precision=cfg.precision)
    model = MLP(s, opt, cfg.param_dtype)
    # The same (float32) initial values as every other run, stored in param_dtype;
    # the FORGE states are initialised from the kernels as stored.
    variables = _with_forge_states(_cast_params(init_params, cfg.param_dtype), opt)
    state = forge_jax.TrainState.create(model.apply, variables, opt)
    loss_fn = functools.partial(_forge_loss, model.apply)
    for i in range(s.steps):
      state, metrics = forge_jax.train_step(state, {"x": xs[i], "y": ys[i]}, loss_fn)
      losses.append(metrics["loss"])
    final = state.params
  losses = np.asarray(jax.device_get(jnp.stack(losses)), np.float64)
  moved = [np.mean(np.asarray(a) != b) for a, b in zip(_kernels(final), init_k)]
  return {
      "name": name,
      "impl": cfg.impl,
      "param_dtype": jnp.dtype(cfg.param_dtype).name,
      "precision": None if cfg.precision is None else repr(cfg.precision),
      "loss": losses.tolist(),
      "final_loss": float(losses[-max(1, s.steps // 10):].mean()),
      "moved_fraction": float(np.mean(moved)),
      "seconds": time.perf_counter() - start,
  }


def _with_forge_states(params, opt) -> dict:
  """Variables for a FORGE MLP: ``params`` plus each kernel's optimizer state."""
  forge_state = {
      name: {"kernel": forge_jax.KernelState(opt.init(layer["kernel"]), jnp.zeros((), F32))}
      for name, layer in params.items()
  }
  return {"params": params, forge_jax.FORGE_STATE: forge_state}


def summarize(rows: list[dict], reference: str = "fp32") -> list[dict]:
  """Adds each run's final-loss gap relative to ``reference``."""
  ref = next((r["final_loss"] for r in rows if r["name"] == reference), None)
  for r in rows:
    r["rel_gap"] = None if ref is None else r["final_loss"] / ref - 1.0
  return rows


def run(names: Sequence[str] = DEFAULT_RUNS, setup: Setup = Setup(), log: Callable = print) -> list[dict]:
  data = make_data(setup)
  rows = []
  for name in names:
    row = run_config(name, setup, data)
    rows.append(row)
    log(f"  {name:<20} final loss {row['final_loss']:.5f}  moved {row['moved_fraction']:.3f}  "
        f"({row['seconds']:.1f} s)")
  return summarize(rows)


def markdown(info: dict, rows: list[dict]) -> str:
  out = [
      "# Low-precision fidelity (tiny MLP, AdamW)", "",
      f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
      f"Setup: {info['setup']}.", "",
      "| run | weights | final loss | gap vs fp32 | weights ever moved |",
      "|---|---|---|---|---|",
  ]
  for r in rows:
    gap = "-" if r["rel_gap"] is None else f"{100 * r['rel_gap']:+.2f}%"
    out.append(f"| {r['name']} | {r['param_dtype']} | {r['final_loss']:.5f} | {gap} | "
               f"{100 * r['moved_fraction']:.1f}% |")
  return "\n".join(out) + "\n"


def plot(rows: list[dict], path) -> bool:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in rows:
    loss = np.asarray(r["loss"])
    smooth = np.convolve(loss, np.ones(10) / 10, mode="valid")
    ax.plot(np.arange(len(smooth)) + 9, smooth, label=r["name"], lw=1.2)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("train MSE (10-step mean)")
  ax.legend(fontsize=8)
  ax.set_title("bf16 + stochastic rounding / int8 states vs fp32")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), choices=list(CONFIGS))
  for field in dataclasses.fields(Setup):
    parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
  args = parser.parse_args(argv)
  setup = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.lowp_fidelity", argv)
  info["setup"] = dataclasses.asdict(setup)
  _timing.log(f"lowp_fidelity: {setup}")
  rows = run(args.runs, setup, log=_timing.log)
  _timing.write_json(folder / "lowp_fidelity.json", {"info": info, "rows": rows})
  table = markdown(info, rows)
  (folder / "lowp_fidelity.md").write_text(table)
  plotted = plot(rows, folder / "lowp_fidelity.png")
  _timing.log("\n" + table)
  _timing.log(f"wrote {folder / 'lowp_fidelity.json'}, .md" + (", .png" if plotted else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
