"""The training CLI (exact resume, FORGE = optax, clear errors), the quickstart and convergence smoke runs."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import forge_jax
from experiments import convergence
from experiments import data as data_lib
from experiments import quickstart
from experiments import train

# tests/conftest.py: runs of one configuration (straight, stopped, resumed) compile the same step.
pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter", "module_compilation_cache")

# The runs here share one configuration (convergence.SMOKE's: tiny-qwen3, 12 steps of 2x32
# bytes, lr 3e-3, warmup 1), so that the compilation cache compiles each program once.
CORPUS = convergence.SMOKE["corpus_bytes"]
STEPS = convergence.SMOKE["steps"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("data_cache"))


def _argv(impl: str, out, cache: str, *extra) -> list[str]:
  return ["--impl", impl, "--model", "tiny-qwen3", "--steps", str(STEPS), "--warmup", "1",
          "--batch", "2", "--seq", "32", "--tokenizer", "bytes", "--corpus-bytes", str(CORPUS),
          "--eval-every", "4", "--eval-batches", "2", "--log-every", "2", "--ckpt-every", "12",
          "--data-cache", cache, "--out", str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> dict:
  """A straight run per implementation (forge through the CLI's main)."""
  root = tmp_path_factory.mktemp("straight")
  assert train.main(_argv("forge", root / "forge", cache)) == 0
  train.run(train.parse_args(_argv("optax", root / "optax", cache)))
  return {impl: root / impl for impl in train.IMPLS}


def _train_records(out) -> list[dict]:
  return [r for r in train.read_log(pathlib.Path(out) / "log.jsonl") if r["event"] == "train"]


def _final_state(out, cache):
  args = train.parse_args(_argv(out.name, out, cache))
  data = data_lib.load("bytes", max_bytes=CORPUS, cache_dir=cache)
  trainer = train.build_trainer(args, data.vocab_size, compile_step=False)
  found = train.latest_checkpoint(pathlib.Path(out))
  assert found and found[0] == STEPS
  return forge_jax.restore_train_state(found[1], trainer.init_state())


def test_logs_record_data_fingerprint_steps_evals_and_summary(straight):
  records = train.read_log(straight["forge"] / "log.jsonl")
  start = records[0]
  assert start["event"] == "start" and start["impl"] == "forge"
  for key in ("corpus_sha256", "corpus_bytes", "python", "tokens_sha256"):
    assert key in start["data"]
  assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, STEPS + 1))
  assert [r["step"] for r in records if r["event"] == "eval"] == [4, 8, 12]
  assert records[-1]["event"] == "end" and records[-1]["complete"]
  summary = json.loads((straight["forge"] / "summary.json").read_text())
  assert summary["final_eval_loss"] > 0 and summary["tokens_per_s"] > 0
  assert summary["xla_memory"]["step_gib"] > 0


def test_forge_tracks_optax_on_the_same_data(straight):
  forge, optax_ = _train_records(straight["forge"]), _train_records(straight["optax"])
  # Same init and batches: equal first loss; then float32 summation order only.
  assert forge[0]["loss"] == pytest.approx(optax_[0]["loss"], rel=1e-6)
  np.testing.assert_allclose([r["loss"] for r in forge], [r["loss"] for r in optax_], rtol=1e-5)
  np.testing.assert_allclose([r["grad_norm"] for r in forge], [r["grad_norm"] for r in optax_],
                             rtol=1e-4)


@pytest.mark.parametrize("impl", train.IMPLS)
def test_resume_from_a_checkpoint_is_bit_exact(impl, straight, cache, tmp_path):
  out = tmp_path / impl
  stopped = train.run(train.parse_args(_argv(impl, out, cache, "--stop-at", "5")))
  assert not stopped["complete"] and train.latest_checkpoint(out)[0] == 5
  resumed = train.run(train.parse_args(_argv(impl, out, cache, "--resume")))
  assert resumed["complete"] and resumed["resumed_from"] == 5
  a, b = _train_records(straight[impl]), _train_records(out)
  assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == \
         [(r["step"], r["loss"], r["grad_norm"]) for r in b]
  for x, y in zip(jax.tree.leaves(_final_state(straight[impl], cache)),
                  jax.tree.leaves(_final_state(out, cache)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# A training CLI that SIGKILLs itself while orbax writes one checkpoint: after the arrays are in
# the temporary directory, before the rename that commits it (orbax's atomic save).
_KILLED_DURING_WRITE = """
import os, signal, sys
from orbax.checkpoint import path as ocp_path
from experiments import train
temporary = ocp_path.atomicity.AtomicRenameTemporaryPath
finalize = temporary.finalize
async def killed(self):
  if os.path.basename(str(self.get())).startswith(sys.argv[1] + "."):
    os.kill(os.getpid(), signal.SIGKILL)
  return await finalize(self)
temporary.finalize = killed
sys.exit(train.main(sys.argv[2:]))
"""


@pytest.mark.usefixtures("fast_subprocess_compiles")
def test_a_run_killed_while_writing_a_checkpoint_resumes_bit_for_bit(straight, cache, tmp_path):
  """SIGKILL during the write of step 8's checkpoint leaves orbax's temporary directory
  beside step 4's; --resume continues from step 4 and ends as the run that was never killed."""
  out = tmp_path / "forge"
  argv = _argv("forge", out, cache)
  argv[argv.index("--ckpt-every") + 1] = "4"
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
  killed = subprocess.run([sys.executable, "-c", _KILLED_DURING_WRITE, "step_00000008", *argv],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  left = sorted(p.name for p in (out / "ckpt").iterdir())
  assert left[0] == "step_00000004" and len(left) == 2, left
  assert left[1].startswith("step_00000008.orbax-checkpoint-tmp"), left
  assert [r["step"] for r in _train_records(out)] == list(range(1, 9))
  resumed = train.run(train.parse_args(argv + ["--resume"]))
  assert resumed["complete"] and resumed["resumed_from"] == 4
  a, b = _train_records(straight["forge"]), _train_records(out)
  assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == \
         [(r["step"], r["loss"], r["grad_norm"]) for r in b]
  for x, y in zip(jax.tree.leaves(_final_state(straight["forge"], cache)),
                  jax.tree.leaves(_final_state(out, cache)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_perturb_ulp_moves_half_the_elements_by_one_ulp():
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (64, 32)),
            "s": jax.numpy.ones(8, jax.numpy.bfloat16), "i": jax.numpy.arange(3)}
  moved = train.perturb_ulp(params, seed=1)
  w, w2 = np.asarray(params["w"]), np.asarray(moved["w"])
  changed = w2 != w
  assert 0.4 < changed.mean() < 0.6
  np.testing.assert_array_equal(w2[changed], np.nextafter(w[changed], np.inf))
  assert moved["s"].dtype == jax.numpy.bfloat16 and (moved["i"] == params["i"]).all()


def test_clipping_with_forge_and_forge_storage_with_optax_are_refused():
  with pytest.raises(ValueError, match="not available with --impl forge"):
    train.parse_args(["--impl", "forge", "--clip", "1.0"])
  args = train.parse_args(["--impl", "optax", "--clip", "1.0"])
  assert args.clip == 1.0
  with pytest.raises(ValueError, match="FORGE storage options"):
    train.parse_args(["--impl", "optax", "--state-dtype", "int8"])


def test_an_existing_run_needs_resume_with_the_same_arguments(straight, cache):
  with pytest.raises(ValueError, match="--resume"):
    train.run(train.parse_args(_argv("forge", straight["forge"], cache)))
  with pytest.raises(ValueError, match="lr"):
    train.run(train.parse_args(_argv("forge", straight["forge"], cache, "--resume", "--lr", "1")))


def test_quickstart_smoke(tmp_path, cache, capsys):
  # tiny-qwen3 as it is (num_layers=2), at the module's configuration.
  result = quickstart.main(["--steps", str(STEPS), "--batch", "2", "--seq", "32", "--lr", "3e-3",
                            "--set", "num_layers=2", "--corpus-bytes", str(CORPUS),
                            "--eval-every", "4", "--no-progress",
                            "--data-cache", cache, "--out", str(tmp_path)])
  printed = capsys.readouterr().out
  assert "mean |loss gap|" in printed and "forge" in printed and "optax" in printed
  assert result["gap"]["mean_abs_gap"] < 1e-4
  assert json.loads((tmp_path / "quickstart.json").read_text())["table"] == result["table"]
  if result["plot"]:
    assert (tmp_path / "quickstart_loss.png").stat().st_size > 1000


def test_convergence_smoke_writes_curves_gaps_control_and_plot(tmp_path, cache, capsys):
  out = tmp_path / "conv"
  result = convergence.main(["--smoke", "--out", str(out), "--data-cache", cache])
  saved = json.loads((out / "convergence.json").read_text())
  steps = convergence.SMOKE["steps"]
  assert set(saved["curves"]) == set(convergence.RUNS)
  for name in convergence.RUNS:
    assert len(saved["curves"][name]["loss"]) == steps and saved["summaries"][name]["complete"]
  gap, control = saved["gaps"]["forge-optax"], saved["gaps"]["optax_ulp-optax"]
  assert gap["mean_abs_gap"] == result["gaps"]["forge-optax"]["mean_abs_gap"] < 1e-4
  assert len(gap["eval_steps"]) == steps // convergence.SMOKE["eval_every"]
  # The control starts from weights one ulp away: its losses differ by rounding only.
  assert control["max_abs_gap"] < 1e-4
  # Every run continued from the pre-training run's weights (--init-from its --save-hf).
  pretrain = train.read_log(out / "pretrain" / "log.jsonl")
  first = [r["loss"] for r in pretrain if r["event"] == "train"][0]
  assert saved["pretrain"]["complete"] and saved["curves"]["forge"]["loss"][0] < first - 0.3
  md = (out / "convergence.md").read_text()
  assert "Paper: mean |gap| 0.001 nat" in md and "| optax_ulp-optax |" in md
  assert saved["data"]["corpus_sha256"]
  if result.get("plot"):
    assert (out / "convergence.png").stat().st_size > 1000
  assert gap["windows"][0]["mean_abs_gap"] == pytest.approx(gap["mean_abs_gap"])  # < 50 steps: one window
  capsys.readouterr()
  convergence.main(["--smoke", "--out", str(out), "--data-cache", cache])  # finished runs are reused
  assert capsys.readouterr().out.count("reusing the finished run") == len(convergence.RUNS) + 1
  with pytest.raises(ValueError, match=r"holds a finished run with other arguments .*'lr': \(0.003, 0.01\)"):
    convergence.main(["--smoke", "--lr", "0.01", "--out", str(out), "--data-cache", cache])
  # The gap tables can be rebuilt from the stored curves alone (no training).
  (out / "convergence.md").unlink()
  rebuilt = convergence.main(["--report-from", str(out)])
  assert rebuilt["gaps"]["forge-optax"]["mean_abs_gap"] == pytest.approx(gap["mean_abs_gap"])
  assert "--report-from" in (out / "convergence.md").read_text()


def test_gap_windows():
  from experiments import plots  # pylint: disable=g-import-not-at-top
  steps = np.arange(1, 121)
  gap = -np.arange(120, dtype=float)  # |gap| = index
  got = plots.gap_windows(steps, gap)
  assert [(w["from_step"], w["to_step"]) for w in got] == [(1, 50), (51, 100), (101, 120)]
  assert [w["mean_abs_gap"] for w in got] == [24.5, 74.5, 109.5]


def test_cli_refuses_bad_numbers_and_misplaced_set_fields():
  for flag, value in (("--log-every", "0"), ("--eval-batches", "0"), ("--keep-ckpts", "0"),
                      ("--warmup", "-5"), ("--stop-at", "-1")):
    with pytest.raises(ValueError, match=f"{flag} {value} must be at least"):
      train.check_args(train.parse_args(["--impl", "optax", flag, value]))
  args = train.parse_args(["--impl", "optax", "--set", "dtype=bfloat16"])
  with pytest.raises(ValueError, match="this field is set by --dtype"):
    train.model_config(args, 256)
  args = train.parse_args(["--impl", "optax", "--set", "foo=1"])
  with pytest.raises(ValueError, match="ModelConfig has no field 'foo'"):
    train.model_config(args, 256)


def test_resume_without_a_checkpoint_starts_again_and_says_so(tmp_path, cache, capsys):
  """A run stopped without a checkpoint cannot continue: --resume starts it again (as the
  convergence script's "run the same command again" needs), and says so."""
  out = tmp_path / "run"
  argv = _argv("optax", out, cache)
  argv[argv.index("--ckpt-every") + 1] = "0"
  train.run(train.parse_args(argv + ["--stop-at", "2"]))  # an early stop checkpoints...
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(out / "ckpt")  # ...so take it away: as a run killed before any
  capsys.readouterr()
  summary = train.run(train.parse_args(argv + ["--resume"]))
  assert "has no checkpoint" in capsys.readouterr().err
  assert summary["complete"] and summary["resumed_from"] is None


def test_resume_of_a_finished_run_keeps_its_summary_and_can_export(straight, cache, tmp_path):
  before = json.loads((straight["optax"] / "summary.json").read_text())
  again = train.run(train.parse_args(_argv("optax", straight["optax"], cache, "--resume")))
  assert again == before == json.loads((straight["optax"] / "summary.json").read_text())
  export = tmp_path / "hf"  # --save-hf of a finished run writes its final weights
  again = train.run(train.parse_args(_argv("optax", straight["optax"], cache, "--resume",
                                           "--save-hf", str(export))))
  assert again["saved_hf"] == str(export) and (export / "model.safetensors").exists()
  assert json.loads((straight["optax"] / "summary.json").read_text()) == before


def test_convergence_checks_every_run_first_and_smoke_yields_to_flags(tmp_path):
  with pytest.raises(ValueError, match="--runs: 'optx' is not one of"):
    convergence.check_runs(convergence.parse_args(["--smoke", "--runs", "forge,optx"]))
  with pytest.raises(ValueError, match="--warmup 4 must be below --steps 3"):
    convergence.check_runs(convergence.parse_args(["--smoke", "--steps", "3", "--warmup", "4"]))
  args = convergence.parse_args(["--smoke", "--steps", "30", "--lr", "0.01"])
  assert (args.steps, args.lr, args.batch) == (30, 0.01, convergence.SMOKE["batch"])
