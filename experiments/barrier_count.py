"""Warpgroup barriers (``bar.sync``) in the Mosaic kernel as lowered, with and without
Pallas's automatic ones (``MosaicTileConfig.no_auto_barriers``). Runs on a CPU.

Pallas lowers the kernel to a Mosaic GPU module (before LLVM, ptxas and the GPU);
this cross-lowers AdamW at T x 4096 x 4096 for ``cuda`` on a faked Hopper device
with the default tiling for each weight/state dtype and counts the ``bar.sync``
instructions in that module: static counts (the epilogue is unrolled per
sub-tile), not executions. The module is read through a private hook of Mosaic
GPU (``core._run_serde_pass``); a jax without it makes this script fail loudly.
jax >= 0.11 lowers for ``cuda`` only with a GPU (or an abstract device) present.

    python -m experiments.barrier_count --out experiments/results/cpu/barrier_count
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
from typing import Optional, Sequence


def lowered_module(dtype: str, tokens: int, **overrides) -> tuple[str, object]:
  """The Mosaic GPU module (text) of AdamW at ``tokens`` x 4096 x 4096 lowered for ``cuda``,
  with the default tiling for ``dtype`` weights and states and ``overrides`` replaced; and the
  tiling used."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic.gpu import core as mgpu_core  # pylint: disable=g-import-not-at-top

  import forge_jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fused_dw_mosaic as fm  # pylint: disable=g-import-not-at-top

  modules = []
  real = mgpu_core._run_serde_pass  # AttributeError on a jax without it: loud, as documented
  mgpu_core._run_serde_pass = lambda module, **kw: modules.append(str(module)) or real(module, **kw)
  try:
    rule = forge_jax.adamw(1e-3).rule
    sds = jax.ShapeDtypeStruct
    x, dy = sds((tokens, 4096), jnp.bfloat16), sds((tokens, 4096), jnp.bfloat16)
    w = sds((4096, 4096), jnp.dtype(dtype))
    cfg = dataclasses.replace(fm.default_config(x, dy, w, (w, w)), num_sms=132, **overrides)
    kernel = functools.partial(fm.fused_dw_update_mosaic, update_fn=rule.update, config=cfg)
    jax.jit(kernel).trace(x, dy, w, (w, w), rule.scalars(jnp.int32(0))).lower(
        lowering_platforms=("cuda",))
  finally:
    mgpu_core._run_serde_pass = real
  return modules[-1], cfg


def count(dtype: str, tokens: int, no_auto_barriers: bool) -> dict:
  text, cfg = lowered_module(dtype, tokens, no_auto_barriers=no_auto_barriers)
  return {"dtype": dtype, "tokens": tokens, "no_auto_barriers": no_auto_barriers,
          "bar_sync": text.count("bar.sync"), "module_lines": len(text.splitlines()),
          "config": dataclasses.asdict(cfg)}


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--tokens", type=int, default=1024)
  args = parser.parse_args(argv)
  from experiments import _timing  # pylint: disable=g-import-not-at-top

  rows = [count(d, args.tokens, flag) for d in args.dtypes for flag in (False, True)]
  info = _timing.run_info("experiments.barrier_count", argv)
  args.out.mkdir(parents=True, exist_ok=True)
  _timing.write_json(args.out / "barrier_count.json", {"info": info, "rows": rows})
  lines = ["# bar.sync in the lowered Mosaic kernel", "",
           f"`{info['command']}`; {info['date']}; jax {info['jax']} (lowered for cuda on "
           f"{info['device']}).", "",
           f"AdamW, {args.tokens}x4096x4096, default tiling per dtype; static counts in the "
           "Mosaic GPU module before LLVM.", "",
           "| w / states | no_auto_barriers | bar.sync | module lines |", "|---|---|---|---|"]
  lines += [f"| {r['dtype']} | {r['no_auto_barriers']} | {r['bar_sync']} | {r['module_lines']} |"
            for r in rows]
  (args.out / "barrier_count.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
