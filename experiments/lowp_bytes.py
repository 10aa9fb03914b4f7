"""Bytes per parameter of each weight/state storage, from the real array sizes.

For one [K, N] weight (default 4096 x 4096) it builds each optimizer's state
with ``jax.eval_shape`` (nothing is allocated) and divides the bytes of the
stored arrays by K * N: the weight, its optimizer state (AdamW: two moments;
int8 states count their float32 block scales), and the gradient buffer an
unfused optimizer needs (optax materializes ``dW`` in the parameter's dtype;
FORGE consumes it tile by tile, so it holds O(tile), i.e. 0 per parameter).

    PYTHONPATH=$PWD python -m experiments.lowp_bytes                 # prints the table
    PYTHONPATH=$PWD python -m experiments.lowp_bytes --write-docs   # refreshes docs/precision.md

``tests/test_lowp.py`` checks that docs/precision.md holds this script's table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

import forge_jax
from forge_jax import _lowp

F32, BF16 = jnp.float32, jnp.bfloat16
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "precision.md"
BEGIN, END = "<!-- lowp_bytes:begin -->", "<!-- lowp_bytes:end -->"
LR = 1e-3


def _optax_row(tx: optax.GradientTransformation, w_dtype, shape) -> dict:
  w = jax.ShapeDtypeStruct(shape, jnp.dtype(w_dtype))
  state = jax.eval_shape(tx.init, w)
  n = w.size
  # Per-parameter arrays only (the step counts are scalars).
  states = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim) / n
  weights = jnp.dtype(w_dtype).itemsize
  return {"weights": weights, "states": states, "gradient": weights}


def _forge_row(precision: Optional[forge_jax.Precision], w_dtype, shape) -> dict:
  row = _lowp.bytes_per_param(forge_jax.adamw(LR, precision=precision), shape, w_dtype)
  return {"weights": row["weights"], "states": row["states"], "gradient": 0.0}


P = forge_jax.Precision
# (label, weight dtype, builder) in table order.
CONFIGS: list[tuple[str, Any, Callable[[Any, tuple], dict]]] = [
    ("optax.adamw, fp32 params", F32, lambda d, s: _optax_row(optax.adamw(LR), d, s)),
    ("optax.adamw, bf16 params (bf16 moments)", BF16, lambda d, s: _optax_row(optax.adamw(LR), d, s)),
    ("optax.adamw(mu_dtype=bf16), fp32 params", F32,
     lambda d, s: _optax_row(optax.adamw(LR, mu_dtype=BF16), d, s)),
    ("FORGE, fp32 weights and states (default)", F32, lambda d, s: _forge_row(None, d, s)),
    ("FORGE, fp32 weights, bf16 states", F32, lambda d, s: _forge_row(P(state_dtype="bfloat16"), d, s)),
    ("FORGE, fp32 weights, int8 states", F32, lambda d, s: _forge_row(P(state_dtype="int8"), d, s)),
    ("FORGE, bf16 weights + SR, fp32 states", BF16,
     lambda d, s: _forge_row(P("stochastic", state_dtype="float32"), d, s)),
    ("FORGE, bf16 weights + SR, bf16 states", BF16, lambda d, s: _forge_row(P("stochastic"), d, s)),
    ("FORGE, bf16 weights + SR, int8 states (block 64)", BF16,
     lambda d, s: _forge_row(P("stochastic", state_dtype="int8"), d, s)),
    ("FORGE, bf16 weights + SR, int8 states (block 256)", BF16,
     lambda d, s: _forge_row(P("stochastic", state_dtype="int8", block_size=256), d, s)),
]


def rows(shape: tuple[int, int] = (4096, 4096)) -> list[dict]:
  out = []
  for label, dtype, build in CONFIGS:
    r = build(dtype, tuple(shape))
    r.update(label=label, total=r["weights"] + r["states"])
    r["with_gradient"] = r["total"] + r["gradient"]
    out.append(r)
  return out


def table(shape: tuple[int, int] = (4096, 4096)) -> str:
  base = rows(shape)[0]["total"]
  lines = [
      f"AdamW, one {shape[0]} x {shape[1]} weight; bytes per parameter "
      "(`python -m experiments.lowp_bytes`).",
      "",
      "| storage | weights | states | weights + states | vs optax fp32 | + gradient buffer |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows(shape):
    lines.append(
        f"| {r['label']} | {r['weights']:g} | {r['states']:.4g} | {r['total']:.4g} | "
        f"{r['total'] / base:.2f}x | {r['with_gradient']:.4g} |"
    )
  return "\n".join(lines) + "\n"


def docs_section(text: str) -> str:
  """The table currently between the markers of docs/precision.md."""
  return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", type=int, nargs=2, default=(4096, 4096))
  parser.add_argument("--write-docs", action="store_true", help=f"refresh the table in {DOCS}")
  args = parser.parse_args(argv)
  text = table(tuple(args.shape))
  print(text)
  if args.write_docs:
    doc = DOCS.read_text()
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOCS.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")
    print(f"wrote {DOCS}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
