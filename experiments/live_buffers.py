"""The buffers live at a compiled train step's memory peak, read from XLA's own buffer assignment.

``memory_analysis`` says *how much* a step plans (arguments, temporaries); this says *what* is
live when the plan peaks. Each implementation's step is compiled (no allocation) by
``experiments.memory_analysis`` in a subprocess that dumps XLA's optimized module
(``--xla_dump_to``). From the dump's ``-live-range.txt`` (the flattened schedule and each
buffer's live range in it) and ``-buffer-assignment.txt`` (each buffer's size and shape) this
sums the live bytes at every point of the schedule and lists the largest buffers live at the
maximum. Arguments and outputs are buffers too, so the peak is the whole step's, as XLA's
buffer assignment sees it (buffers it does not size, such as parameter aliases it did not list,
are counted as 0 and their number is reported). Buffers that XLA placed in the same slot (one
allocation and offset: a while loop's carried tuple and its body's parameter, an in-place update
and the array it overwrites) are one piece of memory: at each point a slot counts once, at the
size of its largest live buffer (counted apart, FORGE's Llama-3.1-8B step at 64x1024 read 100.9 GiB
live on the H200 against a 92.7 GiB plan).

    python -m experiments.live_buffers --model llama-3.1-8b --impls forge,optax_clip --batch 64 \\
        --out $OUT/live_b64
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30

_SEQUENCE = re.compile(r"InstructionSequence:\n(.*?)\n\s*BufferLiveRange:", re.S)
_RANGES = re.compile(r"BufferLiveRange:\n(.*?)(?:\n\s*Live ranges at|\Z)", re.S)
_RANGE = re.compile(r"\s*(\S+?)(\{[\d,]*\}):(\d+)-(\d+)")
_VALUE = re.compile(r"\s*value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_ALLOCATION = re.compile(r"allocation (\d+): size \d+")


def parse(live_range: str, buffer_assignment: str) -> dict:
  """``{"sequence": [instruction names in schedule order], "ranges": {buffer: (start, end)},
  "sizes": {buffer: bytes}, "shapes": {buffer: shape}, "slots": {buffer: (allocation, offset)}}``
  from a module's two dump files."""
  m = _SEQUENCE.search(live_range)
  if m is None:
    raise ValueError("no InstructionSequence in the live-range dump")
  sequence = {}
  for line in m.group(1).splitlines():
    index, name = line.strip().split(":", 1)
    sequence[int(index)] = name
  ranges = {}
  m = _RANGES.search(live_range)
  for line in (m.group(1).splitlines() if m else []):
    mm = _RANGE.match(line)
    if mm:
      ranges[mm.group(1) + mm.group(2)] = (int(mm.group(3)), int(mm.group(4)))
  sizes, shapes, slots = {}, {}, {}
  allocation = None
  for line in buffer_assignment.splitlines():
    ma = _ALLOCATION.match(line)
    if ma:
      allocation = int(ma.group(1))
      continue
    mm = _VALUE.match(line)
    if mm:
      key = mm.group(1) + (mm.group(2) or "{}")
      sizes[key] = int(mm.group(3))
      # a value listed outside any allocation keeps a slot of its own
      slots[key] = (allocation, int(mm.group(4))) if allocation is not None else (key, 0)
      shape = mm.group(5)
      shapes[key] = "tuple" if shape.startswith("(") else shape.split("{")[0]
  return {"sequence": [sequence[i] for i in sorted(sequence)], "ranges": ranges, "sizes": sizes,
          "shapes": shapes, "slots": slots}


def peak(module: dict, top: int = 20, min_bytes: int = 0) -> dict:
  """The schedule's peak of live bytes, where it is, and the ``top`` largest buffers live there
  (one per slot; the other buffers live in the same slot at that point are its ``aliases``)."""
  n = len(module["sequence"])
  sizes, slots = module["sizes"], module.get("slots", {})
  by_slot = {}
  for key, (start, end) in module["ranges"].items():
    if sizes.get(key, 0) > 0 and n:
      by_slot.setdefault(slots.get(key, (key, 0)), []).append((min(start, n - 1), min(end, n - 1), key))
  live = np.zeros(n, np.int64)
  for values in by_slot.values():
    if len(values) == 1:  # the common case: the slot holds one buffer
      start, end, key = values[0]
      live[start:end + 1] += sizes[key]
    else:  # at each point the slot holds its largest live buffer's bytes
      slot = np.zeros(n, np.int64)
      for start, end, key in values:
        np.maximum(slot[start:end + 1], sizes[key], out=slot[start:end + 1])
      live += slot
  at = int(np.argmax(live)) if n else 0
  best = int(live[at]) if n else 0
  here = []
  for values in by_slot.values():
    keys = sorted(((sizes[k], k) for s, e, k in values if s <= at <= e), reverse=True)
    if keys and keys[0][0] >= min_bytes:
      here.append((keys[0][0], keys[0][1], [k for _, k in keys[1:]]))
  here.sort(key=lambda b: (b[0], b[1]), reverse=True)
  return {"peak_gib": best / GIB, "at": at, "instruction": module["sequence"][at] if n else "",
          "unsized_buffers": sum(k not in sizes for k in module["ranges"]),
          "live": [{"gib": size / GIB, "buffer": key, "shape": module["shapes"].get(key, "?"),
                    "range": list(module["ranges"][key]), "aliases": aliases}
                   for size, key, aliases in here[:top]]}


def find_step_module(dump_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """The train step's ``(live-range, buffer-assignment)`` files in a dump: the module whose
  name has ``train_step`` or ``step`` in it, the largest if several."""
  found = []
  for lr in dump_dir.glob("*-live-range.txt"):
    ba = lr.with_name(lr.name.replace("-live-range.txt", "-buffer-assignment.txt"))
    if ba.exists() and "step" in lr.name:
      found.append((ba.stat().st_size, lr, ba))
  if not found:
    raise FileNotFoundError(f"no train step's live-range and buffer-assignment files in {dump_dir}")
  _, lr, ba = max(found)
  return lr, ba


def analyse(impl: str, args, tree: pathlib.Path, tag: str = "main") -> dict:
  """Compiles ``impl``'s step from ``tree`` with a dump, and returns its peak's buffers. With
  ``args.save_hlo`` the step's optimized HLO goes to ``{args.out}/hlo_{impl}_{tag}.txt.gz`` (to
  read what the buffers live at the peak are computed by)."""
  with tempfile.TemporaryDirectory(prefix="live_buffers_") as tmp:
    dump, out = pathlib.Path(tmp) / "dump", pathlib.Path(tmp) / "out"
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               XLA_FLAGS=f"{flags} --xla_dump_to={dump} --xla_dump_hlo_module_re=.*step.* "
               "--xla_dump_buffer_assignment_analysis=true".strip())
    cmd = [sys.executable, "-m", "experiments.memory_analysis", "--model", args.model, "--impls", impl,
           "--batch", str(args.batch), "--tokens", str(args.tokens), "--dtype", args.dtype,
           "--loss", args.loss, "--out", str(out)] + (["--layers", str(args.layers)] if args.layers else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=args.timeout)
    if proc.returncode != 0:
      return {"impl": impl, "error": (proc.stderr.strip().splitlines() or ["exit"])[-1][:400]}
    plan = json.loads((out / "memory_analysis.json").read_text())["rows"][0]
    if "error" in plan:
      return {"impl": impl, "error": plan["error"]}
    lr, ba = find_step_module(dump)
    result = peak(parse(lr.read_text(), ba.read_text()), top=args.top)
    hlo = lr.with_name(lr.name.replace("-live-range.txt", ".txt"))
    if getattr(args, "save_hlo", False) and hlo.exists():
      with gzip.open(pathlib.Path(args.out) / f"hlo_{impl}_{tag}.txt.gz", "wt") as f:
        f.write(hlo.read_text())
    step = plan["step"]
    return {"impl": impl, "module": lr.name.replace("-live-range.txt", ""),
            "xla_step_gib": step["step_gib"],
            "temp_gib": step["temp_gib"], **result}


def markdown(rows, meta) -> str:
  lines = ["# Buffers live at the train step's peak (XLA's buffer assignment)", "",
           f"`{meta['command']}`; {meta['date']}; {meta['device']}; jax {meta['jax']}.", "",
           f"Model {meta['model']}, {meta['batch']}x{meta['tokens']} tokens, {meta['dtype']}, "
           f"loss {meta['loss']}. `peak`: the most bytes live at one point of the step's schedule "
           "(arguments and outputs included); `XLA step`: arguments + outputs - aliased + "
           "temporaries (memory_analysis).", "",
           "| impl | tree | peak GiB | XLA step GiB | temporaries GiB | at | unsized |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['impl']} | {r['tree']} | {r['error']} | | | | |")
    else:
      lines.append(f"| {r['impl']} | {r['tree']} | {r['peak_gib']:.3f} | {r['xla_step_gib']:.3f} | "
                   f"{r['temp_gib']:.3f} | `{r['instruction'][:60]}` ({r['at']}) | {r['unsized_buffers']} |")
  for r in rows:
    if "error" in r:
      continue
    lines += ["", f"## {r['impl']} ({r['tree']}): the largest buffers live at the peak", "",
              "| MiB | buffer | shape | live range | same slot, live there too |", "|---|---|---|---|---|"]
    lines += [f"| {b['gib'] * 1024:.1f} | `{b['buffer']}` | `{b['shape']}` | {b['range'][0]}-{b['range'][1]} | "
              + ", ".join(f"`{a}`" for a in b.get("aliases", [])[:4])
              + (f" (+{len(b['aliases']) - 4})" if len(b.get("aliases", [])) > 4 else "") + " |"
              for b in r["live"]]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="qwen3-0.6b")
  parser.add_argument("--impls", default="forge,optax_clip")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--loss", default="lean")
  parser.add_argument("--top", type=int, default=20, help="buffers listed per step")
  parser.add_argument("--timeout", type=int, default=600, help="seconds per compile")
  parser.add_argument("--save-hlo", action="store_true",
                      help="also write each step's optimized HLO, gzipped, next to the tables")
  parser.add_argument("--out", default=os.environ.get("OUT", "runs"))
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  import jax  # the device's name only; the compiles run in subprocesses
  meta = {"command": "python -m experiments.live_buffers " + " ".join(argv),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "model": args.model, "batch": args.batch, "tokens": args.tokens, "dtype": args.dtype,
          "loss": args.loss, "layers": args.layers}
  rows = []
  for impl in args.impls.split(","):
    rows.append({**analyse(impl, args, ROOT, tag="main"), "tree": "main"})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "live"}), flush=True)
    with open(os.path.join(args.out, "live_buffers.json"), "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "live_buffers.md"), "w") as f:
      f.write(markdown(rows, meta))
  return rows


if __name__ == "__main__":
  main()
