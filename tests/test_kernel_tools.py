"""experiments.kernel_tools on a CPU: what it reads from the profiler, ncu and ptxas, and how it
calls them (the tools themselves need a Hopper GPU; the kernel call they wrap is
tests/test_fused_dw_mosaic.py's, the profiler argument included)."""

from __future__ import annotations

import json

import pytest

from experiments import kernel_tools


def test_profile_trace_summary():
  ev = lambda name, ph, ts, tid: {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}
  trace = {"traceEvents": [
      ev("fdw_mainloop", "B", 0.0, 1), ev("fdw_mainloop", "E", 10.0, 1),
      ev("fdw_epilogue", "B", 10.0, 1), ev("fdw_epi_wait", "B", 10.0, 1), ev("fdw_epi_wait", "E", 13.0, 1),
      ev("fdw_epi_wait", "B", 14.0, 1), ev("fdw_epi_wait", "E", 15.0, 1), ev("fdw_epilogue", "E", 20.0, 1),
      ev("fdw_mainloop", "B", 5.0, 2), ev("fdw_mainloop", "E", 9.0, 2), ev("fdw_epilogue", "E", 9.5, 2),
  ]}
  s = kernel_tools.summarize_trace(trace)
  assert s["tracks"] == 2 and s["span_us"] == 20.0
  assert s["regions"]["fdw_mainloop"] == {"count": 2, "total_us": 14.0, "mean_us": 7.0}
  assert s["regions"]["fdw_epi_wait"]["total_us"] == 4.0
  assert s["regions"]["fdw_epilogue"] == {"count": 1, "total_us": 10.0, "mean_us": 10.0}  # unmatched end


def test_ptxas_report_parsing():
  text = ("ptxas info    : Compiling entry function 'new_body_kernel' for 'sm_90a'\n"
          "ptxas info    : Used 168 registers, used 1 barriers\n"
          "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
          "ptxas info    : Used 40 registers\n"
          "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
  assert kernel_tools.parse_ptxas(text) == {
      "registers": 168, "stack_frame_bytes": 8, "spill_store_bytes": 4, "spill_load_bytes": 4,
      "functions": 2}
  assert kernel_tools.parse_ptxas("no report")["registers"] is None


def test_ncu_runs_one_profiled_call_and_summarizes_the_raw_page(tmp_path):
  cmd = kernel_tools.ncu_command("/x/ncu", tmp_path / "kernel", ["--shape", "64x64x128"])
  assert cmd[0] == "/x/ncu" and ["--profile-from-start", "off"] == cmd[3:5]
  assert cmd[-5:] == ["experiments.kernel_tools", "run", "--cuda-profiler-range", "--shape", "64x64x128"]
  raw = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","other"\n'
         '"","","usecond","byte",""\n'
         '"0","new_body_kernel","101.5","1,048,576","x"\n')
  assert kernel_tools.summarize_ncu_raw(raw) == [
      {"name": "new_body_kernel", "duration": 101.5, "dram_read": 1048576.0}]
  assert kernel_tools.summarize_ncu_raw("") == []


def test_arguments_are_checked(tmp_path):
  with pytest.raises(SystemExit):
    kernel_tools.main(["profile", "--shape", "1024x4096", "--out", str(tmp_path)])
  with pytest.raises(SystemExit):
    kernel_tools.main(["sass", "--out", str(tmp_path)])
  args = ["--shape", "64x64x128", "--states", "int8", "--config-json", json.dumps({"tile_m": 64})]
  ns = type("A", (), dict(shape="64x64x128", states="int8", optimizer="lion",
                          config_json=json.dumps({"tile_m": 64})))
  assert kernel_tools._run_args(ns) == args[:4] + ["--optimizer", "lion"] + args[4:]  # pylint: disable=protected-access
