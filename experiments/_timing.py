"""Device-side timing and run metadata shared by the tuning and benchmark scripts.

Timing a jitted call with a host clock around each call adds the dispatch
(0.1 to 0.2 ms on the H200) to every figure; see /work/shared/FINDINGS.md. So
:func:`time_steps` runs a step many times back to back, blocks once at the
end, and divides: as long as the device work of one call takes longer than
its dispatch, the device never waits for the host and the figure is device
time. The median of a few such repeats is reported.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
  """Per-call milliseconds of one timed step."""

  median_ms: float
  min_ms: float
  repeats_ms: tuple[float, ...]
  iters: int


def time_steps(
    step: Callable[[Any], Any],
    carry: Any,
    *,
    warmup: int = 3,
    iters: Optional[int] = 30,
    repeats: int = 3,
    target_repeat_ms: float = 20.0,
    max_iters: int = 30,
) -> tuple[Timing, Any]:
  """Times ``carry = step(carry)`` run back to back; returns (timing, carry).

  The carry threads each call's output into the next call, so a step that
  donates its state (an optimizer step) can run any number of times. With
  ``iters=None`` the count per repeat is picked from the warm-up so that one
  repeat lasts about ``target_repeat_ms`` (between 3 and ``max_iters`` calls).
  """
  start = time.perf_counter()
  for _ in range(max(warmup, 1)):
    carry = step(carry)
  jax.block_until_ready(carry)
  if iters is None:
    per_call_ms = (time.perf_counter() - start) * 1e3 / max(warmup, 1)
    iters = int(min(max_iters, max(3, math.ceil(target_repeat_ms / max(per_call_ms, 1e-3)))))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      carry = step(carry)
    jax.block_until_ready(carry)
    per_call.append((time.perf_counter() - start) * 1e3 / iters)
  timing = Timing(
      median_ms=statistics.median(per_call),
      min_ms=min(per_call),
      repeats_ms=tuple(per_call),
      iters=iters,
  )
  return timing, carry


def out_dir(path: Optional[str]) -> pathlib.Path:
  """The results folder: ``--out``, else ``$OUT``, else ``./runs``; created."""
  folder = pathlib.Path(path or os.environ.get("OUT") or "runs")
  folder.mkdir(parents=True, exist_ok=True)
  return folder


def run_info(module: str, argv: Sequence[str]) -> dict[str, Any]:
  """Command, date, device and versions, to store beside every number."""
  import jaxlib  # pylint: disable=g-import-not-at-top

  try:
    import triton  # pylint: disable=g-import-not-at-top

    triton_version = triton.__version__
  except Exception:  # not installed (CPU machines)
    triton_version = None
  device = jax.devices()[0]
  return {
      "command": " ".join(["python", "-m", module, *map(shlex.quote, argv)]),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device": getattr(device, "device_kind", str(device)),
      "platform": device.platform,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "triton": triton_version,
      "python": platform.python_version(),
      "host": platform.node(),
  }


def write_json(path: pathlib.Path, payload: Any) -> None:
  """Writes ``payload`` atomically (a killed run never leaves half a file)."""
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  tmp.replace(path)


def run_shapes(
    path: pathlib.Path,
    info: dict,
    tokens: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    bench: Callable[[int, int, int], list],
    error_row: dict,
) -> list[dict]:
  """``bench(t, k, n)`` for every T x (K, N); returns all rows.

  A shape that fails (e.g. out of memory making its inputs) becomes one
  ``error_row`` with its shape and error. ``{"info", "rows"}`` is rewritten
  to ``path`` after every shape, so a run cut short keeps what it measured,
  and once more at the end with ``elapsed_s``.
  """
  rows: list[dict] = []
  payload = {"info": info, "rows": rows}
  start = time.perf_counter()
  for t in tokens:
    for k, n in shapes:
      try:
        rows += bench(t, k, n)
      except Exception as e:  # pylint: disable=broad-except  (recorded, the next shape runs)
        rows.append({**error_row, "shape": f"{t}x{k}x{n}", "status": "error", "error": short_error(e)})
      gc.collect()
      write_json(path, payload)
  payload["elapsed_s"] = time.perf_counter() - start
  write_json(path, payload)
  return rows


def write_table(path: pathlib.Path, table: str, json_path: pathlib.Path) -> None:
  """Writes a run's markdown table and logs it."""
  path.write_text(table)
  log("\n" + table)
  log(f"wrote {json_path} and {path}")


def short_error(exc: BaseException, limit: int = 600) -> str:
  """A one-line description of a failed config, for the results file."""
  text = " ".join(f"{type(exc).__name__}: {exc}".split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def log(*args: Any) -> None:
  print(*args, flush=True, file=sys.stdout)
