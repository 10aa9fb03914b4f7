"""Host memory of initializing int8 optimizer states outside jit: old path vs the current one.

``forge_jax.TrainState.create`` runs the optax face's ``optimizer.init``
eagerly (embeddings, norms). This measures the peak-RSS growth of one eager
``adamw(precision=Precision(state_dtype="int8")).init`` of an embedding-sized
parameter (Qwen3-0.6B's, 151936 x 1024, bf16) in a fresh process per path:

* ``current``: ``optimizer.init`` (``forge_jax._lowp.init_slots``: one
  quantized block broadcast, no float32 array of the parameter's size);
* ``float32_detour``: what ``init_slots`` did before: quantize float32 zeros
  of the full shape, each intermediate allocated in turn.

    PYTHONPATH=$PWD python -m experiments.int8_init_memory --out experiments/results/cpu/int8_init_memory

Writes ``int8_init_memory.json`` and ``.md`` (peak RSS is a host figure: on a
GPU the same temporaries are device memory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from experiments import _timing

SHAPE = (151936, 1024)
PATHS = ("float32_detour", "current")


def worker(path: str) -> float:
  import resource

  import jax
  import jax.numpy as jnp

  import forge_jax

  p = forge_jax.Precision(state_dtype="int8")
  opt = forge_jax.adamw(1e-3, precision=p)
  e = jnp.zeros(SHAPE, jnp.bfloat16)
  jax.block_until_ready(e)
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  if path == "current":
    state = opt.init({"e": e})
  else:
    rule = opt.rule
    zeros = rule.init_slots(jnp.zeros(SHAPE, jnp.float32))
    state = tuple(p.codec(n).quantize(z) for n, z in zip(rule.slot_names, zeros))
  jax.block_until_ready(state)
  return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20  # KiB -> GiB


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--worker", choices=PATHS)
  args = parser.parse_args(argv)
  if args.worker:
    print("GIB", worker(args.worker))
    return 0
  folder = _timing.out_dir(args.out)
  info = _timing.run_info("experiments.int8_init_memory", argv)
  rows = []
  for path in PATHS:
    out = subprocess.run([sys.executable, "-m", "experiments.int8_init_memory", "--worker", path],
                         capture_output=True, text=True, check=True, env=dict(os.environ))
    gib = float(next(l for l in out.stdout.splitlines() if l.startswith("GIB")).split()[1])
    rows.append({"path": path, "peak_rss_growth_gib": gib})
  _timing.write_json(folder / "int8_init_memory.json", {"info": info, "shape": SHAPE, "rows": rows})
  table = "\n".join([
      f"`{info['command']}`; {info['date']}; {info['device']}; jax {info['jax']}.", "",
      f"Eager int8 AdamW init of a {SHAPE[0]}x{SHAPE[1]} bf16 parameter: peak host RSS growth.", "",
      "| path | peak RSS growth GiB |", "|---|---|",
      *[f"| {r['path']} | {r['peak_rss_growth_gib']:.2f} |" for r in rows]]) + "\n"
  _timing.write_table(folder / "int8_init_memory.md", table, folder / "int8_init_memory.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
