"""The repository's own promises: CI runs the README's test command."""

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
