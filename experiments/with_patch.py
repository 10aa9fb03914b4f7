"""Runs a command in a copy of the repository with a patch applied: try a change on the GPU before
it lands, side by side with the same command on the unpatched tree.

    python -m experiments.with_patch experiments/patches/head_update_first.diff -- \\
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
import subprocess
import sys
import tempfile

from experiments import live_buffers


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
    tree = live_buffers.patched_tree(patch, pathlib.Path(tmp))
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    print(f"with_patch: {patch.name} applied in {tree}", flush=True)
    if command[0] in ("python", "python3"):  # this interpreter (a virtual environment's, say)
      command = [sys.executable, *command[1:]]
    return subprocess.run(command, cwd=tree, env=env).returncode


if __name__ == "__main__":
  sys.exit(main())
