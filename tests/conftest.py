"""Fixtures shared by the test modules that ask for them (none is autouse), and the order in which
pytest-xdist hands the test files to its workers."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import pathlib

import pytest

# The test files that take longest on the 2-core CI machine, longest first (their time in a run
# of 2026-12-03: 64 s down to 11 s, workers pinned, the legacy emitter where adopted). With
# --dist loadfile a worker runs a whole file, and xdist hands files out in the order of their
# number of tests: a long file with few tests (the notebook's one test) started last left the
# other worker idle for its whole run. Starting the long files first leaves only short ones to
# even out the two workers at the end. A new file that takes more than about 10 s belongs in
# this list.
LONGEST_FIRST = (
    "test_flax_binding.py",
    "test_train_models.py",
    "test_parallel.py",
    "test_fused_dw_mosaic.py",
    "test_ablations_notebook.py",
    "test_stacked_matmul.py",
    "test_lowp.py",
    "test_experiments_smoke.py",
    "test_bench_models.py",
    "test_optimizers.py",
    "test_models.py",
    "test_stabilizers.py",
    "test_experiments_train.py",
    "test_numerics.py",
    "test_reliability.py",
    "test_nnx.py",
    "test_nonfinite.py",
    "test_fused_linear_update.py",
    "test_hf_parity.py",
    "test_fused_dw_kernel.py",
)


def pytest_configure(config):
  """Each pytest-xdist worker on its own share of the CPUs (one core each on the 2-core CI
  machine), set before jax starts its backend.

  XLA's CPU client sizes its thread pools by the CPUs the process may run on: unpinned, each
  worker (and each process a test starts: test_parallel's 8-device process, the notebook's
  kernel, the benchmark workers) runs as many threads as the machine has cores, and two workers
  on two cores contend for them. Pinned, a worker and its subprocesses keep to their share: the
  suite took 384 s instead of 443 to 466 s on the 2-core machine, with less CPU time (11:54
  instead of 12:14 to 13:05 user). With more workers than CPUs nothing is pinned.

  On a GPU host the workers share the GPU: each allocates on demand
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set) instead of taking jax's default 75% of
  the device's memory at start-up, which leaves the other worker a quarter. (On an H100 the GPU
  tests under two preallocating workers failed and crashed both workers; allocating on demand,
  they pass: experiments/results/h100/2026-12-05_20a7f1d/README.md.)
  """
  del config
  worker = os.environ.get("PYTEST_XDIST_WORKER", "")
  count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
  if not worker.startswith("gw") or count < 2:
    return
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if not hasattr(os, "sched_setaffinity"):
    return
  cpus = sorted(os.sched_getaffinity(0))
  share = len(cpus) // count
  if share < 1:
    return
  index = int(worker[2:]) % count
  os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])


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


@contextlib.contextmanager
def _compile_overrides(*, fresh: bool = False, **options):
  """Every XLA compile in the block takes ``options`` (per-compile debug options, where the
  caller has not set them), on a CPU backend whose XLA knows each; else nothing changes.
  ``fresh``: also drop the executables compiled before the block (see below)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import compiler  # pylint: disable=g-import-not-at-top
  from tests._xla_flags import knows_option  # pylint: disable=g-import-not-at-top

  real = getattr(compiler, "get_compile_options", None)
  if (real is None or jax.default_backend() != "cpu"
      or not all(knows_option(name, value) for name, value in options.items())):
    yield
    return

  signature = inspect.signature(real)  # the real one's, through another override's functools.wraps

  @functools.wraps(real)
  def with_options(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    overrides = dict(bound.arguments.get("env_options_overrides") or {})
    for name, value in options.items():
      overrides.setdefault(name, value)
    bound.arguments["env_options_overrides"] = overrides
    return real(*bound.args, **bound.kwargs)

  # jax's in-memory caches key a compiled program by function and arguments, not by compile
  # options: drop the executables compiled with the options on the way out, so that a later
  # program is compiled afresh (and, if fresh, those compiled without them on the way in).
  if fresh:
    jax.clear_caches()
  compiler.get_compile_options = with_options
  try:
    yield
  finally:
    compiler.get_compile_options = real
    jax.clear_caches()


def _legacy_cpu_emitter():
  return _compile_overrides(xla_cpu_use_fusion_emitters=False)


@pytest.fixture(scope="module")
def legacy_cpu_emitter():
  """XLA:CPU's legacy elemental emitter instead of its MLIR fusion emitters, for the compiles
  of the module (``xla_cpu_use_fusion_emitters=false``, a per-compile option; nothing where
  this jaxlib lacks the option or the backend is not the CPU).

  It halves compile time, which is most of what these tests spend on a CPU (the suite on the
  2-core machine: 322 s with it, 384 s without). The HLO passes (fusion, buffer assignment,
  copies, aliasing) are the same; only each fusion's machine code comes from the other emitter,
  which may round an element differently. The modules whose checks hold FORGE within a few
  float32 ulps of optax over several steps (test_flax_binding, test_train_models,
  test_optimizers) keep the default emitter: under the legacy one 7 of their cases missed
  their tolerances. Every other module passes under either. A module opts in with
  ``pytest.mark.usefixtures("legacy_cpu_emitter")``; a test of those modules that compares
  nothing with optax (compiled HLO, errors, bit-exact reruns), with
  ``legacy_cpu_emitter_for_test``.
  """
  with _legacy_cpu_emitter():
    yield


@pytest.fixture
def legacy_cpu_emitter_for_test():
  """``legacy_cpu_emitter`` for one test."""
  with _legacy_cpu_emitter():
    yield


@pytest.fixture
def bf16_as_written():
  """XLA keeps every bfloat16 (and other narrow float) value of the program rounded as written
  (``xla_allow_excess_precision=false``) for the test's compiles on a CPU. By default XLA may
  keep an elementwise result in float32 where it feeds a fused consumer such as its own dot,
  while a custom call (a Pallas kernel) reads it rounded: the kernels and the "xla" route then
  see different bf16 inputs in a model."""
  with _compile_overrides(fresh=True, xla_allow_excess_precision=False):
    yield


@pytest.fixture
def fast_subprocess_compiles(monkeypatch):
  """``fast_cpu_compiles`` for the processes a test starts, through XLA_FLAGS (which they read
  at start-up), with the legacy emitter of ``legacy_cpu_emitter`` where this jaxlib has it (tests/_xla_flags:
  ``fast_cpu_flags``). Their tests check what the processes write, not values to an ulp, and
  CPU step times are meaningless anyway."""
  from tests._xla_flags import fast_cpu_flags  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XLA_FLAGS", fast_cpu_flags())


@pytest.fixture(scope="module")
def module_compilation_cache(tmp_path_factory):
  """jax's persistent compilation cache, for this module only: a program the module compiles
  again (the same init or step, built by several tests or runs) is compiled once and loaded after.

  Every program is kept (no minimum compile time or size). ``reset_cache`` makes jax read the
  settings again (it decides once per process otherwise). A module opts in with
  ``pytestmark = pytest.mark.usefixtures("module_compilation_cache")``.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cc  # pylint: disable=g-import-not-at-top

  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {n: getattr(jax.config, n) for n in names}
  for n, v in zip(names, (str(tmp_path_factory.mktemp("jax_cache")), 0.0, 0)):
    jax.config.update(n, v)
  cc.reset_cache()
  yield
  for n, v in saved.items():
    jax.config.update(n, v)
  cc.reset_cache()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config, log):
  """--dist loadfile with LONGEST_FIRST's files handed out first (the others after them, in
  xdist's order)."""
  if config.getoption("dist", None) != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class LongestFirst(LoadFileScheduling):

    def _assign_work_unit(self, node):
      # The first call comes once every file is queued, before any is handed out.
      if not getattr(self, "_ordered", False):
        self._ordered = True
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        order = sorted(self.workqueue, key=lambda f: rank.get(pathlib.PurePath(f).name, len(rank)))
        self.workqueue = collections.OrderedDict((f, self.workqueue[f]) for f in order)
      super()._assign_work_unit(node)

  return LongestFirst(config, log)


@pytest.fixture
def fake_gpu(monkeypatch):
  """``forge_jax._fused`` sees a GPU; each fused-update kernel entry records ``(name, config,
  interpret)`` in the returned list and returns the reference's result."""
  import pallas_kernels as fd  # pylint: disable=g-import-not-at-top
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  from pallas_kernels import mosaic as fm  # pylint: disable=g-import-not-at-top
  from pallas_kernels.mosaic import uninitialized  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  calls = []

  def fake(name):
    def run(x, dy, w, slots, scalars, update_fn, *, layer=None, config=None,
            compute_grad_sq_norm=False, interpret=False, config_checked=False, **rounding):
      calls.append((name, config, interpret))
      return fd.fused_dw_update_reference(
          x, dy, w, slots, scalars, update_fn, layer=layer, compute_grad_sq_norm=compute_grad_sq_norm,
          **rounding)  # weight_codec, seed, step: the kernels write the reference's bits
    return run

  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  # Buffers a GPU leaves unwritten are zeros here (an empty Mosaic kernel cannot run on a CPU).
  monkeypatch.setattr(uninitialized, "uninitialized",
                      lambda shape, dtype, tag=0: jax.numpy.zeros(shape, dtype))
  monkeypatch.setattr(fd, "fused_dw_update", fake("pallas"))
  monkeypatch.setattr(fm, "fused_dw_update_mosaic", fake("mosaic"))
  return calls
