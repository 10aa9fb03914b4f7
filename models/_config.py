"""Model hyperparameters: one frozen dataclass, one named preset per size.

The architecture fields mirror the Hugging Face ``config.json`` of the Llama-3.x
and Qwen3 families (see :mod:`models.hf_io` for the exact mapping); the
implementation switches (``linear``, ``scan_layers``, ``remat``, dtypes,
``attention``) choose how the same network is built and trained.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

FAMILIES = ("llama", "qwen3")
LINEAR_IMPLS = ("flax", "forge")
# forge_jax._fused.BACKENDS, repeated so that plain-Flax configs need not import forge_jax
# (tests/test_models.py checks they agree).
FORGE_BACKENDS = ("auto", "xla", "pallas", "interpret", "mosaic", "mosaic_interpret")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# jax.checkpoint_policies members that are policies themselves (the others,
# e.g. save_only_these_names, are factories that need arguments).
REMAT_POLICIES = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)
# Factories of jax.checkpoint_policies that take tensor names: the names come from
# ModelConfig.remat_names, chosen among the activations the blocks name (models._layers).
REMAT_NAMED_POLICIES = ("save_only_these_names", "save_anything_except_these_names")
CHECKPOINT_NAMES = ("attention_out", "mlp_hidden")
# forge_jax's own policies (forge_jax.save_all_but_elementwise: what a scanned stack without remat
# saves, here for unrolled blocks too).
FORGE_REMAT_POLICIES = ("save_all_but_elementwise",)
REMAT_CHOICES = ("none", "full") + REMAT_POLICIES + FORGE_REMAT_POLICIES + REMAT_NAMED_POLICIES
# Module names of the linear layers inside one decoder block (HF's names).
BLOCK_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1's ``"llama3"`` rotary frequency scaling (HF ``rope_scaling``).

  Frequencies whose wavelengths are longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by
  ``factor`` (their wavelengths stretched by it); those with wavelengths
  shorter than ``... / high_freq_factor`` are kept; the band between is
  interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of the Llama-3.x / Qwen3 families.

  Attributes:
    family: ``"llama"`` or ``"qwen3"``. Qwen3 adds a per-head RMSNorm on q and k
      (``q_norm``/``k_norm``, before RoPE); otherwise the families share the
      block: pre-norm RMSNorm, GQA with RoPE, SwiGLU MLP.
    vocab_size: V.
    hidden_size: D, the width of the residual stream.
    intermediate_size: F, the SwiGLU hidden width.
    num_layers: L, the number of decoder blocks.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (N must be a multiple of K).
    head_dim: H; Qwen3 allows N * H != D.
    rope_theta: RoPE base wavelength.
    rms_norm_eps: epsilon inside every RMSNorm.
    tie_word_embeddings: the LM head is ``embed_tokens.attend`` (no own weight).
    rope_scaling: Llama-3.1's frequency scaling, or ``None`` for plain RoPE.
    max_position_embeddings: recorded for config.json; RoPE needs no table.
    attention_bias: biases on q/k/v/o projections (False for both families).
    init_std: stddev of the normal init of kernels and embeddings (HF's
      ``initializer_range``).
    linear: ``"flax"`` (``nn.Dense``, trained by optax) or ``"forge"``
      (``forge_jax.Dense``: the optimizer runs inside the backward GEMM).
    forge_backend: the ``backend`` of every FORGE layer (see
      ``forge_jax.fused_linear_update``): ``"auto"`` (the Mosaic kernel on
      Hopper, the Triton one on other GPUs, ``"xla"`` for int8 states and off
      GPUs), ``"pallas"`` (the fused Triton-lowered kernel), ``"mosaic"`` (the
      warp-specialized Hopper kernel), ``"xla"`` (one dot, then the update
      fused by XLA: the layer's dW lives in HBM for one layer at a time), or an
      interpreter. Ignored when ``linear="flax"``.
    scan_layers: ``nn.scan`` over one block (params stacked ``[L, ...]`` under
      ``layers``) or a Python loop (``layers_0`` ... ``layers_{L-1}``).
    remat: activation checkpointing of each block: ``"none"`` (save every activation the
      backward needs; scanned, elementwise ones are recomputed:
      ``forge_jax.save_all_but_elementwise``), ``"full"``
      (save nothing, recompute all), a ``jax.checkpoint_policies`` name, or
      ``"save_all_but_elementwise"`` (``forge_jax.save_all_but_elementwise``: every
      activation but elementwise and layout ones, which the backward recomputes; what a
      scanned ``"none"`` saves, here for unrolled blocks too);
      ``"save_only_these_names"`` and ``"save_anything_except_these_names"``
      take their names from ``remat_names``.
    remat_names: the named activations (``"attention_out"``, ``"mlp_hidden"``)
      of the name-based policies; empty otherwise.
    param_dtype: storage dtype of every parameter.
    dtype: compute dtype (activations, matmul inputs, logits).
    attention: ``"auto"`` (cuDNN flash attention on GPU for 16-bit compute,
      XLA otherwise), ``"xla"`` or ``"cudnn"``. ``jax.nn.dot_product_attention``
      with ``implementation=None`` always runs XLA's version (jax 0.10 and
      later), hence the explicit choice here.
  """

  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  rms_norm_eps: float
  tie_word_embeddings: bool
  rope_scaling: Optional[RopeScaling] = None
  max_position_embeddings: int = 8192
  attention_bias: bool = False
  init_std: float = 0.02
  # Implementation switches: not part of the checkpoint.
  linear: str = "flax"
  forge_backend: str = "auto"
  scan_layers: bool = True
  remat: str = "none"
  remat_names: tuple[str, ...] = ()
  param_dtype: str = "float32"
  dtype: str = "float32"
  attention: str = "auto"

  def __post_init__(self):
    _check_choice("family", self.family, FAMILIES)
    _check_choice("linear", self.linear, LINEAR_IMPLS)
    _check_choice("forge_backend", self.forge_backend, FORGE_BACKENDS)
    _check_choice("remat", self.remat, REMAT_CHOICES)
    _check_choice("attention", self.attention, ATTENTION_IMPLS)
    for field in ("param_dtype", "dtype"):
      value = getattr(self, field)
      try:
        ok = isinstance(value, str) and jnp.issubdtype(jnp.dtype(value), jnp.floating)
      except TypeError:  # not a dtype name at all, e.g. 'bf16'
        ok = False
      if not ok:
        raise ValueError(
            f"{field}={value!r} must be the name of a float dtype, e.g. 'float32' or 'bfloat16'")
      if jnp.dtype(value).itemsize > 4 and not jax.config.jax_enable_x64:
        raise ValueError(f"{field}={value!r} needs jax_enable_x64 (without it jax computes and "
                         "stores float32): use 'float32' or enable x64")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field}={getattr(self, field)} must be at least 1")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None or a models.RopeScaling "
                       "(e.g. RopeScaling(factor=8.0)); a HF rope_scaling dict is read by "
                       "models.config_from_hf")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
          "(grouped-query attention shares each kv head among num_heads // num_kv_heads "
          "query heads)"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of channels")
    if self.remat in REMAT_POLICIES and not hasattr(jax.checkpoint_policies, self.remat):
      raise ValueError(f"remat={self.remat!r} is not in this jax's jax.checkpoint_policies")
    names = self.remat_names
    if isinstance(names, list):  # as read back from JSON
      names = tuple(names)
      object.__setattr__(self, "remat_names", names)
    if self.remat in REMAT_NAMED_POLICIES:
      if (not names or not isinstance(names, tuple)
          or not set(names) <= set(CHECKPOINT_NAMES)):
        raise ValueError(
            f"remat={self.remat!r} needs remat_names, a non-empty tuple of "
            f"{', '.join(map(repr, CHECKPOINT_NAMES))}; got remat_names={names!r}")
    elif names:
      raise ValueError(
          f"remat_names={names!r} is only read by remat='save_only_these_names' or "
          f"'save_anything_except_these_names', not remat={self.remat!r}: drop it")

  @property
  def qk_norm(self) -> bool:
    """Qwen3's per-head RMSNorm on queries and keys."""
    return self.family == "qwen3"

  @property
  def forge_layer_names(self) -> tuple[str, ...]:
    """Module names of the linear layers FORGE updates inside the backward.

    Empty when ``linear == "flax"``. Otherwise the seven projections of every
    block, plus ``lm_head`` when the embeddings are untied: a tied head is
    ``embed_tokens.attend``, whose weight has two gradient consumers (lookup
    and head), which FORGE cannot fuse, so it stays with optax together with
    the embeddings and all norm scales. See :func:`models.param_labels`.
    """
    if self.linear != "forge":
      return ()
    head = () if self.tie_word_embeddings else ("lm_head",)
    return BLOCK_LINEAR_NAMES + head

  @property
  def num_params(self) -> int:
    """Parameter count, from the shapes alone (tied weights counted once)."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    q, kv = self.num_heads * h, self.num_kv_heads * h
    attn = d * q + 2 * d * kv + q * d
    if self.attention_bias:
      attn += q + 2 * kv + d
    norms = 2 * d + (2 * h if self.qk_norm else 0)
    block = attn + 3 * d * f + norms
    embed = self.vocab_size * d
    head = 0 if self.tie_word_embeddings else self.vocab_size * d
    return embed + self.num_layers * block + d + head


def _check_choice(field: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, choices))}")


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> ModelConfig:
  # Shared by every Qwen3 dense size (Hugging Face config.json, Qwen/Qwen3-*).
  return ModelConfig(
      family="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
      num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
      rms_norm_eps=1e-6, tie_word_embeddings=tied, max_position_embeddings=40960,
  )


PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
    "llama-3.1-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
    ),
    # Tiny test models. tiny-qwen3 has N * H != D (as Qwen3 allows); tiny-llama
    # has an original context of 64 so that all three bands of the llama3 rope
    # scaling (kept, interpolated, divided) occur at head_dim 16.
    "tiny-qwen3": ModelConfig(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=512,
    ),
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=256,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
  """The preset called ``name``, with any field replaced by ``overrides``.

  Example: ``get_config("qwen3-8b", linear="forge", remat="full", dtype="bfloat16")``.
  """
  if name not in PRESETS:
    raise ValueError(f"Unknown model config {name!r}; the presets are: {', '.join(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)
