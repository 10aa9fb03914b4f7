"""Builds the generated tables of ``experiments/RESULTS.md`` from the committed JSON.

* The headline (``<!-- headline:begin -->``): the models suite of ``experiments.reproduce``,
  its ``bench_models`` JSON under ``results/h200/models/`` (``models.json``, or
  ``models_part<k>of<n>.json`` for a suite run in parts). Until that run is committed, the
  section says so and shows the Llama-3.1-8B rows of ``REFERENCE_JSON``.
* The model sizes (``<!-- models-table:begin -->``): every ``bench_models*.json`` under
  ``results/h200/`` is one ``experiments.bench_models`` run. Per (model, batch, tokens,
  implementation, allocator limit) the row of the run with the most same-run references
  (optax, optax_clip) is kept, the newest among equals; ratios are taken only against rows of
  the same run, measured side by side (an unrolled row's against ``optax_unrolled``). int8-state
  rows from before the int8 init fix (``INT8_INIT_FIX``) measured a bug and are left out;
  ``forge`` rows from before ``backend="auto"`` picked the Mosaic kernel on Hopper
  (``AUTO_MOSAIC``) ran the Triton kernel and are shown as ``forge_triton``.

    python -m experiments.results_tables            # rewrite the tables in RESULTS.md
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
# Commit a4a50d9 (int8 slots initialised in storage form): int8 rows measured before it are superseded.
INT8_INIT_FIX = "2026-11-29T18:42"
# Commit a9a6146: backend="auto" runs the Mosaic kernel on Hopper. Before it, "auto" meant Triton.
AUTO_MOSAIC = "2026-11-29T21:29"
# bench_models before 2026-11-30 (meta["timing"] != "median3") took the mean of 5 steps after one
# warm-up step, not the median of 3 back-to-back repeats after 3.
OLD_TIMING_MARK = "\u2020"
OLD_TIMING_NOTE = ("Step time taken as the mean of 5 steps after one warm-up step (bench_models before "
                   "2026-11-30); the others are the median of 3 back-to-back repeats after 3 warm-ups. "
                   "The scanned 8B rows re-timed the new way kept their ratios (Llama-3.1-8B FORGE 0.95x "
                   "optax either way); the unrolled qwen3-0.6b FORGE step read 32.0 ms the old way and "
                   "22.0 on the device ([diagnose_unrolled_28]"
                   "(results/h200/diagnose_unrolled_28/diagnose_unrolled.json)).")
# models.cross_entropy's backward writes its gradient over the logits since 2026-11-30;
# bench_models records it as meta["loss_backward"] == "over_logits".
LOSS_MARK = "\u00a7"
LOSS_NOTE = ("Peak measured with the loss's backward writing its gradient over the logits "
             "(models/_loss.py, since 2026-11-30); unmarked peaks held the logits and their gradient "
             "together, which sets the peak where the logits are large (8x1024 and up).")
MODEL_ORDER = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama-3.1-8b", "qwen3-14b", "qwen3-32b")
IMPL_ORDER = ("optax", "optax_unrolled", "optax_clip", "forge", "forge_mosaic", "forge_triton", "forge_unrolled",
              "forge_triton_unrolled", "forge_xla", "forge_int8", "forge_int8_xla",
              "forge_int8_mosaic")
LIMIT_NOTE = ("`limit`: the allocator's limit. `default`: jax's default, 75% of the device, 104.9 GiB on "
              "this H200 ([default_limit](results/h200/capacity_mem95/default_limit/bench_models.md)); "
              "`95%`: `XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`, 132.8 GiB; `97%`: 135.6 GiB; `prealloc`: the "
              "pool preallocated (jax's default; the other rows allocated on demand).")


def load_runs(folder: pathlib.Path = RESULTS_DIR) -> list[tuple[str, dict]]:
  runs = []
  for path in sorted(folder.glob("bench_models*.json")):
    runs.append((path.name, json.loads(path.read_text())))
  return sorted(runs, key=lambda r: r[1]["meta"]["date"])


def _key(row):
  return (row["model"], row["batch"], row["tokens"], row["impl"])


def _limit(run) -> str:
  fraction = run["meta"].get("mem_fraction")
  label = "default" if fraction is None else f"{fraction:.0%}"
  return label + (", prealloc" if run["meta"].get("preallocate") else "")


def merged_rows(runs) -> list[dict]:
  """One row per (model, batch, tokens, impl, limit), with same-run ratios (see the module doc)."""
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


# The summary's columns: (implementation, what the cell shows). The ratio of a cell is its row's
# same-run ratio: FORGE's peak against optax_clip's, a step time against optax's (unrolled:
# optax_unrolled's).
SUMMARY_IMPLS = ("optax", "optax_clip", "forge", "forge_int8", "optax_unrolled", "forge_unrolled")


def _cell(r) -> str:
  if r is None:
    return ""
  if "error" in r:
    return "OOM" if r["error"] == "OOM" else "error"
  peak = f"{r['peak_gib']:.1f}" + (LOSS_MARK if r.get("loss_over_logits") else "")
  ms = f"{r['step_ms']:.1f}" + (OLD_TIMING_MARK if r.get("old_timing") else "")
  ratios = [f"{r['vs_clip']:.2f}x" if r["impl"] != "optax_clip" and "vs_clip" in r else "",
            f"{r['vs_optax']:.2f}x" if r["impl"] not in ("optax", "optax_unrolled") and "vs_optax" in r else ""]
  ratios = ", ".join(x for x in ratios if x)
  return f"{peak} / {ms}" + (f" ({ratios})" if ratios else "")


def table(rows) -> str:
  """One line per (model, batch x tokens, limit): each implementation's peak GiB / step ms, with
  its same-run ratios (peak vs optax_clip, time vs optax), and the runs the cells come from."""
  lines = ["| model | batch | limit | " + " | ".join(SUMMARY_IMPLS) + " | runs |",
           "|---|---|---|" + "---|" * len(SUMMARY_IMPLS) + "---|"]
  groups = {}
  for r in rows:
    impl = r["impl"].replace("forge_int8_xla", "forge_int8")  # "auto" sends int8 states to xla
    if impl in SUMMARY_IMPLS:
      groups.setdefault((r["model"], r["batch"], r["tokens"], r["limit"]), {}).setdefault(impl, r)
  for (model, batch, tokens, limit), cells in groups.items():
    sources = sorted({r["source"][:-5] for r in cells.values()})
    links = ", ".join(f"[{s[len('bench_models_'):] or s}](results/h200/{s}.md)" for s in sources)
    lines.append(f"| {model} | {batch}x{tokens} | {limit} | "
                 + " | ".join(_cell(cells.get(i)) for i in SUMMARY_IMPLS) + f" | {links} |")
  lines += ["", "Each cell: peak GiB / step ms (its same-run ratios: peak against optax_clip, step time "
            "against optax; unrolled against optax_unrolled). " + LIMIT_NOTE,
            "", LOSS_MARK + " " + LOSS_NOTE, "", OLD_TIMING_MARK + " " + OLD_TIMING_NOTE]
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
