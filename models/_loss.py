"""Next-token cross-entropy that keeps no float32 copy of the logits.

``optax.softmax_cross_entropy_with_integer_labels(logits.astype(f32), labels)``
is the usual spelling. Its float32 logits feed several reductions and the
backward, so XLA materializes them: at 32 x 1024 tokens and a 128k
vocabulary that is 16 GiB next to the 8 GiB of bf16 logits (the H200 memory
analysis of Llama-3.1-8B, experiments/results/h200/memory_analysis_b32/,
holds ``f32[32,1024,128256]`` buffers in both the optax and the FORGE step).

:func:`cross_entropy` computes the same loss in float32 from the logits in
their own dtype, through a ``custom_vjp`` that saves only the logits (which
the LM head's backward needs anyway) and the per-token log-sum-exp, and whose
backward writes ``softmax - onehot`` straight in the logits' dtype. Value and
gradient equal optax's up to float32 rounding (tested).

At a large batch the backward writes that gradient over the logits, a block of
rows at a time (a ``fori_loop`` of dynamic-update-slices on the logits'
buffer), so the two never need memory at once. Written in one pass, the H200
compile kept both live: at 64 x 1024 tokens of Llama-3.1-8B that is 2 x 15.66
GiB, and it set FORGE's peak (92.72 GiB; 78.56 GiB with the loop, measured
preallocated; experiments/results/h200/live_hlo and dlogits_in_place/).

FORGE cannot use a loss chunked over tokens instead: each chunk would call
the LM head's fused backward, i.e. apply one optimizer step per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _log_sum_exp(logits: jax.Array) -> jax.Array:
  """float32 ``logsumexp`` over the last axis, from logits in any float dtype."""
  x = logits.astype(_F32)
  peak = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
  return peak[..., 0] + jnp.log(jnp.sum(jnp.exp(x - peak), axis=-1))


def _valid(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return (labels >= 0) & (labels < logits.shape[-1])


def _picked(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """``logits[label]`` in float32; NaN for an id outside ``[0, V)`` (negative ones included:
  no wrap-around, and the backward below agrees)."""
  valid = _valid(logits, labels)
  safe = jnp.where(valid, labels, 0)
  picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0].astype(_F32)
  return jnp.where(valid, picked, jnp.nan)


@jax.custom_vjp
def _mean_nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return jnp.mean(_log_sum_exp(logits) - _picked(logits, labels))


def _mean_nll_fwd(logits, labels):
  lse = _log_sum_exp(logits)
  return jnp.mean(lse - _picked(logits, labels)), (logits, labels, lse)


def _grad_rows(logits, labels, lse, scale):
  """``(softmax - onehot) * scale`` in the logits' dtype, NaN rows for invalid ids."""
  prob = jnp.exp(logits.astype(_F32) - lse[..., None])
  vocab = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
  grad = jnp.where(vocab == labels[..., None], prob - 1.0, prob) * scale
  grad = jnp.where(_valid(logits, labels)[..., None], grad, jnp.nan)  # as the value: NaN
  return grad.astype(logits.dtype)


_BLOCK_BYTES = 256 << 20  # float32 bytes of one block of the backward's rows
_MIN_BLOCK_ROWS = 64  # thinner blocks do not pay for the loop: one pass instead


def _chunk_rows(n: int, vocab: int, target_bytes: int | None = None) -> int:
  """The largest divisor of ``n`` whose rows of ``vocab`` float32 values fit ``target_bytes``
  (default ``_BLOCK_BYTES``)."""
  target_bytes = _BLOCK_BYTES if target_bytes is None else target_bytes
  for rows in range(max(1, min(n, target_bytes // (4 * vocab))), 0, -1):
    if n % rows == 0:
      return rows
  return 1


def _mean_nll_bwd(res, g):
  logits, labels, lse = res
  scale = g / labels.size
  # Written over the logits, block of rows by block of rows: a loop that carries the logits'
  # buffer and updates one slice of it in place (a dynamic-update-slice of a slice it read), so
  # the gradient takes the logits' memory whatever XLA's fusions do (on the H200 the one-pass
  # spelling kept both live at the step's peak: experiments/results/h200/live_hlo).
  vocab = logits.shape[-1]
  n = labels.size
  rows = _chunk_rows(n, vocab)
  if rows == n or rows < _MIN_BLOCK_ROWS:  # one block, or blocks too thin (a token count with
    return _grad_rows(logits, labels, lse, scale), None  # no divisor near the block): one pass
  flat, flat_labels, flat_lse = logits.reshape(-1, vocab), labels.reshape(-1), lse.reshape(-1)

  def body(i, buf):
    start = i * rows
    block = jax.lax.dynamic_slice_in_dim(buf, start, rows, 0)
    grad = _grad_rows(block, jax.lax.dynamic_slice_in_dim(flat_labels, start, rows, 0),
                      jax.lax.dynamic_slice_in_dim(flat_lse, start, rows, 0), scale)
    return jax.lax.dynamic_update_slice_in_dim(buf, grad, start, 0)

  return jax.lax.fori_loop(0, n // rows, body, flat).reshape(logits.shape), None


_mean_nll.defvjp(_mean_nll_fwd, _mean_nll_bwd)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token negative log-likelihood, computed in float32.

  Args:
    logits: ``[..., V]`` in any float dtype (bf16 from a bf16 model); not
      upcast as a whole.
    labels: integer class ids of shape ``logits.shape[:-1]``, in ``[0, V)``.
      Outside ``jit`` an id outside it (a negative ignore id such as -100
      included) raises; inside ``jit`` it makes the loss and its gradient
      NaN (no masking: pass only real next-token ids).

  Returns:
    A float32 scalar: ``mean(logsumexp(logits) - logits[label])``, as
    ``optax.softmax_cross_entropy_with_integer_labels(logits.astype(f32),
    labels).mean()``; its gradient comes back in the logits' dtype.
  """
  logits = jnp.asarray(logits)
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"cross_entropy: logits must be a float array, got {logits.dtype}")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"cross_entropy: labels must be integer class ids, got {labels.dtype}")
  if tuple(labels.shape) != tuple(logits.shape[:-1]):
    raise ValueError(
        f"cross_entropy: labels of shape {tuple(labels.shape)} do not match logits "
        f"{tuple(logits.shape)} (expected {tuple(logits.shape[:-1])}, one id per position)"
    )
  try:  # concrete labels (outside jit): check the ids
    low, high = (int(jnp.min(labels)), int(jnp.max(labels))) if labels.size else (0, 0)
  except (TypeError, jax.errors.ConcretizationTypeError):
    low, high = 0, 0
  if low < 0 or high >= logits.shape[-1]:
    raise ValueError(f"cross_entropy: label ids range over [{low}, {high}], outside the vocabulary "
                     f"[0, {logits.shape[-1]}): pass next-token ids (no ignore ids such as -100)")
  return _mean_nll(logits, labels.astype(jnp.int32))
