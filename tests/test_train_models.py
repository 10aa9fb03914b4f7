"""Training the model presets with FORGE: parity with optax, and exact resume."""

import dataclasses
import collections
import functools
import re

import flax

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
import models

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles")  # tests/conftest.py
# The default CPU emitter for the comparisons with optax, which hold to a few float32 ulps over
# several steps; the legacy one (tests/conftest.py: legacy_cpu_emitter_for_test) for the tests
# that compare nothing with optax (HLO, errors, warnings, bit-exact reruns of one program).

STEPS = 3


def _loss(apply_fn, variables, batch):
  logits = apply_fn(variables, batch[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _batches(cfg, n):
  return [jax.random.randint(jax.random.PRNGKey(100 + i), (2, 9), 0, cfg.vocab_size) for i in range(n)]


# The family (qwen3: q/k norms, tied head; llama: untied FORGE head) and the layout are
# independent: each family once, each layout once. Scanned tiny-llama:
# test_scanned_forge_equals_unrolled_forge_and_optax_at_every_remat.
@pytest.mark.parametrize("name, scan", [("tiny-qwen3", True), ("tiny-llama", False)],
                         ids=["tiny-qwen3-scanned", "tiny-llama-unrolled"])
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


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
@pytest.mark.parametrize("case", ["lion_fp32", "adamw_bf16_sr_int8"])
def test_resume_is_bit_exact(tmp_path, case):
  """Two steps, a checkpoint, two more from the restored state: the same state as four steps
  straight, bit for bit; also with bf16 weights rounded stochastically (the rounding streams
  follow the restored counts) and int8 states (codes and scales restored as written)."""
  if case == "lion_fp32":
    cfg = models.get_config("tiny-llama", linear="forge", remat="full")
    opt = forge_jax.lion(1e-3, weight_decay=0.1)
  else:
    cfg = models.get_config("tiny-llama", linear="forge", remat="full", param_dtype="bfloat16",
                            dtype="bfloat16", intermediate_size=128)  # int8 blocks of 64 along N
    opt = forge_jax.adamw(1e-3, weight_decay=0.1,
                          precision=forge_jax.Precision("stochastic", state_dtype="int8"))
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
  if case != "lion_fp32":  # int8 states in both the FORGE kernels' and the optax-managed states
    quantized = lambda tree: any(isinstance(x, forge_jax.QuantizedArray) for x in jax.tree.leaves(
        tree, is_leaf=lambda x: isinstance(x, forge_jax.QuantizedArray)))
    assert quantized(half.forge_state) and quantized(half.opt_state)
  forge_jax.save_train_state(tmp_path / "ckpt", half)
  resumed = forge_jax.restore_train_state(tmp_path / "ckpt", fresh())
  assert int(resumed.step) == 2
  for batch in batches[2:]:
    resumed, _ = forge_jax.train_step(resumed, batch, loss_fn)
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
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


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
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


# ----------------------------------------------------------------------------- scanned FORGE and remat


def _unstacked(tree, num_layers):
  """A scanned model's collection (params or forge_state) in the unrolled layout."""
  out = {}
  for path, leaf in flax.traverse_util.flatten_dict(flax.core.unfreeze(tree)).items():
    if path[:3] == ("decoder", "layers", "block"):
      for i in range(num_layers):
        out[("decoder", f"layers_{i}", *path[3:])] = jax.tree.map(lambda a, i=i: a[i], leaf)
    else:
      out[path] = leaf
  return flax.traverse_util.unflatten_dict(out)


def _all_eqns(jaxpr):
  """Every equation of ``jaxpr`` in program order, each followed by those of its sub-jaxprs."""
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      inner = getattr(p, "jaxpr", p)
      if hasattr(inner, "eqns"):
        yield from _all_eqns(inner)


def _forward_scan_outputs(jaxpr, length):
  """Output avals of the first scan of ``length`` steps in program order (the forward pass)."""
  scan = next((e for e in _all_eqns(jaxpr)
               if e.primitive.name == "scan" and e.params["length"] == length), None)
  return None if scan is None else [v.aval for v in scan.outvars]


def _train(cfg, variables, opt, batches):
  """Losses and final state of len(batches) FORGE steps, with the step's jaxpr and executable."""
  model = models.CausalLM(cfg, optimizer=opt)
  loss_fn = functools.partial(_loss, model.apply)
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  jaxpr = jax.make_jaxpr(lambda s, b: forge_jax.train_step(s, b, loss_fn))(state, batches[0])
  compiled = forge_jax.train_step.lower(state, batches[0], loss_fn).compile()
  losses = []
  for batch in batches:
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))
  return losses, state, jaxpr, compiled


@functools.lru_cache(maxsize=None)
def _references():
  """Unrolled FORGE (no remat) and optax runs from the scanned model's init, shared by every
  remat setting (checkpointing changes what is saved, not the values)."""
  cfg = models.get_config("tiny-llama", linear="forge", remat="none", scan_layers=True)
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  batches = _batches(cfg, STEPS)
  variables = jax.jit(models.CausalLM(cfg, optimizer=opt).init)(jax.random.PRNGKey(0), batches[0][:, :-1])
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  unrolled_vars = {k: _unstacked(v, cfg.num_layers) for k, v in variables.items()}
  losses_u, state_u, _, _ = _train(unrolled, jax.tree.map(jnp.copy, unrolled_vars), opt, batches)

  ref_model = models.CausalLM(dataclasses.replace(unrolled, linear="flax"))
  tx = optax.adamw(1e-2, weight_decay=0.1)

  @jax.jit
  def ref_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: _loss(ref_model.apply, {"params": p}, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(jnp.copy, unrolled_vars["params"])
  opt_state, losses_o = tx.init(params), []
  for batch in batches:
    params, opt_state, loss = ref_step(params, opt_state, batch)
    losses_o.append(float(loss))
  return cfg, opt, batches, variables, (losses_u, state_u), (losses_o, params, opt_state)


@pytest.mark.parametrize("remat, names", [
    ("none", ()), ("dots_saveable", ()), ("save_only_these_names", ("attention_out", "mlp_hidden")),
    ("full", ())], ids=["none", "dots_saveable", "save_only_these_names", "full"])
def test_scanned_forge_equals_unrolled_forge_and_optax_at_every_remat(remat, names):
  """A scanned FORGE model (forge_jax.ScannedStack) trains like the unrolled FORGE model to
  float32 rounding and like optax to the parity tolerances, whatever its activation
  checkpointing; its forward scan saves no stacked weight or state (the backward reads the live
  stacks), and the compiled step updates the stacks in place, without copying them."""
  cfg, opt, batches, variables, (losses_u, state_u), (losses_o, params_o, opt_state_o) = _references()
  cfg = dataclasses.replace(cfg, remat=remat, remat_names=names)
  losses, state, jaxpr, compiled = _train(cfg, jax.tree.map(jnp.copy, variables), opt, batches)

  # Unrolled FORGE: same sums in another program, so float32 rounding apart.
  np.testing.assert_allclose(losses, losses_u, rtol=1e-6)
  for ours, theirs in [(state.params, state_u.params), (state.forge_state, state_u.forge_state)]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 _unstacked(ours, cfg.num_layers), theirs)
  # optax: the tolerances of test_forge_training_matches_optax.
  np.testing.assert_allclose(losses, losses_o, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5),
               _unstacked(state.params, cfg.num_layers), params_o)
  mu_o = opt_state_o[0].mu["decoder"]["layers_1"]["mlp"]["gate_proj"]["kernel"]
  mu = state.forge_state["decoder"]["layers"]["block"]["mlp"]["gate_proj"]["kernel"].opt.mu[1]
  np.testing.assert_allclose(mu, mu_o, rtol=1e-4, atol=5e-6)

  # What the forward scan keeps per layer: never a FORGE kernel or state slot, neither the
  # layer's slice ([L, K, N] stacked) nor the whole stack ([L, L, K, N]).
  stacks = {(a.shape, a.dtype) for a in jax.tree.leaves(state.forge_state) + jax.tree.leaves(
      state.params["decoder"]) if a.ndim == 3}
  saved = _forward_scan_outputs(jaxpr.jaxpr, cfg.num_layers)
  assert not [a for a in saved if (a.shape[-2:], a.dtype) in {(s[1:], d) for s, d in stacks}], saved
  b, t = batches[0][:, :-1].shape
  block_input = (cfg.num_layers, b, t, cfg.hidden_size)
  named = [(cfg.num_layers, b, t, cfg.num_heads, cfg.head_dim),  # attention_out
           (cfg.num_layers, b, t, cfg.intermediate_size)]  # mlp_hidden
  expected = {"full": [block_input], "save_only_these_names": [block_input, *named]}
  if remat in expected:
    # After the forward loop's counter and carried hidden state: what it fills per layer.
    assert sorted(a.shape for a in saved[2:]) == sorted(expected[remat]), saved
  else:  # activations inside the blocks too
    assert len(saved) > 3, saved
  # The compiled step: no copy of a stack, and every state buffer updated in place.
  hlo = compiled.as_text()
  kernel_stacks = collections.Counter(_hlo_shape(a) for a in jax.tree.leaves(state.params["decoder"])
                                      if a.ndim == 3)
  all_stacks = kernel_stacks + collections.Counter(
      _hlo_shape(a) for a in jax.tree.leaves(state.forge_state) if a.ndim == 3)
  copies = [l.strip() for l in hlo.splitlines() if re.search(r"= \S+ copy\(", l)]
  bad = [c for c in copies if any(s + "{" in c.split(" copy(")[0] for s in all_stacks)]
  assert not bad, "copies of stacked FORGE weight/state buffers:\n" + "\n".join(bad)
  stats = compiled.memory_analysis()
  assert stats.alias_size_in_bytes == stats.argument_size_in_bytes - batches[0].nbytes
  # The loops' buffers: the forward loop reads each kernel stack, the backward loop carries every
  # stack (kernels and slots). A weight saved per layer, as its layer's slice or as the whole
  # stack, would be one more loop buffer ending in a kernel's [K, N].
  def per_layer(shape):
    dtype, dims = re.fullmatch(r"(\w+)\[([0-9,]*)\]", shape).groups()
    dims = dims.split(",")
    return (dtype, *dims[-2:]) if len(dims) >= 3 else None

  in_loops = collections.Counter()
  for line in hlo.splitlines():
    if re.search(r"= \(.*\) while\(", line):
      in_loops.update(per_layer(s) for s in re.findall(r"\w+\[[0-9,]*\]", line.split(" while(")[0]))
  allowed = collections.Counter()
  for shape, n in all_stacks.items():
    allowed[per_layer(shape)] += kernel_stacks[shape] + n
  assert all(in_loops[k] <= n for k, n in allowed.items()), (in_loops, allowed)


def test_unrolled_save_all_but_elementwise_trains_like_remat_none():
  """``remat="save_all_but_elementwise"`` on unrolled blocks (what a scanned stack without remat
  saves) changes what the forward keeps, not the values: the same losses, weights and states as
  unrolled remat none to float32 rounding, with every block under forge_jax's policy."""
  cfg, opt, batches, variables, (losses_u, state_u), _ = _references()
  unrolled = dataclasses.replace(cfg, scan_layers=False, remat="save_all_but_elementwise")
  unrolled_vars = {k: _unstacked(v, cfg.num_layers) for k, v in variables.items()}
  losses, state, jaxpr, _ = _train(unrolled, jax.tree.map(jnp.copy, unrolled_vars), opt, batches)
  np.testing.assert_allclose(losses, losses_u, rtol=1e-6)
  for ours, theirs in [(state.params, state_u.params), (state.forge_state, state_u.forge_state)]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, theirs)
  # jax.checkpoint's primitive is named "remat2" (a jaxpr prints it as "checkpoint").
  policies = [e.params["policy"] for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "remat2"]
  assert len(policies) >= cfg.num_layers, policies
  assert all(p is forge_jax.save_all_but_elementwise for p in policies), policies


def _hlo_shape(a):
  """``a``'s shape as HLO prints it, e.g. ``f32[2,64,160]``."""
  return f"{a.dtype.name.replace('float', 'f')}[{','.join(map(str, a.shape))}]"


@pytest.mark.usefixtures("legacy_cpu_emitter_for_test")
def test_scanned_forge_remat_is_bit_exact_with_bfloat16_weights_and_int8_states():
  """Activation checkpointing changes what is saved, not a bit of the result: with bf16 weights
  (stochastic rounding, streams by path and layer) and int8 states, a step of the scanned FORGE
  model is the same without remat and with full remat."""
  opt = forge_jax.adamw(1e-2, precision=forge_jax.Precision(state_dtype="int8"))
  cfg = models.get_config("tiny-llama", linear="forge", remat="none", scan_layers=True,
                          param_dtype="bfloat16", dtype="bfloat16",
                          intermediate_size=128)  # int8 blocks of 64 along every N
  batches = _batches(cfg, 1)
  # Both models start from one init (remat leaves the parameters and states as they are).
  variables = jax.jit(models.CausalLM(cfg, optimizer=opt).init)(jax.random.PRNGKey(0), batches[0][:, :-1])
  results = []
  for remat in ("none", "full"):
    model = models.CausalLM(dataclasses.replace(cfg, remat=remat), optimizer=opt)
    state = forge_jax.TrainState.create(model.apply, jax.tree.map(jnp.copy, variables), opt)
    for batch in batches:
      state, _ = forge_jax.train_step(state, batch, functools.partial(_loss, model.apply))
    results.append(jax.tree.leaves(state))
  for a, b in zip(*results, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
