"""Mosaic GPU kernels compiled on a thread pool while XLA compiles the rest of the computation.

XLA compiles a computation's Mosaic GPU kernels one after another, on one host thread, when it
reaches their custom calls: for a scanned Llama-3.1-8B training step, 20 kernels took 8.0 s of a
19.4 s compile, and 13.2 s with this pool (H200, jax 0.11.2;
``experiments/results/h200/scanned/parallel_compile``). Mosaic GPU
keeps every compiled kernel in a process-wide cache keyed by the hash its lowering computed, and
XLA's compile looks there first. So, as soon as jax has lowered a computation (the monitoring
event that ends each lowering, before XLA's compile starts), each Mosaic GPU kernel the lowering
produced is compiled on its own on a thread pool, as a one-op computation holding the same
module and hash; XLA's own passes run meanwhile, and its compile then finds the kernels in the
cache. A kernel still compiling when XLA reaches it is compiled again by XLA, as without the
pool: the pool can save time, never change a result (the cache holds what the same module
compiles to).

On by default on a GPU backend; :func:`set_enabled` turns it off (or the environment variable
``FORGE_PARALLEL_KERNEL_COMPILE=0``). It reads the kernels a lowering produced from
``jax.experimental.mosaic.gpu.core.KNOWN_KERNELS`` (hash -> module, filled by every Mosaic GPU
lowering); where that is missing it does nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Optional

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

# The monitoring event jax records when a computation's lowering to StableHLO ends, right
# before XLA's compile of it starts (jax._src.dispatch.JAXPR_TO_MLIR_MODULE_EVENT).
LOWERING_DONE_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
MOSAIC_TARGET = "mosaic_gpu_v2"  # the custom call Mosaic GPU kernels lower to

_lock = threading.Lock()
_enabled = os.environ.get("FORGE_PARALLEL_KERNEL_COMPILE", "1") not in ("0", "false", "False")
_installed = False
_submitted: set = set()  # kernel hashes handed to the pool
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_futures: list = []


def set_enabled(enabled: bool) -> None:
  """Turns the parallel compile of Mosaic GPU kernels on or off for later lowerings."""
  global _enabled
  _enabled = bool(enabled)


def enabled() -> bool:
  return _enabled


def _known_kernels() -> Optional[dict]:
  try:
    from jax.experimental.mosaic.gpu import core  # pylint: disable=g-import-not-at-top
  except ImportError:  # no Mosaic GPU in this jax
    return None
  return getattr(core, "KNOWN_KERNELS", None)


def kernel_computation(kernel_hash: bytes, module: bytes):
  """A jitted one-op computation holding one Mosaic GPU kernel's custom call, with the target,
  module, hash and flags its own lowering gives it (compiled, never run: its result shape does
  not matter)."""
  call = jax.ffi.ffi_call(MOSAIC_TARGET, jax.ShapeDtypeStruct((1,), jnp.int8))
  return jax.jit(lambda: call(kernel_hash=kernel_hash, module=module, use_custom_barrier=False,
                              uses_xla_collective_metadata=False))


def compile_kernel(kernel_hash: bytes, module: bytes) -> None:
  """Compiles one Mosaic GPU kernel into Mosaic GPU's kernel cache."""
  kernel_computation(kernel_hash, module).lower().compile()


def _compile_quietly(kernel_hash: bytes, module: bytes) -> None:
  try:
    compile_kernel(kernel_hash, module)
  except Exception as e:  # XLA compiles it again in the computation's compile and reports there
    logger.debug("parallel compile of a Mosaic GPU kernel failed: %s", e)


def _host_cores() -> int:
  """The cores this process may run on (a container's or ``taskset``'s share, not the host's)."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # no sched_getaffinity (macOS)
    return max(1, os.cpu_count() or 1)


def submit_new_kernels() -> int:
  """Hands every Mosaic GPU kernel lowered so far and not yet handed over to the pool, longest
  module first; returns how many. A no-op off GPU or when disabled."""
  global _pool
  known = _known_kernels()
  if not _enabled or not known or jax.default_backend() != "gpu":
    return 0
  with _lock:
    new = [(h, m) for h, m in list(known.items()) if h not in _submitted]
    if not new:
      return 0
    _submitted.update(h for h, _ in new)
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(max_workers=_host_cores(),
                                                    thread_name_prefix="mosaic_compile")
    new.sort(key=lambda hm: len(hm[1]), reverse=True)
    _futures[:] = [f for f in _futures if not f.done()]
    _futures.extend(_pool.submit(_compile_quietly, h, m) for h, m in new)
  return len(new)


def wait() -> None:
  """Blocks until every kernel handed to the pool is compiled (or failed)."""
  with _lock:
    pending = list(_futures)
    _futures.clear()
  concurrent.futures.wait(pending)


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs, kwargs
  if event == LOWERING_DONE_EVENT:
    submit_new_kernels()


def install() -> None:
  """Registers the listener that starts the pool's compiles after each lowering (once)."""
  global _installed
  with _lock:
    if _installed:
      return
    _installed = True
  jax.monitoring.register_event_duration_secs_listener(_on_event)
