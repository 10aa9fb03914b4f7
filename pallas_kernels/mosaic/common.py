"""Pieces both Mosaic GPU kernels use: the persistent grid's tile order, shared-memory tiling,
the register split and the interpreter's parameters."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu

MEMORY_REGISTERS = 40  # per thread of the memory warpgroup; the compute warpgroups get the rest


def same_trace_context():
  """The abstract-mesh context made explicit, for a call into a jitted kernel.

  jit's trace cache keys on the abstract mesh in context, which is ``None`` where nothing set it
  and an empty ``AbstractMesh`` inside some of jax's own transformations (a scan body's slicing,
  a zero cotangent): the same kernel call, same shapes and config, then misses the cache and is
  traced again (a scanned model's stacked GEMM was, from both kinds of call site). Entering the
  mesh in context (the empty one where none is set) gives both the same key.
  """
  use = getattr(jax.sharding, "use_abstract_mesh", None)
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  return use(get()) if use and get else contextlib.nullcontext()


def compute_registers(num_compute_wgs: int) -> int:
  """Registers per thread of a compute warpgroup (a multiple of 8, at most 256)."""
  return min(256, (512 - MEMORY_REGISTERS) // num_compute_wgs) // 8 * 8


def mma_transforms(cols: int, dtype) -> tuple:
  """Tiling + swizzle for a shared-memory buffer whose rows hold ``cols`` elements (the widest
  swizzle, up to 128 bytes, that divides a row)."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def planar_snake(lin: jax.Array, m_iters: int, n_iters: int, width: int):
  """``(m, n)`` of linear tile ``lin`` in ``plgpu.planar_snake``'s order along ``N`` (bands of
  ``width`` tiles, every other one walking ``M`` backwards), with static band widths: jax's
  evaluates a remainder band of width 0 when the width divides the grid, an integer division
  by zero that kills the CPU interpreter (SIGFPE)."""
  width = max(1, min(width, n_iters))
  full_bands = n_iters // width
  full_elems = full_bands * width * m_iters
  rem_width = n_iters - full_bands * width

  def coords(idx, band_width, first_n, first_band):
    per_band = jnp.int32(band_width * m_iters)
    band, within = lax.div(idx, per_band), lax.rem(idx, per_band)
    n = first_n + band * band_width + lax.rem(within, jnp.int32(band_width))
    m = lax.div(within, jnp.int32(band_width))
    odd = lax.rem(band + first_band, 2) == 1
    return jnp.where(odd, m_iters - 1 - m, m), n

  m, n = coords(lin, width, 0, 0)
  if rem_width:  # a last, narrower band
    tail_m, tail_n = coords(jnp.maximum(lin - full_elems, 0), rem_width, full_bands * width,
                            full_bands)
    in_tail = lin >= full_elems
    n = jnp.where(in_tail, tail_n, n)
    m = jnp.where(in_tail, tail_m, m)
  return m, n


def interpret_params(interpret: Any):
  """``InterpretGPUParams`` for ``interpret=True`` (public in jax 0.11.2, private before)."""
  if interpret is False or interpret is None:
    return None
  if interpret is not True:
    return interpret
  params_cls = getattr(plgpu, "InterpretGPUParams", None)
  if params_cls is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params_cls  # pylint: disable=g-import-not-at-top
  return params_cls()
