"""L2 eviction priorities on Mosaic GPU's TMA copies, for experiments (not the product).

Nsight Compute on the H200 (results/h200/ncu/) read the fused kernel's main loop as
latency-bound, with x/dy read from device memory 3x their size beside the W/state stream,
and with plain SGD's W-only stream the main loop runs at a same-tile GEMM's speed
(results/h200/rules/). The lever that would keep x/dy in L2 is an eviction priority on the
stream's copies (PTX ``cp.async.bulk.tensor ... .L2::cache_hint`` with a ``createpolicy``
policy), which Mosaic GPU does not expose (no cache hints in jax 0.10.2 nor in jax's source of
2026-08-08). Its NVVM ops do take an ``l2_cache_hint`` operand, so this module wraps the
``nvvm`` module that ``jax.experimental.mosaic.gpu.launch_context`` builds its TMA copies with
and adds a policy to every TMA store (shared -> global) and/or load (global -> shared) lowered
while :func:`hints` is active.

In the fused kernel every TMA store is a W/state (or grad-norm) store, so ``store="evict_first"``
marks the stream's lines first to go, and the x/dy lines that the main loop re-reads stay; loads
are x/dy (memory warpgroup) and W/state (epilogue) alike, and a W/state line loaded is stored
again, so its store's policy is the one it keeps. The kernel must be lowered (its first call
under ``jax.jit``) inside the context. GPU only in effect; the wrapper's MLIR is checked on CPU
by lowering for ``cuda``.

    with l2_hints.hints(store="evict_first"):
      jax.block_until_ready(step(w, state))   # compiled here, with the hints
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

POLICIES = ("evict_first", "evict_last", "evict_normal", "evict_unchanged")


def _policy(kind: str) -> Any:
  """An i64 L2 cache policy for the whole access (``createpolicy.fractional``, fraction 1.0)."""
  from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jaxlib.mlir.dialects import llvm  # pylint: disable=g-import-not-at-top

  return llvm.inline_asm(ir.IntegerType.get_signless(64), [],
                         f"createpolicy.fractional.L2::{kind}.b64 $0, 1.0;", "=l",
                         has_side_effects=False)


class _NvvmWithHints:
  """Stands in for ``jaxlib.mlir.dialects.nvvm`` in launch_context: the two TMA tensor copies
  get an ``l2_cache_hint``; every other name is nvvm's own."""

  def __init__(self, base, store: Optional[str], load: Optional[str]):
    self._base, self._store, self._load = base, store, load
    self.hinted = {"store": 0, "load": 0}  # copies lowered with a hint (tests, logs)

  def __getattr__(self, name):
    return getattr(self._base, name)

  # NVVM's own lowering of these ops refuses a cache hint beside a predicate ("Inline-ptx
  # lowering unsupported with L2 cache-hint"), and launch_context always passes one: so the
  # hinted copies are written as inline PTX here, as launch_context writes its TMA reductions.
  def cp_async_bulk_tensor_global_shared_cta(self, tma_desc, smem_ptr, coords, *, predicate=None,
                                             **kwargs):  # TMA store
    if not self._store or kwargs:
      return self._base.cp_async_bulk_tensor_global_shared_cta(
          tma_desc, smem_ptr, coords, predicate=predicate, **kwargs)
    from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
    from jaxlib.mlir.dialects import llvm  # pylint: disable=g-import-not-at-top

    rank = len(coords)
    idx = ",".join(f"${i}" for i in range(3, 3 + rank))
    llvm.inline_asm(
        ir.Type.parse("!llvm.void"),
        [_predicate(predicate), smem_ptr, tma_desc, *coords, _policy(self._store)],
        f"@$0 cp.async.bulk.tensor.{rank}d.global.shared::cta.tile.bulk_group.L2::cache_hint "
        f"[$2,{{{idx}}}], [$1], ${3 + rank};",
        "b,r,l" + ",r" * rank + ",l", has_side_effects=True)
    self.hinted["store"] += 1
    return None

  def cp_async_bulk_tensor_shared_cluster_global(self, smem_ptr, tma_desc, coords, barrier_ptr,
                                                 im2col, *, multicast_mask=None, predicate=None,
                                                 **kwargs):  # TMA load
    if not self._load or im2col or multicast_mask is not None or kwargs:  # those keep no hint
      return self._base.cp_async_bulk_tensor_shared_cluster_global(
          smem_ptr, tma_desc, coords, barrier_ptr, im2col, multicast_mask=multicast_mask,
          predicate=predicate, **kwargs)
    from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
    from jaxlib.mlir.dialects import llvm  # pylint: disable=g-import-not-at-top

    rank = len(coords)
    idx = ",".join(f"${i}" for i in range(4, 4 + rank))
    llvm.inline_asm(
        ir.Type.parse("!llvm.void"),
        [_predicate(predicate), smem_ptr, tma_desc, barrier_ptr, *coords, _policy(self._load)],
        f"@$0 cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        f".L2::cache_hint [$1], [$2,{{{idx}}}], [$3], ${4 + rank};",
        "b,r,l,r" + ",r" * rank + ",l", has_side_effects=True)
    self.hinted["load"] += 1
    return None


def _predicate(predicate):
  """launch_context's predicate (an i1), or true where it passes none."""
  if predicate is not None:
    return predicate
  from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jaxlib.mlir.dialects import arith  # pylint: disable=g-import-not-at-top

  return arith.constant(ir.IntegerType.get_signless(1), 1)


@contextlib.contextmanager
def hints(store: Optional[str] = None, load: Optional[str] = None) -> Iterator[_NvvmWithHints]:
  """TMA copies lowered inside get these L2 policies (``None``: none added)."""
  from jax.experimental.mosaic.gpu import launch_context  # pylint: disable=g-import-not-at-top

  for name, kind in (("store", store), ("load", load)):
    if kind is not None and kind not in POLICIES:
      raise ValueError(f"{name}={kind!r} is not an L2 policy; use one of {POLICIES}")
  saved = launch_context.nvvm
  wrapper = _NvvmWithHints(saved, store, load)
  launch_context.nvvm = wrapper
  try:
    yield wrapper
  finally:
    launch_context.nvvm = saved
