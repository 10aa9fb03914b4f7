"""XLA_FLAGS for the processes that tests start (jax reads XLA_FLAGS once, when its backend
starts, so a flag for a subprocess is set before it imports jax)."""

from __future__ import annotations

import functools
import os

# LLVM without its optimizations: float-identical numbers, a third to a half off each compile.
FAST_COMPILES = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


@functools.cache
def knows_option(option: str, value) -> bool:
  """Whether this jaxlib's XLA has the debug option: an unknown name in XLA_FLAGS aborts the
  process that reads it, whereas a compile option is refused with an error."""
  import jax  # pylint: disable=g-import-not-at-top

  try:
    jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options={option: value})
  except (jax.errors.JaxRuntimeError, ValueError):  # "No such compile option"
    return False
  return True


def fast_cpu_flags(*extra: str) -> str:
  """``extra``, the caller's XLA_FLAGS and the flags that make CPU compiles of small programs
  cheap.

  Besides ``FAST_COMPILES``: the CPU backend's legacy elemental emitter instead of its MLIR
  fusion emitters (``xla_cpu_use_fusion_emitters=false``), where this XLA still has the
  choice. Compiling a tiny model's training step drops from about 2.2 s to 0.7 s with it; the
  HLO passes (fusion, buffer assignment, the collectives the SPMD partitioner inserts) are the
  same, only the machine code of each fusion comes from another emitter.
  """
  flags = [*extra, os.environ.get("XLA_FLAGS", ""), *FAST_COMPILES]
  if knows_option("xla_cpu_use_fusion_emitters", False):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return " ".join(f for f in flags if f)
