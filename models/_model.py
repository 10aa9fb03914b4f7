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

from models._config import FORGE_REMAT_POLICIES
from models._config import ModelConfig
from models._layers import TENSOR_PARALLEL_LAYOUT
from models._layers import Attention, Mlp, RopeBxLxH2, _constrain, _norm, dense
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
  tensor_parallel: Any = None

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, rope: RopeBxLxH2) -> jax.Array:
    cfg, opt, tp = self.cfg, self.optimizer, self.tensor_parallel
    attn = Attention(cfg, opt, tp, name="self_attn")
    attn_BxLxD = attn(_norm(cfg, "input_layernorm")(x_BxLxD), rope)
    h_BxLxD = x_BxLxD + attn_BxLxD
    mlp_BxLxD = Mlp(cfg, opt, tp, name="mlp")(_norm(cfg, "post_attention_layernorm")(h_BxLxD))
    return _constrain(tp, h_BxLxD + mlp_BxLxD, "between")


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
  """The policy ``cfg.remat`` names (``None`` for none and full): from ``jax.checkpoint_policies``,
  or forge_jax's ``save_all_but_elementwise``."""
  if cfg.remat in ("none", "full"):
    return None
  if cfg.remat in FORGE_REMAT_POLICIES:
    import forge_jax  # pylint: disable=g-import-not-at-top
    return getattr(forge_jax, cfg.remat)
  policy = getattr(jax.checkpoint_policies, cfg.remat)
  return policy(*cfg.remat_names) if cfg.remat_names else policy


def _maybe_remat(cls: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
  """``cls`` wrapped in ``nn.remat`` with the configured policy (or as is).

  A scanned block without remat saves every activation except elementwise ones
  (``forge_jax.save_all_but_elementwise``, as ``forge_jax.ScannedStack`` does): under a scan
  each saved value is a stacked buffer of its own, and XLA cannot fuse the cheap ops between
  activations away as it does in an unrolled step.
  """
  if cfg.remat == "none" and not cfg.scan_layers:
    return cls
  if cfg.remat == "none":
    import forge_jax  # pylint: disable=g-import-not-at-top
    return nn.remat(cls, policy=forge_jax.save_all_but_elementwise, prevent_cse=False)
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
  tensor_parallel: Any = None

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, rope: RopeBxLxH2) -> jax.Array:
    cfg = self.cfg
    block = functools.partial(DecoderBlock, cfg, self.optimizer, self.tensor_parallel)
    if cfg.scan_layers:
      body = _maybe_remat(_ScanBody, cfg)
      scanned = nn.scan(body, variable_axes={True: 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,), length=cfg.num_layers)
      x_BxLxD, _ = scanned(block, name="layers")(x_BxLxD, rope)
      return x_BxLxD
    block_cls = _maybe_remat(DecoderBlock, cfg)
    for i in range(cfg.num_layers):
      x_BxLxD = block_cls(cfg, self.optimizer, self.tensor_parallel, name=f"layers_{i}")(x_BxLxD, rope)
    return x_BxLxD


def _decoder(cfg: ModelConfig, optimizer: Any, tp: Any = None) -> nn.Module:
  """The layer stack, named ``decoder``: FORGE scanned stacks get their own VJP.

  With ``linear="forge"`` and ``scan_layers=True`` the stack is a
  ``forge_jax.ScannedStack``: one custom VJP around all layers whose backward
  updates the stacked kernels and optimizer states in place (a plain
  ``nn.scan`` would build a second stacked copy of them). Its parameters have
  the ``decoder/layers/block`` layout of the ``nn.scan`` branch and the same
  activation checkpointing (``cfg.remat``).
  """
  if not (cfg.scan_layers and cfg.linear == "forge"):
    return DecoderStack(cfg, optimizer, tp, name="decoder")
  import forge_jax  # pylint: disable=g-import-not-at-top  (forge is optional here)
  block = functools.partial(DecoderBlock, cfg, optimizer, tp)
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
    tensor_parallel: ``None``, or a ``forge_jax.TensorParallel``: the model is split
      Megatron-style over its mesh axis (:data:`TENSOR_PARALLEL_LAYOUT`: attention heads,
      the SwiGLU's F, a vocabulary-parallel untied LM head; embeddings and norms
      replicated), with sequence parallelism between the blocks if it says so. Place the
      train state with :func:`shard_train_state` (docs/parallel.md).
  """

  cfg: ModelConfig
  optimizer: Any = None
  tensor_parallel: Any = None

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
    cfg, tp = self.cfg, self.tensor_parallel
    if jnp.ndim(tokens_BxL) != 2:
      raise ValueError(f"tokens_BxL has shape {jnp.shape(tokens_BxL)}: pass [batch, length] ids")
    if tp is not None:
      check_tensor_parallel(cfg, tp, jnp.shape(tokens_BxL)[1])
    if positions_BxL is not None and jnp.shape(positions_BxL) != jnp.shape(tokens_BxL):
      raise ValueError(f"positions_BxL has shape {jnp.shape(positions_BxL)}, tokens_BxL "
                       f"{jnp.shape(tokens_BxL)}: pass one position per token ([batch, length])")
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
                     param_dtype=jnp.dtype(cfg.param_dtype),
                     embedding_init=nn.initializers.normal(stddev=cfg.init_std),
                     name="embed_tokens")
    x_BxLxD = embed(tokens_BxL)
    if tp is not None:
      # Each device looks up all tokens in its rows of the vocabulary-split table (the
      # partitioner sums the [B, L, D] partial results), so the table's gradient is complete on
      # the device that owns the rows: under sequence parallelism the backward all-gathers the
      # [B, L, D] cotangent instead of all-reducing a [V, D] embedding gradient.
      x_BxLxD = _constrain(tp, tp.constrain(x_BxLxD, jax.sharding.PartitionSpec()), "between")
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
    rope = rope_sin_cos(positions_BxL, rope_inv_frequencies(cfg))
    x_BxLxD = _decoder(cfg, self.optimizer, tp)(x_BxLxD, rope)
    x_BxLxD = _norm(cfg, "norm")(x_BxLxD)
    if cfg.tie_word_embeddings:
      if tp is None:
        return embed.attend(x_BxLxD)
      # Vocabulary-parallel, as the untied head: all tokens against the device's rows.
      logits_BxLxV = embed.attend(tp.constrain(x_BxLxD, jax.sharding.PartitionSpec()))
      return _constrain(tp, logits_BxLxV, "features")
    return dense(cfg, cfg.vocab_size, "lm_head", self.optimizer, tensor_parallel=tp)(x_BxLxD)


def check_tensor_parallel(cfg: ModelConfig, tp: Any, length: int | None = None) -> None:
  """Raises ValueError if ``cfg`` cannot be split Megatron-style over ``tp``'s axis."""
  p, axis = tp.size, tp.axis
  fix = f"choose a model with sizes divisible by {p} or a {axis!r} axis of a divisor of them"
  for what, size in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                     ("intermediate_size", cfg.intermediate_size)):
    if size % p:
      raise ValueError(
          f"{what}={size} is not divisible by the {axis!r} axis size {p}: tensor parallelism "
          f"gives each device whole heads and an equal slice of the MLP; {fix}.")
  if cfg.vocab_size % p:
    raise ValueError(
        f"vocab_size={cfg.vocab_size} is not divisible by the {axis!r} axis size {p}: the "
        f"embeddings and the LM head are split over the vocabulary; {fix} (or pad the "
        "vocabulary).")
  if tp.sequence_parallel and length is not None and length % p:
    raise ValueError(
        f"a sequence of {length} tokens is not divisible by the {axis!r} axis size {p}: "
        "sequence parallelism splits the tokens of each sequence evenly over the devices; "
        f"pad the sequences to a multiple of {p} or pass sequence_parallel=False.")


def shard_train_state(tp: Any, state: Any) -> Any:
  """A TrainState (or variables, or params) of a :class:`CausalLM` placed on ``tp``'s mesh:
  the linear layers' weights and their optimizer states (FORGE's and optax's) split as
  :data:`TENSOR_PARALLEL_LAYOUT` says, everything else replicated."""
  import forge_jax  # pylint: disable=g-import-not-at-top
  return jax.device_put(state, forge_jax.shard_tree(tp, state, TENSOR_PARALLEL_LAYOUT))


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
