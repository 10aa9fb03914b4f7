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
  md = results_tables.table(rows)
  old = [r for r in rows if "error" not in r and r["old_timing"]]
  assert old and all(f"{r['step_ms']:.1f}{results_tables.OLD_TIMING_MARK} |" in md for r in old)
  assert results_tables.OLD_TIMING_NOTE in md
  new = dict(old[0], old_timing=False)
  assert results_tables.OLD_TIMING_MARK not in results_tables.table([new])
  # Peaks of runs whose loss wrote its gradient over the logits (bench_models' meta) are marked.
  marked = lambda meta: results_tables.table(results_tables.merged_rows(
      [("r.json", {"meta": {"date": "2026-12-01", "timing": "median3", **meta}, "rows": [dict(new, scan=True)]})]))
  line = lambda md: next(l for l in md.splitlines() if l.startswith(f"| {new['model']} |"))
  assert f"{new['peak_gib']:.2f}{results_tables.LOSS_MARK} |" in line(marked({"loss_backward": "over_logits"}))
  assert results_tables.LOSS_MARK not in line(marked({}))


def test_results_table_keeps_limits_apart_and_lists_the_empty_grid_cells():
  from experiments import results_tables
  meta = lambda date, fraction: {"date": date, "mem_fraction": fraction, "timing": "median3"}
  row = lambda impl, **kw: {"model": "qwen3-14b", "batch": 1, "tokens": 1024, "impl": impl, "scan": True,
                            "peak_gib": 100.0, "step_ms": 1.0, "tokens_per_s": 1.0, **kw}
  runs = [("a.json", {"meta": meta("2026-11-30T01", None), "rows": [row("optax", error="OOM")]}),
          ("b.json", {"meta": meta("2026-11-30T02", 0.95), "rows": [row("optax")]})]
  rows = results_tables.merged_rows(runs)
  # The OOM under the default limit and the fit under 95% are both shown, each with its limit.
  assert [(r["limit"], "error" in r) for r in rows] == [("default", True), ("95%", False)]
  assert "| qwen3-14b | 1x1024 | optax | scanned | 95% | 100.00 |" in results_tables.table(rows)
  cells = results_tables.missing(rows)
  assert ("qwen3-14b", 1, "optax") not in cells and ("qwen3-14b", 1, "forge") in cells
  assert len(cells) == len(results_tables.MODEL_ORDER) * 2 * 5 - 1


def test_h200_session_script_parses_and_refuses_unknown_parts(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  script = ROOT / "experiments" / "h200_session.sh"
  assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
  run = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path)})
  assert run.returncode == 2 and "unknown part bogus" in run.stderr


def test_relative_links_in_the_docs_resolve():
  """Every relative link of the README, docs/ (the kernel's design included) and RESULTS.md names
  a file that exists (results are linked by path: a renamed folder must not leave a dead link)."""
  import re  # pylint: disable=g-import-not-at-top
  files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "RESULTS.md"]
  dead, count = [], 0
  for f in files:
    for target in re.findall(r"\]\(([^)\s]+)\)", f.read_text()):
      if target.startswith(("http://", "https://", "#", "mailto:")):
        continue
      count += 1
      if not (f.parent / target.split("#")[0]).exists():
        dead.append(f"{f.relative_to(ROOT)}: {target}")
  assert count > 50 and not dead, dead
