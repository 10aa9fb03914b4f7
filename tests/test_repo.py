"""The repository's own promises: CI runs the README's test command."""

import os
import pathlib
import re

import pytest

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


@pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py
def test_readme_python_examples_run():
  """Each README python block runs on its own, as a reader would paste it (CPU: "auto" is "xla")."""
  readme = (ROOT / "README.md").read_text()
  blocks = [(readme[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", readme, flags=re.S)]
  assert any("train_step" in code for _, code in blocks)
  assert any("fused_linear_update(" in code for _, code in blocks)
  for line, code in blocks:
    # Pad so that a traceback names the README line.
    exec(compile("\n" * (line - 1) + code, "README.md", "exec"), {})  # pylint: disable=exec-used


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
  """Every relative link of the README, docs/ (the kernel's design included) and RESULTS.md names
  a file that exists (results are linked by path: a renamed folder must not leave a dead link)."""
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


# Development-history narration that the tree must not carry (dates and commits are fine):
# numbered or ordinal work sittings, issue numbers, and agent words. Each pattern is written so
# that its own source text does not match it.
_SITTING_WORDS = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                  r"\d+(?:st|nd|rd|th)|this|next|last|previous|earlier|later|same|that|the|between|"
                  r"other|those|these|each|every")
_AGENT_WORD = re.compile(r"\bhelpers?\b", re.I)
_NARRATION = [
    re.compile(r"\bsessions?[ -]\d+", re.I),
    re.compile(rf"\b(?:{_SITTING_WORDS}) (?:h200 |gpu |device |cpu )?sessions?\b", re.I),
    re.compile(r"\b(?:issues?|PRs?|pull requests?|tickets?) #\d+", re.I),
    # A bare issue reference in prose (a number after "#" followed by "'s", a comma, a closing
    # parenthesis, a colon or a space), not a name such as the profiler's "Stream #13(Compute)".
    re.compile(r"(?:^|[\s(])#\d+(?='s|[,):.;]|\s)"),
    _AGENT_WORD,
    re.compile(r"\bcampaigns?\b", re.I),
    re.compile(r"\bwork[- ]periods?\b", re.I),
]
# The one use of that agent word allowed: as the whole title comment of a code section.
_SECTION_TITLE = re.compile(r"^\s*#[\s=-]*h[e]lpers?\.?\s*$", re.I)


def _narration_in(line):
  """The first narration ``line`` holds, or None."""
  for pattern in _NARRATION:
    match = pattern.search(line)
    if match and not (pattern is _AGENT_WORD and _SECTION_TITLE.match(line)):
      return match.group(0).strip()
  return None


_TEXT_SUFFIXES = {".py", ".md", ".sh", ".ipynb", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml"}


def _tracked_text_files():
  """The repository's source and documentation files (not JSON data, logs or binaries)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  try:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                            check=True).stdout.decode().split("\0")
    paths = [ROOT / p for p in listed if p]
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: the package's own tree
    skip = {"runs", "build", "dist", "__pycache__", "node_modules"}
    paths = [p for p in ROOT.rglob("*") if not any(
        part.startswith(".") or part in skip or part.endswith(".egg-info")
        for part in p.relative_to(ROOT).parts[:-1])]
  for path in paths:
    rel = path.relative_to(ROOT)
    if path.is_file() and (path.suffix in _TEXT_SUFFIXES or path.name.startswith("README")
                           or rel.parts[0] == ".ci"):
      yield rel, path


def _narration_hits():
  hits = []
  for rel, path in _tracked_text_files():
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError):
      continue
    for number, line in enumerate(text.splitlines(), 1):
      found = _narration_in(line)
      if found:
        hits.append(f"{rel}:{number}: {found!r} in {line.strip()[:120]!r}")
  return hits


def test_narration_patterns_hit_narration_and_spare_code_words():
  # "|" splits each example so that this file's own text does not match; it is removed here.
  narration = ["measured in sess|ion 9", "Sess|ions 8-16 timed", "the fifth H200 sess|ion",
               "see iss|ue #4", "|#4's bars are met", "(|#3, |#4)", "a help|er's analysis",
               "the next H200 campa|ign", "in this work per|iod"]
  code = ["def _helper(x):", "compile_helpers = 1", "# ---------- help|ers", "# Help|ers.",
          'scope="session"', "a profiler session is active", "Stream #13(Compute)", "commit 2b67016",
          "run on 2026-12-01"]
  assert [s for s in narration if not _narration_in(s.replace("|", ""))] == []
  assert [s for s in code if _narration_in(s.replace("|", ""))] == []


def test_no_development_narration_in_the_tree():
  """Code, docs and results READMEs speak of the product: no numbered work sittings, issue
  numbers or agent words (say what a measurement is, with its date or commit)."""
  hits = _narration_hits()
  assert not hits, f"{len(hits)} lines narrate development history:\n" + "\n".join(hits)


def test_gpu_only_cases_carry_the_gpu_marker():
  """A case skipped without a GPU is skipped through tests/_gpu.py, which also marks it ``gpu``,
  so that ``pytest -m gpu`` on a GPU machine (the README's command) runs every such case."""
  pattern = re.compile(r'skipif\(\s*(?:not\s+)?jax\.default_backend\(\)\s*!=\s*"gpu"')
  bare = [f"{path.name}:{i}" for path in sorted((ROOT / "tests").glob("*.py")) if path.name != "_gpu.py"
          for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
  assert bare == [], f"GPU-only skips without the gpu marker (use tests._gpu.gpu_marks): {bare}"
