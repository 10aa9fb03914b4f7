"""The Flax NNX front end: forge_jax.nnx.Linear, ScannedStack, train_step, models.nnx."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import forge_jax
import forge_jax.nnx as fnnx
import models
import models.nnx as mnnx

# Compile time dominates these tests (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")

LR = 1e-2


class Block(nnx.Module):
  """A residual MLP block with a norm-like scale (optax) and two linear layers (FORGE or not)."""

  def __init__(self, opt, *, rngs):
    if opt is None:
      lin = lambda i, o, **kw: nnx.Linear(i, o, rngs=rngs, **kw)
    else:
      lin = lambda i, o, **kw: fnnx.Linear(i, o, optimizer=opt, rngs=rngs, **kw)
    self.scale = nnx.Param(jnp.ones((8,)))
    self.up = lin(8, 16)
    self.down = lin(16, 8, use_bias=False)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x * self.scale[...])))


class Net(nnx.Module):
  """Three blocks, scanned (a ScannedStack) or unrolled, and a head."""

  def __init__(self, opt, scan, *, rngs):
    self.scan = scan
    if scan:
      self.layers = fnnx.ScannedStack(lambda r: Block(opt, rngs=r), 3, rngs=rngs)
    else:
      self.layers = nnx.List([Block(opt, rngs=rngs) for _ in range(3)])
    self.head = (nnx.Linear(8, 4, rngs=rngs) if opt is None
                 else fnnx.Linear(8, 4, optimizer=opt, rngs=rngs))

  def __call__(self, x):
    if self.scan:
      x = self.layers(x)
    else:
      for block in self.layers:
        x = block(x)
    return self.head(x)


def _mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": jnp.asarray(rng.normal(size=(2, 6, 8)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(2, 6, 4)), jnp.float32)} for _ in range(n)]


def _params(model):
  return {"/".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_linear_has_nnx_linears_parameters_and_its_state_is_an_opt_state():
  opt = forge_jax.adamw(LR)
  ours = fnnx.Linear(8, 4, optimizer=opt, dtype=jnp.float32, rngs=nnx.Rngs(3))
  theirs = nnx.Linear(8, 4, dtype=jnp.float32, rngs=nnx.Rngs(3))
  for name in ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision"):
    assert getattr(ours, name) == getattr(theirs, name), name
  assert _params(ours).keys() == _params(theirs).keys() == {"kernel", "bias"}
  for k, v in _params(theirs).items():
    np.testing.assert_array_equal(_params(ours)[k], v)  # same initializers, same draws
  x = jnp.ones((2, 8))
  np.testing.assert_array_equal(ours(x), theirs(x))
  states = nnx.to_flat_state(nnx.state(ours, fnnx.OptState))
  assert [p for p, _ in states] == [("kernel_opt",)]
  assert isinstance(states[0][1].get_value(), forge_jax.KernelState)
  assert not fnnx.Linear(8, 4, optimizer=opt, use_bias=False, rngs=nnx.Rngs(0)).use_bias


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_five_steps_match_nnx_linear_with_optax_adamw(scan):
  """FORGE (fused backward, in place) against nnx.Linear + nnx.Optimizer(optax.adamw): same
  init, same losses, gradient norms and parameters after 5 steps, at the Linen parity
  tolerances; and no copy of a FORGE weight or optimizer state in the compiled step."""
  opt = forge_jax.adamw(LR, weight_decay=0.1)
  model, ref = Net(opt, scan, rngs=nnx.Rngs(0)), Net(None, scan, rngs=nnx.Rngs(0))
  optimizer = fnnx.Optimizer(model, opt, wrt=nnx.Param)
  ref_opt = nnx.Optimizer(ref, optax.adamw(LR, weight_decay=0.1), wrt=nnx.Param)
  for k, v in _params(ref).items():
    np.testing.assert_array_equal(_params(model)[k], v, err_msg=k)

  @nnx.jit
  def ref_step(ref, ref_opt, batch):
    loss, grads = nnx.value_and_grad(_mse)(ref, batch)
    ref_opt.update(ref, grads)
    return loss, optax.tree.norm(grads)

  for batch in _batches(5):
    metrics = fnnx.train_step(model, optimizer, batch, _mse)
    loss, norm = ref_step(ref, ref_opt, batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-4)
    assert not metrics["skipped"]
  for k, v in _params(ref).items():
    np.testing.assert_allclose(_params(model)[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
  assert int(optimizer.step[...]) == 5
  # A non-finite loss skips the step, as in Linen: nothing moves, the step says so.
  before = _params(model)
  nan_batch = dict(_batches(1)[0], y=jnp.full((2, 6, 4), jnp.nan))
  metrics = fnnx.train_step(model, optimizer, nan_batch, _mse)
  assert bool(metrics["skipped"]) and int(optimizer.skipped_steps[...]) == 1
  assert int(optimizer.step[...]) == 5
  for k, v in before.items():
    np.testing.assert_array_equal(_params(model)[k], v, err_msg=k)
  # The optimizer states moved too (the first moment of every FORGE kernel is non-zero).
  for path, var in nnx.to_flat_state(nnx.state(model, fnnx.OptState)):
    assert np.abs(np.asarray(var.get_value().opt.mu)).sum() > 0, path

  batch = _batches(1)[0]
  compiled = fnnx.train_step.lower(model, optimizer, batch, _mse).compile()
  forge = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, fnnx.OptState))]
  shapes = {"[" + ",".join(map(str, a.shape)) + "]" for ks in forge for a in jax.tree.leaves(ks)
            if a.ndim >= 2}
  copies = [l.strip() for l in compiled.as_text().splitlines() if re.search(r"= \S+ copy\(", l)]
  bad = [c for c in copies if any(s + "{" in c.split(" copy(")[0] for s in shapes)]
  assert not bad, "copies of FORGE weight/state buffers:\n" + "\n".join(bad)
  stats = compiled.memory_analysis()
  assert stats.alias_size_in_bytes == stats.argument_size_in_bytes - sum(
      x.nbytes for x in jax.tree.leaves(batch))
  # The compiled step runs on the model and optimizer as train_step does (the second call
  # through the variables the first one found), and train_step carries on from there.
  for batch in _batches(3, seed=1):
    ref_step(ref, ref_opt, batch)
  for batch in _batches(2, seed=1):
    compiled(model, optimizer, batch)
  fnnx.train_step(model, optimizer, _batches(3, seed=1)[2], _mse)
  assert int(optimizer.step[...]) == 8
  for k, v in _params(ref).items():
    np.testing.assert_allclose(_params(model)[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_train_step_inside_nnx_jit_matches_the_direct_call():
  opt = forge_jax.adamw(LR)
  a, b = Block(opt, rngs=nnx.Rngs(0)), Block(opt, rngs=nnx.Rngs(0))
  opt_a, opt_b = fnnx.Optimizer(a, opt, wrt=nnx.Param), fnnx.Optimizer(b, opt, wrt=nnx.Param)
  jitted = nnx.jit(fnnx.train_step, static_argnums=(3,))
  for batch in _batches(2):
    batch = dict(batch, y=batch["x"])
    np.testing.assert_array_equal(jitted(a, opt_a, batch, _mse)["loss"],
                                  fnnx.train_step(b, opt_b, batch, _mse)["loss"])
  for k, v in _params(b).items():
    np.testing.assert_array_equal(_params(a)[k], v, err_msg=k)
  assert int(opt_a.step[...]) == 2


def _lm_loss(model, tokens):
  return models.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


def test_nnx_and_linen_forge_models_with_the_same_weights_agree():
  """The NNX Llama and the Linen one, FORGE-trained from the same weights: the same losses
  and norms, and the same weights after two steps (scanned, remat'd)."""
  opt = forge_jax.adamw(LR)
  cfg = models.get_config("tiny-llama", linear="forge", remat="full", num_layers=2)
  linen = models.CausalLM(cfg, opt)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)))
  variables = jax.jit(linen.init)(jax.random.PRNGKey(0), tokens[:, :-1])
  # Built in one program (eagerly, its random init runs op by op); load_params replaces it.
  model = nnx.jit(lambda: mnnx.CausalLM(cfg, opt, rngs=nnx.Rngs(0)))()
  mnnx.load_params(model, variables["params"])
  state = forge_jax.TrainState.create(linen.apply, variables, opt)
  optimizer = fnnx.Optimizer(model, opt, wrt=nnx.Param)

  def linen_loss(v, t):
    return models.cross_entropy(linen.apply(v, t[:, :-1]), t[:, 1:])

  for _ in range(2):
    state, want = forge_jax.train_step(state, tokens, linen_loss)
    got = fnnx.train_step(model, optimizer, tokens, _lm_loss)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               mnnx.params_of(model), state.params)


def _op_counts(lowered) -> collections.Counter:
  return collections.Counter(re.findall(r"= \"?([a-z_]+\.[a-z_]+)", lowered.as_text()))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_nnx_and_linen_steps_lower_to_the_same_program(scan):
  """Operation for operation, the NNX model's step is the Linen one's (from shapes alone; the
  same holds for Llama-3.1-8B): the NNX front end adds nothing to the compiled step."""
  opt = forge_jax.adamw(LR)
  cfg = models.get_config("tiny-llama", linear="forge", remat="full", scan_layers=scan)
  tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
  linen = models.CausalLM(cfg, opt)

  def make():
    model = mnnx.CausalLM(cfg, opt, rngs=nnx.Rngs(0))
    return model, fnnx.Optimizer(model, opt, wrt=nnx.Param)

  state = jax.eval_shape(lambda: forge_jax.TrainState.create(
      linen.apply, linen.init(jax.random.PRNGKey(0), jnp.zeros((2, 8), jnp.int32)), opt))
  ours = _op_counts(fnnx.train_step.lower(*nnx.eval_shape(make), tokens, _lm_loss))
  theirs = _op_counts(forge_jax.train_step.lower(
      state, tokens, lambda v, t: models.cross_entropy(linen.apply(v, t[:, :-1]), t[:, 1:])))
  assert sum(ours.values()) > 100 and ours == theirs


def test_hf_checkpoint_round_trip_and_logits_parity(tmp_path):
  """A transformers Qwen3 checkpoint loads into the NNX model with HF's logits; the NNX
  model saves the same tensors back."""
  from tests import test_hf_parity as hf  # pylint: disable=g-import-not-at-top (needs torch)
  hf.import_torch_and_transformers()
  cfg = models.get_config("tiny-qwen3", tie_word_embeddings=False, num_layers=1)
  expected = hf._hf_logits(hf._random_hf_checkpoint(cfg, tmp_path / "hf"), hf._tokens(cfg))
  loaded_cfg, model = mnnx.load_checkpoint(tmp_path / "hf", rngs=nnx.Rngs(0), scan_layers=False)
  assert loaded_cfg.num_layers == 1
  logits = nnx.jit(lambda m, t: m(t))(model, hf._tokens(cfg))  # eagerly: op by op, 4x slower
  np.testing.assert_allclose(logits, expected, atol=hf.ATOL, rtol=hf.RTOL)
  mnnx.save_checkpoint(tmp_path / "ours", model)
  _, saved = models.load_checkpoint(tmp_path / "ours", scan_layers=False)
  jax.tree.map(np.testing.assert_array_equal, saved, mnnx.params_of(model))


class _Twice(nnx.Module):
  def __init__(self, opt, *, rngs):
    self.lin = fnnx.Linear(8, 8, optimizer=opt, rngs=rngs)

  def __call__(self, x):
    return self.lin(self.lin(x))


def test_errors_as_in_linen():
  opt = forge_jax.sgd(LR)
  batch = {"x": jnp.ones((2, 8)), "y": jnp.ones((2, 8))}
  model = _Twice(opt, rngs=nnx.Rngs(0))
  optimizer = fnnx.Optimizer(model, opt, wrt=nnx.Param)
  before = _params(model)
  with pytest.raises(ValueError, match=r"runs more than once in one step: lin \(2 times\)"):
    fnnx.train_step(model, optimizer, batch, _mse)
  for k, v in before.items():  # refused while tracing: nothing changed
    np.testing.assert_array_equal(_params(model)[k], v)

  # A FORGE weight also read directly (a tied head): refused, nothing changed.
  class Tied(nnx.Module):
    def __init__(self, *, rngs):
      self.lin = fnnx.Linear(8, 8, optimizer=opt, rngs=rngs)

    def __call__(self, x):
      return self.lin(x) + x @ self.lin.kernel[...]

  tied = Tied(rngs=nnx.Rngs(0))
  before = _params(tied)
  with pytest.raises(ValueError, match=r"FORGE kernels \['lin'\] are also used outside"):
    fnnx.train_step(tied, fnnx.Optimizer(tied, opt, wrt=nnx.Param), batch, _mse)
  for k, v in before.items():
    np.testing.assert_array_equal(_params(tied)[k], v)

  # nnx.grad through a FORGE layer outside train_step would return new weights as gradients.
  with pytest.raises(ValueError, match="was traced outside"):
    nnx.grad(_mse)(model, batch)

  with pytest.raises(ValueError, match="plain optax transformation"):
    fnnx.Linear(8, 4, optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)),
                rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs remat=True"):
    fnnx.ScannedStack(lambda r: Block(opt, rngs=r), 2, rngs=nnx.Rngs(0), remat=False,
                      remat_policy=jax.checkpoint_policies.dots_saveable)
  with pytest.raises(ValueError, match="needs `optimizer=`"):
    fnnx.Linear(8, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="was built with another optimizer than"):
    fnnx.train_step(Net(opt, False, rngs=nnx.Rngs(0)), fnnx.Optimizer(
        Net(opt, False, rngs=nnx.Rngs(0)), forge_jax.adamw(LR), wrt=nnx.Param), _batches(1)[0], _mse)

  # A FORGE layer inside the user's own nnx.scan runs its backward pass once per layer on one
  # weight stack: refused. The same stacked block, handed to a ScannedStack, trains in place.
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(r):
    return Block(opt, rngs=r)

  class UserScan(nnx.Module):
    def __init__(self, blocks, wrap):
      self.blocks, self.wrap = (fnnx.ScannedStack(blocks, 3) if wrap else blocks), wrap

    def __call__(self, x):
      if self.wrap:
        return self.blocks(x)
      return nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
          x, self.blocks)

  square = {"x": batch["x"], "y": batch["x"]}
  user = UserScan(make(nnx.Rngs(0)), wrap=False)
  with pytest.raises(ValueError, match=r"blocks/up \(3 times\)"):
    fnnx.train_step(user, fnnx.Optimizer(user, opt, wrt=nnx.Param), square, _mse)
  user = UserScan(make(nnx.Rngs(0)), wrap=True)
  assert not fnnx.train_step(user, fnnx.Optimizer(user, opt, wrt=nnx.Param), square, _mse)["skipped"]
  with pytest.raises(ValueError, match="leading axis of size 4"):
    fnnx.ScannedStack(make(nnx.Rngs(0)), 4)

  # A batch split over devices (explicit mesh axes: the sharding is in the batch's type).
  mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  model = Net(opt, True, rngs=nnx.Rngs(0))
  optimizer = fnnx.Optimizer(model, opt, wrt=nnx.Param)
  batch = _batches(1)[0]
  with jax.sharding.use_abstract_mesh(mesh):
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    split = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                         batch)
    with pytest.raises(ValueError, match="the batch is split over 2 devices"):
      jax.eval_shape(lambda b: fnnx.train_step(model, optimizer, b, _mse), split)


def test_bench_models_api_option():
  from experiments import bench_models  # pylint: disable=g-import-not-at-top
  assert bench_models.parse_spec("forge_unrolled:api=nnx:remat=none") == (
      "forge_unrolled", {"api": "nnx", "remat": "none"})
  with pytest.raises(ValueError, match="api=nnx in 'optax:api=nnx' is for FORGE rows"):
    bench_models.parse_spec("optax:api=nnx")
  with pytest.raises(ValueError, match="must be one of"):
    bench_models.parse_spec("forge:api=haiku")


def _counting_mse(calls, model, batch):
  calls.append(1)
  return _mse(model, batch)


def test_a_partial_built_in_the_loop_traces_the_nnx_step_once():
  """As in Linen: train_step(model, optimizer, batch, functools.partial(loss, ...)) written in a
  training loop is one compiled step (a partial alone compares by identity)."""
  import functools  # pylint: disable=g-import-not-at-top
  opt = forge_jax.sgd(LR)
  model = Net(opt, False, rngs=nnx.Rngs(0))
  optimizer = fnnx.Optimizer(model, opt, wrt=nnx.Param)
  calls = []
  for batch in _batches(3):
    fnnx.train_step(model, optimizer, batch, functools.partial(_counting_mse, calls))
  assert len(calls) == 1
