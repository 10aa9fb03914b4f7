"""Tiling of the Mosaic GPU kernel: the config, the one table of defaults, and what it supports.

Everything here reads shapes and dtypes only (arrays or ``jax.ShapeDtypeStruct``), so a
caller can pick a backend before tracing anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import contract, numerics
from pallas_kernels.mosaic import common

# A Hopper block may use 227 KiB of shared memory; Mosaic GPU's own total (barriers included,
# checked while lowering) exceeds smem_bytes' count by about 2.1 KiB, hence a 3 KiB margin.
# fp32 AdamW's default (exactly 224 KiB here) lowers and runs on the H200; the tests lower every
# default in the margin, so a config Mosaic refuses fails a test, not a user's compile.
SMEM_BUDGET_BYTES = 224 * 1024
MOSAIC_SMEM_LIMIT = 227 * 1024
NUM_COMPUTE_WGS = 2
# Registers a compute thread needs beside its float32 accumulator (a 128-thread warpgroup holds a
# tile_m x tile_n accumulator in tile_m * tile_n / 128 registers a thread).
EPILOGUE_REGISTERS = 40
_REGISTERS = common.compute_registers(NUM_COMPUTE_WGS)
MAX_SLOTS = 4
DEFAULT_NUM_SMS = 132  # the grid when the device says nothing (interpreter, cross-lowering): H200
_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicTileConfig:
  """Static tiling of the ping-pong kernel (docs/mosaic_kernel.md); the defaults are fp32 AdamW's.

  Attributes:
    tile_m, tile_n: rows / columns of ``W`` per tile, each compute warpgroup owning whole tiles;
      multiples of 64, ``tile_n`` at most 256.
    tile_t: tokens per pipeline step (wgmma ``K``); a multiple of 64.
    max_concurrent_steps: stages of ``x``/``dy`` blocks in the shared ring (at least 2).
    epi_m, epi_n: epilogue sub-tile, multiples of 64 / 16 dividing the tile; ``epi_n`` is the
      quantization block of int8 states. int8 states, and float states at T <= SHORT_T
      without ``epi_l2_lookahead``, run the sub-tiles as a loop over one copy of their code
      (docs/mosaic_kernel.md); the others unroll them.
    epi_slots: depth of each compute warpgroup's epilogue ring.
    epi_rotate: the epilogue loop carries the tile's gradient slices and works on the first,
      handing the rest down one place an iteration, instead of picking a slice beside the whole
      live accumulator (int8 states on 128x128 tiles: no register spills; docs/mosaic_kernel.md).
    epi_l2_lookahead: TMA-prefetch into L2 the sub-tile this many beyond the ring (0: off; float
      states only; it keeps the epilogue unrolled).
    mma_in_flight: keep one ``wgmma`` in flight across main-loop steps.
    no_auto_barriers: lower without Pallas's warpgroup barriers around register -> shared-memory
      stores: each thread rewrites only its own ring elements and ``commit_smem`` orders them
      before the TMA store (int8 row scales: docs/mosaic_kernel.md, "int8 state blocks").
    grid_tile_width: the persistent loop walks bands of this many tiles along ``N``.
    num_sms: persistent grid size; ``None`` means the device's SM count.
    fast_math: the rule's ``sqrt`` and tile / tile divisions as PTX's ``sqrt.approx.ftz`` and
      ``div.approx.ftz`` (no denormal range handling: a denormal operand or result counts as
      zero); ``False`` keeps Mosaic GPU's ``sqrt.approx`` / ``div.full`` (docs/mosaic_kernel.md,
      "The rule, from its jaxpr"). The interpreter always runs the rule as written.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_t: int = 64
  max_concurrent_steps: int = 4
  epi_m: int = 64
  epi_n: int = 32
  epi_slots: int = 2
  epi_l2_lookahead: int = 0
  mma_in_flight: bool = True
  no_auto_barriers: bool = True
  grid_tile_width: int = 8
  num_sms: Optional[int] = None
  fast_math: bool = True
  epi_rotate: bool = False


_Cfg = MosaicTileConfig
# Fallback tilings: Pallas's store barriers and one wgmma at a time (the shipped schedule is up to
# 1.25x slower on them: docs/mosaic_kernel.md, "The defaults, and why").
_PLAIN = dict(mma_in_flight=False, no_auto_barriers=False)
SHORT_T = 2048  # T at or below this counts as short (the epilogue, not the main loop, bounds)
# THE default table: default_config takes the first row whose conditions the call meets and
# that ``supports`` accepts. Conditions: "float" (no int8 state) or "int8"; "short" / "long" T;
# "two_byte" (weight and every state in 2 bytes); "two_byte_w" (the weight in 2 bytes);
# "small_grid" / "few_tiles" (128x128 tiles give the SMs at most 1.5 / 2.5 each). The
# measurements behind each row:
# docs/mosaic_kernel.md, "The defaults, and why".
_DEFAULTS: tuple[tuple[frozenset, MosaicTileConfig], ...] = tuple(
    (frozenset(when.split()), cfg) for when, cfg in (
        ("float small_grid", _Cfg(tile_m=64, max_concurrent_steps=6)),
        ("float small_grid", _Cfg(tile_m=64, max_concurrent_steps=5)),
        ("float small_grid", _Cfg(tile_m=64)),
        ("float two_byte short", _Cfg(epi_n=64)),
        ("float two_byte long", _Cfg(max_concurrent_steps=5)),
        ("float", _Cfg()),
        ("float long", _Cfg(epi_n=16, epi_l2_lookahead=4)),
        ("float", _Cfg(max_concurrent_steps=3)),
        ("float", _Cfg(max_concurrent_steps=3, epi_n=16, epi_l2_lookahead=4)),
        ("float short", _Cfg(epi_n=16, epi_l2_lookahead=4)),
        # Smaller pipelines and tiles, for what the above do not fit or divide.
        ("float", _Cfg(max_concurrent_steps=3, epi_n=16, **_PLAIN)),
        ("float", _Cfg(max_concurrent_steps=2, epi_n=16, **_PLAIN)),
        ("float", _Cfg(tile_n=64, max_concurrent_steps=3, epi_n=16, **_PLAIN)),
        ("float", _Cfg(tile_m=64, epi_n=16, **_PLAIN)),  # K a multiple of 64 only
        ("float", _Cfg(tile_m=64, tile_n=64, epi_n=16, **_PLAIN)),
        # int8: epi_n is replaced by the quantization block (one block per sub-tile row).
        # 128x128 tiles, 4 stages and one ring slot: at long T for every weight, at short T
        # under a 2-byte weight (H100: 0.84-0.97x 3 stages with half the accumulator staged in
        # shared memory at T=4096, 0.86-0.88x at 16384; 0.90-1.00x the 128x64 tiles at T=1024
        # under a bf16 weight, where an fp32 weight lost, 1.08-1.25x).
        # At long T the loop carries the accumulator's slices (epi_rotate: no spills; H100,
        # T=4096, the update after its dX product, cold states, side by side with the pick:
        # SR bf16 weight 0.92-0.98x, fp32 weight 0.81-1.00x; at T=1024 1.02-1.04x).
        ("int8 long", _Cfg(epi_n=64, epi_slots=1, epi_rotate=True)),
        # Few tiles (at most 2.5 of 128x128 per SM: the k/v projections) at short T under a
        # 2-byte weight: 64x128 tiles, 6 stages, so that each warpgroup has tiles enough for one's
        # epilogue to overlap the other's main loop (H100, T=512-2048, the update after its dX
        # product: 0.60-1.02x the 128x128 tiles' time; with more tiles 0.95-1.15x, at T=4096
        # 1.13x: docs/mosaic_kernel.md).
        ("int8 short two_byte_w few_tiles", _Cfg(tile_m=64, epi_n=64, max_concurrent_steps=6)),
        ("int8 short two_byte_w", _Cfg(epi_n=64, epi_slots=1)),
        ("int8 long", _Cfg(max_concurrent_steps=3, epi_n=64)),
        ("int8", _Cfg(tile_n=64, epi_n=64)),
        ("int8", _Cfg(tile_n=64, max_concurrent_steps=3, epi_n=64)),
        ("int8", _Cfg(tile_n=64, max_concurrent_steps=2, epi_n=64)),
        ("int8", _Cfg(tile_m=64, tile_n=64, max_concurrent_steps=3, epi_n=64)),
        ("int8", _Cfg(max_concurrent_steps=3, epi_n=64)),  # blocks of 128
    ))
_SMALL_GRID_WAVES = 1.5
_FEW_TILES_WAVES = 2.5


def quantized(slot) -> bool:
  """Whether ``slot`` is an int8 state (codes + per-block scales)."""
  return isinstance(slot, numerics.QuantizedArray)


def stored_dtype(slot):
  """What the kernel streams for a slot: its dtype, or int8 codes for a quantized one."""
  return slot.codes.dtype if quantized(slot) else slot.dtype


def ring_depth(cfg: MosaicTileConfig) -> int:
  """Epilogue ring slots allocated: no more than a tile has sub-tiles."""
  return min(cfg.epi_slots, (cfg.tile_m // cfg.epi_m) * (cfg.tile_n // cfg.epi_n))


def smem_bytes(cfg: MosaicTileConfig, in_dtype, w_dtype, slot_dtypes, with_norm: bool,
               num_quantized: int = 0) -> int:
  """Shared memory the kernel allocates for ``cfg``: stage ring + epilogue rings (+ norms);
  ``slot_dtypes`` are the stored dtypes, and each int8 slot adds its row scales to the ring."""
  stage = cfg.tile_t * (cfg.tile_m + cfg.tile_n) * jnp.dtype(in_dtype).itemsize
  per_sub = cfg.epi_m * cfg.epi_n * sum(jnp.dtype(d).itemsize for d in (w_dtype, *slot_dtypes))
  per_sub += num_quantized * cfg.epi_m * 4
  total = cfg.max_concurrent_steps * stage + NUM_COMPUTE_WGS * ring_depth(cfg) * per_sub
  return total + (NUM_COMPUTE_WGS * cfg.tile_m * 4 if with_norm else 0)


def grid_size(cfg: MosaicTileConfig) -> int:
  """Blocks of the persistent grid: ``cfg.num_sms``, or the device's SM count."""
  if cfg.num_sms is not None:
    return cfg.num_sms
  device = jax.devices()[0]
  count = getattr(device, "core_count", None)
  return count if device.platform == "gpu" and count else DEFAULT_NUM_SMS


def config_problem(cfg: MosaicTileConfig) -> Optional[str]:
  """Why ``cfg`` is not a valid tiling, or None."""
  checks = (
      (cfg.tile_m > 0 and cfg.tile_m % 64 == 0, f"tile_m={cfg.tile_m} must be a positive multiple of 64"),
      (0 < cfg.tile_n <= 256 and cfg.tile_n % 64 == 0, f"tile_n={cfg.tile_n} must be a multiple of 64 in [64, 256]"),
      (cfg.tile_t > 0 and cfg.tile_t % 64 == 0, f"tile_t={cfg.tile_t} must be a positive multiple of 64"),
      (cfg.epi_m % 64 == 0 and cfg.tile_m % cfg.epi_m == 0,
       f"epi_m={cfg.epi_m} must be a multiple of 64 dividing tile_m={cfg.tile_m}"),
      (cfg.epi_n % 16 == 0 and cfg.tile_n % cfg.epi_n == 0,
       f"epi_n={cfg.epi_n} must be a multiple of 16 dividing tile_n={cfg.tile_n}"),
      (cfg.epi_slots >= 1, f"epi_slots={cfg.epi_slots} must be >= 1"),
      (cfg.max_concurrent_steps >= 2,
       f"max_concurrent_steps={cfg.max_concurrent_steps} must be >= 2 (one stage per warpgroup)"),
      (cfg.epi_l2_lookahead >= 0, f"epi_l2_lookahead={cfg.epi_l2_lookahead} must be >= 0"),
      (cfg.grid_tile_width >= 1, f"grid_tile_width={cfg.grid_tile_width} must be >= 1"),
      (cfg.tile_m * cfg.tile_n // 128 + EPILOGUE_REGISTERS <= _REGISTERS,
       f"a {cfg.tile_m}x{cfg.tile_n} float32 accumulator takes {cfg.tile_m * cfg.tile_n // 128} of "
       f"the {_REGISTERS} registers a compute thread has, leaving under {EPILOGUE_REGISTERS} "
       "for the epilogue: use a smaller tile"),
  )
  return next((why for ok, why in checks if not ok), None)


def device_problem() -> Optional[str]:
  """Why the default device cannot run the kernel, or None. ``wgmma`` exists on Hopper (sm_90)
  only (Blackwell has ``tcgen05``); a CPU passes: there the kernel is interpreted or lowered."""
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


def _operand_problem(x, dy, w, slots) -> Optional[str]:
  """Why the operands (whatever the tiling) cannot go to the kernel, or None."""
  if (problem := contract.operand_problem(x, dy, w, slots)) is not None:
    return problem
  if jnp.dtype(x.dtype) not in _INPUT_DTYPES or jnp.dtype(dy.dtype) != jnp.dtype(x.dtype):
    return (f"x/dy dtypes {x.dtype}/{dy.dtype}: both must be bfloat16 or both float16 "
            "(wgmma reads the transposed x operand only for 16-bit types)")
  if jnp.dtype(w.dtype) not in _STATE_DTYPES:
    return f"w dtype {w.dtype} must be float32, bfloat16 or float16"
  if len(slots) > MAX_SLOTS:
    return f"{len(slots)} optimizer slots: at most {MAX_SLOTS} are supported"
  for i, s in enumerate(slots):  # an int8 state's codes are int8 (contract.check_quantized)
    if not quantized(s) and jnp.dtype(s.dtype) not in _STATE_DTYPES:
      return f"slot {i} dtype {s.dtype} must be float32, bfloat16 or float16"
  return None


def supports(x: Any, dy: Any, w: Any, slots: Sequence[Any],
             config: Optional[MosaicTileConfig] = None, *,
             compute_grad_sq_norm: bool = False) -> tuple[bool, str]:
  """Whether the kernel takes these operands with ``config`` (None: :func:`default_config`):
  ``(True, "")`` or ``(False, reason)``, the reason naming the value and the fix."""
  cfg, why = select_config(x, dy, w, slots, config, compute_grad_sq_norm=compute_grad_sq_norm)
  return cfg is not None, why


def epilogue_loops(cfg: MosaicTileConfig, t: int, quantized_states: bool) -> bool:
  """Whether the epilogue's sub-tiles run as a loop over one copy of their code: always for
  int8 states (their straight-line code did not fit the instruction cache), and for float
  states at short T without L2 prefetch (0.95-0.98x the straight-line epilogue per layer at
  T=1024 on the H200, half its compile time; docs/mosaic_kernel.md). Long T keeps the
  straight-line epilogue (as a loop, bf16 states took 1.00-1.05x its time at T = 4096 and
  16384); an L2-prefetching config picks its prefetches per sub-tile in Python, which a loop
  cannot trace."""
  return quantized_states or (t <= SHORT_T and not cfg.epi_l2_lookahead)


def _tiling_problem(x, dy, w, slots, cfg, with_norm) -> Optional[str]:
  """Why ``cfg`` cannot tile these (checked) operands, or None."""
  if (problem := config_problem(cfg)) is not None:
    return f"invalid MosaicTileConfig: {problem}"
  if (problem := device_problem()) is not None:
    return problem
  for i, s in enumerate(slots):
    if quantized(s) and cfg.epi_n != s.codec.block:
      return (f"slot {i} is int8 in blocks of {s.codec.block} columns: epi_n={cfg.epi_n} "
              "must equal the block (one block per sub-tile row)")
    if quantized(s) and cfg.epi_l2_lookahead:
      return (f"slot {i} is int8, whose epilogue loop prefetches nothing beyond the ring: "
              f"epi_l2_lookahead={cfg.epi_l2_lookahead} must be 0")
  for name, dt in [("w", w.dtype)] + [(f"slot {i}", stored_dtype(s)) for i, s in enumerate(slots)]:
    if cfg.epi_n * jnp.dtype(dt).itemsize % 32:  # no 32-, 64- or 128-byte swizzle
      return f"epi_n={cfg.epi_n} gives {name} ({dt}) rows under 32 bytes; raise epi_n"
  (t, k), n = x.shape, dy.shape[1]
  for dim, size, field in (("T", t, "tile_t"), ("K", k, "tile_m"), ("N", n, "tile_n")):
    if size % getattr(cfg, field):
      return f"{dim}={size} must be a multiple of {field}={getattr(cfg, field)}"
  smem = smem_bytes(cfg, x.dtype, w.dtype, [stored_dtype(s) for s in slots], with_norm,
                    sum(map(quantized, slots)))
  if smem > SMEM_BUDGET_BYTES:
    return (f"config needs {smem} bytes of shared memory (budget {SMEM_BUDGET_BYTES}); "
            "lower max_concurrent_steps, epi_slots or the epilogue sub-tile")
  return None


def default_config(x: Any, dy: Any, w: Any, slots: Sequence[Any], *,
                   compute_grad_sq_norm: bool = False,
                   num_sms: Optional[int] = None) -> MosaicTileConfig:
  """The first row of ``_DEFAULTS`` that applies to and fits these operands; if none fits, the
  last that applies (the loosest), whose :func:`supports` reason then names the requirement."""
  quant_blocks = {s.codec.block for s in slots if quantized(s)}
  t = x.shape[0] if len(x.shape) == 2 else 0
  k, n = w.shape[-2:]
  grid_sms = grid_size(MosaicTileConfig(num_sms=num_sms))
  traits = {"int8" if quant_blocks else "float", "short" if t <= SHORT_T else "long"}
  if all(jnp.dtype(stored_dtype(a)).itemsize <= 2 for a in (w, *slots)):
    traits.add("two_byte")
  if jnp.dtype(w.dtype).itemsize <= 2:
    traits.add("two_byte_w")
  tiles_128 = -(-k // 128) * -(-n // 128)
  if tiles_128 <= _SMALL_GRID_WAVES * grid_sms:
    traits.add("small_grid")
  if tiles_128 <= _FEW_TILES_WAVES * grid_sms:
    traits.add("few_tiles")
  candidates = [cfg for when, cfg in _DEFAULTS if when <= traits]
  if quant_blocks:
    candidates = [dataclasses.replace(c, epi_n=min(quant_blocks)) for c in candidates]
  candidates = [dataclasses.replace(c, num_sms=num_sms) for c in candidates]
  for cfg in candidates:
    if _tiling_problem(x, dy, w, slots, cfg, compute_grad_sq_norm) is None:
      return cfg
  return candidates[-1]


def select_config(x: Any, dy: Any, w: Any, slots: Sequence[Any],
                  config: Optional[MosaicTileConfig] = None, *,
                  compute_grad_sq_norm: bool = False) -> tuple[Optional[MosaicTileConfig], str]:
  """Asks once whether the kernel takes a call, with the caller's tiling or ``None``
  (:func:`default_config`): ``(config, "")`` to pass to
  :func:`~pallas_kernels.mosaic.fused_dw_update_mosaic` with ``config_checked=True``, or
  ``(None, reason)``."""
  if config is not None and not isinstance(config, MosaicTileConfig):
    raise ValueError(f"config={config!r} is not a MosaicTileConfig: pass "
                     "pallas_kernels.mosaic.MosaicTileConfig or None")
  if (problem := _operand_problem(x, dy, w, slots)) is not None:
    return None, problem
  if config is None:
    config = default_config(x, dy, w, slots, compute_grad_sq_norm=compute_grad_sq_norm)
  why = _tiling_problem(x, dy, w, slots, config, compute_grad_sq_norm)
  return (config, "") if why is None else (None, why)
