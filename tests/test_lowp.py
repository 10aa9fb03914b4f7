"""forge_jax.Precision: the same low-precision storage in the optax face, the
XLA backend, the fused kernel (interpret mode) and a Flax training step; the
bytes table in docs/precision.md; fidelity on a tiny model; the GPU benchmark
script in its CPU smoke mode."""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from experiments import bench_fused_dw
from experiments import bench_lowp
from experiments import lowp_bytes
from experiments import lowp_fidelity
import pallas_kernels
from pallas_kernels import numerics as nm

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

F32, BF16 = jnp.float32, jnp.bfloat16
P = forge_jax.Precision
SR_INT8 = P("stochastic", state_dtype="int8", min_quantized_size=0)


def _leaves_equal(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    u, v = np.atleast_1d(np.asarray(u)), np.atleast_1d(np.asarray(v))
    assert u.dtype == v.dtype and u.shape == v.shape
    np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


def _inputs(seed, t, k, n, w_dtype=BF16):
  kx, kd, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (t, k)).astype(BF16)
  dy = (jax.random.normal(kd, (t, n)) / np.sqrt(t)).astype(BF16)
  return x, dy, jax.random.normal(kw, (k, n)).astype(w_dtype)


# ----------------------------------------------------------------------------
# The API.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight_rounding="up"), "weight_rounding='up' must be one of"),
        (dict(state_dtype="int4"), "state_dtype='int4' must be None, a float dtype"),
        (dict(state_dtype=jnp.int32), "must be None, a float dtype"),
        (dict(block_size=48), "block_size=48 must be a power of two"),
        (dict(block_size=64.0), "block_size=64.0 must be an int"),
        (dict(min_quantized_size=None), "min_quantized_size=None must be an int"),
        (dict(unsigned_map=nm.QuantMap("linear", signed=True)), "unsigned_map=.* an unsigned one"),
    ],
)
def test_precision_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    P(**kwargs)


def test_precision_takes_the_int8_dtype_for_the_int8_codec():
  assert P(state_dtype=jnp.int8) == P(state_dtype="int8")
  assert P(state_dtype=jnp.int8).state_dtype == "int8"


def test_optimizer_errors_name_the_conflict_and_the_fix():
  with pytest.raises(ValueError, match="mu_dtype=.*and precision.state_dtype=.*pass only one"):
    forge_jax.adamw(1e-3, mu_dtype=BF16, precision=P(state_dtype="int8"))
  with pytest.raises(ValueError, match="must be a forge_jax.Precision"):
    forge_jax.sgd(1e-3, precision="bf16")
  opt = forge_jax.adamw(1e-3, precision=P(state_dtype="int8"))
  with pytest.raises(ValueError, match=r"shape \(64, 100\).*multiple of block_size=64.*min_quantized_size"):
    opt.init({"w": jnp.zeros((64, 100))})
  plain_adam = forge_jax.adam(1e-3, precision=P("stochastic"))
  params = {"w": jnp.ones((4, 4), BF16)}
  with pytest.raises(ValueError, match="needs the current params"):
    plain_adam.update(params, plain_adam.init(params))


def test_default_precision_is_exactly_todays_behaviour():
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (32, 64)).astype(BF16), "b": jnp.ones((64,), BF16)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, F32), params)
  for ctor in (forge_jax.adamw, forge_jax.lion, forge_jax.adagrad):
    a, b = ctor(1e-2), ctor(1e-2, precision=P())
    assert a.precision == P()
    _leaves_equal(a.update(grads, a.init(params), params), b.update(grads, b.init(params), params))
  x, dy, w = _inputs(0, 16, 32, 64)
  a, b = forge_jax.adamw(1e-2), forge_jax.adamw(1e-2, precision=P())
  _leaves_equal(forge_jax.fused_linear_update(x, dy, w, a.init(w), a, "xla"),
                forge_jax.fused_linear_update(x, dy, w, b.init(w), b, "xla"))


def test_state_storage_follows_the_precision():
  params = {"w": jnp.zeros((128, 256), F32), "b": jnp.zeros((256,), F32), "tiny": jnp.zeros((8, 64))}
  bf16 = forge_jax.adamw(1e-3, precision=P(state_dtype="bfloat16")).init(params)
  assert {x.dtype for x in jax.tree.leaves((bf16.mu, bf16.nu))} == {jnp.dtype(BF16)}
  int8 = forge_jax.adamw(1e-3, precision=P(state_dtype="int8")).init(params)
  for slot in (int8.mu, int8.nu):
    assert isinstance(slot["w"], forge_jax.QuantizedArray)  # 32768 >= 4096 elements
    assert slot["w"].codes.dtype == jnp.int8 and slot["w"].scale.shape == (4, 128)
    assert slot["b"].dtype == F32 and slot["tiny"].dtype == F32  # below min_quantized_size
  assert int8.mu["w"].codec.qmap == P().signed_map and int8.nu["w"].codec.qmap == P().unsigned_map
  init = forge_jax.rmsprop(1e-3, initial_scale=0.1, precision=P(state_dtype="int8")).init(params)
  np.testing.assert_allclose(init.nu["w"].dequantize(), 0.1, rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda p: forge_jax.adamw(1e-3, precision=p),
    lambda p: forge_jax.rmsprop(1e-3, initial_scale=0.1, momentum=0.9, precision=p),
    lambda p: forge_jax.adagrad(1e-3, initial_accumulator_value=0.3, precision=p),
])
def test_int8_init_is_the_quantized_initial_slots_without_a_float_copy(make):
  """Initial int8 slots equal quantizing the full float32 slots, bit for bit, and
  are built without any float32 array of the parameter's size (also outside jit)."""
  p = P(state_dtype="int8")
  opt = make(p)
  w = jnp.zeros((3, 128, 256), BF16)  # stacked, like a ScannedStack's kernel
  rule = opt.rule
  for name, got, full in zip(rule.slot_names, forge_jax._lowp.init_slots(rule, p, w),
                             rule.init_slots(jnp.zeros(w.shape, F32))):
    want = p.codec(name).quantize(full)
    assert got.codes.dtype == want.codes.dtype and got.scale.dtype == want.scale.dtype
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.scale, want.scale)
  jaxpr = jax.make_jaxpr(lambda w: forge_jax._lowp.init_slots(rule, p, w))(w)
  sizes = [v.aval.size for e in jaxpr.eqns for v in e.outvars if v.aval.dtype == F32]
  assert max(sizes, default=0) < w.size // p.block_size + 1, sizes
  bf16 = forge_jax._lowp.init_slots(rule, P(state_dtype="bfloat16"), w)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(BF16)), bf16,
               rule.init_slots(jnp.zeros(w.shape, F32)))


# ----------------------------------------------------------------------------
# One definition everywhere: optax face == XLA backend == kernel.
# ----------------------------------------------------------------------------


def _optax_face_step(opt, x, dy, w, state):
  g = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=F32)
  updates, state = opt.update({"w": g}, state, {"w": w})
  return optax.apply_updates({"w": w}, updates)["w"], state


def test_optax_face_xla_backend_and_kernel_agree_sr_int8():
  # Three steps; the optax face's stream for a one-leaf tree is 0, as passed here.
  opt = forge_jax.adamw(1e-2, weight_decay=0.1, precision=SR_INT8)
  x, dy, w = _inputs(1, 45, 96, 192)
  face = (w, opt.init({"w": w}))
  xla = kern = (w, opt.init(w))
  step_face = jax.jit(functools.partial(_optax_face_step, opt))
  step = lambda backend: jax.jit(functools.partial(
      forge_jax.fused_linear_update, optimizer=opt, backend=backend, stream=0,
      config=pallas_kernels.TileConfig(32, 64, 16, 4, 2)))
  step_xla, step_kernel = step("xla"), step("interpret")
  for i in range(3):
    xi = x * (1.0 + 0.1 * i)
    face = step_face(xi, dy, *face)
    xla, kern = step_xla(xi, dy, *xla), step_kernel(xi, dy, *kern)
  w_face, w_xla, w_kern = (np.asarray(s[0], np.float32) for s in (face, xla, kern))
  assert face[0].dtype == BF16 and xla[0].dtype == BF16
  # Same bits everywhere; the float32 values differ in their last bits (sum
  # order, compilation), which moves a rounding by one step on a few elements.
  for a in (w_face, w_kern):
    assert (a != w_xla).mean() <= 2e-3
    np.testing.assert_allclose(a, w_xla, rtol=2**-7, atol=1e-6)
  for slot in ("mu", "nu"):
    ref = getattr(xla[1], slot)
    for other in (getattr(face[1], slot)["w"], getattr(kern[1], slot)):
      assert (np.asarray(other.codes) != np.asarray(ref.codes)).mean() <= 2e-3
      np.testing.assert_allclose(other.dequantize(), ref.dequantize(), rtol=0.07, atol=1e-3 * float(jnp.max(ref.scale)))
  assert not np.array_equal(w_xla, np.asarray(w, np.float32))


def test_optax_face_sr_update_lands_exactly_on_the_rounded_weight():
  opt = forge_jax.sgd(2.0**-6, precision=P("stochastic"))
  w = jax.random.normal(jax.random.PRNGKey(2), (64, 128)).astype(BF16)
  g = 1e-3 * jax.random.normal(jax.random.PRNGKey(3), (64, 128))
  state = opt.init({"w": w})
  updates, state = opt.update({"w": g}, state, {"w": w})
  assert updates["w"].dtype == F32
  new_w = optax.apply_updates({"w": w}, updates)["w"]
  bits = nm.element_bits(nm.rounding_key(nm.stream_seed(0, 0), 0, 0), nm.matrix_index(w.shape))
  want = nm.stochastic_round(w.astype(F32) - 2.0**-6 * g, bits, BF16)
  _leaves_equal(new_w, want)


def test_sub_ulp_updates_survive_with_sr_and_vanish_with_nearest():
  # 200 updates of -1e-4 each on weights at 1.0 (bf16 ulp 2**-7 ~ 7.8e-3):
  # round-to-nearest never moves; stochastic rounding moves -0.02 on average.
  w = {"w": jnp.ones((64, 64), BF16)}
  results = {}
  for rounding in ("nearest", "stochastic"):
    opt = forge_jax.sgd(1e-4, precision=P(rounding))
    params, state = w, opt.init(w)

    @jax.jit
    def step(params, state):
      updates, state = opt.update({"w": jnp.ones((64, 64), BF16)}, state, params)
      return optax.apply_updates(params, updates), state

    for _ in range(200):
      params, state = step(params, state)
    results[rounding] = np.asarray(params["w"], np.float64)
  assert np.all(results["nearest"] == 1.0)
  drift = results["stochastic"].mean() - 1.0
  assert abs(drift - (-0.02)) < 0.002, drift


# ----------------------------------------------------------------------------
# Flax: Dense + train_step, int8 codes through the VJP.
# ----------------------------------------------------------------------------


class _Block(nn.Module):
  opt: forge_jax.ForgeOptimizer
  backend: str

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(forge_jax.Dense, optimizer=self.opt, param_dtype=BF16, backend=self.backend)
    return x + dense(64)(jax.nn.gelu(dense(64)(x)))


class _Model(nn.Module):
  """Unstacked FORGE layers around a ScannedStack (stacked kernels and int8 states)."""

  opt: forge_jax.ForgeOptimizer
  backend: str

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(forge_jax.Dense, optimizer=self.opt, param_dtype=BF16, backend=self.backend)
    x = forge_jax.ScannedStack(functools.partial(_Block, self.opt, self.backend), 2)(dense(64)(x))
    return dense(64)(x)


def _mse(apply_fn, variables, batch):
  return jnp.mean((apply_fn(variables, batch["x"]).astype(F32) - batch["y"]) ** 2)


def test_train_step_with_sr_and_int8_states_scanned_and_unrolled_kernel_equals_xla(tmp_path):
  opt = forge_jax.adamw(1e-3, weight_decay=0.1, precision=SR_INT8)
  batch = {"x": jax.random.normal(jax.random.PRNGKey(1), (24, 64)), "y": jnp.zeros((24, 64))}
  states = {}
  # One init for both (the backend does not enter it): each backend's step from the same state.
  variables = _Model(opt, "xla").init(jax.random.PRNGKey(0), batch["x"])
  for backend in ("xla", "interpret"):
    model = _Model(opt, backend)
    state = forge_jax.TrainState.create(model.apply, jax.tree.map(jnp.copy, variables), opt)
    loss_fn = functools.partial(_mse, model.apply)  # one object: train_step compiles per loss_fn
    losses = []
    for _ in range(2):
      state, metrics = forge_jax.train_step(state, batch, loss_fn)
      losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    states[backend] = state
  xla, kern = states["xla"], states["interpret"]
  mu = xla.forge_state["Dense_0"]["kernel"].opt.mu
  assert isinstance(mu, forge_jax.QuantizedArray) and mu.codes.dtype == jnp.int8  # stored as int8
  stacked = xla.forge_state["ScannedStack_0"]["layers"]["block"]["Dense_0"]["kernel"].opt.nu
  assert stacked.codes.shape == (2, 64, 64) and stacked.scale.shape == (2, 1, 64)  # block-major
  assert xla.params["Dense_0"]["kernel"].dtype == BF16
  # Identical inputs, the same bits: the backends agree up to rare one-step roundings.
  for a, b in zip(jax.tree.leaves(xla.forge_state), jax.tree.leaves(kern.forge_state)):
    if a.dtype == jnp.int8:
      assert (np.asarray(a) != np.asarray(b)).mean() <= 2e-3
  for a, b in zip(jax.tree.leaves(xla.params), jax.tree.leaves(kern.params)):
    assert (np.asarray(a) != np.asarray(b)).mean() <= 2e-3
  # Bit-exact resume: the int8 state checkpoints as int8.
  path = forge_jax.save_train_state(tmp_path / "ckpt", xla)
  _leaves_equal(forge_jax.restore_train_state(path, xla), xla)
  old = _saved_before_block_major(tmp_path / "old", xla)
  assert old.forge_state["Dense_0"]["kernel"].opt.mu.scale.shape == (64, 1)
  _leaves_equal(forge_jax.restore_train_state(tmp_path / "old", xla), xla)


def _saved_before_block_major(path, state):
  """``state`` written as forge-jax wrote checkpoints before 2026-12-05: no format metadata, a
  matrix's int8 scales [..., K, N // block]. Returns the state so written."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  is_scale = lambda p: getattr(p[-1], "name", None) == "scale"
  old = jax.tree_util.tree_map_with_path(
      lambda p, a: jnp.swapaxes(a, -1, -2) if is_scale(p) and a.ndim >= 2 else a, state)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(str(path), old)
    ckptr.wait_until_finished()
  return old


def test_checkpoint_from_before_block_major_scales_restores_square_scales_too(tmp_path):
  """Square scales ([16, 16] of a 16x1024 weight) have the same shape in both layouts: the
  format recorded with each checkpoint, not the shape, says they are to be transposed."""
  opt = forge_jax.adamw(1e-3, precision=P(state_dtype="int8"))
  model = forge_jax.Dense(1024, optimizer=opt, backend="xla", use_bias=False)
  batch = {"x": jax.random.normal(jax.random.PRNGKey(1), (8, 16)), "y": jnp.zeros((8, 1024))}
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  state, _ = forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  mu = state.forge_state["kernel"].opt.mu
  assert mu.scale.shape == (16, 16) and not np.array_equal(mu.scale, mu.scale.T)
  _saved_before_block_major(tmp_path / "old", state)
  _leaves_equal(forge_jax.restore_train_state(tmp_path / "old", state), state)
  _leaves_equal(forge_jax.restore_train_state(forge_jax.save_train_state(tmp_path / "new", state),
                                              state), state)


def test_dense_layers_draw_independent_rounding_bits():
  opt = forge_jax.sgd(1e-4, precision=P("stochastic"))

  class Twin(nn.Module):
    @nn.compact
    def __call__(self, x):
      a = forge_jax.Dense(64, optimizer=opt, param_dtype=BF16, use_bias=False, backend="xla")(x)
      b = forge_jax.Dense(64, optimizer=opt, param_dtype=BF16, use_bias=False, backend="xla")(x)
      return a + b

  x = jnp.ones((8, 64))
  model = Twin()
  variables = model.init(jax.random.PRNGKey(0), x)
  same = lambda: jnp.full((64, 64), 1.0, BF16)
  variables = {**variables, "params": {"Dense_0": {"kernel": same()}, "Dense_1": {"kernel": same()}}}
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  state, _ = forge_jax.train_step(state, {"x": x}, lambda v, b: jnp.sum(model.apply(v, b["x"])))
  k0, k1 = (np.asarray(state.params[f"Dense_{i}"]["kernel"], np.float32) for i in (0, 1))
  assert 0.2 < (k0 != k1).mean() < 0.8  # same values and gradients, other bits


# ----------------------------------------------------------------------------
# Docs, fidelity, benchmark script.
# ----------------------------------------------------------------------------


def test_docs_bytes_table_is_the_scripts_output():
  text = lowp_bytes.DOCS.read_text()
  assert lowp_bytes.docs_section(text) == lowp_bytes.table(), (
      "docs/precision.md is stale: run `python -m experiments.lowp_bytes --write-docs`"
  )
  rows = {r["label"]: r for r in lowp_bytes.rows()}
  assert rows["optax.adamw, fp32 params"]["total"] == 12
  assert rows["FORGE, bf16 weights + SR, int8 states (block 64)"]["total"] == 2 + 2 * (1 + 4 / 64)


def test_fidelity_bf16_sr_tracks_fp32_while_nearest_stalls_and_int8_tracks():
  setup = lowp_fidelity.Setup(hidden=128, steps=200, lr=1e-4)
  rows = {r["name"]: r for r in lowp_fidelity.run(
      ["fp32", "optax_bf16", "bf16_rtn", "bf16_sr", "fp32_int8", "bf16_sr_int8", "fp32_int8_rtn_v"],
      setup, log=lambda *a: None)}
  gap = {k: r["rel_gap"] for k, r in rows.items()}
  # Stochastic rounding tracks the fp32 master weights; int8 states track fp32 states.
  assert abs(gap["bf16_sr"]) < 0.005 and abs(gap["fp32_int8"]) < 0.005 and abs(gap["bf16_sr_int8"]) < 0.01
  # Round to nearest drops the sub-ulp updates: most weights never move, the loss stalls.
  for name in ("optax_bf16", "bf16_rtn"):
    assert gap[name] > 0.2 and rows[name]["moved_fraction"] < 0.6
  assert rows["bf16_sr"]["moved_fraction"] > 0.95
  # A second moment rounded to nearest sticks (biased low: the run takes larger steps).
  assert gap["fp32_int8_rtn_v"] < min(gap["fp32_int8"], 0.0) - 0.004


def test_bench_lowp_smoke_checks_and_reports_every_configuration(tmp_path):
  configs = ["fp32", "bf16_sr_int8"]
  assert bench_lowp.main(["--smoke", "--configs", *configs, "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "bench_lowp.json").read_text())
  rows = result["rows"]
  assert {(r["config"], r["impl"]) for r in rows} == {
      ("optax_fp32", "optax_fp32"), ("optax_bf16", "optax_bf16"), ("fp32", "xla"), ("fp32", "pallas"),
      ("bf16_sr_int8", "xla"), ("bf16_sr_int8", "pallas")}
  for row in rows:
    assert row["status"] == "ok", row
    assert row["ms"] > 0 and row["bytes_per_param"] > 0
  assert "| 48x40x256 |" in (tmp_path / "bench_lowp.md").read_text()


def test_bench_lowp_mosaic_rows_are_the_kernel_or_say_why_not(tmp_path):
  """--impls mosaic: the Mosaic kernel (interpreter here) where it runs, checked against xla;
  elsewhere an 'unsupported' row with the kernel's reason, never the fallback timed."""
  assert bench_lowp.main(["--smoke", "--tokens", "64", "--shapes", "64x256", "40x256", "--configs",
                          "fp32", "bf16_sr_int8", "--impls", "xla", "mosaic", "--out", str(tmp_path)]) == 0
  rows = {(r["shape"], r["config"], r["impl"]): r
          for r in json.loads((tmp_path / "bench_lowp.json").read_text())["rows"]}
  for config in ("fp32", "bf16_sr_int8"):  # stochastic rounding and int8 states included
    row = rows[("64x64x256", config, "mosaic")]
    assert row["status"] == "ok" and row["ms"] > 0, row
    unsupported = rows[("64x40x256", config, "mosaic")]
    assert unsupported["status"] == "unsupported" and "K=40 must be a multiple of tile_m" in unsupported["error"]
    assert "ms" not in unsupported
