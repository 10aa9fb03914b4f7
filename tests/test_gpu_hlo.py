"""experiments.gpu_hlo: reading a compiled module's launches and bytes; the compile-only GPU
where jax's CUDA PJRT plugin is installed."""

from __future__ import annotations

import importlib.util

import pytest

from experiments import gpu_hlo

# The shape of XLA's optimized HLO text: a fused computation, a loop with a known trip count, a
# custom call with a tuple result (with XLA's `/*index=N*/` comments), a copy.
_MODULE = """HloModule jit_f, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%fused_add (param_0: f32[4,8], param_1: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[4,8]{1,0} parameter(1)
  ROOT %add.0 = f32[4,8]{1,0} add(%param_0, %param_1)
}

%fused_transpose (param_0.1: f32[8,4]) -> f32[4,8] {
  %param_0.1 = f32[8,4]{1,0} parameter(0)
  ROOT %transpose.1 = f32[4,8]{1,0} transpose(%param_0.1), dimensions={1,0}
}

%body (arg: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %arg = (s32[], f32[4,8]{1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  %gte.1 = f32[4,8]{1,0} get-tuple-element(%arg), index=1
  %loop_add_fusion = f32[4,8]{1,0} fusion(%gte.1, %gte.1), kind=kLoop, calls=%fused_add
  ROOT %tuple.1 = (s32[], f32[4,8]{1,0}) tuple(%gte.0, %loop_add_fusion)
}

%cond (arg.1: (s32[], f32[4,8])) -> pred[] {
  %arg.1 = (s32[], f32[4,8]{1,0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%arg.1), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%gte.2, %c), direction=LT
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %copy.1 = f32[4,8]{1,0} copy(%x)
  %kernel = (f32[4,8]{1,0}, s8[16]{0}, s8[16]{0}, s8[16]{0}, s8[16]{0}, /*index=5*/s8[16]{0}) custom-call(%copy.1), custom_call_target="mosaic_gpu_v2"
  %gte.3 = f32[4,8]{1,0} get-tuple-element(%kernel), index=0
  %flip = f32[8,4]{1,0} bitcast(%gte.3)
  %input_transpose_fusion = f32[4,8]{1,0} fusion(%flip), kind=kInput, calls=%fused_transpose
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %input_transpose_fusion)
  %while = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%while), index=1
}
"""


def test_launches_count_loop_trips_and_the_bytes_of_operands_and_results():
  rows = {r["name"]: r for r in gpu_hlo.launches(_MODULE)}
  assert set(rows) == {"copy.1", "kernel", "input_transpose_fusion", "loop_add_fusion"}
  assert rows["input_transpose_fusion"]["transpose"] and not rows["loop_add_fusion"]["transpose"]
  assert rows["copy.1"] == {"name": "copy.1", "kind": "copy", "bytes": 256, "count": 1,
                            "shape": "f32[4,8]{1,0}", "transpose": False}
  assert rows["kernel"]["kind"] == "custom:mosaic_gpu_v2"
  assert rows["kernel"]["bytes"] == 128 + 128 + 5 * 16  # operand + the tuple's elements
  assert rows["loop_add_fusion"]["kind"] == "fusion:kLoop"
  assert (rows["loop_add_fusion"]["bytes"], rows["loop_add_fusion"]["count"]) == (3 * 128, 3)
  s = gpu_hlo.summary(_MODULE)
  assert (s["launches"], s["copies"], s["copy_bytes"]) == (6, 1, 256)
  assert s["bytes"] == 256 + 336 + 256 + 3 * 384
  assert s["by_kind"]["fusion:kLoop"] == {"launches": 3, "bytes": 3 * 384}
  assert (s["transposes"], s["transpose_bytes"]) == (1, 256)
  assert gpu_hlo.shape_bytes("(bf16[2,3]{1,0}, pred[5], f32[])") == 12 + 5 + 4


def _has_cuda_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ImportError:  # no jax_plugins package at all
    return False


_PLUGIN = pytest.mark.skipif(not _has_cuda_plugin(), reason="jax's CUDA PJRT plugin is not installed")


def _gpu_hlo(*args) -> None:
  """``python -m experiments.gpu_hlo ARGS`` in a new process: the compile-only CUDA device must
  come up before any other jax backend, which a test process has started already."""
  import os  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, "-m", "experiments.gpu_hlo", *args], cwd=root,
                        env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]


@_PLUGIN
def test_the_guard_costs_the_xla_route_no_pass_on_a_gpu(tmp_path):
  """Compiled for an H200: the "xla" route's guarded update launches and moves what the
  unguarded one does (one multi-output fusion for the rule)."""
  _gpu_hlo("layer", "--shape", "256x512x512", "--configs", "fp32,fp32_noguard", "--out", str(tmp_path))
  import json  # pylint: disable=g-import-not-at-top
  guarded, plain = json.loads((tmp_path / "gpu_hlo.json").read_text())["rows"]
  for key in ("launches", "bytes", "copies"):
    assert guarded[key] == plain[key], (key, guarded, plain)


@_PLUGIN
def test_ptxas_lists_the_mosaic_kernels_registers_and_spills(tmp_path):
  """``--ptxas``: the Mosaic kernel a layer program compiles, with its registers and spills."""
  _gpu_hlo("layer", "--impl", "mosaic", "--shape", "256x256x256", "--configs", "bf16_rtn_bf16",
           "--ptxas", "--out", str(tmp_path))
  import json  # pylint: disable=g-import-not-at-top
  (row,) = json.loads((tmp_path / "gpu_hlo.json").read_text())["rows"]
  (kernel,) = row["mosaic_ptxas"]
  assert 0 < kernel["registers"] <= 255 and kernel["spill_store_bytes"] is not None, kernel
  assert "| spill stores per spilling kernel (bytes) |" in (tmp_path / "gpu_hlo.md").read_text()


def test_baseline_runs_get_the_command_line_without_their_own_options(tmp_path):
  """What the --baseline-tree scripts (gpu_hlo, bench_lowp, bench_fused_dw) hand the baseline's
  run: every other option and positional argument, in order."""
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  argv = ["layer", "--shape", "1x2x3", "--baseline-tree", "/t", "--configs", "a", "b",
          "--out=o", "--hlo", "step"]
  assert _timing.drop_options(argv, {"--baseline-tree": 1, "--out": 1}) == [
      "layer", "--shape", "1x2x3", "--configs", "a", "b", "--hlo", "step"]
  assert _timing.drop_options(argv, {"--configs": None, "--shape": 1}) == [
      "layer", "--baseline-tree", "/t", "--out=o", "--hlo", "step"]
  with pytest.raises(ValueError, match="no pallas_kernels"):
    _timing.run_harness_on_tree("x.py", [], tmp_path / "out", tmp_path, "r.json")
