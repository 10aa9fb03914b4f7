"""``y = x @ w_stack[layer]`` (or ``x @ w_stack[layer].T``) on Hopper, reading the stack in place.

Inside ``lax.scan`` over a stacked weight, XLA copies ``w_stack[l]`` out of the stack before every
GEMM. This kernel takes the whole stack as one ``[L*R, C]`` operand and the layer as a runtime row
offset read from an int32 vector in device memory (as :mod:`pallas_kernels.mosaic.kernel` does),
so no slice of the stack is ever materialized.

Schedule (the FORGE kernel's, with a plain epilogue): a persistent grid, one block per SM; two
compute warpgroups take turns on whole ``tile_m x tile_n`` output tiles, fed by a memory
warpgroup through one ring of ``x``/``w`` stages; the fp32 accumulator is cast and leaves
through shared memory with one TMA store per tile (or per ``epi_n`` columns). With ``wg_split="m"``
the two warpgroups instead share each block tile, twice as tall as one warpgroup's, and each
stage of the ring feeds both (jax's Hopper matmul's schedule). With ``transpose_w`` the ``w`` block goes to
``wgmma`` as a transposed view of shared memory; under the interpreter, which cannot read one
(jax 0.10.2), it goes through registers into a scratch buffer instead.

``forge_jax.ScannedStack`` runs each stacked FORGE layer's forward and ``dX`` products with it on a
Hopper GPU (``forge_jax._fused.stacked_dot``). Measured on the H200 over 32 Llama-3.1-8B layers at
T=1024 (``experiments/bench_stacked_matmul.py``, results in
``experiments/results/h200/stacked_gemm/``): with :func:`default_config`'s tilings, a layer's 14
products (7 forward, 7 transposed) take 46.11 ms per 32 layers against 47.43 for unrolled XLA's
GEMMs on separate weights, which a scan could not use without copying ``w_stack[l]`` out first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.mosaic import common
from pallas_kernels.mosaic import config as mcfg

_WGS = 2  # compute warpgroups
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class StackedMatmulConfig:
  """Tiling. The tiles are those of jax's Hopper matmul (ops/gpu/hopper_matmul_mgpu.py) with its
  two compute warpgroups; five ring stages (224 KiB of shared memory) measured 0.97-1.04x the
  time of four on the Llama-3.1-8B shapes at T=1024 (faster on six of eight), 128x256 tiles with
  two stages 5-10x slower, 64x256 with four 1.03-1.13x slower.

  Attributes:
    tile_m, tile_n: output rows / columns per tile (one compute warpgroup's), multiples of 64,
      ``tile_n`` at most 256.
    tile_k: contraction elements per pipeline step, a multiple of 64.
    max_concurrent_steps: stages of the ``x``/``w`` ring (at least 2).
    grid_tile_width: the persistent loop walks bands of this many tiles along N.
    num_sms: persistent grid size; ``None``: the device's SM count (132 off a GPU).
    wg_split: ``None``: each compute warpgroup takes whole tiles of its own, in turns; ``"m"``:
      both take one block tile of ``2 * tile_m`` rows, a ``tile_m x tile_n`` half each, and share
      its ring stages (the split along N measured slower on every shape: docs/mosaic_kernel.md).
    epi_n: columns per TMA store of a tile's result (two store buffers per warpgroup, a
      divisor of ``tile_n`` and a multiple of 64); ``None``: the whole tile at once.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 5
  grid_tile_width: int = 8
  num_sms: Optional[int] = None
  wg_split: Optional[str] = None
  epi_n: Optional[int] = None

  @property
  def block_m(self) -> int:
    """Output rows of a block's tile (both warpgroups' with ``wg_split="m"``)."""
    return self.tile_m * (_WGS if self.wg_split == "m" else 1)

  @property
  def out_buffers(self) -> int:
    """Store buffers per compute warpgroup."""
    return 1 if self.epi_n in (None, self.tile_n) else 2

  def smem_bytes(self, itemsize: int = 2) -> int:
    stage = (self.block_m * self.tile_k + self.tile_k * self.tile_n) * itemsize
    out = _WGS * self.out_buffers * self.tile_m * (self.epi_n or self.tile_n) * itemsize
    return self.max_concurrent_steps * stage + out


# Both compute warpgroups on one 128x256 tile, 64x256 each, stored 64 columns at a time (four
# stages fit beside the store buffers). Measured on the H200 at T=1024 (ms per 32 Llama-3.1-8B
# layers, experiments/results/h200/stacked_gemm/shared_tiles): where these tiles fill the SMs in
# one wave (a 1024x4096 result: 128 tiles) 0.80-0.98x the time of 128x128 tiles taken in turns
# (q/o 1.782 / 1.726 against 1.815 / 1.924 forward / transposed, gate/up's dX 5.597 against
# 6.181, down 5.078 against 5.638); over several waves the turns' overlap of one warpgroup's
# store with the other's GEMM wins (a 1024x14336 result: 6.545 / 6.599 against 6.504 / 6.366).
SHARED_TILE = StackedMatmulConfig(tile_m=64, tile_n=256, max_concurrent_steps=4, wg_split="m",
                                  epi_n=64)


def default_config(m: int, n: int) -> StackedMatmulConfig:
  """The tiling of an [M, N] product.

  * 64x128 tiles taken in turns where 128x128 ones would leave more than half the SMs without
    one (the k and v projections of Llama-3.1-8B at 1024 tokens: 64 tiles for 132 SMs; per 32
    layers 0.721 ms against 0.917 with 128x128 tiles, where 128x64 took 0.742 and XLA 0.652; at
    4096 tokens, 256 tiles, 64-row tiles are 1.37x slower);
  * else :data:`SHARED_TILE` where its 128x256 tiles fill the SMs in one wave (more than half of
    them, at most all);
  * else :class:`StackedMatmulConfig`'s 128x128 tiles taken in turns.
  """
  cfg = StackedMatmulConfig()
  sms = mcfg.grid_size(cfg)
  if m % 64 == 0 and 2 * (m // cfg.tile_m) * (n // cfg.tile_n) <= sms:
    return dataclasses.replace(cfg, tile_m=64)
  if m % SHARED_TILE.block_m == 0 and n % SHARED_TILE.tile_n == 0:
    if sms < 2 * (m // SHARED_TILE.block_m) * (n // SHARED_TILE.tile_n) <= 2 * sms:
      return SHARED_TILE
  return cfg


@dataclasses.dataclass(frozen=True)
class _Plan:
  cfg: StackedMatmulConfig
  m: int
  k: int
  n: int
  transpose_w: bool
  num_sms: int
  interpreting: bool


def _kernel(x_gmem, w_gmem, layer_gmem, out_gmem, *, plan: _Plan):
  cfg, dtype = plan.cfg, x_gmem.dtype
  tm, tn, tk, stages = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.max_concurrent_steps
  bm, shared = cfg.block_m, cfg.wg_split is not None
  epi_n, out_buffers = cfg.epi_n or tn, cfg.out_buffers
  m_iters, n_iters, k_iters = plan.m // bm, plan.n // tn, plan.k // tk
  w_block = (tn, tk) if plan.transpose_w else (tk, tn)

  @functools.partial(
      pl.run_scoped,
      x_stages=plgpu.SMEM((stages, bm, tk), dtype, transforms=common.mma_transforms(tk, dtype)),
      w_stages=plgpu.SMEM((stages, *w_block), dtype,
                          transforms=common.mma_transforms(w_block[1], dtype)),
      # Taking turns, each warpgroup waits on barriers of its own; sharing, both on one set.
      stage_ready=plgpu.Barrier(num_arrivals=2, num_barriers=stages * (1 if shared else _WGS)),
      stage_free=plgpu.Barrier(num_arrivals=_WGS if shared else 1, num_barriers=stages),
      out_smem=plgpu.SMEM((_WGS, out_buffers, tm, epi_n), dtype,
                          transforms=common.mma_transforms(epi_n, dtype)),
      # The 0.10.2 interpreter reads no transposed operand: the w block goes through registers.
      wt_smem=(plgpu.SMEM((_WGS, tk, tn), dtype, transforms=common.mma_transforms(tn, dtype))
               if plan.interpreting and plan.transpose_w else None),
      collective_axes="wg",
  )
  def _scope(x_stages, w_stages, stage_ready, stage_free, out_smem, wt_smem):
    wg_idx, block = lax.axis_index("wg"), lax.axis_index("sm")
    num_local = lax.div(m_iters * n_iters - block + (plan.num_sms - 1), jnp.int32(plan.num_sms))
    tile_coords = lambda i: common.planar_snake(block + i * plan.num_sms, m_iters, n_iters,
                                                cfg.grid_tile_width)
    # The layer is a row offset into the [L*R, C] view of the stack.
    w_row0 = layer_gmem[0] * (plan.n if plan.transpose_w else plan.k)

    @pl.when(wg_idx == _WGS)
    def _memory_warpgroup():
      plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")

      @pl.loop(0, num_local)
      def _tile(i):
        m_idx, n_idx = tile_coords(i)
        ready_base = 0 if shared else lax.rem(i, _WGS) * stages  # the owner's barriers

        @pl.loop(0, k_iters)
        def _step(k):
          step = i * k_iters + k
          slot = lax.rem(step, stages)
          pl.when(step >= stages)(lambda: plgpu.barrier_wait(stage_free.at[slot]))
          ready = stage_ready.at[ready_base + slot]
          plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(m_idx * bm, bm), pl.ds(k * tk, tk)],
                                  x_stages.at[slot], ready)
          if plan.transpose_w:  # rows of W[l] are output columns
            window = pl.ds(w_row0 + n_idx * tn, tn), pl.ds(k * tk, tk)
          else:
            window = pl.ds(w_row0 + k * tk, tk), pl.ds(n_idx * tn, tn)
          plgpu.copy_gmem_to_smem(w_gmem.at[window], w_stages.at[slot], ready)

      total = num_local * k_iters

      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):  # every completion of a barrier is awaited before it goes away
        plgpu.barrier_wait(stage_free.at[lax.rem(step, stages)])

    @pl.when(wg_idx < _WGS)
    def _compute_warpgroup():
      plgpu.set_max_registers(common.compute_registers(_WGS), action="increase")
      row_off = wg_idx * tm if shared else 0  # this warpgroup's rows within its block tile

      @pl.loop(0, num_local if shared else lax.div(num_local - wg_idx + (_WGS - 1), _WGS))
      def _tile(j):
        i = j if shared else wg_idx + j * _WGS  # taking turns: tiles wg_idx, wg_idx + 2, ...
        m_idx, n_idx = tile_coords(i)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
        def _acc_scope(acc_ref):
          @pl.loop(0, k_iters)
          def _step(k):
            step = i * k_iters + k
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(stage_ready.at[slot if shared else wg_idx * stages + slot])
            x_ref, w_ref = x_stages.at[slot], w_stages.at[slot]
            if shared:
              x_ref = x_ref.at[pl.ds(row_off, tm)]
            if plan.transpose_w and plan.interpreting:
              plgpu.wgmma_wait(0)  # the previous step's wgmma has read the scratch block
              wt_smem.at[wg_idx][...] = w_ref[...].T
              plgpu.commit_smem()
              w_ref = wt_smem.at[wg_idx]
            elif plan.transpose_w:
              w_ref = w_ref.transpose((1, 0))  # wgmma's transposed view of shared memory
            plgpu.wgmma(acc_ref, x_ref, w_ref)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: free its stage
            prev_slot = lax.rem(step + (stages - 1), stages)
            pl.when(k > 0)(lambda: plgpu.barrier_arrive(stage_free.at[prev_slot]))

          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(stage_free.at[lax.rem(i * k_iters + (k_iters - 1), stages)])
          out = acc_ref[...].astype(out_smem.dtype)
          rows = pl.ds(m_idx * bm + row_off, tm)
          for c in range(tn // epi_n):
            buf = out_smem.at[wg_idx, c % out_buffers]
            # The store that last read this buffer (a tile or a chunk earlier) has read it out.
            plgpu.wait_smem_to_gmem(out_buffers - 1, wait_read_only=True)
            buf[...] = out[:, c * epi_n:(c + 1) * epi_n]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                buf, out_gmem.at[rows, pl.ds(n_idx * tn + c * epi_n, epi_n)])

    plgpu.wait_smem_to_gmem(0)  # every result is in device memory before the kernel exits


def problem(x, w_stack, transpose_w: bool, cfg: StackedMatmulConfig) -> Optional[str]:
  """Why the kernel cannot take these operands (shapes/dtypes only), or ``None``."""
  if getattr(x, "ndim", None) != 2 or getattr(w_stack, "ndim", None) != 3:
    return (f"x must be [M, K] and w_stack [L, K, N] (or [L, N, K] with transpose_w); got "
            f"{getattr(x, 'shape', x)} and {getattr(w_stack, 'shape', w_stack)}")
  if x.dtype != w_stack.dtype or jnp.dtype(x.dtype) not in _DTYPES:
    return f"x and w_stack must both be bfloat16 or both float16; got {x.dtype}, {w_stack.dtype}"
  m, k = x.shape
  n = w_stack.shape[1] if transpose_w else w_stack.shape[2]
  k_w = w_stack.shape[2] if transpose_w else w_stack.shape[1]
  if k != k_w:
    what = "w_stack.shape[2] (transpose_w)" if transpose_w else "w_stack.shape[1]"
    return f"x.shape[1]={k} must equal {what}={k_w}"
  if w_stack.shape[0] < 1:
    return "w_stack has no layer"
  c = cfg
  if c.tile_m % 64 or c.tile_n % 64 or c.tile_k % 64 or c.tile_n > 256 or min(c.tile_m, c.tile_k) < 64:
    return f"tile_m={c.tile_m}, tile_n={c.tile_n}, tile_k={c.tile_k} must be multiples of 64 (tile_n <= 256)"
  if c.max_concurrent_steps < 2:
    return f"max_concurrent_steps={c.max_concurrent_steps} must be at least 2"
  if c.wg_split not in (None, "m"):
    return f"wg_split={c.wg_split!r} must be None or 'm'"
  if c.epi_n is not None and (c.epi_n % 64 or c.epi_n <= 0 or c.tile_n % c.epi_n):
    return f"epi_n={c.epi_n} must be a multiple of 64 that divides tile_n={c.tile_n}"
  if m % c.block_m or n % c.tile_n or k % c.tile_k:
    split = f" (wg_split={c.wg_split!r}: a block's tile is {c.block_m}x{c.tile_n})" if c.wg_split else ""
    return (f"M={m}, N={n}, K={k} must be multiples of tile_m={c.tile_m}, tile_n={c.tile_n}, "
            f"tile_k={c.tile_k}{split}")
  if (smem := c.smem_bytes(jnp.dtype(x.dtype).itemsize)) > mcfg.SMEM_BUDGET_BYTES:
    return f"the config needs {smem} bytes of shared memory (at most {mcfg.SMEM_BUDGET_BYTES})"
  return None


def stacked_matmul(x: jax.Array, w_stack: jax.Array, layer: Any, *, transpose_w: bool = False,
                   config: Optional[StackedMatmulConfig] = None,
                   interpret: Union[bool, Any] = False) -> jax.Array:
  """``x @ w_stack[layer]`` (``x @ w_stack[layer].T`` with ``transpose_w``), f32 accumulation.

  Args:
    x: [M, K], bfloat16 or float16.
    w_stack: [L, K, N] (or [L, N, K] with ``transpose_w``: ``dX = dy @ W[l].T`` is
      ``stacked_matmul(dy, W, l, transpose_w=True)``), the dtype of ``x``; read in place.
    layer: an integer scalar (may be traced); as in ``lax.dynamic_index_in_dim``, a negative one
      counts from the end, and the result is clamped to ``[0, L)``.
    config: tiling; ``None``: :func:`default_config`'s for this product.
    interpret: run on CPU under the Mosaic GPU interpreter (``True`` or ``InterpretGPUParams``).

  Returns:
    [M, N] in the dtype of ``x``.

  Raises:
    ValueError: for operands or a config the kernel cannot take.
  """
  layer = jnp.asarray(layer)
  if jnp.issubdtype(layer.dtype, jnp.integer):
    layer = layer.astype(jnp.int32)  # a Python int and an int32 array: one trace
  with common.same_trace_context():  # one trace per shape and config, wherever it is called
    return _stacked_matmul(x, w_stack, layer, transpose_w=transpose_w, config=config,
                           interpret=interpret)


@functools.partial(jax.jit, static_argnames=("transpose_w", "config", "interpret"))
def _stacked_matmul(x, w_stack, layer, *, transpose_w, config, interpret):
  n_out = w_stack.shape[1] if transpose_w else w_stack.shape[-1]
  cfg = config or default_config(x.shape[0], n_out)
  if why := problem(x, w_stack, transpose_w, cfg):
    raise ValueError(f"stacked_matmul: {why}")
  layer = jnp.asarray(layer)
  if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
    raise ValueError(f"stacked_matmul: layer must be an integer scalar; got {layer.dtype}{list(layer.shape)}")
  num_layers, rows, cols = w_stack.shape
  (m, k), n = x.shape, (rows if transpose_w else cols)
  params = common.interpret_params(interpret)
  plan = _Plan(cfg, m, k, n, transpose_w, mcfg.grid_size(cfg), params is not None)
  # As lax.dynamic_index_in_dim: a negative layer counts from the end, then clamped into [0, L).
  layer = layer.astype(jnp.int32)
  layer_vec = jnp.clip(jnp.where(layer < 0, layer + num_layers, layer), 0, num_layers - 1).reshape(1)
  mesh = plgpu.Mesh(grid=(plan.num_sms,), grid_names=("sm",), num_threads=_WGS + 1,
                    thread_name="wg")
  call = pl.kernel(
      functools.partial(_kernel, plan=plan), out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
      mesh=mesh, name="stacked_matmul",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({} if params is None else dict(interpret=params)))
  # A reshape of the whole stack (a bitcast), not a slice of it.
  return call(x, w_stack.reshape(num_layers * rows, cols), layer_vec)
