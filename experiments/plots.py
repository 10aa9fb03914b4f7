"""Loss curves of training runs (``log.jsonl`` records), and the gap between two of them.

matplotlib is optional here (the ``experiments`` extra installs it): without
it the plot functions print a note and return ``None``.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np


def curves(records: Sequence[dict]) -> dict[str, np.ndarray]:
  """``step``/``loss`` of the train records, ``eval_step``/``eval_loss`` of the eval records.

  When a step appears twice (a resumed run's log) the last record wins.
  """
  train = {r["step"]: r["loss"] for r in records if r.get("event") == "train"}
  evals = {r["step"]: r["eval_loss"] for r in records if r.get("event") == "eval"}
  steps = np.array(sorted(train))
  esteps = np.array(sorted(evals))
  return {"step": steps, "loss": np.array([train[s] for s in steps]),
          "eval_step": esteps, "eval_loss": np.array([evals[s] for s in esteps])}


# Step windows of the gap table: where the runs still agree to rounding,
# and where training has amplified it (each window twice the last).
GAP_WINDOW_EDGES = (0, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def gap_windows(steps: np.ndarray, gap: np.ndarray, edges=GAP_WINDOW_EDGES) -> list[dict]:
  """Mean |gap| per window ``[lo, hi)`` of step indices (0-based, in order), up to the last step."""
  out = []
  n = len(gap)
  for lo, hi in zip(edges, list(edges[1:]) + [None]):
    if lo >= n:
      break
    hi = n if hi is None else min(hi, n)
    part = np.abs(gap[lo:hi])
    out.append({"from_step": int(steps[lo]), "to_step": int(steps[hi - 1]),
                "mean_abs_gap": float(np.mean(part))})
  return out


def loss_gap(a: dict, b: dict) -> dict:
  """Per-step ``a - b`` of two runs' train losses on their common steps, and its summary."""
  common, ia, ib = np.intersect1d(a["step"], b["step"], return_indices=True)
  gap = a["loss"][ia] - b["loss"][ib]
  ecommon, ea, eb = np.intersect1d(a["eval_step"], b["eval_step"], return_indices=True)
  egap = a["eval_loss"][ea] - b["eval_loss"][eb]
  tail = gap[len(gap) // 2:]
  return {
      "steps": common, "gap": gap, "eval_steps": ecommon, "eval_gap": egap,
      "mean_abs_gap": float(np.mean(np.abs(gap))) if gap.size else float("nan"),
      "mean_abs_gap_2nd_half": float(np.mean(np.abs(tail))) if tail.size else float("nan"),
      "max_abs_gap": float(np.max(np.abs(gap))) if gap.size else float("nan"),
      "mean_gap": float(np.mean(gap)) if gap.size else float("nan"),
      "mean_abs_eval_gap": float(np.mean(np.abs(egap))) if egap.size else float("nan"),
      "windows": gap_windows(common, gap),
  }


def _pyplot():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed (pip install -e '.[experiments]'): no plot written")
    return None
  matplotlib.use("Agg")  # files only; works without a display
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
  if window <= 1 or y.size < window:
    return y
  kernel = np.ones(window) / window
  return np.convolve(y, kernel, mode="valid")


def plot_runs(runs: dict[str, dict], path: str | os.PathLike, title: str, smooth: int = 1,
              gaps: Sequence[tuple[str, str]] = ()) -> Optional[str]:
  """Train (lines) and eval (markers) loss of each run; below, per-step gaps between runs.

  Args:
    runs: name -> :func:`curves` of that run.
    path: the PNG to write.
    title: the figure title (say what was trained, on what).
    smooth: moving-average window for the train curves (eval is not smoothed).
    gaps: pairs ``(a, b)``: a panel with ``loss(a) - loss(b)`` per step for each.

  Returns:
    The path written, or ``None`` without matplotlib.
  """
  plt = _pyplot()
  if plt is None:
    return None
  rows = 2 if gaps else 1
  fig, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows + 0.6), squeeze=False,
                           sharex=True, height_ratios=[2, 1][:rows])
  ax = axes[0, 0]
  for i, (name, c) in enumerate(runs.items()):
    color = f"C{i}"
    y = _smooth(c["loss"], smooth)
    # Wider lines first, so that identical curves still show both.
    ax.plot(c["step"][len(c["step"]) - len(y):], y, color=color, lw=max(2.8 - 1.2 * i, 0.8),
            label=f"{name} train")
    if c["eval_step"].size:
      ax.plot(c["eval_step"], c["eval_loss"], "o--", color=color, ms=4, lw=0.8,
              label=f"{name} eval (held out)")
  ax.set_ylabel("loss (nat/token)")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  if gaps:
    gx = axes[1, 0]
    for j, (a, b) in enumerate(gaps):
      g = loss_gap(runs[a], runs[b])
      gx.plot(g["steps"], g["gap"], lw=0.8, color=f"C{3 + 2 * j}",
              label=f"{a} - {b}: mean |gap| {g['mean_abs_gap']:.2e}")
      if g["eval_steps"].size:
        gx.plot(g["eval_steps"], g["eval_gap"], "o", color=f"C{4 + 2 * j}", ms=4,
                label=f"{a} - {b}, eval")
    gx.axhline(0, color="k", lw=0.5)
    gx.set_ylabel("loss gap (nat)")
    gx.legend(fontsize=8)
    gx.grid(alpha=0.3)
  axes[-1, 0].set_xlabel("step")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)
