"""Mosaic GPU kernels compiled on a thread pool after each lowering (pallas_kernels.mosaic.parallel_compile).

Off a GPU nothing is compiled; what is checked here is that the pool's one-op computation carries
exactly the custom call (target, module, hash, flags) the kernel's own lowering produced, so that
Mosaic GPU's kernel cache, keyed by that hash, serves XLA's compile; and that a lowering hands
each new kernel to the pool once."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic import parallel_compile as pc
from pallas_kernels.mosaic import stacked_matmul
from tests._lowering import skip_if_cuda_lowering_needs_a_gpu

BF16 = jnp.bfloat16


def _custom_call_configs(lowered) -> list:
  """``(call target, str(backend_config))`` of every custom call in a lowered computation."""
  found = []

  def visit(op):
    op = op.operation
    if op.name == "stablehlo.custom_call":
      found.append((str(op.attributes["call_target_name"]).strip('"'),
                    str(op.attributes["mhlo.backend_config"])
                    if "mhlo.backend_config" in op.attributes else None))
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner)

  visit(lowered.compiler_ir("stablehlo").operation)
  return found


def _lower_stacked_matmul(k: int, k_in: int = 256):
  x = jax.ShapeDtypeStruct((128, k_in), BF16)
  w = jax.ShapeDtypeStruct((2, k_in, k), BF16)
  fn = lambda x, w: stacked_matmul.stacked_matmul(x, w, jnp.int32(1))
  with skip_if_cuda_lowering_needs_a_gpu():
    return jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))


def test_the_pools_call_is_the_kernels_own():
  """Same target, module, hash and flags as the kernel's custom call in a computation."""
  lowered = _lower_stacked_matmul(128)
  calls = [c for c in _custom_call_configs(lowered) if c[0] == pc.MOSAIC_TARGET]
  assert len(calls) == 1
  # The kernel is among those Mosaic GPU's lowerings recorded (the newest, unless an earlier
  # test lowered the same one), and the pool's call for it is the same custom call.
  kernel_hash, module = next((h, m) for h, m in reversed(list(pc._known_kernels().items()))
                             if _config_of(h, m) == calls[0][1])
  assert len(kernel_hash) == 32 and module.startswith(b"ML\xefR")  # sha256, MLIR bytecode


def _config_of(kernel_hash: bytes, module: bytes) -> str:
  """The backend config of the custom call in the pool's computation for this kernel."""
  with skip_if_cuda_lowering_needs_a_gpu():
    lowered = pc.kernel_computation(kernel_hash, module).trace().lower(lowering_platforms=("cuda",))
  (target, config), = _custom_call_configs(lowered)
  assert target == pc.MOSAIC_TARGET
  return config


def test_each_lowering_hands_its_new_kernels_to_the_pool_once(monkeypatch):
  """The listener installed by importing pallas_kernels.mosaic submits a lowering's new kernels
  (on a GPU backend, here pretended), longest module first, and never the same kernel twice."""
  compiled = []
  monkeypatch.setattr(pc, "_compile_quietly", lambda h, m: compiled.append(h))
  monkeypatch.setattr(pc.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pc, "_submitted", set(pc._known_kernels()))  # earlier tests' kernels
  # Shapes no other test lowers: a kernel an earlier test lowered in this process is known
  # already (and its lowering cached), so it would never count as new here.
  _lower_stacked_matmul(256, k_in=640)
  pc.wait()
  assert len(compiled) == 1 and compiled[0] in pc._known_kernels()
  _lower_stacked_matmul(256, k_in=640)  # the same kernel again: nothing new
  pc.wait()
  assert len(compiled) == 1
  monkeypatch.setattr(pc, "_enabled", False)
  _lower_stacked_matmul(384, k_in=640)
  pc.wait()
  assert len(compiled) == 1
  monkeypatch.setattr(pc, "_enabled", True)
  assert pc.submit_new_kernels() == 1  # the disabled lowering's kernel, at the next chance
  pc.wait()
  assert len(compiled) == 2


def test_nothing_is_compiled_off_a_gpu(monkeypatch):
  compiled = []
  monkeypatch.setattr(pc, "_compile_quietly", lambda h, m: compiled.append(h))
  monkeypatch.setattr(pc, "_submitted", set())
  assert jax.default_backend() != "gpu"
  assert pc.submit_new_kernels() == 0 and not compiled
