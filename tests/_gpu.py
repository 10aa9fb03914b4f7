"""The GPU cases: the compiled kernels' tests, skipped on a CPU host and selected on a GPU
machine with ``python -m pytest -q -p no:xdist -m gpu`` (the rest of the suite is written for a
CPU host: the interpreters, its tolerances and its device counts)."""

from __future__ import annotations

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"


def gpu_marks(reason: str) -> tuple:
  """The marks of a GPU case: ``gpu`` (for ``-m gpu``) and a skip without a GPU."""
  return (pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason=reason))


def gpu_case(reason: str):
  """Decorator form of :func:`gpu_marks`."""
  def wrap(f):
    for mark in gpu_marks(reason):
      f = mark(f)
    return f
  return wrap
