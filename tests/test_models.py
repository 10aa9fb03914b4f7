"""models: presets, layer-stack layouts, switches and HF checkpoint I/O (no torch needed)."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from models import hf_io
from models._layers import rope_inv_frequencies, rope_sin_cos

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

TINY = ("tiny-qwen3", "tiny-llama")

# Abridged config.json files of the real checkpoints (Hugging Face Hub,
# transformers 4.4x/4.5x era), to check the presets against.
_QWEN3_COMMON = dict(
    architectures=["Qwen3ForCausalLM"], num_key_value_heads=8, head_dim=128, vocab_size=151936,
    rope_theta=1000000, rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=40960,
    hidden_act="silu", attention_bias=False, use_sliding_window=False, initializer_range=0.02)
HUB_CONFIGS = {
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-14b": dict(_QWEN3_COMMON, hidden_size=5120, intermediate_size=17408,
                      num_hidden_layers=40, num_attention_heads=40, tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3_COMMON, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, tie_word_embeddings=False),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
        max_position_embeddings=131072, hidden_act="silu", attention_bias=False, mlp_bias=False,
        initializer_range=0.02),
}


def _tokens(cfg, batch=2, length=12, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)


# Compilation dominates these tests' time on CPU: init and apply are jitted
# once per config and shared.
@functools.lru_cache(maxsize=None)
def _init(name: str, **overrides):
  cfg = models.get_config(name, **overrides)
  params = jax.jit(models.CausalLM(cfg).init)(jax.random.key(0), _tokens(cfg))["params"]
  return cfg, params


@functools.lru_cache(maxsize=None)
def _apply(cfg):
  return jax.jit(models.CausalLM(cfg).apply)


def _logits(cfg, params, tokens):
  return _apply(cfg)({"params": params}, tokens)


def _relayout(scanned_params, cfg):
  """Scanned params in the layout ``cfg.scan_layers`` asks for (via the HF names)."""
  return hf_io.params_from_hf(
      hf_io.params_to_hf(scanned_params, dataclasses.replace(cfg, scan_layers=True)), cfg)


# ----------------------------------------------------------------------------- configs


def test_get_config_unknown_name_lists_the_presets():
  with pytest.raises(ValueError, match="Unknown model config 'qwen3-9b'.*qwen3-0.6b.*llama-3.1-8b"):
    models.get_config("qwen3-9b")


def test_get_config_overrides():
  cfg = models.get_config("qwen3-8b", linear="forge", remat="full", dtype="bfloat16")
  assert (cfg.linear, cfg.remat, cfg.dtype, cfg.num_layers) == ("forge", "full", "bfloat16", 36)


@pytest.mark.parametrize("field, value, message", [
    ("linear", "torch", "linear='torch' is not one of 'flax', 'forge'"),
    ("remat", "save_these_names", "remat='save_these_names' is not one of"),
    ("remat", "save_only_these_names", "remat='save_only_these_names' needs remat_names"),
    ("remat_names", ("mlp_hidden",), r"remat_names=\('mlp_hidden',\) is only read by"),
    ("num_kv_heads", 3, "num_heads=4 must be a multiple of num_kv_heads=3"),
    ("dtype", "int8", "dtype='int8' must be the name of a float dtype"),
    ("family", "gemma", "family='gemma' is not one of"),
    ("forge_backend", "triton", "forge_backend='triton' is not one of"),
])
def test_config_validation(field, value, message):
  with pytest.raises(ValueError, match=message):
    models.get_config("tiny-llama", **{field: value})


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_presets_match_the_hub_config_json(name):
  assert hf_io.config_from_hf(HUB_CONFIGS[name]) == models.get_config(name)


# Published totals (model cards: 0.6B/1.7B/4.0B/8.2B/14.8B/32.8B, tied weights counted once;
# Llama-3.1-8B exactly 8,030,261,248).
@pytest.mark.parametrize("name, billions", [
    ("qwen3-0.6b", 0.596), ("qwen3-1.7b", 1.72), ("qwen3-4b", 4.02), ("qwen3-8b", 8.19),
    ("qwen3-14b", 14.77), ("qwen3-32b", 32.76), ("llama-3.1-8b", 8.030),
])
def test_preset_parameter_counts(name, billions):
  cfg = models.get_config(name)
  assert cfg.num_params / 1e9 == pytest.approx(billions, abs=0.006)


def test_num_params_counts_the_initialized_tree():
  # And eval_shape of a full-size preset builds without allocating it.
  for name in TINY:
    cfg, params = _init(name)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
  cfg = models.get_config("llama-3.1-8b")
  shapes = jax.eval_shape(models.CausalLM(cfg).init, jax.random.key(0),
                          jnp.zeros((1, 8), jnp.int32))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params == 8_030_261_248


def test_llama3_rope_scaling_keeps_short_divides_long_interpolates_between():
  cfg = models.get_config("tiny-llama")
  plain = rope_inv_frequencies(dataclasses.replace(cfg, rope_scaling=None))
  scaled = rope_inv_frequencies(cfg)
  s = cfg.rope_scaling
  wavelen = 2 * np.pi / plain
  short = wavelen < s.original_max_position_embeddings / s.high_freq_factor
  long = wavelen > s.original_max_position_embeddings / s.low_freq_factor
  assert short.any() and long.any() and (~short & ~long).any()  # all three bands occur
  np.testing.assert_array_equal(scaled[short], plain[short])
  np.testing.assert_allclose(scaled[long], plain[long] / s.factor, rtol=1e-6)
  mid = ~short & ~long
  assert np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / s.factor)


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("name", TINY)
def test_param_tree_uses_hf_names(name):
  cfg, params = _init(name)
  block = params["decoder"]["layers"]["block"]
  assert set(block) == {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp"}
  attn = {"q_proj", "k_proj", "v_proj", "o_proj"} | ({"q_norm", "k_norm"} if cfg.qk_norm else set())
  assert set(block["self_attn"]) == attn
  q_shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
  assert block["self_attn"]["q_proj"]["kernel"].shape == q_shape
  assert ("lm_head" in params) == (not cfg.tie_word_embeddings)


@pytest.mark.parametrize("name", TINY)
def test_scanned_equals_unrolled(name):
  cfg, params = _init(name)
  unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
  unrolled = _relayout(params, unrolled_cfg)
  assert sorted(unrolled["decoder"]) == [f"layers_{i}" for i in range(cfg.num_layers)]
  tokens = _tokens(cfg)
  np.testing.assert_allclose(_logits(unrolled_cfg, unrolled, tokens), _logits(cfg, params, tokens),
                             rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
  cfg, params = _init("tiny-qwen3")
  tokens = _tokens(cfg)
  changed = tokens.at[:, 7:].set((tokens[:, 7:] + 1) % cfg.vocab_size)
  a, b = _logits(cfg, params, tokens), _logits(cfg, params, changed)
  np.testing.assert_array_equal(a[:, :7], b[:, :7])
  assert not np.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("scan_layers, remat",
                         [(True, "full"), (False, "dots_with_no_batch_dims_saveable")])
def test_remat_changes_neither_logits_nor_gradients(scan_layers, remat):
  cfg, params = _init("tiny-llama")
  cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  params = _relayout(params, cfg)
  tokens = _tokens(cfg)

  def loss(c, p):
    return jnp.mean(_logits(c, p, tokens) ** 2)

  remat_cfg = dataclasses.replace(cfg, remat=remat)
  (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(functools.partial(loss, c)))(params)
                        for c in (cfg, remat_cfg))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)


def test_bfloat16_compute_with_float32_params():
  cfg, params = _init("tiny-qwen3")
  bf16 = dataclasses.replace(cfg, dtype="bfloat16")
  tokens = _tokens(cfg)
  logits = _logits(bf16, params, tokens)
  assert logits.dtype == jnp.bfloat16
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  np.testing.assert_allclose(logits.astype(jnp.float32), _logits(cfg, params, tokens), atol=0.05)


def test_bfloat16_params():
  cfg = models.get_config("tiny-llama", param_dtype="bfloat16")
  params = jax.eval_shape(models.CausalLM(cfg).init, jax.random.key(0), _tokens(cfg))["params"]
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}


# ----------------------------------------------------------------------------- FORGE switch


def test_param_labels():
  cfg, params = _init("tiny-llama")
  assert set(jax.tree.leaves(models.param_labels(cfg, params))) == {"optax"}
  forge_cfg = dataclasses.replace(cfg, linear="forge", remat="full")
  labels = models.param_labels(forge_cfg, params)
  block = labels["decoder"]["layers"]["block"]
  assert block["self_attn"]["q_proj"]["kernel"] == block["mlp"]["down_proj"]["kernel"] == "forge"
  assert block["input_layernorm"]["scale"] == labels["embed_tokens"]["embedding"] == "optax"
  assert labels["lm_head"]["kernel"] == "forge"
  assert "lm_head" in forge_cfg.forge_layer_names
  # A tied head is the embedding: optax's.
  assert "lm_head" not in models.get_config("tiny-qwen3", linear="forge", remat="full").forge_layer_names


def test_forge_needs_an_optimizer():
  cfg = models.get_config("tiny-qwen3", linear="forge", remat="full")
  with pytest.raises(ValueError, match="needs a FORGE optimizer"):
    models.CausalLM(cfg).init(jax.random.key(0), _tokens(cfg))


def test_scanned_layout_is_forge_scanned_stacks():
  """forge_jax.ScannedStack can replace the scanned branch: same tree, same init, same output."""
  forge_jax = pytest.importorskip("forge_jax")
  if not hasattr(forge_jax, "ScannedStack"):
    pytest.skip("forge_jax.ScannedStack is not available")
  cfg = models.get_config("tiny-qwen3", linear="forge", remat="full")
  opt = forge_jax.adamw(1e-3)
  x_BxLxD = jax.random.normal(jax.random.key(0), (2, 8, cfg.hidden_size))
  rope = rope_sin_cos(jnp.broadcast_to(jnp.arange(8), (2, 8)), rope_inv_frequencies(cfg))
  ours = models.DecoderStack(cfg, opt)
  theirs = forge_jax.ScannedStack(functools.partial(models.DecoderBlock, cfg, opt), cfg.num_layers)
  ours_vars, theirs_vars = (jax.jit(m.init)(jax.random.key(1), x_BxLxD, rope) for m in (ours, theirs))
  jax.tree.map(np.testing.assert_array_equal, ours_vars, theirs_vars)
  params = {"params": ours_vars["params"]}
  theirs_y, ours_y = (jax.jit(m.apply)(params, x_BxLxD, rope) for m in (theirs, ours))
  np.testing.assert_allclose(theirs_y, ours_y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("remat, policy", [(False, "dots_saveable"), (True, "dots_saveable")])
def test_scanned_stack_policy_errors(remat, policy):
  """A policy is a jax.checkpoint_policies callable, and means nothing without remat."""
  forge_jax = pytest.importorskip("forge_jax")
  cfg = models.get_config("tiny-qwen3")
  if remat:
    policy_arg = policy  # the name, where the policy itself is needed
  else:
    policy_arg = getattr(jax.checkpoint_policies, policy)
  stack = forge_jax.ScannedStack(functools.partial(models.DecoderBlock, cfg), 2, remat=remat,
                                 remat_policy=policy_arg)
  x_BxLxD = jnp.zeros((1, 4, cfg.hidden_size))
  rope = rope_sin_cos(jnp.zeros((1, 4), jnp.int32), rope_inv_frequencies(cfg))
  with pytest.raises(ValueError, match=r"ScannedStack\(remat=.*remat_policy=.*a policy is a callable"):
    stack.init(jax.random.key(0), x_BxLxD, rope)


def test_forge_backend_choices_are_forge_jax_backends():
  from forge_jax import _fused
  assert models.FORGE_BACKENDS == _fused.BACKENDS


def _forge_loss(apply_fn, variables, batch):
  logits = apply_fn(variables, batch[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@functools.lru_cache(maxsize=None)
def _forge_start_and_optax_step():
  """The FORGE model's variables (the backend does not enter its init) and the parameters after
  one optax step of the same optimizer from them, shared by every backend's case."""
  import forge_jax  # pylint: disable=g-import-not-at-top
  # scanned, untied: lm_head is FORGE too
  cfg = models.get_config("tiny-llama", linear="forge", remat="full")
  opt = forge_jax.adamw(1e-2, weight_decay=0.1)
  batch = _tokens(cfg, length=9)
  variables = jax.jit(models.CausalLM(cfg, optimizer=opt).init)(jax.random.key(0), batch[:, :-1])
  params = variables["params"]
  flax_apply = models.CausalLM(dataclasses.replace(cfg, linear="flax")).apply
  grads = jax.jit(jax.grad(lambda p: _forge_loss(flax_apply, {"params": p}, batch)))(params)
  reference_opt = optax.adamw(1e-2, weight_decay=0.1)
  updates, _ = reference_opt.update(grads, reference_opt.init(params), params)
  return cfg, opt, batch, variables, optax.apply_updates(params, updates)


@pytest.mark.parametrize("forge_backend", ["auto", "interpret"])
def test_forge_linear_trains_like_optax(forge_backend):
  """One step with FORGE layers equals one optax step of the same optimizer.

  ``forge_backend="interpret"`` runs every layer's update through the Pallas
  kernel (interpret mode), so it also checks that the backend reaches the layers.
  """
  forge_jax = pytest.importorskip("forge_jax")
  if not hasattr(forge_jax, "train_step"):
    pytest.skip("forge_jax.train_step is not available")
  cfg, opt, batch, variables, expected = _forge_start_and_optax_step()
  assert "forge_state" in variables
  model = models.CausalLM(dataclasses.replace(cfg, forge_backend=forge_backend), optimizer=opt)
  # A copy: train_step donates its state.
  state = forge_jax.TrainState.create(model.apply, jax.tree.map(jnp.copy, variables), opt)
  state, _ = forge_jax.train_step(state, batch, functools.partial(_forge_loss, model.apply))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5), state.params, expected)


# ----------------------------------------------------------------------------- checkpoint I/O


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_save_load_round_trip(tmp_path, name, scan_layers):
  cfg, params = _init(name)
  cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  params = _relayout(params, cfg)
  models.save_checkpoint(tmp_path, cfg, params, base_config={"bos_token_id": 7})
  assert json.loads((tmp_path / "config.json").read_text())["bos_token_id"] == 7
  loaded_cfg, loaded = models.load_checkpoint(tmp_path, scan_layers=scan_layers)
  assert loaded_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_tied_checkpoint_has_no_lm_head(tmp_path):
  cfg, params = _init("tiny-qwen3")
  names = set(hf_io.params_to_hf(params, cfg))
  assert "lm_head.weight" not in names and "model.layers.1.self_attn.k_norm.weight" in names


def test_sharded_bfloat16_checkpoint(tmp_path):
  cfg, params = _init("tiny-llama")
  models.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16", max_shard_bytes=40_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
  loaded_cfg, loaded = models.load_checkpoint(tmp_path)
  assert loaded_cfg.param_dtype == "float32"  # the storage dtype is the caller's choice
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  jax.tree.map(np.testing.assert_array_equal, loaded, rounded)


def test_config_json_round_trip_and_transformers5_rope_parameters():
  for name in list(models.PRESETS):
    cfg = models.get_config(name)
    assert hf_io.config_from_hf(hf_io.config_to_hf(cfg)) == cfg
  # transformers 5 writes rope settings as one `rope_parameters` dict.
  hf = dict(HUB_CONFIGS["llama-3.1-8b"])
  rope = dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta"))
  assert hf_io.config_from_hf({**hf, "rope_parameters": rope}) == models.get_config("llama-3.1-8b")


def _tensors(name="tiny-llama"):
  cfg, params = _init(name)
  return cfg, hf_io.params_to_hf(params, cfg)


def test_error_missing_tensor():
  cfg, tensors = _tensors()
  del tensors["model.layers.1.mlp.up_proj.weight"]
  message = r"missing 1 tensor\(s\): 'model.layers.1.mlp.up_proj.weight'"
  with pytest.raises(ValueError, match=message):
    hf_io.params_from_hf(tensors, cfg)


def test_error_unexpected_tensor():
  cfg, tensors = _tensors()
  tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"]
  message = r"unexpected 1 tensor\(s\): 'model.layers.2.mlp.up_proj.weight'"
  with pytest.raises(ValueError, match=message):
    hf_io.params_from_hf(tensors, cfg)


def test_error_wrong_shape():
  cfg, tensors = _tensors()
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
  message = r"'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), expected \(32, 64\)"
  with pytest.raises(ValueError, match=message):
    hf_io.params_from_hf(tensors, cfg)


def test_qwen3_checkpoint_read_as_llama_names_the_q_k_norms():
  cfg, tensors = _tensors("tiny-qwen3")
  message = r"unexpected 4 tensor\(s\): 'model.layers.0.self_attn.k_norm.weight'"
  with pytest.raises(ValueError, match=message):
    hf_io.params_from_hf(tensors, dataclasses.replace(cfg, family="llama"))


def test_tied_checkpoint_with_a_different_head_is_refused():
  cfg, tensors = _tensors("tiny-qwen3")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  hf_io.params_from_hf(tensors, cfg)  # an identical copy of the embedding is fine
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
  with pytest.raises(ValueError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
    hf_io.params_from_hf(tensors, cfg)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]},
     r"Unsupported architecture \['MistralForCausalLM'\]"),
    ({"architectures": None, "model_type": "gemma"}, "Unsupported architecture 'gemma'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "Unsupported rope type 'yarn'"),
])
def test_error_unsupported_config(change, message):
  with pytest.raises(ValueError, match=message):
    hf_io.config_from_hf({**HUB_CONFIGS["llama-3.1-8b"], **change})


def test_error_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="No config.json"):
    models.load_checkpoint(tmp_path)
  config = hf_io.config_to_hf(models.get_config("tiny-llama"))
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(FileNotFoundError,
                     match="No model.safetensors or model.safetensors.index.json"):
    models.load_checkpoint(tmp_path)


def test_error_params_of_the_other_layout():
  cfg, params = _init("tiny-llama")
  with pytest.raises(ValueError, match="params have no decoder/layers_0/input_layernorm/scale"):
    hf_io.params_to_hf(params, dataclasses.replace(cfg, scan_layers=False))


def _forward_scan_residuals(jaxpr, length):
  """Avals of the stacked outputs of the first scan of ``length`` steps in program order (its
  ``ys``, and the carried buffers of ``length`` layers that a ``fori_loop`` fills): what the
  forward pass keeps per layer."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and eqn.params["length"] == length:
      n = eqn.params["num_carry"]
      # A fori_loop's scan carries its counter first, then the hidden state, then its buffers.
      counted = n >= 2 and not eqn.outvars[0].aval.shape
      filled = [v for v in eqn.outvars[2:n] if counted and v.aval.ndim and v.aval.shape[0] == length]
      return sorted(str(v.aval) for v in eqn.outvars[n:] + filled)
    for p in eqn.params.values():
      inner = getattr(p, "jaxpr", p)
      if hasattr(inner, "eqns"):
        found = _forward_scan_residuals(inner, length)
        if found is not None:
          return found
  return None


@pytest.mark.parametrize("remat", ["none", "dots_saveable", "full"])
def test_forge_scanned_training_saves_the_same_residuals_as_optax(remat):
  """Scanned layers: FORGE's train step keeps per layer exactly what the flax + optax step keeps
  between the forward and backward scans, whatever the activation checkpointing (with full
  remat, one block input per layer), so any peak-memory difference between them is in
  transient buffers, not saved activations."""
  import forge_jax  # pylint: disable=g-import-not-at-top
  from experiments import bench_models  # pylint: disable=g-import-not-at-top

  batch, tokens = 3, 40
  data = jnp.zeros((batch, tokens + 1), jnp.int32)
  outputs = {}
  for impl in ("optax", "forge"):
    linear = "forge" if impl == "forge" else "flax"
    cfg = models.get_config("tiny-llama", linear=linear, remat=remat, scan_layers=True,
                            forge_backend="xla", param_dtype="bfloat16", dtype="bfloat16")
    opt = bench_models._forge_optimizer(impl)
    model = models.CausalLM(cfg, optimizer=opt)
    # Only the traced program is read: the states' shapes suffice (no init to run).
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(1), data[:, :-1])
    loss_fn = functools.partial(bench_models._loss, model.apply)
    if opt is not None:
      state = jax.eval_shape(lambda v: forge_jax.TrainState.create(model.apply, v, opt), variables)
      jaxpr = jax.make_jaxpr(lambda s, d: forge_jax.train_step(s, d, loss_fn))(state, data)
    else:
      tx, step = bench_models.optax_baseline(impl, loss_fn)
      jaxpr = jax.make_jaxpr(step)((variables["params"], jax.eval_shape(tx.init, variables["params"])),
                                   data)
    outputs[impl] = _forward_scan_residuals(jaxpr.jaxpr, cfg.num_layers)
  hidden = f"bfloat16[{cfg.num_layers},{batch},{tokens},{cfg.hidden_size}]"
  assert hidden in outputs["optax"]
  assert (outputs["optax"] == [hidden]) == (remat == "full")
  assert outputs["forge"] == outputs["optax"]


def test_scanned_without_remat_saves_no_elementwise_functions_of_an_activation():
  """Without remat a scanned Llama block keeps its activations, not elementwise functions of them:
  per layer the gate and up projections, not also sigmoid(g), silu(g) or the down projection's
  input silu(g) * up (named ``mlp_hidden``: a name is no reason to save), and no float32 upcast
  of the bfloat16 hidden state or of q and k (forge_jax.save_all_but_elementwise)."""
  import forge_jax  # pylint: disable=g-import-not-at-top
  from experiments import bench_models  # pylint: disable=g-import-not-at-top

  batch, tokens = 3, 40
  data = jnp.zeros((batch, tokens + 1), jnp.int32)
  cfg = models.get_config("tiny-llama", linear="forge", remat="none", scan_layers=True,
                          forge_backend="xla", param_dtype="bfloat16", dtype="bfloat16")
  opt = bench_models._forge_optimizer("forge")
  model = models.CausalLM(cfg, optimizer=opt)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(1), data[:, :-1])
  state = jax.eval_shape(lambda v: forge_jax.TrainState.create(model.apply, v, opt), variables)
  loss_fn = functools.partial(bench_models._loss, model.apply)
  jaxpr = jax.make_jaxpr(lambda s, d: forge_jax.train_step(s, d, loss_fn))(state, data)
  saved = _forward_scan_residuals(jaxpr.jaxpr, cfg.num_layers)
  wide = f"bfloat16[{cfg.num_layers},{batch},{tokens},{cfg.intermediate_size}]"
  assert saved.count(wide) == 2, saved
  assert not [a for a in saved if a.startswith("float32") and a.endswith(f",{cfg.hidden_size}]")], saved
  # Nor the float32 halves of q and k that RoPE splits (jnp.split is a primitive of its own).
  assert not [a for a in saved if a.startswith("float32") and a.endswith(f",{cfg.head_dim // 2}]")], saved
  assert forge_jax.save_all_but_elementwise(jax.lax.dot_general_p)
  assert not forge_jax.save_all_but_elementwise(jax.lax.logistic_p)


# ----------------------------------------------------------------------------
# The loss.
# ----------------------------------------------------------------------------


def _optax_nll(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cross_entropy_equals_optax_value_and_gradient(dtype):
  logits = (3 * jax.random.normal(jax.random.PRNGKey(0), (3, 17, 500))).astype(dtype)
  labels = jax.random.randint(jax.random.PRNGKey(1), (3, 17), 0, 500)
  want, want_g = jax.value_and_grad(_optax_nll)(logits, labels)
  got, got_g = jax.value_and_grad(models.cross_entropy)(logits, labels)
  assert got.dtype == jnp.float32 and got_g.dtype == dtype
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  # float32 gradients agree to rounding; bf16 ones to one bf16 ulp, rarely.
  tol = 2e-8 if dtype == jnp.float32 else 2.0**-8 * float(jnp.max(jnp.abs(want_g.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(got_g, np.float32), np.asarray(want_g, np.float32), atol=tol)
  # The label's own logit gets (p - 1) / n: check one element.
  p = jax.nn.softmax(logits[1, 2].astype(jnp.float32))
  np.testing.assert_allclose(float(got_g[1, 2, labels[1, 2]]), float((p[labels[1, 2]] - 1) / labels.size),
                             rtol=2.0**-7 if dtype == jnp.bfloat16 else 1e-5)


def test_cross_entropy_keeps_no_float32_copy_of_the_logits():
  """The reason it exists: compiled loss+grad of bf16 logits through an LM head needs at
  least one bf16-logits-sized buffer less than optax's spelling (a float32 copy is two)."""
  b, t, d, v = 4, 128, 64, 8192
  x = jnp.ones((b, t, d), jnp.bfloat16)
  w = jnp.zeros((d, v), jnp.bfloat16)
  y = jnp.zeros((b, t), jnp.int32)

  def temp(loss):
    f = jax.jit(jax.value_and_grad(lambda w: loss(x @ w, y)))
    return f.lower(w).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = b * t * v * 2
  lean, optax_way = temp(models.cross_entropy), temp(_optax_nll)
  assert lean <= optax_way - 0.9 * logits_bytes, (lean, optax_way, logits_bytes)


def _has_loop(jaxpr) -> bool:
  """A fori_loop with static bounds traces to a scan, others to a while."""
  return any(e.primitive.name in ("scan", "while") for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cross_entropy_backward_in_blocks_equals_one_pass(dtype, monkeypatch):
  """At a large batch the backward writes the gradient over the logits block by block (a loop);
  forced to 4 blocks at a small size it must give the one-pass gradient bit for bit, NaN rows
  for invalid ids (inside jit) included."""
  from models import _loss  # pylint: disable=g-import-not-at-top
  logits = (3 * jax.random.normal(jax.random.PRNGKey(0), (4, 64, 500))).astype(dtype)
  labels = jax.random.randint(jax.random.PRNGKey(1), (4, 64), 0, 500).at[2, 5].set(-1)
  grad = jax.jit(jax.grad(_loss._mean_nll))  # the checked entry point refuses -1 outside jit

  one_pass = np.asarray(grad(logits, labels).astype(jnp.float32))
  monkeypatch.setattr(_loss, "_BLOCK_BYTES", 64 * 500 * 4)
  assert _has_loop(jax.make_jaxpr(jax.grad(_loss._mean_nll))(logits, labels))
  blocked = np.asarray(jax.jit(jax.grad(_loss._mean_nll))(logits, labels).astype(jnp.float32))
  assert np.isnan(blocked[2, 5]).all() and not np.isnan(np.delete(blocked.reshape(256, 500), 133, 0)).any()
  np.testing.assert_array_equal(blocked, one_pass)


def test_cross_entropy_backward_block_choice():
  from models import _loss  # pylint: disable=g-import-not-at-top
  # Llama-3.1-8B at 64x1024: 8 positions of 64 sequences per block (250.5 MiB), 128 blocks.
  assert _loss._block_positions((64, 1024, 128256)) == 8
  assert _loss._block_positions((65536, 128256)) == 512  # flat rows: 512 per block
  assert _loss._block_positions((4, 64, 500), 64 * 500 * 4) == 16
  assert _loss._block_positions((97, 500), 64 * 500 * 4) == 1  # a prime count: one pass (rows < 64)
  assert _loss._block_positions((100, 500), 10**9) == 100  # fits one block
  # The real size takes the loop, traced from shapes alone; a small one the single pass.
  def traced(*shape):
    args = (jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct(shape[:-1], jnp.int32))
    return jax.make_jaxpr(jax.grad(_loss._mean_nll))(*args)
  assert _has_loop(traced(64, 1024, 128256)) and _has_loop(traced(65536, 128256))
  assert not _has_loop(traced(2048, 8192)) and not _has_loop(traced(97, 500))


SHARDED_LOSS_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from models import _loss
mesh = Mesh(np.array(jax.devices()), ("d",))
logits = (3 * jax.random.normal(jax.random.PRNGKey(0), (8, 64, 512))).astype(jnp.bfloat16)
labels = jax.random.randint(jax.random.PRNGKey(1), (8, 64), 0, 512)
grad = lambda: jax.jit(jax.grad(_loss._mean_nll))
for name, lg_spec, lb_spec, shape in [("batch", P("d"), P("d"), None), ("seq", P(None, "d"), P(None, "d"), None),
                                      ("vocab", P(None, None, "d"), P(), None),
                                      ("rows", P("d"), P("d"), (512, 512))]:
  lg = logits if shape is None else logits.reshape(shape)
  lb = labels if shape is None else labels.reshape(shape[:-1])
  lg = jax.device_put(lg, NamedSharding(mesh, lg_spec)); lb = jax.device_put(lb, NamedSharding(mesh, lb_spec))
  _loss._BLOCK_BYTES, _loss._MIN_BLOCK_ROWS = 64 * 512 * 4, 10**9
  one_pass = grad()(lg, lb)
  _loss._MIN_BLOCK_ROWS = 64
  compiled = grad().lower(lg, lb).compile()
  blocked = compiled(lg, lb)
  print(name, "loop" if "while" in compiled.as_text() else "no-loop",
        "gathers", compiled.as_text().count("all-gather"),
        "same-sharding", blocked.sharding.spec == lg.sharding.spec,
        "equal", bool(jnp.array_equal(blocked, one_pass)))
"""


def test_cross_entropy_backward_in_blocks_keeps_shardings():
  """The blocked backward must not gather a logits array split over devices (batch, sequence,
  vocabulary, or flat rows): each block is every nb-th position, so its dynamic slices run along
  an axis no device boundary cuts. Before, blocks of consecutive rows all-gathered a batch-split
  array on every step of the loop."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  # The fast compile flags of tests/conftest.py: the check reads the optimized HLO, which they
  # leave as it is.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
             "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
             JAX_PLATFORMS="cpu", PYTHONPATH=root)
  out = subprocess.run([sys.executable, "-c", SHARDED_LOSS_SCRIPT], capture_output=True,
                       text=True, env=env, cwd=root, timeout=300)
  lines = [l for l in out.stdout.splitlines() if l.split(" ")[0] in ("batch", "seq", "vocab", "rows")]
  assert len(lines) == 4, out.stdout + out.stderr
  for line in lines:
    assert line.endswith("loop gathers 0 same-sharding True equal True"), line


def test_cross_entropy_errors():
  logits = jnp.zeros((2, 3, 10))
  with pytest.raises(ValueError, match=r"labels of shape \(2, 4\).*expected \(2, 3\)"):
    models.cross_entropy(logits, jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(TypeError, match="integer class ids"):
    models.cross_entropy(logits, jnp.zeros((2, 3)))
  with pytest.raises(TypeError, match="float array"):
    models.cross_entropy(jnp.zeros((2, 3, 10), jnp.int32), jnp.zeros((2, 3), jnp.int32))


def test_saving_again_replaces_the_other_layout(tmp_path):
  """A sharded save over a single-file one (and back) leaves only the new weights: the old
  file would be read first by transformers (model.safetensors) or by us (the index)."""
  cfg, params = _init("tiny-llama")
  other = jax.tree.map(lambda a: a + 1, params)
  models.save_checkpoint(tmp_path, cfg, params)
  models.save_checkpoint(tmp_path, cfg, other, max_shard_bytes=40_000)
  assert not (tmp_path / hf_io.WEIGHTS_NAME).exists()
  _, loaded = models.load_checkpoint(tmp_path)
  np.testing.assert_array_equal(loaded["embed_tokens"]["embedding"], other["embed_tokens"]["embedding"])
  models.save_checkpoint(tmp_path, cfg, params)
  assert not (tmp_path / hf_io.INDEX_NAME).exists() and not list(tmp_path.glob("model-*-of-*"))
  _, loaded = models.load_checkpoint(tmp_path)
  np.testing.assert_array_equal(loaded["embed_tokens"]["embedding"], params["embed_tokens"]["embedding"])


def test_saving_params_the_config_does_not_write_is_an_error(tmp_path):
  cfg, params = _init("tiny-llama")  # untied: has an lm_head
  with pytest.raises(ValueError, match=r"params hold \['lm_head/kernel'\] .* would be lost"):
    models.save_checkpoint(tmp_path, dataclasses.replace(cfg, tie_word_embeddings=True), params)


def test_base_config_rope_and_dtype_keys_do_not_override_the_written_ones(tmp_path):
  cfg, params = _init("tiny-llama")
  base = {"bos_token_id": 7, "dtype": "float32", "rope_theta": 1.0,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
  models.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16", base_config=base)
  written = json.loads((tmp_path / hf_io.CONFIG_NAME).read_text())
  assert written["bos_token_id"] == 7 and "rope_parameters" not in written
  assert written["dtype"] == written["torch_dtype"] == "bfloat16"
  loaded_cfg, _ = models.load_checkpoint(tmp_path)
  assert loaded_cfg.rope_theta == cfg.rope_theta and loaded_cfg.rope_scaling == cfg.rope_scaling


def test_cross_entropy_refuses_ids_outside_the_vocabulary():
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11))
  labels = jnp.array([[1, 2, 3], [4, 5, -1]])
  with pytest.raises(ValueError, match=r"label ids range over \[-1, 5\], outside the vocabulary"):
    models.cross_entropy(logits, labels)
  # Under jit value and gradient agree: NaN (no wrap-around of -1 to the last class).
  value, grad = jax.jit(jax.value_and_grad(models.cross_entropy))(logits, labels)
  assert np.isnan(float(value)) and bool(jnp.isnan(grad).all(axis=-1)[1, 2])


@pytest.mark.parametrize("overrides, match", [
    (dict(num_kv_heads=0), "num_kv_heads=0 must be at least 1"),
    (dict(remat="save_anything_except_these_names", remat_names=("mlp_out",)),
     r"needs remat_names, a non-empty tuple of 'attention_out', 'mlp_hidden'; got .*mlp_out"),
    (dict(dtype="bf16"), "dtype='bf16' must be the name of a float dtype"),
    (dict(param_dtype="float64"), "needs jax_enable_x64"),
    (dict(rope_scaling={"factor": 8.0}), "must be None or a models.RopeScaling"),
])
def test_config_errors_name_the_value(overrides, match):
  with pytest.raises(ValueError, match=match):
    models.get_config("tiny-llama", **overrides)


def test_positions_of_another_shape_are_an_error():
  cfg, params = _init("tiny-llama")
  tokens = jnp.ones((2, 5), jnp.int32)
  with pytest.raises(ValueError, match=r"positions_BxL has shape \(5,\)"):
    models.CausalLM(cfg).apply({"params": params}, tokens, jnp.arange(5))


def test_saving_removes_only_the_index_own_shards(tmp_path):
  cfg, params = _init("tiny-llama")
  models.save_checkpoint(tmp_path / "ckpt", cfg, params, max_shard_bytes=40_000)
  index = json.loads((tmp_path / "ckpt" / hf_io.INDEX_NAME).read_text())
  index["weight_map"]["x"] = "../notes.txt"  # a hand-edited index naming a file outside
  (tmp_path / "ckpt" / hf_io.INDEX_NAME).write_text(json.dumps(index))
  (tmp_path / "notes.txt").write_text("keep me")
  models.save_checkpoint(tmp_path / "ckpt", cfg, params)
  assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_cross_entropy_of_no_labels_is_nan_not_an_error():
  assert np.isnan(float(models.cross_entropy(jnp.zeros((0, 11)), jnp.zeros((0,), jnp.int32))))
