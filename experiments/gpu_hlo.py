"""What XLA:GPU compiles for a FORGE layer update or training step, on a host without a GPU.

jax's CUDA PJRT plugin compiles for a compile-only Hopper device (the H200 described in
``H200_TARGET``: XLA's GPU pipeline, fusion, scheduling and buffer assignment, no CUDA library
and no driver needed). Install the plugin matching jaxlib, into an environment of its own if the
CPU tests should keep running without it:

    pip install "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')" \\
        "jax-cuda12-pjrt==$(python -c 'import jaxlib; print(jaxlib.__version__)')"

Then, from the repository root (the per-layer program that ``bench_lowp`` times, on the
``"xla"`` route or the Mosaic kernel; a model's training step as ``bench_models`` builds it):

    PYTHONPATH=$PWD python -m experiments.gpu_hlo layer --shape 1024x4096x4096 \\
        --configs fp32,fp32_noguard --impl xla --out $OUT
    PYTHONPATH=$PWD python -m experiments.gpu_hlo step --model llama-3.1-8b --layers 3 \\
        --impls forge_unrolled,optax_unrolled --out $OUT

For each program: the launches (top-level fusions and custom calls, a loop's body counted once
per trip), the copies, and the bytes each launch's operands and results span, the sum of which
bounds its memory traffic from above (a kernel that updates one layer of a stack in place counts
the whole stack). XLA's GEMM autotuner needs a device, so it is off: GEMMs compile to XLA's
default choices (on a GPU, cuBLAS where the autotuner prefers it), and the models' attention
is XLA's (``bench_models`` runs cuDNN's fused attention on a GPU, which needs a device to
compile: XLA's materializes the attention scores and transposes them); the rest is what a GPU
compile makes of the program, with the host's jax and XLA (not the GPU machine's). The Mosaic
GPU kernels are compiled to SASS as well (Mosaic GPU runs ptxas, from the
``nvidia-cuda-nvcc-cu12`` wheel here): ``--ptxas`` lists each kernel's registers and spills,
and ``experiments.kernel_tools ptxas|sass --compile-only`` reads one kernel's SASS. ``--baseline-tree DIR`` runs the same on another checkout's ``forge_jax`` and
``pallas_kernels`` (this tree's harness), side by side. Writes ``gpu_hlo.json`` and
``gpu_hlo.md`` (and each program's optimized HLO with ``--hlo``) to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import os
import pathlib
import re
import sys
from typing import Optional, Sequence

# An H200 as XLA's GpuTargetConfigProto describes one (what the compile reads of the device).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200 (compile only)"
"""
COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0}  # no device to autotune on
PLUGIN_HINT = ('pip install "jax-cuda12-plugin==JAXLIB" "jax-cuda12-pjrt==JAXLIB" '
               "(JAXLIB: this jaxlib's version)")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "s16": 2,
          "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
# `%name = SHAPE opcode(operands), attributes`; a tuple SHAPE is parenthesized (no `=` inside
# once XLA's `/*index=N*/` comments are dropped).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) \((.*?)\) -> (.*?) \{")
_SKIPPED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
            "partition-id", "replica-id", "opt-barrier"}


def shape_bytes(shape: str) -> int:
  """Bytes of the arrays in an HLO shape (a tuple's elements summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def launches(hlo_text: str) -> list[dict]:
  """The launches of a compiled module, in program order: one ``{"name", "kind", "bytes",
  "count", "shape", "transpose"}`` per top-level fusion, custom call, copy or other op of the entry
  computation and of the loops and conditionals it calls (``count``: a loop's known trip count,
  else 1). ``kind``: ``fusion:<kLoop|kInput|kCustom|...>`` (``:<target>`` when the fused
  computation holds a custom call), ``custom:<target>``, or the opcode. ``bytes``: operands +
  results (a fusion's: its fused computation's parameters + results). ``transpose``: a fusion
  whose result is a transpose (of an operand, a layout change)."""
  text = re.sub(r"/\*index=\d+\*/", "", hlo_text)
  computations, shapes = {}, {}
  for block in re.split(r"\n(?=\S)", text):
    head, _, body = block.partition("\n")
    m = _COMPUTATION.match(head)
    if not m:
      continue
    computations[m.group(2)] = (bool(m.group(1)), m.group(3), m.group(4), body)
    for line in body.splitlines():
      if (inst := _INSTRUCTION.match(line)):
        shapes[inst.group(1)] = inst.group(2)
  out: list[dict] = []

  def walk(name: str, count: int) -> None:
    for line in computations[name][3].splitlines():
      inst = _INSTRUCTION.match(line)
      if not inst or inst.group(3) in _SKIPPED:
        continue
      iname, shape, op, operands, attrs = inst.groups()
      if op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
        walk(re.search(r"body=%([\w.\-]+)", attrs).group(1), count * (int(trips.group(1)) if trips else 1))
        continue
      if op in ("conditional", "call"):
        for called in re.findall(r"%([\w.\-]+)", " ".join(
            re.findall(r"(?:branch_computations=\{[^}]*\}|to_apply=%[\w.\-]+)", attrs))):
          walk(called, count)
        continue
      transpose = False
      if op == "fusion":
        _, params, results, body = computations[re.search(r"calls=%([\w.\-]+)", attrs).group(1)]
        size = shape_bytes(params) + shape_bytes(results)
        target = re.search(r'custom_call_target="([^"]+)"', body)
        kind = "fusion:" + re.search(r"kind=(\w+)", attrs).group(1) + (f":{target.group(1)}" if target else "")
        root = re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", body)
        transpose = bool(root) and root.group(1) == "transpose"
      else:
        size = sum(shape_bytes(shapes.get(o, "")) for o in re.findall(r"%([\w.\-]+)", operands))
        size += shape_bytes(shape)
        target = re.search(r'custom_call_target="([^"]+)"', attrs)
        kind = f"custom:{target.group(1)}" if op == "custom-call" and target else op
      out.append({"name": iname, "kind": kind, "bytes": size, "count": count, "shape": shape,
                  "transpose": transpose})

  entry = next(n for n, c in computations.items() if c[0])
  walk(entry, 1)
  return out


def summary(hlo_text: str) -> dict:
  """Launches, copies and bytes (operands + results, loop trips counted) of a compiled module,
  in total and by kind."""
  rows = launches(hlo_text)
  by_kind: dict = collections.defaultdict(lambda: {"launches": 0, "bytes": 0})
  for r in rows:
    by_kind[r["kind"]]["launches"] += r["count"]
    by_kind[r["kind"]]["bytes"] += r["count"] * r["bytes"]
  copies = [r for r in rows if r["kind"] == "copy"]
  transposes = [r for r in rows if r["transpose"]]
  return {"launches": sum(r["count"] for r in rows),
          "transposes": sum(r["count"] for r in transposes),
          "transpose_bytes": sum(r["count"] * r["bytes"] for r in transposes),
          "bytes": sum(r["count"] * r["bytes"] for r in rows),
          "copies": sum(r["count"] for r in copies),
          "copy_bytes": sum(r["count"] * r["bytes"] for r in copies),
          "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["bytes"]))}


def compile_only_device():
  """A compile-only H200 of jax's CUDA PJRT plugin; a RuntimeError naming the install if the
  plugin is missing."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries to check
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  try:
    topology = xla_bridge.make_pjrt_topology("cuda", "", topology="1x1x1", target_config=H200_TARGET)
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f"no compile-only CUDA device ({str(e).splitlines()[0]}): {PLUGIN_HINT}") from e
  return topology._make_compile_only_devices()[0]  # pylint: disable=protected-access


def on_device(device, tree):
  import jax  # pylint: disable=g-import-not-at-top
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def layer_program(device, config: str, shape: str, impl: str):
  """The compiled per-layer update ``bench_lowp`` times (one call), for ``config``."""
  from experiments import _timing, bench_lowp, compile_cost  # pylint: disable=g-import-not-at-top
  t, k, n = (int(v) for v in shape.split("x"))
  w_dtype, precision = bench_lowp.CONFIGS[config]
  context = compile_cost._as_on_a_hopper_gpu() if impl == "mosaic" else contextlib.nullcontext()  # pylint: disable=protected-access
  with context:
    update = _timing.layer_update(bench_lowp._optimizer(precision), impl, w_dtype, calls=1,  # pylint: disable=protected-access
                                  grad_norm=bench_lowp._with_norm(config),  # pylint: disable=protected-access
                                  applied=config.endswith(bench_lowp.APPLIED))
    carry = on_device(device, update.carry_shapes(t, k, n))
    return update.run.trace(carry).lower().compile(COMPILE_OPTIONS)


def step_program(device, model_name: str, impl: str, layers: int, tokens: int, remat: str = "none"):
  """A ``bench_models`` row's compiled training step (bf16, lean loss, ``remat``)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import forge_jax  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from experiments import bench_models, compile_cost  # pylint: disable=g-import-not-at-top
  from forge_jax import _train  # pylint: disable=g-import-not-at-top

  base, scan = bench_models.parse_impl(impl)
  base, backend = bench_models.forge_backend(base)
  forge = base.startswith("forge")
  data = on_device(device, jax.ShapeDtypeStruct((1, tokens + 1), jnp.int32))
  init_tokens = jnp.zeros((1, tokens), jnp.int32)
  with compile_cost._as_on_a_hopper_gpu():  # pylint: disable=protected-access
    cfg = models.get_config(model_name, linear="forge" if forge else "flax", remat=remat,
                            scan_layers=scan, forge_backend=backend, param_dtype="bfloat16",
                            dtype="bfloat16", attention="xla", num_layers=layers)
    if not forge:
      model = models.CausalLM(cfg)
      loss = functools.partial(bench_models._loss, model.apply, kind="lean")  # pylint: disable=protected-access
      tx, step = bench_models.optax_baseline(base, loss)
      state = jax.eval_shape(lambda: (lambda p: (p, tx.init(p)))(
          model.init(jax.random.PRNGKey(1), init_tokens)["params"]))
      return step.lower(on_device(device, state), data).compile(COMPILE_OPTIONS)
    opt = bench_models._forge_optimizer(base)  # pylint: disable=protected-access
    model = models.CausalLM(cfg, optimizer=opt)
    loss = functools.partial(bench_models._loss, model.apply, kind="lean")  # pylint: disable=protected-access
    state = jax.eval_shape(lambda: forge_jax.TrainState.create(
        model.apply, model.init(jax.random.PRNGKey(1), init_tokens), opt))
    traced = _train._train_step_jit.trace(  # pylint: disable=protected-access
        on_device(device, state), data, loss, False, bench_models.skips_nonfinite(base))
    return traced.lower().compile(COMPILE_OPTIONS)


@contextlib.contextmanager
def _process_output_to(path: pathlib.Path):
  """The process's stdout and stderr (file descriptors 1 and 2, where ptxas' report is printed
  from C++) written to ``path`` inside the block."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with open(path, "w") as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)


def compiled_with_ptxas(build, log: pathlib.Path):
  """``(build(), per-kernel ptxas figures)``: ``build`` compiles a program; the Mosaic GPU kernels
  it compiles report registers and spills (MOSAIC_GPU_DUMP_PTXAS; a process compiles each
  distinct kernel once, so a kernel an earlier program compiled is not listed again)."""
  from unittest import mock  # pylint: disable=g-import-not-at-top
  from experiments import kernel_tools  # pylint: disable=g-import-not-at-top
  with mock.patch.dict(os.environ, {"MOSAIC_GPU_DUMP_PTXAS": "1"}), _process_output_to(log):
    compiled = build()
  return compiled, kernel_tools.parse_ptxas_functions(log.read_text())


def _row(label: str, compiled, hlo_dir: Optional[pathlib.Path]) -> dict:
  text = compiled.as_text()
  if hlo_dir is not None:
    hlo_dir.mkdir(parents=True, exist_ok=True)
    (hlo_dir / (re.sub(r"[^\w.\-]+", "_", label) + ".hlo.txt")).write_text(text)
  ma = compiled.memory_analysis()
  return {"program": label, **summary(text),
          "temp_bytes": getattr(ma, "temp_size_in_bytes", None)}


def markdown(info: dict, rows: list[dict]) -> str:
  gb = lambda b: f"{b / 1e9:.3f}"
  out = ["# What XLA:GPU compiles (a compile-only H200)", "",
         f"`{info['command']}`; {info['date']}; jax {info['jax']} (CUDA PJRT plugin, compile only, "
         "GEMM autotuning off). Bytes: each launch's operands + results, summed over launches (an "
         "upper bound on memory traffic).", "",
         "| program | tree | launches | bytes GB | copies (GB) | transposes (GB) | temporaries GB | largest kinds (launches, GB) |",
         "|---|---|---|---|---|---|---|---|"]
  ptxas = [r for r in rows if r.get("mosaic_ptxas") is not None]
  for r in rows:
    kinds = "; ".join(f"{k} {v['launches']}, {gb(v['bytes'])}"
                      for k, v in list(r["by_kind"].items())[:4])
    temp = "" if r.get("temp_bytes") is None else gb(r["temp_bytes"])
    out.append(f"| {r['program']} | {r.get('tree', 'this')} | {r['launches']} | {gb(r['bytes'])} | "
               f"{r['copies']} ({gb(r['copy_bytes'])}) | {r['transposes']} ({gb(r['transpose_bytes'])}) | "
               f"{temp} | {kinds} |")
  if ptxas:
    out += ["", "The Mosaic GPU kernels each program compiled (ptxas; a process compiles a kernel "
            "once, so one an earlier program of its tree compiled is not counted again; each "
            "kernel in the JSON's `mosaic_ptxas`):", "",
            "| program | tree | kernels | spilling | spill stores per spilling kernel (bytes) | most registers |",
            "|---|---|---|---|---|---|"]
    for r in ptxas:
      ks = r["mosaic_ptxas"]
      spills = sorted(k["spill_store_bytes"] for k in ks if k["spill_store_bytes"])
      out.append(f"| {r['program']} | {r.get('tree', 'this')} | {len(ks)} | {len(spills)} | "
                 f"{', '.join(map(str, spills)) or '-'} | "
                 f"{max((k['registers'] or 0 for k in ks), default='-')} |")
  return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("what", choices=("layer", "step"))
  parser.add_argument("--shape", default="1024x4096x4096", help="layer: T x K x N")
  parser.add_argument("--configs", default="fp32,fp32_noguard", help="layer: bench_lowp configurations")
  parser.add_argument("--impl", default="xla", choices=("xla", "mosaic"), help="layer: the backend")
  parser.add_argument("--model", default="llama-3.1-8b", help="step: a models preset")
  parser.add_argument("--layers", type=int, default=3, help="step: the model cut to this many layers")
  parser.add_argument("--tokens", type=int, default=1024, help="step: tokens (batch 1)")
  parser.add_argument("--remat", default="none",
                      help="step: the blocks' activation checkpointing (a models remat choice)")
  parser.add_argument("--impls", default="forge_unrolled,optax_unrolled",
                      help="step: bench_models implementations")
  parser.add_argument("--baseline-tree", type=pathlib.Path, default=None, metavar="DIR",
                      help="also run on another checkout's forge_jax and pallas_kernels")
  parser.add_argument("--hlo", action="store_true", help="also write each optimized HLO module")
  parser.add_argument("--ptxas", action="store_true",
                      help="also each Mosaic GPU kernel's registers and spills, from ptxas")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  args = parser.parse_args(argv)
  args.out = args.out.resolve()  # the baseline's run starts in its tree
  import jax  # pylint: disable=g-import-not-at-top

  from experiments import _timing  # pylint: disable=g-import-not-at-top
  try:
    device = compile_only_device()
  except RuntimeError as e:
    parser.error(str(e))
  args.out.mkdir(parents=True, exist_ok=True)
  hlo_dir = args.out / "hlo" if args.hlo else None
  rows = []
  if args.baseline_tree is not None:
    rest = _timing.drop_options(argv, {"--baseline-tree": 1, "--out": 1})
    base = _timing.run_harness_on_tree(__file__, rest, args.out / "baseline", args.baseline_tree,
                                       "gpu_hlo.json")
    rows += [{**r, "tree": str(args.baseline_tree.resolve())} for r in base["rows"]]
  if args.what == "layer":
    programs = [(f"{args.impl} {config} {args.shape}",
                 functools.partial(layer_program, device, config, args.shape, args.impl))
                for config in args.configs.split(",")]
  else:
    programs = [(f"{impl} {args.model} {args.layers} layers 1x{args.tokens} remat {args.remat}",
                 functools.partial(step_program, device, args.model, impl, args.layers, args.tokens,
                                   args.remat))
                for impl in args.impls.split(",")]
  for i, (label, build) in enumerate(programs):
    kernels = None
    if args.ptxas:
      compiled, kernels = compiled_with_ptxas(build, args.out / f"ptxas_{i}.log")
    else:
      compiled = build()
    rows.append(_row(label, compiled, hlo_dir))
    if kernels is not None:
      rows[-1]["mosaic_ptxas"] = kernels
    _timing.log(f"{label}: {rows[-1]['launches']} launches, {rows[-1]['bytes'] / 1e9:.3f} GB")
  info = {"command": "python -m experiments.gpu_hlo " + " ".join(argv),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "jax": jax.__version__}
  (args.out / "gpu_hlo.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
  text = markdown(info, rows)
  (args.out / "gpu_hlo.md").write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
