"""The Llama-3.x and Qwen3 families in Flax NNX, with the Linen models' configs and checkpoints.

The same :class:`models.ModelConfig` and presets, the same math (RoPE, GQA
attention, SwiGLU, RMSNorm from :mod:`models._layers`) and the same
parameter tree as :class:`models.CausalLM`: ``nnx.state(model, nnx.Param)``
as a pure dict (:func:`params_of`) is the Linen ``params`` collection, so
:mod:`models.hf_io` reads and writes NNX models too (:func:`load_checkpoint`,
:func:`save_checkpoint`, :func:`load_params`).

With ``cfg.linear == "forge"`` every block projection (and an untied
``lm_head``) is a :class:`forge_jax.nnx.Linear` trained by
:func:`forge_jax.nnx.train_step`; ``cfg.scan_layers`` stacks the blocks in a
:class:`forge_jax.nnx.ScannedStack` (in place, as the Linen
``forge_jax.ScannedStack``); ``cfg.remat`` checkpoints each block as the Linen
model does. With ``"flax"`` the projections are ``flax.nnx.Linear``, trained
by ``nnx.Optimizer``.

Example::

  cfg = models.get_config("tiny-llama", linear="forge")
  opt = forge_jax.adamw(1e-3)
  model = models.nnx.CausalLM(cfg, opt, rngs=nnx.Rngs(0))
  optimizer = forge_jax.nnx.Optimizer(model, opt, wrt=nnx.Param)
  metrics = forge_jax.nnx.train_step(model, optimizer, batch, loss_fn)
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax import traverse_util
from jax.ad_checkpoint import checkpoint_name

import forge_jax.nnx as forge_nnx
from models import hf_io
from models._config import ModelConfig
from models._layers import apply_rope, attention_implementation
from models._layers import rope_inv_frequencies, rope_sin_cos
from models._model import _remat_policy


def linear(cfg: ModelConfig, in_features: int, out_features: int, optimizer: Any,
           rngs: nnx.Rngs, use_bias: bool = False) -> nnx.Module:
  """Every linear layer of the model: ``nnx.Linear``, or ``forge_jax.nnx.Linear`` for FORGE."""
  common = dict(use_bias=use_bias, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                precision=None, kernel_init=nnx.initializers.normal(stddev=cfg.init_std),
                bias_init=nnx.initializers.zeros_init(), rngs=rngs)
  if cfg.linear == "flax":
    return nnx.Linear(in_features, out_features, **common)
  if optimizer is None:
    raise ValueError("ModelConfig(linear='forge') needs a FORGE optimizer: "
                     "models.nnx.CausalLM(cfg, forge_jax.adamw(...), rngs=nnx.Rngs(0))")
  return forge_nnx.Linear(in_features, out_features, optimizer=optimizer,
                          backend=cfg.forge_backend, **common)


class RMSNorm(nnx.Module):
  """RMSNorm as in Llama/Qwen3: statistics in float32, then ``scale`` (init 1)."""

  def __init__(self, cfg: ModelConfig, features: int):
    self.scale = nnx.Param(jnp.ones((features,), jnp.dtype(cfg.param_dtype)))
    self.eps = cfg.rms_norm_eps
    self.dtype = cfg.dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y.astype(self.dtype) * self.scale.get_value().astype(self.dtype)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with RoPE (and Qwen3's q/k norm)."""

  def __init__(self, cfg: ModelConfig, optimizer: Any, *, rngs: nnx.Rngs):
    d, n, k, h, bias = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.attention_bias)
    self.cfg = cfg
    self.q_proj = linear(cfg, d, n * h, optimizer, rngs, bias)
    self.k_proj = linear(cfg, d, k * h, optimizer, rngs, bias)
    self.v_proj = linear(cfg, d, k * h, optimizer, rngs, bias)
    self.o_proj = linear(cfg, n * h, d, optimizer, rngs, bias)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg, h)
      self.k_norm = RMSNorm(cfg, h)

  def __call__(self, x_BxLxD: jax.Array, rope) -> jax.Array:
    cfg = self.cfg
    b, l, _ = x_BxLxD.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_BxLxNxH = self.q_proj(x_BxLxD).reshape(b, l, n, h)
    k_BxLxKxH = self.k_proj(x_BxLxD).reshape(b, l, k, h)
    v_BxLxKxH = self.v_proj(x_BxLxD).reshape(b, l, k, h)
    if cfg.qk_norm:
      q_BxLxNxH = self.q_norm(q_BxLxNxH)
      k_BxLxKxH = self.k_norm(k_BxLxKxH)
    q_BxLxNxH = apply_rope(q_BxLxNxH, rope)
    k_BxLxKxH = apply_rope(k_BxLxKxH, rope)
    out_BxLxNxH = jax.nn.dot_product_attention(
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True,
        implementation=attention_implementation(cfg))
    out_BxLxNxH = checkpoint_name(out_BxLxNxH, "attention_out")
    return self.o_proj(out_BxLxNxH.reshape(b, l, n * h))


class Mlp(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, cfg: ModelConfig, optimizer: Any, *, rngs: nnx.Rngs):
    self.gate_proj = linear(cfg, cfg.hidden_size, cfg.intermediate_size, optimizer, rngs)
    self.up_proj = linear(cfg, cfg.hidden_size, cfg.intermediate_size, optimizer, rngs)
    self.down_proj = linear(cfg, cfg.intermediate_size, cfg.hidden_size, optimizer, rngs)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    hidden_BxLxF = checkpoint_name(jax.nn.silu(self.gate_proj(x_BxLxD)) * self.up_proj(x_BxLxD),
                                   "mlp_hidden")
    return self.down_proj(hidden_BxLxF)


class DecoderBlock(nnx.Module):
  """One pre-norm block: ``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``."""

  def __init__(self, cfg: ModelConfig, optimizer: Any = None, *, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg, cfg.hidden_size)
    self.self_attn = Attention(cfg, optimizer, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg, cfg.hidden_size)
    self.mlp = Mlp(cfg, optimizer, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array, rope) -> jax.Array:
    h_BxLxD = x_BxLxD + self.self_attn(self.input_layernorm(x_BxLxD), rope)
    return h_BxLxD + self.mlp(self.post_attention_layernorm(h_BxLxD))


def _remat_block(cfg: ModelConfig, block: DecoderBlock, x_BxLxD, rope):
  """``block(x, rope)`` under ``jax.checkpoint`` with ``cfg.remat``'s policy (as ``nn.remat``)."""
  if cfg.remat == "none":
    return block(x_BxLxD, rope)
  graphdef, state = nnx.split(block)
  fn = jax.checkpoint(lambda s, x, r: nnx.merge(graphdef, s)(x, r), policy=_remat_policy(cfg),
                      prevent_cse=True)
  return fn(state, x_BxLxD, rope)


class Decoder(nnx.Module):
  """The L blocks: ``layers`` (a ScannedStack, stacked ``layers/block/...``) or ``layers_{i}``."""

  def __init__(self, cfg: ModelConfig, optimizer: Any = None, *, rngs: nnx.Rngs):
    self.cfg = cfg
    if cfg.scan_layers:
      self.layers = forge_nnx.ScannedStack(
          lambda r: DecoderBlock(cfg, optimizer, rngs=r), cfg.num_layers, rngs=rngs,
          remat=cfg.remat != "none", remat_policy=_remat_policy(cfg))
    else:
      for i in range(cfg.num_layers):
        setattr(self, f"layers_{i}", DecoderBlock(cfg, optimizer, rngs=rngs))

  def __call__(self, x_BxLxD: jax.Array, rope) -> jax.Array:
    if self.cfg.scan_layers:
      return self.layers(x_BxLxD, rope)
    for i in range(self.cfg.num_layers):
      x_BxLxD = _remat_block(self.cfg, getattr(self, f"layers_{i}"), x_BxLxD, rope)
    return x_BxLxD


class CausalLM(nnx.Module):
  """A Llama-3.x / Qwen3 causal language model in NNX (``tokens_BxL -> logits_BxLxV``).

  Args:
    cfg: the :class:`models.ModelConfig`.
    optimizer: the FORGE optimizer of every FORGE linear layer; required when
      ``cfg.linear == "forge"``.
    rngs: the initializers' :class:`flax.nnx.Rngs`.
  """

  def __init__(self, cfg: ModelConfig, optimizer: Any = None, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        embedding_init=nnx.initializers.normal(stddev=cfg.init_std), rngs=rngs)
    self.decoder = Decoder(cfg, optimizer, rngs=rngs)
    self.norm = RMSNorm(cfg, cfg.hidden_size)
    if not cfg.tie_word_embeddings:
      self.lm_head = linear(cfg, cfg.hidden_size, cfg.vocab_size, optimizer, rngs)

  def __call__(self, tokens_BxL: jax.Array, positions_BxL: Optional[jax.Array] = None) -> jax.Array:
    """Logits ``[B, L, V]`` in ``cfg.dtype``, as :class:`models.CausalLM`."""
    cfg = self.cfg
    if jnp.ndim(tokens_BxL) != 2:
      raise ValueError(f"tokens_BxL has shape {jnp.shape(tokens_BxL)}: pass [batch, length] ids")
    if positions_BxL is not None and jnp.shape(positions_BxL) != jnp.shape(tokens_BxL):
      raise ValueError(f"positions_BxL has shape {jnp.shape(positions_BxL)}, tokens_BxL "
                       f"{jnp.shape(tokens_BxL)}: pass one position per token ([batch, length])")
    x_BxLxD = self.embed_tokens(tokens_BxL)
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
    rope = rope_sin_cos(positions_BxL, rope_inv_frequencies(cfg))
    x_BxLxD = self.norm(self.decoder(x_BxLxD, rope))
    if cfg.tie_word_embeddings:
      return self.embed_tokens.attend(x_BxLxD)
    return self.lm_head(x_BxLxD)


def params_of(model: nnx.Module) -> dict:
  """The model's ``nnx.Param`` values as the Linen ``params`` collection (nested dicts)."""
  flat = {tuple(str(k) for k in path): var.get_value()
          for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  return traverse_util.unflatten_dict(flat)


def load_params(model: nnx.Module, params: Any) -> None:
  """Sets every ``nnx.Param`` of ``model`` from a Linen-layout ``params`` tree (same shapes).

  Raises:
    ValueError: naming the parameters missing from ``params``, left over in it, or of
      another shape.
  """
  given = traverse_util.flatten_dict(dict(params) if not isinstance(params, dict) else params)
  state = nnx.state(model, nnx.Param)
  flat = list(nnx.to_flat_state(state))
  keys = {tuple(str(k) for k in path) for path, _ in flat}
  missing = sorted("/".join(k) for k in keys - set(given))
  extra = sorted("/".join(k) for k in set(given) - keys)
  if missing or extra:
    raise ValueError(f"params do not match the model: missing {missing}, unexpected {extra}")
  for path, var in flat:
    key = tuple(str(k) for k in path)
    old = var.get_value()
    if tuple(jnp.shape(given[key])) != tuple(old.shape):
      raise ValueError(f"{'/'.join(key)} has shape {tuple(jnp.shape(given[key]))}, the model's "
                       f"is {tuple(old.shape)}")
    # A copy: the model's buffers are donated to its train step, and must not be the caller's.
    var.set_value(jnp.array(given[key], old.dtype, copy=True))
  nnx.update(model, state)


def load_checkpoint(path: str | pathlib.Path, optimizer: Any = None, *, rngs: nnx.Rngs,
                    **overrides) -> tuple[ModelConfig, CausalLM]:
  """Reads a HF checkpoint directory into a new NNX :class:`CausalLM` (``(cfg, model)``).

  ``overrides`` are :class:`ModelConfig` fields, as :func:`models.load_checkpoint`'s.
  """
  cfg, params = hf_io.load_checkpoint(path, **overrides)
  model = CausalLM(cfg, optimizer, rngs=rngs)
  load_params(model, params)
  return cfg, model


def save_checkpoint(path: str | pathlib.Path, model: CausalLM, **kwargs) -> None:
  """Writes the model in the HF layout (``kwargs``: :func:`models.save_checkpoint`'s)."""
  hf_io.save_checkpoint(path, model.cfg, params_of(model), **kwargs)
