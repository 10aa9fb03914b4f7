"""The GPU tuning and benchmark scripts, in their CPU smoke mode (interpret).

They are run on the H200 by hand; here they must at least run end to end,
check the kernel, survive a failing config or implementation, and write
their results.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import numpy as np
import optax

import pytest

from experiments import bench_fused_dw
from experiments import tune_fused_dw
from pallas_kernels import fused_dw

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py


def test_tune_smoke_survives_a_failing_config_and_writes_results(tmp_path, monkeypatch):
  real = fused_dw.fused_dw_update

  def flaky(*args, config=None, **kwargs):
    if config is not None and config.block_k == 16:
      raise RuntimeError("simulated compile failure")
    return real(*args, config=config, **kwargs)

  monkeypatch.setattr(fused_dw, "fused_dw_update", flaky)
  assert tune_fused_dw.main(["--smoke", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "tune_fused_dw.json").read_text())
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tune_fused_dw.json", "tune_fused_dw.md"]
  assert result["selfcheck"] and all(c["status"] == "ok" for c in result["selfcheck"])
  statuses = {r["status"] for r in result["rows"]}
  assert statuses <= {"ok", "error", "skipped"} and "ok" in statuses
  assert any("simulated compile failure" in r.get("error", "") for r in result["rows"])
  for row in result["rows"]:
    if row["status"] == "ok":
      assert row["err_update"] <= tune_fused_dw.UPDATE_TOL and row["ms"] > 0
  assert set(result["best_per_shape"]) == {"48x40x72", "48x72x40"}
  assert "t<=2048" in result["table"] and "TUNED_TILES" in result["table_python"]
  assert result["info"]["command"].startswith("python -m experiments.tune_fused_dw --smoke")
  assert "| 48x40x72 |" in (tmp_path / "tune_fused_dw.md").read_text()


def test_tune_prunes_configs_that_cannot_fit():
  space = tune_fused_dw.GPU_SPACE
  too_much_smem = fused_dw.TileConfig(128, 256, 128, 8, 4)
  too_many_regs = fused_dw.TileConfig(256, 256, 32, 8, 2)
  assert "shared memory" in tune_fused_dw.infeasible(too_much_smem, space)
  assert "registers" in tune_fused_dw.infeasible(too_many_regs, space)
  assert tune_fused_dw.infeasible(tune_fused_dw.BASELINE, space) is None
  evaluated = [c for c in tune_fused_dw.coarse_configs(space) if tune_fused_dw.infeasible(c, space) is None]
  assert len(evaluated) == len(tune_fused_dw.coarse_configs(space))


def test_bench_smoke_checks_times_and_reports_every_implementation(tmp_path, monkeypatch):
  def broken(problem):
    raise RuntimeError("simulated backend failure")

  # A new implementation is one dict entry (as the Mosaic GPU kernel will be).
  monkeypatch.setitem(bench_fused_dw.IMPLEMENTATIONS, "broken", broken)
  assert bench_fused_dw.main(["--smoke", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "bench_fused_dw.json").read_text())
  rows = result["rows"]
  impls = set(bench_fused_dw.IMPLEMENTATIONS) - bench_fused_dw.GPU_ONLY  # interpreted: no mosaic
  assert {(r["impl"], r["optimizer"]) for r in rows} == {
      (i, o) for i in impls for o in bench_fused_dw.OPTIMIZERS
  }
  for row in rows:
    if row["impl"] == "broken":
      assert row["status"] == "error" and "simulated backend failure" in row["error"]
      continue
    assert row["status"] == "ok", row
    assert row["ms"] > 0 and row["frac_floor"] > 0 and row["tflops"] >= 0
    if row["impl"] != "xla_gemm":  # the ones that update weights are checked
      assert row["err_update"] <= bench_fused_dw.UPDATE_TOL
      assert row["err_slots"] <= bench_fused_dw.SLOT_TOL
  table = (tmp_path / "bench_fused_dw.md").read_text()
  assert "pallas vs xla_gemm_optax" in table and "simulated backend failure" in table


def test_bench_bf16_states_stay_bf16_on_both_sides(tmp_path):
  """--state-dtype bfloat16: weight and states are bf16 for the kernel and for optax (its
  gradient cast to the parameter's dtype, as a bf16 model's is), before and after steps."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x, dy, w0 = bench_fused_dw.make_inputs(64, 40, 72, state_dtype=jnp.bfloat16)
  p = bench_fused_dw.make_problem(x, dy, w0, "adamw", interpret=True)
  for impl in ("xla_gemm_optax", "pallas"):
    runner = bench_fused_dw.IMPLEMENTATIONS[impl](p)
    carry = runner.step(runner.step(runner.init()))
    w, slots = runner.result(carry)
    assert w.dtype == jnp.bfloat16 and all(s.dtype == jnp.bfloat16 for s in slots), impl
  assert bench_fused_dw.main(["--smoke", "--state-dtype", "bfloat16", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "bench_fused_dw.json").read_text())["rows"]
  assert rows and all(r["status"] == "ok" for r in rows), rows
  assert "Weight and optimizer states: bfloat16" in (tmp_path / "bench_fused_dw.md").read_text()


def test_bench_floor_counts_minimal_bytes():
  x, dy, w0 = bench_fused_dw.make_inputs(64, 32, 48)
  p = bench_fused_dw.make_problem(x, dy, w0, "adamw", interpret=True)
  # bf16 x and dy once; fp32 w, mu and nu read and written once.
  assert p.floor_bytes == 64 * 32 * 2 + 64 * 48 * 2 + 2 * 3 * 32 * 48 * 4
  assert p.floor_ms == pytest.approx(
      max(2 * 64 * 32 * 48 / bench_fused_dw.PEAK_FLOPS, p.floor_bytes / bench_fused_dw.PEAK_BYTES) * 1e3
  )


def test_time_steps_runs_exactly_warmup_plus_iters_times_repeats_calls():
  """The smoke timings (``warmup=0``) time the first call, with no warm-up call before it; a
  count picked from the warm-up needs one."""
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  calls = []
  step = lambda c: calls.append(c) or c + 1
  for warmup, iters, repeats in ((0, 1, 1), (2, 3, 2)):
    calls.clear()
    timing, carry = _timing.time_steps(step, 0, warmup=warmup, iters=iters, repeats=repeats)
    assert len(calls) == carry == warmup + iters * repeats and timing.iters == iters
  with pytest.raises(ValueError, match="warmup=0"):
    _timing.time_steps(step, 0, warmup=0, iters=None)


def test_dispatched_runs_n_calls_in_one_jit_without_merging_them(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  run = bench_fused_dw._dispatched(lambda c, x, dy: c + jnp.sum(x) * jnp.sum(dy))
  xs, dys = (jnp.full((4, 8), 2.0),) * 5, (jnp.full((4, 3), 1.0),) * 5
  assert float(run(jnp.float32(1.0), xs, dys)) == 1.0 + 5 * 64.0 * 12.0
  x, dy, w0 = bench_fused_dw.make_inputs(16, 8, 12)
  p = bench_fused_dw.make_problem(x, dy, w0, "adamw", interpret=True)
  xs, dys = bench_fused_dw._input_copies(p, 3)
  assert len({id(a) for a in xs + dys}) == 6 and bench_fused_dw._input_copies(p, 3)[0] is xs

  def update(carry, x, dy):
    params, state = carry
    updates, state = p.optax_opt.update(bench_fused_dw._gemm(x, dy), state, params)
    return optax.apply_updates(params, updates), state

  def dots(f, carry, xs, dys):
    return len(re.findall(r" dot\(", bench_fused_dw._dispatched(f).lower(carry, xs, dys).compile().as_text()))

  gemm = lambda grads, x, dy: (*grads, bench_fused_dw._gemm(x, dy))
  carry = (p.w0, p.optax_opt.init(p.w0))
  # Three calls, three dots, for the GEMM alone and for GEMM + optax...
  assert dots(gemm, (), xs, dys) == 3 and dots(update, carry, xs, dys) == 3
  # ...where one x and dy used three times in a jit leave one (CSE): why the copies exist.
  def shared(carry, x, dy):
    for _ in range(3):
      carry = update(carry, x, dy)
    return carry

  assert len(re.findall(r" dot\(", jax.jit(shared).lower(carry, x, dy).compile().as_text())) == 1
  for build in (bench_fused_dw.build_xla_gemm, bench_fused_dw.build_xla_optax):
    runner = build(p)
    jax.block_until_ready(runner.calls(runner.init(), 3))
  # End to end: per-call times from dispatches of 3 calls, every implementation checked first.
  assert bench_fused_dw.main(["--smoke", "--calls", "3", "--impls", "xla_gemm", "xla_gemm_optax",
                              "pallas", "--optimizers", "adamw", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "bench_fused_dw.json").read_text())["rows"]
  assert {r["impl"] for r in rows} == {"xla_gemm", "xla_gemm_optax", "pallas"}
  assert all(r["status"] == "ok" and r["calls_per_dispatch"] == 3 and r["ms"] > 0 for r in rows), rows
  assert "dispatches of 3 calls each" in (tmp_path / "bench_fused_dw.md").read_text()
  with pytest.raises(ValueError, match="--calls must be >= 1; got 0"):
    bench_fused_dw.main(["--smoke", "--calls", "0", "--out", str(tmp_path)])



def test_live_buffers_sums_the_schedule_and_lists_the_peak():
  from experiments import live_buffers  # pylint: disable=g-import-not-at-top
  live_range = ("  InstructionSequence:\n    0:p\n    1:a\n    2:b\n    3:c\n  BufferLiveRange:\n"
                "    p{}:0-3\n    a{}:1-2\n    b{}:2-3\n    c{}:3-3\n  Live ranges at 2 (peak):\n")
  assignment = "\n".join([
      " value: <1 p @0> (size=100,offset=0): f32[25]{0}",
      " value: <2 a @0> (size=400,offset=0): f32[100]{0}",
      " value: <3 b @0> (size=800,offset=0): bf16[400]{0}",
      " value: <4 c @0> (size=50,offset=0): (f32[4], s32[])",
  ])
  module = live_buffers.parse(live_range, assignment)
  assert module["sequence"] == ["p", "a", "b", "c"] and module["ranges"]["b{}"] == (2, 3)
  result = live_buffers.peak(module, top=2)
  # at 2: p + a + b = 1300 bytes (at 3: p + b + c = 950)
  assert result["at"] == 2 and result["instruction"] == "b"
  assert result["peak_gib"] * 2**30 == 1300
  assert [b["buffer"] for b in result["live"]] == ["b{}", "a{}"] and result["live"][0]["shape"] == "bf16[400]"
  assert live_buffers.parse(live_range, assignment)["shapes"]["c{}"] == "tuple"


def test_live_buffers_counts_a_shared_slot_once():
  """Buffers XLA put in one allocation at one offset (a while loop's carried tuple and its body's
  parameter, an in-place update) are one piece of memory."""
  from experiments import live_buffers  # pylint: disable=g-import-not-at-top
  live_range = ("  InstructionSequence:\n    0:p\n    1:a\n    2:b\n    3:c\n  BufferLiveRange:\n"
                "    p{}:0-3\n    a{}:1-2\n    b{}:2-3\n    c{}:2-3\n")
  assignment = "\n".join([
      "allocation 0: size 100, parameter 0, shape |f32[25]| at ShapeIndex {}:",
      " value: <1 p @0> (size=100,offset=0): f32[25]{0}",
      "allocation 1: size 800, maybe-live-out:",
      " value: <2 a @0> (size=400,offset=0): f32[100]{0}",  # b overwrites a in place
      " value: <3 b @0> (size=800,offset=0): bf16[400]{0}",
      "allocation 2: size 1000, preallocated-temp:",
      " value: <4 c @0> (size=60,offset=200): f32[15]{0}",
  ])
  module = live_buffers.parse(live_range, assignment)
  assert module["slots"] == {"p{}": (0, 0), "a{}": (1, 0), "b{}": (1, 0), "c{}": (2, 200)}
  result = live_buffers.peak(module)
  # at 2: p + max(a, b) + c = 100 + 800 + 60 (each buffer on its own: 1360)
  assert result["peak_gib"] * 2**30 == 960 and result["at"] == 2
  assert [(b["buffer"], b["aliases"]) for b in result["live"]] == [("b{}", ["a{}"]), ("p{}", []), ("c{}", [])]


@pytest.mark.usefixtures("fast_subprocess_compiles")  # the compile runs in a subprocess
def test_live_buffers_compiles_a_step_and_keeps_its_hlo(tmp_path):
  from experiments import live_buffers  # pylint: disable=g-import-not-at-top
  rows = live_buffers.main(["--model", "tiny-llama", "--tokens", "16", "--impls", "forge", "--top", "50",
                            "--out", str(tmp_path), "--save-hlo"])
  assert [r["tree"] for r in rows] == ["main"]
  for r in rows:
    assert "error" not in r, r
    assert r["module"].endswith("after_optimizations") and "step" in r["module"]
    # What is live at one point cannot exceed XLA's whole plan (arguments + outputs + temporaries).
    assert 0 < r["peak_gib"] <= r["xla_step_gib"] * 1.0001
  assert "| forge | main |" in (tmp_path / "live_buffers.md").read_text()
  import gzip  # pylint: disable=g-import-not-at-top
  with gzip.open(tmp_path / "hlo_forge_main.txt.gz", "rt") as f:
    assert f.read().startswith("HloModule")


def test_capacity_plan_search_brackets_the_edge():
  """find_edge: the largest batch whose plan fits, with the next multiple compiled and over the
  limit; a kink the line does not predict, failed compiles and too few compiles."""
  from experiments import capacity_plan  # pylint: disable=g-import-not-at-top
  line = lambda b: 10 + 0.5 * b
  r = capacity_plan.find_edge(line, 30.0, [8, 16])
  assert (r["edge"], r["order"]) == (40, [8, 16, 40, 41])  # the line predicts it: 2 more compiles
  assert r["slope_gib"] == pytest.approx(0.5) and r["intercept_gib"] == pytest.approx(10)
  kink = lambda b: line(b) + (5 if b > 36 else 0)
  assert capacity_plan.find_edge(kink, 30.0, [8, 16])["edge"] == 36
  assert capacity_plan.find_edge(line, 30.0, [8, 16], multiple=8)["edge"] == 40
  # A failed compile (on the GPU: the autotuner out of memory beside other processes) says nothing
  # about fitting: the search stops with no edge rather than calling the batch too large.
  fails = lambda b: None if b > 20 else line(b)
  failed = capacity_plan.find_edge(fails, 30.0, [8, 16])
  assert failed["edge"] is None and "batch 40 failed" in failed["error"], failed
  assert failed["plans"] == {8: 14.0, 16: 18.0, 40: None}
  assert capacity_plan.find_edge(lambda b: 100 + b, 30.0, [8, 16])["edge"] is None
  flat = capacity_plan.find_edge(lambda b: 10.0, 30.0, [8, 16], max_compiles=5)
  assert flat["edge"] is None and "5 compiles" in flat["error"]
  for f in (line, kink):
    r = capacity_plan.find_edge(f, 30.0, [8, 16])
    e = r["edge"]
    assert r["plans"][e] <= 30.0 < r["plans"][e + 1]
  # A jump between the probes (forge_int8 on the H200: 91.99 GiB at 112, 113.52 at 120) gives a
  # line with a negative fixed part: the table says so instead of printing it as memory.
  jump = capacity_plan.find_edge(lambda b: 10 + 0.5 * b + (20 if b > 12 else 0), 30.0, [8, 16])
  assert jump["intercept_gib"] < 0
  meta = dict(command="c", date="d", device="cpu", jax="0", model="m", tokens=16, dtype="f32",
              loss="lean", limit_gib=30.0, limit_source="--limit-gib")
  md = capacity_plan.markdown([dict(jump, impl="forge_int8"), dict(r, impl="optax")], meta)
  assert md.count("(a jump, not a line)") == 1 and "| forge_int8 |" in md


def test_capacity_plan_finds_a_tiny_models_edge(tmp_path, monkeypatch):
  from experiments import capacity_plan, memory_analysis  # pylint: disable=g-import-not-at-top
  # Each distinct plan is compiled once in this test: analyse is deterministic, so a call with the
  # same arguments (capacity_plan's for batches 3 and 4, the cut run's for 2) reuses the row.
  plans = {}
  compile_plan = memory_analysis.analyse

  def analyse_once(*a, **kw):
    key = (a, tuple(sorted(kw.items())))
    if key not in plans:
      plans[key] = compile_plan(*a, **kw)
    return plans[key]

  monkeypatch.setattr(memory_analysis, "analyse", analyse_once)
  # the plans at 3 and 4 sequences, and a limit between them (the search compiles 2, 4, then 3);
  # called as capacity_plan calls it
  p3, p4 = (memory_analysis.analyse("tiny-llama", "optax", b, 16, "float32", loss="lean", layers=1,
                                    with_init=False)["step"]["step_gib"] for b in (3, 4))
  assert p4 > p3
  rows = capacity_plan.main(["--model", "tiny-llama", "--impls", "optax", "--tokens", "16", "--dtype",
                             "float32", "--layers", "1", "--probes", "2,4",
                             "--limit-gib", str((p3 + p4) / 2), "--out", str(tmp_path)])
  assert rows[0]["edge"] == 3 and sorted(rows[0]["plans"]) == [2, 3, 4], rows
  assert "| optax | 3 |" in (tmp_path / "capacity_plan.md").read_text()
  # A run cut short keeps the plans compiled so far (the file is rewritten after each compile).
  calls = []
  real = memory_analysis.analyse

  def analyse_then_stop(*a, **kw):
    if calls:
      raise KeyboardInterrupt  # the time limit, after the first compile
    calls.append(a)
    return real(*a, **kw)

  import unittest.mock  # pylint: disable=g-import-not-at-top
  cut = tmp_path / "cut"
  with unittest.mock.patch.object(memory_analysis, "analyse", analyse_then_stop), pytest.raises(KeyboardInterrupt):
    capacity_plan.main(["--model", "tiny-llama", "--impls", "optax", "--tokens", "16", "--dtype", "float32",
                        "--layers", "1", "--probes", "2,4", "--limit-gib", "1", "--out", str(cut)])
  saved = json.loads((cut / "capacity_plan.json").read_text())["rows"]
  assert [(r["impl"], list(r["plans"]), r["edge"]) for r in saved] == [("optax", ["2"], None)]
  assert "cut short" in saved[0]["error"] and "cut short" in (cut / "capacity_plan.md").read_text()
  with pytest.raises(SystemExit):  # XLA:CPU reports no limit
    capacity_plan.main(["--model", "tiny-llama", "--out", str(tmp_path)])


def test_gpu_clocks_summarizes_busy_samples_by_phase(tmp_path):
  """experiments.gpu_clocks: nvidia-smi's samples (a cut last line and an error line skipped)
  grouped by phase window and power band, the throttle reasons named; --summarize rewrites
  the summary of a folder."""
  import gzip  # pylint: disable=g-import-not-at-top
  from experiments import gpu_clocks  # pylint: disable=g-import-not-at-top
  lines = ["2026/12/04 07:00:00.000, 1980 MHz, 3201 MHz, 230.00 W, 95 %, 40, 0x0000000000000000",
           "2026/12/04 07:00:00.050, 1575 MHz, 3201 MHz, 690.50 W, 100 %, 55, 0x0000000000000004",
           "2026/12/04 07:00:00.100, 1560 MHz, 3201 MHz, 688.00 W, 100 %, 56, 0x0000000000000004",
           "2026/12/04 07:00:00.150, 1980 MHz, 3201 MHz, 80.00 W, 0 %, 40, 0x0000000000000001",
           "Unable to determine the device handle",
           "2026/12/04 07:00:00.2"]
  samples = gpu_clocks.parse_samples("\n".join(lines))
  assert len(samples) == 4 and samples[1]["reasons"] == 4
  assert gpu_clocks.reason_names(0x5) == ["idle", "SW power cap"]
  t0 = samples[0]["t"]
  phases = {"layers": {"command": "a", "window": [t0, t0 + 0.01]},
            "step": {"command": "b", "window": [t0 + 0.04, t0 + 0.2]}}
  (tmp_path / "clocks.csv.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
  (tmp_path / "phases.json").write_text(json.dumps({"date": "d", "device": "H200",
                                                    "interval_ms": 50, "phases": phases}))
  assert gpu_clocks.main(["--summarize", str(tmp_path)]) == 0
  summary = json.loads((tmp_path / "clocks.json").read_text())["summary"]
  assert summary["layers"]["bands"] == [{
      "power_w": [0, 300], "samples": 1, "sm_mhz_median": 1980, "sm_mhz_min": 1980,
      "sm_mhz_max": 1980, "power_w_median": 230.0, "reasons": []}]
  (step,) = summary["step"]["bands"]  # the idle sample is not busy
  assert step["samples"] == 2 and step["sm_mhz_median"] == 1567.5
  assert step["reasons"] == ["SW power cap"] and summary["step"]["busy_samples"] == 2
  assert "| step | 500- | 2 of 3 | 1568 (1560-1575) | 689 | SW power cap |" in (
      tmp_path / "clocks.md").read_text()
  with pytest.raises(SystemExit):
    gpu_clocks.main([])  # neither --run nor --summarize
  # --timeline: the busy samples in bins over time, without phases.json.
  (tmp_path / "phases.json").unlink()
  assert gpu_clocks.main(["--timeline", str(tmp_path), "--bin-s", "0.1"]) == 0
  table = (tmp_path / "timeline.md").read_text()
  assert "| 0 | 2 | 1778 | 460 | SW power cap |" in table  # the first two samples' bin
  assert "| 0.1 | 1 | 1560 | 688 | SW power cap |" in table and table.count("\n| 0") == 2
  # A recorder with a path keeps it current: a phase is on file while it runs, and after.
  path = tmp_path / "live.json"
  recorder = gpu_clocks.Recorder({"phases": {}}, path)
  with recorder.phase("a", "cmd"):
    (start, end) = json.loads(path.read_text())["phases"]["a"]["window"]
    assert start == end
  assert json.loads(path.read_text())["phases"]["a"]["window"][1] > start
  recorder.add("a: row", "cmd", (start, start + 1))
  assert json.loads(path.read_text())["phases"]["a: row"]["window"] == [start, start + 1]
