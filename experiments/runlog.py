"""Run records: the JSONL log, orbax checkpoints, memory figures and versions of a training run."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
import resource
import shutil
from typing import Iterator, NamedTuple, Optional

import jax

import forge_jax


class HloInstruction(NamedTuple):
  dtype: str            # "f32", "bf16", ...
  dims: tuple           # the result's shape
  opcode: str           # "copy", "fusion", "dynamic-update-slice", ...
  line: str             # the instruction's line, stripped


# `%name = f32[3,64,128]{2,1,0} copy(...)`: instructions with an array result (tuples are left out).
_INSTRUCTION = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w-]+)\(")


def hlo_instructions(hlo_text: str) -> Iterator[HloInstruction]:
  """Every instruction with an array result in an HLO module's text: what the scripts that
  look for copies or stack-sized buffers in a compiled step (memory_analysis) read."""
  for m in _INSTRUCTION.finditer(hlo_text):
    start = hlo_text.rfind("\n", 0, m.start()) + 1
    end = hlo_text.find("\n", m.end())
    yield HloInstruction(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d), m.group(3),
                         hlo_text[start:end if end >= 0 else None].strip())


def xla_memory(compiled) -> dict:
  """XLA's own account of one step's buffers (any backend): arguments, outputs, temporaries.

  ``step_gib`` = arguments + outputs - aliased (donated) + temporaries: what
  the step needs resident at its peak, as the compiler planned it.
  """
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend reports it)
    return {}
  if m is None:
    return {}
  gib = lambda b: b / 2**30
  step = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  return {"step_gib": gib(step), "argument_gib": gib(m.argument_size_in_bytes),
          "temp_gib": gib(m.temp_size_in_bytes), "alias_gib": gib(m.alias_size_in_bytes)}


def device_memory() -> dict:
  """Device bytes in use / peak when the backend reports them, else the host's peak RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_in_use" in stats:
    return {"mem_gib": stats["bytes_in_use"] / 2**30,
            "peak_gib": stats.get("peak_bytes_in_use", float("nan")) / 2**30, "mem_source": "device"}
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  return {"peak_gib": rss / 2**30, "mem_source": "host_peak_rss"}


def versions() -> dict:
  return {"jax": jax.__version__, "python": platform.python_version(),
          "device": jax.devices()[0].device_kind, "platform": jax.default_backend()}


def _ckpt_dir(out: pathlib.Path, step: int) -> pathlib.Path:
  return out / "ckpt" / f"step_{step:08d}"


def latest_checkpoint(out: pathlib.Path) -> Optional[tuple[int, pathlib.Path]]:
  ckpts = sorted((out / "ckpt").glob("step_*")) if (out / "ckpt").exists() else []
  ckpts = [c for c in ckpts if c.name[5:].isdigit()]
  return (int(ckpts[-1].name[5:]), ckpts[-1]) if ckpts else None


def save_checkpoint(out: pathlib.Path, step: int, state, keep: int) -> pathlib.Path:
  path = forge_jax.save_train_state(_ckpt_dir(out, step), state, force=True)
  for old in sorted((out / "ckpt").glob("step_*"))[:-keep]:
    shutil.rmtree(old, ignore_errors=True)
  return pathlib.Path(path)


def read_log(path: str | os.PathLike) -> list[dict]:
  """The records of a ``log.jsonl``."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_log(path: pathlib.Path, step: int) -> None:
  """Drops records after ``step`` (written by a run that died after its last checkpoint)."""
  if not path.exists():
    return
  keep = [r for r in read_log(path) if r.get("step", 0) <= step and r["event"] != "end"]
  tmp = path.with_suffix(".tmp")
  tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
  os.replace(tmp, path)


class RunLog:
  """``log.jsonl``, appended one flushed line per record."""

  def __init__(self, path: pathlib.Path, start: int):
    if start:
      truncate_log(path, start)  # records past the checkpoint belong to a lost future
    elif path.exists():
      path.unlink()
    self.path, self._f = path, open(path, "a")

  def write(self, record: dict) -> None:
    self._f.write(json.dumps(record) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()
