"""An array whose contents are whatever its memory held: for a buffer that is overwritten whole
before it is read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def _leave(tag_ref, out_ref) -> None:
  del tag_ref, out_ref  # nothing: the output keeps what its memory held


@functools.lru_cache(maxsize=None)
def _empty_kernel(shape: tuple, dtype: jnp.dtype):
  """One jitted empty kernel per shape and dtype. Traced once, its kernel carries one source
  location wherever it is called from, so a step lowers and compiles one Mosaic kernel per
  shape, not one per call site (Mosaic GPU's kernel hash covers the module's locations)."""
  mesh = plgpu.Mesh(grid=(1,), grid_names=("block",))
  return jax.jit(pl.kernel(_leave, out_type=jax.ShapeDtypeStruct(shape, dtype), mesh=mesh,
                           name="uninitialized"))


def uninitialized(shape, dtype, tag: int = 0) -> jax.Array:
  """A ``shape``/``dtype`` array on a CUDA GPU without a write to it (one empty kernel).

  ``jnp.zeros`` of a buffer that a loop then overwrites slice by slice (the stacked outputs of a
  scan) costs a write pass over it (Llama-3.1-8B's stacked residuals at 1x1024: about 2 ms on the
  H200, experiments/results/h200/stacked_gemm). Read nothing of it before writing it.
  ``tag`` sets each call apart, so that XLA does not merge two of one shape into one buffer
  (the loops that fill them would then have to copy it).
  """
  return _empty_kernel(tuple(shape), jnp.dtype(dtype))(jnp.full((1,), tag, jnp.int32))
