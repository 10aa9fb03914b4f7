"""What ``backend="auto"`` runs on a Hopper GPU: the Mosaic kernel or XLA's dot + fused update.

The choice comes from a table of measurements written by
``python -m experiments.bench_fused_dw --auto-table`` (see that script). Each entry is one
measured case: tokens ``t``, weight shape ``k`` x ``n``, the storage configuration (weight
dtype, state format, stochastic rounding of the weight), the two device times and the faster
backend. The package ships one table per GPU it was measured on (:data:`DEVICE_TABLES`: an
H100 reads ``auto_table_h100.json``, any other GPU the H200's ``auto_table.json``); the
environment variable ``FORGE_JAX_AUTO_TABLE`` names a table to read instead (one measured on
your own GPU).

A layer is looked up by its storage configuration (exact match), then its token count (the
nearest measured ``t`` in octaves), then its shape (the nearest measured ``k`` x ``n`` at that
``t``, by distance in octaves of size ``k * n`` and of aspect ``n / k``: the GEMM's work and
the state stream scale with ``t * k * n`` and ``k * n``, the tiling with the aspect). A layer
further than :data:`T_RADIUS` octaves outside the measured tokens, or than
:data:`SHAPE_RADIUS` octaves from every measured shape, is outside the table, and
``"auto"`` keeps its rule without a table (see ``forge_jax._fused._resolve_backend``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

TABLE_PATH = pathlib.Path(__file__).with_name("auto_table.json")  # measured on an H200
# (marker in the device kind, table): the first whose marker the device's kind contains, else
# TABLE_PATH. Kinds as jax reports them, e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200".
DEVICE_TABLES = (("H100", TABLE_PATH.with_name("auto_table_h100.json")),)
TABLE_ENV = "FORGE_JAX_AUTO_TABLE"
CHOICES = ("mosaic", "xla")
# A token count this many octaves beyond the smallest or largest measured one is outside the table.
T_RADIUS = 1.0
# A shape this far (octaves of k*n and of n/k, Euclidean) from every measured one is outside it:
# the presets' shape classes lie within 0.61 octaves of their representative.
SHAPE_RADIUS = 1.0
STATE_FORMATS = ("float32", "bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One measured case (``kernel_ms``/``xla_ms`` None where the table was not measured)."""

  t: int
  k: int
  n: int
  weight: str  # the weight's dtype name: "float32", "bfloat16"
  states: str  # one of STATE_FORMATS
  sr: bool  # the weight is written back with stochastic rounding
  choice: str  # one of CHOICES
  kernel_ms: Optional[float] = None
  xla_ms: Optional[float] = None

  @property
  def key(self) -> tuple[str, str, bool]:
    return (self.weight, self.states, self.sr)


def _entry(raw: dict, where: str) -> Entry:
  fields = {f.name for f in dataclasses.fields(Entry)}
  missing = {"t", "k", "n", "weight", "states", "sr", "choice"} - set(raw)
  if missing:
    raise ValueError(f"{where}: entry {raw!r} lacks {sorted(missing)}")
  entry = Entry(**{k: v for k, v in raw.items() if k in fields})
  if entry.choice not in CHOICES:
    raise ValueError(f"{where}: choice={entry.choice!r} is not one of {CHOICES} in {raw!r}")
  if entry.states not in STATE_FORMATS:
    raise ValueError(f"{where}: states={entry.states!r} is not one of {STATE_FORMATS} in {raw!r}")
  if min(entry.t, entry.k, entry.n) < 1:
    raise ValueError(f"{where}: t, k, n must be >= 1 in {raw!r}")
  return entry


@dataclasses.dataclass(frozen=True)
class Table:
  """The measured cases and where they come from (``provenance``: device, date, jax, commit)."""

  provenance: dict
  entries: tuple[Entry, ...]

  @classmethod
  def from_json(cls, payload: dict, where: str = "auto table") -> "Table":
    if not isinstance(payload, dict) or "entries" not in payload or "provenance" not in payload:
      raise ValueError(f"{where}: expected a JSON object with 'provenance' and 'entries'")
    return cls(dict(payload["provenance"]), tuple(_entry(e, where) for e in payload["entries"]))

  def to_json(self) -> dict:
    return {"provenance": self.provenance, "entries": [dataclasses.asdict(e) for e in self.entries]}

  def dumps(self) -> str:
    """The JSON text, one entry a line (diffs of a re-measured table stay readable)."""
    lines = [json.dumps(dataclasses.asdict(e)) for e in self.entries]
    return ('{"provenance": ' + json.dumps(self.provenance, indent=1) + ',\n "entries": [\n  '
            + ",\n  ".join(lines) + "\n ]\n}\n")

  def lookup(self, t: int, k: int, n: int, weight: str, states: str, sr: bool) -> Optional[Entry]:
    """The entry that stands for this layer, or None where it is outside the table."""
    same = [e for e in self.entries if e.key == (weight, states, bool(sr))]
    if not same or min(t, k, n) < 1:
      return None
    measured_t = sorted({e.t for e in same})
    lt = math.log2(t)
    if lt < math.log2(measured_t[0]) - T_RADIUS or lt > math.log2(measured_t[-1]) + T_RADIUS:
      return None
    bucket = min(measured_t, key=lambda m: (abs(math.log2(m) - lt), m))
    distance = lambda e: math.hypot(math.log2(e.k * e.n) - math.log2(k * n),
                                    math.log2(e.n / e.k) - math.log2(n / k))
    best = min((e for e in same if e.t == bucket), key=lambda e: (distance(e), e.k, e.n))
    return best if distance(best) <= SHAPE_RADIUS else None

  def choose(self, t: int, k: int, n: int, weight: str, states: str, sr: bool) -> Optional[str]:
    """``"mosaic"`` or ``"xla"`` for this layer, or None where it is outside the table."""
    entry = self.lookup(t, k, n, weight, states, sr)
    return None if entry is None else entry.choice


def read_table(path: pathlib.Path) -> Table:
  try:
    payload = json.loads(pathlib.Path(path).read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read the auto table {path}: {e}") from e
  return Table.from_json(payload, str(path))


def table_path(device_kind: str) -> pathlib.Path:
  """The table for a device of this kind: ``$FORGE_JAX_AUTO_TABLE`` if set, else the shipped one
  measured on that kind of GPU (:data:`DEVICE_TABLES`), else the H200's."""
  override = os.environ.get(TABLE_ENV)
  if override:
    return pathlib.Path(override)
  for marker, path in DEVICE_TABLES:
    if marker.upper() in device_kind.upper():
      return path
  return TABLE_PATH


@functools.lru_cache(maxsize=None)
def _read_cached(path: pathlib.Path) -> Table:
  return read_table(path)


def table() -> Table:
  """The table "auto" reads on this process's default device (each file read once)."""
  device = jax.devices()[0]
  path = table_path(getattr(device, "device_kind", "") or "")
  try:
    return _read_cached(path)
  except ValueError as e:
    if os.environ.get(TABLE_ENV):
      raise ValueError(f"{e} (set by {TABLE_ENV}; unset it to use the shipped table)") from e
    raise


def state_format(slots: Sequence[Any]) -> str:
  """``"int8"`` if any slot is block-quantized, else the float slots' common dtype name.

  Slots of mixed float dtypes (``"mixed"``) or no slots (``"none"``) match no entry.
  """
  from pallas_kernels import numerics  # pylint: disable=g-import-not-at-top

  if any(isinstance(s, numerics.QuantizedArray) for s in slots):
    return "int8"
  dtypes = {jnp.dtype(s.dtype).name for s in slots}
  if not dtypes:
    return "none"
  return dtypes.pop() if len(dtypes) == 1 else "mixed"
