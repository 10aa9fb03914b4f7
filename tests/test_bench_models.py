"""experiments/bench_models.py on CPU: every implementation's worker runs, and
the table, capacity and time-budget modes write their results.

Each row is a subprocess that imports jax and compiles a tiny model, so the
rows are few, one timed step each, and XLA's CPU backend skips its expensive
optimizations (compile time dominates here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time

import pytest

from experiments import bench_models

# tests/conftest.py; the cache compiles once what several tests build in this process (the same
# model's init, FORGE's step compiled next to its state and from its shapes).
pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter", "module_compilation_cache")

TINY = ["--models", "tiny-qwen3", "--tokens", "16", "--steps", "1"]


@pytest.fixture(autouse=True)
def _cpu_workers(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("BENCH_TAG", raising=False)


# Only the tests that start processes set their XLA_FLAGS: jax's cache key holds XLA_FLAGS, so an
# in-process compile under them would miss what the module-scoped fixtures compiled without.
@pytest.mark.usefixtures("fast_subprocess_compiles")
def test_table_row_runs_in_a_worker_process_compiled_into_a_fresh_cache(tmp_path):
  """int8-state FORGE with stochastically rounded weights, unrolled, without remat (a row
  option), in its worker process at batch 2, compiled first into a fresh cache: the file's only
  real worker process. The rows of a --batch list, batch-major, are checked without workers in
  test_time_budget_skips_rows_and_still_writes_results; plain FORGE's step is built and run in
  this process by the forge_step fixture; optax's scanned row runs in a worker process of its own
  in tests/test_experiments_reproduce.py (there its step comes from a precompiled cache, here
  nothing is cached: one such worker, the costlier step, covers it)."""
  impls = ["forge_int8_sr_unrolled:remat=none"]
  began = time.time()
  bench_models.main(["--out", str(tmp_path), *TINY, "--batch", "2",
                     "--impls", ",".join(impls), "--compile-cache", str(tmp_path / "cold_cache"),
                     "--compile-first"])
  result = json.loads((tmp_path / "bench_models.json").read_text())
  rows = result["rows"]
  assert [(r["batch"], r["impl"]) for r in rows] == [(2, i) for i in impls]
  for r in rows:
    assert "error" not in r, r
    # Without --precompile, a fresh cache holds no step: each worker compiles its own, and its
    # compile_s is its own. (The cache --precompile fills, loaded by the timed workers, is
    # checked end to end in tests/test_experiments_reproduce.py.)
    assert not r["step_from_cache"] and not r["init_from_cache"] and r["compile_first"]
    assert r["compile_s"] > 0 and "compile_parallel" not in r
    assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0
    # Device time: the median of 3 repeats of back-to-back steps.
    assert len(r["step_ms_repeats"]) == 3 and r["step_ms"] == sorted(r["step_ms_repeats"])[1]
    # The timed steps' wall-clock window, where reproduce --clocks matches the GPU's samples.
    t0, t1 = r["steps_window"]
    assert began < t0 and t0 + 3 * r["step_ms"] / 1e3 <= t1 < time.time()
    assert math.isfinite(r["loss"]) and r["wall_s"] > 0
    assert not r["scan"] and r["remat"] == "none"  # the row's options, over the run's
    assert math.isnan(r["peak_gib"])  # CPU: no memory_stats()
    assert r["loss_fn"] == "lean"
    assert math.isnan(r["limit_gib"])  # CPU: no allocator limit reported
  meta = result["meta"]
  assert meta["device"] == "cpu" and meta["remat"] == "full" and meta["dtype"] == "bfloat16"
  assert meta["loss"] == "lean" and "loss lean (models.cross_entropy, its gradient written over the logits)" in (tmp_path / "bench_models.md").read_text()
  assert meta["timing"] == "median3" and "median of 3 repeats" in (tmp_path / "bench_models.md").read_text()
  md = (tmp_path / "bench_models.md").read_text()
  assert "| vs optax_clip |" in md and "| vs optax |" in md
  assert "| tiny-qwen3 | 2x16 | forge_int8_sr_unrolled:remat=none | unrolled | none | bfloat16 |" in md
  assert "attention auto" in md and "remat full" in md
  assert "Allocator limit (what OOM means): not reported (jax's default" in md
  if importlib.util.find_spec("matplotlib") is not None:
    assert (tmp_path / "bench_models.png").stat().st_size > 0


@pytest.fixture(scope="module")
def forge_step():
  """FORGE's step on tiny-qwen3 in float32 with the lean loss, compiled next to its state: the
  row, the metrics of its first step and of one more, and the state after that second step, on
  the host (the step donates its state, so the tests share these copies, not the step)."""
  import jax
  row, step, (state, metrics) = bench_models.build_step("tiny-qwen3", "forge", 1, 16, "float32", "auto")
  state, metrics2 = step(state)
  return row, jax.device_get((metrics, metrics2)), jax.device_get(jax.tree.leaves(state))


def test_worker_loss_kinds_agree(forge_step):
  """--loss optax (the earlier runs' spelling) and lean train the same step: the same loss to
  float32 rounding, before and after an update (so the same gradient too)."""
  import jax
  lean_row, lean_metrics, _ = forge_step
  row, step, (state, metrics) = bench_models.build_step("tiny-qwen3", "forge", 1, 16, "float32", "auto",
                                                        "optax")
  assert (lean_row["loss_fn"], row["loss_fn"]) == ("lean", "optax")
  assert set(bench_models.LOSSES) == {"lean", "optax"}  # a new kind needs its row here
  optax_metrics = jax.device_get((metrics, step(state)[1]))
  for lean, optax_ in zip(lean_metrics, optax_metrics):
    assert float(lean["loss"]) == pytest.approx(float(optax_["loss"]), rel=1e-5)
  assert float(lean_metrics[1]["loss"]) != float(lean_metrics[0]["loss"])  # the update moved it


def test_capacity_records_every_tried_batch(monkeypatch, tmp_path):
  """--capacity doubles the batch until a row fails (out of memory here) and keeps every row it
  tried. The rows come from a fake worker: this is the search and its tables (real workers run
  in test_table_row_runs_in_a_worker_process_compiled_into_a_fresh_cache)."""
  seen = []

  def fake_run(cmd, env=None, timeout=None, **kw):
    batch = int(cmd[cmd.index("--batch") + 1])
    seen.append(batch)
    if batch == 4:
      return bench_models.subprocess.CompletedProcess(
          cmd, 1, stdout='PLAN {"init_peak_gib": 0.5, "xla_step_gib": 9.0, "limit_gib": 8.0}\n',
          stderr="W bfc_allocator.cc:501] Allocator (GPU_0_bfc) ran out of memory trying to "
                 "allocate 9.00GiB\njax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n")
    row = {"model": "tiny-qwen3", "impl": "forge", "batch": batch, "tokens": 16, "dtype": "bfloat16",
           "param_dtype": "bfloat16", "scan": True, "remat": "full", "peak_gib": 2.0 * batch,
           "step_ms": 2.0, "tokens_per_s": 8.0 * batch, "loss": 1.0, "device": "fake", "limit_gib": 8.0}
    return bench_models.subprocess.CompletedProcess(cmd, 0, stdout="ROW " + json.dumps(row), stderr="")

  monkeypatch.setattr(bench_models.subprocess, "run", fake_run)
  bench_models.main(["--out", str(tmp_path), *TINY, "--capacity", "--max-batch", "8",
                     "--impls", "forge"])
  assert seen == [1, 2, 4]  # 8 is not tried once 4 failed
  results = json.loads((tmp_path / "capacity.json").read_text())["results"]
  assert len(results) == 1
  s = results[0]
  assert [r["batch"] for r in s["tried"]] == [1, 2, 4]
  assert all("error" not in r for r in s["tried"][:2]) and s["tried"][2]["error"] == "OOM"
  assert s["tried"][2]["xla_step_gib"] == 9.0 and "9.00GiB" in s["tried"][2]["error_detail"]
  assert (s["largest_batch"], s["peak_gib"], s["tokens_per_s"]) == (2, 4.0, 16.0)
  assert (s["first_fail_batch"], s["first_fail_error"]) == (4, "OOM") and not s["skipped"]
  assert "| tiny-qwen3 | forge | scanned | 16 | 2 | 4.00 | 16 | 4 | OOM | 1, 2, 4 (OOM) |" in (
      tmp_path / "capacity.md").read_text()


@pytest.mark.usefixtures("fast_subprocess_compiles")  # the device probe's process
def test_time_budget_skips_rows_and_still_writes_results(monkeypatch, tmp_path):
  bench_models.main(["--out", str(tmp_path), *TINY, "--batch", "1,2", "--impls",
                     "optax_clip,forge_unrolled", "--time-budget", "0"])
  rows = json.loads((tmp_path / "bench_models.json").read_text())["rows"]
  assert len(rows) == 4 and all(r["error"] == bench_models.SKIPPED for r in rows)
  # Every batch x impl of the lists, batch-major (the table's row order).
  assert [(r["batch"], r["impl"]) for r in rows] == [(b, i) for b in (1, 2)
                                                     for i in ("optax_clip", "forge_unrolled")]
  assert "| tiny-qwen3 | 1x16 | forge_unrolled | unrolled |" in (tmp_path / "bench_models.md").read_text()
  # No row ran, so no worker reported the device: it is asked of jax (it read "unknown").
  assert json.loads((tmp_path / "bench_models.json").read_text())["meta"]["device"] == "cpu"
  # (The device was asked of jax above: the second run names it without starting jax again.)
  monkeypatch.setattr(bench_models.Runner, "device_name", lambda self: "cpu")
  bench_models.main(["--out", str(tmp_path), *TINY, "--capacity", "--impls", "forge",
                     "--time-budget", "0"])
  s = json.loads((tmp_path / "capacity.json").read_text())["results"][0]
  assert [r["batch"] for r in s["tried"]] == [1] and s["skipped"] and s["largest_batch"] == 0


def test_implementation_names():
  assert bench_models.parse_impl("forge_int8") == ("forge_int8", True)
  assert bench_models.parse_impl("optax_unrolled") == ("optax", False)
  assert bench_models.parse_impl("forge_int8_xla_unrolled") == ("forge_int8_xla", False)
  assert bench_models.forge_backend("forge_int8_xla") == ("forge_int8", "xla")
  assert bench_models.forge_backend("forge") == ("forge", "auto")
  with pytest.raises(ValueError, match="Unknown implementation 'optax_xla'"):
    bench_models.parse_impl("optax_xla")
  with pytest.raises(ValueError):
    bench_models.parse_impl("sgd")
  with pytest.raises(SystemExit):
    bench_models.main(["--impls", "forge,sgd"])


def test_memory_analysis_compiles_from_shapes_and_finds_the_state_aliased(tmp_path):
  """FORGE's step from shapes, float32 as forge_step's (the module's compilation cache then holds
  it), and with int8 states. (The optax branch of memory_analysis.analyse compiles in
  tests/test_experiments_smoke.py's capacity_plan test.)"""
  from experiments import memory_analysis
  memory_analysis.main(["--model", "tiny-qwen3", "--tokens", "16", "--dtype", "float32",
                        "--impls", "forge,forge_int8,bogus", "--out", str(tmp_path), "--hlo"])
  rows = json.loads((tmp_path / "memory_analysis.json").read_text())["rows"]
  forge, int8, bogus = rows
  assert "Unknown implementation 'bogus'" in bogus["error"]
  for r in (forge, int8):
    # The donated state is reused for the outputs: everything aliased.
    assert abs(r["step"]["alias_gib"] - r["state_gib"]) < 1e-3 * r["state_gib"]
    assert r["stack_buffers"] and (tmp_path / "hlo" / f"tiny-qwen3_{r['impl']}_lean_L2.hlo.txt").exists()
  assert int8["forge_state_gib"] < 0.6 * forge["forge_state_gib"]


def test_memory_analysis_compares_the_losses(tmp_path):
  """--loss lean,optax: each impl with each loss, side by side (FORGE's float32 step, whose two
  losses test_worker_loss_kinds_agree compiles too). (What the lean loss saves shows where the
  logits dominate, at a real vocabulary: test_models tests it; here tiny-qwen3's 256-token
  vocabulary leaves the peak elsewhere, so only the plumbing is checked.)"""
  from experiments import memory_analysis
  memory_analysis.main(["--model", "tiny-qwen3", "--tokens", "16", "--dtype", "float32", "--impls", "forge",
                        "--loss", "lean,optax", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "memory_analysis.json").read_text())["rows"]
  assert [(r["impl"], r["loss_fn"]) for r in rows] == [("forge", "lean"), ("forge", "optax")]
  assert all("error" not in r for r in rows)
  with pytest.raises(SystemExit):
    memory_analysis.main(["--model", "tiny-qwen3", "--loss", "fast", "--out", str(tmp_path)])


def test_oom_rows_keep_the_allocators_line():
  stderr = ("2026-11-30 13:09:20 W external/xla/xla/tsl/framework/bfc_allocator.cc:501] Allocator "
            "(GPU_0_bfc) ran out of memory trying to allocate 20.00GiB (rounded to 21474836480)\n"
            "Traceback (most recent call last):\n"
            "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
            "21474836480 bytes.\n")
  assert bench_models._error(stderr, 1) == "OOM"
  assert "20.00GiB" in bench_models._oom_detail(stderr)
  assert bench_models._oom_detail("ValueError: bad shape") == ""


def test_a_worker_that_dies_after_compiling_keeps_its_plan():
  out = ('PLAN {"init_peak_gib": 14.9, "xla_step_gib": 91.4, "limit_gib": 125.8}\n'
         "2026 W bfc_allocator.cc] ran out of memory\n")
  row, plan = bench_models.parse_worker_output(out)
  assert row is None and plan == {"init_peak_gib": 14.9, "xla_step_gib": 91.4, "limit_gib": 125.8}
  row, plan = bench_models.parse_worker_output(out.encode() + b'ROW {"impl": "forge"}\n')
  assert row == {"impl": "forge"} and plan["xla_step_gib"] == 91.4  # bytes: TimeoutExpired.stdout
  assert bench_models.parse_worker_output("") == (None, {})
  meta = {"command": "c", "date": "d", "device": "H200", "jax": "0.11.2", "dtype": "bfloat16",
          "attention": "auto", "remat": "full", "loss": "lean", "steps": 5, "timing": "median3",
          "timeout_s": 300, "time_budget_s": None, "limit_gib": 125.8, "mem_fraction": None}
  oom = {"model": "llama-3.1-8b", "batch": 40, "tokens": 1024, "impl": "optax_clip", "scan": True,
         "error": "OOM", "wall_s": 44.0, **plan}
  md = bench_models.markdown([oom], meta)
  assert "| llama-3.1-8b | 40x1024 | optax_clip | scanned | full |  | OOM | | 14.90 | 91.40 |" in md
  assert "Allocator limit (what OOM means): 125.8 GiB (jax's default" in md
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in bench_models.markdown([oom], {**meta, "mem_fraction": 0.95})
  assert "allocated on demand" in md
  assert "whole limit preallocated" in bench_models.markdown([oom], {**meta, "preallocate": True})
  assert "Date: d; device H200; jax 0.11.2.  " in md  # no FORGE row reported a table
  table = {**meta, "auto_table": "auto_table_h100.json (NVIDIA H100 80GB HBM3, 2026-12-05, commit 20a7f1d)"}
  assert ("jax 0.11.2; FORGE's `\"auto\"` read auto_table_h100.json (NVIDIA H100 80GB HBM3, "
          "2026-12-05, commit 20a7f1d).") in bench_models.markdown([oom], table)


def test_runs_say_which_auto_table_a_gpu_reads():
  from experiments import _timing
  from forge_jax import _auto
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
    path = _auto.table_path(kind)
    prov = _auto.read_table(path).provenance
    said = _timing.auto_table_used(kind)
    assert said.startswith(f"{path.name} ({prov['device']}, {prov['date'][:10]}, commit "), said


def test_mem_fraction_reaches_the_workers():
  assert bench_models.worker_env(0.95)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
  assert bench_models.worker_env(None)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert bench_models.worker_env(None, preallocate=True)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  with pytest.raises(SystemExit):
    bench_models.main(["--mem-fraction", "1.5"])


def test_memory_analysis_per_layer(tmp_path):
  from experiments import memory_analysis
  # Two layer counts show the growth; each more unrolled layer is more step to compile. optax's
  # step compiles in about two thirds of FORGE's here; --layers cuts any impl's model alike.
  rows = memory_analysis.main(["--model", "tiny-llama", "--tokens", "16", "--impls", "optax_unrolled",
                               "--layers", "1,2", "--out", str(tmp_path)])
  assert [r["layers"] for r in rows] == [1, 2] and all("error" not in r for r in rows)
  # An unrolled layer's params are arguments of the step: they grow with the layers.
  assert rows[1]["state_gib"] > rows[0]["state_gib"]
  assert "| optax_unrolled | lean |" in (tmp_path / "memory_analysis.md").read_text()
  synthetic = [{"impl": "a", "loss_fn": "lean", "layers": l, "step": {"temp_gib": 2.0 + 0.5 * l}}
               for l in (1, 2, 4, 8)]
  (g,) = memory_analysis.per_layer(synthetic)
  assert g["slope_gib_per_layer"] == pytest.approx(0.5) and g["constant_gib"] == pytest.approx(2.0)
  with pytest.raises(SystemExit):
    memory_analysis.main(["--layers", "0", "--out", str(tmp_path)])


def test_runner_passes_the_limit_and_keeps_the_plan_of_a_cut_worker(monkeypatch, tmp_path):
  """--mem-fraction reaches the worker's environment, and a worker cut by its timeout after
  compiling keeps XLA's plan (TimeoutExpired.stdout is bytes)."""
  import subprocess
  seen = {}

  def fake_run(cmd, env=None, timeout=None, **kw):
    seen["env"] = env
    raise subprocess.TimeoutExpired(cmd, timeout, output=b'PLAN {"xla_step_gib": 91.4, "limit_gib": 125.8}\n')

  monkeypatch.setattr(bench_models.subprocess, "run", fake_run)
  monkeypatch.setattr(bench_models.Runner, "device_name", lambda self: "fake")
  bench_models.main(["--out", str(tmp_path), *TINY, "--impls", "forge", "--mem-fraction", "0.95"])
  assert seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
  assert seen["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  bench_models.main(["--out", str(tmp_path / "pre"), *TINY, "--impls", "forge", "--preallocate"])
  assert seen["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  assert json.loads((tmp_path / "pre" / "bench_models.json").read_text())["meta"]["preallocate"]
  (row,) = json.loads((tmp_path / "bench_models.json").read_text())["rows"]
  assert row["error"].startswith("timeout") and row["xla_step_gib"] == 91.4
  meta = json.loads((tmp_path / "bench_models.json").read_text())["meta"]
  assert meta["mem_fraction"] == 0.95 and meta["limit_gib"] == 125.8


def test_precompile_workers_never_preallocate(monkeypatch, tmp_path):
  """With --preallocate the timed worker reserves the whole limit, but the --precompile workers
  share the device several at a time, so they allocate on demand."""
  seen = []

  def fake_run(cmd, env=None, timeout=None, **kw):
    seen.append(("--compile-only" in cmd, env["XLA_PYTHON_CLIENT_PREALLOCATE"]))
    raise bench_models.subprocess.TimeoutExpired(cmd, timeout, output=b"")

  monkeypatch.setattr(bench_models.subprocess, "run", fake_run)
  monkeypatch.setattr(bench_models.Runner, "device_name", lambda self: "fake")
  bench_models.main(["--out", str(tmp_path), *TINY, "--impls", "forge,optax", "--preallocate",
                     "--precompile", "2", "--compile-cache", str(tmp_path / "cache")])
  assert sorted(seen) == [(False, "true"), (False, "true"), (True, "false"), (True, "false")]


def test_oom_detail_prefers_the_allocators_line():
  stderr = ("W autotuner: out of memory while trying a candidate (ignored)\n"
            "W bfc_allocator.cc:501] Allocator (GPU_0_bfc) ran out of memory trying to allocate 20.00GiB\n"
            "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n")
  assert "20.00GiB" in bench_models._oom_detail(stderr)
  assert bench_models._oom_detail("a: out of memory (warning)\nRESOURCE_EXHAUSTED: final\n").endswith("final")


def test_compile_first_builds_the_same_step(forge_step):
  """--compile-first compiles from the state's shapes before init; the step it runs is the same
  (same first loss, same state after one more step) as the one compiled next to the state
  (forge_step). FORGE's step (its state holds the optimizer's slots and step fields, its
  train_step donates them); optax's takes the same path in build_step (a state's shapes, then
  lower and compile)."""
  import jax
  import numpy as np
  row0, (m0, _), s0 = forge_step
  row1, step, (state, m1) = bench_models.build_step("tiny-qwen3", "forge", 1, 16, "float32", "auto",
                                                    compile_first=True)
  assert row0["compile_first"] is False and row1["compile_first"] is True
  s1 = jax.device_get(jax.tree.leaves(step(state)[0]))
  np.testing.assert_array_equal(np.asarray(m0["loss"]), np.asarray(m1["loss"]))
  assert len(s0) == len(s1) and all(np.array_equal(a, b) for a, b in zip(s0, s1))


def test_compile_first_reaches_the_workers(monkeypatch, tmp_path):
  seen = {}

  def fake_run(cmd, env=None, timeout=None, **kw):
    seen["cmd"] = cmd
    raise bench_models.subprocess.TimeoutExpired(cmd, timeout, output=b"")

  monkeypatch.setattr(bench_models.subprocess, "run", fake_run)
  monkeypatch.setattr(bench_models.Runner, "device_name", lambda self: "fake")
  bench_models.main(["--out", str(tmp_path), *TINY, "--impls", "forge", "--compile-first"])
  assert "--compile-first" in seen["cmd"]
  meta = json.loads((tmp_path / "bench_models.json").read_text())["meta"]
  assert meta["compile_first"] is True
  assert "before the state exists" in (tmp_path / "bench_models.md").read_text()


def test_precompile_needs_a_compile_cache(tmp_path):
  """(Workers compiling their own step into a fresh cache:
  test_table_row_runs_in_a_worker_process_compiled_into_a_fresh_cache.)"""
  with pytest.raises(SystemExit):
    bench_models.main(["--out", str(tmp_path), *TINY, "--precompile", "2"])  # no --compile-cache


def test_row_options_override_the_run_and_refuse_bad_values():
  spec = "optax_unrolled:remat=none:master=float32:mem=0.95"
  assert bench_models.parse_spec(spec) == ("optax_unrolled", {"remat": "none", "master": "float32",
                                                              "mem": 0.95})
  assert bench_models.parse_impl(spec) == ("optax", False)
  assert bench_models.row_settings(spec, "full", None, 0.8) == {
      "remat": "none", "param_dtype": "float32", "mem_fraction": 0.95}
  assert bench_models.row_settings("forge_sr", "dots_saveable", "float32", None) == {
      "remat": "dots_saveable", "param_dtype": "float32", "mem_fraction": None}
  assert bench_models.forge_backend(bench_models.parse_impl("forge_int8_sr_xla_unrolled")[0]) == (
      "forge_int8_sr", "xla")
  for bad, match in (("optax:remat", "Bad row option 'remat'"), ("optax:speed=1", "Bad row option"),
                     ("optax:mem=1.5", r"mem='1.5'.*\(0, 1\]"), ("optax:remat=a:remat=b", "twice"),
                     ("sgd:remat=none", "Unknown implementation 'sgd'")):
    with pytest.raises(ValueError, match=match):
      bench_models.parse_spec(bad)
  with pytest.raises(SystemExit):
    bench_models.main(["--impls", "optax:mem=0"])
  assert bench_models.row_settings("forge:stacked=0")["stacked"] == 0
  for bad in ("forge:stacked=off", "optax:stacked=0"):
    with pytest.raises(ValueError, match="stacked=.*most rows for the Mosaic stacked GEMM"):
      bench_models.parse_spec(bad)


def test_a_row_sets_its_workers_stacked_gemm_limit(monkeypatch):
  """``:stacked=N`` sets ``forge_jax._fused.STACKED_GEMM_MAX_ROWS`` in the row's worker (one row
  per process) and records it."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_fused, "STACKED_GEMM_MAX_ROWS", _fused.STACKED_GEMM_MAX_ROWS)  # restored after
  row, _, _ = bench_models.build_step("tiny-qwen3", "forge:stacked=0", 1, 16, "float32", "auto",
                                      compile_only=True)
  assert row["stacked_gemm_max_rows"] == 0 and _fused.STACKED_GEMM_MAX_ROWS == 0


def test_xla_flag_sets_reach_the_workers_env(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  args = argparse.Namespace(mem_fraction=None, compile_cache=None)
  runner = bench_models.Runner(args)
  env = runner.row_env("forge:remat=none:xla=dsf+dbuf", False)
  assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=1 "
                              "--xla_gpu_enable_dynamic_slice_fusion=true "
                              "--xla_gpu_enable_while_loop_double_buffering=true")
  assert runner.row_env("forge", False)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
  with pytest.raises(ValueError, match=r"unknown flag set\(s\) \['fast'\].*dsf"):
    bench_models.parse_spec("forge:xla=dsf+fast")


def test_profile_markdown_lists_each_profiled_row():
  prof = {"calls": 2, "device_ms": 10.0, "by_kind": {"loop_fusion": 6.0, "copy": 4.0},
          "top": [{"kernel": "copy_kernel", "ops": ["copy.3"], "ms": 4.0, "count": 32.0}]}
  rows = [{"model": "m", "impl": "forge", "batch": 1, "tokens": 8, "step_ms": 11.0, "profile": prof},
          {"model": "m", "impl": "optax", "batch": 1, "tokens": 8, "profile": {"error": "no CUPTI"}},
          {"model": "m", "impl": "forge_xla", "batch": 1, "tokens": 8}]
  md = bench_models.profile_markdown(rows, {"command": "c", "date": "d", "device": "H200", "jax": "0"})
  assert "| copy | 4.00 |" in md and "| copy_kernel | 4.00 | 32 | - | copy.3 |" in md
  assert "no profile (no CUPTI)" in md and "forge_xla" not in md
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  assert [_timing._kernel_kind(k) for k in (
      "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "gemm_fusion_dot_225", "memcpy128",
      "loop_dynamic_update_slice_fusion_3", "input_reduce_fusion", "wrapped_copy_2")] == [
      "gemm", "gemm", "copy", "loop_dynamic_update_slice_fusion", "input_reduce_fusion", "copy"]


def test_busy_and_gaps_unions_streams_and_buckets_idle_time():
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  us = 1000
  # Two streams overlapping (0-50 and 20-80 us), then gaps of 5 us, 40 us and 300 us.
  t = _timing.busy_and_gaps([(0, 50 * us), (20 * us, 80 * us), (85 * us, 95 * us),
                             (135 * us, 140 * us), (440 * us, 450 * us)])
  assert t["busy_ms"] == pytest.approx((80 + 10 + 5 + 10) / 1e3)
  assert t["span_ms"] == pytest.approx(450 / 1e3)
  assert t["gaps"] == {"<10us": [1, pytest.approx(0.005)], "10-100us": [1, pytest.approx(0.04)],
                       ">=100us": [1, pytest.approx(0.3)]}
  assert _timing.busy_and_gaps([])["busy_ms"] == 0.0
  prof = {"calls": 1, "device_ms": 1.0, "by_kind": {}, "top": [], "launches": 5.0, "busy_ms": 0.105,
          "idle_ms": 0.345, "gaps": t["gaps"]}
  md = bench_models.profile_markdown([{"model": "m", "impl": "forge", "batch": 1, "tokens": 8,
                                       "step_ms": 1.0, "profile": prof}],
                                     {"command": "c", "date": "d", "device": "H200", "jax": "0"})
  assert "5 kernel launches per step; the device busy 0.1 ms, idle 0.34 ms" in md
  assert ">=100us: 1 gaps, 0.30 ms" in md


def test_duration_classes_split_one_kernel_by_shape():
  """One kernel launched on three shapes (64 x 23 us, 64 x 55 us, 160 x ~200 us in two steps):
  one class per shape, with its launches per step; the profile table shows them."""
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  us = [23.0, 23.4] * 64 + [55.0] * 128 + [198.0, 201.0, 205.0, 210.0] * 80
  assert _timing.duration_classes(us, calls=2) == [[205.0, 160.0], [55.0, 64.0], [23.4, 64.0]]
  assert _timing.duration_classes(us, calls=2, top=1) == [[205.0, 160.0]]
  prof = {"calls": 1, "device_ms": 1.0, "by_kind": {}, "launches": 2.0, "busy_ms": 1.0,
          "idle_ms": 0.0, "gaps": {}, "top": [{"kernel": "k", "ops": ["op"], "ms": 1.0, "count": 2,
                                                "durations": [[600.0, 1.0], [400.0, 1.0]]}]}
  md = bench_models.profile_markdown([{"model": "m", "impl": "forge", "batch": 1, "tokens": 8,
                                       "step_ms": 1.0, "profile": prof}],
                                     {"command": "c", "date": "d", "device": "H200", "jax": "0"})
  assert "| k | 1.00 | 2 | 600 (1), 400 (1) | op |" in md


def test_rounding_and_state_implementations():
  precision = lambda base: bench_models._forge_optimizer(base).precision
  assert precision("forge").weight_rounding == "nearest" and precision("forge").state_dtype is None
  assert precision("forge_sr").weight_rounding == "stochastic"
  assert precision("forge_int8").state_dtype == "int8" and precision("forge_int8").weight_rounding == "nearest"
  assert precision("forge_int8_sr").state_dtype == "int8"
  assert precision("forge_int8_sr").weight_rounding == "stochastic"
  assert bench_models._forge_optimizer("optax") is None


def test_remat_and_master_dtype_reach_the_model_config():
  """A row's remat and master dtype build that model: float32 weights and optax states with bf16
  compute; a row's remat the config refuses is its ValueError, before anything compiles."""
  import jax
  import jax.numpy as jnp
  row, step, (state, _) = bench_models.build_step("tiny-qwen3", "optax_unrolled:remat=none", 1, 16,
                                                  "bfloat16", "auto", master_dtype="float32")
  assert (row["remat"], row["param_dtype"], row["dtype"], row["scan"]) == ("none", "float32", "bfloat16", False)
  params, opt_state = state
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  assert jnp.dtype("float32") in {x.dtype for x in jax.tree.leaves(opt_state)}
  assert jnp.dtype("bfloat16") not in {x.dtype for x in jax.tree.leaves(opt_state)}
  assert "compile_s" in row and row["compile_s"] > 0 and not row["step_from_cache"]
  with pytest.raises(ValueError, match="remat='save_only_these_names' needs remat_names"):
    bench_models.build_step("tiny-qwen3", "forge:remat=save_only_these_names", 1, 16, "bfloat16", "auto",
                            compile_only=True)


def test_row_options_reach_the_workers_and_the_table(monkeypatch, tmp_path):
  seen = []

  def fake_run(cmd, env=None, timeout=None, **kw):
    seen.append((cmd, env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")))
    impl = cmd[cmd.index("--worker") + 1]
    row = {"model": "tiny-qwen3", "impl": impl, "batch": 1, "tokens": 16, "dtype": "bfloat16",
           "param_dtype": "float32" if "master" in impl else "bfloat16", "scan": "_unrolled" not in impl,
           "remat": cmd[cmd.index("--remat") + 1], "peak_gib": 1.0, "step_ms": 2.0, "tokens_per_s": 8.0,
           "loss": 1.0, "device": "fake", "limit_gib": 1.0}
    return bench_models.subprocess.CompletedProcess(cmd, 0, stdout="ROW " + json.dumps(row), stderr="")

  monkeypatch.setattr(bench_models.subprocess, "run", fake_run)
  bench_models.main(["--out", str(tmp_path), *TINY, "--remat", "dots_saveable", "--mem-fraction", "0.8",
                     "--impls", "optax,optax_unrolled:master=float32:mem=0.95"])
  (cmd0, mem0), (cmd1, mem1) = seen
  assert cmd0[cmd0.index("--remat") + 1] == "dots_saveable" and "--master-dtype" not in cmd0
  assert (mem0, mem1) == ("0.8", "0.95")
  result = json.loads((tmp_path / "bench_models.json").read_text())
  assert result["meta"]["remat"] == "dots_saveable"
  assert [r["mem_fraction"] for r in result["rows"]] == [0.8, 0.95]
  md = (tmp_path / "bench_models.md").read_text()
  assert "| tiny-qwen3 | 1x16 | optax_unrolled:master=float32:mem=0.95 | unrolled | dots_saveable | float32 |" in md
