"""Fused ``dW = x.T @ dy`` + optimizer update on Hopper, lowered through Mosaic GPU.

The contract is :mod:`pallas_kernels.contract`'s. One persistent block per SM: two compute
warpgroups take turns on whole tiles of ``W`` (one's epilogue overlaps the other's main loop), fed
by a memory warpgroup through one ring of ``x``/``dy`` stages; ``x`` goes to ``wgmma`` as a
transposed view of shared memory; each epilogue streams ``W``/state sub-tiles through a TMA ring
and writes them back in place (``pl.run_state`` aliases them to the kernel's outputs). Design,
figures and the variants tried: docs/mosaic_kernel.md.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Optional, Sequence, Union

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics
from pallas_kernels.contract import (UpdateFn, apply_update, grad_sq_terms, layer_problem,
                                     pack_scalars, rounding_ints, unwrap)
from pallas_kernels.mosaic import common
from pallas_kernels.mosaic import config as mcfg
from pallas_kernels.mosaic import rule_eval
from pallas_kernels.mosaic.config import MosaicTileConfig
from pallas_kernels.numerics import store_cast

Array = jax.Array
_WGS = mcfg.NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static the kernel body needs."""

  cfg: MosaicTileConfig
  t: int
  k: int
  n: int
  num_sms: int
  num_scalars: int
  with_norm: bool
  interpreting: bool
  stochastic: bool  # stochastic rounding of the weight (its key in layer_gmem[1])
  gated: bool  # the stores to W and the states run only where layer_gmem[2] != 0
  codecs: tuple  # per slot: None (a float array) or its numerics.BlockQuantized codec

  @property
  def loop(self) -> bool:
    """Whether the epilogue's sub-tiles run as a loop (:func:`pallas_kernels.mosaic.config.epilogue_loops`)."""
    return mcfg.epilogue_loops(self.cfg, self.t, any(c is not None for c in self.codecs))

  @property
  def needs_bits(self) -> bool:
    return self.stochastic or any(c is not None and c.needs_bits for c in self.codecs)

  @property
  def depth(self) -> int:
    return mcfg.ring_depth(self.cfg)

  @property
  def sub_tiles(self) -> list[tuple[int, int]]:
    """(row, col) offsets of the epilogue sub-tiles within a tile."""
    c = self.cfg
    return [(mi * c.epi_m, ni * c.epi_n)
            for mi in range(c.tile_m // c.epi_m) for ni in range(c.tile_n // c.epi_n)]


def _region(name: str):
  """A named range of the kernel body: a timed range per warpgroup under the profiler."""
  return jax.named_scope(f"fdw_{name}")


@dataclasses.dataclass
class _Epilogue:
  """One compute warpgroup's epilogue: ``begin`` (before a tile's main loop) fills the first
  ring slots; ``finish`` streams the sub-tiles through the ring, updates and stores them."""

  plan: _Plan
  rule: rule_eval.TracedRule  # the rule unwrapped from update_fn, traced
  update_fn: Any  # what says whether non-finite gradient elements are skipped
  sc_gmem: Any  # the rule's scalars, flattened
  layer_gmem: Any  # [layer, rounding key bits(, apply)] (int32)
  w_gmem: Any
  slot_gmems: Sequence[Any]  # per slot: the array, or (codes, block-major scales)
  norm_gmem: Any
  w_ring: Any
  slot_rings: Sequence[Any]
  ring_ready: Any
  norm_smem: Any
  wg_idx: Any

  def _offsets(self, j):
    """(row, col) offset of sub-tile ``j`` within its tile: ints for a static ``j``, int32
    scalars for the loop's."""
    if isinstance(j, int):
      return self.plan.sub_tiles[j]
    cfg = self.plan.cfg
    cols = jnp.int32(cfg.tile_n // cfg.epi_n)
    return lax.div(j, cols) * cfg.epi_m, lax.rem(j, cols) * cfg.epi_n

  def _ring_slot(self, j):
    return j % self.plan.depth if isinstance(j, int) else lax.rem(j, jnp.int32(self.plan.depth))

  def _window(self, j, row0, col0):
    r, c = self._offsets(j)
    return pl.ds(row0 + r, self.plan.cfg.epi_m), pl.ds(col0 + c, self.plan.cfg.epi_n)

  def _slot_refs(self, slot: int) -> list:
    """Each state's buffer in ring slot ``slot``: a ref, or ``(codes, scales)`` for int8."""
    at = lambda ring: ring.at[self.wg_idx, slot]
    return [tuple(map(at, ring)) if isinstance(ring, tuple) else at(ring) for ring in self.slot_rings]

  def _slot_copies(self, j, row0, col0, s_refs):
    """``(shared buffer, device window)`` of sub-tile ``j`` for every stored part of every state."""
    win = self._window(j, row0, col0)
    for ref, gmem in zip(s_refs, self.slot_gmems):
      if isinstance(gmem, tuple):  # int8: codes, then the scales in the [L*N/blk, K] view
        plan, (r, c) = self.plan, self._offsets(j)
        layer = self.layer_gmem[0]
        blocks = plan.n // plan.cfg.epi_n  # block columns a layer
        yield ref[0], gmem[0].at[win]
        yield ref[1], gmem[1].at[layer * blocks + lax.div(col0 + c, jnp.int32(plan.cfg.epi_n)),
                                 pl.ds(row0 + r - layer * plan.k, plan.cfg.epi_m)]
      else:
        yield ref, gmem.at[win]

  def _fetch(self, j, row0, col0) -> None:
    slot = self._ring_slot(j)
    barrier = self.ring_ready.at[self.wg_idx * self.plan.depth + slot]
    plgpu.copy_gmem_to_smem(self.w_gmem.at[self._window(j, row0, col0)],
                            self.w_ring.at[self.wg_idx, slot], barrier)
    for smem, gmem in self._slot_copies(j, row0, col0, self._slot_refs(slot)):
      plgpu.copy_gmem_to_smem(gmem, smem, barrier)

  def _prefetch_l2(self, j: int, row0, col0) -> None:
    """TMA prefetch of sub-tile ``j`` into L2 (a hint: the interpreter has no L2)."""
    if self.plan.interpreting or j >= len(self.plan.sub_tiles):
      return
    win = self._window(j, row0, col0)
    for src in (self.w_gmem, *(g[0] if isinstance(g, tuple) else g for g in self.slot_gmems)):
      plgpu.async_prefetch(src.at[win])

  def begin(self, row0, col0) -> None:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores left the ring
    for j in range(self.plan.depth):
      self._fetch(j, row0, col0)

  def _element_bits(self, row0, col0):
    """Each element's hashed bits (uint32, WGMMA layout) for the sub-tile at ``row0, col0`` of
    the [L*K, N] view: ``element_bits(key, row * N + col)``, the row within its layer."""
    plan = self.plan
    shape = (plan.cfg.epi_m, plan.cfg.epi_n)
    layout = None if plan.interpreting else plgpu.Layout.WGMMA  # no layout casts there
    local_row0 = row0 - self.layer_gmem[0] * plan.k
    # (row0 + i) * N + (col0 + j) as one scalar plus the sub-tile's own i * N + j, which is the
    # same for every sub-tile: per element one add (uint32 arithmetic wraps as the index does).
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    base = numerics.element_index(local_row0.astype(jnp.uint32), col0.astype(jnp.uint32), plan.n)
    # Not a scalar bitcast_convert_type: warpgroup semantics lowers that to a vector
    # ("Scalars must be represented by non-vector types", jax 0.10.2-0.11.2).
    key = self.layer_gmem[1].astype(jnp.uint32)
    return numerics.element_bits(key, base + numerics.element_index(rows, cols, plan.n))

  def finish(self, acc, row0, col0, norm_block, norm_row0) -> None:
    plan, cfg = self.plan, self.plan.cfg
    scalar_leaves = [self.sc_gmem[i] for i in range(plan.num_scalars)]
    for j in range(plan.depth, plan.depth + cfg.epi_l2_lookahead):
      self._prefetch_l2(j, row0, col0)
    grads = [acc[r:r + cfg.epi_m, c:c + cfg.epi_n] for r, c in plan.sub_tiles]
    row_sums = {}  # row offset -> the gradient's squares summed along N
    if plan.loop and cfg.epi_rotate:
      # One copy of the sub-tile code, run on the first of the slices the loop carries; each
      # iteration hands the rest down one place, so a slice's registers die once it is used.
      if plan.with_norm:
        row_sums[0] = jnp.sum(grad_sq_terms(acc), axis=1)

      def _sub_tile(j, slices):
        self._sub_tile(j, slices[0], row0, col0, scalar_leaves)
        return (*slices[1:], slices[-1])

      lax.fori_loop(0, len(grads), _sub_tile, tuple(grads))
    elif plan.loop:
      # One copy of the sub-tile code, run once per sub-tile: a sub-tile's gradient is picked
      # from the accumulator's static slices (registers cannot be indexed: _pick), the whole
      # accumulator live through the loop.
      @pl.loop(0, len(plan.sub_tiles))
      def _sub_tile(j):
        self._sub_tile(j, _pick(grads, j), row0, col0, scalar_leaves)

      if plan.with_norm:
        row_sums[0] = jnp.sum(grad_sq_terms(acc), axis=1)
    else:
      for j, (r, c) in enumerate(plan.sub_tiles):
        self._sub_tile(j, grads[j], row0, col0, scalar_leaves)
        if plan.with_norm:
          part = jnp.sum(grad_sq_terms(grads[j]), axis=1)
          row_sums[r] = part if r not in row_sums else row_sums[r] + part
    if plan.with_norm:
      for r, part in row_sums.items():
        self.norm_smem[self.wg_idx, pl.ds(r, part.shape[0])] = part
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(self.norm_smem.at[self.wg_idx],
                              self.norm_gmem.at[norm_block, pl.ds(norm_row0, cfg.tile_m)])

  def _sub_tile(self, j, g, row0, col0, scalar_leaves) -> None:
    """Sub-tile ``j`` (static, or the loop's int32) with gradient ``g``: wait for its ring slot,
    decode, update, encode, store, refill the slot."""
    plan, cfg = self.plan, self.plan.cfg
    r, c = self._offsets(j)
    slot = self._ring_slot(j)
    with _region("epi_wait"):
      plgpu.barrier_wait(self.ring_ready.at[self.wg_idx * plan.depth + slot])
    w_ref, s_refs = self.w_ring.at[self.wg_idx, slot], self._slot_refs(slot)
    with _region("epi_load"):  # swizzled SMEM reads come back in the accumulator's layout
      w_raw = w_ref[...]
      s_raw = tuple(tuple(p[...] for p in ref) if isinstance(ref, tuple) else ref[...]
                    for ref in s_refs)
    with _region("epi_decode"):
      widen = _widen_bits if unwrap(self.update_fn)[1] else (lambda a: a.astype(jnp.float32))
      w32 = widen(w_raw)
      s32 = tuple(widen(raw) if codec is None else codec.decode_block_rows(*raw)
                  for raw, codec in zip(s_raw, plan.codecs))
    with _region("epi_math"):
      new_w32, new_slots = apply_update(self.update_fn, g, w32, s32, scalar_leaves, rule=self.rule)
    with _region("epi_write"):
      bits = self._element_bits(row0 + r, col0 + c) if plan.needs_bits else None
      # The values that do not read the element bits are stored first, then those that do (an
      # SR weight last), so that the states' registers are free before the bits' are taken: in
      # W, m, v order an SR bf16 weight's loop spilled the most (compiled for an H200 at T=1024,
      # with int8 states 108 bytes then, none now: experiments/results/cpu/epilogue_sass).
      def store_w():
        w_ref[...] = (numerics.stochastic_round(new_w32, bits, w_ref.dtype) if plan.stochastic
                      else store_cast(new_w32, w_ref.dtype))

      if not plan.stochastic:
        store_w()
      # A stable sort: the slots that read no bits keep their order ahead of those that do.
      for i in sorted(range(len(plan.codecs)),
                      key=lambda i: plan.codecs[i] is not None and plan.codecs[i].needs_bits):
        ref, new, codec = s_refs[i], new_slots[i], plan.codecs[i]
        if codec is None:
          ref[...] = store_cast(new, ref.dtype)
        else:  # int8: codes and row scales, stochastic maps from the slot's 16 bits
          codes, scale = codec.encode_block_rows(
              new, numerics.value_bits(bits, 1 + i) if codec.needs_bits else None)
          ref[0][...], ref[1][...] = codes.astype(ref[0].dtype), scale
      if plan.stochastic:
        store_w()
    with _region("epi_store"):
      plgpu.commit_smem()

      @pl.when(self.layer_gmem[2] != 0 if plan.gated else True)
      def _store():  # not applied: W and the states in memory stay as they were, bit for bit
        plgpu.copy_smem_to_gmem(w_ref, self.w_gmem.at[self._window(j, row0, col0)],
                                commit_group=False)
        for smem, gmem in self._slot_copies(j, row0, col0, s_refs):
          plgpu.copy_smem_to_gmem(smem, gmem, commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      if cfg.epi_l2_lookahead:
        self._prefetch_l2(j + plan.depth + cfg.epi_l2_lookahead, row0, col0)

    @pl.when(j + plan.depth < len(plan.sub_tiles))  # a Python bool for a static j
    def _refill():
      with _region("epi_store_read"):  # refill this slot once its results were read out
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      with _region("epi_refill"):
        self._fetch(j + plan.depth, row0, col0)


def _widen_bits(raw: Array) -> Array:
  """float32 of a stored value; bfloat16 widened by its bits (the high half of a float32), which
  is what ``astype`` does, spelled so that LLVM cannot see the conversion: the non-finite guard's
  select between the new value and this one then stays a float32 select ahead of the paired
  float32 -> bfloat16 conversion. Written as ``astype``, LLVM folds the select through the
  store's conversion (the old value's conversion back cancels), selects bfloat16 halves and
  converts element by element, and the guarded bf16 loop spilled
  (experiments/results/cpu/epilogue_sass). Unguarded, ``astype`` compiles shorter."""
  if raw.dtype != jnp.bfloat16:
    return raw.astype(jnp.float32)
  bits = lax.bitcast_convert_type(raw, jnp.uint16).astype(jnp.uint32) << jnp.uint32(16)
  return lax.bitcast_convert_type(bits, jnp.float32)


def _pick(values: Sequence[Array], j) -> Array:
  """``values[j]`` for an int32 scalar ``j``: float32 arrays of one shape and layout, bit for
  bit (NaNs and infinities of the other entries stay out).

  Of more than two, a ``lax.switch`` (a uniform branch to one block of register moves): a blend
  costs a logic op an element per entry, every one of which runs, where a switch runs one move
  an element (the fp32 AdamW loop, eight 64x32 sub-tiles a tile: 592 instructions run a
  sub-tile against 699; experiments/results/cpu/epilogue_sass). Of two, a blend (an AND with an
  all-ones or all-zeros mask each, then an OR), which the int8 loop on 128x64 tiles keeps: there
  the switch's moves spilled registers."""
  if len(values) > 2:
    return lax.switch(j, [functools.partial(lambda i, *vs: vs[i], i) for i in range(len(values))],
                      *values)
  out = None
  for i, v in enumerate(values):
    mask = -(j == i).astype(jnp.int32)  # -1 (all ones) for the chosen entry, else 0
    part = lax.bitcast_convert_type(v, jnp.int32) & mask
    out = part if out is None else out | part
  return lax.bitcast_convert_type(out, jnp.float32)


def _fused_kernel(x_gmem, dy_gmem, sc_gmem, layer_gmem, w_gmem, slot_gmems, norm_gmem, *,
                  plan: _Plan, rule, update_fn):
  """One block: the persistent ping-pong loop over its ``W`` tiles. ``stage_ready[w * S + s]``
  completes only for warpgroup ``w``'s steps; ``stage_free[s]`` is awaited by the memory
  warpgroup alone (docs/mosaic_kernel.md, "The ping-pong schedule")."""
  cfg = plan.cfg
  tile_m, tile_n, tile_t = cfg.tile_m, cfg.tile_n, cfg.tile_t
  stages, t_iters = cfg.max_concurrent_steps, plan.t // cfg.tile_t
  m_iters, n_iters = plan.k // tile_m, plan.n // tile_n
  in_dtype = x_gmem.dtype
  in_transforms = common.mma_transforms(64, in_dtype)  # rows of >= 64 16-bit elements: 128 B swizzle
  epi_shape = (_WGS, plan.depth, cfg.epi_m, cfg.epi_n)
  ring = lambda d: plgpu.SMEM(epi_shape, d, transforms=common.mma_transforms(cfg.epi_n, d))
  slot_rings = [(ring(g[0].dtype), plgpu.SMEM(epi_shape[:3], jnp.float32)) if isinstance(g, tuple)
                else ring(g.dtype) for g in slot_gmems]  # int8: codes and row scales

  @functools.partial(
      pl.run_scoped,
      x_stages=plgpu.SMEM((stages, tile_t, tile_m), in_dtype, transforms=in_transforms),
      dy_stages=plgpu.SMEM((stages, tile_t, tile_n), in_dtype, transforms=in_transforms),
      stage_ready=plgpu.Barrier(num_arrivals=2, num_barriers=_WGS * stages),
      stage_free=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      w_ring=ring(w_gmem.dtype),
      slot_rings=slot_rings,
      # One arrival per TMA copy into a ring slot: W, each state, each int8 state's scales.
      ring_ready=plgpu.Barrier(num_arrivals=1 + len(plan.codecs) + sum(c is not None for c in plan.codecs),
                               num_barriers=_WGS * plan.depth),
      norm_smem=plgpu.SMEM((_WGS, tile_m), jnp.float32) if plan.with_norm else None,
      xt_smem=(plgpu.SMEM((_WGS, tile_m, tile_t), in_dtype, transforms=in_transforms)
               if plan.interpreting else None),
      collective_axes="wg",
  )
  def _scope(x_stages, dy_stages, stage_ready, stage_free, w_ring, slot_rings, ring_ready,
             norm_smem, xt_smem):
    wg_idx = lax.axis_index("wg")
    block = lax.axis_index("sm")
    # This block's tiles: block, block + num_sms, ... of the snake order.
    num_local = lax.div(m_iters * n_iters - block + (plan.num_sms - 1), jnp.int32(plan.num_sms))
    tile_coords = lambda i: common.planar_snake(block + i * plan.num_sms, m_iters, n_iters,
                                                cfg.grid_tile_width)

    @pl.when(wg_idx == _WGS)
    def _memory_warpgroup():
      plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")
      total = num_local * t_iters

      @pl.loop(0, num_local)
      def _tile(i):
        m_idx, n_idx = tile_coords(i)
        owner = lax.rem(i, _WGS)

        @pl.loop(0, t_iters)
        def _step(k):
          slot = lax.rem(i * t_iters + k, stages)

          @pl.when(i * t_iters + k >= stages)
          def _wait_free():
            with _region("mem_wait_free"):  # long: the consumers bound; short: the loads do
              plgpu.barrier_wait(stage_free.at[slot])

          ready = stage_ready.at[owner * stages + slot]
          rows = pl.ds(k * tile_t, tile_t)
          plgpu.copy_gmem_to_smem(x_gmem.at[rows, pl.ds(m_idx * tile_m, tile_m)],
                                  x_stages.at[slot], ready)
          plgpu.copy_gmem_to_smem(dy_gmem.at[rows, pl.ds(n_idx * tile_n, tile_n)],
                                  dy_stages.at[slot], ready)

      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):  # every completion of a barrier is awaited before it goes away
        plgpu.barrier_wait(stage_free.at[lax.rem(step, stages)])

    @pl.when(wg_idx < _WGS)
    def _compute_warpgroup():
      plgpu.set_max_registers(common.compute_registers(_WGS), action="increase")
      epi = _Epilogue(plan, rule, update_fn, sc_gmem, layer_gmem, w_gmem, slot_gmems,
                      norm_gmem, w_ring, slot_rings, ring_ready, norm_smem, wg_idx)
      xt = xt_smem.at[wg_idx] if plan.interpreting else None

      @pl.loop(0, lax.div(num_local - wg_idx + (_WGS - 1), _WGS))
      def _tile(j):
        i = wg_idx + j * _WGS  # tiles wg_idx, wg_idx + 2, ... of this block's list
        m_idx, n_idx = tile_coords(i)
        row0 = layer_gmem[0] * plan.k + m_idx * tile_m  # the layer is a row offset
        col0 = n_idx * tile_n
        epi.begin(row0, col0)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          with _region("mainloop"):
            @pl.loop(0, t_iters)
            def _step(k):
              step = i * t_iters + k
              slot = lax.rem(step, stages)
              plgpu.barrier_wait(stage_ready.at[wg_idx * stages + slot])
              x_block, dy_block = x_stages.at[slot], dy_stages.at[slot]  # acc += x_block.T @ dy_block
              if plan.interpreting:  # the interpreter reads no transposed operand: x via registers
                xt[...] = x_block[...].T
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, xt, dy_block)
              else:
                plgpu.wgmma(acc_ref, x_block.transpose((1, 0)), dy_block)
              if cfg.mma_in_flight:  # wait for the previous step's wgmma, then free its stage
                plgpu.wgmma_wait(1)
                prev_slot = lax.rem(step + (stages - 1), stages)
                pl.when(k > 0)(lambda: plgpu.barrier_arrive(stage_free.at[prev_slot]))
              else:
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(stage_free.at[slot])

            if cfg.mma_in_flight:
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(stage_free.at[lax.rem(i * t_iters + (t_iters - 1), stages)])
          with _region("epilogue"):
            epi.finish(acc_ref[...], row0, col0, norm_block=n_idx, norm_row0=m_idx * tile_m)

    plgpu.wait_smem_to_gmem(0)  # every result is in device memory before the kernel exits


def fused_dw_update_mosaic(
    x: Array, dy: Array, w: Array, slots: Sequence[Array], scalars: Any, update_fn: UpdateFn, *,
    layer: Optional[Array] = None, config: Optional[MosaicTileConfig] = None,
    config_checked: bool = False, compute_grad_sq_norm: bool = False,
    interpret: Union[bool, Any] = False, weight_codec: Optional[numerics.Codec] = None,
    seed: Optional[Any] = None, step: Optional[Any] = None, apply: Optional[Any] = None,
    profile: Optional[tuple[int, str]] = None):
  """Fused ``dW = x.T @ dy`` + optimizer update on one Hopper GPU (Mosaic GPU).

  Same contract, arguments and results as
  :func:`pallas_kernels.reference.fused_dw_update_reference` (without ``index``), and:

  Args:
    x, dy: both bfloat16 or both float16.
    w: float32, bfloat16 or float16.
    slots: float arrays, or int8 :class:`~pallas_kernels.numerics.QuantizedArray` states in
      blocks of ``config.epi_n`` along N (their block-major scales read and written in place).
    config: tiling; ``None`` picks :func:`~pallas_kernels.mosaic.default_config`.
    config_checked: ``config`` came from :func:`~pallas_kernels.mosaic.select_config` for these
      very operands, so it is not checked again.
    interpret: run on CPU under the Mosaic GPU interpreter (``True`` or an
      ``InterpretGPUParams``).
    weight_codec: ``None``/``numerics.Cast()`` or ``numerics.StochasticRound()`` (bfloat16 ``w``).
    profile: ``(profile_space, profile_dir)``: Mosaic GPU's in-kernel profiler records each
      named region of the body per warpgroup and writes a Chrome trace to ``profile_dir`` after
      every call (``python -m experiments.kernel_tools profile``).

  Returns:
    ``(new_w, new_slots, grad_sq_norm)``, ``w`` and the slots updated in place when donated.

  Raises:
    ValueError: for operands the kernel cannot take (the message says why and what to change).
  """
  slots = tuple(slots)
  codec = weight_codec or numerics.Cast()
  if not config_checked:
    config, reason = mcfg.select_config(x, dy, w, slots, config,
                                        compute_grad_sq_norm=compute_grad_sq_norm)
    if config is None:
      raise ValueError(f"fused_dw_update_mosaic: {reason}")
  if why := layer_problem(w, layer):
    raise ValueError(f"fused_dw_update_mosaic: {why}")
  if codec.needs_bits and not isinstance(codec, numerics.StochasticRound):
    raise ValueError(f"weight_codec={codec!r}: the Mosaic kernel takes Cast or StochasticRound")
  if isinstance(codec, numerics.StochasticRound):  # its dtype check
    numerics.stochastic_round(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.uint32), w.dtype)
  static = dict(update_fn=update_fn, cfg=config, compute_grad_sq_norm=compute_grad_sq_norm,
                interpret=interpret, codec=codec, profile=profile)
  try:
    hash(tuple(static.values()))
  except TypeError:  # e.g. a rule holding an array hyperparameter: lowered at every call site
    return _launch(x, dy, w, slots, scalars, layer, seed, step, apply, **static)
  with common.same_trace_context():
    return _launch_cached(x, dy, w, slots, scalars, layer, seed, step, apply, **static)


def _launch(x, dy, w, slots, scalars, layer, seed, step, apply, *, update_fn, cfg, compute_grad_sq_norm,
            interpret, codec, profile):
  """The kernel call, for operands :func:`fused_dw_update_mosaic` has checked."""
  (t, k), n = x.shape, dy.shape[1]
  num_layers = w.shape[0] if w.ndim == 3 else 1
  sc_vec, _ = pack_scalars(scalars)  # ValueError unless every leaf is 0-d
  # Clamped like dynamic_index_in_dim: an out-of-range layer must not address other rows.
  layer_i32 = (jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1) if w.ndim == 3
               else jnp.int32(0))
  # The hash key of (seed, step, layer); the kernel hashes it with each element's index.
  quant = [s for s in slots if mcfg.quantized(s)]
  seed_i32, step_i32 = rounding_ints((codec, *(s.codec for s in quant)), seed, step)
  key = numerics.rounding_key(seed_i32, step_i32, layer_i32)
  ints = [layer_i32, jax.lax.bitcast_convert_type(key, jnp.int32)]
  if apply is not None:
    ints.append(jnp.asarray(apply).astype(jnp.int32))
  layer_vec = jnp.stack(ints)
  params = common.interpret_params(interpret)
  plan = _Plan(cfg=cfg, t=t, k=k, n=n, num_sms=mcfg.grid_size(cfg), num_scalars=len(jax.tree.leaves(scalars)),
               with_norm=compute_grad_sq_norm, interpreting=params is not None,
               stochastic=isinstance(codec, numerics.StochasticRound), gated=apply is not None,
               codecs=tuple(s.codec if mcfg.quantized(s) else None for s in slots))
  rule = rule_eval.trace_rule(unwrap(update_fn)[0], (cfg.epi_m, cfg.epi_n), len(slots), scalars,
                              fast_math=params is None and cfg.fast_math)
  flat = lambda a: a.reshape(num_layers * k, n)  # one [L*K, N] array; the layer is a row offset
  # One row of per-W-row partial sums per column tile; NaN makes a missed entry loud.
  norm_init = jnp.full((n // cfg.tile_n, k), jnp.nan, jnp.float32) if compute_grad_sq_norm else None
  mesh = plgpu.Mesh(grid=(plan.num_sms,), grid_names=("sm",), num_threads=_WGS + 1,
                    thread_name="wg")
  compiler_params = plgpu.CompilerParams(
      lowering_semantics=getattr(plgpu.LoweringSemantics, rule_eval.LOWERING_SEMANTICS),
      unsafe_no_auto_barriers=cfg.no_auto_barriers,
      **({} if profile is None else dict(profile_space=profile[0], profile_dir=profile[1])))
  body = functools.partial(_fused_kernel, plan=plan, rule=rule, update_fn=update_fn)

  def stateful(refs):
    x_ref, dy_ref, sc_ref, layer_ref, w_ref, slot_refs, norm_ref = refs
    if params is not None:
      # The Mosaic GPU interpreter (jax 0.10.2) cannot run pl.kernel on run_state's refs (their
      # memory space is None: KeyError in its GPU callbacks), so the interpreted launch keeps
      # pl.core_map (deprecated in jax 0.11.2; its warning is the only one filtered). Same body.
      with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*core_map", category=DeprecationWarning)
        pl.core_map(mesh, compiler_params=compiler_params, name="fused_dw_update_mosaic",
                    interpret=params)(lambda: body(*refs[:5], tuple(slot_refs), norm_ref))
      return
    # pl.kernel aliases the refs it is given to its outputs (W, the states, the norm partials:
    # in place under jit with them donated) and reads the arrays (x, dy, the scalars). Operands
    # in the order the kernel first reads them.
    def fused_dw_update_mosaic(x, dy, lay, w_, slots_, sc, norm):
      body(x, dy, sc, lay, w_, tuple(slots_), norm)

    pl.kernel(fused_dw_update_mosaic, out_type=(), mesh=mesh, compiler_params=compiler_params,
              name="fused_dw_update_mosaic")(x_ref[...], dy_ref[...], layer_ref[...], w_ref,
                                             slot_refs, sc_ref[...], norm_ref)

  def kernel_view(s):
    if not mcfg.quantized(s):
      return flat(s)
    # The scales are stored block-major, [L, N/blk, K]: a sub-tile's row scales are one
    # contiguous TMA box of the [L*N/blk, K] view (a [64, 1] column of [K, N/blk] would be 4
    # bytes wide; TMA needs 16).
    return flat(s.codes), s.scale.reshape(num_layers * (n // s.codec.block), k)

  def from_kernel_view(new, old):
    if not mcfg.quantized(old):
      return new.reshape(old.shape)
    codes, scale = new
    return numerics.QuantizedArray(codes.reshape(old.codes.shape), scale.reshape(old.scale.shape),
                                   old.codec)

  outs = pl.run_state(stateful)(
      (x, dy, sc_vec, layer_vec, flat(w), tuple(map(kernel_view, slots)), norm_init))
  new_w, new_slots, norm_parts = outs[4].reshape(w.shape), outs[5], outs[6]
  new_slots = tuple(from_kernel_view(s, old) for s, old in zip(new_slots, slots))
  return new_w, new_slots, jnp.sum(norm_parts) if compute_grad_sq_norm else None


# One trace (and one lowering per jit module) for every call with the same shapes and static
# arguments: an unrolled model calls the kernel once per layer, and lowering one call takes
# about 1.7 s on the host (qwen3-0.6b unrolled: 325 s for 196 calls,
# experiments/results/cpu/unrolled_lowering/).
_launch_cached = jax.jit(
    _launch, static_argnames=("update_fn", "cfg", "compute_grad_sq_norm", "interpret", "codec",
                              "profile"))
