"""The decoder block, the layer stack and the causal LM.

Parameter tree (names follow Hugging Face's, see :mod:`models.hf_io`)::

  embed_tokens/embedding                       [V, D]
  decoder/layers/block/...                     stacked [L, ...]  (scan_layers=True)
  decoder/layers_{i}/...                       one per block     (scan_layers=False)
      input_layernorm/scale, post_attention_layernorm/scale      [D]
      self_attn/{q,k,v,o}_proj/kernel                            [in, out]
      self_attn/{q,k}_norm/scale                                 [H] (Qwen3)
      mlp/{gate,up,down}_proj/kernel                             [in, out]
  norm/scale                                   [D]
  lm_head/kernel                               [D, V] (untied only)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models._config import ModelConfig
from models._layers import Attention, Mlp, RopeBxLxH2, _norm, dense
from models._layers import rope_inv_frequencies, rope_sin_cos


class DecoderBlock(nn.Module):
  """One pre-norm block: ``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``.

  Self-contained: ``DecoderBlock(cfg).apply({"params": one_layer}, x, rope)``
  runs one layer from its (unstacked) parameters, and
  ``functools.partial(DecoderBlock, cfg, optimizer)`` is the block factory a
  stack of identical blocks (``nn.scan``, ``forge_jax.ScannedStack``) needs.
  """

  cfg: ModelConfig
  optimizer: Any = None

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, rope: RopeBxLxH2) -> jax.Array:
    cfg, opt = self.cfg, self.optimizer
    attn_BxLxD = Attention(cfg, opt, name="self_attn")(_norm(cfg, "input_layernorm")(x_BxLxD), rope)
    h_BxLxD = x_BxLxD + attn_BxLxD
    mlp_BxLxD = Mlp(cfg, opt, name="mlp")(_norm(cfg, "post_attention_layernorm")(h_BxLxD))
    return h_BxLxD + mlp_BxLxD


class _ScanBody(nn.Module):
  """Adapts ``block(x, rope) -> x`` to the ``(carry, x) -> (carry, y)`` of nn.scan.

  The block is its child ``block``, so the scanned layout is
  ``layers/block/...``, the same as ``forge_jax.ScannedStack``'s.
  """

  block: Callable[..., nn.Module]

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, rope: RopeBxLxH2) -> tuple[jax.Array, None]:
    return self.block(name="block")(x_BxLxD, rope), None


def _remat_policy(cfg: ModelConfig) -> Any:
  """The ``jax.checkpoint_policies`` policy ``cfg.remat`` names (``None`` for none and full)."""
  if cfg.remat in ("none", "full"):
    return None
  policy = getattr(jax.checkpoint_policies, cfg.remat)
  return policy(*cfg.remat_names) if cfg.remat_names else policy


def _maybe_remat(cls: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
  """``cls`` wrapped in ``nn.remat`` with the configured policy (or as is)."""
  if cfg.remat == "none":
    return cls
  policy = _remat_policy(cfg)
  # Under scan, CSE across iterations cannot undo the remat, and the barrier
  # that prevents it costs speed (flax's advice for remat inside scan).
  return nn.remat(cls, policy=policy, prevent_cse=not cfg.scan_layers)


def layer_path(cfg: ModelConfig, i: int) -> tuple[str, ...]:
  """Where layer ``i``'s parameters live in ``params``.

  Scanned: ``decoder/layers/block`` (every leaf stacked, layer ``i`` at index
  ``i`` of the leading axis); unrolled: ``decoder/layers_{i}``.
  """
  return ("decoder", "layers", "block") if cfg.scan_layers else ("decoder", f"layers_{i}")


class DecoderStack(nn.Module):
  """The L decoder blocks: the only place that loops over layers.

  ``scan_layers=True`` scans one (possibly remat'ed) block over a leading
  layer axis of every variable collection (``variable_axes={True: 0}``, so a
  FORGE optimizer-state collection is stacked like ``params``), with
  per-layer ``params`` rngs, under ``layers/block``. ``scan_layers=False``
  unrolls a Python loop over ``layers_0`` ... ``layers_{L-1}``
  (:func:`layer_path`). A FORGE-specific stack (one custom VJP
  whose backward updates the stacked weights in place) replaces the scanned
  branch here and nothing else.
  """

  cfg: ModelConfig
  optimizer: Any = None

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, rope: RopeBxLxH2) -> jax.Array:
    cfg = self.cfg
    block = functools.partial(DecoderBlock, cfg, self.optimizer)
    if cfg.scan_layers:
      body = _maybe_remat(_ScanBody, cfg)
      scanned = nn.scan(body, variable_axes={True: 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,), length=cfg.num_layers)
      x_BxLxD, _ = scanned(block, name="layers")(x_BxLxD, rope)
      return x_BxLxD
    block_cls = _maybe_remat(DecoderBlock, cfg)
    for i in range(cfg.num_layers):
      x_BxLxD = block_cls(cfg, self.optimizer, name=f"layers_{i}")(x_BxLxD, rope)
    return x_BxLxD


def _decoder(cfg: ModelConfig, optimizer: Any) -> nn.Module:
  """The layer stack, named ``decoder``: FORGE scanned stacks get their own VJP.

  With ``linear="forge"`` and ``scan_layers=True`` the stack is a
  ``forge_jax.ScannedStack``: one custom VJP around all layers whose backward
  updates the stacked kernels and optimizer states in place (a plain
  ``nn.scan`` would build a second stacked copy of them). Its parameters have
  the ``decoder/layers/block`` layout of the ``nn.scan`` branch and the same
  activation checkpointing (``cfg.remat``).
  """
  if not (cfg.scan_layers and cfg.linear == "forge"):
    return DecoderStack(cfg, optimizer, name="decoder")
  import forge_jax  # pylint: disable=g-import-not-at-top  (forge is optional here)
  block = functools.partial(DecoderBlock, cfg, optimizer)
  return forge_jax.ScannedStack(block, cfg.num_layers, remat=cfg.remat != "none",
                                remat_policy=_remat_policy(cfg), name="decoder")


class CausalLM(nn.Module):
  """A Llama-3.x / Qwen3 causal language model.

  Attributes:
    cfg: the :class:`ModelConfig`.
    optimizer: the FORGE optimizer (``forge_jax.adamw(...)`` etc.) that every
      FORGE linear layer applies in its backward; required when
      ``cfg.linear == "forge"``, unused otherwise. Which parameters FORGE
      updates and which are left to optax: :func:`param_labels`.
  """

  cfg: ModelConfig
  optimizer: Any = None

  @property
  def forge_layer_names(self) -> tuple[str, ...]:
    """Names of the FORGE-managed linear modules (see ``ModelConfig.forge_layer_names``)."""
    return self.cfg.forge_layer_names

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None) -> jax.Array:
    """Logits ``[B, L, V]`` in ``cfg.dtype`` (upcast in the loss for 16-bit compute).

    Args:
      tokens_BxL: int token ids.
      positions_BxL: RoPE positions; ``0 .. L-1`` per row by default.
    """
    cfg = self.cfg
    if jnp.ndim(tokens_BxL) != 2:
      raise ValueError(f"tokens_BxL has shape {jnp.shape(tokens_BxL)}: pass [batch, length] ids")
    if positions_BxL is not None and jnp.shape(positions_BxL) != jnp.shape(tokens_BxL):
      raise ValueError(f"positions_BxL has shape {jnp.shape(positions_BxL)}, tokens_BxL "
                       f"{jnp.shape(tokens_BxL)}: pass one position per token ([batch, length])")
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
                     param_dtype=jnp.dtype(cfg.param_dtype),
                     embedding_init=nn.initializers.normal(stddev=cfg.init_std),
                     name="embed_tokens")
    x_BxLxD = embed(tokens_BxL)
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
    rope = rope_sin_cos(positions_BxL, rope_inv_frequencies(cfg))
    x_BxLxD = _decoder(cfg, self.optimizer)(x_BxLxD, rope)
    x_BxLxD = _norm(cfg, "norm")(x_BxLxD)
    if cfg.tie_word_embeddings:
      return embed.attend(x_BxLxD)
    return dense(cfg, cfg.vocab_size, "lm_head", self.optimizer)(x_BxLxD)


def param_labels(cfg: ModelConfig, params: Any) -> Any:
  """``"forge"`` or ``"optax"`` for every leaf of ``params`` (same tree).

  ``"forge"``: the kernel of every FORGE linear layer (the block projections,
  and ``lm_head`` when untied); FORGE updates them inside the backward, so the
  optax side must leave them alone (e.g. ``optax.multi_transform({"optax":
  adamw, "forge": optax.set_to_zero()}, labels)``). ``"optax"``: embeddings,
  every RMSNorm scale, biases (``forge_jax.Dense`` leaves them to the
  optimizer's optax form), a tied head (it is the embedding), and everything
  when ``cfg.linear == "flax"``. ``forge_jax.TrainState`` finds the same split
  from the ``forge_state`` collection; this function predicts it from the
  config alone.
  """
  forge_names = set(cfg.forge_layer_names)

  def label(path, _):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return "forge" if names[-1] == "kernel" and set(names) & forge_names else "optax"

  return jax.tree_util.tree_map_with_path(label, params)
