"""fused_linear_update equals optax applied to g = x.T @ dy, on every backend."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from pallas_kernels import mosaic
from pallas_kernels.mosaic import config as mosaic_config

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

# Optimizer cases: (id, forge/optax name, kwargs).
OPTIMIZERS = [
    ("adamw", "adamw", dict(learning_rate=1e-2, weight_decay=0.1)),
    ("nadamw", "nadamw", dict(learning_rate=1e-2, eps_root=1e-9)),
    ("adam", "adam", dict(learning_rate=1e-2)),
    ("radam", "radam", dict(learning_rate=1e-2, b2=0.9)),  # rectifies from step 3
    ("lion", "lion", dict(learning_rate=1e-3, weight_decay=0.1)),
    ("rmsprop_centered_momentum", "rmsprop", dict(learning_rate=1e-3, centered=True, momentum=0.9, initial_scale=0.1)),
    ("adagrad", "adagrad", dict(learning_rate=1e-2)),
    ("sgd_momentum", "sgd", dict(learning_rate=1e-2, momentum=0.9, nesterov=True)),
    ("sgd", "sgd", dict(learning_rate=1e-2)),
]
STEPS = 3


def _inputs(key, t, k, n, in_dtype, w_dtype):
  kx, kd, kw = jax.random.split(key, 3)
  x = jax.random.normal(kx, (t, k), jnp.float32).astype(in_dtype)
  dy = (jax.random.normal(kd, (t, n), jnp.float32) / np.sqrt(t)).astype(in_dtype)
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(w_dtype)
  return x, dy, w


def _optax_step(tx, x, dy, w, state):
  g = jax.lax.dot_general(
      x, dy, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
  )
  w32 = w.astype(jnp.float32)
  updates, state = tx.update(g, state, w32)
  return optax.apply_updates(w32, updates), state


def _tolerances(w_dtype):
  # Both sides sum the same bf16/f32 products in float32, in different orders:
  # the relative error of a T-term sum is ~ sqrt(T) * 2**-24, far under 1e-5.
  if w_dtype == jnp.bfloat16:
    return dict(rtol=2**-7, atol=2**-7)  # one bf16 ulp at |w| ~ 1
  return dict(rtol=1e-5, atol=1e-6)


def _compare(got, want, what, w_dtype, loose_atol):
  """Nearly every element to summation rounding; every element within `loose_atol`.

  A few elements are ill-conditioned: where the gradient sum cancels to nearly
  zero its relative error is large, and sign(.) (Lion) or Adam's first step
  (about g / |g|) turn that into an O(lr) difference. Such elements are rare;
  any real bug moves far more of them, or moves one by more than an update.
  """
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  close = np.isclose(got, want, **_tolerances(w_dtype))
  assert close.mean() >= 0.999, f"{what}: {(~close).sum()} of {close.size} elements differ"
  ulp = 2**-7 if w_dtype == jnp.bfloat16 else 0.0  # a bf16 rounding may flip too
  np.testing.assert_allclose(got, want, rtol=ulp, atol=loose_atol, err_msg=what)


def _run_case(backend, opt_case, t, k, n, in_dtype, w_dtype, seed=0):
  case_id, name, kwargs = opt_case
  ours = getattr(forge_jax, name)(**kwargs)
  theirs = getattr(optax, name)(**kwargs)
  key = jax.random.PRNGKey(seed)
  x, dy, w = _inputs(key, t, k, n, in_dtype, w_dtype)
  state = ours.init(w)
  w_ref, s_ref = w.astype(jnp.float32), theirs.init(w.astype(jnp.float32))
  step = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=ours, backend=backend))
  for i in range(STEPS):
    x, dy, _ = _inputs(jax.random.fold_in(key, i + 1), t, k, n, in_dtype, w_dtype)
    w, state = step(x, dy, w, state)
    w_ref, s_ref = _optax_step(theirs, x, dy, w_ref, s_ref)
    w_ref = w_ref.astype(w_dtype).astype(jnp.float32)  # the stored weight's rounding
    assert w.dtype == w_dtype
    # At most a few updates' worth (|u| <~ 3 lr per step for these rules).
    lr = kwargs["learning_rate"]
    _compare(w, w_ref, f"{case_id} {backend} w step {i}", w_dtype, 4 * lr * (i + 1))
    for slot in state._fields[1:]:
      want = _find(s_ref, slot)
      scale = float(jnp.max(jnp.abs(want)))
      _compare(getattr(state, slot), want, f"{case_id} {backend} {slot} step {i}", w_dtype,
               max(1e-4 * scale, _tolerances(w_dtype)["atol"]))
  assert int(state.count) == STEPS


def _find(state, name):
  for sub in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "_fields")):
    if hasattr(sub, "_fields") and name in sub._fields:
      return getattr(sub, name)
  raise KeyError(name)


@pytest.mark.parametrize("opt_case", OPTIMIZERS, ids=[c[0] for c in OPTIMIZERS])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_backend_matches_optax(opt_case, in_dtype):
  _run_case("xla", opt_case, 77, 200, 333, in_dtype, jnp.float32)


@pytest.mark.parametrize("opt_case", OPTIMIZERS, ids=[c[0] for c in OPTIMIZERS])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_interpret_backend_matches_optax(opt_case, in_dtype):
  # The Pallas kernel itself (interpret mode), with its per-shape default tiles
  # on a shape that is a multiple of nothing.
  _run_case("interpret", opt_case, 77, 200, 333, in_dtype, jnp.float32)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("opt_case", OPTIMIZERS[:1] + OPTIMIZERS[4:5], ids=["adamw", "lion"])
def test_bf16_weights(opt_case, backend):
  _run_case(backend, opt_case, 64, 48, 40, jnp.bfloat16, jnp.bfloat16)


def test_leading_dims_are_flattened():
  opt = forge_jax.adamw(1e-2)
  x, dy, w = _inputs(jax.random.PRNGKey(1), 24, 16, 8, jnp.float32, jnp.float32)
  state = opt.init(w)
  a = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla")
  b = forge_jax.fused_linear_update(x.reshape(2, 3, 4, 16), dy.reshape(2, 3, 4, 8), w, state, opt, backend="xla")
  np.testing.assert_array_equal(a[0], b[0])


def test_grad_sq_norm():
  opt = forge_jax.sgd(1e-2)
  x, dy, w = _inputs(jax.random.PRNGKey(2), 30, 20, 10, jnp.float32, jnp.float32)
  _, _, sq = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="xla", return_grad_sq_norm=True)
  g = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
  np.testing.assert_allclose(float(sq), float((g**2).sum()), rtol=1e-5)


def test_stacked_layer_updates_one_slice():
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  key = jax.random.PRNGKey(3)
  x, dy, _ = _inputs(key, 20, 12, 6, jnp.float32, jnp.float32)
  w = jax.random.normal(key, (4, 12, 6))
  state = opt.init(w)
  new_w, new_state = forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla", layer=jnp.int32(2))
  single_w, single_state = forge_jax.fused_linear_update(x, dy, w[2], opt.init(w[2]), opt, backend="xla")
  np.testing.assert_array_equal(new_w[2], single_w)
  np.testing.assert_array_equal(new_state.mu[2], single_state.mu)
  for l in (0, 1, 3):
    np.testing.assert_array_equal(new_w[l], w[l])
    np.testing.assert_array_equal(new_state.nu[l], state.nu[l])
  assert int(new_state.count) == 0  # advanced by the caller once per step
  for bad in (4, -1):  # a concrete index outside [0, L) is refused, not clamped
    with pytest.raises(ValueError, match=f"layer={bad} is out of range for 4 stacked weights"):
      forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla", layer=jnp.int32(bad))


def test_errors():
  opt = forge_jax.adamw(1e-2)
  x, dy, w = _inputs(jax.random.PRNGKey(4), 8, 6, 4, jnp.float32, jnp.float32)
  state = opt.init(w)
  with pytest.raises(ValueError, match="do not match a linear layer"):
    forge_jax.fused_linear_update(x, dy, w.T, opt.init(w.T), opt, backend="xla")
  with pytest.raises(ValueError, match="do not match a linear layer"):
    forge_jax.fused_linear_update(x[:7], dy, w, state, opt, backend="xla")
  with pytest.raises(ValueError, match="optimizer.init"):
    forge_jax.fused_linear_update(x, dy, w, forge_jax.lion(1e-3).init(w), opt, backend="xla")
  with pytest.raises(ValueError, match="for this very weight"):
    forge_jax.fused_linear_update(x, dy, w, opt.init(jnp.ones((3, 3))), opt, backend="xla")
  with pytest.raises(ValueError, match="floating"):
    forge_jax.fused_linear_update(x.astype(jnp.int32), dy, w, state, opt, backend="xla")
  with pytest.raises(ValueError, match="clip_by_global_norm"):
    forge_jax.fused_linear_update(x, dy, w, state, optax.adamw(1e-3), backend="xla")
  with pytest.raises(ValueError, match="is not one of"):
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="cuda")
  with pytest.raises(ValueError, match="stacked"):
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla", layer=jnp.int32(0))
  with pytest.raises(ValueError, match="is not a tile configuration"):
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="xla", config="garbage")
  with pytest.raises(ValueError, match="is not a TileConfig: backend='interpret'"):
    forge_jax.fused_linear_update(x, dy, w, state, opt, backend="interpret",
                                  config=mosaic.MosaicTileConfig())
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="needs a GPU"):
      forge_jax.fused_linear_update(x, dy, w, state, opt, backend="pallas")


def test_float16_inputs_on_a_gpu_without_the_mosaic_kernel_go_to_xla(monkeypatch):
  """"auto" falls back from the Mosaic kernel to the Triton one, which takes float32 and
  bfloat16 inputs only: float16 x/dy go to "xla" instead of failing (traced as on a
  non-Hopper GPU)."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  monkeypatch.setattr(mosaic_config, "device_problem", lambda: "needs a Hopper GPU (test)")
  opt = forge_jax.adamw(1e-2)
  x, dy, w = jnp.ones((64, 64), jnp.float16), jnp.ones((64, 128), jnp.float16), jnp.ones((64, 128))
  out = jax.eval_shape(lambda *a: forge_jax.fused_linear_update(*a, opt, backend="auto"),
                       x, dy, w, opt.init(w))
  assert out[0].shape == w.shape
  with pytest.raises(ValueError, match="float32 or bfloat16"):  # the Triton kernel itself says so
    jax.eval_shape(lambda *a: forge_jax.fused_linear_update(*a, opt, backend="pallas"),
                   x, dy, w, opt.init(w))


def test_no_tokens_is_the_decay_only_step_and_empty_weights_are_refused():
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  w = jnp.ones((64, 128))
  x, dy = jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 128), jnp.bfloat16)
  want, _ = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="xla")
  got, _ = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="interpret")
  np.testing.assert_array_equal(got, want)
  assert float(want[0, 0]) < 1.0  # decayed
  with pytest.raises(ValueError, match=r"w has shape \(0, 128\): a linear layer needs K, N >= 1"):
    forge_jax.fused_linear_update(jnp.zeros((4, 0)), jnp.zeros((4, 128)), jnp.ones((0, 128)),
                                  opt.init(jnp.ones((0, 128))), opt, backend="xla")


def test_int8_state_with_wrong_scale_shape_is_named_on_every_backend():
  opt = forge_jax.adamw(1e-2, precision=forge_jax.Precision(state_dtype="int8", min_quantized_size=0))
  w = jnp.ones((64, 128))
  state = opt.init(w)
  bad = state._replace(mu=dataclasses.replace(state.mu, scale=state.mu.scale.T))  # not block-major
  x, dy = jnp.ones((8, 64)), jnp.ones((8, 128))
  for backend in ("xla", "interpret"):
    with pytest.raises(ValueError, match=r"scale.shape=\(64, 2\) must be \(2, 64\)"):
      forge_jax.fused_linear_update(x, dy, w, bad, opt, backend=backend)
