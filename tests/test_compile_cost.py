"""experiments/compile_cost.py: what an unrolled FORGE step hands the compiler."""

from __future__ import annotations

import json

import pytest

from experiments import compile_cost

# tests/conftest.py: the fusions are XLA's HLO passes', which still run; only LLVM's are cut.
pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")


def test_int8_states_add_equations_and_every_count_is_reported(tmp_path):
  # One layer: the int8 states' extra equations are per layer, one shows them.
  assert compile_cost.main(["--model", "tiny-qwen3", "--layers", "1", "--tokens", "16", "--compile",
                            "--impls", "forge_unrolled,forge_int8_unrolled", "--trace-compile",
                            "--out", str(tmp_path)]) == 0
  bf16, int8 = json.loads((tmp_path / "compile_cost.json").read_text())["rows"]
  assert (bf16["impl"], int8["impl"]) == ("forge_unrolled", "forge_int8_unrolled")
  assert bf16["attention"] == int8["attention"] == "xla"  # the default; --attention auto on a GPU
  # int8 states: decode, block maxima and re-encoding per layer on the XLA route.
  assert int8["jaxpr_eqns"] > bf16["jaxpr_eqns"] and int8["stablehlo_ops"] > bf16["stablehlo_ops"]
  for row in (bf16, int8):
    assert 0 < row["distinct_fusions"] <= row["fusions"]
    assert row["compile_s"] > 0 and row["trace_s"] > 0
  assert "| forge_int8_unrolled | 1 |" in (tmp_path / "compile_cost.md").read_text()
  # --trace-compile: the compile's host events (XLA's CPU compiler here) and no Mosaic GPU kernel.
  names = {e["name"] for e in bf16["compile_events"]}
  assert any("Compile" in n for n in names) and bf16["mosaic_compile_ms"] == []


def test_fusion_stats_ignores_names_and_metadata():
  hlo = """%fused_computation.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0), metadata={op_name="a"}
  ROOT %m = f32[4]{0} multiply(%p, %p)
}

%fused_computation.2 (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0), metadata={op_name="b"}
  ROOT %n = f32[4]{0} multiply(%q, %q)
}

%fused_computation.3 (r: f32[4]) -> f32[4] {
  %r = f32[4]{0} parameter(0)
  ROOT %s = f32[4]{0} add(%r, %r)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1
}
"""
  assert compile_cost.fusion_stats(hlo) == {"fusions": 3, "distinct_fusions": 2}


def test_custom_call_stats_counts_targets_and_the_fused_ones():
  hlo = """%dynamic-slice-fusion.1 (p: bf16[8,4], i: s32[]) -> bf16[4,4] {
  %c = bf16[4,4]{1,0} custom-call(%p, %i), custom_call_target="mosaic_gpu_v2"
  ROOT %d = bf16[4,4]{1,0} dynamic-update-slice(%c, %c, %i, %i)
}

%body (s: (bf16[8,4], s32[])) -> (bf16[8,4], s32[]) {
  %g = bf16[4,4]{1,0} custom-call(%x, %i), custom_call_target="mosaic_gpu_v2"
  %h = bf16[4,4]{1,0} custom-call(%x, %i), custom_call_target="mosaic_gpu_v2"
  ROOT %t = tuple(%g, %h)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} custom-call(%a), custom_call_target="__cudnn$fmha"
}
"""
  assert compile_cost.custom_call_stats(hlo) == {
      "custom_calls": {"mosaic_gpu_v2": 3, "__cudnn$fmha": 1},
      "fused_custom_calls": {"mosaic_gpu_v2 in dynamic-slice-fusion.1": 1}}


def test_xla_phase_seconds_reads_the_gpu_compilers_timers():
  log = """I1204 18:32:18 1 se_gpu_pjrt_compiler.cc:390] Performing a JIT compilation.
I1204 18:32:22 1 gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit__train_step time: 4.05 s (4054298 us) (cumulative: 4.05 s, max: 4.05 s, #called: 1)
I1204 18:32:34 1 gpu_compiler.cc:3017] GpuCompiler::RunBackend for jit__train_step time: 11.9 s (11921796 us) (cumulative: 11.9 s, max: 11.9 s, #called: 1)
I1204 18:32:34 1 gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit__lambda time: 21.5 ms (21512 us) (cumulative: 4.08 s)
"""
  assert compile_cost.xla_phase_seconds(log) == {"xla_hlo_passes_s": 4.054298, "xla_backend_s": 11.921796}
  assert compile_cost.xla_phase_seconds("no timers here") == {}


def test_xla_timers_need_a_fresh_compiled_measurement(capsys):
  with pytest.raises(SystemExit):
    compile_cost.main(["--xla-timers", "--compile"])
  assert "--fresh --compile" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    compile_cost.main(["--trace-compile"])
  assert "give --compile" in capsys.readouterr().err


def test_host_event_totals_count_mosaic_kernel_compiles():
  class Event:
    def __init__(self, name, ms, start_ms=0.0):
      self.name, self.duration_ns, self.start_ns = name, int(ms * 1e6), int(start_ms * 1e6)

  class Line:
    def __init__(self, events, name="python"):
      self.events, self.name = events, name

  class Plane:
    def __init__(self, name, lines):
      self.name, self.lines = name, lines

  class Data:
    planes = [Plane("/host:CPU", [Line([Event("GpuCompiler::RunBackend", 900.0), Event("Compile", 300.0, 10.0),
                                        Event("Compile", 120.5, 400.0), Event("$stages.py:586 compile", 1000.0)])]),
              Plane("/device:GPU:0", [Line([Event("Compile", 5.0)])])]

  got = compile_cost.host_event_totals(Data())
  assert got["mosaic_compile_ms"] == [300.0, 120.5]
  # One after another on one thread: from 10 ms to 520.5 ms.
  assert got["mosaic_compile_span_ms"] == 510.5 and got["mosaic_compile_threads"] == 1
  Data.planes[0].lines.append(Line([Event("Compile", 50.0, 20.0)]))  # same name, another thread
  assert compile_cost.host_event_totals(Data())["mosaic_compile_threads"] == 2
  assert got["compile_events"] == [{"name": "GpuCompiler::RunBackend", "count": 1, "ms": 900.0},
                                   {"name": "Compile", "count": 2, "ms": 420.5}]


def test_kernel_compile_modes_are_checked(capsys):
  with pytest.raises(SystemExit):
    compile_cost.main(["--kernel-compile", "parallel,fast"])
  assert "--kernel-compile parallel,fast" in capsys.readouterr().err
  row = {"impl": "forge", "kernel_compile": "serial"}
  assert compile_cost.label(row) == "forge [serial kernels]"
  assert compile_cost.label(dict(row, kernel_compile="parallel")) == "forge"


def test_guard_on_and_off_side_by_side(tmp_path, capsys):
  """--guard on,off: the step with and without the non-finite guard, one row each; the guard
  adds equations (its selects) to the jaxpr."""
  with pytest.raises(SystemExit):
    compile_cost.main(["--guard", "yes"])
  assert "--guard yes" in capsys.readouterr().err
  assert compile_cost.main(["--model", "tiny-qwen3", "--layers", "1", "--tokens", "16",
                            "--impls", "forge_unrolled", "--guard", "on,off",
                            "--out", str(tmp_path)]) == 0
  on, off = json.loads((tmp_path / "compile_cost.json").read_text())["rows"]
  assert (on["guard"], off["guard"]) == (True, False)
  assert on["jaxpr_eqns"] > off["jaxpr_eqns"]
  assert compile_cost.label(off) == "forge_unrolled [no guard]" and compile_cost.label(on) == "forge_unrolled"
  assert compile_cost.label(dict(off, remat="full")) == "forge_unrolled [remat full] [no guard]"


def test_lower_for_cuda_lowers_the_gpu_step_with_its_mosaic_kernels(tmp_path):
  """--lower-for cuda: the step a Hopper GPU compiles, traced and lowered on this host, its FORGE
  layers in the Mosaic kernel (a scanned stack's layer products in the stacked GEMM too)."""
  from tests._lowering import skip_if_cuda_lowering_needs_a_gpu  # pylint: disable=g-import-not-at-top
  with skip_if_cuda_lowering_needs_a_gpu():
    assert compile_cost.main(["--model", "tiny-llama", "--layers", "2", "--tokens", "128",
                              "--impls", "forge,forge_unrolled", "--lower-for", "cuda",
                              "--out", str(tmp_path)]) == 0
  scanned, unrolled = json.loads((tmp_path / "compile_cost.json").read_text())["rows"]
  for row in (scanned, unrolled):
    assert row["lowered_for"] == "cuda" and row["lower_s"] > 0 and "compile_s" not in row
  assert 0 < unrolled["mosaic_kernels"] < scanned["mosaic_kernels"]
  for row in (scanned, unrolled):  # each kernel's lowering timed once, within the step's lowering
    kernels = row["mosaic_lowering"]
    assert len(kernels) == row["mosaic_kernels"] and all(k["s"] > 0 for k in kernels)
    assert sum(k["s"] for k in kernels) < row["lower_s"]
  assert "Lowering the Mosaic GPU kernels" in (tmp_path / "compile_cost.md").read_text()
  assert "| forge [lowered for cuda] | 2 |" in (tmp_path / "compile_cost.md").read_text()
  with pytest.raises(SystemExit):  # nothing to compile for a GPU here
    compile_cost.main(["--lower-for", "cuda", "--compile", "--out", str(tmp_path)])
