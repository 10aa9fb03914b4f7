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
positions at a time (a ``fori_loop`` of dynamic-update-slices on the logits'
buffer), so the two never need memory at once. Written in one pass, the H200
compile kept both live: at 64 x 1024 tokens of Llama-3.1-8B that is 2 x 15.66
GiB, and it set FORGE's peak (92.72 GiB; 78.56 GiB with blocks of consecutive
rows, measured preallocated; experiments/results/h200/live_hlo and
dlogits_in_place/). A block is now every nb-th position instead, so that
logits split over devices (by batch, sequence or vocabulary) are not gathered;
the same loop-carried update, not yet re-measured on the GPU.

FORGE cannot use a loss chunked over tokens instead: each chunk would call
the LM head's fused backward, i.e. apply one optimizer step per chunk.
"""

from __future__ import annotations

import math

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


_BLOCK_BYTES = 256 << 20  # float32 bytes of one block of the backward (the gradient before its cast)
_MIN_BLOCK_ROWS = 64  # thinner blocks do not pay for the loop: one pass instead


def _block_positions(shape, target_bytes: int | None = None) -> int:
  """Positions per block for logits of ``shape = (*lead, P, V)``: the largest divisor ``c`` of
  ``P`` whose ``prod(lead) * c * V`` float32 values fit ``target_bytes`` (default
  ``_BLOCK_BYTES``), at least 1."""
  target_bytes = _BLOCK_BYTES if target_bytes is None else target_bytes
  *lead, positions, vocab = shape
  row_bytes = 4 * vocab * math.prod(lead)
  for c in range(max(1, min(positions, target_bytes // row_bytes)), 0, -1):
    if positions % c == 0:
      return c
  return 1


def _mean_nll_bwd(res, g):
  logits, labels, lse = res
  scale = g / labels.size
  if logits.ndim < 2:
    return _grad_rows(logits, labels, lse, scale), None
  # Written over the logits, block by block: a loop that carries the logits' buffer and
  # updates one slice of it in place (a dynamic-update-slice of the slice it read), so the
  # gradient takes the logits' memory whatever XLA's fusions do. In one pass the H200 compile
  # kept both live at the step's peak (experiments/results/h200/live_hlo).
  # A block is every nb-th position (positions p with p % nb == j): the position axis is split
  # as (c, nb) and the loop runs over the minor part, so its dynamic slices never cut a
  # sharded axis. A batch (data parallelism), a vocabulary (a vocab-parallel head) or, when c
  # is a multiple of the device count, a sequence split over devices stays split, with no
  # gather (tests/test_models.py::test_cross_entropy_backward_in_blocks_keeps_shardings).
  *lead, positions, vocab = logits.shape
  c = _block_positions(logits.shape)
  nb = positions // c
  if nb == 1 or math.prod(lead) * c < _MIN_BLOCK_ROWS:  # fits one block, or blocks too thin
    return _grad_rows(logits, labels, lse, scale), None  # (a prime P): one pass
  axis = len(lead) + 1
  split = lambda a, tail=(): a.reshape(*lead, c, nb, *tail)
  buf, blocked_labels, blocked_lse = split(logits, (vocab,)), split(labels), split(lse)

  def body(j, buf):
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, j, 1, axis)
    grad = _grad_rows(take(buf), take(blocked_labels), take(blocked_lse), scale)
    return jax.lax.dynamic_update_slice_in_dim(buf, grad, j, axis)

  return jax.lax.fori_loop(0, nb, body, buf).reshape(logits.shape), None


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
