"""Builds the whole-model table of ``experiments/RESULTS.md`` from the committed JSON.

Every ``bench_models*.json`` under ``experiments/results/h200/`` is one
``experiments.bench_models`` run (its command, date, device and jax version in
``meta``). This merges their rows into one table, sorted by model size, batch
and implementation; ratios (``vs optax_clip`` peak memory, ``vs optax`` step
time; an unrolled row's ``vs optax`` against ``optax_unrolled``) are taken only
against rows of the *same run*, measured side by side.
Where several runs measured the same (model, batch, tokens, implementation),
the row of the run with the most same-run references (optax, optax_clip) is
shown, the newest among equals. Rows measured under a raised allocator limit
(``bench_models --mem-fraction``) are kept apart from those under jax's default
limit: the ``limit`` column says which (an OOM under one is not an OOM under
the other). int8-state rows from runs before the int8 init
fix (``INT8_INIT_FIX``: their peak included float32 init temporaries) are left
out: they measured a bug. ``forge`` rows (``backend="auto"``) from runs before
``backend="auto"`` picked the Mosaic kernel on Hopper (``AUTO_MOSAIC``) ran the
Triton kernel: they are shown as ``forge_triton``. Peaks of runs whose loss
backward wrote its gradient over the logits (``LOSS_MARK``) are marked.

    python -m experiments.results_tables            # rewrite the table in RESULTS.md
    python -m experiments.results_tables --check    # exit 1 if RESULTS.md is stale
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent
RESULTS_DIR = ROOT / "results" / "h200"
RESULTS_MD = ROOT / "RESULTS.md"
BEGIN, END = "<!-- models-table:begin -->", "<!-- models-table:end -->"
# Commit a4a50d9 (int8 slots initialised in storage form): int8 rows measured
# before it are superseded.
INT8_INIT_FIX = "2026-11-29T18:42"
# Commit a9a6146: backend="auto" runs the Mosaic kernel on Hopper. Before it,
# "auto" (and the default before "auto" existed) meant the Triton kernel.
AUTO_MOSAIC = "2026-11-29T21:29"
# Runs before bench_models timed the median of 3 back-to-back repeats (meta["timing"] ==
# "median3") took the mean of 5 steps after one warm-up step.
OLD_TIMING_MARK = "\u2020"
OLD_TIMING_NOTE = ("Mean of 5 steps after one warm-up step (bench_models before 2026-11-30); later "
                   "runs take the median of 3 back-to-back repeats after 3 warm-ups. For the unrolled "
                   "qwen3-0.6b FORGE step the old way read 32.0 ms where device timing gives 22.0 "
                   "(results/h200/diagnose_unrolled_28). The 8B scanned rows re-timed the new way "
                   "(bench_models_nb_defaults, with the next kernel defaults) kept their ratios: "
                   "Llama-3.1-8B FORGE 0.95x optax either way. qwen3-0.6b and qwen3-1.7b were re-timed "
                   "the new way with the 64-row small-grid default (bench_models_small_nb*): FORGE "
                   "1.05x and 1.00x optax (before, the old way: qwen3-0.6b 1.15x with the Mosaic kernel, "
                   "qwen3-1.7b 1.09x with Triton), and qwen3-4b (bench_models_4b_nb): FORGE 0.98x optax "
                   "(1.10x with Triton, the old way); the qwen3-14b FORGE row with the Mosaic kernel "
                   "(bench_models_14b_mosaic) has no optax row of its run (optax runs out of memory under the "
                   "default limit; with 95% of the device it fits, in separate runs: bench_models_14b_mem95).")
# models.cross_entropy's backward writes its gradient over the logits since 2026-11-30 (session
# 12); bench_models records it as meta["loss_backward"] == "over_logits". Rows of earlier runs
# computed the gradient in one pass beside the logits, which on the H200 kept both live.
LOSS_MARK = "\u00a7"
LOSS_NOTE = ("The loss's backward writes its gradient over the logits, a block at a time, since "
             "2026-11-30 (models/_loss.py; results/h200/dlogits_in_place). Rows marked so ran it; the others "
             "computed the gradient in one pass beside the logits, which the H200 compile kept live together: "
             "2 x 15.66 GiB for Llama-3.1-8B at 64x1024, FORGE's peak there (92.72 GiB, 78.56 with the "
             "loop). Where a row's peak sat in the loss, it should be lower now (not re-measured for these "
             "rows); at 32x1024 FORGE fell from 68.80 to 62.12 GiB at the same step time (3042 vs 3037 "
             "ms, consecutive runs; the landed strided version, session 14: 1.022x optax+clip's step, as "
             "1.025x with the one-pass loss).")
MODEL_ORDER = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama-3.1-8b", "qwen3-14b")
IMPL_ORDER = ("optax", "optax_unrolled", "optax_clip", "forge", "forge_mosaic", "forge_triton", "forge_unrolled",
              "forge_triton_unrolled", "forge_xla", "forge_int8", "forge_int8_xla",
              "forge_int8_mosaic")


def load_runs(folder: pathlib.Path = RESULTS_DIR) -> list[tuple[str, dict]]:
  runs = []
  for path in sorted(folder.glob("bench_models*.json")):
    runs.append((path.name, json.loads(path.read_text())))
  return sorted(runs, key=lambda r: r[1]["meta"]["date"])


LIMIT_NOTE = ("`limit`: the allocator's limit the row ran under, in GiB. `default`: jax's default fraction "
              "of the device's memory (75%), 104.9 GiB on this H200 "
              "([default_limit](results/h200/capacity_mem95/default_limit/bench_models.md)); runs before "
              "session 10 (2026-11-30 15:11 UTC) did not record it, and none changed it. `95%`: "
              "`XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`, 132.8 GiB; `97%`: 0.97, 135.6 GiB. Every row's worker allocated on demand "
              "(no preallocation), where an OOM can fall below the limit (RESULTS: Capacity), except in "
              "rows marked `prealloc` (`bench_models --preallocate`, jax's default).")


def _key(row):
  return (row["model"], row["batch"], row["tokens"], row["impl"])


def _limit(run) -> str:
  fraction = run["meta"].get("mem_fraction")
  label = "default" if fraction is None else f"{fraction:.0%}"
  return label + (", prealloc" if run["meta"].get("preallocate") else "")


def merged_rows(runs) -> list[dict]:
  """One row per (model, batch, tokens, impl), with same-run ratios (see the module doc)."""
  best = {}
  for name, run in runs:
    by_key = {_key(r): r for r in run["rows"]}
    for r in run["rows"]:
      if r.get("error", "").startswith("skipped"):
        continue  # never ran: not a measurement
      if r["impl"].startswith("forge_int8") and run["meta"]["date"] < INT8_INIT_FIX:
        continue  # measured the int8 init bug
      row = dict(r, source=name, date=run["meta"]["date"][:10],
                 old_timing=run["meta"].get("timing") != "median3", limit=_limit(run),
                 loss_over_logits=run["meta"].get("loss_backward") == "over_logits")
      if r["impl"] in ("forge", "forge_unrolled") and run["meta"]["date"] < AUTO_MOSAIC:
        row["impl"] = r["impl"].replace("forge", "forge_triton", 1)  # "auto" then meant Triton
      for other, field, out in (("optax_clip", "peak_gib", "vs_clip"), ("optax", "step_ms", "vs_optax")):
        if out == "vs_optax" and r.get("scan") is False:
          other = "optax_unrolled"  # an unrolled step against the unrolled optax step
        ref = by_key.get((r["model"], r["batch"], r["tokens"], other))
        if ref and "error" not in ref and "error" not in r and ref.get(field, 0) > 0:
          row[out] = r[field] / ref[field]
      refs = lambda x: ("vs_clip" in x) + ("vs_optax" in x)
      key = (*_key(row), row["limit"])
      if key not in best or refs(row) >= refs(best[key]):  # date order: newest among equals
        best[key] = row
  order = lambda r: (MODEL_ORDER.index(r["model"]) if r["model"] in MODEL_ORDER else 99, r["batch"],
                     r["tokens"],
                     IMPL_ORDER.index(r["impl"]) if r["impl"] in IMPL_ORDER else 99, r["impl"],
                     r["limit"] != "default", r["limit"])
  return sorted(best.values(), key=order)


# Issue #8's grid: every model at a small and a larger batch of 1024-token sequences, with these
# implementations. A cell is measured when a row exists for it (an OOM row counts).
GRID_BATCHES = (1, 8)
GRID_IMPLS = ("optax_unrolled", "optax", "optax_clip", "forge_unrolled", "forge")


def missing(rows) -> list[tuple[str, int, str]]:
  """The grid cells (model, batch, impl) that no row measured."""
  have = {(r["model"], r["batch"], r["impl"]) for r in rows if r["tokens"] == 1024}
  return [(m, b, i) for m in MODEL_ORDER for b in GRID_BATCHES for i in GRID_IMPLS
          if (m, b, i) not in have]


def missing_text(rows) -> str:
  cells = missing(rows)
  if not cells:
    return "Every cell of issue #8's grid is measured."
  by = {}
  for m, b, i in cells:
    by.setdefault((m, b), []).append(i)
  return ("Not yet measured (issue #8's grid: each model at 1x1024 and 8x1024 with "
          + ", ".join(GRID_IMPLS) + "): "
          + "; ".join(f"{m} {b}x1024: {', '.join(i)}" for (m, b), i in by.items()) + ".")


def table(rows) -> str:
  lines = ["| model | tokens | impl | layers | limit | peak GiB | vs optax_clip | step ms | vs optax | tokens/s | run |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    layers = "scanned" if r.get("scan", True) else "unrolled"
    head = f"| {r['model']} | {r['batch']}x{r['tokens']} | {r['impl']} | {layers} | {r.get('limit', 'default')} |"
    src = f"[{r['source'][:-5]}](results/h200/{r['source'][:-5]}.md)"
    if "error" in r:
      lines.append(f"{head} {r['error']} | | | | | {src} |")
      continue
    ratio = lambda k: f"{r[k]:.2f}x" if k in r else ""
    mark = OLD_TIMING_MARK if r.get("old_timing") else ""
    peak_mark = LOSS_MARK if r.get("loss_over_logits") else ""
    lines.append(f"{head} {r['peak_gib']:.2f}{peak_mark} | {ratio('vs_clip')} | {r['step_ms']:.1f}{mark} | "
                 f"{ratio('vs_optax')} | {r['tokens_per_s']:.0f} | {src} |")
  lines += ["", LIMIT_NOTE, "", missing_text(rows), "", LOSS_MARK + " " + LOSS_NOTE]
  if any(r.get("old_timing") and "error" not in r for r in rows):
    lines += ["", OLD_TIMING_MARK + " " + OLD_TIMING_NOTE]
  return "\n".join(lines) + "\n"


def render(md: str, body: str, begin: str = BEGIN, end: str = END) -> str:
  if begin not in md or end not in md:
    raise ValueError(f"{RESULTS_MD} lacks the {begin} ... {end} markers")
  head, rest = md.split(begin, 1)
  _, tail = rest.split(end, 1)
  return f"{head}{begin}\n{body}{end}{tail}"


# The headline: the models suite of experiments.reproduce, its bench_models JSON (models.json, or
# models_part<k>of<n>.json for a suite run in parts) under HEADLINE_DIR.
HEADLINE_DIR = RESULTS_DIR / "models"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
# Until the suite's run is committed: the Llama-3.1-8B 1x1024 rows of the last run before it.
REFERENCE_JSON = RESULTS_DIR / "compile_first" / "compile_first" / "bench_models.json"
PENDING = "pending: run `python -m experiments.reproduce --suite models`"
LABELS = {"optax": "optax.adamw", "optax_clip": "optax clip_by_global_norm(1.0) + adamw",
          "forge": "FORGE adamw", "forge_sr": "FORGE adamw", "forge_int8": "FORGE adamw",
          "forge_int8_sr": "FORGE adamw"}


def headline_runs(folder: pathlib.Path = HEADLINE_DIR) -> list[tuple[str, dict]]:
  """The models suite's bench_models runs under ``folder`` (its parts, in part order)."""
  return [(p.name, json.loads(p.read_text())) for p in sorted(folder.glob("models*.json"))
          if not p.name.startswith("models_") or p.name.startswith("models_part")]


def _storage(r) -> str:
  """Weights / optimizer states of a row, e.g. ``bf16 SR / int8``."""
  from experiments import bench_models  # pylint: disable=g-import-not-at-top
  base = bench_models.forge_backend(bench_models.parse_impl(r["impl"])[0])[0]
  short = {"bfloat16": "bf16", "float32": "fp32"}
  weights = short.get(r.get("param_dtype", r["dtype"]), r.get("param_dtype", r["dtype"]))
  states = "int8" if base.startswith("forge_int8") else weights
  if base.endswith("_sr"):
    weights += " SR"
  return f"{weights} / {states}"


def _layout(r) -> tuple[bool, str]:
  return r.get("scan", True), r.get("remat", "full")


def headline_table(runs, link_prefix: str = "results/h200/models/") -> str:
  """One row per headline row measured: peak, step and compile time, with ratios against the
  optax.adamw row of the same layout (scanned or unrolled, same remat; for float32 weights, the
  bf16 one) of the same suite run."""
  from experiments import bench_models, reproduce  # pylint: disable=g-import-not-at-top
  rows = [dict(r, source=name) for name, run in runs for r in run["rows"]]
  optax = {_layout(r): r for r in rows
           if bench_models.parse_impl(r["impl"])[0] == "optax" and "error" not in r
           and r.get("param_dtype", r["dtype"]) == r["dtype"]}
  order = {spec: i for i, spec in enumerate(reproduce.HEADLINE_ROWS)}
  rows.sort(key=lambda r: order.get(r["impl"], len(order)))
  lines = ["| implementation | weights / states | layers | remat | limit | peak GiB | vs optax | step ms "
           "| vs optax | compile s | run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base = bench_models.forge_backend(bench_models.parse_impl(r["impl"])[0])[0]
    scan, remat = _layout(r)
    mem = r.get("mem_fraction")
    head = (f"| {LABELS.get(base, base)} | {_storage(r)} | {'scanned' if scan else 'unrolled'} | {remat} "
            f"| {'default' if mem is None else f'{mem:.0%}'} |")
    src = f"[{r['source'][:-5]}]({link_prefix}{r['source'][:-5]}.md)"
    if "error" in r:
      lines.append(f"{head} {r['error'][:60]} | | | | | {src} |")
      continue
    ref = optax.get((scan, remat), {})
    ratio = lambda k: (f"{r[k] / ref[k]:.2f}x" if ref.get(k) and r is not ref and isinstance(r.get(k), float)
                       else "")
    comp = f"{r['compile_s']:.0f}" if isinstance(r.get("compile_s"), (int, float)) else ""
    peak = f"{r['peak_gib']:.2f}" if isinstance(r.get("peak_gib"), float) and r["peak_gib"] == r["peak_gib"] else "n/a"
    lines.append(f"{head} {peak} | {ratio('peak_gib')} | {r['step_ms']:.1f} | {ratio('step_ms')} | {comp} | {src} |")
  meta, first = runs[0][1]["meta"], rows[0]
  lines += ["", f"{first['model']}, batch {first['batch']} x {first['tokens']} tokens, {meta['dtype']} compute, "
            f"on {meta['device']} (jax {meta['jax']}, {meta['date'][:10]}); step time: device time, the median of 3 repeats of {meta['steps']} "
            "steps back to back; compile s: tracing, lowering and compiling the step, several compiles "
            "running at once; `vs optax`: against optax.adamw with the same layers and remat. "
            "Commands: " + ", ".join(f"`{run['meta']['command']}`" for _, run in runs) + "."]
  return "\n".join(lines) + "\n"


def headline_section(folder: pathlib.Path = HEADLINE_DIR, reference: pathlib.Path = REFERENCE_JSON) -> str:
  """RESULTS.md's headline: the suite's table, or the pending note and the reference rows."""
  runs = headline_runs(folder) if folder.is_dir() else []
  if runs:
    return headline_table(runs)
  lines = [PENDING + " (two parts: `--part 1/2`, `--part 2/2`).", ""]
  if reference.is_file():
    run = json.loads(reference.read_text())
    rel = reference.relative_to(ROOT).with_suffix(".md").as_posix()
    rows = [r for r in run["rows"] if r["model"] == "llama-3.1-8b" and r["batch"] == 1 and r["tokens"] == 1024]
    lines += [f"Reference, {run['meta']['date'][:10]} ([{reference.parent.name}]({rel}), "
              f"`{run['meta']['command']}`): Llama-3.1-8B at 1x1024, bf16 weights and states, scanned, "
              "remat full, on " + run["meta"]["device"] + ".", "",
              "| implementation | peak GiB | step ms |", "|---|---|---|"]
    lines += [f"| {r['impl']} | {r['peak_gib']:.2f} | {r['step_ms']:.1f} |" for r in rows if "error" not in r]
  return "\n".join(lines) + "\n"


def write_headline(folder: pathlib.Path) -> list[str]:
  """Writes ``folder/headline.md`` from the suite's JSON there; where ``folder`` is the committed
  HEADLINE_DIR, rewrites RESULTS.md too. Returns the files written (names relative to folder)."""
  folder = pathlib.Path(folder)
  runs = headline_runs(folder)
  if not runs:
    return []
  (folder / "headline.md").write_text("# The headline table\n\n" + headline_table(runs, link_prefix=""))
  written = ["headline.md"]
  if folder.resolve() == HEADLINE_DIR.resolve():
    main([])
    written.append(str(RESULTS_MD))
  return written


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="fail if RESULTS.md's table is stale")
  args = parser.parse_args(argv)
  md = RESULTS_MD.read_text()
  new = render(md, table(merged_rows(load_runs())))
  new = render(new, headline_section(), HEADLINE_BEGIN, HEADLINE_END)
  if args.check:
    if new != md:
      print(f"{RESULTS_MD} is stale: run python -m experiments.results_tables", file=sys.stderr)
      return 1
    return 0
  RESULTS_MD.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main())
