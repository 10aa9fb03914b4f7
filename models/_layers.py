"""The parts of a decoder block: linear factory, RMSNorm, RoPE, attention, MLP.

Shapes in names: B batch, L sequence, D hidden, F intermediate, N query heads,
K key/value heads, H head_dim, V vocab. Activations a remat policy may pick by
name (``jax.ad_checkpoint.checkpoint_name``): ``attention_out`` (the attention
output, before ``o_proj``) and ``mlp_hidden`` (``silu(gate) * up``, before
``down_proj``).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from models._config import ModelConfig

RopeBxLxH2 = tuple[jax.Array, jax.Array]  # (sin, cos), float32, [B, L, H/2]

# Megatron's layout of every linear layer under tensor parallelism: q/k/v and gate/up split on
# their outputs (heads, F), o/down on their inputs, so that attention and the SwiGLU run on each
# device's heads and F slice without communication; the untied LM head is vocabulary-parallel.
TENSOR_PARALLEL_LAYOUT = {
    "q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
    "gate_proj": "column", "up_proj": "column", "down_proj": "row", "lm_head": "column",
    # The [V, D] embedding split over the vocabulary (a row split of the table): its optax
    # states and gradient stay on the device that owns the rows, and a tied head computes its
    # V/P logits from the local rows.
    "embed_tokens": "row",
}


def _constrain(tp: Any, x: jax.Array, spec_name: str) -> jax.Array:
  """``x`` laid out as ``tp``'s ``spec_name`` spec (``heads``, ``features``, ``between``); as
  is without tensor parallelism."""
  if tp is None:
    return x
  return tp.constrain(x, getattr(tp, f"{spec_name}_spec")(x.ndim))


def dense(cfg: ModelConfig, features: int, name: str, optimizer: Any = None,
          use_bias: bool = False, tensor_parallel: Any = None) -> nn.Module:
  """Builds every linear layer of the model: the one seam for FORGE.

  ``cfg.linear == "flax"`` gives ``nn.Dense`` (its gradient goes to optax);
  ``"forge"`` gives ``forge_jax.Dense``, which has the same ``params``
  (``kernel`` [in, out], ``bias``) and applies ``optimizer`` to the kernel tile
  by tile inside its backward GEMM, keeping the optimizer state in a variable
  collection of its own. With ``tensor_parallel`` (a ``forge_jax.TensorParallel``) a
  FORGE layer is split over its mesh axis as :data:`TENSOR_PARALLEL_LAYOUT` says for ``name``.
  """
  kernel_init = nn.initializers.normal(stddev=cfg.init_std)
  common = dict(use_bias=use_bias, dtype=jnp.dtype(cfg.dtype),
                param_dtype=jnp.dtype(cfg.param_dtype), precision=None, kernel_init=kernel_init,
                bias_init=nn.initializers.zeros, name=name)
  if cfg.linear == "flax":
    return nn.Dense(features, **common)
  # Imported only when asked for: plain-Flax models need none of forge_jax's kernels.
  import forge_jax

  if optimizer is None:
    raise ValueError(
        "ModelConfig(linear='forge') needs a FORGE optimizer: "
        "CausalLM(cfg, optimizer=forge_jax.adamw(...))"
    )
  layout = {}
  if tensor_parallel is not None:
    layout = dict(parallel=TENSOR_PARALLEL_LAYOUT[name], tensor_parallel=tensor_parallel)
  return forge_jax.Dense(features, optimizer=optimizer, backend=cfg.forge_backend, **common,
                         **layout)


class RMSNorm(nn.Module):
  """RMSNorm as in Llama/Qwen3: statistics in float32, then ``scale`` (init 1).

  Attributes:
    eps: added to the mean square.
    dtype: compute/output dtype.
    param_dtype: storage dtype of ``scale``.
  """

  eps: float
  dtype: str = "float32"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.param_dtype))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y.astype(self.dtype) * scale.astype(self.dtype)


def _norm(cfg: ModelConfig, name: str) -> RMSNorm:
  return RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype, name=name)


def rope_inv_frequencies(cfg: ModelConfig) -> np.ndarray:
  """The H/2 rotary inverse frequencies, with Llama-3.1 scaling if configured.

  Computed in float64 on the host (static for a config), returned as float32.
  """
  h = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  s = cfg.rope_scaling
  if s is not None:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept; in between,
    # interpolate by where the wavelength sits relative to the original context.
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(medium, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
  return inv_freq.astype(np.float32)


def rope_sin_cos(positions_BxL: jax.Array, inv_freq_H2: np.ndarray) -> RopeBxLxH2:
  """Angles ``position * inv_freq`` in float32, as (sin, cos) [B, L, H/2]."""
  angles_BxLxH2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_H2)
  return jnp.sin(angles_BxLxH2), jnp.cos(angles_BxLxH2)


def apply_rope(x_BxLxNxH: jax.Array, rope: RopeBxLxH2) -> jax.Array:
  """Rotates channel pairs (i, i + H/2), HF's "rotate_half" layout, in float32."""
  sin_BxLx1xH2, cos_BxLx1xH2 = (t[:, :, None, :] for t in rope)
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos_BxLx1xH2 - x2 * sin_BxLx1xH2,
                         x2 * cos_BxLx1xH2 + x1 * sin_BxLx1xH2], axis=-1)
  return out.astype(x_BxLxNxH.dtype)


def attention_implementation(cfg: ModelConfig) -> str:
  """The ``implementation`` passed to ``jax.nn.dot_product_attention``."""
  if cfg.attention != "auto":
    return cfg.attention
  # cuDNN's fused attention takes 16-bit inputs and head_dim <= 128 (multiple
  # of 8); anything else, or any other platform, runs XLA's version.
  eligible = (jax.default_backend() == "gpu" and jnp.dtype(cfg.dtype) in (jnp.bfloat16, jnp.float16)
              and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128)
  return "cudnn" if eligible else "xla"


class Attention(nn.Module):
  """Causal grouped-query self-attention with RoPE (and Qwen3's q/k norm)."""

  cfg: ModelConfig
  optimizer: Any = None
  tensor_parallel: Any = None

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, rope: RopeBxLxH2) -> jax.Array:
    cfg, opt, tp = self.cfg, self.optimizer, self.tensor_parallel
    b, l, _ = x_BxLxD.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.attention_bias
    heads = lambda t: _constrain(tp, t, "heads")
    q_BxLxNxH = heads(dense(cfg, n * h, "q_proj", opt, bias, tp)(x_BxLxD).reshape(b, l, n, h))
    k_BxLxKxH = heads(dense(cfg, k * h, "k_proj", opt, bias, tp)(x_BxLxD).reshape(b, l, k, h))
    v_BxLxKxH = heads(dense(cfg, k * h, "v_proj", opt, bias, tp)(x_BxLxD).reshape(b, l, k, h))
    if cfg.qk_norm:
      q_BxLxNxH = _norm(cfg, "q_norm")(q_BxLxNxH)
      k_BxLxKxH = _norm(cfg, "k_norm")(k_BxLxKxH)
    q_BxLxNxH = apply_rope(q_BxLxNxH, rope)
    k_BxLxKxH = apply_rope(k_BxLxKxH, rope)
    # GQA is native here: query head i reads kv head i // (N // K), as HF's repeat_kv.
    out_BxLxNxH = jax.nn.dot_product_attention(
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True,
        implementation=attention_implementation(cfg))
    out_BxLxNxH = checkpoint_name(heads(out_BxLxNxH), "attention_out")
    out_BxLxD = dense(cfg, cfg.hidden_size, "o_proj", opt, bias, tp)(out_BxLxNxH.reshape(b, l, n * h))
    return _constrain(tp, out_BxLxD, "between")


class Mlp(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  cfg: ModelConfig
  optimizer: Any = None
  tensor_parallel: Any = None

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg, opt, tp = self.cfg, self.optimizer, self.tensor_parallel
    gate_BxLxF = dense(cfg, cfg.intermediate_size, "gate_proj", opt, tensor_parallel=tp)(x_BxLxD)
    up_BxLxF = dense(cfg, cfg.intermediate_size, "up_proj", opt, tensor_parallel=tp)(x_BxLxD)
    hidden_BxLxF = _constrain(tp, jax.nn.silu(gate_BxLxF) * up_BxLxF, "features")
    hidden_BxLxF = checkpoint_name(hidden_BxLxF, "mlp_hidden")
    out_BxLxD = dense(cfg, cfg.hidden_size, "down_proj", opt, tensor_parallel=tp)(hidden_BxLxF)
    return _constrain(tp, out_BxLxD, "between")
