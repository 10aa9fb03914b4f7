"""Reproduces the measurements behind ``experiments/RESULTS.md``, one suite per GPU call.

    python -m experiments.reproduce --suite front|kernels|lowp|storage|auto|models|capacity|convergence --out DIR
    python -m experiments.reproduce --suite models --part 1/2 --out DIR   # half of the rows
    python -m experiments.reproduce --suite models --dry-run              # commands and estimate

Each suite is sized for one 10-minute call on one H200 with 16 CPU cores (the models suite in
two parts, ``--part 1/2`` and ``--part 2/2``). It runs the repository's own tools as
subprocesses, each with a time limit, so a hang costs that step, not the call:

* ``front``: the README's first figures: Llama-3.1-8B at 1x1024 in bf16, nine rows side by
  side in one ``experiments.bench_models`` run, eight without remat (optax.adamw and optax +
  ``clip_by_global_norm(1.0)`` unrolled; FORGE unrolled and scanned, each with and without the
  non-finite guard; FORGE with int8 states and stochastically rounded bf16 weights, unrolled and
  scanned) and the unrolled int8 row again with ``remat="save_all_but_elementwise"``, then
  ``experiments.compile_cost``: the scanned and the unrolled FORGE step's compile seconds, each
  twice in a fresh process.
* ``kernels``: ``experiments.check_mosaic_gpu --quick`` (the Mosaic kernel against its
  reference on the real shapes) and ``experiments.bench_fused_dw`` (per-layer fused dW +
  update against XLA), each at its own defaults.
* ``lowp``: ``experiments.bench_lowp``, the kernel per storage on the model's block shapes
  (Llama-3.1-8B's four) at T = 1024 and 4096 (fp32 weights with fp32, bf16 or int8 states; bf16 weights,
  rounded to nearest or stochastically, with bf16 or int8 states): int8 states against float
  ones under the same weight.
* ``storage``: what each storage choice costs in the step and per layer, side by side: the
  unrolled Llama-3.1-8B step at 1x1024 without remat for optax and FORGE with bf16 or
  stochastically rounded bf16 weights and bf16 or int8 states (five rows, profiled: each kernel's
  time in the step), then ``experiments.bench_lowp --with-dx`` on the model's block shapes at
  T=1024 for the same four storages (each update after its dX product, as the step runs it).
* ``auto``: ``experiments.bench_fused_dw --auto-table --members``: the Mosaic kernel against XLA
  on the presets' projections that ``"auto"``'s table serves through another shape's entry (each
  shape class's members but its representative) at every T and storage the table has, then
  ``auto_regret.md``: each case's time under the pick of the table ``"auto"`` reads on this
  GPU over the faster backend's, and ``auto_table_with_members.json``: that table with the
  measured cases joined, to ship for that GPU.
* ``models``: the headline table, Llama-3.1-8B at 1x1024 in bf16: optax.adamw, optax +
  ``clip_by_global_norm(1.0)``, FORGE (nearest and stochastic rounding) and FORGE with int8
  states (stochastically rounded bf16 weights), each scanned (remat full) and unrolled (remat
  none); optax, FORGE and FORGE int8 scanned without remat; optax, optax + clip and FORGE
  unrolled with full remat; and the fidelity baseline, optax with float32 weights and states and bf16
  compute, unrolled, remat none, under a 95% allocator limit. One ``experiments.bench_models``
  run: every step compiled first in parallel (``--precompile``) into a persistent compilation
  cache, then each row timed alone.
* ``capacity``: the largest Llama-3.1-8B batch of 1024 tokens per implementation under jax's
  default limit, the pool preallocated: for optax+clip, FORGE and FORGE with int8 states, the
  batch that fits and the next one, which runs out of memory (``bench_models --preallocate``).
* ``convergence``: ``experiments.convergence`` on qwen3-0.6b at 8x256 in float32: FORGE,
  optax and the one-ulp control from the same pre-trained weights.

Under ``--out`` each suite writes ``reproduce_<suite>[_part<k>of<n>].json`` and ``.md`` (the
command, date, device, package versions and each step's command, exit status and seconds),
each tool's own JSON and markdown (``bench_models`` runs as ``<step>.json``/``.md``, the others in
a folder named after the step), and each step's log. The models
suite also writes ``headline.md`` (``experiments.results_tables``); pointed at
``experiments/results/h200/models`` it rewrites RESULTS.md's headline table as well.

``--clocks`` samples the GPU's SM clock, power and throttle reasons with ``nvidia-smi`` while the
steps run (``experiments.gpu_clocks``, one phase a step, and one for each ``bench_models`` row's
timed steps) and writes ``clocks/clocks.md``: whether a suite's timings ran at the GPU's top
clock or at its power cap (a whole step reaches the cap, per-layer bursts do not), row by row.

The parent process never initializes a JAX backend (the device name comes from a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time

from experiments import gpu_clocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUITES = ("front", "kernels", "lowp", "storage", "auto", "models", "capacity", "convergence")
CALL_S = 600  # one device call
CLOCKS_INTERVAL_MS = 250  # --clocks: about 2,200 samples in a call
BUDGET_S = 560  # what a suite plans to use of it: start-up and copying results take the rest

MODEL = "llama-3.1-8b"
# The headline rows, in table order: implementation[_unrolled][:row options] (bench_models).
HEADLINE_ROWS = (
    "optax", "optax_clip", "forge", "forge_sr", "forge_int8_sr",
    "optax:remat=none", "forge:remat=none", "forge_int8_sr:remat=none",
    "optax_unrolled:remat=none", "optax_clip_unrolled:remat=none", "forge_unrolled:remat=none",
    "forge_sr_unrolled:remat=none", "forge_int8_sr_unrolled:remat=none",
    "optax_unrolled", "optax_clip_unrolled", "forge_unrolled",
    "optax_unrolled:remat=none:master=float32:mem=0.95",
)
# The front suite's rows (README, first bullets), side by side in one run: remat none, and last
# the unrolled int8 row whose blocks save what a scanned stack saves (forge_jax's policy).
FRONT_ROWS = tuple(f"{row}:remat=none" for row in (
    "optax_unrolled", "optax_clip_unrolled", "forge_unrolled", "forge_noguard_unrolled",
    "forge", "forge_noguard", "forge_int8_sr_unrolled", "forge_int8_sr")) + (
    "forge_int8_sr_unrolled:remat=save_all_but_elementwise",)
# The lowp suite's storages: int8 states against float ones under each weight (H100,
# 2026-12-05: Llama-3.1-8B's four block shapes at two T, 56 cases, ~130 s).
LOWP_CONFIGS = ("fp32", "fp32_bf16", "fp32_int8", "bf16_rtn_bf16", "bf16_rtn_int8", "bf16_sr_bf16",
                "bf16_sr_int8")
# Seconds on an H100 (16 CPU cores), 2026-12-05: the eight rows without remat in one call
# 232-347 s (a ninth adds about 30 s), the compile ratio (four fresh processes) about 100 s.
FRONT_S = {"rows": 380.0, "compile": 110.0}
# Seconds on the H200 (16 CPU cores), from earlier runs: compiling a Llama-3.1-8B step at 1x1024
# (unrolled 97-143 s, scanned 20-40 s), and a timed row whose step comes from the cache (start-up,
# init, 3 warm-up and 3 x 5 timed steps).
COMPILE_S = {"unrolled": 180.0, "scanned": 40.0}  # unrolled: the slowest, with 8 compiling at once
ROW_S = 40.0
PRECOMPILE = 10  # compile processes at once: each takes one core most of its time (16 on the H200 machine)

# (implementation, batch that fits, batch that does not, seconds for both) at 1024 tokens, from
# the capacity search of 2026-12-01 (results/h200/capacity_per_impl). A fitting row compiles
# (~40 s) and runs 6 steps of ~0.1 s per sequence; a row that does not fit stops at its first.
CAPACITY_EDGES = (("forge", 112, 120, 200), ("optax_clip", 64, 72, 150), ("forge_int8", 136, 144, 200))


@dataclasses.dataclass
class Step:
  """One tool run: ``python -m <argv...>`` with a time limit."""

  name: str
  argv: list
  estimate_s: float
  timeout_s: int
  env: dict = dataclasses.field(default_factory=dict)

  def command(self) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
    return (env + " " if env else "") + " ".join(["python", "-m", *map(shlex.quote, self.argv)])


def parse_part(text: str | None) -> tuple[int, int]:
  """``"2/3"`` -> ``(2, 3)``; None -> ``(1, 1)``."""
  if text is None:
    return 1, 1
  k, sep, n = text.partition("/")
  try:
    k, n = int(k), int(n)
  except ValueError:
    k = n = 0
  if not sep or n < 1 or not 1 <= k <= n:
    raise ValueError(f"--part {text!r} must be K/N with 1 <= K <= N, e.g. 1/2")
  return k, n


def headline_rows(part: tuple[int, int]) -> list[str]:
  """The headline rows of ``part`` (K/N): every N-th row from the K-th, so that each part gets
  its share of the slow unrolled compiles."""
  k, n = part
  return list(HEADLINE_ROWS[k - 1::n])


def models_estimate(rows) -> float:
  """Seconds: the rows' steps compiled ``PRECOMPILE`` at a time, then each row timed."""
  from experiments import bench_models  # pylint: disable=g-import-not-at-top
  compiles = sorted((COMPILE_S["scanned" if bench_models.parse_impl(r)[1] else "unrolled"] for r in rows),
                    reverse=True)
  waves = sum(compiles[i] for i in range(0, len(compiles), PRECOMPILE))  # the slowest of each wave
  return waves + ROW_S * len(rows)


def models_steps(out: pathlib.Path, part, args) -> list[Step]:
  rows = headline_rows(part)
  tag = "models" if part == (1, 1) else f"models_part{part[0]}of{part[1]}"
  estimate = models_estimate(rows)
  argv = ["experiments.bench_models", "--out", str(out), "--models", args.model, "--batch", "1",
          "--tokens", str(args.tokens), "--dtype", "bfloat16", "--remat", "full",
          "--impls", ",".join(rows), "--steps", "5",
          "--precompile", str(min(PRECOMPILE, len(rows))), "--compile-cache", args.compile_cache,
          "--timeout", "300", "--time-budget", str(BUDGET_S - 20)]
  return [Step(tag, argv, estimate, BUDGET_S, env={"BENCH_TAG": tag})]


def side_by_side(out: pathlib.Path, args, rows, *, steps: int, limit: int, profile: bool = False) -> list:
  """``bench_models`` argv: ``rows`` of the model at 1 x ``tokens`` in bf16 without remat, every
  step compiled first at once, then each row timed (``steps`` a repeat), within ``limit`` s."""
  return ["experiments.bench_models", "--out", str(out), "--models", args.model, "--batch", "1",
          "--tokens", str(args.tokens), "--dtype", "bfloat16", "--remat", "none",
          "--impls", ",".join(rows), *(["--profile"] if profile else []), "--mem-fraction", "0.9",
          "--steps", str(steps), "--precompile", str(len(rows)), "--compile-cache", args.compile_cache,
          "--timeout", str(limit - 30), "--time-budget", str(limit - 20)]


def front_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part
  import models  # pylint: disable=g-import-not-at-top
  compile_limit = 130
  rows_limit = BUDGET_S - compile_limit
  rows = side_by_side(out, args, FRONT_ROWS, steps=10, limit=rows_limit)
  layers = models.get_config(args.model).num_layers  # the whole model, as the rows run it
  compile_cost = ["experiments.compile_cost", "--out", str(out / "compile_cost"), "--model", args.model,
                  "--layers", str(layers), "--tokens", str(args.tokens),
                  "--impls", "forge,forge_unrolled", "--attention", "auto", "--compile", "--fresh",
                  "--repeats", "2"]
  return [Step("front", rows, FRONT_S["rows"], rows_limit, env={"BENCH_TAG": "front"}),
          Step("compile_cost", compile_cost, FRONT_S["compile"], compile_limit)]


def kernels_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part, args
  # Only --out: the kernel tools' own defaults define what they measure.
  return [Step("check_mosaic_gpu", ["experiments.check_mosaic_gpu", "--out", str(out / "check_mosaic_gpu"),
                                    "--quick"], 170, 240),
          Step("bench_fused_dw", ["experiments.bench_fused_dw", "--out", str(out / "bench_fused_dw")],
               120, 300)]


def lowp_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part
  from experiments import bench_fused_dw  # pylint: disable=g-import-not-at-top
  shapes = [f"{k}x{n}" for k, n in bench_fused_dw.block_shapes(args.model)]
  return [Step("bench_lowp", ["experiments.bench_lowp", "--out", str(out / "bench_lowp"),
                              "--tokens", "1024", "4096", "--shapes", *shapes,
                              "--configs", *LOWP_CONFIGS, "--impls", "mosaic"], 130, 300)]


# The storage suite: optax, then FORGE's weight rounding x state storage, unrolled, remat none; and
# the same four storages per layer (H100, 2026-12-06: the rows 345 s, the per-layer run 67 s).
STORAGE_ROWS = ("optax_unrolled", "forge_unrolled", "forge_sr_unrolled", "forge_int8_unrolled",
                "forge_int8_sr_unrolled")
STORAGE_CONFIGS = ("bf16_rtn_bf16", "bf16_sr_bf16", "bf16_rtn_int8", "bf16_sr_int8")
STORAGE_S = {"rows": 360.0, "per_layer": 90.0}


def storage_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part
  from experiments import bench_fused_dw  # pylint: disable=g-import-not-at-top
  layer_limit = 130
  rows_limit = BUDGET_S - layer_limit
  rows = side_by_side(out, args, STORAGE_ROWS, steps=5, limit=rows_limit, profile=True)
  shapes = [f"{k}x{n}" for k, n in bench_fused_dw.block_shapes(args.model)]
  per_layer = ["experiments.bench_lowp", "--out", str(out / "bench_lowp_with_dx"),
               "--tokens", str(args.tokens), "--shapes", *shapes, "--configs", *STORAGE_CONFIGS,
               "--impls", "mosaic", "--with-dx"]
  return [Step("storage", rows, STORAGE_S["rows"], rows_limit, env={"BENCH_TAG": "storage"}),
          Step("bench_lowp_with_dx", per_layer, STORAGE_S["per_layer"], layer_limit)]


def auto_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part, args
  from experiments import bench_fused_dw  # pylint: disable=g-import-not-at-top
  members = bench_fused_dw.class_members(bench_fused_dw.preset_shapes())  # what the tool measures
  plan = bench_fused_dw.auto_plan([(m, [m]) for m in members], bench_fused_dw.AUTO_TOKENS,
                                  list(bench_fused_dw.AUTO_CONFIGS))
  estimate = bench_fused_dw.auto_estimate_s(plan, "mosaic", workers=8)
  # The tool stops starting cases before its limit and writes what it measured.
  return [Step("auto_members", ["experiments.bench_fused_dw", "--auto-table", "--members",
                                "--time-limit", str(BUDGET_S - 40), "--out", str(out / "auto_members")],
               estimate, BUDGET_S)]


def capacity_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part
  steps = []
  for impl, fits, fails, limit in CAPACITY_EDGES:
    tag = f"capacity_{impl}"
    estimate = 40 + 6 * 0.1 * fits + 50
    # No --time-budget: it would skip the second row by the first's wall time, though a row that
    # runs out of memory stops early. The step's limit cuts a run that overruns; bench_models has
    # written the first row by then.
    steps.append(Step(tag, ["experiments.bench_models", "--out", str(out), "--models", args.model,
                            "--impls", impl, "--batch", f"{fits},{fails}", "--tokens", str(args.tokens),
                            "--steps", "1", "--preallocate", "--timeout", str(limit - 40)],
                      estimate, limit, env={"BENCH_TAG": tag}))
  return steps


def convergence_steps(out: pathlib.Path, part, args) -> list[Step]:
  del part, args
  return [Step("convergence", ["experiments.convergence", "--out", str(out / "convergence"),
                               "--dtype", "float32", "--matmul-precision", "highest", "--batch", "8",
                               "--seq", "256", "--pretrain-steps", "100", "--steps", "300",
                               "--warmup", "50"], 480, BUDGET_S)]


BUILDERS = {"front": front_steps, "kernels": kernels_steps, "lowp": lowp_steps,
            "storage": storage_steps, "auto": auto_steps,
            "models": models_steps, "capacity": capacity_steps, "convergence": convergence_steps}


def versions() -> dict:
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "jax-cuda12-plugin", "flax", "optax", "numpy", "triton"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def device_name() -> str:
  """The first device's kind, from a subprocess (this one never initializes a backend)."""
  probe = [sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"]
  try:
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  except subprocess.TimeoutExpired:
    return "unknown"
  lines = proc.stdout.strip().splitlines()
  return lines[-1] if proc.returncode == 0 and lines else "unknown"


def run_step(step: Step, out: pathlib.Path) -> dict:
  env = dict(os.environ, **step.env)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  log = out / f"{step.name}.log"
  t0 = time.monotonic()
  with open(log, "w") as f:
    try:
      rc = subprocess.run([sys.executable, "-m", *step.argv], stdout=f, stderr=subprocess.STDOUT,
                          env=env, cwd=ROOT, timeout=step.timeout_s).returncode
    except subprocess.TimeoutExpired:
      rc = None
  return {"name": step.name, "command": step.command(), "rc": rc, "seconds": time.monotonic() - t0,
          "estimate_s": step.estimate_s, "timeout_s": step.timeout_s, "log": log.name}


def row_windows(step: Step) -> list[tuple[str, list]]:
  """A ``bench_models`` step's rows as clock phases: ``("<step>: <model> <batch>x<tokens>
  <impl>", the row's timed-steps window)`` for each row of its JSON that has one (none for other
  tools, or where the step wrote no JSON)."""
  tag = step.env.get("BENCH_TAG")
  if not tag or step.argv[:1] != ["experiments.bench_models"] or "--out" not in step.argv:
    return []
  path = pathlib.Path(step.argv[step.argv.index("--out") + 1]) / f"{tag}.json"
  try:
    rows = json.loads(path.read_text())["rows"]
  except (OSError, ValueError, KeyError):
    return []
  return [(f"{step.name}: {r['model']} {r['batch']}x{r['tokens']} {r['impl']}", r["steps_window"])
          for r in rows if "steps_window" in r]


def markdown(record: dict) -> str:
  lines = [f"# Reproduction: {record['suite']} suite" + (f", part {record['part']}" if record["part"] != "1/1" else ""),
           "", f"Command: `{record['command']}`  ",
           f"Date: {record['date']}; device {record['device']}; "
           + ", ".join(f"{k} {v}" for k, v in record["versions"].items()) + ".", "",
           "| step | exit | seconds | estimate s | command |", "|---|---|---|---|---|"]
  for s in record["steps"]:
    rc = "timeout" if s.get("rc", 0) is None else s.get("rc", "not run")
    secs = f"{s['seconds']:.0f}" if "seconds" in s else ""
    lines.append(f"| {s['name']} | {rc} | {secs} | {s['estimate_s']:.0f} | `{s['command']}` |")
  if record.get("clocks"):
    lines += ["", f"GPU clocks while the steps ran: [{record['clocks']}]({record['clocks']})"]
  if record.get("tables"):
    lines += ["", "Tables: " + ", ".join(f"[{t}]({t})" for t in record["tables"])]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", required=True, choices=SUITES)
  parser.add_argument("--out", default=os.environ.get("OUT", "runs/reproduce"))
  parser.add_argument("--part", default=None,
                      help="K/N: run the K-th of N parts of the models suite's rows (e.g. 1/2)")
  parser.add_argument("--dry-run", action="store_true",
                      help="print the commands and the estimated time; run nothing")
  parser.add_argument("--model", default=MODEL,
                      help="the front, lowp, models and capacity suites' model (a tiny preset to "
                      "try it on a CPU)")
  parser.add_argument("--tokens", type=int, default=1024,
                      help="tokens per sequence (front, models, capacity)")
  parser.add_argument("--compile-cache", default=os.path.join("/tmp", "forge_jax_compile_cache"),
                      help="jax's persistent compilation cache for the front and models suites "
                      "(kept out of --out)")
  parser.add_argument("--clocks", action="store_true",
                      help="sample the GPU's clocks and power with nvidia-smi while the steps run "
                      "(clocks/clocks.md)")
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  try:
    part = parse_part(args.part)
  except ValueError as e:
    parser.error(str(e))
  if part != (1, 1) and args.suite != "models":
    parser.error(f"--part splits the models suite only (got --suite {args.suite})")
  if args.clocks and not args.dry_run and not gpu_clocks.available():
    parser.error("--clocks samples the GPU with nvidia-smi, which is not on the PATH: run on an "
                 "NVIDIA GPU, or leave --clocks out")
  out = pathlib.Path(args.out).resolve()  # the tools run from the repository root
  args.compile_cache = os.path.abspath(args.compile_cache)
  steps = BUILDERS[args.suite](out, part, args)
  estimate = sum(s.estimate_s for s in steps)
  for s in steps:
    print(f"[{s.name}] ~{s.estimate_s:.0f} s (limit {s.timeout_s} s): {s.command()}", flush=True)
  print(f"estimated {estimate:.0f} s of the {CALL_S} s of one call", flush=True)
  if args.suite == "models" and estimate > BUDGET_S:
    n = math.ceil(models_estimate(HEADLINE_ROWS) / (BUDGET_S - 40))
    print(f"that is more than one call: run --part 1/{n} ... --part {n}/{n}, one per call", flush=True)
  part_text = f"{part[0]}/{part[1]}"
  record = {"suite": args.suite, "part": part_text,
            "command": " ".join(["python", "-m", "experiments.reproduce", *map(shlex.quote, argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": "unknown", "versions": versions(), "estimate_s": estimate,
            "steps": [{"name": s.name, "command": s.command(), "estimate_s": s.estimate_s,
                       "timeout_s": s.timeout_s} for s in steps]}
  if args.dry_run:
    return record
  out.mkdir(parents=True, exist_ok=True)
  suffix = "" if part == (1, 1) else f"_part{part[0]}of{part[1]}"
  paths = {ext: out / f"reproduce_{args.suite}{suffix}.{ext}" for ext in ("json", "md")}
  record["device"] = device_name()

  def write():
    paths["json"].write_text(json.dumps(record, indent=1) + "\n")
    paths["md"].write_text(markdown(record))

  write()
  # Without --clocks the phases are recorded and dropped.
  sampler = (gpu_clocks.sampling(out / "clocks", CLOCKS_INTERVAL_MS, record["command"])
             if args.clocks else contextlib.nullcontext(gpu_clocks.Recorder({"phases": {}})))
  with sampler as recorder:
    for i, step in enumerate(steps):
      with recorder.phase(step.name, step.command()):
        record["steps"][i] = run_step(step, out)
      for name, window in row_windows(step):
        recorder.add(name, step.command(), window)
      print(f"[{step.name}] exit {record['steps'][i]['rc']} after {record['steps'][i]['seconds']:.0f} s",
            flush=True)
      write()
  if args.clocks:
    gpu_clocks.write_summary(out / "clocks", busy=90)
    record["clocks"] = "clocks/clocks.md"
    write()
  if args.suite == "models":
    from experiments import results_tables  # pylint: disable=g-import-not-at-top
    record["tables"] = results_tables.write_headline(out)
    write()
  print(paths["md"].read_text(), flush=True)
  return record


if __name__ == "__main__":
  main()
