"""Runs a command in a copy of the repository with a patch applied: try a change on the GPU before
it lands, side by side with the same command on the unpatched tree.

    python -m experiments.with_patch experiments/patches/no_head_barrier.diff -- \\
        python -m experiments.bench_models --out $OUT/patched --models llama-3.1-8b --impls forge

The copy holds the repository's files (git's tracked files, or every file but results and caches
where there is no .git, as on the device machine), patched with ``git apply`` (``patch -p1``
without git). The command runs there with ``PYTHONPATH`` pointing at it; relative paths in its
arguments are resolved against the copy, so give output folders as absolute paths (``$OUT/...``).
A command starting with ``python`` runs with this interpreter. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tree_files(root: pathlib.Path) -> list:
  """The repository's files: git's tracked files, or (in a copy without .git, as on the device
  machine) every file but results, caches and git's own."""
  try:
    return subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", "__pycache__", "results", "runs", ".pytest_cache"}
    return [str(f.relative_to(root)) for f in root.rglob("*")
            if f.is_file() and not skip.intersection(f.relative_to(root).parts)]


def patched_tree(patch: pathlib.Path, into: pathlib.Path, root: pathlib.Path = ROOT) -> pathlib.Path:
  """A copy of the repository's files with ``patch`` applied (``git apply``, or ``patch -p1``
  where git is missing)."""
  for name in _tree_files(root):
    target = into / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if (root / name).is_file():
      shutil.copy2(root / name, target)
  try:
    subprocess.run(["git", "apply", str(patch.resolve())], cwd=into, check=True)
  except OSError:
    subprocess.run(["patch", "-p1", "-i", str(patch.resolve())], cwd=into, check=True)
  return into


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("patch", help="a unified diff against the repository root (git apply)")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command after --")
  patch = pathlib.Path(args.patch)
  if not patch.is_file():
    parser.error(f"patch {args.patch}: no such file")
  with tempfile.TemporaryDirectory(prefix="with_patch_") as tmp:
    tree = patched_tree(patch, pathlib.Path(tmp))
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    print(f"with_patch: {patch.name} applied in {tree}", flush=True)
    if command[0] in ("python", "python3"):  # this interpreter (a virtual environment's, say)
      command = [sys.executable, *command[1:]]
    return subprocess.run(command, cwd=tree, env=env).returncode


if __name__ == "__main__":
  sys.exit(main())
