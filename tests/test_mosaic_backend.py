"""fused_linear_update(backend="mosaic" / "mosaic_interpret"): dispatch and fallback, on a CPU.

* ``"mosaic_interpret"`` runs the Mosaic GPU kernel under its interpreter and
  matches the ``"xla"`` backend at a shape the kernel takes.
* A call the kernel cannot take falls back (``"pallas"`` on a GPU, ``"xla"``
  off it) with one ``BackendFallbackWarning`` per reason. The GPU dispatch
  is checked with the platform faked and both kernels replaced by the
  reference (recording which one ran): nothing here compiles for a GPU.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from forge_jax import _fused
import pallas_kernels as fd
from pallas_kernels import mosaic as fm
from pallas_kernels import numerics as pallas_numerics
from pallas_kernels.mosaic import config as mosaic_config

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
  monkeypatch.setattr(_fused, "_FALLBACK_WARNED", set())


def _problem(t, k, n, *, in_dtype=BF16, w_dtype=F32, seed=0):
  kx, kd, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (t, k), F32).astype(in_dtype)
  dy = (jax.random.normal(kd, (t, n), F32) / np.sqrt(t)).astype(in_dtype)
  w = jax.random.normal(kw, (k, n), F32).astype(w_dtype)
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  state = opt.init(w)
  # Non-zero moments, so the rule's every term matters.
  state = state._replace(mu=0.1 * jnp.ones_like(state.mu), nu=0.01 * jnp.ones_like(state.nu))
  return x, dy, w, state, opt


def _fallback_warnings(record):
  return [r for r in record if issubclass(r.category, _fused.BackendFallbackWarning)]


def test_mosaic_needs_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU")
  x, dy, w, state, opt = _problem(64, 64, 128)
  with pytest.raises(ValueError, match="needs a GPU.*mosaic_interpret"):
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic")


def test_backends_listed():
  assert {"mosaic", "mosaic_interpret"} <= set(forge_jax.BACKENDS)


def test_mosaic_interpret_matches_xla():
  """The Mosaic kernel (interpreter) through the public entry, AdamW, a supported shape."""
  x, dy, w, state, opt = _problem(64, 64, 64)
  run = lambda backend: jax.jit(functools.partial(
      forge_jax.fused_linear_update, optimizer=opt, backend=backend, return_grad_sq_norm=True,
  ))(x, dy, w, state)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got_w, got_state, got_sq = run("mosaic_interpret")
  assert not _fallback_warnings(record)  # the kernel ran, no fallback
  want_w, want_state, want_sq = run("xla")
  np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=2e-5, atol=2e-6)
  for a, b in zip(got_state[1:], want_state[1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
  assert int(got_state.count) == int(want_state.count) == 1
  np.testing.assert_allclose(float(got_sq), float(want_sq), rtol=2e-5)


@pytest.mark.parametrize("w_dtype, weight_rounding", [(F32, "nearest"), (BF16, "stochastic")])
def test_mosaic_interpret_with_int8_states_matches_xla(w_dtype, weight_rounding):
  """int8 states in forge_jax's default maps (the second moment rounds stochastically), with a
  float32 weight or a stochastically rounded bf16 one, through the Mosaic kernel under its
  interpreter, from the public entry: the "xla" backend's weights, codes and scales (the same
  hashed bits; a code may differ by one where the float32 values differ in their last bits)."""
  x, dy, w, _, _ = _problem(64, 64, 128, w_dtype=w_dtype)
  opt = forge_jax.adamw(1e-2, weight_decay=0.1, precision=forge_jax.Precision(
      weight_rounding, state_dtype="int8", min_quantized_size=0))
  state = opt.init(w)
  for _ in range(2):  # a second step: non-zero int8 moments in, decoded in the epilogue
    w, state = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=opt,
                                         backend="xla"))(x, dy, w, state)
  run = lambda backend: jax.jit(functools.partial(
      forge_jax.fused_linear_update, optimizer=opt, backend=backend))(x, dy, w, state)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got_w, got_state = run("mosaic_interpret")
  assert not _fallback_warnings(record)  # the kernel ran
  want_w, want_state = run("xla")
  if w_dtype == BF16:
    assert np.mean(np.asarray(got_w, F32) == np.asarray(want_w, F32)) >= 0.999
  np.testing.assert_allclose(np.asarray(got_w, F32), np.asarray(want_w, F32), rtol=2e-5, atol=2e-6)
  for a, b in zip(got_state[1:], want_state[1:]):
    assert isinstance(a, pallas_numerics.QuantizedArray)
    diff = np.abs(np.asarray(a.codes, np.int32) - np.asarray(b.codes, np.int32))
    assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3
    np.testing.assert_allclose(np.asarray(a.scale), np.asarray(b.scale), rtol=1e-5)


def test_mosaic_interpret_falls_back_once_per_reason():
  """N=100 is off the kernel's tiling: the reference runs, with one warning naming why."""
  x, dy, w, state, opt = _problem(64, 64, 100)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic_interpret")
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic_interpret")
  fell = _fallback_warnings(record)
  assert len(fell) == 1, [str(r.message) for r in fell]
  assert "N=100" in str(fell[0].message) and "'xla'" in str(fell[0].message)
  want = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla")
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


# ----------------------------------------------------------------------------
# The GPU dispatch, with the platform faked and the kernels replaced.
# ----------------------------------------------------------------------------


# `fake_gpu` (tests/conftest.py): _fused sees a GPU; the kernel entries record and return the reference.


def test_mosaic_runs_the_mosaic_kernel_where_supported(fake_gpu):
  x, dy, w, state, opt = _problem(64, 128, 256)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic")
  assert not _fallback_warnings(record)
  [(name, config, interpret)] = fake_gpu
  assert name == "mosaic" and isinstance(config, fm.MosaicTileConfig) and not interpret
  # A config of its own is passed through.
  fake_gpu.clear()
  cfg = fm.MosaicTileConfig(tile_m=64, tile_n=64, epi_n=16)
  forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic", config=cfg)
  assert fake_gpu == [("mosaic", cfg, False)]


@pytest.mark.parametrize(
    "t, k, n, in_dtype, fragment",
    [
        (64, 128, 100, BF16, "N=100"),
        (50, 128, 256, BF16, "T=50"),
        (64, 128, 256, F32, "bfloat16"),  # wgmma reads a transposed x only in 16 bits
    ],
)
def test_mosaic_falls_back_to_pallas_once_per_reason(fake_gpu, t, k, n, in_dtype, fragment):
  x, dy, w, state, opt = _problem(t, k, n, in_dtype=in_dtype)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic")
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic")
  fell = _fallback_warnings(record)
  assert len(fell) == 1 and fragment in str(fell[0].message), [str(r.message) for r in fell]
  assert "'pallas'" in str(fell[0].message)
  assert [c[0] for c in fake_gpu] == ["pallas", "pallas"]
  assert all(c[1] is None for c in fake_gpu)  # no Mosaic config handed to the Triton kernel
  want = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla")
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_mosaic_falls_back_on_a_non_hopper_gpu(fake_gpu, monkeypatch):
  monkeypatch.setattr(mosaic_config, "device_problem", lambda: "needs a Hopper GPU (sm_90, wgmma); A100 is sm_8.0")
  x, dy, w, state, opt = _problem(64, 128, 256)
  with pytest.warns(_fused.BackendFallbackWarning, match="Hopper"):
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="mosaic")
  assert [c[0] for c in fake_gpu] == ["pallas"]


def test_mosaic_problem_codecs_and_configs():
  """The kernel takes float and int8 states (int8: one block per sub-tile row), whatever their
  rounding (stochastic rounding runs in the epilogue, under the interpreter too); a Triton
  config is an error."""
  x = jax.ShapeDtypeStruct((64, 128), BF16)
  dy = jax.ShapeDtypeStruct((64, 256), BF16)
  w = jax.ShapeDtypeStruct((128, 256), F32)

  def quantized(rounding):  # int8 codes + per-block scales
    qmap = pallas_numerics.QuantMap("float", signed=False, mantissa_bits=4, rounding=rounding)
    return pallas_numerics.QuantizedArray(jax.ShapeDtypeStruct((128, 256), jnp.int8),
                                          jax.ShapeDtypeStruct((4, 128), F32),
                                          pallas_numerics.BlockQuantized(qmap, 64))

  assert _fused._mosaic_problem(x, dy, w, (w, w), None, False)[0] is None
  for rounding in ("stochastic", "nearest"):
    reason, cfg = _fused._mosaic_problem(x, dy, w, (w, quantized(rounding)), None, False)
    assert reason is None and cfg.epi_n == 64, reason
  with pytest.raises(ValueError, match="MosaicTileConfig"):
    _fused._mosaic_problem(x, dy, w, (w,), fd.TileConfig(), False)


def test_auto_on_a_non_hopper_gpu_is_the_triton_kernel_except_for_int8_states(fake_gpu, monkeypatch):
  """"auto" takes the Triton kernel on a non-Hopper GPU (without a warning: it promised no
  kernel), but XLA's dot + update for int8 states (measured faster on the H200; see
  _fused._resolve_backend)."""
  monkeypatch.setattr(mosaic_config, "device_problem", lambda: "needs a Hopper GPU (sm_90, wgmma); A100 is sm_8.0")
  x, dy, w, state, opt = _problem(64, 128, 256)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="auto")
  assert not _fallback_warnings(record)
  assert [name for name, _, _ in fake_gpu] == ["pallas"]
  fake_gpu.clear()
  opt8 = forge_jax.adamw(1e-3, precision=forge_jax.Precision(state_dtype="int8", min_quantized_size=0))
  state8 = opt8.init(w)
  assert isinstance(state8.mu, forge_jax.QuantizedArray)
  new_w, _ = forge_jax.fused_linear_update(x, dy, w, state8, opt8, backend="auto")
  want, _ = forge_jax.fused_linear_update(x, dy, w, state8, opt8, backend="xla")
  assert fake_gpu == []  # neither kernel ran
  np.testing.assert_array_equal(new_w, want)


def test_auto_on_hopper_is_the_mosaic_kernel_with_a_silent_triton_fallback(fake_gpu):
  """On a Hopper GPU (what the faked GPU looks like to the kernel's device check) "auto" runs
  the Mosaic kernel; what it cannot take (here N off its tiling, or a Triton TileConfig) runs
  the Triton kernel without a warning; int8 states take the Mosaic kernel too."""
  x, dy, w, state, opt = _problem(64, 128, 256)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="auto")
    assert [c[0] for c in fake_gpu] == ["mosaic"]
    fake_gpu.clear()
    x2, dy2, w2, state2, opt2 = _problem(64, 128, 100)  # N=100: no Mosaic tiling divides it
    forge_jax.fused_linear_update(x2, dy2, w2, state2, opt2, backend="auto")
    assert [(c[0], c[1]) for c in fake_gpu] == [("pallas", None)]
    fake_gpu.clear()
    tiles = fd.TileConfig()
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="auto", config=tiles)
    assert [(c[0], c[1]) for c in fake_gpu] == [("pallas", tiles)]
  assert not _fallback_warnings(record)
  want = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla")
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  fake_gpu.clear()
  opt8 = forge_jax.adamw(1e-3, precision=forge_jax.Precision(state_dtype="int8", min_quantized_size=0))
  forge_jax.fused_linear_update(x, dy, w, opt8.init(w), opt8, backend="auto")
  assert [c[0] for c in fake_gpu] == ["mosaic"]


def test_auto_on_hopper_sends_stochastically_rounded_weights_to_the_kernel_or_xla(fake_gpu):
  """Stochastically rounded bfloat16 weights with float states: the Mosaic kernel, as for the
  same weight rounded to nearest (faster than XLA's dot + update on the large Llama-3.1-8B
  shapes, experiments/results/h200/int8_epilogue/lowp/); where the kernel cannot take the call,
  XLA, not the Triton kernel (slower than XLA there), and without a fallback warning."""
  for n, want_sr in ((256, ["mosaic"]), (100, [])):  # N=100: no Mosaic tiling divides it
    x, dy, w, _, _ = _problem(64, 128, n, w_dtype=BF16)
    for rounding, want_kernels in (("stochastic", want_sr), ("nearest", ["mosaic"] if n == 256 else ["pallas"])):
      opt = forge_jax.adamw(1e-3, precision=forge_jax.Precision(weight_rounding=rounding))
      fake_gpu.clear()
      with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, _ = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="auto")
      assert [c[0] for c in fake_gpu] == want_kernels, (n, rounding)
      assert not _fallback_warnings(record)
      want, _ = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="xla")
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))



@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_guarded_train_steps_lower_for_cuda_with_the_kernels_and_no_conditional(
    monkeypatch, scan, remat):
  """A bf16 model's whole train step, the non-finite guard on, lowered for CUDA on a CPU: its
  FORGE layers run the Mosaic kernel (the flag reaches kernels in a ScannedStack's loop and in
  nn.remat's checkpoint bodies) and the step has no conditional."""
  import re  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from experiments import bench_models  # pylint: disable=g-import-not-at-top
  from forge_jax import _train  # pylint: disable=g-import-not-at-top
  from tests._lowering import skip_if_cuda_lowering_needs_a_gpu  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  cfg = models.get_config(
      "tiny-llama", linear="forge", remat=remat, scan_layers=scan, forge_backend="mosaic",
      param_dtype="bfloat16", dtype="bfloat16", hidden_size=256, intermediate_size=512,
      num_heads=2, num_kv_heads=2, head_dim=128, vocab_size=512, attention="xla")
  opt = forge_jax.adamw(1e-3)
  model = models.CausalLM(cfg, optimizer=opt)
  state = jax.eval_shape(lambda: forge_jax.TrainState.create(
      model.apply, model.init(jax.random.PRNGKey(1), jnp.zeros((1, 128), jnp.int32)), opt))
  loss = functools.partial(bench_models._loss, model.apply)  # pylint: disable=protected-access
  with warnings.catch_warnings():
    warnings.simplefilter("error", _fused.BackendFallbackWarning)
    with skip_if_cuda_lowering_needs_a_gpu():
      traced = _train._train_step_jit.trace(  # pylint: disable=protected-access
          state, jax.ShapeDtypeStruct((1, 129), jnp.int32), loss, False, True)
      text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "@mosaic_gpu" in text
  assert not re.search(r"stablehlo\.(case|if)\b", text)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter, and XLA:CPU's option")
@pytest.mark.usefixtures("bf16_as_written")
def test_a_train_step_through_the_mosaic_kernel_equals_the_xla_route():
  """A train step of a bf16 model whose FORGE layers take stochastically rounded weights and
  int8 states in the default maps, the layers' updates in the Mosaic kernel (interpreter)
  against the "xla" route: the same loss, gradient norm, codes and scales, and the same
  weights but where the two float32 sums over T differ in their last bit at a rounding
  threshold (at most one in 10,000; with other random bits, as many differ as stochastic rounding
  moves off round-to-nearest). XLA keeps bf16 values as written for this (``bf16_as_written``,
  tests/conftest.py): by default it may keep one in float32 where it feeds its own fused
  consumer, where the kernel reads it rounded (seen here on the forward's output and the
  loss's cotangent)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  precision = forge_jax.Precision("stochastic", state_dtype="int8", min_quantized_size=0, seed=7)
  opt = forge_jax.adamw(1e-2, weight_decay=0.1, precision=precision)

  class TwoLayers(nn.Module):
    backend: str

    @nn.compact
    def __call__(self, x):
      dense = functools.partial(forge_jax.Dense, optimizer=opt, backend=self.backend,
                                use_bias=False, dtype=BF16, param_dtype=BF16)
      return dense(128)(dense(256)(x))

  kx, kc = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (128, 128), F32).astype(BF16)
  target = jax.random.normal(kc, (128, 128), F32).astype(BF16)
  loss_fn = lambda apply_fn, variables, batch: jnp.sum(  # noqa: E731
      jnp.square(apply_fn(variables, batch[0]).astype(F32) - batch[1].astype(F32))) * 2.0**-14
  results = {}
  for backend in ("mosaic_interpret", "xla"):
    model = TwoLayers(backend)
    state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(1), x), opt)
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      results[backend] = forge_jax.train_step(state, (x, target), functools.partial(loss_fn, model.apply))
    assert not _fallback_warnings(record)  # the kernel ran
  (got, got_metrics), (want, want_metrics) = results["mosaic_interpret"], results["xla"]
  assert float(got_metrics["loss"]) == float(want_metrics["loss"])
  np.testing.assert_allclose(float(got_metrics["grad_norm"]), float(want_metrics["grad_norm"]), rtol=1e-6)
  for name in ("Dense_0", "Dense_1"):
    a = np.asarray(got.params[name]["kernel"], F32)
    b = np.asarray(want.params[name]["kernel"], F32)
    assert np.mean(a != b) <= 1e-4, (name, np.mean(a != b))
    for s_got, s_want in zip(got.forge_state[name]["kernel"].opt[1:],
                             want.forge_state[name]["kernel"].opt[1:]):
      assert isinstance(s_got, forge_jax.QuantizedArray)
      np.testing.assert_array_equal(np.asarray(s_got.codes), np.asarray(s_want.codes), err_msg=name)
      np.testing.assert_allclose(np.asarray(s_got.scale), np.asarray(s_want.scale), rtol=1e-6)
