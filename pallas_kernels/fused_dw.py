"""Fused weight-gradient + optimizer update: ``dW = x.T @ dy`` consumed in place.

For ``x`` [T, K] and ``dy`` [T, N], each program of the kernel owns one
(block_k, block_n) tile of the weight ``w`` [K, N]: it accumulates
``x[:, tile_k].T @ dy[:, tile_n]`` over all T tokens in float32, calls the
optimizer's elementwise ``update_fn`` on that tile, and writes the new weight
and state-slot tiles in place. The gradient tile never leaves the kernel.

The contract (``update_fn``, stored forms, stacked weights) is the one of
:mod:`pallas_kernels.contract`; :func:`pallas_kernels.reference.fused_dw_update_reference`
is its plain-jnp reference.

Pallas's Triton backend is deprecated from jax 0.11: when jax removes it, the
Mosaic GPU kernel (:mod:`pallas_kernels.mosaic`) takes its place on Hopper and
the ``"xla"`` reference everywhere else.

The Triton-lowered kernel (:func:`fused_dw_update`):

* grid ``(cdiv(K, block_k), cdiv(N, block_n))``; each program runs a
  ``fori_loop`` over T in steps of ``block_t``, so T can be any length (64k+
  tokens) with a fixed register and shared-memory footprint;
* every array is passed whole (no BlockSpec) and indexed inside the kernel:
  tails of T, K and N are handled by masked loads (zeros) and masked stores,
  never by padded copies in device memory; stacked weights are addressed by
  the ``layer`` scalar the same way;
* ``w`` and the slots are aliased to the outputs (``input_output_aliases``),
  so under a jit that donates them the update is in place;
* ``scalars`` (any pytree of 0-d floats) travels as one small float32 vector
  and is rebuilt with its treedef inside the kernel; the integers (layer,
  rounding seed, step) travel as one small int32 vector;
* a block-quantized slot is two arrays (codes, scales); a tile of
  ``block_n`` columns (a multiple of the quantization block) owns whole
  blocks, so re-quantizing needs no other tile.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Optional, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels import numerics
from pallas_kernels.contract import (UpdateFn, apply_update, codecs_for, grad_sq_terms,
                                     layer_problem, operand_problem, pack_scalars, parts_of,
                                     rebuild, rounding_ints)

Array = jax.Array

# Triton's tl.dot needs at least 16 in each of M, N and K.
_MIN_BLOCK = 16
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# jax >= 0.11 warns on every lowering of a Triton pallas_call (the backend is
# deprecated in favour of Mosaic GPU). This kernel uses it on purpose until
# the Mosaic GPU kernel (pallas_kernels/mosaic/) is faster, so exactly that
# message is silenced, and nothing else.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


# ----------------------------------------------------------------------------
# Tile configuration.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Static tiling of :func:`fused_dw_update`.

  Attributes:
    block_k: rows of the weight tile one program owns (the K axis).
    block_n: columns of the weight tile (the N axis).
    block_t: tokens consumed per step of the accumulation loop.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the token loop.
  """

  block_k: int = 128
  block_n: int = 128
  block_t: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_k", "block_n", "block_t"):
      value = getattr(self, name)
      if value < _MIN_BLOCK or value & (value - 1):
        raise ValueError(
            f"TileConfig.{name}={value} must be a power of two >= {_MIN_BLOCK} "
            "(Triton's dot needs power-of-two tiles of at least 16 in each dim)."
        )
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"TileConfig.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16.")
    if self.num_stages < 1:
      raise ValueError(f"TileConfig.num_stages={self.num_stages} must be >= 1.")

  def replace(self, **changes) -> "TileConfig":
    return dataclasses.replace(self, **changes)


def shape_class(t: int, k: int, n: int) -> str:
  """The key of :data:`TUNED_TILES` a problem of T x K x N falls in.

  Only T separates the classes for now: it sets how long the token loop runs
  against the fixed cost of the optimizer epilogue, which is what moved the
  best tile in the first measurements (128x128 at T <= 4096, 128x256 at 16k).
  """
  del k, n
  if t <= 2048:
    return "t<=2048"
  if t <= 8192:
    return "t<=8192"
  return "t>8192"


# Best tile per shape class for bf16 x/dy with fp32 w and AdamW slots, chosen
# by experiments/tune_fused_dw.py (lowest mean slowdown over the four model
# shapes of each class).
TUNED_TILES: dict[str, TileConfig] = {
    # Source: experiments/results/h200/tune_fused_dw.json (H200, jax 0.11.2,
    # 2026-11-29, `python -m experiments.tune_fused_dw --budget-s 170`).
    "t<=2048": TileConfig(block_k=128, block_n=64, block_t=64, num_warps=4, num_stages=4),
    "t<=8192": TileConfig(block_k=128, block_n=128, block_t=64, num_warps=8, num_stages=4),
    "t>8192": TileConfig(block_k=256, block_n=128, block_t=64, num_warps=8, num_stages=3),
}


def _fit(block: int, dim: int) -> int:
  """Shrinks a tile edge to the smallest power of two covering ``dim``."""
  return min(block, max(_MIN_BLOCK, pl.next_power_of_2(dim)))


def default_tile_config(t: int, k: int, n: int, dtype=jnp.bfloat16) -> TileConfig:
  """The tile :func:`fused_dw_update` uses for T x K x N inputs of ``dtype``.

  Starts from :data:`TUNED_TILES`; tiles are shrunk for dims smaller than the
  tile (less masked work), and float32 inputs take half the token step
  (twice the bytes per token in shared memory).
  """
  cfg = TUNED_TILES[shape_class(t, k, n)]
  block_t = cfg.block_t
  if jnp.dtype(dtype).itemsize > 2:
    block_t = max(_MIN_BLOCK, block_t // 2)
  return cfg.replace(
      block_k=_fit(cfg.block_k, k), block_n=_fit(cfg.block_n, n), block_t=_fit(block_t, t)
  )


# ----------------------------------------------------------------------------
# The Triton-lowered kernel.
# ----------------------------------------------------------------------------


def _edge_mask(start, block: int, dim: int) -> Optional[Array]:
  """``start + arange(block) < dim``, or None when no tile can overhang.

  Static: a dim that is a multiple of the tile gets no mask at all, so the
  hot loop of aligned shapes carries no compares.
  """
  if dim % block == 0:
    return None
  return start + jnp.arange(block, dtype=jnp.int32) < dim


def _tile_mask(
    row_mask: Optional[Array], col_mask: Optional[Array], shape: tuple[int, int]
) -> Optional[Array]:
  """The 2-d in-bounds mask of a tile from its row and column masks."""
  if row_mask is None and col_mask is None:
    return None
  if row_mask is None:
    return jnp.broadcast_to(col_mask[None, :], shape)
  if col_mask is None:
    return jnp.broadcast_to(row_mask[:, None], shape)
  return row_mask[:, None] & col_mask[None, :]


def _load(view, mask: Optional[Array]) -> Array:
  """Loads a tile; masked-off elements read as 0 (and touch no memory)."""
  if mask is None:
    return pltriton.load(view)
  return pltriton.load(view, mask=mask, other=jnp.zeros((), view.dtype))


def _store(view, value: Array, mask: Optional[Array]) -> None:
  if mask is None:
    pltriton.store(view, value)
  else:
    pltriton.store(view, value, mask=mask)


def _accumulate_grad(
    x_ref, dy_ref, k0, n0, k_mask, n_mask, *, t: int, config: TileConfig, compute_dtype, precision
) -> Array:
  """``x[:, tile_k].T @ dy[:, tile_n]`` in float32, ``block_t`` tokens a step."""
  bk, bn, bt = config.block_k, config.block_n, config.block_t

  def body(i, acc):
    t0 = i * bt
    t_mask = _edge_mask(t0, bt, t)
    x_blk = _load(x_ref.at[pl.ds(t0, bt), pl.ds(k0, bk)], _tile_mask(t_mask, k_mask, (bt, bk)))
    dy_blk = _load(dy_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], _tile_mask(t_mask, n_mask, (bt, bn)))
    # Contracting dim 0 of both: Triton transposes the x tile in shared
    # memory, no transposed copy of x is ever made.
    return acc + lax.dot_general(
        x_blk.astype(compute_dtype), dy_blk.astype(compute_dtype),
        (((0,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )

  return lax.fori_loop(0, pl.cdiv(t, bt), body, jnp.zeros((bk, bn), jnp.float32))


def _fused_dw_kernel(
    # Inputs: x [T, K], dy [T, N], packed scalars [S], (ints [3 or 4]), then the
    # parts of w and of every slot (see `codecs`).
    x_ref, dy_ref, scalars_ref, *refs,
    # Outputs: the same parts (aliased to the inputs), then (grad_sq [gk, gn]).
    t: int,
    k: int,
    n: int,
    codecs: tuple[numerics.Codec, ...],
    with_ints: bool,
    stacked: bool,
    gated: bool,
    with_norm: bool,
    scalars_treedef: Any,
    update_fn: UpdateFn,
    config: TileConfig,
    compute_dtype: Any,
    precision: Any,
):
  """One (block_k, block_n) weight tile: gradient, update, write-back."""
  ints_ref, refs = (refs[0], refs[1:]) if with_ints else (None, refs)
  num_parts = sum(len(c.col_divisors()) for c in codecs)
  in_refs, out_refs = refs[:num_parts], refs[num_parts : 2 * num_parts]
  norm_ref = refs[2 * num_parts] if with_norm else None
  bk, bn = config.block_k, config.block_n

  pid_k, pid_n = pl.program_id(0), pl.program_id(1)
  k0, n0 = pid_k * bk, pid_n * bn
  k_mask = _edge_mask(k0, bk, k)
  n_mask = _edge_mask(n0, bn, n)
  g = _accumulate_grad(
      x_ref, dy_ref, k0, n0, k_mask, n_mask,
      t=t, config=config, compute_dtype=compute_dtype, precision=precision,
  )

  # Where each part's tile lives: a part with one value per `d` columns of the
  # weight (per-block scales) is stored block-major, [..., N // d, K]: its tile
  # is bn // d rows at n0 // d by the weight tile's bk columns.
  layer = (ints_ref[0],) if stacked else ()
  views = []
  for d in (d for c in codecs for d in c.col_divisors()):
    if d == 1:
      views.append((layer + (pl.ds(k0, bk), pl.ds(n0, bn)), _tile_mask(k_mask, n_mask, (bk, bn))))
    else:
      block_mask = _edge_mask(n0 // d, bn // d, n // d)
      views.append((layer + (pl.ds(n0 // d, bn // d), pl.ds(k0, bk)),
                    _tile_mask(block_mask, k_mask, (bn // d, bk))))

  values32, i = [], 0
  for c in codecs:
    m = len(c.col_divisors())
    values32.append(c.decode(tuple(_load(r.at[v[0]], v[1]) for r, v in zip(in_refs[i : i + m], views[i : i + m]))))
    i += m
  scalars = scalars_treedef.unflatten(
      [scalars_ref[j] for j in range(scalars_treedef.num_leaves)]
  )
  w32 = values32[0]
  new_w32, new_slots = apply_update(update_fn, g, w32, tuple(values32[1:]), scalars)

  bits = None
  if any(c.needs_bits for c in codecs):
    # The hash of (seed, step, layer, row * N + col): independent of the tile.
    rows = k0 + jnp.arange(bk, dtype=jnp.int32)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    key = numerics.rounding_key(ints_ref[1], ints_ref[2], ints_ref[0])
    bits = numerics.element_bits(key, numerics.element_index(rows[:, None], cols[None, :], n))

  applied = ints_ref[3] != 0 if gated else None  # not applied: nothing is stored
  i = 0
  for j, (c, value) in enumerate(zip(codecs, (new_w32,) + new_slots)):
    m = len(c.col_divisors())
    refs_i, views_i = out_refs[i : i + m], views[i : i + m]
    bits_j = numerics.value_bits(bits, j) if c.needs_bits else None
    parts = c.encode(value, tuple(r.dtype for r in refs_i), bits_j)
    for r, (tile, mask), part in zip(refs_i, views_i, parts):
      if gated:  # the aliased buffers keep their values
        keep = jnp.broadcast_to(applied, part.shape)
        mask = keep if mask is None else mask & keep
      _store(r.at[tile], part, mask)
    i += m
  if with_norm:
    # Masked-off rows and columns of g are exact zeros (masked loads).
    norm_ref[pid_k, pid_n] = jnp.sum(grad_sq_terms(g))


# ----------------------------------------------------------------------------
# The wrapper.
# ----------------------------------------------------------------------------


def _check_inputs(x: Array, dy: Array, w: Array, slots: tuple, layer) -> None:
  """ValueErrors that name the offending value and the fix."""
  if why := operand_problem(x, dy, w, slots) or layer_problem(w, layer):
    raise ValueError(why)
  for name, a in (("x", x), ("dy", dy)):
    if jnp.dtype(a.dtype) not in _INPUT_DTYPES:
      raise ValueError(
          f"{name}.dtype={a.dtype} is not supported: x and dy must be float32 or "
          f"bfloat16; cast {name} to one of them."
      )
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w.dtype={w.dtype} must be a floating dtype.")
  for i, s in enumerate(slots):
    if not isinstance(s, numerics.QuantizedArray) and not jnp.issubdtype(s.dtype, jnp.floating):
      raise ValueError(
          f"slots[{i}].dtype={s.dtype} must be a floating dtype (int8 states are "
          "passed as a numerics.QuantizedArray, codes with their scales)."
      )


def _silence_triton_deprecation() -> None:
  """Ignores jax >= 0.11's Triton-backend deprecation warning, and only it.

  Installed at call time (idempotent: ``filterwarnings`` de-duplicates) rather
  than at import so it sits in front of filters a test runner adds per test
  (``-W error``); the warning is raised when the enclosing jit is lowered,
  which always comes after this trace-time call.
  """
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


def fused_dw_update(
    x: Array,
    dy: Array,
    w: Array,
    slots: Sequence[Array],
    scalars: Any,
    update_fn: UpdateFn,
    *,
    layer: Optional[Array] = None,
    config: Optional[TileConfig] = None,
    compute_grad_sq_norm: bool = False,
    interpret: bool = False,
    weight_codec: Optional[numerics.Codec] = None,
    seed: Optional[Any] = None,
    step: Optional[Any] = None,
    apply: Optional[Any] = None,
):
  """``dW = x.T @ dy`` consumed tile by tile by ``update_fn``, in place.

  Same contract as :func:`pallas_kernels.reference.fused_dw_update_reference`. Under a jit that
  donates ``w`` and ``slots`` the new values are written over the old ones;
  without donation XLA copies them first (the result is the same).

  Args:
    x: [T, K] layer input, float32 or bfloat16.
    dy: [T, N] output cotangent, float32 or bfloat16.
    w: [K, N] weight, or [L, K, N] stacked weights with ``layer`` given.
    slots: optimizer-state arrays shaped like ``w``: float arrays of any float
      dtype, or :class:`~pallas_kernels.numerics.QuantizedArray` (N a multiple
      of its block; ``config.block_n`` must be a multiple of the block too).
    scalars: pytree of 0-d float32 values passed to ``update_fn`` (packed
      into one float32 vector; other numeric leaves arrive as float32).
    update_fn: the elementwise rule (see the module docstring).
    layer: int32 scalar (may be traced) selecting the slice of stacked
      ``w``/slots; clamped to ``[0, L)`` like ``lax.dynamic_index_in_dim``.
    config: tiling; :func:`default_tile_config` when None.
    compute_grad_sq_norm: also return ``sum(dW**2)`` (float32; NaN if an element of ``dW``
      is not finite).
    interpret: run the same kernel in Pallas interpret mode (CPU).
    weight_codec: how the new weight is written back
      (:class:`~pallas_kernels.numerics.Cast`, round to nearest, by default;
      :class:`~pallas_kernels.numerics.StochasticRound` for stochastic
      rounding).
    seed: int or int32/uint32 scalar: the rounding seed (needed by
      stochastic rounding; see :func:`~pallas_kernels.numerics.rounding_key`).
    step: int32 scalar (may be traced): the optimizer step, hashed with
      ``seed`` and ``layer``.
    apply: a boolean scalar (may be traced): where false the kernel stores
      nothing, so ``w`` and the slots keep their values bit for bit.

  Returns:
    ``(new_w, new_slots, grad_sq_norm)``; ``grad_sq_norm`` is ``None`` unless
    requested.
  """
  slots = tuple(slots)
  _check_inputs(x, dy, w, slots, layer)
  (t, k), n = x.shape, dy.shape[1]
  codecs = codecs_for(w, slots, weight_codec)
  block = max(d for c in codecs for d in c.col_divisors())
  if config is None:
    config = default_tile_config(t, k, n, x.dtype)
    if config.block_n < block:
      # A tile must hold whole quantization blocks: widen it, and keep its
      # area (the accumulator's registers) by making it shorter.
      block_k = max(_MIN_BLOCK, config.block_k * config.block_n // block)
      config = config.replace(block_n=block, block_k=block_k)
  elif config.block_n % block:
    raise ValueError(
        f"config.block_n={config.block_n} must be a multiple of the quantization "
        f"block={block}: a tile re-quantizes whole blocks. Use a larger block_n."
    )
  seed_i32, step_i32 = rounding_ints(codecs, seed, step)
  compute_dtype = jnp.promote_types(x.dtype, dy.dtype)
  # Full fp32 (no TF32) for fp32 inputs, as the reference; bf16 is exact in
  # the tensor cores' products either way.
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
  scalar_vec, scalars_treedef = pack_scalars(scalars)
  stacked = w.ndim == 3
  gated = apply is not None
  with_ints = stacked or gated or any(c.needs_bits for c in codecs)
  inputs = [x, dy, scalar_vec]
  if with_ints:
    # Clamped: an out-of-range layer must never become an out-of-bounds write.
    layer_i32 = jnp.int32(0) if not stacked else jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
    ints = [layer_i32, seed_i32, step_i32]
    if gated:
      ints.append(jnp.asarray(apply).astype(jnp.int32))
    inputs.append(jnp.stack(ints))
  first_state = len(inputs)
  parts = parts_of(codecs, w, slots)
  inputs += parts
  grid = (pl.cdiv(k, config.block_k), pl.cdiv(n, config.block_n))
  out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in parts]
  if compute_grad_sq_norm:
    out_shape.append(jax.ShapeDtypeStruct(grid, jnp.float32))
  kernel = functools.partial(
      _fused_dw_kernel,
      t=t, k=k, n=n,
      codecs=codecs,
      with_ints=with_ints,
      stacked=stacked,
      gated=gated,
      with_norm=compute_grad_sq_norm,
      scalars_treedef=scalars_treedef,
      update_fn=update_fn,
      config=config,
      compute_dtype=compute_dtype,
      precision=precision,
  )
  _silence_triton_deprecation()
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      input_output_aliases={first_state + i: i for i in range(len(parts))},
      # Explicit Triton params: without them jax >= 0.9 picks Mosaic GPU.
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages
      ),
      interpret=interpret,
      name="fused_dw_update",
  )(*inputs)
  new_w, new_slots = rebuild(codecs, outs[: len(parts)])
  norm = jnp.sum(outs[-1]) if compute_grad_sq_norm else None
  return new_w, new_slots, norm
