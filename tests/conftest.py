"""Fixtures shared by the test modules that ask for them (none is autouse)."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser, pluginmanager):
  """pyproject's addopts pass ``-n 2``: accept (and ignore) it when pytest-xdist is disabled
  (``-p no:xdist``) or not installed, so that the suite still runs in one process."""
  if not pluginmanager.has_plugin("xdist"):
    # The name of xdist's own group and option; a plugin-style private call, because pytest
    # reserves lowercase short options for plugins.
    parser.getgroup("xdist")._addoption(  # pylint: disable=protected-access
        "-n", "--numprocesses", dest="numprocesses", default=None,
        help="ignored: pytest-xdist is disabled or not installed")
    parser.getgroup("xdist")._addoption(  # pylint: disable=protected-access
        "--dist", dest="dist", default=None, help="ignored: pytest-xdist is disabled or not installed")


@pytest.fixture(scope="module")
def fast_cpu_compiles():
  """XLA compiles without LLVM's optimizations while the module runs.

  ``jax_disable_most_optimizations`` sets ``xla_backend_optimization_level=0`` and
  ``xla_llvm_disable_expensive_passes`` on each compile. Compilation dominates these tests on a
  CPU, and this takes a third to a half off it. XLA's HLO passes still run: the optimized HLO and
  its buffer assignment (what the in-place, copy and memory checks read) are the same, only the
  machine code is less optimized. The subprocess tests in test_bench_models and the notebook
  test already compile this way, through XLA_FLAGS. A module opts in with
  ``pytestmark = pytest.mark.usefixtures("fast_cpu_compiles")``.
  """
  import jax  # pylint: disable=g-import-not-at-top

  saved = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", saved)


@pytest.fixture
def fast_subprocess_compiles(monkeypatch):
  """The same for the processes a test starts (XLA_FLAGS, which they read at start-up; the
  numbers are float-identical here, and CPU step times are meaningless anyway)."""
  flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
