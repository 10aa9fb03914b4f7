"""Training the model presets with FORGE: parity with optax, and exact resume."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
import models

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles")  # tests/conftest.py

STEPS = 3


def _loss(apply_fn, variables, batch):
  logits = apply_fn(variables, batch[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _batches(cfg, n):
  return [jax.random.randint(jax.random.PRNGKey(100 + i), (2, 9), 0, cfg.vocab_size) for i in range(n)]


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_forge_training_matches_optax(name, scan):
  cfg = models.get_config(name, linear="forge", remat="full", scan_layers=scan)
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  model = models.CausalLM(cfg, optimizer=opt)
  ref_model = models.CausalLM(dataclasses.replace(cfg, linear="flax"))
  batches = _batches(cfg, STEPS)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), batches[0][:, :-1])
  params = jax.tree.map(jnp.copy, variables["params"])
  tx = optax.adamw(1e-2, weight_decay=0.1)
  opt_state = tx.init(params)

  @jax.jit
  def ref_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: _loss(ref_model.apply, {"params": p}, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  state = forge_jax.TrainState.create(model.apply, variables, opt)
  loss_fn = functools.partial(_loss, model.apply)
  for batch in batches:
    state, metrics = forge_jax.train_step(state, batch, loss_fn)
    params, opt_state, loss = ref_step(params, opt_state, batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  # fp32 with different summation orders over a few Adam steps (see
  # test_flax_binding): agreement far below one Adam step (lr = 1e-2).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), state.params, params)


def test_resume_is_bit_exact(tmp_path):
  cfg = models.get_config("tiny-llama", linear="forge", remat="full")
  opt = forge_jax.lion(1e-3, weight_decay=0.1)
  model = models.CausalLM(cfg, optimizer=opt)
  loss_fn = functools.partial(_loss, model.apply)
  batches = _batches(cfg, 4)
  init = jax.jit(model.init)  # three fresh states: one compile

  def fresh():
    variables = init(jax.random.PRNGKey(0), batches[0][:, :-1])
    return forge_jax.TrainState.create(model.apply, variables, opt)

  straight = fresh()
  for batch in batches:
    straight, _ = forge_jax.train_step(straight, batch, loss_fn)

  half = fresh()
  for batch in batches[:2]:
    half, _ = forge_jax.train_step(half, batch, loss_fn)
  forge_jax.save_train_state(tmp_path / "ckpt", half)
  resumed = forge_jax.restore_train_state(tmp_path / "ckpt", fresh())
  assert int(resumed.step) == 2
  for batch in batches[2:]:
    resumed, _ = forge_jax.train_step(resumed, batch, loss_fn)
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_into_another_model_is_an_error(tmp_path):
  opt = forge_jax.sgd(1e-2)
  cfg = models.get_config("tiny-llama", linear="forge", remat="full")
  model = models.CausalLM(cfg, optimizer=opt)
  tokens = jnp.ones((1, 8), jnp.int32)
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), tokens), opt)
  forge_jax.save_train_state(tmp_path / "ckpt", state)
  other_cfg = models.get_config("tiny-qwen3", linear="forge", remat="full")
  other = models.CausalLM(other_cfg, optimizer=opt)
  # The target's shapes suffice (restore_train_state takes jax.eval_shape of a state).
  like = jax.eval_shape(
      lambda: forge_jax.TrainState.create(other.apply, other.init(jax.random.PRNGKey(0), tokens), opt))
  with pytest.raises(ValueError, match="does not match"):
    forge_jax.restore_train_state(tmp_path / "ckpt", like)
  # ... while the shapes of the saved model's own state restore it.
  same = jax.eval_shape(
      lambda: forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), tokens), opt))
  assert int(forge_jax.restore_train_state(tmp_path / "ckpt", same).step) == 0


def test_restore_into_other_dtypes_is_an_error(tmp_path):
  """orbax casts a stored array to the target's dtype; a bfloat16 model restored from a
  float32 checkpoint would resume silently changed, so the dtypes are compared first."""
  opt = forge_jax.sgd(1e-2, momentum=0.9)
  tokens = jnp.ones((1, 8), jnp.int32)

  def state(param_dtype, abstract=False):
    cfg = models.get_config("tiny-llama", linear="forge", remat="full", param_dtype=param_dtype)
    model = models.CausalLM(cfg, optimizer=opt)
    create = lambda: forge_jax.TrainState.create(model.apply, model.init(jax.random.PRNGKey(0), tokens), opt)
    return jax.eval_shape(create) if abstract else create()

  saved = state("float32")
  forge_jax.save_train_state(tmp_path / "ckpt", saved)
  with pytest.raises(ValueError, match=r"holds other dtypes .*stored float32, expected bfloat16"):
    # The target's dtypes are what is compared: its shapes suffice (jax.eval_shape).
    forge_jax.restore_train_state(tmp_path / "ckpt", state("bfloat16", abstract=True))
  restored = forge_jax.restore_train_state(tmp_path / "ckpt", saved)  # a float32 target restores
  assert int(restored.step) == 0
