"""The GPU's SM clock, power and throttle reasons while benchmarks run: is a timing power-capped?

A per-layer benchmark runs its kernels in bursts of a few milliseconds and the GPU stays at its
top clock; a whole training step keeps it busy for seconds, reaches the power cap and clocks down.
A kernel's cost in arithmetic (the non-finite guard's compares and selects, the gradient norm's
sums) can then differ between the two. Each ``--run NAME CMD`` runs ``CMD`` (a shell command) as
a phase while ``nvidia-smi`` samples every ``--interval-ms``::

    PYTHONPATH=$PWD python -m experiments.gpu_clocks --out $OUT/clocks \\
      --run layers "python -m experiments.bench_lowp --out $OUT/layers --tokens 1024 --impls mosaic" \\
      --run step "python -m experiments.bench_models --out $OUT/step --models llama-3.1-8b ..."

writes ``clocks.csv.gz`` (the samples), ``phases.json`` (each phase's command and wall-clock
window) and ``clocks.md``/``.json``: per phase, the SM clock and power of the samples at
``--busy`` utilization or more, by power band, with the throttle reasons named.
``--summarize DIR`` rewrites the summary of an earlier run's files (no GPU needed);
``--timeline DIR`` bins its busy samples over time instead, for a run without phase windows.
In a program, ``with sampling(out, interval_ms, argv) as recorder:`` samples around any code and
``with recorder.phase(name, command):`` marks its phases (``experiments.reproduce --clocks``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gzip
import io
import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

QUERY = ("timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu,"
         "clocks_throttle_reasons.active")
# nvidia-smi's clocks_event_reasons bits (nvidia-smi --help-query-gpu).
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown",
           0x10: "sync boost", 0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake",
           0x100: "display clock"}
POWER_BANDS = ((0, 300), (300, 500), (500, 10_000))


def reason_names(mask: int) -> list[str]:
  """The throttle reasons set in ``mask`` (``[]`` for none)."""
  return [name for bit, name in REASONS.items() if mask & bit]


def parse_samples(text: str) -> list[dict]:
  """``nvidia-smi --query-gpu=QUERY --format=csv,noheader`` lines as dicts (unix time, MHz,
  W, %); lines that are not samples (errors, a cut last line) are skipped."""
  samples = []
  for row in csv.reader(io.StringIO(text)):
    try:
      stamp = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
      samples.append({
          "t": stamp.replace(tzinfo=datetime.timezone.utc).timestamp(),
          "sm_mhz": int(row[1].split()[0]), "mem_mhz": int(row[2].split()[0]),
          "power_w": float(row[3].split()[0]), "util": int(row[4].split()[0]),
          "temp_c": int(row[5]), "reasons": int(row[6].strip(), 16)})
    except (IndexError, ValueError):
      continue
  return samples


def _stats(part: list[dict]) -> dict:
  """Samples' count, SM clock (median, min, max), median power and throttle reasons."""
  return {"samples": len(part),
          "sm_mhz_median": statistics.median(s["sm_mhz"] for s in part),
          "sm_mhz_min": min(s["sm_mhz"] for s in part),
          "sm_mhz_max": max(s["sm_mhz"] for s in part),
          "power_w_median": statistics.median(s["power_w"] for s in part),
          "reasons": sorted({n for s in part for n in reason_names(s["reasons"])})}


def summarize(samples: list[dict], phases: dict, busy: int = 90) -> dict:
  """Per phase (``{name: {"window": [start, end], ...}}``, unix times of the host whose clock
  stamped the samples), the busy samples' SM clock and power by power band."""
  out = {}
  for name, phase in phases.items():
    start, end = phase["window"]
    inside = [s for s in samples if start <= s["t"] <= end]
    hot = [s for s in inside if s["util"] >= busy]
    bands = []
    for lo, hi in POWER_BANDS:
      part = [s for s in hot if lo <= s["power_w"] < hi]
      if part:
        bands.append({"power_w": [lo, hi], **_stats(part)})
    out[name] = {"command": phase.get("command"), "seconds": end - start,
                 "samples": len(inside), "busy_samples": len(hot), "bands": bands}
  return out


def to_markdown(summary: dict, busy: int, meta: dict) -> str:
  lines = ["# GPU clock and power while benchmarks ran", "",
           f"{meta.get('date', '')}; {meta.get('device', '')}; samples every "
           f"{meta.get('interval_ms', '?')} ms (`nvidia-smi --query-gpu=...`), `--busy {busy}`.", "",
           f"Per phase, the samples at {busy}% utilization or more, by power band.", "",
           "| phase | power band W | samples | SM MHz median (min-max) | power W median | throttle reasons |",
           "|---|---|---|---|---|---|"]
  for name, phase in summary.items():
    if not phase["bands"]:
      lines.append(f"| {name} | - | 0 of {phase['samples']} | - | - | - |")
    for band in phase["bands"]:
      lo, hi = band["power_w"]
      lines.append(
          f"| {name} | {lo}-{hi if hi < 10_000 else ''} | {band['samples']} of {phase['samples']} | "
          f"{band['sm_mhz_median']:.0f} ({band['sm_mhz_min']}-{band['sm_mhz_max']}) | "
          f"{band['power_w_median']:.0f} | {', '.join(band['reasons']) or 'none'} |")
  lines += ["", "Commands:", ""]
  lines += [f"- {name}: `{phase['command']}`" for name, phase in summary.items()]
  return "\n".join(lines) + "\n"


def timeline(samples: list[dict], bin_s: float, busy: int = 90) -> list[dict]:
  """The busy samples in ``bin_s``-second bins from the first sample (bins without one left
  out): each bin's offset and its samples' statistics (as a phase's power band). For a run
  without phase windows (one killed before it wrote them), where the busy stretches are the
  phases."""
  if not samples:
    return []
  t0 = samples[0]["t"]
  bins: dict = {}
  for s in samples:
    if s["util"] >= busy:
      # (A microsecond's slack: the stamps are large floats, and a sample on a bin's edge
      # belongs to the bin it opens.)
      bins.setdefault(int((s["t"] - t0) / bin_s + 1e-6), []).append(s)
  return [{"offset_s": b * bin_s, **_stats(part)} for b, part in sorted(bins.items())]


def timeline_markdown(rows: list[dict], bin_s: float, busy: int, source: str) -> str:
  lines = [f"# GPU clock and power over time: {source}", "",
           f"Samples at {busy}% utilization or more, in {bin_s:g}-second bins from the first sample "
           "(`python -m experiments.gpu_clocks --timeline`).", "",
           "| from s | samples | SM MHz median | power W median | throttle reasons |",
           "|---|---|---|---|---|"]
  lines += [f"| {r['offset_s']:g} | {r['samples']} | {r['sm_mhz_median']:.0f} | "
            f"{r['power_w_median']:.0f} | {', '.join(r['reasons']) or 'none'} |" for r in rows]
  return "\n".join(lines) + "\n"


def _read_samples(folder: pathlib.Path) -> list[dict]:
  gz, plain = folder / "clocks.csv.gz", folder / "clocks.csv"
  text = gzip.decompress(gz.read_bytes()).decode() if gz.exists() else plain.read_text()
  return parse_samples(text)


def write_summary(folder: pathlib.Path, busy: int) -> dict:
  meta = json.loads((folder / "phases.json").read_text())
  summary = summarize(_read_samples(folder), meta["phases"], busy)
  (folder / "clocks.json").write_text(json.dumps({**meta, "busy": busy, "summary": summary},
                                                 indent=1) + "\n")
  (folder / "clocks.md").write_text(to_markdown(summary, busy, meta))
  return summary


class Recorder:
  """The phases of one sampling run: ``with recorder.phase(name, command):`` records the
  wall-clock window of what runs inside it, ``recorder.add(name, command, window)`` one measured
  elsewhere (a benchmark row's timed steps). With a ``path``, the phases are written there at
  every change, so a run killed before its end still has the windows of the phases it finished."""

  def __init__(self, meta: dict, path: Optional[pathlib.Path] = None):
    self.meta = meta
    self.path = path

  def save(self) -> None:
    if self.path is not None:
      self.path.write_text(json.dumps(self.meta, indent=1) + "\n")

  @contextlib.contextmanager
  def phase(self, name: str, command: str):
    start = time.time()
    entry = self.meta["phases"][name] = {"command": command, "window": [start, start]}
    self.save()
    try:
      yield entry
    finally:
      entry["window"][1] = time.time()
      self.save()

  def add(self, name: str, command: str, window: Sequence[float]) -> None:
    self.meta["phases"][name] = {"command": command, "window": [float(window[0]), float(window[1])]}
    self.save()


def available() -> bool:
  """Whether ``nvidia-smi`` is on the PATH (what sampling needs)."""
  return shutil.which("nvidia-smi") is not None


@contextlib.contextmanager
def sampling(out: pathlib.Path, interval_ms: int, argv: str):
  """``nvidia-smi`` samples the GPU every ``interval_ms`` while the block runs; yields a
  :class:`Recorder` for its phases. On exit writes ``clocks.csv.gz`` and ``phases.json`` under
  ``out`` (``write_summary`` then summarizes them; ``phases.json`` is kept current while it runs,
  and a run killed midway leaves ``clocks.csv``, which ``--summarize`` reads too); ``argv`` is
  the command recorded."""
  out.mkdir(parents=True, exist_ok=True)
  raw = out / "clocks.csv"
  device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout.strip()
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": device, "interval_ms": interval_ms, "phases": {}, "argv": argv}
  with open(raw, "w") as f:
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader",
                                f"--loop-ms={interval_ms}"], stdout=f, stderr=subprocess.STDOUT)
    recorder = Recorder(meta, out / "phases.json")
    recorder.save()
    try:
      yield recorder
    finally:
      sampler.terminate()
      sampler.wait()
      (out / "clocks.csv.gz").write_bytes(gzip.compress(raw.read_bytes()))
      raw.unlink()
      recorder.save()


def run(out: pathlib.Path, phases: Sequence[tuple[str, str]], interval_ms: int) -> dict:
  """Runs each phase's command (a shell command) under the sampler; returns the phases'
  metadata."""
  argv = " ".join(["python -m experiments.gpu_clocks", *(shlex.quote(a) for a in sys.argv[1:])])
  with sampling(out, interval_ms, argv) as recorder:
    for name, command in phases:
      with recorder.phase(name, command) as entry:
        entry["rc"] = subprocess.call(command, shell=True)
  return recorder.meta


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="results folder (default $OUT/clocks or ./runs/clocks)")
  parser.add_argument("--run", nargs=2, action="append", default=[], metavar=("NAME", "CMD"),
                      help="a phase: its name and a shell command (repeatable)")
  parser.add_argument("--interval-ms", type=int, default=50, help="sampling period (default 50)")
  parser.add_argument("--busy", type=int, default=90,
                      help="the utilization (%%) from which a sample counts (default 90)")
  parser.add_argument("--summarize", type=pathlib.Path, default=None, metavar="DIR",
                      help="rewrite the summary of an earlier run's folder; runs nothing")
  parser.add_argument("--timeline", type=pathlib.Path, default=None, metavar="DIR",
                      help="write DIR/timeline.md: an earlier run's busy samples in --bin-s bins "
                      "(needs no phases.json); runs nothing")
  parser.add_argument("--bin-s", type=float, default=2.0, help="--timeline's bin (default 2 s)")
  args = parser.parse_args(argv)
  if args.timeline is not None:
    if args.run or args.summarize:
      parser.error("--timeline reads an earlier run: give no --run or --summarize")
    text = timeline_markdown(timeline(_read_samples(args.timeline), args.bin_s, args.busy),
                             args.bin_s, args.busy, args.timeline.name)
    (args.timeline / "timeline.md").write_text(text)
    print(text)
    return 0
  if args.summarize is not None:
    if args.run:
      parser.error("--summarize reads an earlier run: give no --run")
    print(to_markdown(write_summary(args.summarize, args.busy), args.busy,
                      json.loads((args.summarize / "phases.json").read_text())))
    return 0
  if not args.run:
    parser.error("give at least one --run NAME CMD (or --summarize DIR)")
  out = args.out or pathlib.Path(os.environ.get("OUT", "runs")) / "clocks"
  meta = run(out, args.run, args.interval_ms)
  print(to_markdown(write_summary(out, args.busy), args.busy, meta))
  return max(p["rc"] for p in meta["phases"].values())


if __name__ == "__main__":
  sys.exit(main())
