"""Fused ``dW = x.T @ dy`` + optimizer update on Hopper, lowered through Mosaic GPU.

The contract is the one of :mod:`pallas_kernels.fused_dw` (module docstring
and :func:`~pallas_kernels.fused_dw.fused_dw_update_reference`): the rule
``update_fn(g, w, slots, scalars) -> (u, new_slots)`` runs on float32 tiles of
the gradient inside the kernel, the weight becomes ``w + u``, and the new
weight and slots are written in place; the gradient never reaches device
memory.

Kernel structure (one CUDA block per SM, persistent):

* three Pallas threads (warpgroups): two compute warpgroups and one memory
  warpgroup, with one of two schedules (``MosaicTileConfig.schedule``):
  ``"cooperative"`` (default), driven by
  ``plgpu.emit_pipeline_warp_specialized`` as in jax's ``hopper_matmul_mgpu``:
  the block owns a ``tile_m x (2 * tile_n)`` tile of ``W`` and each compute
  warpgroup accumulates its ``tile_m x tile_n`` half in float32 registers
  (``plgpu.ACC``) over the token dimension ``T``; or ``"pingpong"``, a
  hand-written producer/consumer pipeline in which each compute warpgroup
  owns whole ``tile_m x tile_n`` tiles, fed in turn through one stage ring,
  so that one warpgroup's epilogue overlaps the other's main loop.
* the contraction runs over ``T``, the major dimension of both ``x [T, K]``
  and ``dy [T, N]``, so the ``A`` operand is ``x`` block transposed. The
  ``(tile_t, tile_m)`` block of ``x`` is copied as is by TMA and handed to
  ``wgmma`` through ``plgpu.transpose_ref``: Hopper's tensor cores read a
  transposed 16-bit operand from shared memory natively, so no transposed copy
  of ``x`` exists anywhere.
* the epilogue streams the tile through a ring of ``epi_slots`` shared-memory
  slots of ``epi_m x epi_n`` sub-tiles (one buffer for ``W`` and one per
  optimizer slot). The first ``epi_slots`` sub-tiles are fetched with TMA
  *before* the main loop starts, so they arrive while the tensor cores work;
  each further sub-tile is fetched as soon as its slot's previous results have
  left shared memory. A sub-tile is read into registers in the WGMMA layout
  (the accumulator's), updated by the rule, written back to its slot and
  stored with an asynchronous TMA copy into the aliased ``W``/slot arrays;
  those stores drain while the next sub-tiles load and the next tile's main
  loop runs. (``epi_out_slots > 0`` stages the results in separate store
  buffers instead, so a slot is refilled without waiting for its store;
  measured no faster on the H200.)
* in-place: the kernel runs under ``pl.run_state`` + ``pl.core_map``, whose
  discharge aliases exactly the refs the kernel writes (``W``, the slots, the
  optional norm partials) to its outputs; under ``jit`` with those arrays
  donated there is no copy.

What this file does not do yet (see ``MOSAIC_NOTES.md``): pipelining across
tiles in the cooperative schedule exists only as the knob
``pipeline_across_tiles`` (off; lowers for sm_90, not yet run on a GPU, and
the interpreter hangs on it on 2 cores); clusters only as the
ping-pong knob ``cluster_n=2`` (x multicast to a pair of blocks; correct on the
H200 and no faster there, so off by default). (int8 states are done, see ``MOSAIC_NOTES.md``.)
Stochastic rounding of a bfloat16 weight is done in the
epilogue, with the same hash of (seed, step, layer, row * N + col) as the
Triton kernel and the reference (element indices from an iota in the WGMMA
layout), so all three write the same bits.
Checked under the Mosaic GPU interpreter and by lowering for ``cuda`` on a
CPU (jax 0.10.2, with the warpgroup lowering semantics that jax 0.11 uses by
default and this kernel pins), and on an H200 (jax 0.11.2,
``experiments/check_mosaic_gpu``): fp32 states match the reference to ~1e-7;
bf16 states and stochastically rounded bf16 weights match it to the rounding
of the last bit (see MOSAIC_NOTES.md).

Mosaic GPU in jax 0.10.2 (and 0.11.1) has no ``sqrt`` lowering, only
``rsqrt`` (jax 0.11.2 lowers it). Where it is missing, the kernel evaluates
the rule through its jaxpr with ``sqrt_p`` spelled from ``rsqrt`` (same
values at 0, inf, negatives and NaN; a few ulp elsewhere); the rule itself
(one definition, shared with XLA and the Triton kernel) is called unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, Union

import jax
from jax import lax
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics
from pallas_kernels.fused_dw import _rounding_ints
from pallas_kernels.numerics import store_cast

Array = jax.Array
UpdateFn = Callable[..., tuple[Array, tuple[Array, ...]]]

# The largest dynamic shared memory a Hopper block may use is 227 KiB, and
# Mosaic GPU checks a kernel's real total (its own accounting: barriers and
# its reduction scratch included) against it while lowering, also when
# cross-lowering on a CPU. Its total exceeds _smem_bytes' count by about
# 2.1 KiB, so the budget keeps a 3 KiB margin: 4 stages + 64x32 sub-tiles for
# fp32 AdamW (exactly 224 KiB by _smem_bytes) lowers and ran correctly on the
# H200, and is the fastest tiling at T = 64, 1024 and 4096
# (experiments/results/h200/mosaic_defaults/); with the grad-norm buffer
# (1 KiB more) it would not lower.
# tests/test_fused_dw_mosaic.py lowers every default candidate that lands in
# the margin, so a config the count admits but Mosaic refuses fails a test,
# not a user's compile.
_SMEM_BUDGET_BYTES = 224 * 1024
_MOSAIC_SMEM_LIMIT = 227 * 1024
_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_SLOTS = 4
_NUM_COMPUTE_WGS = 2
# START / STEADY / STOP of a pipeline of pipelines (jax's PipelinePipeline; public in 0.10.2).
try:
  _PIPELINE = plgpu.PipelinePipeline
except AttributeError:  # pragma: no cover - where a jax version keeps it private
  from jax._src.pallas.mosaic_gpu.pipeline import PipelinePipeline as _PIPELINE
# SM count used when the default device says nothing (CPU interpret mode,
# cross-lowering); the H200 has 132.
_DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class MosaicTileConfig:
  """Static tiling of :func:`fused_dw_update_mosaic`.

  Attributes:
    tile_m: rows of ``W`` per block (the ``x`` block width, wgmma ``M``);
      a multiple of 64.
    tile_n: columns of ``W`` per compute warpgroup; a block covers
      ``2 * tile_n`` columns. A multiple of 64, at most 256.
    tile_t: tokens per pipeline step (wgmma ``K``); a multiple of 64.
    max_concurrent_steps: pipeline stages of ``x``/``dy`` blocks in shared
      memory (clamped to the number of steps).
    epi_m: rows of an epilogue sub-tile; a multiple of 64 dividing ``tile_m``.
    epi_n: columns of an epilogue sub-tile; a multiple of 16 dividing
      ``tile_n``.
    epi_slots: depth of each compute warpgroup's epilogue ring; the first
      ``epi_slots`` sub-tiles of a tile are prefetched during its main loop.
    grid_minor_dim: ``"n"`` or ``"m"``: the dimension along which the
      persistent loop walks ``grid_tile_width`` tiles before moving on (L2
      locality of the ``x``/``dy`` blocks).
    grid_tile_width: width of that band of tiles.
    memory_registers: registers per thread of the memory warpgroup.
    l2_prefetch_steps: this many pipeline steps before a tile's main loop
      ends, each compute warpgroup asks TMA to prefetch its whole ``W``/slot
      tile into L2, so that the epilogue's loads beyond the prefetched ring
      hit L2 rather than device memory (0: off). Early enough for the data to
      arrive, late enough that the ``x``/``dy`` stream does not evict it.
    schedule: ``"cooperative"``: both compute warpgroups work on one block
      tile (``tile_m x 2 tile_n``, sharing the ``x`` block) fed by jax's
      warp-specialized pipeline, and run their epilogues together.
      ``"pingpong"``: each compute warpgroup owns a whole ``tile_m x tile_n``
      tile and the memory warpgroup feeds their tiles in turn through one
      stage ring, so one warpgroup's epilogue runs while the other's main
      loop keeps the tensor cores busy.
    mma_in_flight: ``"pingpong"`` only: keep one ``wgmma`` in flight across
      main-loop steps (wait for the previous step's, not this step's, and
      release its stage one step later), so the tensor cores do not idle
      between steps while the single active warpgroup waits. (The
      cooperative schedule has two warpgroups issuing in turn instead.)
    epi_l2_lookahead: during the epilogue, ask TMA to prefetch into L2 the
      ``W``/slot sub-tile this many sub-tiles beyond the shared-memory ring
      (0: off). The ring bounds the bytes in flight by shared memory; L2
      prefetches do not, so the ring's own loads then hit L2.
    epi_out_slots: 0: the epilogue writes its results back into the ring slot
      it read and stores them from there, so refilling that slot waits until
      the TMA store has read it (one wait per sub-tile, behind every TMA copy
      queued before it). ``n > 0``: results go to a separate ring of ``n``
      store buffers per compute warpgroup, the input slot is refilled as soon
      as the warpgroup has read it, and a store buffer is reused once the
      store issued ``n`` sub-tiles earlier has read it.
    lowering_semantics: ``"Warpgroup"`` (the default: jax >= 0.11's own
      default, layouts inferred for whole warpgroup arrays) or ``"Lane"``
      (the per-thread lowering jax 0.10 defaults to). Same results; a knob
      for the sweep.
    approx_math: Mosaic GPU's ``approx_math``: its approximate ``rsqrt``,
      ``exp``, ``log``, ``tanh``, ``sin``/``cos`` (``.approx.ftz`` PTX
      instructions, a few ulp). Off by default. (Before session 17 it also
      turned divisions by a scalar into products with the reciprocal; the
      kernel now always does that, see ``_eval_for_mosaic``.) Without it the
      epilogue's float32 division and square root are still PTX's
      approximate ones, as Mosaic GPU compiles them: ``div.full.f32`` (2 ulp)
      and ``sqrt.approx.f32`` (jax 0.11.2's PTX of the bf16 AdamW kernel,
      results/h200/mma_live/ptx_bf16.log.gz; in its SASS, MUFU.RCP and
      MUFU.SQRT, results/h200/ncu/), not XLA's correctly rounded ones; the
      tests' tolerances cover the difference. No faster since session 17
      (bf16 AdamW 0.103 against 0.100 ms at T=1024, fp32 0.169 against
      0.155; results/h200/mma_live/).
    epi_read_ahead: software-pipeline the epilogue's shared-memory reads:
      wait for sub-tile ``j + 1``'s ring slot and read its ``W``/states into
      registers before sub-tile ``j``'s arithmetic, so the reads' latency
      overlaps that arithmetic instead of stalling it (the profile puts most
      of the epilogue in the arithmetic's region). Costs one more sub-tile of
      registers (``W`` and states, as stored) per thread. Same results. On
      the H200 it was 3-21% slower in every sweep and raised ptxas's spills
      (fp32 AdamW: 4 bytes stored / 4 loaded -> 40 / 144;
      experiments/results/h200/ptxas_report/), so it stays off.
    no_auto_barriers: lower with ``plgpu.CompilerParams(unsafe_no_auto_barriers=True)``.
      By default Pallas brackets every register -> shared-memory store of a
      warpgroup with two warpgroup barriers (``bar.sync``), conservatively;
      the epilogue's W and state writes make about 11 of them per sub-tile.
      Without them the epilogue relies on what it already guarantees: each
      thread reads and rewrites only its own elements of a ring slot (the
      WGMMA layout both ways), and ``commit_smem`` (a fence and a warpgroup
      barrier, kept) orders every thread's accesses before the TMA store and
      the slot's refill. Float states only: an int8 state's per-row scale is
      read by the four threads of a quad and rewritten, a race without the
      barriers (``supports`` says so). And ``epi_out_slots=0``: a store buffer
      is rewritten after ``wait_smem_to_gmem``, which only the thread that
      issued the TMA store observes. Off by default until the H200 checks it.
    cluster_n: 1, or 2 for clusters of two blocks that work on horizontally
      adjacent tiles (same ``x`` columns, neighbouring ``dy`` columns) in
      lockstep, each ``x`` block multicast by TMA to both: the main loop then
      reads 24 instead of 32 KiB from L2 per 64-token step of a 128x128 tile
      (the traffic per FLOP of a 128x256 tile; jax's Hopper GEMM, faster than
      cuBLAS, uses such tiles). Ping-pong only; the stage ring's "free"
      barriers become cluster barriers (a slot is refilled once both blocks
      have read it). The Mosaic GPU interpreter cannot allocate cluster
      barriers (jax 0.10.2), so this is checked by lowering on a CPU and by
      ``experiments.check_mosaic_gpu --quick`` on a GPU (24/24 on the H200,
      results/h200/mosaic_cluster/). Off by default: it brings the kernel's
      main-loop stream at T=16384 (``skip_compute``) from 0.876 to 0.734 ms
      (cuBLAS 0.719), but not the kernel (bf16 AdamW 4096x4096: 0.795 ->
      0.790 ms at T=16384, 0.226 -> 0.232 at 4096, 0.107 -> 0.114 at 1024;
      no cluster setting tried did better, results/h200/mosaic_cluster_sweep/).
    pipeline_across_tiles: ``"cooperative"`` only: run a block's tiles as one
      pipeline of pipelines (``emit_pipeline_warp_specialized``'s
      ``pipeline_state``: START, STEADY..., STOP), so the memory warpgroup
      loads the next tile's first ``x``/``dy`` stages while the compute
      warpgroups finish this tile's main loop and run its epilogue, instead of
      refilling the pipeline at each tile's start. Applied where every block
      gets at least two tiles and the stages divide the tile's steps (jax's
      condition); elsewhere each tile runs its own pipeline, as when off
      (``_Plan.across_tiles`` says which). Same results. Off by default: not
      timed on the H200 yet.
    epi_direct: the epilogue reads each sub-tile's ``W`` and states from
      device memory straight into registers (in the accumulator's WGMMA
      layout) and writes the results straight back, with no shared-memory
      ring, no TMA copies and no waits for a store to leave shared memory.
      The ring's shared memory goes to the main loop's stages instead, and
      the bytes in flight are bounded by registers, not by ring slots. With
      ``epi_read_ahead`` the next sub-tile's loads are issued before this
      one's arithmetic. Float states only (an int8 state's per-row scales go
      through the ring). Same results. Off by default: slower on the H200
      (AdamW 4096x4096, results/h200/mosaic_direct/): bf16 0.149 ms at best
      against the default's 0.112 at T=1024, 0.272 against 0.230 at T=4096,
      0.903 against 0.785 at T=16384; fp32 0.180 against 0.154 at T=1024,
      0.280 against 0.277 at T=4096. Each sub-tile's loads wait for device
      memory, where the ring's TMA copies overlap the arithmetic.
    epi_shared_ring: ``"pingpong"`` only: the two compute warpgroups' rings
      become one ring of ``2 * epi_slots`` slots (the same shared memory)
      that a block's tiles stream through in order. Each slot is refilled,
      once its store has left it, with the sub-tile ``2 * epi_slots`` ahead,
      which near a tile's end is the next tile's, owned by the other
      warpgroup: so a tile's first sub-tiles are loaded while the previous
      tile's epilogue finishes and its own main loop runs, and the epilogue
      in progress (one at a time in ping-pong) has all slots ahead of it
      instead of half. Needs the sub-tiles per tile to be a multiple of
      ``2 * epi_slots``, no store buffers, no ``epi_direct``, no L2
      lookahead and ``cluster_n=1``. Same results. Off by default: not
      faster on the H200 (AdamW 4096x4096, results/h200/mosaic_shared/): bf16
      0.114 ms against the default's 0.111 at T=1024, 0.224 against 0.223 at
      T=4096, 0.806 against 0.774 at T=16384; fp32 0.161 against 0.156 at
      T=1024 (0.150 with 64x64 sub-tiles in one slot each, which is 0.289
      against 0.275 at T=4096). The epilogue outlasts the main loop, so one
      warpgroup's epilogue waits for slots the other's still holds.
    stage_l2_lookahead: ``"pingpong"`` only: when the memory warpgroup loads
      pipeline step ``s`` into shared memory, it also asks TMA to prefetch the
      ``x``/``dy`` blocks of step ``s + stage_l2_lookahead`` (the next tile's
      near a tile's end) into L2, so those loads hit L2 instead of device
      memory when their stage comes (0: off). Why: Nsight Compute on the H200
      (results/h200/ncu/) found the main loop latency-bound: the producer waits
      for free stages while the consumers wait for loaded ones, i.e. every
      stage is a load in flight, and the x/dy blocks are read from device
      memory 2-3 times their size (the W/state stream evicts them from L2).
      The prefetch adds bytes in flight without shared memory. Hint only;
      skipped under the interpreter (which has no L2). Same results. Off by
      default: 1.4x *slower* on the H200 at T >= 4096 for a lookahead of 2, 4
      or 8 steps, 1.08x at T=1024 (AdamW 4096x4096, bf16 and fp32,
      results/h200/stage_lookahead/), whatever the distance: the prefetches
      seem to take the TMA unit's time as loads do (not measured).
    num_sms: persistent grid size; ``None`` means the device's SM count.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_t: int = 64
  max_concurrent_steps: int = 3
  epi_m: int = 64
  epi_n: int = 32
  epi_slots: int = 2
  grid_minor_dim: str = "n"
  grid_tile_width: int = 8
  memory_registers: int = 40
  l2_prefetch_steps: int = 16
  schedule: str = "cooperative"
  mma_in_flight: bool = False
  epi_l2_lookahead: int = 0
  epi_out_slots: int = 0
  lowering_semantics: str = "Warpgroup"
  approx_math: bool = False
  epi_read_ahead: bool = False
  no_auto_barriers: bool = False
  cluster_n: int = 1
  pipeline_across_tiles: bool = False
  epi_direct: bool = False
  epi_shared_ring: bool = False
  stage_l2_lookahead: int = 0
  num_sms: Optional[int] = None


# ----------------------------------------------------------------------------
# Shape / dtype support.
# ----------------------------------------------------------------------------


def _block_n(cfg: MosaicTileConfig) -> int:
  """Columns of W per block tile: both warpgroups' halves, or one warpgroup's."""
  return cfg.tile_n * (_NUM_COMPUTE_WGS if cfg.schedule == "cooperative" else 1)


def _stages(cfg: MosaicTileConfig, t: int) -> int:
  """Pipeline stages a call with ``t`` tokens runs: jax's pipeline wants no more stages than
  steps; the ping-pong ring runs across tiles and keeps them all."""
  if cfg.schedule == "pingpong":
    return cfg.max_concurrent_steps
  return max(1, min(cfg.max_concurrent_steps, t // cfg.tile_t))


def _across_tiles(cfg: MosaicTileConfig, t: int, k: int, n: int, num_sms: int) -> bool:
  """Whether a block's cooperative tiles run as one pipeline of pipelines
  (``pipeline_across_tiles``): asked for, every one of ``num_sms`` blocks gets two tiles or more
  (the first is START, the last STOP), and the stages divide the steps (jax's condition)."""
  tiles = (k // cfg.tile_m) * (n // _block_n(cfg))
  return (cfg.pipeline_across_tiles and tiles >= 2 * num_sms
          and (t // cfg.tile_t) % _stages(cfg, t) == 0)


def _out_depth(cfg: MosaicTileConfig) -> int:
  """Epilogue store buffers allocated (0: results go back into the ring)."""
  sub_tiles = (cfg.tile_m // cfg.epi_m) * (cfg.tile_n // cfg.epi_n)
  return min(cfg.epi_out_slots, sub_tiles)


def _ring_depth(cfg: MosaicTileConfig) -> int:
  """Epilogue slots actually allocated: no more than there are sub-tiles (none when the
  epilogue reads and writes device memory directly)."""
  if cfg.epi_direct:
    return 0
  sub_tiles = (cfg.tile_m // cfg.epi_m) * (cfg.tile_n // cfg.epi_n)
  return min(cfg.epi_slots, sub_tiles)


def _smem_bytes(cfg: MosaicTileConfig, in_dtype, w_dtype, slot_dtypes, with_norm: bool,
                num_quantized: int = 0) -> int:
  """Shared memory the kernel allocates for ``cfg`` (pipeline + epilogue ring).

  ``slot_dtypes`` are the stored dtypes (int8 for a quantized slot's codes);
  each of the ``num_quantized`` int8 slots adds its per-row scales to the ring.
  """
  ib = jnp.dtype(in_dtype).itemsize
  stage = cfg.tile_t * (cfg.tile_m + _block_n(cfg)) * ib
  per_sub = cfg.epi_m * cfg.epi_n * sum(jnp.dtype(d).itemsize for d in (w_dtype, *slot_dtypes))
  per_sub += num_quantized * cfg.epi_m * 4
  total = cfg.max_concurrent_steps * stage + _NUM_COMPUTE_WGS * _ring_depth(cfg) * per_sub
  total += _NUM_COMPUTE_WGS * _out_depth(cfg) * per_sub
  if with_norm:
    total += _NUM_COMPUTE_WGS * cfg.tile_m * 4
  return total


def _quantized(slot) -> bool:
  return isinstance(slot, numerics.QuantizedArray)


def _stored_dtype(slot):
  """What the kernel streams for a slot: its dtype, or int8 codes for a quantized one."""
  return slot.codes.dtype if _quantized(slot) else slot.dtype


def _swizzle_ok(cols: int, dtype) -> bool:
  """Whether a row of ``cols`` elements gets a real swizzle (>= 32 bytes)."""
  row_bytes = cols * jnp.dtype(dtype).itemsize
  return any(row_bytes % s == 0 for s in (128, 64, 32))


def _config_problem(cfg: MosaicTileConfig) -> Optional[str]:
  """Why ``cfg`` is not a valid tiling, or None."""
  if cfg.tile_m % 64 or cfg.tile_m <= 0:
    return f"tile_m={cfg.tile_m} must be a positive multiple of 64"
  if cfg.tile_n % 64 or not 0 < cfg.tile_n <= 256:
    return f"tile_n={cfg.tile_n} must be a multiple of 64 in [64, 256]"
  if cfg.tile_t % 64 or cfg.tile_t <= 0:
    return f"tile_t={cfg.tile_t} must be a positive multiple of 64"
  if cfg.epi_m % 64 or cfg.tile_m % cfg.epi_m:
    return f"epi_m={cfg.epi_m} must be a multiple of 64 dividing tile_m={cfg.tile_m}"
  if cfg.epi_n % 16 or cfg.tile_n % cfg.epi_n:
    return f"epi_n={cfg.epi_n} must be a multiple of 16 dividing tile_n={cfg.tile_n}"
  if cfg.epi_slots < 1:
    return f"epi_slots={cfg.epi_slots} must be >= 1"
  if cfg.max_concurrent_steps < 1:
    return f"max_concurrent_steps={cfg.max_concurrent_steps} must be >= 1"
  if cfg.grid_minor_dim not in ("m", "n"):
    return f"grid_minor_dim={cfg.grid_minor_dim!r} must be 'm' or 'n'"
  if cfg.grid_tile_width < 1:
    return f"grid_tile_width={cfg.grid_tile_width} must be >= 1"
  if cfg.l2_prefetch_steps < 0:
    return f"l2_prefetch_steps={cfg.l2_prefetch_steps} must be >= 0"
  if cfg.schedule not in ("cooperative", "pingpong"):
    return f"schedule={cfg.schedule!r} must be 'cooperative' or 'pingpong'"
  if cfg.schedule == "pingpong" and cfg.max_concurrent_steps < 2:
    return "schedule='pingpong' needs max_concurrent_steps >= 2"
  if cfg.mma_in_flight and cfg.schedule != "pingpong":
    return "mma_in_flight=True needs schedule='pingpong'"
  if cfg.epi_l2_lookahead < 0:
    return f"epi_l2_lookahead={cfg.epi_l2_lookahead} must be >= 0"
  if cfg.stage_l2_lookahead < 0:
    return f"stage_l2_lookahead={cfg.stage_l2_lookahead} must be >= 0"
  if cfg.stage_l2_lookahead and cfg.schedule != "pingpong":
    return (f"stage_l2_lookahead={cfg.stage_l2_lookahead} needs schedule='pingpong' (the "
            "cooperative schedule's loads are jax's pipeline's)")
  if cfg.epi_out_slots < 0:
    return f"epi_out_slots={cfg.epi_out_slots} must be >= 0"
  if cfg.no_auto_barriers and cfg.epi_out_slots:
    return (f"no_auto_barriers=True needs epi_out_slots=0 (got {cfg.epi_out_slots}): a store "
            "buffer is rewritten after a wait for its TMA store that only the issuing thread "
            "observes, so the other threads need the automatic barrier")
  if cfg.epi_direct and cfg.epi_out_slots:
    return (f"epi_direct=True needs epi_out_slots=0 (got {cfg.epi_out_slots}): results are "
            "written from registers, with no store buffers")
  if cfg.epi_read_ahead and cfg.epi_slots < 2 and not cfg.epi_direct:
    return (f"epi_read_ahead=True needs epi_slots >= 2 (got {cfg.epi_slots}): the next sub-tile "
            "is read from another ring slot while this one's is still in use")
  if cfg.lowering_semantics not in ("Warpgroup", "Lane"):
    return f"lowering_semantics={cfg.lowering_semantics!r} must be 'Warpgroup' or 'Lane'"
  if cfg.cluster_n not in (1, 2):
    return f"cluster_n={cfg.cluster_n} must be 1 or 2"
  if cfg.cluster_n > 1 and cfg.schedule != "pingpong":
    return f"cluster_n={cfg.cluster_n} needs schedule='pingpong'"
  if cfg.pipeline_across_tiles and cfg.schedule != "cooperative":
    return ("pipeline_across_tiles=True needs schedule='cooperative' (the ping-pong ring "
            "already runs across tiles)")
  if cfg.epi_shared_ring:
    sub_tiles = (cfg.tile_m // cfg.epi_m) * (cfg.tile_n // cfg.epi_n)
    shared = _NUM_COMPUTE_WGS * cfg.epi_slots
    if cfg.schedule != "pingpong":
      return ("epi_shared_ring=True needs schedule='pingpong' (the warpgroups take turns at "
              "whole tiles there)")
    if sub_tiles % shared:
      return (f"epi_shared_ring=True needs the {sub_tiles} epilogue sub-tiles of a "
              f"{cfg.tile_m}x{cfg.tile_n} tile to be a multiple of 2 x epi_slots = {shared}: "
              "lower epi_slots or the sub-tile")
    for name in ("epi_out_slots", "epi_l2_lookahead"):
      if getattr(cfg, name):
        return f"epi_shared_ring=True needs {name}=0 (got {getattr(cfg, name)})"
    if cfg.epi_direct:
      return "epi_shared_ring=True needs epi_direct=False (it is a ring)"
    if cfg.cluster_n != 1:
      return f"epi_shared_ring=True needs cluster_n=1 (got {cfg.cluster_n})"
  if cfg.cluster_n > 1 and cfg.num_sms is not None and cfg.num_sms % cfg.cluster_n:
    return f"cluster_n={cfg.cluster_n} needs num_sms={cfg.num_sms} to be a multiple of it"
  return None


def _device_problem() -> Optional[str]:
  """Why the default device cannot run the kernel, or None.

  ``wgmma`` exists on Hopper (sm_90) only: not before, and Blackwell has
  ``tcgen05`` instead. A CPU passes: there the kernel runs interpreted (or is
  only lowered).
  """
  try:
    device = jax.devices()[0]
  except RuntimeError:  # no backend at all
    return None
  if device.platform != "gpu":
    return None
  capability = getattr(device, "compute_capability", None)
  if capability is not None and not str(capability).startswith("9."):
    return f"needs a Hopper GPU (sm_90, wgmma); {device.device_kind} is sm_{capability}"
  return None


def supports(
    x: Any,
    dy: Any,
    w: Any,
    slots: Sequence[Any],
    config: Optional[MosaicTileConfig] = None,
    *,
    compute_grad_sq_norm: bool = False,
) -> tuple[bool, str]:
  """Whether :func:`fused_dw_update_mosaic` can take these operands.

  Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct``), so a
  caller can route to another backend before tracing anything.

  Returns:
    ``(True, "")`` or ``(False, reason)``; the reason names the value and the
    fix.
  """
  cfg = config or MosaicTileConfig()
  if (problem := _config_problem(cfg)) is not None:
    return False, f"invalid MosaicTileConfig: {problem}"
  if (problem := _device_problem()) is not None:
    return False, problem
  if len(x.shape) != 2 or len(dy.shape) != 2:
    return False, f"x and dy must be 2-D [T, K] / [T, N], got {x.shape} and {dy.shape}"
  t, k = x.shape
  t2, n = dy.shape
  if t != t2:
    return False, f"x and dy disagree on T: {x.shape} vs {dy.shape}"
  if len(w.shape) not in (2, 3) or tuple(w.shape[-2:]) != (k, n):
    return False, f"w must be [K, N] = {(k, n)} or stacked [L, K, N], got {w.shape}"
  in_dt = jnp.dtype(x.dtype)
  if in_dt not in _INPUT_DTYPES or jnp.dtype(dy.dtype) != in_dt:
    return False, (
        f"x/dy dtypes {x.dtype}/{dy.dtype}: both must be bfloat16 or both float16 "
        "(wgmma reads the transposed x operand only for 16-bit types)"
    )
  if jnp.dtype(w.dtype) not in _STATE_DTYPES:
    return False, f"w dtype {w.dtype} must be float32, bfloat16 or float16"
  if len(slots) > _MAX_SLOTS:
    return False, f"{len(slots)} optimizer slots: at most {_MAX_SLOTS} are supported"
  for i, s in enumerate(slots):
    if tuple(s.shape) != tuple(w.shape):
      return False, f"slot {i} has shape {s.shape}, expected w's {w.shape}"
    if _quantized(s):
      block = s.codec.block
      if jnp.dtype(s.codes.dtype) != jnp.dtype(jnp.int8):
        return False, f"slot {i} is quantized with {s.codes.dtype} codes; the kernel takes int8"
      if tuple(s.scale.shape) != tuple(w.shape[:-1]) + (n // block,) or n % block:
        return False, (f"slot {i}'s scale has shape {s.scale.shape}, expected "
                       f"{tuple(w.shape[:-1]) + (n // block,)} (N={n} in blocks of {block})")
      if cfg.epi_n != block:
        return False, (f"slot {i} is int8 in blocks of {block} columns: epi_n={cfg.epi_n} must "
                       f"equal the block (one block per sub-tile row)")
      if cfg.epi_out_slots:
        return False, "int8 slots need epi_out_slots=0 (results go back through the ring)"
      if cfg.epi_direct:
        return False, (f"slot {i} is int8: epi_direct=True needs float states (an int8 state's "
                       "per-row scales go through the shared-memory ring)")
      if cfg.no_auto_barriers:
        return False, (f"slot {i} is int8: no_auto_barriers=True needs float states (the four "
                       "threads of a quad read a row's scale and rewrite it, a race without the "
                       "barriers)")
      if cfg.schedule != "pingpong":
        # Under the Mosaic GPU interpreter the cooperative schedule with int8
        # slots never returns (jax 0.10.2; not investigated); ping-pong is the
        # default and is checked.
        return False, f"int8 slots need schedule='pingpong', got {cfg.schedule!r}"
      continue
    if jnp.dtype(s.dtype) not in _STATE_DTYPES:
      return False, f"slot {i} dtype {s.dtype} must be float32, bfloat16 or float16"
  for name, dt in [("w", w.dtype)] + [(f"slot {i}", _stored_dtype(s)) for i, s in enumerate(slots)]:
    if not _swizzle_ok(cfg.epi_n, dt):
      return False, f"epi_n={cfg.epi_n} gives {name} ({dt}) rows under 32 bytes; raise epi_n"
  if t % cfg.tile_t:
    return False, f"T={t} must be a multiple of tile_t={cfg.tile_t}"
  if k % cfg.tile_m:
    return False, f"K={k} must be a multiple of tile_m={cfg.tile_m}"
  block_n = _block_n(cfg) * cfg.cluster_n
  if n % block_n:
    what = ("2 * tile_n" if cfg.schedule == "cooperative" else
            "cluster_n * tile_n" if cfg.cluster_n > 1 else "tile_n")
    return False, f"N={n} must be a multiple of {what} = {block_n}"
  smem = _smem_bytes(cfg, in_dt, w.dtype, [_stored_dtype(s) for s in slots], compute_grad_sq_norm,
                     sum(map(_quantized, slots)))
  if smem > _SMEM_BUDGET_BYTES:
    return False, (
        f"config needs {smem} bytes of shared memory (budget {_SMEM_BUDGET_BYTES}); "
        "lower max_concurrent_steps, epi_slots or the epilogue sub-tile"
    )
  return True, ""


# ----------------------------------------------------------------------------
# The rule, evaluated so that Mosaic GPU can lower it.
# ----------------------------------------------------------------------------


def _portable_sqrt(x: Array) -> Array:
  """``sqrt`` from ``rsqrt``, for a Mosaic GPU that lowers the latter only.

  ``x * rsqrt(x)`` is within a few ulp of ``sqrt(x)`` for finite ``x > 0``
  and NaN for ``x < 0`` or NaN, as ``sqrt``; the ``where`` keeps
  ``sqrt(+-0) == +-0`` and ``sqrt(inf) == inf`` (``0 * inf`` and
  ``inf * 0`` would be NaN). (The first version returned negative inputs
  unchanged, so a rule taking the root of a negative variance gave finite
  garbage where XLA gives NaN.)
  """
  root = x * lax.rsqrt(x)
  return jnp.where(x == 0, x, jnp.where(x == jnp.inf, x, root))


# Primitive -> portable spelling, applied when the rule is evaluated in the
# kernel (see _eval_for_mosaic) for the primitives this jax's Mosaic GPU
# cannot lower. Module-level so experiments can switch it off.
_REWRITES: dict[Any, Callable[..., Array]] = {
    jex_core.primitives.sqrt_p: _portable_sqrt,
}
# Rewrite even primitives Mosaic GPU lowers natively (tests, experiments).
_FORCE_REWRITES = False
# The kernel is lowered with warpgroup semantics on every jax version unless
# MosaicTileConfig.lowering_semantics says otherwise: the default of
# jax >= 0.11 (where `plgpu.CompilerParams()` switched from "Lane" to
# "Warpgroup"), what jax's own Hopper matmul asks for, and what every H200 run
# of this kernel used. Pinned so that jax 0.10.2's cross-lowering tests check
# the code path the GPU runs.
_LOWERING_SEMANTICS = "Warpgroup"
# Mosaic GPU's in-kernel profiler, for experiments.profile_mosaic: None, or
# (profile_space, profile_dir). Each _region below then becomes a timed range
# per warpgroup, written as a Chrome trace to profile_dir after every call.
# Without it the regions are names only (no code).
_PROFILE: Optional[tuple[int, str]] = None
# Diagnostic variants of the epilogue, for experiments.profile_mosaic only: they
# compute something else than the optimizer step, on purpose, to split the
# epilogue's time between its parts. A set of:
#   "skip_reads": W and every state are taken as 1.0 instead of being read from
#     the ring (the ring is still loaded and waited for): the arithmetic and
#     the writes without the shared-memory reads' latency. The result is the
#     rule's step from w = 1, states = 1.
#   "skip_rule": the update is the gradient tile itself and the states are
#     written back as read: the reads and writes without the rule's arithmetic.
#     The result is w + x.T @ dy, states unchanged.
#   "skip_compute": no reads, no arithmetic, and no writes but one: the ring's
#     TMA loads, waits and stores (which copy W and the states back unchanged),
#     i.e. the main loop plus the epilogue's data movement. The one write keeps
#     the main loop's MMAs: the first sub-tile of each row band of the tile
#     (c == 0) gets the gradient tile itself, cast to W's dtype. Without any use
#     of the accumulator ptxas drops every wgmma as dead code (Nsight Compute on
#     the H200 read a tensor pipe idle in this variant before session 17:
#     results/h200/ncu/), so it timed the data movement without the GEMM. The
#     result: W's first epi_n columns of each tile_n block are x.T @ dy in W's
#     dtype, the rest of W and the states unchanged (with epi_out_slots, the
#     other sub-tiles hold whatever the store buffers held).
#   "skip_mainloop": no main loop (the memory warpgroup loads no x/dy stage and the
#     accumulator stays zero) and the whole epilogue: the W/state stream through the
#     ring alone, with nothing beside it. The result is the rule's step from a zero
#     gradient. Ping-pong only.
# Float states only (not int8). Empty (the real kernel) unless an experiment sets it.
DIAGNOSE_VARIANTS = ("skip_reads", "skip_rule", "skip_compute", "skip_mainloop")
_DIAGNOSE: frozenset = frozenset()


@contextlib.contextmanager
def diagnosing(*variants: str):
  """Within it, the kernel is traced as the diagnostic ``variants`` (see ``_DIAGNOSE``; none:
  the real kernel). A jitted function traced before keeps its trace: build a new one."""
  global _DIAGNOSE
  if unknown := set(variants) - set(DIAGNOSE_VARIANTS):
    raise ValueError(f"unknown diagnostic variants {sorted(unknown)}; the variants are "
                     f"{DIAGNOSE_VARIANTS}")
  saved, _DIAGNOSE = _DIAGNOSE, frozenset(variants)
  try:
    yield
  finally:
    _DIAGNOSE = saved


def _region(name: str):
  """A named range of the kernel body (timed only when ``_PROFILE`` is set)."""
  return jax.named_scope(f"fdw_{name}")


def _lowers_natively(prim, semantics: str = _LOWERING_SEMANTICS) -> bool:
  """Whether this jax's Mosaic GPU has a lowering rule for ``prim``
  (``semantics`` lowering, warpgroup threads: what the kernel uses). Private
  API: any surprise counts as "no", which only costs the portable spelling."""
  try:
    from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # pylint: disable=g-import-not-at-top

    for (lowering_sem, primitive_sem), table in mgpu_lowering.mosaic_lowering_rules.items():
      if lowering_sem.name == semantics and primitive_sem.name == "Warpgroup":
        return prim in table
  except Exception:  # pylint: disable=broad-except
    pass
  return False


def _active_rewrites(semantics: str = _LOWERING_SEMANTICS) -> dict[Any, Callable[..., Array]]:
  """The rewrites the kernel applies on this jax (with ``semantics`` lowering)."""
  return {
      prim: fn for prim, fn in _REWRITES.items()
      if _FORCE_REWRITES or not _lowers_natively(prim, semantics)
  }

_INLINED_CALLS = {
    jex_core.primitives.jit_p: "jaxpr",
    jex_core.primitives.closed_call_p: "call_jaxpr",
    jex_core.primitives.custom_jvp_call_p: "call_jaxpr",
}


def _open_jaxpr(j) -> tuple[Any, list]:
  """``(jaxpr, consts)`` of a closed jaxpr (jax 0.10: ``ClosedJaxpr`` wraps a
  ``Jaxpr``; jax 0.11: they are one class and ``.jaxpr`` is the object itself)."""
  inner = getattr(j, "jaxpr", j)
  return inner, list(getattr(j, "consts", ()))


def _eval_for_mosaic(closed_jaxpr, *args, rewrites=None, scalar_reciprocal: bool = True):
  """Evaluates a closed jaxpr with the primitives Mosaic GPU lacks rewritten.

  Nested ``jit`` / ``closed_call`` / ``custom_jvp_call`` bodies (``jnp``
  functions are often jitted) are inlined so their primitives are rewritten
  too. Everything else is bound unchanged (as ``jax.core.eval_jaxpr`` does).
  ``scalar_reciprocal`` (on in the kernel): an array divided by a scalar (Adam's
  bias corrections) becomes the array times the scalar's reciprocal, one
  division per sub-tile instead of one per element. On the GPU that is the
  same number: Mosaic GPU compiles float32 division as ``div.full.f32``, i.e.
  the numerator times ``rcp.approx`` of the divisor, after scaling both when
  the divisor's magnitude is above 2**126 or below 2**-126 (PTX ISA); for a
  divisor between the two the product with the reciprocal (itself ``1 / c`` by
  ``div.full``) is the same value, without the per-element range checks and
  MUFU.RCP (results/h200/mma_live/ptx_bf16.log.gz has the kernel's PTX).
  Outside that range (never a bias correction: those lie in (0, 1]) the two
  can differ. Under the interpreter (exact division) they differ by <= 1 ulp.
  """
  jaxpr, consts = _open_jaxpr(closed_jaxpr)
  rewrites = _active_rewrites() if rewrites is None else rewrites
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    prim = eqn.primitive
    if prim in rewrites:
      outvals = [rewrites[prim](*invals)]
    elif (scalar_reciprocal and prim is lax.div_p and _is_scalar(eqn.invars[1])
          and not _is_scalar(eqn.invars[0])):
      outvals = [invals[0] * (1.0 / invals[1])]
    elif prim in _INLINED_CALLS:
      outvals = _eval_for_mosaic(eqn.params[_INLINED_CALLS[prim]], *invals, rewrites=rewrites,
                                 scalar_reciprocal=scalar_reciprocal)
    else:
      outvals = prim.bind(*invals, **prim.get_bind_params(eqn.params))
      if not prim.multiple_results:
        outvals = [outvals]
    for v, val in zip(eqn.outvars, outvals):
      env[v] = val
  return [read(v) for v in jaxpr.outvars]


def _is_scalar(v) -> bool:
  return tuple(getattr(v.aval, "shape", ())) == ()


@dataclasses.dataclass(frozen=True)
class _TracedRule:
  """``update_fn`` traced once on one epilogue sub-tile."""

  closed_jaxpr: Any
  out_tree: Any
  semantics: str = _LOWERING_SEMANTICS
  scalar_reciprocal: bool = True  # see _eval_for_mosaic

  def __call__(self, g, w, slots, scalar_leaves):
    outs = _eval_for_mosaic(self.closed_jaxpr, g, w, *slots, *scalar_leaves,
                            rewrites=_active_rewrites(self.semantics),
                            scalar_reciprocal=self.scalar_reciprocal)
    return jax.tree.unflatten(self.out_tree, outs)


def _trace_rule(update_fn: UpdateFn, shape, num_slots: int, scalars,
                semantics: str = _LOWERING_SEMANTICS, scalar_reciprocal: bool = True) -> _TracedRule:
  tile = jax.ShapeDtypeStruct(shape, jnp.float32)
  scalar_avals = jax.tree.map(lambda _: jax.ShapeDtypeStruct((), jnp.float32), scalars)
  closed, out_shape = jax.make_jaxpr(update_fn, return_shape=True)(
      tile, tile, (tile,) * num_slots, scalar_avals
  )
  u_shape, new_shapes = out_shape
  if len(new_shapes) != num_slots:
    raise ValueError(f"update_fn returned {len(new_shapes)} slots for {num_slots} given")
  for s in jax.tree.leaves(out_shape):
    if tuple(s.shape) != tuple(shape):
      raise ValueError(f"update_fn must be elementwise: got an output of shape {s.shape}")
  return _TracedRule(closed, jax.tree.structure(out_shape), semantics, scalar_reciprocal)


# ----------------------------------------------------------------------------
# Kernel.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static the kernel body needs."""

  cfg: MosaicTileConfig
  t: int
  k: int
  n: int
  num_slots: int
  num_scalars: int
  stages: int
  num_sms: int
  with_norm: bool
  interpreting: bool  # under the CPU interpreter (see mma_body)
  stochastic: bool = False  # stochastic rounding of the weight (key in layer_gmem[1])
  # Per slot: None (a float array) or the numerics.BlockQuantized codec of an
  # int8 slot (codes + per-row scales of epi_n-column blocks, the scales
  # transposed to [N/blk, L*K]).
  slot_codecs: tuple = ()

  @property
  def codecs(self) -> tuple:
    """One entry per slot: None (float) or its int8 codec."""
    return self.slot_codecs or (None,) * self.num_slots

  @property
  def needs_bits(self) -> bool:
    return self.stochastic or any(c is not None and c.needs_bits for c in self.codecs)

  @property
  def m_iters(self) -> int:
    return self.k // self.cfg.tile_m

  @property
  def n_iters(self) -> int:
    return self.n // _block_n(self.cfg)

  @property
  def t_iters(self) -> int:
    return self.t // self.cfg.tile_t

  @property
  def across_tiles(self) -> bool:
    return _across_tiles(self.cfg, self.t, self.k, self.n, self.num_sms)

  @property
  def sub_tiles(self) -> list[tuple[int, int]]:
    """(row, col) offsets of the epilogue sub-tiles within a warpgroup tile."""
    c = self.cfg
    return [
        (mi * c.epi_m, ni * c.epi_n)
        for mi in range(c.tile_m // c.epi_m)
        for ni in range(c.tile_n // c.epi_n)
    ]


def _mma_transforms(cols: int, dtype) -> tuple:
  """Tiling + swizzle for a shared-memory buffer whose rows hold ``cols`` elements."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _planar_snake(lin: Array, m_iters: int, n_iters: int, minor_dim: str, width: int):
  """Tile coordinates of linear step ``lin``: bands of ``width`` along the minor dim.

  Same order as ``plgpu.planar_snake``, written with static band widths: that
  helper evaluates a remainder band of width 0 when the width divides the
  grid, an integer division by zero that kills the CPU interpreter (SIGFPE).
  """
  minor_size, major_size = (n_iters, m_iters) if minor_dim == "n" else (m_iters, n_iters)
  width = max(1, min(width, minor_size))
  full_bands = minor_size // width
  full_elems = full_bands * width * major_size
  rem_width = minor_size - full_bands * width

  def coords(idx, band_width, first_minor, first_band):
    per_band = jnp.int32(band_width * major_size)
    band = lax.div(idx, per_band)
    within = lax.rem(idx, per_band)
    minor = first_minor + band * band_width + lax.rem(within, jnp.int32(band_width))
    major_in = lax.div(within, jnp.int32(band_width))
    # Every other band walks the major dimension backwards (the "snake").
    odd = lax.rem(band + first_band, 2) == 1
    return minor, jnp.where(odd, major_size - 1 - major_in, major_in)

  minor, major = coords(lin, width, 0, 0)
  if rem_width:
    # A last, narrower band when the width does not divide the minor size.
    tail = jnp.maximum(lin - full_elems, 0)
    t_minor, t_major = coords(tail, rem_width, full_bands * width, full_bands)
    in_tail = lin >= full_elems
    minor = jnp.where(in_tail, t_minor, minor)
    major = jnp.where(in_tail, t_major, major)
  return (major, minor) if minor_dim == "n" else (minor, major)


def _mma(acc_ref, x_smem, dy_smem, xt_smem, interpreting: bool, wait: bool = True) -> None:
  """``acc += x_block.T @ dy_block`` on the tensor cores, awaited unless ``wait=False``."""
  if interpreting:
    # CPU interpreter only: it cannot read a transposed wgmma operand, so the
    # x block goes through registers into a scratch buffer.
    xt_smem[...] = x_smem[...].T
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, xt_smem, dy_smem)
  else:
    # x.T without a copy: the tensor cores read the transposed operand.
    plgpu.wgmma(acc_ref, plgpu.transpose_ref(x_smem, (1, 0)), dy_smem)
  if wait:
    plgpu.wgmma_wait(0)


@dataclasses.dataclass
class _Epilogue:
  """One compute warpgroup's epilogue: TMA ring of W/slot sub-tiles + the rule.

  ``begin`` (before a tile's main loop) refills the first ring slots;
  ``prefetch_l2`` (during it) asks for the whole tile in L2; ``finish``
  (after it) streams the sub-tiles through the ring: rule on the fp32
  accumulator, results stored in place by TMA.
  """

  plan: _Plan
  rule: _TracedRule
  scalars_treedef: Any
  sc_gmem: Any
  w_gmem: Any
  slot_gmems: Sequence[Any]
  norm_gmem: Any
  w_ring: Any
  slot_rings: Sequence[Any]
  ring_ready: Any
  norm_smem: Any
  wg_idx: Any
  layer_gmem: Any = None  # [layer, rounding key bits] (int32)
  out_rings: Optional[Sequence[Any]] = None  # [W, *slots] store buffers, or None

  @property
  def out_depth(self) -> int:
    return _out_depth(self.plan.cfg) if self.out_rings else 0

  @property
  def depth(self) -> int:
    return _ring_depth(self.plan.cfg)

  @property
  def shared(self) -> bool:
    return self.plan.cfg.epi_shared_ring

  @property
  def slots_ahead(self) -> int:
    """Ring slots this warpgroup's sub-tiles cycle through: its own ``depth``, or with
    ``epi_shared_ring`` both warpgroups' (one ring for the block's tiles in order)."""
    return _NUM_COMPUTE_WGS * self.depth if self.shared else self.depth

  def _ring_at(self, slot: int) -> tuple:
    """Index of ring slot ``slot`` in the ``[warpgroup, depth]`` ring arrays."""
    if self.shared:
      return divmod(slot, self.depth)  # the shared ring spans both warpgroups' halves
    return self.wg_idx, slot

  def _ready(self, slot: int, owner=None):
    """The barrier a fill of ``slot`` for a sub-tile of ``owner``'s (default: this
    warpgroup's) tile arrives on. Shared ring: one per (owner, slot), so that each warpgroup
    waits on every completion of the barriers it waits on (Mosaic GPU tracks their parity per
    thread)."""
    owner = self.wg_idx if owner is None else owner
    return self.ring_ready.at[owner * self.slots_ahead + slot]

  def _window(self, j: int, row0, col0):
    r, c = self.plan.sub_tiles[j]
    return (pl.ds(row0 + r, self.plan.cfg.epi_m), pl.ds(col0 + c, self.plan.cfg.epi_n))

  def _scale_window(self, j: int, row0, col0):
    """A quantized slot's scales of sub-tile ``j`` in the transposed [N/blk, L*K] view."""
    r, c = self.plan.sub_tiles[j]
    cfg = self.plan.cfg
    return (lax.div(col0 + c, jnp.int32(cfg.epi_n)), pl.ds(row0 + r, cfg.epi_m))

  def _slot_refs(self, rings, slot: int) -> list:
    """Each optimizer slot's buffer in ring slot ``slot`` of ``rings``: one ref for a float
    slot, ``(codes, scales)`` for an int8 one."""
    a, b = self._ring_at(slot)
    return [tuple(part.at[a, b] for part in ring) if isinstance(ring, tuple)
            else ring.at[a, b] for ring in rings]

  def _slot_copies(self, j: int, row0, col0, s_refs):
    """``(shared-memory buffer, device-memory window)`` of sub-tile ``j`` for every stored
    part of every optimizer slot: the array, or an int8 slot's codes and then its scales."""
    win = self._window(j, row0, col0)
    for ref, gmem in zip(s_refs, self.slot_gmems):
      if isinstance(gmem, tuple):
        yield ref[0], gmem[0].at[win]
        yield ref[1], gmem[1].at[self._scale_window(j, row0, col0)]
      else:
        yield ref, gmem.at[win]

  def _fetch(self, j: int, row0, col0, owner=None) -> None:
    """Loads sub-tile ``j`` of the tile at ``row0, col0`` (``owner``'s: default this
    warpgroup's) into its ring slot."""
    slot = j % self.slots_ahead
    barrier = self._ready(slot, owner)
    plgpu.copy_gmem_to_smem(self.w_gmem.at[self._window(j, row0, col0)],
                            self.w_ring.at[self._ring_at(slot)], barrier)
    for smem, gmem in self._slot_copies(j, row0, col0, self._slot_refs(self.slot_rings, slot)):
      plgpu.copy_gmem_to_smem(gmem, smem, barrier)

  @property
  def _l2_sources(self):
    """The W and slot arrays the L2 prefetches cover (a quantized slot's codes)."""
    return (self.w_gmem, *(g[0] if isinstance(g, tuple) else g for g in self.slot_gmems))

  def begin(self, row0, col0) -> None:
    if self.plan.cfg.epi_direct:
      return  # no ring: the epilogue reads device memory itself
    if self.shared:
      return  # filled by the previous tile's epilogue (the block's first tile: fill_first)
    if not self.out_depth:
      # The previous tile's stores must have left the ring before it is refilled.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for j in range(self.depth):
      self._fetch(j, row0, col0)  # lands while the main loop runs

  def _refill_shared(self, j: int, row0, col0, next_tile) -> None:
    """Shared ring: once sub-tile ``j``'s results have left its slot, load the sub-tile
    ``slots_ahead`` further on in the block's order: this tile's, or the next tile's (for
    the other warpgroup, if there is a next tile)."""
    with _region("epi_store_read"):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    ahead = j + self.slots_ahead
    sub_tiles = len(self.plan.sub_tiles)
    with _region("epi_refill"):
      if ahead < sub_tiles:
        self._fetch(ahead, row0, col0)
      else:
        exists, next_row0, next_col0 = next_tile
        other = _NUM_COMPUTE_WGS - 1 - self.wg_idx
        pl.when(exists)(lambda: self._fetch(ahead - sub_tiles, next_row0, next_col0, owner=other))

  def fill_first(self, row0, col0) -> None:
    """Shared ring: the block's first tile's first sub-tiles (warpgroup 0's), loaded once
    before anything else runs."""
    for j in range(self.slots_ahead):
      self._fetch(j, row0, col0, owner=0)

  def prefetch_l2(self, row0, col0) -> None:
    cfg = self.plan.cfg
    tile = (pl.ds(row0, cfg.tile_m), pl.ds(col0, cfg.tile_n))
    for src in self._l2_sources:
      plgpu.async_prefetch(src.at[tile])

  def _prefetch_sub_l2(self, j: int, row0, col0) -> None:
    """TMA prefetch of sub-tile ``j`` into L2 (no shared memory, no barrier)."""
    if self.plan.interpreting or j >= len(self.plan.sub_tiles):
      return  # the interpreter has no L2 (and no rule for the prefetch)
    win = self._window(j, row0, col0)
    for src in self._l2_sources:
      plgpu.async_prefetch(src.at[win])

  def _element_bits(self, row0, col0):
    """Each element's hashed bits (uint32, WGMMA layout) for the sub-tile at ``row0, col0``
    of the [L*K, N] view: ``element_bits(key, row * N + col)``, the row within its layer."""
    cfg, plan = self.plan.cfg, self.plan
    shape = (cfg.epi_m, cfg.epi_n)
    # The accumulator's layout (the interpreter has no rule for layout casts).
    layout = None if plan.interpreting else plgpu.Layout.WGMMA
    # Rows within the layer: the hash indexes one [K, N] weight, as the reference does.
    local_row0 = row0 - self.layer_gmem[0] * plan.k
    rows = local_row0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
    cols = col0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    # int32 -> uint32 keeps the bits (two's complement). Not a scalar
    # bitcast_convert_type: warpgroup semantics lowers that to a vector
    # ("Scalars must be represented by non-vector types", jax 0.10.2-0.11.2).
    key = self.layer_gmem[1].astype(jnp.uint32)
    return numerics.element_bits(key, numerics.element_index(rows, cols, plan.n))

  def _decode_slot(self, raw, codec):
    """A slot's sub-tile, as read from its ring slot, in float32 (decoded from codes and
    per-row scales if int8)."""
    if codec is None:
      return raw.astype(jnp.float32)
    codes, scale = raw
    return codec.decode_block_rows(codes, scale)  # epi_n == block

  def _write_slot(self, ref, codec, value, bits) -> None:
    """Stores a slot's new float32 sub-tile: cast, or int8 codes + per-row scales."""
    if codec is None:
      ref[...] = store_cast(value, ref.dtype)
      return
    codes_ref, scale_ref = ref
    codes, scale = codec.encode_block_rows(value, bits)  # epi_n == block
    codes_ref[...] = codes.astype(codes_ref.dtype)
    scale_ref[...] = scale

  def finish(self, acc, row0, col0, norm_block, norm_row0, next_tile=None) -> None:
    """The tile's epilogue. ``next_tile``: ``(exists, row0, col0)`` of the block's next tile
    (the other warpgroup's), whose first sub-tiles a shared ring loads from here."""
    plan, cfg = self.plan, self.plan.cfg
    scalars = jax.tree.unflatten(
        self.scalars_treedef, [self.sc_gmem[i] for i in range(plan.num_scalars)]
    )
    scalar_leaves = jax.tree.leaves(scalars)
    row_sums = {}
    ahead = cfg.epi_l2_lookahead
    for j in range(self.depth, self.depth + ahead):
      self._prefetch_sub_l2(j, row0, col0)

    direct = cfg.epi_direct

    def load_direct(gmem, win):
      """A device-memory window read into registers in the accumulator's (WGMMA) layout (the
      interpreter has neither layouts nor a rule for plgpu.load: a plain read there). Not
      "optimized": Mosaic GPU's optimized transfer plans are for shared memory only."""
      if plan.interpreting:
        return gmem[win]
      return plgpu.load(gmem, win, layout=plgpu.Layout.WGMMA, optimized=False)

    def read(j):
      """Waits for sub-tile j's ring slot; its W and states as stored (read, not yet decoded).
      With ``epi_direct``: the sub-tile's device-memory windows, read into registers."""
      if direct:
        win = self._window(j, row0, col0)
        w_ref, s_refs = self.w_gmem.at[win], [g.at[win] for g in self.slot_gmems]
        reads = lambda: (load_direct(self.w_gmem, win),
                         tuple(load_direct(g, win) for g in self.slot_gmems))
      else:
        slot = j % self.slots_ahead
        with _region("epi_wait"):
          plgpu.barrier_wait(self._ready(slot))
        w_ref = self.w_ring.at[self._ring_at(slot)]
        s_refs = self._slot_refs(self.slot_rings, slot)
        # Reads of tiled, swizzled SMEM come back in the WGMMA layout, the
        # accumulator's, so the rule's arithmetic needs no relayout.
        reads = lambda: (w_ref[...], tuple(tuple(p[...] for p in ref) if isinstance(ref, tuple)
                                           else ref[...] for ref in s_refs))
      with _region("epi_load"):
        if "skip_compute" in _DIAGNOSE:  # diagnostic variants (see _DIAGNOSE): no reads
          raw = (None, (None,) * len(s_refs))
        elif "skip_reads" in _DIAGNOSE:
          one = lambda ref: jnp.ones(ref.shape, ref.dtype)
          raw = (one(w_ref), tuple(one(ref) for ref in s_refs))
        else:
          raw = reads()
      return w_ref, s_refs, raw

    ahead_read = read(0) if cfg.epi_read_ahead else None
    for j, (r, c) in enumerate(plan.sub_tiles):
      if cfg.epi_read_ahead:
        w_ref, s_refs, (w_raw, s_raw) = ahead_read
        if j + 1 < len(plan.sub_tiles):
          ahead_read = read(j + 1)  # its latency overlaps this sub-tile's arithmetic
      else:
        w_ref, s_refs, (w_raw, s_raw) = read(j)
      g = acc[r:r + cfg.epi_m, c:c + cfg.epi_n]
      compute = "skip_compute" not in _DIAGNOSE  # False only in a diagnostic variant
      # skip_compute keeps the accumulator live (see _DIAGNOSE) unless there is no main loop.
      keep_mma = not compute and c == 0 and "skip_mainloop" not in _DIAGNOSE
      with _region("epi_decode"):
        if compute:
          w32 = w_raw.astype(jnp.float32)
          s32 = tuple(self._decode_slot(raw, codec) for raw, codec in zip(s_raw, plan.codecs))
      with _region("epi_math"):
        if not compute:
          pass
        elif "skip_rule" in _DIAGNOSE:  # a diagnostic variant (see _DIAGNOSE): no arithmetic
          u, new_slots = g, s32
        else:
          u, new_slots = self.rule(g, w32, s32, scalar_leaves)
      if self.out_depth:
        # Separate store buffers: the one the store of sub-tile
        # j - out_depth used must have been read out (at most out_depth - 1
        # store groups, one per sub-tile, may still be reading).
        out = j % self.out_depth
        with _region("epi_out_wait"):
          plgpu.wait_smem_to_gmem(self.out_depth - 1, wait_read_only=True)
        w_ref = self.out_rings[0].at[self.wg_idx, out]
        s_refs = self._slot_refs(self.out_rings[1:], out)
      with _region("epi_write"):
        bits = self._element_bits(row0 + r, col0 + c) if plan.needs_bits and compute else None
        if keep_mma:
          w_ref[...] = store_cast(g, w_ref.dtype)
        elif not compute:
          pass
        elif plan.stochastic:
          w_ref[...] = numerics.stochastic_round(w32 + u, bits, w_ref.dtype)
        else:
          w_ref[...] = store_cast(w32 + u, w_ref.dtype)
        for i, (ref, new, codec) in enumerate(zip(s_refs, new_slots, plan.codecs) if compute else ()):
          sr = codec is not None and codec.needs_bits
          self._write_slot(ref, codec, new, numerics.value_bits(bits, 1 + i) if sr else None)
        if plan.with_norm:
          part = jnp.sum(g * g, axis=1)
          row_sums[r] = part if r not in row_sums else row_sums[r] + part
      if direct:
        continue  # written to device memory above: nothing to store or refill
      with _region("epi_store"):
        plgpu.commit_smem()
        win = self._window(j, row0, col0)
        plgpu.copy_smem_to_gmem(w_ref, self.w_gmem.at[win], commit_group=False)
        for smem, gmem in self._slot_copies(j, row0, col0, s_refs):
          plgpu.copy_smem_to_gmem(smem, gmem, commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        if ahead:
          self._prefetch_sub_l2(j + self.depth + ahead, row0, col0)
      if self.shared:
        self._refill_shared(j, row0, col0, next_tile)
      elif j + self.depth < len(plan.sub_tiles):
        if not self.out_depth:
          # Refill this slot once its results have been read out.
          with _region("epi_store_read"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        # (With store buffers the slot is free: commit_smem's warpgroup
        # barrier ordered every thread's reads of it before this copy.)
        with _region("epi_refill"):
          self._fetch(j + self.depth, row0, col0)
    if plan.with_norm:
      for r, part in row_sums.items():
        self.norm_smem[self.wg_idx, pl.ds(r, cfg.epi_m)] = part
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          self.norm_smem.at[self.wg_idx],
          self.norm_gmem.at[norm_block, pl.ds(norm_row0, cfg.tile_m)],
      )


def _fused_kernel(
    x_gmem, dy_gmem, sc_gmem, layer_gmem, w_gmem, slot_gmems, norm_gmem,
    *, plan: _Plan, rule: _TracedRule, scalars_treedef, w_dtype, slot_dtypes,
):
  """Body of one block: persistent loop over ``W`` tiles, warp-specialized."""
  cfg = plan.cfg
  epi_shape = (_NUM_COMPUTE_WGS, _ring_depth(cfg), cfg.epi_m, cfg.epi_n)
  in_dtype = x_gmem.dtype
  # Both x and dy blocks hold >= 64 16-bit elements per row: 128-byte swizzle.
  in_transforms = _mma_transforms(64, in_dtype)
  ring = _ring_depth(cfg) > 0  # no ring with epi_direct
  epilogue_allocs = dict(
      w_ring=plgpu.SMEM(epi_shape, w_dtype, transforms=_mma_transforms(cfg.epi_n, w_dtype))
      if ring else None,
      slot_rings=[
          plgpu.SMEM(epi_shape, d, transforms=_mma_transforms(cfg.epi_n, d)) if q is None
          else (plgpu.SMEM(epi_shape, d, transforms=_mma_transforms(cfg.epi_n, d)),
                plgpu.SMEM(epi_shape[:2] + (cfg.epi_m,), jnp.float32))  # codes, scales
          for d, q in zip(slot_dtypes, plan.codecs)
      ] if ring else None,
      # One arrival per TMA copy into a ring slot: W, each slot, each int8 slot's scales.
      ring_ready=plgpu.Barrier(
          num_arrivals=1 + plan.num_slots + sum(c is not None for c in plan.codecs),
          # (a shared ring: one per owner warpgroup and slot of both halves)
          num_barriers=_NUM_COMPUTE_WGS * _ring_depth(cfg) * (
              _NUM_COMPUTE_WGS if cfg.epi_shared_ring else 1),
      ) if ring else None,
      norm_smem=(
          plgpu.SMEM((_NUM_COMPUTE_WGS, cfg.tile_m), jnp.float32) if plan.with_norm else None
      ),
      out_rings=(
          [plgpu.SMEM((_NUM_COMPUTE_WGS, _out_depth(cfg), cfg.epi_m, cfg.epi_n), d,
                      transforms=_mma_transforms(cfg.epi_n, d))
           for d in (w_dtype, *slot_dtypes)]
          if _out_depth(cfg) else None
      ),
      xt_smem=(
          plgpu.SMEM((_NUM_COMPUTE_WGS, cfg.tile_m, cfg.tile_t), in_dtype, transforms=in_transforms)
          if plan.interpreting else None
      ),
  )

  def make_epilogue(w_ring, slot_rings, ring_ready, norm_smem, wg_idx, out_rings) -> _Epilogue:
    return _Epilogue(
        plan, rule, scalars_treedef, sc_gmem, w_gmem, slot_gmems, norm_gmem,
        w_ring, slot_rings, ring_ready, norm_smem, wg_idx, layer_gmem, out_rings,
    )

  # The interpreter has no L2 (and no rule for the prefetch); it is a hint.
  prefetch_step = None
  if cfg.l2_prefetch_steps and not plan.interpreting:
    prefetch_step = max(0, plan.t_iters - cfg.l2_prefetch_steps)

  def tile_origin(m_idx, n_idx, wg_idx):
    """Top-left of this warpgroup's W tile in the [L*K, N] view (layer = row offset)."""
    row0 = layer_gmem[0] * plan.k + m_idx * cfg.tile_m
    col0 = n_idx * _block_n(cfg)
    if cfg.schedule == "cooperative":
      col0 = col0 + wg_idx * cfg.tile_n
    return row0, col0

  body = _cooperative_body if cfg.schedule == "cooperative" else _pingpong_body
  body(
      x_gmem, dy_gmem, plan=plan, in_transforms=in_transforms,
      epilogue_allocs=epilogue_allocs, make_epilogue=make_epilogue,
      prefetch_step=prefetch_step, tile_origin=tile_origin,
  )


def _cooperative_body(
    x_gmem, dy_gmem, *, plan, in_transforms, epilogue_allocs, make_epilogue,
    prefetch_step, tile_origin,
):
  """Both compute warpgroups on one block tile, jax's warp-specialized pipeline."""
  cfg = plan.cfg
  tile_m, tile_n, tile_t = cfg.tile_m, cfg.tile_n, cfg.tile_t
  block_n = _block_n(cfg)

  def get_pipeline(body, compute_context, pipeline_state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(plan.t_iters,),
        memory_registers=cfg.memory_registers,
        in_specs=[
            plgpu.BlockSpec((tile_t, tile_m), lambda t: (t, 0), transforms=in_transforms),
            plgpu.BlockSpec((tile_t, block_n), lambda t: (t, 0), transforms=in_transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=plan.stages,
        compute_context=compute_context,
        pipeline_state=pipeline_state,
    )

  ignore = lambda *_, **__: None  # allocations do not depend on the bodies

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, dy_gmem),
      collective_axes="wg",
      **epilogue_allocs,
  )
  def _scope(pipeline_allocs, w_ring, slot_rings, ring_ready, norm_smem, out_rings, xt_smem):
    wg_idx = lax.axis_index("wg")
    epi = make_epilogue(w_ring, slot_rings, ring_ready, norm_smem, wg_idx, out_rings)

    @plgpu.nd_loop((plan.m_iters * plan.n_iters,), collective_axes="sm")
    def _tile_loop(loop_info):
      (lin_idx,) = loop_info.index
      m_idx, n_idx = _planar_snake(
          lin_idx, plan.m_iters, plan.n_iters, cfg.grid_minor_dim, cfg.grid_tile_width
      )
      row0, col0 = tile_origin(m_idx, n_idx, wg_idx)

      def compute_context(eval_pipeline):
        epi.begin(row0, col0)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          epi.finish(
              acc_ref[...], row0, col0,
              norm_block=n_idx * _NUM_COMPUTE_WGS + wg_idx, norm_row0=m_idx * tile_m,
          )

      def mma_body(idxs, x_smem, dy_smem, acc_ref):
        if prefetch_step is not None:
          pl.when(idxs[0] == prefetch_step)(lambda: epi.prefetch_l2(row0, col0))
        dy_wg = dy_smem.at[:, pl.ds(wg_idx * tile_n, tile_n)]
        _mma(acc_ref, x_smem, dy_wg, xt_smem.at[wg_idx] if plan.interpreting else None,
             plan.interpreting)
        return acc_ref

      state = None
      if plan.across_tiles:  # this block's first tile starts the pipeline, its last stops it
        i, last = loop_info.local_index, loop_info.num_local_steps - 1
        state = jnp.where(i == 0, int(_PIPELINE.START),
                          jnp.where(i == last, int(_PIPELINE.STOP), int(_PIPELINE.STEADY)))
      get_pipeline(mma_body, compute_context, state)(
          x_gmem.at[:, pl.ds(m_idx * tile_m, tile_m)],
          dy_gmem.at[:, pl.ds(n_idx * block_n, block_n)],
          allocations=pipeline_allocs,
      )

    # All results must be in device memory before the kernel exits.
    plgpu.wait_smem_to_gmem(0)


def _compute_registers(memory_registers: int) -> int:
  """Registers per compute thread: what the memory warpgroup leaves, /2, multiple of 8."""
  return min(256, (512 - memory_registers) // _NUM_COMPUTE_WGS) // 8 * 8


def _pingpong_tile(unit, block, i, *, m_iters: int, n_iters: int, num_units: int, cluster: int,
                   minor_dim: str, width: int):
  """``(m_idx, n_idx)`` of the ``i``-th tile of block ``block`` of grid unit ``unit`` (a block,
  or a cluster of ``cluster`` blocks taking adjacent columns of one cluster tile)."""
  m_idx, n_unit = _planar_snake(unit + i * num_units, m_iters, n_iters // cluster, minor_dim, width)
  return m_idx, n_unit * cluster + block


def _pingpong_body(
    x_gmem, dy_gmem, *, plan, in_transforms, epilogue_allocs, make_epilogue,
    prefetch_step, tile_origin,
):
  """Each compute warpgroup owns whole tiles; the memory warpgroup feeds them in turn.

  The block's tiles (every ``num_sms``-th of the snake order) alternate
  between the two compute warpgroups. The memory warpgroup walks the tiles
  in order and streams every step of a tile through one ring of ``stages``
  shared-memory slots before moving to the next tile, so the main loops of
  consecutive tiles (i.e. of the two warpgroups) follow each other while
  each warpgroup's epilogue overlaps the other's main loop.

  Barriers: ``stage_ready[w * S + s]`` (two TMA arrivals) is completed only
  for steps of warpgroup ``w``'s tiles, so each compute warpgroup waits on
  exactly the completions of its own barriers; ``stage_free[s]`` (one
  arrival, from whichever warpgroup read slot ``s``) is waited only by the
  memory warpgroup, which drains the last completions before it exits.
  """
  cfg = plan.cfg
  tile_m, tile_n, tile_t = cfg.tile_m, cfg.tile_n, cfg.tile_t
  stages, t_iters = plan.stages, plan.t_iters
  in_dtype = x_gmem.dtype
  # With clusters (cluster_n=2) the grid walks cluster tiles of cluster_n
  # horizontally adjacent tiles; block c of a cluster takes column c of each.
  cluster = cfg.cluster_n
  num_units = plan.num_sms // cluster
  n_units = plan.n_iters // cluster
  num_tiles = plan.m_iters * n_units
  # A slot of the stage ring is free once every block that reads it has: with
  # clusters, the x block in it was multicast to both, so both must release it.
  free_barrier = (
      plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=1, num_barriers=stages)
      if cluster > 1 else plgpu.Barrier(num_arrivals=1, num_barriers=stages)
  )

  @functools.partial(
      pl.run_scoped,
      x_stages=plgpu.SMEM((stages, tile_t, tile_m), in_dtype, transforms=in_transforms),
      dy_stages=plgpu.SMEM((stages, tile_t, tile_n), in_dtype, transforms=in_transforms),
      stage_ready=plgpu.Barrier(num_arrivals=2, num_barriers=_NUM_COMPUTE_WGS * stages),
      stage_free=free_barrier,
      collective_axes="wg",
      **epilogue_allocs,
  )
  def _scope(x_stages, dy_stages, stage_ready, stage_free,
             w_ring, slot_rings, ring_ready, norm_smem, out_rings, xt_smem):
    wg_idx = lax.axis_index("wg")
    unit_idx = lax.axis_index("sm")  # the block, or with clusters the cluster
    block_in_cluster = lax.axis_index("cluster") if cluster > 1 else 0
    # This block's tiles: unit_idx, unit_idx + num_units, ... of the snake order
    # (the same list, in step, for both blocks of a cluster).
    num_local = lax.div(num_tiles - unit_idx + (num_units - 1), jnp.int32(num_units))

    def tile_coords(i):
      return _pingpong_tile(unit_idx, block_in_cluster, i, m_iters=plan.m_iters, n_iters=plan.n_iters,
                            num_units=num_units, cluster=cluster, minor_dim=cfg.grid_minor_dim,
                            width=cfg.grid_tile_width)

    skip_mainloop = "skip_mainloop" in _DIAGNOSE  # a diagnostic variant: no x/dy stream

    @pl.when(wg_idx == _NUM_COMPUTE_WGS)
    def _memory_warpgroup():
      plgpu.set_max_registers(cfg.memory_registers, action="decrease")
      if skip_mainloop:
        return

      total = num_local * t_iters
      lookahead = 0 if plan.interpreting else cfg.stage_l2_lookahead  # no L2 to fill there

      def prefetch_l2(step):
        """TMA prefetch into L2 of the x/dy blocks of the block's ``step``-th step."""
        m_ahead, n_ahead = tile_coords(lax.div(step, t_iters))
        rows = pl.ds(lax.rem(step, t_iters) * tile_t, tile_t)
        plgpu.async_prefetch(x_gmem.at[rows, pl.ds(m_ahead * tile_m, tile_m)])
        plgpu.async_prefetch(dy_gmem.at[rows, pl.ds(n_ahead * tile_n, tile_n)])

      @pl.loop(0, num_local)
      def _tile(i):
        m_idx, n_idx = tile_coords(i)
        owner = lax.rem(i, _NUM_COMPUTE_WGS)

        @pl.loop(0, t_iters)
        def _step(k):
          step = i * t_iters + k
          slot = lax.rem(step, stages)
          if lookahead:  # before the wait for a free stage: as early as this step allows
            pl.when(step + lookahead < total)(lambda: prefetch_l2(step + lookahead))

          @pl.when(step >= stages)
          def _wait_free():
            # Profiled: how long the producer waits for the consumers to free a stage (long:
            # the main loop or epilogues bound it; short: the loads do).
            with _region("mem_wait_free"):
              plgpu.barrier_wait(stage_free.at[slot])

          ready = stage_ready.at[owner * stages + slot]
          rows = pl.ds(k * tile_t, tile_t)
          # With clusters each block issues its share of the x block, multicast to both.
          plgpu.copy_gmem_to_smem(
              x_gmem.at[rows, pl.ds(m_idx * tile_m, tile_m)], x_stages.at[slot], ready,
              **({"collective_axes": "cluster"} if cluster > 1 else {}),
          )
          plgpu.copy_gmem_to_smem(
              dy_gmem.at[rows, pl.ds(n_idx * tile_n, tile_n)], dy_stages.at[slot], ready
          )

      # Every completion of a barrier must be awaited before it goes away.
      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):
        plgpu.barrier_wait(stage_free.at[lax.rem(step, stages)])

    @pl.when(wg_idx < _NUM_COMPUTE_WGS)
    def _compute_warpgroup():
      plgpu.set_max_registers(_compute_registers(cfg.memory_registers), action="increase")
      epi = make_epilogue(w_ring, slot_rings, ring_ready, norm_smem, wg_idx, out_rings)
      xt = xt_smem.at[wg_idx] if plan.interpreting else None
      # Tiles wg_idx, wg_idx + 2, ... of this block's list.
      num_mine = lax.div(num_local - wg_idx + (_NUM_COMPUTE_WGS - 1), _NUM_COMPUTE_WGS)
      if cfg.epi_shared_ring:  # the block's first tile's sub-tiles; later ones load each other's
        pl.when((wg_idx == 0) & (num_local > 0))(
            lambda: epi.fill_first(*tile_origin(*tile_coords(0), 0)))

      @pl.loop(0, num_mine)
      def _tile(j):
        i = wg_idx + j * _NUM_COMPUTE_WGS
        m_idx, n_idx = tile_coords(i)
        row0, col0 = tile_origin(m_idx, n_idx, wg_idx)
        epi.begin(row0, col0)

        def _main_loop(acc_ref):
          @pl.loop(0, t_iters)
          def _step(k):
            step = i * t_iters + k
            slot = lax.rem(step, stages)
            if prefetch_step is not None:
              pl.when(k == prefetch_step)(lambda: epi.prefetch_l2(row0, col0))
            plgpu.barrier_wait(stage_ready.at[wg_idx * stages + slot])
            if cfg.mma_in_flight:
              # Wait for the previous step's wgmma only, then free its stage.
              _mma(acc_ref, x_stages.at[slot], dy_stages.at[slot], xt, plan.interpreting,
                   wait=False)
              plgpu.wgmma_wait(1)
              prev_slot = lax.rem(step + (stages - 1), stages)
              pl.when(k > 0)(lambda: plgpu.barrier_arrive(stage_free.at[prev_slot]))
            else:
              _mma(acc_ref, x_stages.at[slot], dy_stages.at[slot], xt, plan.interpreting)
              plgpu.barrier_arrive(stage_free.at[slot])

          if cfg.mma_in_flight:
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(stage_free.at[lax.rem(i * t_iters + (t_iters - 1), stages)])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          with _region("mainloop"):
            if not skip_mainloop:  # (else the accumulator stays zero)
              _main_loop(acc_ref)
          next_tile = None
          if cfg.epi_shared_ring:
            next_tile = (i + 1 < num_local, *tile_origin(*tile_coords(i + 1), 1 - wg_idx))
          with _region("epilogue"):
            epi.finish(acc_ref[...], row0, col0, norm_block=n_idx, norm_row0=m_idx * tile_m,
                       next_tile=next_tile)

    # All results must be in device memory before the kernel exits.
    plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------
# Wrapper.
# ----------------------------------------------------------------------------


_PINGPONG = functools.partial(MosaicTileConfig, schedule="pingpong")
# The knobs the H200 sweeps kept (jax 0.11.2, AdamW fp32, all under
# experiments/results/h200/): one wgmma in flight (mosaic_tuned/: T=16384 main
# loop 1.024 -> 0.883 ms against cuBLAS's 0.696) and no L2 prefetch of the
# whole tile. The L2 lookahead of 4 epilogue sub-tiles helps 64x16 sub-tiles
# (mosaic_store_buffers/: T=1024 0.226 -> 0.212 ms) but slows 64x32 ones
# (mosaic_sweep4/, 4 stages: 0.288 / 0.172 / 0.158 ms
# with it at T = 4096 / 1024 / 64, 0.276 / 0.162 / 0.140 without).
_TUNED = dict(l2_prefetch_steps=0, mma_in_flight=True)
# Float states also leave out Pallas's automatic warpgroup barriers around
# shared-memory stores (no_auto_barriers; int8 states cannot): correct on the
# H200 and faster in both sweeps (results/h200/mosaic_barriers/: fp32 AdamW
# 0.275 / 0.155 / 0.139 ms at T = 4096 / 1024 / 64 against 0.275 / 0.160 /
# 0.139; bf16 with 64x64 sub-tiles 0.234 / 0.108 / 0.083 against 0.244 /
# 0.116 / 0.088).
_FLOAT = dict(no_auto_barriers=True, **_TUNED)
_WIDE = dict(epi_n=32, epi_l2_lookahead=0, **_FLOAT)  # 64x32 sub-tiles
_NARROW = dict(epi_n=16, epi_l2_lookahead=4, **_FLOAT)  # 64x16 sub-tiles
# Tried in order by :func:`default_config`: the first that fits the operands'
# dtypes in shared memory (and divides their shape) wins. Ping-pong beat
# cooperative at every setting. 4 stages with 64x32 sub-tiles (224 KiB for
# fp32 AdamW, which the 3 KiB margin admits) is the fastest tiling at every T
# swept (64, 1024, 4096): 0.290 / 0.171 / 0.159 ms with the lookahead
# (mosaic_defaults/), against 0.298 / 0.211 / 0.206 for 4 stages with 64x16
# (the former long-T default) and 0.348 / 0.180 / 0.157 for 3 stages with
# 64x32 (the former short-T one): the main loop wants stages, the epilogue
# few round trips. When the states are larger (3-4 fp32 slots), the order
# says which to give up first: the sub-tile width at long T, a stage at short
# T. Separate store buffers (epi_out_slots), the lane lowering and
# approx_math stay off (mosaic_store_buffers/: no faster; approx_math: 0.153
# vs 0.162 ms at T=1024, but inexact).
_LONG_T_CANDIDATES = (
    _PINGPONG(max_concurrent_steps=4, **_WIDE),
    _PINGPONG(max_concurrent_steps=4, **_NARROW),
)
_SHORT_T_CANDIDATES = (
    _PINGPONG(max_concurrent_steps=4, **_WIDE),
    _PINGPONG(max_concurrent_steps=3, **_WIDE),
    _PINGPONG(max_concurrent_steps=3, **_NARROW),
)
# Then smaller pipelines and tiles, for what the above do not fit or divide.
_OTHER_CANDIDATES = (
    _PINGPONG(max_concurrent_steps=3, epi_n=16, l2_prefetch_steps=0),
    _PINGPONG(max_concurrent_steps=2, epi_n=16, l2_prefetch_steps=0),
    MosaicTileConfig(max_concurrent_steps=3, epi_n=16),
    MosaicTileConfig(max_concurrent_steps=2, epi_n=16),
    _PINGPONG(tile_n=64, max_concurrent_steps=3, epi_n=16, l2_prefetch_steps=0),
    # Shapes with K a multiple of 64 only.
    _PINGPONG(tile_m=64, max_concurrent_steps=4, epi_n=16, l2_prefetch_steps=0),
    _PINGPONG(tile_m=64, tile_n=64, max_concurrent_steps=4, epi_n=16, l2_prefetch_steps=0),
)
# T at or below this counts as short (the epilogue, not the main loop, bounds).
_SHORT_T = 2048
# Tried first when the weight and every state take 2 bytes (bf16): the bf16
# sweep (AdamW, mosaic_bf16_sweep/) had 5 stages with 64x32 sub-tiles fastest
# at T=4096 (0.228 ms, against 0.248 for the 4 stages above) and 4 stages with
# 64x64 sub-tiles fastest at T = 1024 and 64 (0.112 / 0.083 ms, against
# 0.120 / 0.114). Neither fits float32 AdamW's shared memory; Lion's float32
# state would fit 5 stages, never timed, so these stay 2-byte only.
_TWO_BYTE_LONG_T = (_PINGPONG(max_concurrent_steps=5, **_WIDE),)
_TWO_BYTE_SHORT_T = (_PINGPONG(max_concurrent_steps=4, epi_n=64, epi_l2_lookahead=0, **_FLOAT),)
# Tried first (float states) when 128x128 tiles would give the SMs at most 1.5
# tiles each: with one tile per SM, no next tile's main loop hides the
# epilogue. 64-row tiles were faster for every projection of qwen3-0.6b and
# the smaller ones of qwen3-1.7b on the H200 (bf16 AdamW at T=1024, 16 calls
# per dispatch, results/h200/mosaic_small_shapes/: 1024x1024 0.019 -> 0.013 ms,
# 1024x2048 0.020 -> 0.017, 1024x3072 0.028 -> 0.025; 64 to 192 tiles of
# 128x128) and slower from 256 tiles (2048x2048 0.028 -> 0.029, 2048x6144
# 0.079 -> 0.085; 4096x4096 at T=4096 +26%, mosaic_sweep_read_ahead/).
_SMALL_GRID_WAVES = 1.5
_SMALL_GRID = tuple(_PINGPONG(tile_m=64, max_concurrent_steps=st, **_WIDE) for st in (6, 5, 4))
# int8 slots: one 64-column block per sub-tile row (epi_n = the block). Not
# yet timed on a GPU: the main loop's 4 stages first, as for float states.
_INT8_CANDIDATES = (
    _PINGPONG(max_concurrent_steps=4, epi_n=64, epi_l2_lookahead=0, **_TUNED),
    _PINGPONG(max_concurrent_steps=3, epi_n=64, epi_l2_lookahead=0, **_TUNED),
    _PINGPONG(max_concurrent_steps=2, epi_n=64, epi_l2_lookahead=0, **_TUNED),
    _PINGPONG(tile_m=64, max_concurrent_steps=3, epi_n=64, epi_l2_lookahead=0, **_TUNED),
)


def _default_candidates(t: int, quantized_block: Optional[int] = None,
                        two_byte: bool = False, small_grid: bool = False) -> tuple[MosaicTileConfig, ...]:
  if quantized_block is not None:
    return tuple(dataclasses.replace(c, epi_n=quantized_block) for c in _INT8_CANDIDATES)
  first = _SHORT_T_CANDIDATES if t <= _SHORT_T else _LONG_T_CANDIDATES
  second = _LONG_T_CANDIDATES if t <= _SHORT_T else _SHORT_T_CANDIDATES
  if two_byte:
    first = (_TWO_BYTE_SHORT_T if t <= _SHORT_T else _TWO_BYTE_LONG_T) + first
  if small_grid:
    first = _SMALL_GRID + first
  return tuple(dict.fromkeys(first + second + _OTHER_CANDIDATES))  # in order, once each


def default_config(
    x: Any, dy: Any, w: Any, slots: Sequence[Any], *, compute_grad_sq_norm: bool = False,
    num_sms: Optional[int] = None,
) -> MosaicTileConfig:
  """The first default candidate :func:`supports` accepts for these operands.

  Candidates depend on ``T`` (``x.shape[0]``); for 2-byte weights and states
  they put the bf16 sweep's best first (see ``_LONG_T_CANDIDATES`` and
  ``_TWO_BYTE_LONG_T``), and for weights with few 128x128 tiles per SM,
  64-row tiles (``_SMALL_GRID``).
  Falls back to the last candidate, the one with the loosest shape
  requirements (whose ``supports`` reason then names what no candidate
  accepts, e.g. ``N=100 must be a multiple of tile_n = 64``), when none fits.
  """
  t = x.shape[0] if len(x.shape) == 2 else 0
  blocks = {s.codec.block for s in slots if _quantized(s)}
  two_byte = all(jnp.dtype(_stored_dtype(a)).itemsize <= 2 for a in (w, *slots))
  k, n = w.shape[-2:]
  sms = _num_sms(MosaicTileConfig(num_sms=num_sms))
  small_grid = -(-k // 128) * -(-n // 128) <= _SMALL_GRID_WAVES * sms
  candidates = _default_candidates(t, min(blocks) if blocks else None, two_byte, small_grid)
  for cand in candidates:
    cand = dataclasses.replace(cand, num_sms=num_sms)
    if supports(x, dy, w, slots, cand, compute_grad_sq_norm=compute_grad_sq_norm)[0]:
      return cand
  return dataclasses.replace(candidates[-1], num_sms=num_sms)


def interpreter_problem(weight_codec: Optional[numerics.Codec], slots: Sequence[Any]) -> Optional[str]:
  """Why the Mosaic GPU interpreter cannot run this call, or None: stochastic rounding (of
  the weight, or an int8 slot's map). Seen with jax 0.10.2: the interpreter never returns
  (no error) from an epilogue with the hash's iota or float32 -> uint32 bitcasts."""
  if getattr(weight_codec, "needs_bits", False):
    return (f"the Mosaic GPU interpreter cannot run the {type(weight_codec).__name__} write-back "
            "of the weight (stochastic rounding hangs it)")
  for i, s in enumerate(slots):
    if _quantized(s) and s.codec.needs_bits:
      return (f"the Mosaic GPU interpreter cannot run the stochastically rounded int8 map of "
              f"optimizer slot {i} (stochastic rounding hangs it)")
  return None


def _interpret_params(interpret: Any):
  """``InterpretGPUParams`` for ``interpret=True`` (public in jax 0.11.2, private before)."""
  if interpret is False or interpret is None:
    return None
  if interpret is not True:
    return interpret  # already a params object
  params_cls = getattr(plgpu, "InterpretGPUParams", None)
  if params_cls is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params_cls
  return params_cls()


def _num_sms(cfg: MosaicTileConfig) -> int:
  if cfg.num_sms is not None:
    return cfg.num_sms
  device = jax.devices()[0]
  count = getattr(device, "core_count", None)
  return count if device.platform == "gpu" and count else _DEFAULT_NUM_SMS


def fused_dw_update_mosaic(
    x: Array,
    dy: Array,
    w: Array,
    slots: Sequence[Array],
    scalars: Any,
    update_fn: UpdateFn,
    *,
    layer: Optional[Array] = None,
    config: Optional[MosaicTileConfig] = None,
    compute_grad_sq_norm: bool = False,
    interpret: Union[bool, Any] = False,
    weight_codec: Optional[numerics.Codec] = None,
    seed: Optional[Any] = None,
    step: Optional[Any] = None,
):
  """Fused ``dW = x.T @ dy`` + optimizer update on one Hopper GPU (Mosaic GPU).

  Same contract and results as
  :func:`pallas_kernels.fused_dw.fused_dw_update_reference`.

  Args:
    x: [T, K] layer input, bfloat16 or float16.
    dy: [T, N] output cotangent, same dtype as ``x``.
    w: [K, N] weight, or [L, K, N] stacked weights with ``layer`` given;
      float32, bfloat16 or float16.
    slots: optimizer-state arrays shaped like ``w`` (each its own float dtype),
      or :class:`~pallas_kernels.numerics.QuantizedArray` int8 states (blocks
      of ``config.epi_n`` values along N, ping-pong schedule; their scales
      pass through the kernel transposed, a scale-sized copy each way).
    scalars: pytree of float32 0-d arrays passed to ``update_fn``.
    update_fn: the elementwise rule ``(g, w, slots, scalars) -> (u, new_slots)``.
    layer: int32 scalar index into the leading axis of stacked ``w``/slots.
    config: tiling; ``None`` picks :func:`default_config` for these operands.
    compute_grad_sq_norm: also return ``sum(dW**2)`` in float32 (from
      per-row partial sums the kernel writes, summed by XLA).
    interpret: run on CPU under the Mosaic GPU interpreter (``True`` or an
      ``InterpretGPUParams``).
    weight_codec: the weight's write-back: ``None``/``numerics.Cast()``
      (round to nearest) or ``numerics.StochasticRound()`` (bfloat16 ``w``),
      as in :func:`pallas_kernels.fused_dw.fused_dw_update`.
    seed, step: the stochastic-rounding seed and step (needed with it).

  Returns:
    ``(new_w, new_slots, grad_sq_norm)``; ``grad_sq_norm`` is ``None`` unless
    requested. ``w`` and the slots are updated in place when donated.

  Raises:
    ValueError: for operands :func:`supports` rejects (the message says why).
  """
  slots = tuple(slots)
  cfg = config or default_config(x, dy, w, slots, compute_grad_sq_norm=compute_grad_sq_norm)
  ok, reason = supports(x, dy, w, slots, cfg, compute_grad_sq_norm=compute_grad_sq_norm)
  if not ok:
    raise ValueError(f"fused_dw_update_mosaic: {reason}")
  if cfg.cluster_n > 1 and _interpret_params(interpret) is not None:
    raise ValueError(f"fused_dw_update_mosaic: cluster_n={cfg.cluster_n} cannot run under the Mosaic "
                     "GPU interpreter (it cannot allocate cluster barriers); use cluster_n=1 there")
  stacked = w.ndim == 3
  if stacked and layer is None:
    raise ValueError(f"w has shape {w.shape} (stacked): pass layer=")
  if not stacked and layer is not None:
    raise ValueError(f"layer={layer!r} given but w has shape {w.shape} (not stacked)")

  for leaf in jax.tree.leaves(scalars):
    if jnp.ndim(leaf) != 0:
      raise ValueError(f"scalars must be 0-d, got a leaf of shape {jnp.shape(leaf)}")
  if unknown := set(_DIAGNOSE) - set(DIAGNOSE_VARIANTS):
    raise ValueError(f"fused_dw_mosaic._DIAGNOSE has {sorted(unknown)}; the variants are "
                     f"{DIAGNOSE_VARIANTS}")
  if _DIAGNOSE and any(map(_quantized, slots)):
    raise ValueError(f"fused_dw_mosaic._DIAGNOSE={sorted(_DIAGNOSE)} takes float states only, "
                     "not int8 ones")
  if "skip_mainloop" in _DIAGNOSE and cfg.schedule != "pingpong":
    raise ValueError(f"fused_dw_mosaic._DIAGNOSE=['skip_mainloop'] needs schedule='pingpong' "
                     f"(got {cfg.schedule!r}): jax's pipeline runs the cooperative main loop")
  if "skip_compute" in _DIAGNOSE and cfg.epi_direct:
    # On the H200 this pair timed T=16384 at 0.050 ms, 14x cuBLAS's GEMM: with no epilogue
    # at all, the main loop is not what runs (results/h200/mosaic_direct/).
    raise ValueError("fused_dw_mosaic._DIAGNOSE=['skip_compute'] with epi_direct=True times no "
                     "main loop (nothing is read or written); use the ring (epi_direct=False)")
  codec = weight_codec or numerics.Cast()
  if codec.needs_bits and not isinstance(codec, numerics.StochasticRound):
    raise ValueError(f"weight_codec={codec!r}: the Mosaic kernel takes Cast or StochasticRound")
  if _interpret_params(interpret) is not None and (why := interpreter_problem(codec, slots)):
    raise NotImplementedError(
        f"{why}; it is checked by lowering for cuda and on the GPU (experiments.check_mosaic_gpu). "
        "Use backend='interpret' or 'xla' on a CPU."
    )
  if isinstance(codec, numerics.StochasticRound):
    numerics.stochastic_round(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.uint32), w.dtype)  # dtype check
  static = dict(update_fn=update_fn, cfg=cfg, compute_grad_sq_norm=compute_grad_sq_norm,
                interpret=interpret, codec=codec, env=_trace_env())
  try:
    hash(tuple(static.values()))
  except TypeError:  # e.g. a rule holding an array hyperparameter: lowered at every call site
    return _launch(x, dy, w, slots, scalars, layer, seed, step, **static)
  return _launch_cached(x, dy, w, slots, scalars, layer, seed, step, **static)


def _trace_env() -> tuple:
  """The module state a trace of :func:`_launch` reads, part of its cache key, so that
  experiments and tests that switch it (the profiler, forced rewrites) get a fresh trace."""
  return (_PROFILE, _FORCE_REWRITES, _DIAGNOSE, _lowers_natively, plgpu.CompilerParams)


def _launch(x, dy, w, slots, scalars, layer, seed, step, *, update_fn, cfg, compute_grad_sq_norm,
            interpret, codec, env):
  """The kernel call, for operands :func:`fused_dw_update_mosaic` has checked."""
  del env  # only a cache key
  stacked = w.ndim == 3
  t, k = x.shape
  n = dy.shape[1]
  num_layers = w.shape[0] if stacked else 1
  leaves, treedef = jax.tree.flatten(scalars)
  sc_vec = jnp.stack([jnp.asarray(v, jnp.float32) for v in leaves] or [jnp.zeros((), jnp.float32)])
  # Clamped like dynamic_index_in_dim (and like the reference and the Triton
  # kernel): an out-of-range layer must not address rows outside the stack.
  layer_i32 = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1) if stacked else jnp.int32(0)
  stochastic = isinstance(codec, numerics.StochasticRound)
  slot_codecs = tuple(s.codec if _quantized(s) else None for s in slots)
  # The hash key of (seed, step, layer), computed once here; the kernel reads
  # it next to the layer and hashes it with each element's index.
  seed_i32, step_i32 = _rounding_ints((codec, *(s.codec for s in slots if _quantized(s))), seed, step)
  key = numerics.rounding_key(seed_i32, step_i32, layer_i32)
  layer_vec = jnp.stack([layer_i32, jax.lax.bitcast_convert_type(key, jnp.int32)])

  plan = _Plan(
      cfg=cfg, t=t, k=k, n=n, num_slots=len(slots), num_scalars=len(leaves),
      stages=_stages(cfg, t), num_sms=_num_sms(cfg), with_norm=compute_grad_sq_norm,
      interpreting=_interpret_params(interpret) is not None, stochastic=stochastic,
      slot_codecs=slot_codecs,
  )
  rule = _trace_rule(update_fn, (cfg.epi_m, cfg.epi_n), len(slots), scalars,
                     cfg.lowering_semantics)
  # The kernel addresses one 2-D [L*K, N] array; the layer is a row offset.
  flat = lambda a: a.reshape(num_layers * k, n)
  # One row of per-W-row partial sums per warpgroup column block; each entry
  # is written exactly once, and the NaN start makes a missed one loud.
  norm_init = (
      jnp.full((n // cfg.tile_n, k), jnp.nan, jnp.float32) if compute_grad_sq_norm else None
  )
  clusters = (
      dict(cluster=(cfg.cluster_n,), cluster_names=("cluster",)) if cfg.cluster_n > 1 else {}
  )
  mesh = plgpu.Mesh(
      grid=(plan.num_sms // cfg.cluster_n,), grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1, thread_name="wg", **clusters,
  )
  core_map_kwargs = {}
  if (params := _interpret_params(interpret)) is not None:
    core_map_kwargs["interpret"] = params
  kernel = functools.partial(
      _fused_kernel, plan=plan, rule=rule, scalars_treedef=treedef,
      w_dtype=w.dtype, slot_dtypes=tuple(_stored_dtype(s) for s in slots),
  )

  def stateful(refs):
    x_ref, dy_ref, sc_ref, layer_ref, w_ref, slot_refs, norm_ref = refs

    @pl.core_map(
        mesh,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=getattr(plgpu.LoweringSemantics, cfg.lowering_semantics),
            approx_math=cfg.approx_math,
            **({"unsafe_no_auto_barriers": True} if cfg.no_auto_barriers else {}),
            **({} if _PROFILE is None else dict(profile_space=_PROFILE[0], profile_dir=_PROFILE[1])),
        ),
        name="fused_dw_update_mosaic",
        **core_map_kwargs,
    )
    def _():
      kernel(x_ref, dy_ref, sc_ref, layer_ref, w_ref, tuple(slot_refs), norm_ref)

  def kernel_view(s):
    if not _quantized(s):
      return flat(s)
    # Scales transposed, [N/blk, L*K]: a sub-tile's 64 row scales are then one
    # contiguous TMA box (a [64, 1] column is 4 bytes wide; TMA needs 16).
    return (flat(s.codes), s.scale.reshape(num_layers * k, n // s.codec.block).T)

  def from_kernel_view(new, old):
    if not _quantized(old):
      return new.reshape(old.shape)
    codes, scale_t = new
    return numerics.QuantizedArray(codes.reshape(old.codes.shape), scale_t.T.reshape(old.scale.shape),
                                   old.codec)

  outs = pl.run_state(stateful)(
      (x, dy, sc_vec, layer_vec, flat(w), tuple(kernel_view(s) for s in slots), norm_init)
  )
  _, _, _, _, new_w, new_slots, norm_parts = outs
  new_w = new_w.reshape(w.shape)
  new_slots = tuple(from_kernel_view(s, old) for s, old in zip(new_slots, slots))
  norm = jnp.sum(norm_parts) if compute_grad_sq_norm else None
  return new_w, new_slots, norm


# One trace (and one lowering per jit module) for every call with the same
# shapes and static arguments: an unrolled model calls the kernel once per
# layer, and lowering one call for Mosaic GPU takes about 1.7 s on the host
# (qwen3-0.6b unrolled: 325 s for 196 calls, experiments/results/cpu/
# unrolled_lowering/), while calls of one jitted function lower once into a
# module and are then called.
_launch_cached = jax.jit(
    _launch, static_argnames=("update_fn", "cfg", "compute_grad_sq_norm", "interpret", "codec", "env"))
