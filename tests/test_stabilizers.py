"""Pool-free stabilizers: clipping by the previous norm, per-array clipping, update clipping,
Adam-atan2. Each one's optax face equals its kernel path, and train_step equals a hand-rolled
optax loop running the same rule."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from forge_jax import _fused
from forge_jax import _math
from pallas_kernels import mosaic as fm
from tests._lowering import skip_if_cuda_lowering_needs_a_gpu
from tests._gpu import gpu_case

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

F32, BF16 = jnp.float32, jnp.bfloat16
_TINY = np.finfo(np.float32).tiny


def _ulps(a, b):
  """Distance in float32 ulps (signed zeros equal)."""
  ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
  ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
  ia = np.where(ia < 0, -(2**31) - ia, ia)
  ib = np.where(ib < 0, -(2**31) - ib, ib)
  return np.abs(ia - ib)


# ----------------------------------------------------------------------------
# atan2 from elementary operations.
# ----------------------------------------------------------------------------


def test_portable_atan2_within_3_ulp():
  rng = np.random.default_rng(0)
  n = 200_000
  atan2 = jax.jit(_math.atan2)
  worst = 0
  for scale in (1e-30, 1e-3, 1.0, 1e3, 1e30):
    y = (rng.standard_normal(n) * scale).astype(np.float32)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    for xs in (x, np.abs(x)):  # both half planes; Adam-atan2 uses x >= 0
      want = np.arctan2(y.astype(np.float64), xs.astype(np.float64)).astype(np.float32)
      u = _ulps(atan2(y, xs), want)
      worst = max(worst, int(np.where(np.abs(want) < _TINY, 0, u).max()))  # normal results
  ratios = np.linspace(0, 1, 400_001, dtype=np.float32)  # every octant boundary region
  for y, x in ((ratios, np.ones_like(ratios)), (np.ones_like(ratios), ratios)):
    want = np.arctan2(y.astype(np.float64), x.astype(np.float64)).astype(np.float32)
    worst = max(worst, int(_ulps(atan2(y, x), want).max()))
  assert worst <= 3, worst


def test_portable_atan2_special_values():
  special = np.array([0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-3, -7.5], np.float32)
  y, x = (a.ravel() for a in np.meshgrid(special, special))
  got = np.asarray(jax.jit(_math.atan2)(y, x))
  want = np.arctan2(y, x)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  assert _ulps(got[ok], want[ok]).max() <= 3


# ----------------------------------------------------------------------------
# Adam-atan2.
# ----------------------------------------------------------------------------


def _adam_atan2_reference(grads, w, lr, b1, b2, a, b, wd):
  """Everett et al.'s update in float64 numpy, with numpy's arctan2."""
  w = np.asarray(w, np.float64)
  mu = np.zeros_like(w)
  nu = np.zeros_like(w)
  for t, g in enumerate(grads, start=1):
    g = np.asarray(g, np.float64)
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * g * g
    u = a * np.arctan2(mu / (1 - b1**t), b * np.sqrt(nu / (1 - b2**t))) + wd * w
    w = w - lr * u
  return w, mu, nu


def test_adam_atan2_matches_the_paper_rule():
  key = jax.random.PRNGKey(0)
  w = jax.random.normal(key, (32, 24))
  grads = [jax.random.normal(jax.random.fold_in(key, i), w.shape) * 10.0**i for i in range(4)]
  grads[1] = grads[1].at[0].set(0.0)  # a zero gradient in a row with history
  opt = forge_jax.adam_atan2(1e-2, b2=0.99, weight_decay=0.1)
  state, p = opt.init(w), w
  for g in grads:
    u, state = opt.update(g, state, p)
    p = optax.apply_updates(p, u)
  want_w, want_mu, want_nu = _adam_atan2_reference(grads, w, 1e-2, 0.9, 0.99, 1.27, 1.0, 0.1)
  np.testing.assert_allclose(np.asarray(p), want_w, rtol=2e-6, atol=2e-7)
  # float32 sums of terms up to 1000x larger: rounding relative to the largest element.
  for got, want in ((state.mu, want_mu), (state.nu, want_nu)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-7 * np.abs(want).max())


def test_adam_atan2_step_is_bounded_and_needs_no_epsilon():
  opt = forge_jax.adam_atan2(1.0, weight_decay=None)
  w = jnp.zeros((4,))
  g = jnp.array([1e15, -1e-15, 0.0, 3.0])
  u, state = opt.update(g, opt.init(w))
  # The first step is a * atan2(g, |g|): +-a*pi/4 whatever |g|, and 0 for g = 0 (rtol: the
  # float32 bias correction 1 - b2 is 1.3e-5 off 1e-3, as in optax.adam).
  quarter = 1.27 * np.pi / 4
  np.testing.assert_allclose(np.asarray(u), [-quarter, quarter, 0.0, -quarter], rtol=1e-5)
  # A second moment that underflows to 0 (Adam: m / eps) gives the bound a * pi / 2.
  u, _ = opt.update(jnp.array([0.0, 1e-30, 0.0, 0.0]), opt.init(w))
  np.testing.assert_allclose(np.asarray(u)[1], -1.27 * np.pi / 2, rtol=1e-6)


def test_adam_atan2_bad_arguments():
  with pytest.raises(ValueError, match="b=0.0 must be a finite number > 0"):
    forge_jax.adam_atan2(1e-3, b=0.0)
  with pytest.raises(ValueError, match="a=-1.0"):
    forge_jax.adam_atan2(1e-3, a=-1.0)


# ----------------------------------------------------------------------------
# Each stabilizer: its definition, on the optax face.
# ----------------------------------------------------------------------------


def _tree(key, scale=1.0):
  k1, k2 = jax.random.split(key)
  return {"a": jax.random.normal(k1, (8, 6)) * scale, "b": jax.random.normal(k2, (5,)) * 3 * scale}


def _run(opt, params, grads):
  state, ups = opt.init(params), []
  for g in grads:
    u, state = opt.update(g, state, params)
    ups.append(u)
  return ups, state


def test_clip_prev_norm_scales_by_the_previous_global_norm():
  key = jax.random.PRNGKey(1)
  params = _tree(key)
  grads = [_tree(jax.random.fold_in(key, i), scale=s) for i, s in enumerate((5.0, 0.01, 2.0))]
  ours, state = _run(forge_jax.sgd(0.1, momentum=0.9, clip_prev_norm=1.0), params, grads)
  norms = [float(optax.tree.norm(g)) for g in grads]
  scales = [1.0] + [min(1.0, 1.0 / n) for n in norms[:-1]]  # step 0 unclipped
  assert scales[1] < 0.5 and scales[2] == 1.0  # the cases this test is about
  want, _ = _run(forge_jax.sgd(0.1, momentum=0.9), params,
                 [jax.tree.map(lambda x, s=s: x * s, g) for g, s in zip(grads, scales)])
  for o, w in zip(ours, want):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), o, w)
  assert type(state).__name__ == "GlobalClipSGDMomentumState"
  # Every leaf carries the global norm of the last step.
  for leaf in jax.tree.leaves(state.prev_norm):
    np.testing.assert_allclose(float(leaf), norms[-1], rtol=1e-6)


def test_layer_clip_scales_each_array_by_its_own_history():
  key = jax.random.PRNGKey(2)
  params = _tree(key)
  steps = [1.0, 1.0, 1.0, 30.0, 30.0, 1.0]  # leaf "a" spikes at step 3; leaf "b" never
  grads = []
  for i, s in enumerate(steps):
    g = _tree(jax.random.fold_in(key, 10 + i))
    grads.append({"a": g["a"] * s, "b": g["b"]})
  lam, decay = 1.05, 0.9
  ours, state = _run(forge_jax.sgd(0.1, layer_clip=lam, layer_clip_decay=decay), params, grads)
  for name in ("a", "b"):
    prev, ema = 0.0, 0.0
    for t, (g, u) in enumerate(zip(grads, ours)):
      scale = min(1.0, lam * ema / prev) if ema > 0 and prev > 0 else 1.0
      np.testing.assert_allclose(u[name], -0.1 * scale * g[name], rtol=2e-6,
                                 err_msg=f"{name} step {t}")
      if name == "a" and t == 4:
        assert scale < 0.1  # the step after the spike is clipped back to the average
      if name == "b":
        assert scale > 0.8
      ema = decay * ema + (1 - decay) * min(prev, lam * ema) if ema > 0 else prev
      prev = float(jnp.linalg.norm(g[name]))
    np.testing.assert_allclose(state.prev_norm[name], prev, rtol=1e-6)
    np.testing.assert_allclose(state.norm_ema[name], ema, rtol=1e-5)
  assert type(state).__name__ == "LayerClipSGDState"


def test_update_clip_bounds_each_element_in_learning_rates():
  key = jax.random.PRNGKey(3)
  params = _tree(key)
  grads = [_tree(jax.random.fold_in(key, i), scale=10.0 ** (i % 2)) for i in range(3)]
  lr = optax.linear_schedule(1e-2, 1e-3, 3)
  plain, _ = _run(forge_jax.adamw(lr, weight_decay=0.5), params, grads)
  ours, state = _run(forge_jax.adamw(lr, weight_decay=0.5, update_clip=0.9), params, grads)
  assert type(state) is forge_jax.AdamState  # no step fields: the plain optimizer's state
  clipped = 0
  for t, (p, o) in enumerate(zip(plain, ours)):
    bound = 0.9 * float(lr(t))
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(o)):
      x, y = np.asarray(x), np.asarray(y)
      np.testing.assert_array_equal(y, np.clip(x, -np.float32(bound), np.float32(bound)))
      clipped += int(np.sum(np.abs(x) > bound))
  assert clipped > 0


def test_carried_norm_keeps_the_last_finite_one():
  prev = jnp.float32(3.0)
  assert float(forge_jax.carry_grad_norm(prev, jnp.float32(5.0))) == 5.0
  assert float(forge_jax.carry_grad_norm(prev, jnp.float32(jnp.inf))) == 3.0
  assert float(forge_jax.carry_grad_norm(prev, jnp.float32(jnp.nan))) == 3.0
  assert float(forge_jax.carry_grad_norm(prev, jnp.float32(5.0), applied=False)) == 3.0
  assert float(forge_jax.carry_grad_norm(prev, jnp.float32(5.0), applied=jnp.bool_(True))) == 5.0
  # The optax face carries the same way: an overflowing step leaves the last finite norm.
  opt = forge_jax.sgd(0.1, clip_prev_norm=1.0)
  w = jnp.zeros((3,))
  _, state = opt.update(jnp.array([3.0, 4.0, 0.0]), opt.init(w))
  _, state = opt.update(jnp.array([jnp.inf, 0.0, 0.0]), state)
  assert float(state.prev_norm) == 5.0


def test_stabilizer_errors():
  with pytest.raises(ValueError, match="clip_prev_norm=-1.0 must be a finite number > 0"):
    forge_jax.adamw(1e-3, clip_prev_norm=-1.0)
  with pytest.raises(ValueError, match="update_clip=inf"):
    forge_jax.adamw(1e-3, update_clip=float("inf"))
  with pytest.raises(ValueError, match="layer_clip_decay=1.0 must be .* < 1"):
    forge_jax.adamw(1e-3, layer_clip=1.05, layer_clip_decay=1.0)
  with pytest.raises(ValueError, match="pass one"):
    forge_jax.adamw(1e-3, clip_prev_norm=1.0, layer_clip=1.05)
  with pytest.raises(ValueError, match="already has stabilizers"):
    forge_jax.stabilize(forge_jax.adamw(1e-3, update_clip=1.0), clip_prev_norm=1.0)
  opt = forge_jax.nadamw(1e-3, clip_prev_norm=1.0, mu_dtype=jnp.bfloat16)  # partials take them too
  assert opt.rule.nesterov and opt.rule.mu_dtype == jnp.bfloat16 and opt.rule.name == "adam"


# ----------------------------------------------------------------------------
# Parity: the optax face equals the kernel path, on each backend.
# ----------------------------------------------------------------------------

CASES = [
    ("adamw_clip_prev_norm", lambda: forge_jax.adamw(1e-2, weight_decay=0.1, clip_prev_norm=1.0)),
    ("sgd_momentum_clip_prev_norm", lambda: forge_jax.sgd(1e-2, momentum=0.9, clip_prev_norm=1.0)),
    ("adamw_layer_clip", lambda: forge_jax.adamw(1e-2, layer_clip=1.05, layer_clip_decay=0.9)),
    ("adamw_update_clip", lambda: forge_jax.adamw(1e-2, weight_decay=0.1, update_clip=0.5)),
    ("adam_atan2", lambda: forge_jax.adam_atan2(1e-2, weight_decay=0.1)),
    ("adam_atan2_clip_prev_norm", lambda: forge_jax.adam_atan2(1e-2, clip_prev_norm=1.0)),
]
STEPS = 4


def _step_inputs(key, i, t, k, n, in_dtype):
  kx, kd = jax.random.split(jax.random.fold_in(key, i))
  x = jax.random.normal(kx, (t, k)).astype(in_dtype)
  # Growing gradients (norm ~10, 20, ...; a dip at step 2) make every clip bind somewhere.
  s = (1.0, 2.0, 0.05, 4.0)[i % 4] * (i + 1)
  dy = (jax.random.normal(kd, (t, n)) * s / np.sqrt(t)).astype(in_dtype)
  return x, dy


def _face_step(opt, x, dy, w, state):
  g = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=F32)
  u, state = opt.update(g, state, w)
  return optax.apply_updates(w, u), state


def _close(got, want, what, strict, lr, atol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if strict:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=atol, err_msg=what)
    return
  # Compiled kernels: where a gradient element cancels to nearly zero, its sum order decides its
  # sign, and Adam's early steps (about g / |g|) turn that into up to one update. Rare elements.
  close = np.isclose(got, want, rtol=2e-5, atol=atol)
  assert close.mean() >= 0.999, f"{what}: {(~close).sum()} of {close.size} elements differ"
  np.testing.assert_allclose(got, want, rtol=0, atol=max(atol, 4 * lr), err_msg=what)


def _parity(make_opt, backend, t, k, n, in_dtype, steps=STEPS, strict=True):
  opt = make_opt()
  key = jax.random.PRNGKey(7)
  w = jax.random.normal(jax.random.fold_in(key, 99), (k, n))
  face_w, face_s = w, opt.init(w)
  kern_w, kern_s = w, opt.init(w)
  fused = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=opt, backend=backend))
  face = jax.jit(functools.partial(_face_step, opt))
  scales = []
  for i in range(steps):
    x, dy = _step_inputs(key, i, t, k, n, in_dtype)
    if opt.rule.step_fields:
      scales.append(float(opt.rule.grad_scale(*opt.rule.step_values(face_s))))
    face_w, face_s = face(x, dy, face_w, face_s)
    kern_w, kern_s = fused(x, dy, kern_w, kern_s)
    lr = 1e-2 * (i + 1)
    _close(kern_w, face_w, f"{backend} w step {i}", strict, lr, 2e-6)
    for name, a, b in zip(kern_s._fields[1:], kern_s[1:], face_s[1:]):
      # The two sides sum x.T @ dy in different orders: where a sum cancels, its rounding is
      # relative to the largest element, not to itself.
      b = np.asarray(b)
      _close(a, b, f"{backend} {name} step {i}", strict, lr * np.abs(b).max(),
             2e-6 * np.abs(b).max())
    assert int(kern_s.count) == int(face_s.count) == i + 1
  if opt.rule.step_fields:
    assert min(scales) < 0.9, scales  # the clip bound on some step


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_path_matches_optax_face(case, backend):
  _parity(case[1], backend, 77, 40, 56, F32)


# Two stabilizers per case, and as few steps as show a clip that binds (``_parity`` asserts
# one does): the interpreter takes seconds a step on a CPU. The previous norm binds on step 1;
# layer_clip's scale, read from the state before each step, shows step 1's clip on step 2.
MOSAIC_CASES = [
    ("adamw_clip_prev_norm_update_clip",
     lambda: forge_jax.adamw(1e-2, weight_decay=0.1, clip_prev_norm=1.0, update_clip=0.5), 2),
    ("adam_atan2_layer_clip",
     lambda: forge_jax.adam_atan2(1e-2, layer_clip=1.05, layer_clip_decay=0.9), 3),
]


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_interpreter_matches_optax_face(case):
  with warnings.catch_warnings():
    warnings.simplefilter("error", _fused.BackendFallbackWarning)  # the kernel itself ran
    _parity(case[1], "mosaic_interpret", 64, 64, 64, BF16, steps=case[2])


@gpu_case("the compiled kernels need a GPU")
@pytest.mark.parametrize("backend", ["mosaic", "pallas"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gpu_kernels_match_optax_face(case, backend):
  """The compiled kernels (the atan2 spelling and the scalars in the real epilogue)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", _fused.BackendFallbackWarning)  # the kernel itself ran
    _parity(case[1], backend, 256, 256, 256, BF16, strict=False)


def test_stacked_layers_keep_their_own_norms():
  """A [L] stack of per-layer step fields: each layer call reads and writes its own entry."""
  opt = forge_jax.adamw(1e-2, layer_clip=1.05)
  key = jax.random.PRNGKey(5)
  w = jax.random.normal(key, (3, 16, 8))
  state = jax.vmap(opt.init)(w)
  assert state.prev_norm.shape == (3,)
  x, dy = _step_inputs(key, 0, 12, 16, 8, F32)
  step = jax.jit(functools.partial(forge_jax.fused_linear_update, optimizer=opt, backend="xla"))
  _, new = step(x, dy, w, state, layer=jnp.int32(1))
  g = x.T @ dy
  np.testing.assert_allclose(np.asarray(new.prev_norm), [0.0, float(jnp.linalg.norm(g)), 0.0],
                             rtol=1e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[CASES[0][0], CASES[4][0]])
def test_mosaic_kernel_lowers_for_cuda_without_a_libdevice_call(case):
  rule = case[1]().rule
  x = jax.ShapeDtypeStruct((512, 256), BF16)
  dy = jax.ShapeDtypeStruct((512, 512), BF16)
  w = jax.ShapeDtypeStruct((256, 512), F32)
  slots = tuple(jax.ShapeDtypeStruct((256, 512), F32) for _ in rule.slot_names)
  config = fm.default_config(x, dy, w, slots, compute_grad_sq_norm=True, num_sms=132)
  kernel = jax.jit(functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update,
                                     compute_grad_sq_norm=True, config=config))
  step = tuple(jnp.float32(2.0) for _ in rule.step_fields)
  with skip_if_cuda_lowering_needs_a_gpu():
    text = kernel.trace(x, dy, w, slots, rule.scalars(jnp.int32(3), *step)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_rule_has_no_atan2_primitive():
  """Mosaic GPU lowers atan2_p to math.atan2, a libdevice call; the rule never binds it."""
  rule = forge_jax.adam_atan2(1e-2).rule
  tile = jnp.ones((8, 8))
  jaxpr = jax.make_jaxpr(lambda g, w, s: rule.update(g, w, (g, g), s))(
      tile, tile, rule.scalars(jnp.int32(0)))
  assert "atan2" not in str(jaxpr)


# ----------------------------------------------------------------------------
# train_step: previous-norm clipping against a hand-rolled optax loop.
# ----------------------------------------------------------------------------


class _MLP(nn.Module):
  opt: object = None

  @nn.compact
  def __call__(self, x):
    dense = lambda f, name: (nn.Dense(f, name=name) if self.opt is None else
                             forge_jax.Dense(f, optimizer=self.opt, backend="xla", name=name))
    x = nn.Dense(16, name="embed")(x)  # trained by the optax form in both
    x = jax.nn.gelu(dense(24, "l0")(x))
    return dense(4, "out")(x)


def _mse(apply_fn, variables, batch):
  return jnp.mean((apply_fn(variables, batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("kwargs", [dict(clip_prev_norm=0.5), dict(layer_clip=1.05)],
                         ids=["clip_prev_norm", "layer_clip"])
def test_train_step_matches_optax_loop_with_the_same_rule(kwargs):
  opt = forge_jax.adamw(3e-2, weight_decay=0.1, **kwargs)
  model_f, model_o = _MLP(opt), _MLP(None)
  key = jax.random.PRNGKey(0)
  batches = []
  for i in range(5):
    kx, ky = jax.random.split(jax.random.fold_in(key, i))
    scale = 40.0 if i == 3 else 1.0  # a spike
    batches.append({"x": jax.random.normal(kx, (16, 8)), "y": scale * jax.random.normal(ky, (16, 4))})
  variables = model_f.init(key, batches[0]["x"])
  params_o = jax.tree.map(jnp.copy, model_o.init(key, batches[0]["x"])["params"])
  state = forge_jax.TrainState.create(model_f.apply, variables, opt)
  opt_state = opt.init(params_o)  # the optax face measures the norm of the whole tree itself

  @jax.jit
  def optax_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: _mse(model_o.apply, {"params": p}, batch))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

  # One loss function for every step: train_step's jit keys its cache on it (a new partial
  # each step compiles the step again).
  loss = functools.partial(_mse, model_f.apply)
  prev, scales = 0.0, []
  for batch in batches:
    if "clip_prev_norm" in kwargs:
      want_scale = min(1.0, 0.5 / prev) if prev > 0 else 1.0
    else:
      want_scale = min(float(jnp.min(opt.rule.grad_scale(*s))) for s in zip(
          *[jax.tree.leaves(t) for t in opt.rule.step_values(opt_state)]))
    state, metrics = forge_jax.train_step(state, batch, loss)
    params_o, opt_state, loss_o, norm_o = optax_step(params_o, opt_state, batch)
    np.testing.assert_allclose(metrics["loss"], loss_o, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], norm_o, rtol=1e-4)
    np.testing.assert_allclose(metrics["clip_scale"], want_scale, rtol=1e-4)
    np.testing.assert_allclose(state.prev_grad_norm, norm_o, rtol=1e-4)
    scales.append(float(metrics["clip_scale"]))
    prev = float(norm_o)
  assert min(scales) < 0.5, scales
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                          jax.tree.leaves(params_o), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  # The kernels' step fields are the optax face's (global mode: the global norm everywhere).
  for name in opt.rule.step_fields:
    for layer in ("l0", "out"):
      np.testing.assert_allclose(getattr(state.forge_state[layer]["kernel"].opt, name),
                                 getattr(opt_state, name)[layer]["kernel"], rtol=1e-4)


def test_train_step_without_stabilizers_reports_scale_one():
  opt = forge_jax.adamw(1e-2)
  model = _MLP(opt)
  batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros((4, 4))}
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  state, metrics = forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  assert float(metrics["clip_scale"]) == 1.0
  np.testing.assert_allclose(state.prev_grad_norm, metrics["grad_norm"])


# ----------------------------------------------------------------------------
# The ablation script's spike count.
# ----------------------------------------------------------------------------


def test_spikes_are_counted_and_sized():
  from experiments import stabilizers  # pylint: disable=g-import-not-at-top
  losses = [5.0, 4.0, 3.5, 3.4, 4.5, 4.8, 3.3, 3.2, 3.1, float("nan"), 3.0, 3.0]
  events = stabilizers.spikes(losses, window=3, nat=0.5)
  assert [e["step"] for e in events] == [4, 9]
  np.testing.assert_allclose(events[0]["size"], 4.8 - 3.4)  # the largest excess of the run
  assert events[1]["size"] == float("inf")  # a non-finite loss is a spike
  assert stabilizers.spikes([3.0, 3.4, 3.0], window=3, nat=0.5) == []
  with pytest.raises(ValueError, match="--rows: 'optax_sgd'"):
    stabilizers.parse_args(["--rows", "optax_adamw,optax_sgd"])


def test_scanned_stack_clips_by_the_global_norm_and_keeps_per_layer_norms():
  """A ScannedStack's kernels: clip_prev_norm matches the optax loop (the global norm reaches
  every layer's [L] field); layer_clip keeps one norm per layer of the stack."""
  from tests.test_flax_binding import Transformer  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(3)
  batches = [{"x": jax.random.normal(jax.random.fold_in(key, i), (2, 6, 8)),
              "y": (8.0 if i == 1 else 1.0) * jax.random.normal(jax.random.fold_in(key, 9 + i), (2, 6, 4))}
             for i in range(3)]
  for kwargs, steps in ((dict(clip_prev_norm=0.5), 3), (dict(layer_clip=1.05), 2)):
    opt = forge_jax.adamw(3e-2, weight_decay=0.1, **kwargs)
    model_f, model_o = Transformer(opt, scan=True), Transformer(None, scan=True)
    variables = model_f.init(key, batches[0]["x"])
    params_o = jax.tree.map(jnp.copy, variables["params"])  # model_o's init: the same parameters
    state = forge_jax.TrainState.create(model_f.apply, variables, opt)
    opt_state = opt.init(params_o)

    @jax.jit
    def optax_step(params, opt_state, batch, model_o=model_o, opt=opt):
      grads = jax.grad(lambda p: _mse(model_o.apply, {"params": p}, batch))(params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, grads

    layer_norms = []
    loss = functools.partial(_mse, model_f.apply)  # one per run: train_step's jit keys on it
    for batch in batches[:steps]:
      state, metrics = forge_jax.train_step(state, batch, loss)
      params_o, opt_state, grads = optax_step(params_o, opt_state, batch)
      layer_norms.append(np.sqrt(np.sum(np.square(
          np.asarray(grads["stack"]["layers"]["block"]["up"]["kernel"])), axis=(1, 2))))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                            jax.tree.leaves(params_o), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                 err_msg=f"{kwargs} {jax.tree_util.keystr(path)}")
    up = state.forge_state["stack"]["layers"]["block"]["up"]["kernel"].opt
    assert up.prev_norm.shape == (2,)
    if "clip_prev_norm" in kwargs:
      assert float(metrics["clip_scale"]) < 1.0
      np.testing.assert_allclose(up.prev_norm, [float(state.prev_grad_norm)] * 2, rtol=1e-6)
    else:  # steps 0 and 1 are unclipped; each layer holds its own norms
      np.testing.assert_allclose(up.prev_norm, layer_norms[1], rtol=1e-4)
      np.testing.assert_allclose(up.norm_ema, layer_norms[0], rtol=1e-4)
      assert abs(layer_norms[1][0] - layer_norms[1][1]) > 1e-3 * layer_norms[1][0]


def test_a_step_skipped_for_a_non_finite_loss_keeps_the_previous_norm():
  """The non-finite guard leaves the carried norm and every ``prev_norm`` field as they were, so
  the next step clips by the last finite norm."""
  opt = forge_jax.adamw(1e-2, clip_prev_norm=0.5)
  model = _MLP(opt)
  batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros((4, 4))}
  loss = functools.partial(_mse, model.apply)
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  state, metrics = forge_jax.train_step(state, batch, loss)
  norm = float(metrics["grad_norm"])
  assert norm > 0.5  # so the next step clips
  before = jax.device_get((state.prev_grad_norm, state.forge_state, state.opt_state))
  state, metrics = forge_jax.train_step(state, {**batch, "x": batch["x"].at[0, 0].set(jnp.nan)}, loss)
  assert bool(metrics["skipped"])
  after = jax.device_get((state.prev_grad_norm, state.forge_state, state.opt_state))
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(a, b)
  state, metrics = forge_jax.train_step(state, batch, loss)
  np.testing.assert_allclose(float(metrics["clip_scale"]), 0.5 / norm, rtol=1e-6)
