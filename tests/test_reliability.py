"""Nothing silently wrong: every unsupported reuse of a FORGE layer is refused before anything
changes, a non-finite loss skips the step, and what a non-finite gradient does is pinned."""

import functools
import os
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from forge_jax import _fused
from tests._jaxpr import eqns
from tests._gpu import gpu_marks

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dense(opt, features, name, backend="xla", dtype=None):
  return forge_jax.Dense(features, optimizer=opt, backend=backend, name=name, dtype=dtype)


class Block(nn.Module):
  opt: object

  @nn.compact
  def __call__(self, x):
    return x + jnp.tanh(_dense(self.opt, 8, "l")(x))


class Twice(nn.Module):
  """A parent holding one Block, called twice: its Dense runs two backward passes."""

  opt: object

  @nn.compact
  def __call__(self, x):
    b = Block(self.opt, name="b")
    return _dense(self.opt, 4, "head")(b(b(x)))


class Net(nn.Module):
  opt: object
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block) if self.remat else Block
    x = block(self.opt, name="b0")(x)
    x = block(self.opt, name="b1")(x)
    return _dense(self.opt, 4, "head")(x)


class Scanned(nn.Module):
  """nn.scan over a FORGE block (weights shared by broadcast, or stacked per layer)."""

  opt: object
  shared: bool = True

  @nn.compact
  def __call__(self, x):
    body = lambda mdl, c, _: (mdl(c), None)
    axes = dict(variable_broadcast=("params", "forge_state"), split_rngs={"params": False}) if self.shared else dict(
        variable_axes={"params": 0, "forge_state": 0}, split_rngs={"params": True})
    x, _ = nn.scan(body, length=3, **axes)(Block(self.opt, name="b"), x, None)
    return x


class Vmapped(nn.Module):
  opt: object

  @nn.compact
  def __call__(self, x_GxBxD):
    vblock = nn.vmap(Block, variable_axes={"params": None, "forge_state": None},
                     split_rngs={"params": False}, in_axes=0)
    return vblock(self.opt, name="b")(x_GxBxD)


def _mse(apply_fn, variables, batch):
  return jnp.mean((apply_fn(variables, batch["x"]) - batch["y"]) ** 2)


def _batch(shape_x=(6, 8), shape_y=(6, 4), key=0):
  kx, ky = jax.random.split(jax.random.PRNGKey(key))
  return {"x": jax.random.normal(kx, shape_x), "y": jax.random.normal(ky, shape_y)}


def _state(model, x, opt):
  return forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), x), opt)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_unchanged(state, before):
  for a, b in zip(jax.tree.leaves(_host(state)), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(a, b)


def _refused(state, batch, loss, match):
  before = _host(state)
  with pytest.raises(ValueError, match=match):
    forge_jax.train_step(state, batch, loss)
  _assert_unchanged(state, before)  # refused while tracing: nothing donated, nothing written


def test_parent_module_called_twice_is_refused():
  opt = forge_jax.sgd(1e-1)
  model = Twice(opt)
  batch = _batch()
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_mse, model.apply),
           r"more than once in one step: b/l \(2 times\)")


def _two_half_batches(apply_fn, variables, batch):
  half = batch["x"].shape[0] // 2
  a = apply_fn(variables, batch["x"][:half])
  b = apply_fn(variables, batch["x"][half:])
  return jnp.mean((jnp.concatenate([a, b]) - batch["y"]) ** 2)


def test_loss_calling_apply_twice_is_refused():
  opt = forge_jax.adamw(1e-2)
  model = Net(opt)
  batch = _batch()
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_two_half_batches, model.apply),
           r"b0/l \(2 times\), b1/l \(2 times\), head \(2 times\)")


def test_loss_calling_a_cached_jitted_apply_twice_is_refused():
  """The count is read from the step's jaxpr: a jax.jit'd apply whose backward pass jax has
  cached (from a first, legitimate step) is counted all the same."""
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()
  fwd = jax.jit(model.apply)
  state = _state(model, batch["x"], opt)
  state, _ = forge_jax.train_step(state, batch, functools.partial(_mse, fwd))
  _refused(state, batch, functools.partial(_two_half_batches, fwd), r"head \(2 times\)")


@pytest.mark.parametrize("shared", [True, False], ids=["broadcast", "stacked"])
def test_nn_scan_over_a_forge_module_is_refused(shared):
  opt = forge_jax.sgd(1e-1)
  model = Scanned(opt, shared=shared)
  batch = _batch(shape_y=(6, 8))
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_mse, model.apply),
           r"b/l \(3 times\)")


def test_nn_vmap_over_a_forge_module_is_refused():
  opt = forge_jax.sgd(1e-1)
  model = Vmapped(opt)
  batch = _batch((2, 3, 8), (2, 3, 8))
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_mse, model.apply),
           r"FORGE kernel b/l is being vmapped")


class Branching(nn.Module):
  """A FORGE block in one branch of a lax.cond, a plain Dense in the other."""

  opt: object

  @nn.compact
  def __call__(self, x):
    block, plain = Block(self.opt, name="b"), nn.Dense(8, name="plain")
    if self.is_initializing():
      return block(x) + plain(x)
    return jax.lax.cond(jnp.sum(x) > 0, lambda h: block(h), lambda h: plain(h), x)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_a_forge_layer_in_a_cond_branch_is_refused(skip_nonfinite):
  """It would update only in the steps that take its branch (optax: every step); refused while
  tracing, with or without the non-finite guard (whose flag a cond's branch cannot close over)."""
  opt = forge_jax.adamw(1e-2)
  model = Branching(opt)
  batch = _batch(shape_y=(6, 8))
  state = _state(model, batch["x"], opt)
  before = _host(state)
  with pytest.raises(ValueError, match=r"FORGE kernels \['b/l'\] runs inside a branch of lax.cond"):
    forge_jax.train_step(state, batch, functools.partial(_mse, model.apply),
                         skip_nonfinite=skip_nonfinite)
  _assert_unchanged(state, before)


def test_remat_recomputation_counts_once():
  """jax.checkpoint recomputes the forward pass inside the backward pass; the FORGE backward
  pass still runs once, and the step equals the one without remat bit for bit."""
  opt = forge_jax.adamw(1e-2)
  batch = _batch()
  out = []
  for remat in (False, True):
    model = Net(opt, remat=remat)
    state, metrics = forge_jax.train_step(_state(model, batch["x"], opt), batch,
                                          functools.partial(_mse, model.apply))
    out.append(_host((state.params, state.forge_state, metrics["loss"])))
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_scanned_stack_is_accepted_and_nested_reuse_of_it_is_not():
  opt = forge_jax.sgd(1e-1)

  class Stack(nn.Module):
    twice: bool = False

    @nn.compact
    def __call__(self, x):
      stack = forge_jax.ScannedStack(functools.partial(Block, opt), 3, name="stack")
      return stack(stack(x)) if self.twice else stack(x)

  batch = _batch(shape_y=(6, 8))
  model = Stack()
  state, metrics = forge_jax.train_step(_state(model, batch["x"], opt), batch,
                                        functools.partial(_mse, model.apply))
  assert not bool(metrics["skipped"]) and int(state.step) == 1
  model = Stack(twice=True)
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_mse, model.apply),
           r"stack/layers/block/l \(2 times\)")


class TiedHead(nn.Module):
  """A FORGE head whose weight the model also reads from its variables (a tied output
  projection, a weight shared with another op). ``mode``: ``"direct"``, ``"stop_gradient"``
  around the second use, or ``"state"`` (a penalty on the head's momentum)."""

  opt: object
  mode: str = "direct"

  @nn.compact
  def __call__(self, x):
    head = _dense(self.opt, 8, "head")
    y = head(x)
    if self.mode == "state":
      trace = head.variables[forge_jax.FORGE_STATE]["kernel"].opt.trace
      return y + jnp.sum(trace ** 2)
    k = head.variables["params"]["kernel"]
    return y + x @ (jax.lax.stop_gradient(k) if self.mode == "stop_gradient" else k)


class TiedInStack(nn.Module):
  """A ScannedStack whose stacked kernel the model also reads."""

  opt: object

  @nn.compact
  def __call__(self, x):
    x = forge_jax.ScannedStack(functools.partial(Block, self.opt), 2, name="stack")(x)
    k = self.variables["params"]["stack"]["layers"]["block"]["l"]["kernel"]
    return x @ k[0]


@pytest.mark.parametrize("mode, jit", [("direct", False), ("direct", True), ("state", False)],
                         ids=["weight", "weight_in_jitted_apply", "optimizer_state"])
def test_a_forge_weight_also_used_outside_its_layer_is_refused(mode, jit):
  """Autodiff would add the other use's gradient to the new weight (after one SGD step the
  head ends far from optax's): refused while tracing, naming the layer."""
  opt = forge_jax.sgd(1e-1, momentum=0.9) if mode == "state" else forge_jax.sgd(1e-1)
  model = TiedHead(opt, mode)
  batch = _batch(shape_y=(6, 8))
  apply = jax.jit(model.apply) if jit else model.apply
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_mse, apply),
           r"FORGE kernels \['head'\] are also used outside their forge_jax.Dense")


def test_a_gradient_penalty_through_forge_layers_is_refused():
  """A jax.grad inside the loss (an input-gradient penalty) differentiates through the FORGE
  layers' backward passes: the outer step would add d(penalty)/dW to the new weights (it ran
  and returned such weights before this check)."""
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()

  def loss(variables, b):
    f = lambda x: _mse(model.apply, variables, {**b, "x": x})
    return f(b["x"]) + jnp.sum(jax.grad(f)(b["x"]) ** 2)

  _refused(_state(model, batch["x"], opt), batch, loss, "differentiates through the layer")


def test_a_stacked_forge_weight_also_used_outside_the_stack_is_refused():
  opt = forge_jax.sgd(1e-1)
  model = TiedInStack(opt)
  batch = _batch(shape_y=(6, 8))
  _refused(_state(model, batch["x"], opt), batch, functools.partial(_mse, model.apply),
           r"\['stack/layers/block/l'\] are also used outside")


def test_a_second_use_behind_stop_gradient_trains_the_weight_once():
  """The fix the error suggests for a use that should not train the weight: the step equals
  optax's on the same loss (whose second use gets no gradient either)."""
  opt = forge_jax.sgd(1e-1)
  model = TiedHead(opt, "stop_gradient")
  batch = _batch(shape_y=(6, 8))
  variables = model.init(jax.random.PRNGKey(0), batch["x"])
  params = jax.tree.map(np.asarray, variables["params"])
  state, _ = forge_jax.train_step(_state(model, batch["x"], opt), batch,
                                  functools.partial(_mse, model.apply))
  def loss(p):
    k = p["head"]["kernel"]
    y = batch["x"] @ k + p["head"]["bias"] + batch["x"] @ jax.lax.stop_gradient(k)
    return jnp.mean((y - batch["y"]) ** 2)
  grads = jax.grad(loss)(params)
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(state.params["head"][name], params["head"][name] - 0.1 * grads["head"][name],
                               rtol=1e-6, atol=1e-7)


def test_vmap_over_train_step_is_refused():
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch((2, 6, 8), (2, 6, 4))
  state = _state(model, batch["x"][0], opt)
  with pytest.raises(ValueError, match="is being vmapped"):
    jax.vmap(lambda b: forge_jax.train_step(state, b, functools.partial(_mse, model.apply))[1])(batch)


MAPPED_SCRIPT = r"""
import functools, jax, jax.numpy as jnp, numpy as np
import forge_jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tests.test_reliability import Net, _mse, _batch, _state, _host
opt = forge_jax.sgd(1e-1)
model = Net(opt)
batch = _batch((16, 8), (16, 4))
loss = functools.partial(_mse, model.apply)
mesh = Mesh(np.array(jax.devices()), ("data",))
step = lambda s, b: forge_jax.train_step(s, b, loss)

def attempt(name, fn):
  try:
    fn()
    print(name, "RAN")
  except ValueError as e:
    print(name, "REFUSED", str(e)[:120])

state = _state(model, batch["x"], opt)
before = _host(state)
split = jax.tree.map(lambda a: a.reshape(8, 2, *a.shape[1:]), batch)
replicas = jax.tree.map(lambda a: jnp.broadcast_to(a, (8, *a.shape)), state)
attempt("pmap", lambda: jax.pmap(step)(replicas, split))
for vma in (False, True):
  smap = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=vma)
  attempt(f"shard_map_check_vma_{vma}", lambda: smap(state, batch))
print("UNCHANGED", all(np.array_equal(a, b) for a, b in
                       zip(jax.tree.leaves(_host(state)), jax.tree.leaves(before))))
sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
attempt("sharded_batch", lambda: step(state, sharded))
# Under a user's jit with explicit mesh axes the batch's sharding is in its type: refused too.
explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(explicit):
  attempt("jit_explicit_sharded_batch", lambda: jax.jit(step)(
      jax.device_put(state, NamedSharding(explicit, P())),
      jax.device_put(batch, NamedSharding(explicit, P("data")))))
# Otherwise the batch's sharding is not known while tracing; jit's semantics are the global
# step's, so the result must equal the step on the replicated batch.
ref, _ = step(_state(model, batch["x"], opt), batch)
out, _ = jax.jit(step)(jax.device_put(state, NamedSharding(mesh, P())), sharded)
diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params)))
print("JIT_SHARDED_EQUALS_GLOBAL", diff < 1e-6, diff)
"""


def test_mapped_axes_are_refused_and_jit_with_sharded_batch_is_global():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
             "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", MAPPED_SCRIPT], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
  log = out.stdout + out.stderr
  for name in ("pmap", "shard_map_check_vma_False", "shard_map_check_vma_True"):
    assert f"{name} REFUSED forge_jax.train_step is traced under the mapped axes" in out.stdout, log
  assert "\nsharded_batch REFUSED the batch is split over 8 devices" in out.stdout, log
  assert "jit_explicit_sharded_batch REFUSED the batch is split over 8 devices" in out.stdout, log
  assert "UNCHANGED True" in out.stdout, log
  assert "JIT_SHARDED_EQUALS_GLOBAL True" in out.stdout, log


# ----------------------------------------------------------------------------------------------
# The non-finite guard.
# ----------------------------------------------------------------------------------------------


class StackNet(nn.Module):
  """Unrolled FORGE layers, a ScannedStack and optax-managed parameters (biases, embed)."""

  opt: object

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="embed")(x)
    x = forge_jax.ScannedStack(functools.partial(Block, self.opt), 2, name="stack")(x)
    x = jnp.tanh(_dense(self.opt, 8, "l1")(x))
    return _dense(self.opt, 4, "head")(x)


_SKIP_OPT = forge_jax.adamw(1e-2, weight_decay=0.1)
_SKIP_CASE = (_SKIP_OPT, StackNet(_SKIP_OPT), functools.partial(_mse, StackNet(_SKIP_OPT).apply))


def _poison(batch, where, value):
  key, index = where
  return {**batch, key: batch[key].at[index].set(value)}


@pytest.mark.parametrize("where, value", [(("x", (2, 3)), jnp.nan), (("x", (0, 0)), jnp.inf),
                                          (("y", (5, 1)), jnp.inf)],
                         ids=["nan_in_batch", "inf_in_batch", "inf_loss"])
def test_non_finite_loss_skips_the_step_bit_for_bit(where, value):
  opt, model, loss = _SKIP_CASE  # one compiled step for every case
  batches = [_batch(key=i) for i in range(2)]
  state = _state(model, batches[0]["x"], opt)
  state, _ = forge_jax.train_step(state, batches[0], loss)  # counts past 0
  before = _host(state)
  state, metrics = forge_jax.train_step(state, _poison(batches[1], where, value), loss)
  assert not np.isfinite(float(metrics["loss"]))
  assert bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 1
  assert int(state.skipped_steps) == 1
  before = before.replace(skipped_steps=np.int32(1))
  _assert_unchanged(state, before)  # weights, FORGE states, optax states, step, counts
  # The run goes on as if the bad batch had never come.
  state, metrics = forge_jax.train_step(state, batches[1], loss)
  ref = _state(model, batches[0]["x"], opt)
  for b in batches:
    ref, ref_metrics = forge_jax.train_step(ref, b, loss)
  assert not bool(metrics["skipped"]) and int(state.step) == 2
  np.testing.assert_array_equal(metrics["loss"], ref_metrics["loss"])
  for a, b in zip(jax.tree.leaves(_host((state.params, state.forge_state, state.opt_state))),
                  jax.tree.leaves(_host((ref.params, ref.forge_state, ref.opt_state))), strict=True):
    np.testing.assert_array_equal(a, b)


def test_skip_nonfinite_false_takes_every_step():
  """``skip_nonfinite=False``: a non-finite loss takes the step (the step count advances, NaN
  reaches the optax-managed parameters), and a finite step equals the guarded one bit for bit."""
  opt, model, loss = _SKIP_CASE
  batch = _batch(key=0)
  guarded, m_on = forge_jax.train_step(_state(model, batch["x"], opt), batch, loss)
  plain, m_off = forge_jax.train_step(_state(model, batch["x"], opt), batch, loss,
                                      skip_nonfinite=False)
  np.testing.assert_array_equal(m_on["loss"], m_off["loss"])
  for a, b in zip(jax.tree.leaves(_host((guarded.params, guarded.forge_state, guarded.opt_state))),
                  jax.tree.leaves(_host((plain.params, plain.forge_state, plain.opt_state))), strict=True):
    np.testing.assert_array_equal(a, b)
  plain, metrics = forge_jax.train_step(plain, _poison(_batch(key=1), ("x", (2, 3)), jnp.nan), loss,
                                        skip_nonfinite=False)
  assert not bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 0
  assert int(plain.step) == 2
  assert not np.all(np.isfinite(np.asarray(plain.params["embed"]["kernel"])))


def _mse_plus(apply_fn, variables, batch):
  """The MSE plus a constant of the batch: a non-finite constant makes the loss non-finite and
  leaves every gradient finite, so only the loss check can keep the weights."""
  return _mse(apply_fn, variables, batch) + batch["offset"]


@pytest.mark.parametrize("remat", [False, True], ids=["scanned_stack", "nn_remat"])
def test_non_finite_loss_with_finite_gradients_skips_bit_for_bit(remat):
  """Every layer skips through its kernel's flag (a ScannedStack's layers, FORGE layers under
  nn.remat, whose checkpoint bodies take the flag as an input), though no gradient element is
  non-finite, and the step has no conditional."""
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  model = Net(opt, remat=True) if remat else StackNet(opt)
  loss = functools.partial(_mse_plus, model.apply)
  batch = {**_batch(key=1), "offset": jnp.zeros(())}
  state = _state(model, batch["x"], opt)
  state, _ = forge_jax.train_step(state, batch, loss)
  before = _host(state)
  state, metrics = forge_jax.train_step(state, {**batch, "offset": jnp.array(jnp.inf)}, loss)
  assert bool(metrics["skipped"]) and int(metrics["nonfinite_grads"]) == 0
  _assert_unchanged(state, before.replace(skipped_steps=np.int32(1)))
  text = forge_jax.train_step.lower(state, batch, loss).compile().as_text()
  assert "conditional(" not in text
  # A new trace (another batch size) takes the flag afresh, not a transpose cached without it.
  other = {**_batch((4, 8), (4, 4), key=2), "offset": jnp.array(jnp.nan)}
  before = _host(state)
  state, metrics = forge_jax.train_step(state, other, loss)
  assert bool(metrics["skipped"])
  _assert_unchanged(state, before.replace(skipped_steps=np.int32(2)))


@pytest.mark.parametrize("kind", ["unrolled", "scanned_stack", "nn_remat", "jitted_apply"])
def test_guard_traces_the_model_once(kind):
  """With the guard on, the forward pass is traced once, as without it, and the step has no
  conditional: the backward pass is traced with a placeholder for the flag in each FORGE layer
  (a ScannedStack's: one, outside its loop; under nn.remat and in a jitted apply: the
  checkpoint and call bodies take the flag as an input) and evaluated with the flag in its
  place (the skip itself: test_non_finite_loss_skip_takes_no_cond,
  test_non_finite_loss_skips_the_step_bit_for_bit,
  test_non_finite_loss_with_finite_gradients_skips_bit_for_bit,
  test_jitted_apply_with_and_without_the_guard)."""
  opt = forge_jax.adamw(1e-2)
  model = {"unrolled": lambda: Poisoned(opt, False), "scanned_stack": lambda: StackNet(opt),
           "nn_remat": lambda: Net(opt, remat=True), "jitted_apply": lambda: Net(opt)}[kind]()
  apply = jax.jit(model.apply) if kind == "jitted_apply" else model.apply
  batch = _batch()
  state = _state(model, batch["x"], opt)
  for skip in (True, False):
    calls = []
    def loss(variables, b):
      calls.append(1)
      return _mse(apply, variables, b)
    jaxpr = jax.make_jaxpr(lambda s, b: forge_jax.train_step(s, b, loss, skip_nonfinite=skip))(
        state, batch)
    assert len(calls) == 1, (skip, len(calls))
    # lax.platform_dependent's conds (the "xla" route's order of writes on a CPU) are resolved
    # to one branch while lowering; any other cond would run as a conditional.
    conds = [e for e in eqns(jaxpr.jaxpr) if e.primitive.name == "cond"
             and e.params.get("branches_platforms") is None]
    assert not conds, (skip, conds)


@pytest.mark.parametrize("guard_first", [True, False], ids=["guard_first", "plain_first"])
def test_jitted_apply_with_and_without_the_guard(guard_first):
  """A jax.jit'd apply in the loss: jax caches its backward pass across steps, traced with
  whichever guard setting came first. Both settings then take finite steps alike (equal to an
  un-jitted apply's), and the guard still skips a non-finite loss bit for bit, also one whose
  gradients are finite (where only the flag, not the kernels' per-element guard, can skip: a
  transpose cached without the flag goes in one cond around the backward pass)."""
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  model = Net(opt)
  fwd = jax.jit(model.apply)
  batches = [{**_batch(key=i), "offset": jnp.zeros(())} for i in range(3)]
  ref = _state(model, batches[0]["x"], opt)
  state = _state(model, batches[0]["x"], opt)
  for i, (b, skip) in enumerate(zip(batches, (guard_first, not guard_first, True))):
    ref, _ = forge_jax.train_step(ref, b, functools.partial(_mse_plus, model.apply))
    state, _ = forge_jax.train_step(state, b, functools.partial(_mse_plus, fwd), skip_nonfinite=skip)
    for a, c in zip(jax.tree.leaves(_host((state.params, state.forge_state, state.opt_state))),
                    jax.tree.leaves(_host((ref.params, ref.forge_state, ref.opt_state))), strict=True):
      np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7, err_msg=f"step {i}")
  for bad, skipped in (({**batches[0], "offset": jnp.array(jnp.inf)}, 1),
                       (_poison(batches[0], ("x", (1, 1)), jnp.nan), 2)):
    before = _host(state)
    state, metrics = forge_jax.train_step(state, bad, functools.partial(_mse_plus, fwd))
    assert bool(metrics["skipped"])
    _assert_unchanged(state, before.replace(skipped_steps=np.int32(skipped)))


@jax.custom_vjp
def _nan_in_cotangent(x):
  return x


def _nan_fwd(x):
  return x, None


def _nan_bwd(_, ct):
  return (ct.at[1, 2].set(jnp.nan),)


_nan_in_cotangent.defvjp(_nan_fwd, _nan_bwd)


class Poisoned(nn.Module):
  """A finite forward pass whose backward pass turns one element of l0's dy into NaN."""

  opt: object
  poison: bool = True
  backend: str = "xla"
  width: int = 8
  out: int = 4
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    dense = lambda features, name: _dense(self.opt, features, name, self.backend, self.dtype)
    h = dense(self.width, "l0")(x)
    if self.poison:
      h = _nan_in_cotangent(h)
    h = jnp.tanh(dense(self.width, "l1")(jnp.tanh(h)))
    return dense(self.out, "head")(h)


def test_non_finite_gradient_with_finite_loss_is_kept_and_counted():
  """The documented semantics: a finite loss takes the step. A NaN that first shows inside the
  backward pass (one element of l0's dy) makes column 2 of l0's dW and element 2 of its bias
  gradient NaN: the kernel's elements keep their weights and optimizer states bit for bit, every
  other element is updated exactly as without the NaN, the bias (an optax-managed parameter)
  takes optax's NaN, metrics["nonfinite_grads"] counts the two parameter arrays and
  metrics["grad_norm"] is NaN."""
  _check_nan_confined("xla", _batch(), width=8)


def _bits(a):
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _check_nan_confined(backend, batch, width, dtype=None):
  opt = forge_jax.adamw(1e-2)
  out = {}
  for poison in (False, True):
    model = Poisoned(opt, poison, backend, width, batch["y"].shape[-1], dtype)
    state = _state(model, batch["x"], opt)
    init = _host(state)
    state, metrics = forge_jax.train_step(state, batch, functools.partial(_mse, model.apply))
    out[poison] = (_host(state), metrics)
  (clean, m_clean), (bad, m_bad) = out[False], out[True]
  assert np.isfinite(float(m_bad["loss"])) and not bool(m_bad["skipped"])
  assert np.isnan(float(m_bad["grad_norm"])) and np.isfinite(float(m_clean["grad_norm"]))
  assert int(m_bad["nonfinite_grads"]) == 2 and int(m_clean["nonfinite_grads"]) == 0
  assert int(bad.step) == 1
  for name in ("l1", "head"):  # above the NaN: untouched by it
    for a, b in zip(jax.tree.leaves(bad.params[name]), jax.tree.leaves(clean.params[name])):
      np.testing.assert_array_equal(_bits(a), _bits(b))
  kstate = lambda s: s.forge_state["l0"]["kernel"].opt
  for get in (lambda s: s.params["l0"]["kernel"], lambda s: kstate(s).mu, lambda s: kstate(s).nu):
    got, old, want = get(bad), get(init), get(clean)
    # dy[1, 2] is NaN: column 2 of dW is, and keeps the old weight and moments.
    np.testing.assert_array_equal(_bits(got[:, 2]), _bits(old[:, 2]))
    np.testing.assert_array_equal(_bits(np.delete(got, 2, axis=1)), _bits(np.delete(want, 2, axis=1)))
  bias = lambda s: s.params["l0"]["bias"]
  assert np.isnan(bias(bad)[2])
  np.testing.assert_array_equal(_bits(np.delete(bias(bad), 2)), _bits(np.delete(bias(clean), 2)))


def _skip_bit_for_bit(backend, batch, width, dtype=None):
  opt = forge_jax.adamw(1e-2)
  model = Poisoned(opt, False, backend, width, batch["y"].shape[-1], dtype)
  state = _state(model, batch["x"], opt)
  loss = functools.partial(_mse, model.apply)
  state, _ = forge_jax.train_step(state, batch, loss)
  before = _host(state)
  state, metrics = forge_jax.train_step(state, _poison(batch, ("x", (0, 0)), jnp.nan), loss)
  assert bool(metrics["skipped"])
  _assert_unchanged(state, before.replace(skipped_steps=np.int32(1)))


@pytest.mark.parametrize("backend", ["xla", pytest.param("interpret", marks=pytest.mark.skipif(
    jax.default_backend() == "gpu", reason="the interpreter: a CPU case"))])
def test_non_finite_loss_skip_takes_no_cond(backend):
  """Unstacked FORGE layers skip a non-finite loss's step inside their kernels (nothing is
  stored): bit for bit, and the compiled step has no conditional (a cond per layer costs a GPU
  step a host round trip each)."""
  batch = _batch(key=3)
  _skip_bit_for_bit(backend, batch, 8)
  opt = forge_jax.adamw(1e-2)
  model = Poisoned(opt, False, backend)
  state = _state(model, batch["x"], opt)
  text = forge_jax.train_step.lower(state, batch, functools.partial(_mse, model.apply)).compile().as_text()
  assert "conditional(" not in text


_ON_GPU = gpu_marks("the compiled kernels: a GPU case")


# Not under the Mosaic GPU interpreter: at these shapes one CPU run of it (jax 0.10.2) stopped
# for good inside the interpreter's buffer allocation, where three earlier runs took 16-18 s.
@pytest.mark.parametrize("backend", [pytest.param("pallas", marks=_ON_GPU),
                                     pytest.param("mosaic", marks=_ON_GPU)])
def test_kernels_keep_the_non_finite_semantics(backend):
  """With the fused kernels on a GPU: shapes on the Mosaic kernel's tiling, the model in bf16,
  so every layer's x and dy are bf16, which the Mosaic kernel needs (a fallback is an error
  here)."""
  key = jax.random.PRNGKey(3)
  batch = {"x": jax.random.normal(key, (128, 256)).astype(jnp.bfloat16),
           "y": jax.random.normal(jax.random.fold_in(key, 1), (128, 256))}
  with warnings.catch_warnings():
    warnings.simplefilter("error", _fused.BackendFallbackWarning)
    _skip_bit_for_bit(backend, batch, 256, dtype=jnp.bfloat16)
    _check_nan_confined(backend, batch, 256, dtype=jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# Small things a user hits.
# ----------------------------------------------------------------------------------------------


def test_a_donated_state_or_its_variables_reused_is_a_clear_error():
  """train_step donates its state, and TrainState.create holds the variables' own arrays: a
  second run from the same variables (a notebook cell run again) or the old state is a
  ValueError that says so, not jax's "Buffer has been deleted or donated"."""
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()
  variables = model.init(jax.random.PRNGKey(0), batch["x"])
  loss = functools.partial(_mse, model.apply)
  fresh = forge_jax.TrainState.create(model.apply, jax.tree.map(jnp.copy, variables), opt)
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  new, _ = forge_jax.train_step(state, batch, loss)
  for reused in (state, forge_jax.TrainState.create(model.apply, variables, opt)):
    with pytest.raises(ValueError, match="donated to an earlier train_step.*jax.tree.map"):
      forge_jax.train_step(reused, batch, loss)
  forge_jax.train_step(new, batch, loss)  # the returned state and a copy's go on
  forge_jax.train_step(fresh, batch, loss)


def _counting_mse(calls, apply_fn, variables, batch):
  calls.append(1)
  return _mse(apply_fn, variables, batch)


def test_a_partial_built_in_the_loop_traces_the_step_once():
  """train_step(state, batch, functools.partial(loss_fn, model.apply)) written inside a training
  loop (the README's call, repeated): partials built alike are one static argument, so the step
  is traced and compiled once (a partial object alone compares by identity: it retraced and
  recompiled at every call); a partial of other arguments is another step."""
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()
  state = _state(model, batch["x"], opt)
  calls = []
  for _ in range(3):
    state, _ = forge_jax.train_step(state, batch, functools.partial(_counting_mse, calls, model.apply))
  assert len(calls) == 1
  state, _ = forge_jax.train_step(state, batch, functools.partial(_counting_mse, [], model.apply))
  assert len(calls) == 1  # the other list: another trace, into that list


def _keyed_mse(apply_fn, key, variables, batch):
  del key
  return _mse(apply_fn, variables, batch)


def test_a_lambda_or_a_changing_partial_in_the_loop_warns_that_the_step_recompiles():
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()
  state = _state(model, batch["x"], opt)
  with pytest.warns(forge_jax.RetraceWarning, match="4 different loss_fn arguments"):
    for _ in range(4):
      state, _ = forge_jax.train_step(state, batch, lambda v, b: _mse(model.apply, v, b))
  # A per-step RNG key in the partial: a constant of each compiled step.
  with pytest.warns(forge_jax.RetraceWarning, match="an RNG key, an array"):
    for i in range(4):
      loss = functools.partial(_keyed_mse, model.apply, jax.random.PRNGKey(i))
      state, _ = forge_jax.train_step(state, batch, loss)


def test_a_loss_that_is_not_a_real_scalar_is_a_clear_error():
  """A per-example loss vector (jax.grad refuses it too) was a lowering error about i1 tensors."""
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()
  per_example = lambda v, b: jnp.mean((model.apply(v, b["x"]) - b["y"]) ** 2, axis=-1)
  _refused(_state(model, batch["x"], opt), batch, per_example, r"real scalar loss.*shape \(6,\)")
  with_aux = lambda v, b: (_mse(model.apply, v, b), {"n": jnp.ones(())})
  _refused(_state(model, batch["x"], opt), batch, with_aux, "returned a tuple.*has_aux=True")


def test_grad_with_respect_to_inputs_alone_works_through_forge_layers():
  opt = forge_jax.adamw(1e-2)
  model = Net(opt)
  batch = _batch()
  variables = model.init(jax.random.PRNGKey(0), batch["x"])
  loss = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
  got = jax.grad(lambda x: loss(variables, x))(batch["x"])
  want = jax.grad(lambda x: loss({"params": variables["params"]}, x))(batch["x"])  # plain Dense
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=r"forge_jax.Dense head was traced outside .*inputs alone"):
    jax.grad(lambda p: loss({**variables, "params": p}, batch["x"]))(variables["params"])
  # Over the whole variables jax refuses the int32 step counts of "forge_state" before any
  # FORGE code runs (its own TypeError); past that check (allow_int) FORGE's message comes.
  with pytest.raises(ValueError, match=r"forge_jax.Dense head was traced outside .*inputs alone"):
    jax.grad(lambda v: loss(v, batch["x"]), allow_int=True)(variables)


def test_checkpoint_mismatch_is_short_and_old_checkpoints_restore(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  opt = forge_jax.sgd(1e-1)
  batch = _batch()
  state = _state(Net(opt), batch["x"], opt)
  path = forge_jax.save_train_state(tmp_path / "ckpt", state)
  other = _state(Block(opt), batch["x"], opt)
  with pytest.raises(ValueError) as e:
    forge_jax.restore_train_state(path, other)
  msg = str(e.value)
  assert "expected but not stored: forge_state/l/kernel" in msg and len(msg.splitlines()) == 1, msg
  # A checkpoint written before TrainState counted skipped steps.
  old = forge_jax.save_train_state(tmp_path / "old", state.replace(skipped_steps=None))
  restored = forge_jax.restore_train_state(old, state)
  assert int(restored.skipped_steps) == 0
  _assert_unchanged(restored.replace(skipped_steps=None), _host(state.replace(skipped_steps=None)))


def test_truncated_safetensors_file_is_named(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  cfg = models.get_config("tiny-llama")
  (tmp_path / "config.json").write_text(json.dumps(models.config_to_hf(cfg)))
  weights = tmp_path / "model.safetensors"
  save_file({"a": np.ones((64, 64), np.float32)}, weights)
  weights.write_bytes(weights.read_bytes()[:1000])
  with pytest.raises(ValueError, match=r"cannot read .*model.safetensors \(1,000 bytes\).*truncated"):
    models.load_checkpoint(tmp_path)


def test_train_cli_warmup_help_and_usage_errors(tmp_path, capsys):
  from experiments import train  # pylint: disable=g-import-not-at-top
  assert train.parse_args(["--steps", "6"]).warmup == 5  # the default fits a short run
  assert train.parse_args([]).warmup == 20
  with pytest.raises(SystemExit):
    train.parse_args(["--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  for default in ("--steps STEPS training steps (default: 200)", "(default: adamw)",
                  "(default: bpe)", "(default: runs/train)"):
    assert default in help_text, default
  # A mismatch is one argparse-style line and exit status 2, not a traceback.
  assert train.main(["--steps", "6", "--warmup", "9"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.endswith("error: --warmup 9 must be below --steps 6 for the cosine schedule "
                      "(or use --schedule constant)") and len(err.splitlines()) == 1, err
  out = tmp_path / "run"
  out.mkdir()
  (out / "config.json").write_text(
      '{"trajectory": ' + __import__("json").dumps(
          {k: getattr(train.parse_args(["--out", str(out)]), k) for k in train.TRAJECTORY_KEYS})
      + "}")
  assert train.main(["--out", str(out), "--resume", "--lr", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert "error: --resume with arguments that change the run (saved, given): {'lr': (0.003, 1.0)}" in err
  assert len(err.splitlines()) == 1, err


# ----------------------------------------------------------------------------------------------
# Faults.
# ----------------------------------------------------------------------------------------------


def test_resume_skips_a_killed_write_and_a_corrupted_newest_checkpoint(tmp_path, capsys):
  """A write killed midway leaves only orbax's temporary directory (renamed to step_N when
  complete), which --resume ignores; a corrupted newest checkpoint is reported and the one
  before it restored, bit for bit."""
  pytest.importorskip("orbax.checkpoint")
  import types  # pylint: disable=g-import-not-at-top
  from experiments import runlog, train  # pylint: disable=g-import-not-at-top
  opt = forge_jax.adamw(1e-2)
  model = Net(opt)
  batch = _batch()
  loss = functools.partial(_mse, model.apply)
  init = lambda: _state(model, batch["x"], opt)
  state, saved = init(), {}
  for step in (1, 2):
    state, _ = forge_jax.train_step(state, batch, loss)
    runlog.save_checkpoint(tmp_path, step, state, keep=3)
    saved[step] = _host(state)
  killed = tmp_path / "ckpt" / "step_00000003.orbax-checkpoint-tmp-1733100000"
  killed.mkdir()
  (killed / "_CHECKPOINT_METADATA").write_text("{")
  trainer = types.SimpleNamespace(init_state=init)
  restored, start = train._restore(trainer, tmp_path, resume=True)  # pylint: disable=protected-access
  assert start == 2
  _assert_unchanged(restored, saved[2])
  newest = tmp_path / "ckpt" / "step_00000002"
  for f in newest.rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(b"\0" * f.stat().st_size)
  restored, start = train._restore(trainer, tmp_path, resume=True)  # pylint: disable=protected-access
  assert start == 1
  _assert_unchanged(restored, saved[1])
  assert f"skipping {newest}: the checkpoint at {newest} is corrupted" in capsys.readouterr().err
  # The run continues from there exactly as it went the first time.
  again, _ = forge_jax.train_step(restored, batch, loss)
  _assert_unchanged(again, saved[2])


def test_resume_counts_skipped_steps(tmp_path):
  """The CLI names checkpoints by its loop's steps; a step skipped for a non-finite loss leaves
  state.step behind by one, and --resume accepts that checkpoint."""
  pytest.importorskip("orbax.checkpoint")
  import types  # pylint: disable=g-import-not-at-top
  from experiments import runlog, train  # pylint: disable=g-import-not-at-top
  opt = forge_jax.sgd(1e-1)
  model = Net(opt)
  batch = _batch()
  loss = functools.partial(_mse, model.apply)
  init = lambda: _state(model, batch["x"], opt)
  state, _ = forge_jax.train_step(init(), batch, loss)
  state, metrics = forge_jax.train_step(state, _poison(batch, ("x", (0, 0)), jnp.nan), loss)
  assert bool(metrics["skipped"]) and int(state.step) == 1
  runlog.save_checkpoint(tmp_path, 2, state, keep=2)
  restored, start = train._restore(types.SimpleNamespace(init_state=init), tmp_path, resume=True)  # pylint: disable=protected-access
  assert start == 2 and int(restored.step) == 1 and int(restored.skipped_steps) == 1
