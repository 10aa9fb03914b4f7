"""The repository's own promises: CI runs the README's test command."""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bash_blocks(text):
  return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  blocks = [b.strip() for b in _bash_blocks(readme)]
  assert len(blocks) >= 2, "README must open with the install/run and test commands"
  test_command = blocks[1]
  assert "pytest" in test_command
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_command in ci, f".ci/run must run the README test command {test_command!r}"


def test_readme_main_command_runs_quickstart():
  readme = (ROOT / "README.md").read_text()
  assert "python -m experiments.quickstart" in _bash_blocks(readme)[0]


def test_readme_python_examples_run():
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
  # The one-line fused_linear_update example names undefined x, dy, w.
  code = "\n".join(b for b in blocks if "fused_linear_update(x" not in b)
  assert "train_step" in code
  exec(compile(code, "README.md", "exec"), {})


def test_results_md_table_is_generated_from_the_committed_json():
  from experiments import results_tables
  assert results_tables.main(["--check"]) == 0, "run: python -m experiments.results_tables"
  rows = results_tables.merged_rows(results_tables.load_runs())
  assert any(r["model"] == "qwen3-14b" and r["impl"] in ("forge", "forge_triton") and "error" not in r for r in rows)
  # "auto" before the Mosaic kernel became its Hopper choice: shown as what it ran.
  run_dates = {name: run["meta"]["date"] for name, run in results_tables.load_runs()}
  early = [r for r in rows if run_dates[r["source"]] < results_tables.AUTO_MOSAIC]
  assert early and not any(r["impl"] in ("forge", "forge_unrolled") for r in early)
  # Step times of runs before bench_models' median-of-3 timing are marked as such.
  new = dict(next(r for r in rows if "error" not in r and r["impl"] == "forge"), old_timing=False)
  cell = lambda r: results_tables.table([r]).splitlines()[2]
  assert f"/ {new['step_ms']:.1f} (" in cell(new) and results_tables.OLD_TIMING_MARK not in cell(new)
  assert f"/ {new['step_ms']:.1f}{results_tables.OLD_TIMING_MARK}" in cell(dict(new, old_timing=True))
  assert results_tables.OLD_TIMING_NOTE in results_tables.table(rows)
  # Peaks of runs whose loss wrote its gradient over the logits (bench_models' meta) are marked.
  marked = lambda meta: cell(results_tables.merged_rows(
      [("r.json", {"meta": {"date": "2026-12-01", "timing": "median3", **meta}, "rows": [dict(new, scan=True)]})])[0])
  assert f"{new['peak_gib']:.1f}{results_tables.LOSS_MARK} /" in marked({"loss_backward": "over_logits"})
  assert results_tables.LOSS_MARK not in marked({})
  # The headline: the models suite's table once committed; until then the pending note.
  section = results_tables.headline_section()
  assert section in (ROOT / "experiments" / "RESULTS.md").read_text()
  assert results_tables.HEADLINE_DIR.is_dir() or section.startswith(results_tables.PENDING)


def test_results_table_keeps_limits_apart_and_pairs_the_same_run():
  from experiments import results_tables
  meta = lambda date, fraction: {"date": date, "mem_fraction": fraction, "timing": "median3"}
  row = lambda impl, **kw: {"model": "qwen3-14b", "batch": 1, "tokens": 1024, "impl": impl, "scan": True,
                            "peak_gib": 100.0, "step_ms": 1.0, "tokens_per_s": 1.0, **kw}
  runs = [("bench_models_a.json", {"meta": meta("2026-11-30T01", None), "rows": [row("optax", error="OOM")]}),
          ("bench_models_b.json", {"meta": meta("2026-11-30T02", 0.95),
                                   "rows": [row("optax"), row("forge", peak_gib=80.0, step_ms=0.9)]}),
          ("bench_models_c.json", {"meta": meta("2026-11-30T03", 0.95), "rows": [row("optax_clip")]})]
  rows = results_tables.merged_rows(runs)
  # The OOM under the default limit and the fit under 95% are both shown, each with its limit.
  assert [(r["impl"], r["limit"], "error" in r) for r in rows] == [
      ("optax", "default", True), ("optax", "95%", False), ("optax_clip", "95%", False), ("forge", "95%", False)]
  lines = results_tables.table(rows).splitlines()
  assert lines[2].startswith("| qwen3-14b | 1x1024 | default | OOM |")
  # FORGE's time ratio is against optax of its own run; optax_clip ran apart, so no peak ratio.
  assert "| 100.0 / 1.0 | 100.0 / 1.0 | 80.0 / 0.9 (0.90x) |" in lines[3]
  assert "[a](results/h200/bench_models_a.md)" in lines[2] and "[b](results/h200/bench_models_b.md)" in lines[3]


def test_relative_links_in_the_docs_resolve():
  """Every relative link of the README, docs/, RESULTS.md and MOSAIC_NOTES.md names a file that
  exists (results are linked by path: a renamed folder must not leave a dead link)."""
  import re  # pylint: disable=g-import-not-at-top
  files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "RESULTS.md",
           ROOT / "pallas_kernels" / "MOSAIC_NOTES.md"]
  dead, count = [], 0
  for f in files:
    for target in re.findall(r"\]\(([^)\s]+)\)", f.read_text()):
      if target.startswith(("http://", "https://", "#", "mailto:")):
        continue
      count += 1
      if not (f.parent / target.split("#")[0]).exists():
        dead.append(f"{f.relative_to(ROOT)}: {target}")
  assert count > 50 and not dead, dead
