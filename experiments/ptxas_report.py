"""Registers and spills of the Mosaic kernel, per storage and tiling, from ptxas (H200).

The fifth H200 profile (results/h200/mosaic_profile_epi_load/) puts 2.15 us
per 64x32 epilogue sub-tile in the region of the rule's arithmetic (16 values
per thread), and the epilogues with stochastic rounding or int8 states run
far slower than their arithmetic explains (results/h200/lowp_mosaic/). Two
readings: stalls on the shared-memory reads (what ``epi_read_ahead`` targets),
or register spills (the compute warpgroups hold a 128x128 float32 accumulator,
128 registers of their 232, next to the epilogue's values). ptxas says which.

Each case compiles one call of the kernel in a fresh process with
``MOSAIC_GPU_DUMP_PTXAS=1``, which makes Mosaic GPU run ``ptxas -v`` on the
kernel and print its report, and records what ptxas reports: registers per
thread, stack frame, spill stores and loads (bytes).

    PYTHONPATH=$PWD python -m experiments.ptxas_report --out $OUT/ptxas
    PYTHONPATH=$PWD python -m experiments.ptxas_report --storage fp32 fp32_int8 --read-ahead
    PYTHONPATH=$PWD python -m experiments.ptxas_report --storage fp32 bf16_rtn_bf16 --sass \
        --diagnose skip_reads skip_rule skip_compute

``--sass`` also has Mosaic GPU disassemble each kernel (``MOSAIC_GPU_DUMP_SASS=1``, which
needs the CUDA toolkit's ``nvdisasm``) and counts its instructions by opcode and class
(shared-memory loads and stores, float arithmetic, integer and address arithmetic, MMA,
...): static counts of the whole kernel, whose epilogue is unrolled per sub-tile, so
the difference between the kernel and a ``--diagnose`` variant (``fused_dw_mosaic._DIAGNOSE``:
no reads, no rule arithmetic, neither) is what those parts compile to.

Cases: ``--storage`` (``experiments.bench_lowp.CONFIGS`` names) x the default
tiling for ``--tokens`` (and, with ``--read-ahead``, the same with
``epi_read_ahead``), AdamW at 4096x4096. Writes ``ptxas_report.json`` and
``.md``; the raw ptxas lines of every case are in the JSON. GPU only;
:func:`parse_ptxas` and the case list are tested on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Optional, Sequence

STORAGES = ("fp32", "bf16_rtn_bf16", "bf16_sr_bf16", "fp32_int8")
_USED = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> dict[str, Any]:
  """The ptxas ``-v`` figures in ``text`` (a process's output), maxima over its functions.

  Returns ``{"registers", "stack_frame_bytes", "spill_store_bytes", "spill_load_bytes",
  "functions", "lines"}``; the figures are None when ``text`` holds no ptxas report.
  """
  lines = [ln.strip() for ln in text.splitlines() if "ptxas" in ln or "bytes stack frame" in ln]
  regs = [int(m.group(1)) for m in _USED.finditer(text)]
  frames = [tuple(int(g) for g in m.groups()) for m in _FRAME.finditer(text)]
  top = lambda i: max(f[i] for f in frames) if frames else None
  return {
      "registers": max(regs) if regs else None,
      "stack_frame_bytes": top(0),
      "spill_store_bytes": top(1),
      "spill_load_bytes": top(2),
      "functions": len(regs),
      "lines": lines[:40],
  }


# SASS opcode (the part before the first ".") -> class, for parse_sass.
SASS_CLASSES = {
    "shared_load": ("LDS", "LDSM"),
    "shared_store": ("STS",),
    "global_or_tma": ("LDG", "STG", "UBLKCP", "UTMALDG", "UTMASTG", "UTMAPF", "UTMACMDFLUSH"),
    "float": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "MUFU", "F2F", "F2I", "I2F",
              "FCHK", "FRND", "HADD2", "HMUL2", "HFMA2", "F2FP"),
    "integer": ("IMAD", "IADD3", "LOP3", "SHF", "ISETP", "SEL", "LEA", "IMNMX", "PRMT", "IABS",
                "SHL", "SHR", "POPC", "FLO", "BMSK", "UIMAD", "UIADD3", "ULOP3", "USHF", "ULEA",
                "USEL", "UISETP", "UPRMT", "S2R", "S2UR", "CS2R", "MOV", "UMOV", "R2UR"),
    "mma": ("HGMMA", "WARPGROUP"),
    "sync": ("BAR", "SYNCS", "WARPSYNC", "BSSY", "BSYNC", "MEMBAR", "FENCE", "DEPBAR", "ERRBAR"),
}
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?\b")


def parse_sass(text: str) -> dict[str, Any]:
  """Instruction counts of the SASS in ``text`` (nvdisasm output: ``/*0a30*/  OPCODE ...;``).

  Returns ``{"sass_instructions", "sass_classes": {class: count}, "sass_top": [[opcode,
  count], ...] (the 30 most frequent)}``; ``sass_instructions`` is 0 when there is no SASS.
  """
  counts: dict[str, int] = {}
  for line in text.splitlines():
    m = _SASS_LINE.match(line)
    if m:
      counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  of_class = {op: cls for cls, ops in SASS_CLASSES.items() for op in ops}
  classes: dict[str, int] = {}
  for op, n in counts.items():
    cls = of_class.get(op, "other")
    classes[cls] = classes.get(cls, 0) + n
  top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:30]
  return {"sass_instructions": sum(counts.values()), "sass_classes": classes,
          "sass_top": [list(kv) for kv in top]}


_PTX_MATH = re.compile(r"\b((?:div|sqrt|rsqrt|rcp|ex2|lg2)\.[a-z0-9.]*f32)\b")


def parse_ptx_math(text: str) -> dict[str, int]:
  """Counts of the float32 division and special-function PTX instructions in ``text``
  (``div.full.f32``, ``sqrt.approx.f32``, ``rcp.approx.f32``, ...): which division and square
  root the epilogue's rule compiled to (correctly rounded ``.rn`` or approximate)."""
  counts: dict[str, int] = {}
  for op in _PTX_MATH.findall(text):
    counts[op] = counts.get(op, 0) + 1
  return dict(sorted(counts.items()))


def cases(storages: Sequence[str], tokens: int, read_ahead: bool,
          diagnose: Sequence[str] = ()) -> list[dict[str, Any]]:
  """One dict per compile: storage, tokens, diagnostic variant ("" for the kernel) and the
  MosaicTileConfig fields (the default tiling for those operands, and with ``read_ahead``
  the same plus ``epi_read_ahead``); each ``diagnose`` variant with the default tiling."""
  from experiments import profile_mosaic  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  out = []
  for storage in storages:
    x, dy, w, state, _ = profile_mosaic._problem(f"{tokens}x4096x4096", storage)
    cfg = fm.default_config(x, dy, w, tuple(state[1:]))
    variants = [cfg] + ([dataclasses.replace(cfg, epi_read_ahead=True)] if read_ahead else [])
    for v in variants:
      out.append({"storage": storage, "tokens": tokens, "variant": "", "config": dataclasses.asdict(v)})
    for variant in diagnose:
      out.append({"storage": storage, "tokens": tokens, "variant": variant,
                  "config": dataclasses.asdict(cfg)})
  return out


def worker(case: dict[str, Any]) -> int:
  """Compiles and runs one call (in this process, whose output the parent reads)."""
  import jax  # pylint: disable=g-import-not-at-top
  import forge_jax  # pylint: disable=g-import-not-at-top
  from experiments import profile_mosaic  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  x, dy, w, state, opt = profile_mosaic._problem(f"{case['tokens']}x4096x4096", case["storage"])
  cfg = fm.MosaicTileConfig(**case["config"])
  with fm.diagnosing(*([case["variant"]] if case.get("variant") else [])):
    step = jax.jit(lambda w, st: forge_jax.fused_linear_update(x, dy, w, st, opt, "mosaic", config=cfg))
    jax.block_until_ready(step(w, state))
  return 0


def run_case(case: dict[str, Any], timeout: float, sass: bool = False,
             ptx_path: Optional[pathlib.Path] = None) -> dict[str, Any]:
  """One compile in a fresh process; with ``ptx_path`` its PTX is also dumped, counted
  (:func:`parse_ptx_math`) and saved there, gzipped."""
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", **({"MOSAIC_GPU_DUMP_SASS": "1"} if sass else {}),
             **({"MOSAIC_GPU_DUMP_PTX": "1"} if ptx_path else {}))
  env.pop("MOSAIC_GPU_DUMP_TO", None)  # with it set, Mosaic GPU writes files and skips ptxas -v
  cmd = [sys.executable, "-m", "experiments.ptxas_report", "--worker", json.dumps(case)]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return dict(case, status="timeout", error=f"no result in {timeout:.0f} s")
  text = proc.stdout + proc.stderr
  row = dict(case, **parse_ptxas(text))
  if ptx_path is not None:
    row["ptx_math"] = parse_ptx_math(text)
    with gzip.open(ptx_path, "wt") as f:
      f.write(text)
    row["ptx_file"] = ptx_path.name
  if sass:
    row.update(parse_sass(text))
    if not row["sass_instructions"]:
      row["sass_error"] = next((ln.strip()[:300] for ln in text.splitlines() if "nvdisasm" in ln),
                               "no SASS in the output")
  if proc.returncode != 0:
    return dict(row, status="error", error=text.strip().splitlines()[-1][:300] if text.strip() else "")
  if row["registers"] is None:
    return dict(row, status="no_report", error="the process printed no ptxas report")
  return dict(row, status="ok")


def markdown(info: dict, rows: Sequence[dict]) -> str:
  from experiments import check_mosaic_gpu  # pylint: disable=g-import-not-at-top

  out = ["# ptxas: registers and spills of the Mosaic kernel", "",
         f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
         "AdamW, K x N = 4096x4096; one compile per row in a fresh process with "
         "`MOSAIC_GPU_DUMP_PTXAS=1`. Registers: ptxas's per-thread figure for the kernel (the "
         "warpgroups then set their own limits with setmaxnreg). Bytes: stack frame, spill stores, "
         "spill loads.", "",
         "| storage | T | config | status | registers | stack | spill st | spill ld |",
         "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    cells = [r.get(k) for k in ("registers", "stack_frame_bytes", "spill_store_bytes", "spill_load_bytes")]
    cells = ["-" if c is None else str(c) for c in cells]
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:80]}"
    variant = f" `{r['variant']}`" if r.get("variant") else ""
    out.append(f"| {r['storage']} | {r['tokens']} | {check_mosaic_gpu.cfg_text(r['config'])}{variant} | "
               f"{status} | " + " | ".join(cells) + " |")
  with_sass = [r for r in rows if "sass_instructions" in r]
  if with_sass:
    classes = [*SASS_CLASSES, "other"]
    out += ["", "SASS instructions (static counts of the whole kernel; `--sass`):", "",
            "| storage | T | variant | total | " + " | ".join(classes) + " |",
            "|---|---|---|---|" + "---|" * len(classes)]
    for r in with_sass:
      if not r["sass_instructions"]:
        out.append(f"| {r['storage']} | {r['tokens']} | {r.get('variant') or 'kernel'} | "
                   f"{r.get('sass_error', '')[:100]} |" + " |" * len(classes))
        continue
      out.append(f"| {r['storage']} | {r['tokens']} | {r.get('variant') or 'kernel'} | "
                 f"{r['sass_instructions']} | "
                 + " | ".join(str(r["sass_classes"].get(c, 0)) for c in classes) + " |")
  with_ptx = [r for r in rows if "ptx_math" in r]
  if with_ptx:
    out += ["", "Float32 division and special functions in the PTX (static counts; `--ptx`; the "
            "whole dump is in the row's `ptx_file`):", ""]
    for r in with_ptx:
      ops = ", ".join(f"`{op}` {n}" for op, n in r["ptx_math"].items()) or "none found"
      out.append(f"- {r['storage']} T={r['tokens']} {r.get('variant') or 'kernel'}: {ops}")
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="results folder (default $OUT or ./runs)")
  parser.add_argument("--storage", nargs="+", default=list(STORAGES),
                      help="experiments.bench_lowp CONFIGS names")
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--read-ahead", action="store_true", help="also each default with epi_read_ahead")
  parser.add_argument("--timeout", type=float, default=120.0, help="seconds per compile")
  parser.add_argument("--sass", action="store_true",
                      help="also count the kernels' SASS instructions (needs nvdisasm)")
  parser.add_argument("--ptx", action="store_true",
                      help="also dump each kernel's PTX (MOSAIC_GPU_DUMP_PTX=1): saved gzipped, "
                           "its float32 division/sqrt/rcp instructions counted")
  parser.add_argument("--diagnose", nargs="+", default=[], choices=fm.DIAGNOSE_VARIANTS,
                      help="also compile these diagnostic epilogues (fused_dw_mosaic._DIAGNOSE)")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return worker(json.loads(args.worker))

  import jax  # pylint: disable=g-import-not-at-top
  from experiments import _timing  # pylint: disable=g-import-not-at-top
  from experiments import bench_lowp  # pylint: disable=g-import-not-at-top

  for storage in args.storage:
    if storage not in bench_lowp.CONFIGS:
      parser.error(f"--storage {storage!r} is not one of {', '.join(bench_lowp.CONFIGS)}")
  if jax.default_backend() != "gpu":
    parser.error("ptxas runs when the kernel compiles for a GPU: run this on the H200")
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.ptxas_report", argv)
  rows = []
  for i, case in enumerate(cases(args.storage, args.tokens, args.read_ahead, args.diagnose)):
    row = run_case(case, args.timeout, args.sass, folder / f"ptx_{i}.txt.gz" if args.ptx else None)
    rows.append(row)
    _timing.log(f"  {row['storage']:<14} {row.get('variant') or 'kernel':<12} {row['status']:<9} "
                f"regs={row.get('registers')} "
                f"spill st/ld={row.get('spill_store_bytes')}/{row.get('spill_load_bytes')}"
                + (f" sass={row.get('sass_instructions')} {row.get('sass_classes')}" if args.sass else ""))
    _timing.write_json(folder / "ptxas_report.json", {"info": info, "rows": rows})
  (folder / "ptxas_report.md").write_text(markdown(info, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
