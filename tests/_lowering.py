"""Cross-lowering for CUDA on a machine without a GPU, shared by the kernel tests."""

from __future__ import annotations

import contextlib

import jax
import pytest


@contextlib.contextmanager
def skip_if_cuda_lowering_needs_a_gpu():
  """Skips the test where this jax cannot lower for a platform it lacks (jax >= 0.11 needs a
  GPU or an abstract device to lower for ``cuda``); any other error propagates."""
  try:
    yield
  except RuntimeError as e:
    if "GPU" not in str(e):
      raise
    pytest.skip(f"cannot lower for cuda here: {e}")


def lower_for_cuda(fn, *args) -> str:
  """The StableHLO text of ``jax.jit(fn)(*args)`` lowered for ``cuda`` (see
  :func:`skip_if_cuda_lowering_needs_a_gpu`)."""
  with skip_if_cuda_lowering_needs_a_gpu():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
