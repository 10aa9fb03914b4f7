"""experiments/ablations.ipynb runs end to end (at its tiny default size, about a minute on CPU)."""

from __future__ import annotations

import pathlib

import pytest

from tests._xla_flags import fast_cpu_flags

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ablations_notebook_runs(tmp_path, monkeypatch):
  # The kernel's XLA_FLAGS: compilation dominates at this size.
  monkeypatch.setenv("XLA_FLAGS", fast_cpu_flags())
  monkeypatch.setenv("ABLATIONS_OUT", str(tmp_path / "runs"))
  monkeypatch.setenv("FORGE_DATA_CACHE", str(tmp_path / "data"))
  # The runs share their eval (forward) programs: compile each once.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  nb = nbformat.read(ROOT / "experiments" / "ablations.ipynb", as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
      "commit the notebook without outputs"
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()  # raises CellExecutionError, with the cell's traceback, on any error
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
  for run in ("forge-adamw", "optax-adamw", "forge-lion", "forge-adamw-bf16", "optax-adamw-bf16"):
    assert run in text
  assert "mean |loss gap|" in text and "xla reference" in text
  assert "| forge_clip_prev_norm |" in text  # section F's table
  assert (tmp_path / "runs" / "forge-adamw" / "log.jsonl").exists()
