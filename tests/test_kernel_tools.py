"""experiments.kernel_tools on a CPU: what it reads from the profiler, ncu and ptxas, and how it
calls them (the tools themselves need a Hopper GPU; the kernel call they wrap is
tests/test_fused_dw_mosaic.py's, the profiler argument included)."""

from __future__ import annotations

import json

import pytest

from experiments import kernel_tools

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py


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
  table = kernel_tools.profile_table(s)
  assert "| fdw_mainloop | 2 | 7.00 | 14.0 | 7.00 |" in table  # per tile: over the main loop's count
  assert "| fdw_epi_wait | 2 | 2.00 | 4.0 | 2.00 |" in table
  assert kernel_tools.profile_table({}) == []


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
  two = ("ptxas info    : Compiling entry function 'a_kernel' for 'sm_90a'\n"
         "ptxas info    : Function properties for a_kernel\n"
         "    8 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
         "ptxas info    : Used 168 registers, used 16 barriers\n"
         "ptxas info    : Compiling entry function 'b_kernel' for 'sm_90a'\n"
         "ptxas info    : Used 4 registers, used 1 barriers\n")
  assert kernel_tools.parse_ptxas_functions(two) == [
      {"function": "a_kernel", "registers": 168, "stack_frame_bytes": 8,
       "spill_store_bytes": 12, "spill_load_bytes": 8},
      {"function": "b_kernel", "registers": 4, "stack_frame_bytes": None,
       "spill_store_bytes": None, "spill_load_bytes": None}]


def test_ncu_runs_one_profiled_call_and_summarizes_the_raw_page(tmp_path):
  cmd = kernel_tools.ncu_command("/x/ncu", tmp_path / "kernel", ["--shape", "64x64x128"])
  assert cmd[0] == "/x/ncu" and ["--profile-from-start", "off"] == cmd[3:5]
  assert cmd[cmd.index("--kernel-name") + 1] == f"regex:{kernel_tools.FUSED_KERNEL}"
  assert cmd[-5:] == ["experiments.kernel_tools", "run", "--cuda-profiler-range", "--shape", "64x64x128"]
  raw = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","other"\n'
         '"","","usecond","byte",""\n'
         '"0","new_body_kernel","101.5","1,048,576","x"\n')
  assert kernel_tools.summarize_ncu_raw(raw) == [
      {"name": "new_body_kernel", "duration": 101.5, "dram_read": 1048576.0}]
  assert kernel_tools.summarize_ncu_raw("") == []


def test_ncu_source_page_is_summarized_by_loop_and_stall_reason():
  """The fused kernel's block of ``ncu --page source --csv``: samples by stall reason for the
  whole kernel, the largest loop without HGMMA (the epilogue's) and the smallest with one (the
  main loop), and the most sampled instructions."""
  head = ('"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_wait",'
          '"stall_wait (Not Issued)"')
  rows = [("0x100", "MOV R1, R2", 1, 0), ("0x110", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4]", 2, 2),
          ("0x120", "@!P0 BRA 0x110", 0, 0), ("0x130", "FFMA R6, R4, R5, R6", 0, 6),
          ("0x140", "MUFU.RSQ R8, R6", 3, 1), ("0x150", "@P1 BRA 0x130", 0, 0),
          ("0x160", "@P2 BRA 0x100", 0, 0), ("0x170", "EXIT", 0, 0)]
  block = "\n".join([head] + [f'"{a}","      {t}","{l + w}","{l}","{w}","9"' for a, t, l, w in rows])
  page = ('"Kernel Name","loop_multiply_fusion",\n' + head + '\n"0x0","NOP","5","5","0","0"\n'
          '"Kernel Name","fused_dw_update_mosaic_mosaic_gpu_kernel",\n' + block + "\n")
  assert kernel_tools.ncu_source_block(page, kernel_tools.FUSED_KERNEL) == block + "\n"
  assert kernel_tools.ncu_source_block(page, "absent") == ""
  got = kernel_tools.summarize_ncu_source(kernel_tools.ncu_source_block(page, kernel_tools.FUSED_KERNEL),
                                          top=2)
  assert got["instructions"] == 8
  assert got["all"]["samples"] == 15 and got["all"]["reasons_pct"] == {"wait": 60.0, "long_sb": 40.0}
  epi = got["largest_loop_without_mma"]
  assert (epi["first"], epi["instructions"], epi["samples"]) == (3, 3, 10)
  assert epi["reasons_pct"] == {"wait": 70.0, "long_sb": 30.0}
  assert epi["by_opcode"] == [
      {"opcode": "FFMA", "instructions": 1, "samples": 6, "reasons": {"wait": 6}},
      {"opcode": "MUFU", "instructions": 1, "samples": 4, "reasons": {"long_sb": 3, "wait": 1}}]
  assert kernel_tools.sass_opcode("@!P1  FMNMX.NAN R104, |R96|, |R135|, !PT") == "FMNMX"
  main = got["smallest_loop_with_mma"]
  assert (main["first"], main["instructions"], main["samples"]) == (1, 2, 4)
  assert [t["index"] for t in got["top"]] == [3, 1] and got["top"][0]["reasons"] == {"wait": 6}
  assert kernel_tools.summarize_ncu_source("") == {}


def test_arguments_are_checked(tmp_path):
  with pytest.raises(SystemExit):
    kernel_tools.main(["profile", "--shape", "1024x4096", "--out", str(tmp_path)])
  with pytest.raises(SystemExit):
    kernel_tools.main(["ptx", "--out", str(tmp_path)])
  args = ["--shape", "64x64x128", "--states", "int8", "--config-json", json.dumps({"tile_m": 64})]
  with pytest.raises(SystemExit):  # a profile needs the kernel run
    kernel_tools.main(["profile", "--compile-only", "--out", str(tmp_path)])
  ns = type("A", (), dict(shape="64x64x128", states="int8", optimizer="lion",
                          config_json=json.dumps({"tile_m": 64}), no_guard=False, compile_only=False))
  assert kernel_tools._run_args(ns) == args[:4] + ["--optimizer", "lion"] + args[4:]  # pylint: disable=protected-access
  ns.no_guard = True  # the run the tools wrap examines the same kernel
  assert kernel_tools._run_args(ns)[-1] == "--no-guard"  # pylint: disable=protected-access
  ns.compile_only = True
  assert kernel_tools._run_args(ns)[-2:] == ["--no-guard", "--compile-only"]  # pylint: disable=protected-access


def _has_cuda_plugin() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ImportError:
    return False


@pytest.mark.skipif(not _has_cuda_plugin(), reason="jax's CUDA PJRT plugin is not installed")
def test_ptxas_reports_the_kernel_compiled_without_a_gpu(tmp_path):
  assert kernel_tools.main(["ptxas", "--compile-only", "--shape", "256x256x256", "--states", "int8",
                            "--out", str(tmp_path)]) == 0
  report = json.loads((tmp_path / "kernel_ptxas.json").read_text())["ptxas"]
  assert 0 < report["registers"] <= 255, report


def test_the_kernel_examined_is_the_guarded_one_unless_told(monkeypatch):
  """The tools examine the kernel as forge_jax's layers run it: with the per-element non-finite
  guard (``pallas_kernels.skip_non_finite``), or the bare rule with ``--no-guard``."""
  import jax  # pylint: disable=g-import-not-at-top
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(mosaic, "fused_dw_update_mosaic",
                      lambda x, dy, w, slots, scalars, update_fn, **kw: seen.append(update_fn) or (w, slots))
  for no_guard in (False, True):
    ns = type("A", (), dict(shape="64x64x128", states="float32", optimizer="adamw", config_json=None,
                            no_guard=no_guard, interpret=True))
    step, operands, _ = kernel_tools.kernel_call(ns)
    jax.eval_shape(step, *operands)  # traces the call, runs nothing
  guarded, bare = seen
  assert pallas_kernels.contract.unwrap(guarded)[1] and not pallas_kernels.contract.unwrap(bare)[1]


def test_check_script_bf16_metric():
  """experiments/check_mosaic_gpu's 16-bit check: summation-order rounding passes (one-ulp flips,
  cancellation to ~0, NaN where both are NaN), a misplaced sub-tile does not."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments import check_mosaic_gpu as check  # pylint: disable=g-import-not-at-top

  b32 = 0.02 * jax.random.normal(jax.random.PRNGKey(0), (256, 256), jnp.float32)
  b = b32.at[0, 0].set(0.0).at[1, 1].set(jnp.nan).astype(jnp.bfloat16)
  a = b.at[0, 0].set(7.7e-10)  # cancellation: reference exactly 0, kernel 7.7e-10
  bits = jax.lax.bitcast_convert_type(b[2:4, 2], jnp.uint16) + 1  # one ulp away
  a = a.at[2:4, 2].set(jax.lax.bitcast_convert_type(bits, jnp.bfloat16))  # rounding flips
  e = check._errors16(a, b)  # pylint: disable=protected-access
  assert e["ok"] and e["nan_kernel"] == e["nan_ref"] == 1, e
  swapped = a.at[:64, :32].set(a[:64, :32].reshape(64, 16, 2)[:, :, ::-1].reshape(64, 32))
  assert not check._errors16(swapped, b)["ok"]  # pylint: disable=protected-access
  assert not check._errors16(b.at[1, 1].set(0.5), b)["ok"]  # pylint: disable=protected-access


def test_check_script_exits_nonzero_on_a_failed_case(tmp_path, monkeypatch):
  """check_mosaic_gpu gates a GPU run: 0 when every case passes (here the odd shapes, which the
  kernel must refuse with a reason), 1 when a case errors or fails its check."""
  from experiments import check_mosaic_gpu as check  # pylint: disable=g-import-not-at-top

  assert check.main(["--smoke", "--cases", "odd_shape", "--out", str(tmp_path / "ok")]) == 0
  rows = json.loads((tmp_path / "ok" / "check_mosaic_gpu.json").read_text())["rows"]
  assert len(rows) == len(check.ODD_SHAPES) and all(r["reason"] for r in rows), rows

  def broken(*args, **kwargs):
    raise RuntimeError("simulated CUDA fault")

  monkeypatch.setattr(check, "check_case", broken)
  assert check.main(["--smoke", "--quick", "--cases", "first_run", "--out", str(tmp_path / "bad")]) == 1
  table = (tmp_path / "bad" / "check_mosaic_gpu.md").read_text()
  assert "0/1 ok" in table and "simulated CUDA fault" in table
  labels = {c[0] for c in check.cases(quick=False, smoke=False)}
  assert {"rule", "int8", "int8_sr", "sr", "stacked_norm", "llama_8b", "fallback_tiling"} <= labels


def test_mlir_tool_lowers_the_call_it_would_profile(tmp_path):
  """kernel_tools mlir lowers the same call the GPU tools run (here int8 states, which round
  stochastically) for sm_90 on this CPU and keeps its Mosaic GPU module."""
  from tests._lowering import skip_if_cuda_lowering_needs_a_gpu  # pylint: disable=g-import-not-at-top

  with skip_if_cuda_lowering_needs_a_gpu():
    assert kernel_tools.main(["mlir", "--shape", "128x256x256", "--states", "int8",
                              "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "kernel_mlir.json").read_text())["mlir"]
  assert result["config"]["epi_n"] == 64 and result["config"]["no_auto_barriers"]
  module = (tmp_path / "kernel.mlir").read_text()
  assert "wgmma" in module and "loc(" not in module


def test_sass_counts_opcodes_classes_and_the_largest_loop():
  text = """        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0040*/                   LDS.64 R4, [R2+UR5] ;
        /*0050*/                   FFMA R6, R4, R5, R6 ;
        /*0060*/                   FFMA.FTZ R7, R4, R5, R7 ;
        /*0070*/                   MUFU.RSQ R8, R6 ;
        /*0080*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0090*/                   UIADD3 UR5, UR5, 0x100, URZ ;
        /*00a0*/                   STS [R2], R7 ;
        /*00b0*/               @P1 BRA `(.L_x_1) ;
        /*00c0*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00d0*/                   EXIT ;
"""
  got = kernel_tools.parse_sass(text)
  assert got["all"]["instructions"] == 14 and got["loops"] == [8, 2]
  loop = got["largest_loop"]
  assert loop["instructions"] == 8
  assert loop["by_class"] == {"fp32": 2, "int": 2, "shared": 2, "special": 1, "branch": 1}
  assert loop["by_opcode"]["FFMA"] == 2  # modifiers (.FTZ) dropped
  assert got["all"]["by_class"]["tensor"] == 1 and got["all"]["by_class"]["move"] == 2
  assert got["largest_loop_without_mma"] == loop
  # An outer loop around both: the largest loop, with the wgmma; the epilogue's stays found.
  outer = kernel_tools.parse_sass(".L_x_9:\n" + text + "        /*00e0*/ @P2 BRA `(.L_x_9) ;\n")
  assert outer["loops"][0] == 15 and outer["largest_loop"]["by_class"]["tensor"] == 1
  assert outer["largest_loop_without_mma"] == loop
  assert kernel_tools.parse_sass("no code") == {
      "all": {"instructions": 0, "by_class": {}, "by_opcode": {}}, "loops": []}


def test_sass_loop_with_a_switch_counts_one_case_as_executed():
  text = """.L_x_1:
        /*0000*/                   LDS.64 R4, [R2+UR5] ;
        /*0010*/                   BRXU UR8 -0x20 ;
.L_x_2:
        /*0020*/                   IMAD.MOV.U32 R10, RZ, RZ, R20 ;
        /*0030*/                   MOV R11, R21 ;
        /*0040*/                   BRA `(.L_x_4) ;
.L_x_3:
        /*0050*/                   IMAD.MOV.U32 R10, RZ, RZ, R22 ;
        /*0060*/                   IMAD.MOV.U32 R11, RZ, RZ, R23 ;
.L_x_4:
        /*0070*/                   FFMA R6, R10, R11, R6 ;
        /*0080*/                   IMAD R7, R10, R11, R7 ;
        /*0090*/               @P1 BRA `(.L_x_1) ;
"""
  loop = kernel_tools.parse_sass(text)["largest_loop_without_mma"]
  # 10 instructions; the cases (3 and 2 of them) run one at a time: 10 - 5 + round(2.5).
  assert (loop["instructions"], loop["switch_cases"], loop["executed"]) == (10, 2, 7)
  plain = kernel_tools.parse_sass(text.replace("BRXU UR8 -0x20", "NOP"))["largest_loop_without_mma"]
  assert "executed" not in plain  # no indirect branch, no switch


def _has_nvdisasm() -> bool:
  try:
    return bool(kernel_tools.cuda_tool("nvdisasm"))
  except RuntimeError:
    return False


@pytest.mark.skipif(not (_has_cuda_plugin() and _has_nvdisasm()),
                    reason="needs jax's CUDA PJRT plugin and nvdisasm")
def test_guarded_bf16_epilogue_converts_in_pairs_and_does_not_spill(tmp_path):
  """The non-finite guard's selects stay float32 selects ahead of the paired float32 -> bfloat16
  conversions (no element-by-element F2F), and the epilogue's loop reads no spilled register."""
  assert kernel_tools.main(["sass", "--compile-only", "--states", "bfloat16",
                            "--out", str(tmp_path)]) == 0
  loop = json.loads((tmp_path / "kernel_sass.json").read_text())["sass"]["largest_loop_without_mma"]
  assert loop["by_opcode"].get("F2FP", 0) > 0 and not loop["by_opcode"].get("F2F"), loop
  assert not loop["by_opcode"].get("LDL"), loop
