"""forge_jax.Dense / ScannedStack / train_step equal flax.linen.Dense + optax."""

import functools
import re
import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from tests._jaxpr import eqns

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles")  # tests/conftest.py
# The default CPU emitter for the comparisons with optax, which hold to a few float32 ulps over
# several steps; the legacy one (tests/conftest.py: legacy_cpu_emitter_for_test) for the tests
# that compare nothing with optax (HLO, errors, warnings, bit-exact reruns of one program).

OPTIMIZERS = [
    ("adamw", dict(learning_rate=1e-2, weight_decay=0.1)),
    ("nadamw", dict(learning_rate=1e-2)),
    ("radam", dict(learning_rate=1e-2, b2=0.9)),
    ("lion", dict(learning_rate=1e-3)),
    ("rmsprop", dict(learning_rate=1e-3, centered=True, momentum=0.9)),
    ("adagrad", dict(learning_rate=1e-2)),
    ("sgd", dict(learning_rate=1e-2, momentum=0.9, nesterov=True)),
    ("sgd", dict(learning_rate=1e-2)),
]
IDS = ["adamw", "nadamw", "radam", "lion", "rmsprop_c_m", "adagrad", "sgd_nesterov", "sgd"]
STEPS = 4


def _dense(opt, features, name, use_bias=True):
  if opt is None:
    return nn.Dense(features, use_bias=use_bias, name=name)
  return forge_jax.Dense(features, use_bias=use_bias, optimizer=opt, backend="xla", name=name)


class MLP(nn.Module):
  opt: object = None

  @nn.compact
  def __call__(self, x):
    x = jax.nn.gelu(_dense(self.opt, 24, "l0")(x))
    x = jax.nn.gelu(_dense(self.opt, 24, "l1")(x))
    return _dense(self.opt, 4, "out")(x)


class Block(nn.Module):
  """A tiny pre-norm transformer block (attention + MLP)."""

  opt: object = None
  heads: int = 2

  @nn.compact
  def __call__(self, x_BxLxD, mask):
    d = x_BxLxD.shape[-1]
    h = nn.RMSNorm(name="attn_norm")(x_BxLxD)
    qkv = _dense(self.opt, 3 * d, "qkv", use_bias=False)(h)
    q, k, v = jnp.split(qkv.reshape(*h.shape[:2], 3 * self.heads, d // self.heads), 3, axis=2)
    att = jax.nn.dot_product_attention(q, k, v, mask=mask)
    x_BxLxD = x_BxLxD + _dense(self.opt, d, "o", use_bias=False)(att.reshape(h.shape))
    h = nn.RMSNorm(name="mlp_norm")(x_BxLxD)
    h = jax.nn.silu(_dense(self.opt, 2 * d, "up")(h))
    return x_BxLxD + _dense(self.opt, d, "down")(h)


class Transformer(nn.Module):
  opt: object = None
  layers: int = 2
  scan: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="embed")(x)  # optax-managed in both variants
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]), dtype=jnp.bool_)
    if self.scan:
      x = forge_jax.ScannedStack(functools.partial(Block, self.opt), self.layers, name="stack")(x, mask)
    else:
      for i in range(self.layers):
        x = Block(self.opt, name=f"block_{i}")(x, mask)
    return nn.Dense(4, name="head")(x)


def _mse(apply_fn, variables, batch):
  return jnp.mean((apply_fn(variables, batch["x"]) - batch["y"]) ** 2)


def _batches(shape_x, shape_y):
  key = jax.random.PRNGKey(42)
  out = []
  for i in range(STEPS):
    kx, ky = jax.random.split(jax.random.fold_in(key, i))
    out.append({"x": jax.random.normal(kx, shape_x), "y": jax.random.normal(ky, shape_y)})
  return out


def _find(state, name):
  for sub in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "_fields")):
    if hasattr(sub, "_fields") and name in sub._fields:
      return getattr(sub, name)
  raise KeyError(name)


# The optax side's initial params, per reference model and input shape: the same for every
# optimizer (a scanned model's init compiles its scan, about 2 s on CPU, once per model).
_REFERENCE_PARAMS = {}


def _reference_params(model_o, x):
  key = (repr(model_o), x.shape, x.dtype)
  if key not in _REFERENCE_PARAMS:
    _REFERENCE_PARAMS[key] = model_o.init(jax.random.PRNGKey(0), x)["params"]
  return _REFERENCE_PARAMS[key]


def _run_parity(make_model, batches, name, kwargs):
  ours = getattr(forge_jax, name)(**kwargs)
  theirs = getattr(optax, name)(**kwargs)
  model_f, model_o = make_model(ours), make_model(None)
  variables = model_f.init(jax.random.PRNGKey(0), batches[0]["x"])
  params_o = jax.tree.map(jnp.copy, _reference_params(model_o, batches[0]["x"]))
  _assert_tree_close(variables["params"], params_o, "init", rtol=0, atol=0)
  state = forge_jax.TrainState.create(model_f.apply, variables, ours)
  opt_state = theirs.init(params_o)
  loss_f = functools.partial(_mse, model_f.apply)

  @jax.jit
  def optax_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: _mse(model_o.apply, {"params": p}, batch))(params)
    updates, opt_state = theirs.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

  for batch in batches:
    state, metrics = forge_jax.train_step(state, batch, loss_f)
    params_o, opt_state, loss_o, norm_o = optax_step(params_o, opt_state, batch)
    np.testing.assert_allclose(metrics["loss"], loss_o, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], norm_o, rtol=1e-4)
  _assert_tree_close(state.params, params_o, f"{name} params")
  # Every FORGE kernel's slots equal optax's slots for that kernel.
  flat_forge = jax.tree_util.tree_flatten_with_path(
      state.forge_state, is_leaf=lambda x: isinstance(x, forge_jax.KernelState))[0]
  for path, kstate in flat_forge:
    keys = tuple(k.key for k in path)
    for slot in kstate.opt._fields[1:]:
      want = _find(opt_state, slot)
      for k in keys:
        want = want[k]
      _assert_tree_close(getattr(kstate.opt, slot), want, f"{name} {keys} {slot}")
    assert np.all(np.asarray(kstate.opt.count) == STEPS)
  assert int(state.step) == STEPS


def _assert_tree_close(a, b, what, rtol=1e-4, atol=1e-5):
  # fp32 parity: the fused path sums x.T @ dy in another order than autodiff's
  # dot, so values agree to accumulation rounding, amplified by a few steps of
  # Adam-style normalization (relative 1e-4 is far above that, far below a bug).
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("case", OPTIMIZERS, ids=IDS)
def test_mlp_matches_optax(case):
  name, kwargs = case
  _run_parity(lambda opt: MLP(opt), _batches((16, 8), (16, 4)), name, kwargs)


# Scanned layers (stacked slots; the optax-managed embed, norms and head) with one optimizer per
# slot layout: two slots (adamw), one (lion), three (centered rmsprop with momentum), none (sgd).
# test_mlp_matches_optax runs every rule; what scanning adds (stacking, slicing and the in-place
# stacked update of each slot) depends on the slots, not on the rule. Unrolled with AdamW only:
# what the unrolled transformer adds (3-d inputs, forge and optax params in one tree) does not
# depend on the optimizer either.
_SCANNED = [IDS.index(i) for i in ("adamw", "lion", "rmsprop_c_m", "sgd")]


@pytest.mark.parametrize("case, scan", [(OPTIMIZERS[0], False)]
                         + [(OPTIMIZERS[i], True) for i in _SCANNED],
                         ids=[f"{IDS[0]}-unrolled"] + [f"{IDS[i]}-scanned" for i in _SCANNED])
def test_transformer_matches_optax(case, scan):
  name, kwargs = case
  _run_parity(lambda opt: Transformer(opt, scan=scan), _batches((2, 6, 8), (2, 6, 4)), name, kwargs)


def _matrices_only(params):
  # A mask that reads every leaf (flax's path_aware_map visits them all), as users write them.
  return flax.traverse_util.path_aware_map(lambda path, x: x.ndim > 1, params)


def test_callable_mask_matches_optax():
  """A callable weight-decay mask sees the whole params, FORGE kernels included, as in optax."""
  kwargs = dict(learning_rate=1e-2, weight_decay=0.5, mask=_matrices_only)
  _run_parity(MLP, _batches((16, 8), (16, 4)), "adamw", kwargs)


class _BatchNormNet(nn.Module):
  opt: object = None

  @nn.compact
  def __call__(self, x):
    dense = ((lambda n, **kw: forge_jax.Dense(n, optimizer=self.opt, **kw)) if self.opt
             else nn.Dense)
    # No bias before the norm: its gradient is zero but for rounding, which Adam magnifies.
    x = nn.BatchNorm(use_running_average=False)(dense(32, use_bias=False)(x))
    return dense(4)(nn.relu(x))


def test_batch_stats_through_aux_match_optax():
  """A collection updated in the forward pass (BatchNorm's running statistics), applied with
  ``mutable=`` in the loss and put back from the aux as the README shows: the weights, the
  BatchNorm's parameters and its running statistics after three steps equal optax's."""
  ours, theirs = forge_jax.adamw(1e-2), optax.adamw(1e-2)
  model_f, model_o = _BatchNormNet(ours), _BatchNormNet()
  batches = _batches((16, 8), (16, 4))
  state = forge_jax.TrainState.create(model_f.apply, model_f.init(jax.random.PRNGKey(0), batches[0]["x"]), ours)
  variables_o = model_o.init(jax.random.PRNGKey(0), batches[0]["x"])
  params_o, stats_o = variables_o["params"], variables_o["batch_stats"]
  opt_state = theirs.init(params_o)

  def loss_fn(apply_fn, variables, batch):
    y, updates = apply_fn(variables, batch["x"], mutable=["batch_stats"])
    return jnp.mean((y - batch["y"]) ** 2), updates

  @jax.jit
  def optax_step(params, stats, opt_state, batch):
    (loss, updates), grads = jax.value_and_grad(
        lambda p: loss_fn(model_o.apply, {"params": p, "batch_stats": stats}, batch), has_aux=True)(params)
    new, opt_state = theirs.update(grads, opt_state, params)
    return optax.apply_updates(params, new), updates["batch_stats"], opt_state, loss

  for batch in batches:
    state, metrics = forge_jax.train_step(state, batch, functools.partial(loss_fn, model_f.apply),
                                          has_aux=True)
    state = state.replace(model_state={**state.model_state, **metrics.pop("aux")})
    params_o, stats_o, opt_state, loss_o = optax_step(params_o, stats_o, opt_state, batch)
    np.testing.assert_allclose(metrics["loss"], loss_o, rtol=1e-5)
  _assert_tree_close(state.params, params_o, "params")
  _assert_tree_close(state.model_state["batch_stats"], stats_o, "batch_stats")


def _copies(hlo_text):
  return [l.strip() for l in hlo_text.splitlines() if re.search(r"= \S+ copy\(", l)]


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
def test_unrolled_train_step_is_in_place():
  opt = forge_jax.adamw(1e-2)
  model = MLP(opt)
  batch = _batches((16, 8), (16, 4))[0]
  variables = model.init(jax.random.PRNGKey(0), batch["x"])
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  compiled = forge_jax.train_step.lower(state, batch, functools.partial(_mse, model.apply)).compile()
  forge_shapes = {f"f32[{','.join(map(str, s))}]" for s in [(8, 24), (24, 24), (24, 4)]}
  bad = [c for c in _copies(compiled.as_text()) if any(s + "{" in c for s in forge_shapes)]
  assert not bad, "copies of FORGE weight/state buffers:\n" + "\n".join(bad)
  stats = compiled.memory_analysis()
  batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
  assert stats.alias_size_in_bytes == stats.argument_size_in_bytes - batch_bytes


def test_layers_below_wait_for_each_update():
  """Each unstacked FORGE layer's dX leaves its backward through one optimization barrier with
  the updated kernel, so the layers below (everything downstream of dX) run after the update and
  its dY dies there. Without it XLA scheduled the LM head's update after the decoder's backward
  at 120 x 1024 tokens of Llama-3.1-8B with int8 states, holding 29.4 GiB of dlogits through it
  (experiments/results/h200/live_jumps, head_barrier)."""
  opt = forge_jax.adamw(1e-2)
  model = MLP(opt)
  batch = _batches((16, 8), (16, 4))[0]
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  jaxpr = jax.make_jaxpr(lambda s, b: forge_jax.train_step(s, b, functools.partial(_mse, model.apply)))(
      state, batch)
  barriers = [{tuple(v.aval.shape) for v in e.outvars} for e in eqns(jaxpr.jaxpr)
              if e.primitive.name == "optimization_barrier"]
  for kernel, x in [((8, 24), (16, 8)), ((24, 24), (16, 24)), ((24, 4), (16, 24))]:
    assert any({kernel, x} <= shapes for shapes in barriers), (kernel, x, barriers)


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
@pytest.mark.parametrize("case", [OPTIMIZERS[0], OPTIMIZERS[4], OPTIMIZERS[6]], ids=["adamw", "rmsprop_c_m", "sgd_nesterov"])
def test_scanned_train_step_is_in_place(case):
  """The stacked weights and states of a ScannedStack are updated in place by the xla
  backend: no stack-sized copies in the compiled step (XLA:CPU added two per stacked
  slot per layer before the slots' writes were ordered after the weight's)."""
  name, kwargs = case
  opt = getattr(forge_jax, name)(**kwargs)
  model = Transformer(opt, layers=3, scan=True)
  batch = _batches((2, 6, 8), (2, 6, 4))[0]
  variables = model.init(jax.random.PRNGKey(0), batch["x"])
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  compiled = forge_jax.train_step.lower(state, batch, functools.partial(_mse, model.apply)).compile()
  stacks = {f"[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state.forge_state) if x.ndim == 3}
  assert len(stacks) == 4  # qkv, o, up, down
  bad = [c for c in _copies(compiled.as_text()) if any(s + "{" in c.split(" copy(")[0] for s in stacks)]
  assert not bad, "copies of stacked FORGE weight/state buffers:\n" + "\n".join(bad)
  stats = compiled.memory_analysis()
  batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
  assert stats.alias_size_in_bytes == stats.argument_size_in_bytes - batch_bytes


class _TwoHeads(nn.Module):
  opt: object = None

  @nn.compact
  def __call__(self, x, use_b=True, stop_b=False):
    a = _dense(self.opt, 4, "a")(x)
    b = _dense(self.opt, 4, "b")(x)
    if stop_b:
      b = jax.lax.stop_gradient(b)
    return a + b if use_b else a


class _BlockWithDeadBranch(nn.Module):
  opt: object = None

  @nn.compact
  def __call__(self, x):
    _dense(self.opt, 8, "dead", use_bias=False)(x)  # its output never reaches the block's
    return x + _dense(self.opt, 8, "live", use_bias=False)(x)


def _mse_kw(apply_fn, kw, variables, batch):
  return jnp.mean((apply_fn(variables, batch["x"], **kw) - batch["y"]) ** 2)


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
@pytest.mark.parametrize("kw", [dict(use_b=False), dict(stop_b=True)], ids=["unused", "stop_gradient"])
def test_kernel_without_backward_pass_warns(kw):
  """A FORGE kernel without a backward pass in a step (its output does not reach the loss)
  keeps its weight, optimizer state and count bit for bit, and train_step warns, naming the
  layer; the other layers train as usual."""
  opt = forge_jax.adamw(1e-2)
  model = _TwoHeads(opt)
  batch = _batches((4, 8), (4, 4))[0]
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  old = jax.tree.map(np.asarray, (state.params, state.forge_state))
  with pytest.warns(forge_jax.NoBackwardPassWarning, match=r"FORGE kernels \['b/kernel'\] was traced"):
    kept, _ = forge_jax.train_step(state, batch, lambda v, b: _mse_kw(model.apply, kw, v, b))
  np.testing.assert_array_equal(kept.params["b"]["kernel"], old[0]["b"]["kernel"])
  for a, b in zip(jax.tree.leaves(kept.forge_state["b"]), jax.tree.leaves(old[1]["b"]), strict=True):
    np.testing.assert_array_equal(a, b)  # the moments and the count
  assert not np.array_equal(kept.params["a"]["kernel"], old[0]["a"]["kernel"])
  assert int(kept.forge_state["a"]["kernel"].opt.count) == 1
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  new_state, _ = forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))  # both used
  assert float(jnp.abs(new_state.params["b"]["kernel"]).sum()) > 0


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
def test_cached_backward_pass_trains_without_a_warning():
  """A backward pass jax reuses from a cache (here a jax.jit'd apply, traced by the first
  step) is seen all the same: train_step reads the backward passes from the step's jaxpr."""
  opt = forge_jax.adamw(1e-2)
  model = MLP(opt)
  batch = _batches((16, 8), (16, 4))[0]
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  fwd = jax.jit(model.apply)

  def loss(scale, variables, b):
    return scale * jnp.mean((fwd(variables, b["x"]) - b["y"]) ** 2)

  before = np.asarray(state.params["l0"]["kernel"])  # the state is donated
  for scale in (1.0, 2.0):  # the second trace of train_step reuses fwd's cached backward pass
    with warnings.catch_warnings():
      warnings.simplefilter("error", forge_jax.NoBackwardPassWarning)
      state, metrics = forge_jax.train_step(state, batch, functools.partial(loss, scale))
    assert np.isfinite(float(metrics["loss"]))
  assert float(jnp.abs(state.params["l0"]["kernel"]).sum()) > 0
  assert not np.allclose(state.params["l0"]["kernel"], before)


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
def test_stacked_kernel_without_backward_pass_warns():
  opt = forge_jax.adamw(1e-2)

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedStack(functools.partial(_BlockWithDeadBranch, opt), 2, name="stack")(x)

  model = Stack()
  batch = _batches((4, 8), (4, 8))[0]
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), opt)
  block = lambda s: s.params["stack"]["layers"]["block"]
  old = jax.tree.map(np.asarray, block(state))
  with pytest.warns(forge_jax.NoBackwardPassWarning, match=r"\['stack/layers/block/dead/kernel'\] was traced"):
    state, _ = forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  np.testing.assert_array_equal(block(state)["dead"]["kernel"], old["dead"]["kernel"])
  assert not np.array_equal(block(state)["live"]["kernel"], old["live"]["kernel"])


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
def test_model_and_state_with_different_optimizers_is_an_error():
  model = MLP(forge_jax.adamw(1e-2))
  batch = _batches((16, 8), (16, 4))[0]
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]),
                                      forge_jax.adamw(1e-3))
  with pytest.raises(ValueError, match="pass the same optimizer to the model and to TrainState.create"):
    forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  # Two optimizers built alike, schedules included (functions, equal only to themselves), agree.
  make = lambda: forge_jax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10))
  model = MLP(make())
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]), make())
  forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  # A number and the constant schedule of it agree too.
  model = MLP(forge_jax.adamw(1e-2))
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), batch["x"]),
                                      forge_jax.adamw(optax.constant_schedule(1e-2)))
  forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  # Schedules that differ (a learning-rate sweep that rebuilt the TrainState, not the model): the
  # FORGE layers would follow the model's, the other parameters the TrainState's.
  model = MLP(forge_jax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)))
  state = forge_jax.TrainState.create(
      model.apply, model.init(jax.random.PRNGKey(0), batch["x"]),
      forge_jax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)))
  with pytest.raises(ValueError, match=r"learning_rate differs at step 1: 0\.005 against 0\.0005"):
    forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
  model = MLP(forge_jax.adamw(1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, 1000)))
  state = forge_jax.TrainState.create(
      model.apply, model.init(jax.random.PRNGKey(0), batch["x"]),
      forge_jax.adamw(1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, 2000)))
  with pytest.raises(ValueError, match=r"weight_decay differs at step 1: 0\.0999 against 0\.09995"):
    forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))


def test_scanned_block_with_dropout_is_an_error():
  opt = forge_jax.adamw(1e-2)

  class DropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dropout(0.1, deterministic=False)(_dense(opt, 8, "l")(x))

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedStack(DropoutBlock, 2, name="stack")(x)

  model = Stack()
  x = jnp.ones((4, 8))
  variables = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x)
  state = forge_jax.TrainState.create(model.apply, variables, opt)

  def loss(v, b):
    return jnp.mean(model.apply(v, b, rngs={"dropout": jax.random.PRNGKey(2)}) ** 2)

  with pytest.raises(ValueError, match="a block of ScannedStack stack draws random numbers"):
    forge_jax.train_step(state, x, loss)


def test_two_stacks_of_one_block_draw_independent_rounding_streams():
  """A FORGE kernel's stochastic-rounding stream hashes its full path, also inside a
  ScannedStack (whose blocks run as modules of their own): two stacks of the same block
  differ."""
  from forge_jax import _dense  # pylint: disable=g-import-not-at-top
  opt = forge_jax.adamw(1e-2)

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = forge_jax.ScannedStack(functools.partial(_BlockWithDeadBranch, opt), 2, name="enc")(x)
      return forge_jax.ScannedStack(functools.partial(_BlockWithDeadBranch, opt), 2, name="dec")(x)

  model = Two()
  x = jnp.ones((4, 8))
  variables = model.init(jax.random.PRNGKey(0), x)
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  with forge_jax.fused_backward(opt) as updated:
    _, vjp_fn = jax.vjp(lambda p, f: jnp.sum(model.apply({"params": p, "forge_state": f}, x)),
                        state.params, state.forge_state)
    vjp_fn(jnp.ones(()))
  streams = {name: _dense.kernel_stream((name, "layers", "block", "live")) for name in ("enc", "dec")}
  assert streams["enc"] != streams["dec"]
  assert set(streams.values()) <= updated  # each ran under the stream of its full path


def test_weight_used_twice_is_an_error():
  opt = forge_jax.sgd(1e-2)

  class Tied(nn.Module):
    @nn.compact
    def __call__(self, x):
      layer = forge_jax.Dense(8, optimizer=opt, name="shared")
      return layer(layer(x))

  model = Tied()
  x = jnp.ones((2, 8))
  with pytest.raises(ValueError, match="called 2 times in one apply"):
    model.init(jax.random.PRNGKey(0), x)


def test_dense_errors_and_eval_mode():
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="needs `optimizer=`"):
    forge_jax.Dense(4).init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="clip_by_global_norm"):
    forge_jax.Dense(4, optimizer=optax.adamw(1e-3)).init(jax.random.PRNGKey(0), x)
  layer = forge_jax.Dense(4, optimizer=forge_jax.adamw(1e-3))
  variables = layer.init(jax.random.PRNGKey(0), x)
  assert set(variables) == {"params", forge_jax.FORGE_STATE}
  ref = nn.Dense(4).apply({"params": variables["params"]}, x)
  np.testing.assert_allclose(layer.apply({"params": variables["params"]}, x), ref)
  np.testing.assert_allclose(layer.apply(variables, x), ref)


def test_mask_excluding_forge_kernel_is_an_error():
  opt = forge_jax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim == 1, p))
  model = MLP(opt)
  variables = model.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
  with pytest.raises(ValueError, match="mask excludes FORGE kernels"):
    forge_jax.TrainState.create(model.apply, variables, opt)


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
def test_plain_grad_through_forge_layers_is_an_error():
  opt = forge_jax.adamw(1e-2)
  model = MLP(opt)
  x = jnp.ones((4, 8))
  variables = model.init(jax.random.PRNGKey(0), x)
  loss = lambda p: jnp.sum(model.apply({**variables, "params": p}, x))
  with pytest.raises(ValueError, match="outside forge_jax.train_step"):
    jax.grad(loss)(variables["params"])
  with forge_jax.fused_backward():  # the escape hatch for custom steps
    new = jax.grad(loss)(variables["params"])
  assert new["l0"]["kernel"].shape == (8, 24)


# A data-parallel batch without tensor_parallel (an error) and a replicated one (trains): in
# tests/test_parallel.py, whose one 8-device process runs them.
