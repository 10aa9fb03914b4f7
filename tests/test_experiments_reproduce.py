"""experiments/reproduce.py: each suite's commands (dry run), and the models suite end to end on a
tiny model on the CPU."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shlex
import sys

import jax.numpy as jnp
import pytest

import forge_jax
from experiments import bench_models, reproduce, results_tables


def _argv(step) -> list:
  return step.argv


def test_models_suite_runs_every_headline_row_once_over_its_parts(tmp_path, capsys):
  whole = reproduce.main(["--suite", "models", "--dry-run", "--out", str(tmp_path)])
  assert whole["estimate_s"] > reproduce.BUDGET_S  # one call cannot hold the whole suite
  assert "run --part 1/2 ... --part 2/2" in capsys.readouterr().out
  rows = []
  for k in (1, 2):
    record = reproduce.main(["--suite", "models", "--part", f"{k}/2", "--dry-run", "--out", str(tmp_path)])
    assert record["estimate_s"] <= reproduce.BUDGET_S, record
    (step,) = record["steps"]
    argv = shlex.split(step["command"])
    assert argv[:3] == ["BENCH_TAG=models_part%dof2" % k, "python", "-m"]
    assert argv[3] == "experiments.bench_models"
    value = lambda flag: argv[argv.index(flag) + 1]  # pylint: disable=cell-var-from-loop
    assert (value("--models"), value("--batch"), value("--tokens"), value("--dtype")) == (
        "llama-3.1-8b", "1", "1024", "bfloat16")
    assert value("--compile-cache") and int(value("--precompile")) >= 2
    assert float(value("--time-budget")) < step["timeout_s"] <= reproduce.BUDGET_S
    rows += value("--impls").split(",")
  assert sorted(rows) == sorted(reproduce.HEADLINE_ROWS)
  assert not (tmp_path / "reproduce_models.json").exists()  # a dry run writes nothing


def test_headline_rows_are_the_brief():
  """optax, optax+clip, FORGE nearest / SR and int8-SR, each scanned with remat full and
  unrolled with remat none; optax, FORGE and FORGE int8-SR scanned without remat; optax,
  optax+clip and FORGE unrolled with remat full; optax with float32 master weights under 95%."""
  settings = {}
  for spec in reproduce.HEADLINE_ROWS:
    base, scan = bench_models.parse_impl(spec)
    s = bench_models.row_settings(spec)
    settings.setdefault(base, set()).add((scan, s["remat"], s["param_dtype"], s["mem_fraction"]))
  scanned_full, unrolled_none = (True, "full", None, None), (False, "none", None, None)
  scanned_none, unrolled_full = (True, "none", None, None), (False, "full", None, None)
  assert settings["optax"] == {scanned_full, unrolled_none, scanned_none, unrolled_full,
                               (False, "none", "float32", 0.95)}
  assert settings["optax_clip"] == {scanned_full, unrolled_none, unrolled_full}
  assert settings["forge"] == {scanned_full, unrolled_none, scanned_none, unrolled_full}
  assert settings["forge_sr"] == {scanned_full, unrolled_none}
  assert settings["forge_int8_sr"] == {scanned_full, unrolled_none, scanned_none}


def test_front_suite_is_the_readmes_rows_in_one_run_then_the_compile_ratio(tmp_path):
  """The README's first figures: nine Llama-3.1-8B 1x1024 bf16 rows in one bench_models run,
  eight without remat (optax and optax + clip unrolled; FORGE unrolled and scanned, guard on and
  off; FORGE int8 + SR unrolled and scanned) and unrolled int8 + SR under forge_jax's policy,
  then compile_cost on the whole model, both within one call."""
  record = reproduce.main(["--suite", "front", "--dry-run", "--out", str(tmp_path)])
  rows_step, compile_step = record["steps"]
  argv = shlex.split(rows_step["command"])
  value = lambda flag, a=argv: a[a.index(flag) + 1]
  assert argv[3] == "experiments.bench_models"
  assert (value("--models"), value("--batch"), value("--tokens"), value("--dtype"), value("--remat")) == (
      "llama-3.1-8b", "1", "1024", "bfloat16", "none")
  settings = set()
  for spec in value("--impls").split(","):
    base, scan = bench_models.parse_impl(spec)
    settings.add((base, scan, bench_models.row_settings(spec)["remat"]))
  none = lambda *rows: {(base, scan, "none") for base, scan in rows}
  assert settings == none(("optax", False), ("optax_clip", False), ("forge", False), ("forge", True),
                          ("forge_noguard", False), ("forge_noguard", True), ("forge_int8_sr", False),
                          ("forge_int8_sr", True)) | {("forge_int8_sr", False, "save_all_but_elementwise")}
  assert int(value("--precompile")) == 9 and float(value("--time-budget")) < rows_step["timeout_s"]
  cargv = shlex.split(compile_step["command"])
  cvalue = lambda flag: cargv[cargv.index(flag) + 1]
  assert cargv[2] == "experiments.compile_cost" and "--fresh" in cargv and "--compile" in cargv
  assert (cvalue("--layers"), cvalue("--impls"), cvalue("--repeats")) == ("32", "forge,forge_unrolled", "2")
  from experiments import compile_cost  # pylint: disable=g-import-not-at-top
  for flag in (a for a in cargv + argv if a.startswith("--")):
    assert f'"{flag}"' in inspect.getsource(compile_cost) + inspect.getsource(bench_models), flag
  assert sum(s["timeout_s"] for s in record["steps"]) <= reproduce.BUDGET_S
  assert record["estimate_s"] <= reproduce.BUDGET_S


def test_storage_suite_is_five_profiled_rows_then_the_same_storages_per_layer_after_dx(tmp_path):
  """optax and FORGE's four weight-rounding x state storages, unrolled, remat none, profiled in
  one bench_models run; then bench_lowp --with-dx for those storages on the model's block shapes."""
  record = reproduce.main(["--suite", "storage", "--dry-run", "--out", str(tmp_path)])
  rows_step, layer_step = record["steps"]
  argv = shlex.split(rows_step["command"])
  value = lambda flag, a=argv: a[a.index(flag) + 1]
  assert argv[3] == "experiments.bench_models" and "--profile" in argv
  assert (value("--remat"), value("--tokens"), value("--precompile")) == ("none", "1024", "5")
  specs = value("--impls").split(",")
  assert [bench_models.parse_impl(spec) for spec in specs] == [
      (base, False) for base in ("optax", "forge", "forge_sr", "forge_int8", "forge_int8_sr")]
  largv = shlex.split(layer_step["command"])
  assert largv[2] == "experiments.bench_lowp" and "--with-dx" in largv
  configs = largv[largv.index("--configs") + 1:largv.index("--impls")]
  from experiments import bench_lowp  # pylint: disable=g-import-not-at-top
  assert [bench_lowp.CONFIGS[c] for c in configs] == [
      (jnp.bfloat16, forge_jax.Precision(weight_rounding=r, state_dtype=s))
      for r, s in (("nearest", None), ("stochastic", None), ("nearest", "int8"),
                   ("stochastic", "int8"))]
  for flag in (a for a in argv if a.startswith("--")):
    assert f'"{flag}"' in inspect.getsource(bench_models), flag
  for flag in (a for a in largv if a.startswith("--")):
    assert f'"{flag}"' in inspect.getsource(bench_lowp), flag
  assert sum(s["timeout_s"] for s in record["steps"]) <= reproduce.BUDGET_S
  assert record["estimate_s"] <= reproduce.BUDGET_S


def test_other_suites_call_the_tools_by_module_and_cli(tmp_path):
  kernels = reproduce.main(["--suite", "kernels", "--dry-run", "--out", str(tmp_path)])
  modules = [shlex.split(s["command"])[2] for s in kernels["steps"]]
  assert modules == ["experiments.check_mosaic_gpu", "experiments.bench_fused_dw"]
  from experiments import bench_fused_dw, check_mosaic_gpu  # pylint: disable=g-import-not-at-top
  for step, module in zip(kernels["steps"], (check_mosaic_gpu, bench_fused_dw)):
    for flag in (a for a in shlex.split(step["command"]) if a.startswith("--")):
      assert f'"{flag}"' in inspect.getsource(module), (flag, module.__name__)  # a flag their CLI has
  (lowp,) = reproduce.main(["--suite", "lowp", "--dry-run", "--out", str(tmp_path)])["steps"]
  argv = shlex.split(lowp["command"])
  assert argv[2] == "experiments.bench_lowp" and argv[argv.index("--impls") + 1] == "mosaic"
  configs = argv[argv.index("--configs") + 1:argv.index("--impls")]
  assert {c for c in configs if c.endswith("_int8")} == {"fp32_int8", "bf16_rtn_int8", "bf16_sr_int8"}
  shapes = argv[argv.index("--shapes") + 1:argv.index("--configs")]
  assert shapes == ["4096x4096", "4096x1024", "4096x14336", "14336x4096"]  # Llama-3.1-8B's block
  from experiments import bench_lowp  # pylint: disable=g-import-not-at-top
  for flag in (a for a in argv if a.startswith("--")):
    assert f'"{flag}"' in inspect.getsource(bench_lowp), flag
  (auto,) = reproduce.main(["--suite", "auto", "--dry-run", "--out", str(tmp_path)])["steps"]
  argv = shlex.split(auto["command"])
  assert argv[2:5] == ["experiments.bench_fused_dw", "--auto-table", "--members"]
  assert auto["estimate_s"] < auto["timeout_s"] <= reproduce.BUDGET_S
  for flag in (a for a in argv if a.startswith("--")):
    assert f'"{flag}"' in inspect.getsource(bench_fused_dw), flag
  capacity = reproduce.main(["--suite", "capacity", "--dry-run", "--out", str(tmp_path)])
  assert sum(s["timeout_s"] for s in capacity["steps"]) <= reproduce.BUDGET_S
  for step in capacity["steps"]:
    argv = shlex.split(step["command"])
    assert "--preallocate" in argv and argv[argv.index("--impls") + 1] in step["command"]
  (conv,) = reproduce.main(["--suite", "convergence", "--dry-run", "--out", str(tmp_path)])["steps"]
  assert "experiments.convergence" in conv["command"] and "--pretrain-steps" in conv["command"]
  for bad in (["--suite", "kernels", "--part", "1/2"], ["--suite", "models", "--part", "3/2"],
              ["--suite", "models", "--part", "x"]):
    with pytest.raises(SystemExit):
      reproduce.main([*bad, "--dry-run"])


@pytest.mark.usefixtures("fast_subprocess_compiles")  # tests/conftest.py
def test_models_suite_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
  """One part of the suite on tiny-llama (one scanned optax row): the bench_models run, whose
  step and init the precompile process compiled into the cache and the timed worker loaded from
  it, the suite's record and the headline table made from it."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  n = len(reproduce.HEADLINE_ROWS)
  record = reproduce.main(["--suite", "models", "--part", f"1/{n}", "--model", "tiny-llama", "--tokens", "16",
                           "--out", str(tmp_path), "--compile-cache", str(tmp_path / "cache")])
  (step,) = record["steps"]
  assert step["rc"] == 0, (tmp_path / step["log"]).read_text()[-2000:]
  saved = json.loads((tmp_path / f"reproduce_models_part1of{n}.json").read_text())
  assert saved["device"] == "cpu" and saved["versions"]["jax"] and saved["date"]
  run = json.loads((tmp_path / f"models_part1of{n}.json").read_text())
  (row,) = run["rows"]
  assert row["impl"] == "optax" and "error" not in row, row
  (pre,) = run["meta"]["precompiled"]
  assert pre["rc"] == 0 and run["meta"]["compile_first"] and any((tmp_path / "cache").iterdir())
  assert row["step_from_cache"] and row["init_from_cache"] and row["compile_first"]
  assert set(row["phases_s"]) >= {"trace_lower", "compile", "init_compile", "init", "first_step"}
  assert row["compile_s"] == pre["compile_s"] > 0 and row["compile_parallel"] == 1
  assert pre["phases_s"]["init_compile"] > 0  # where the precompile's other seconds went
  headline = (tmp_path / "headline.md").read_text()
  assert "| optax.adamw | bf16 / bf16 | scanned | full | default | n/a |" in headline
  assert record["tables"] == ["headline.md"]
  assert f"[models_part1of{n}](models_part1of{n}.md)" in headline


def test_headline_table_ratios_and_the_pending_note(tmp_path):
  def row(impl, peak, ms, **kw):
    base = {"model": "llama-3.1-8b", "impl": impl, "batch": 1, "tokens": 1024, "dtype": "bfloat16",
            "param_dtype": "bfloat16", "scan": "_unrolled" not in impl, "remat": "full", "peak_gib": peak,
            "step_ms": ms, "compile_s": 100.0, "mem_fraction": None}
    return {**base, **kw}

  meta = {"device": "NVIDIA H200", "jax": "0.11.2", "date": "2026-12-02T02:00:00", "steps": 5,
          "dtype": "bfloat16", "command": "python -m experiments.bench_models ..."}
  runs = [("models_part1of2.json", {"meta": meta, "rows": [
      row("optax_unrolled:remat=none", 50.0, 120.0, remat="none"), row("optax", 60.0, 150.0),
      row("forge_int8_sr_unrolled:remat=none", 30.0, 240.0, remat="none")]}),
          ("models_part2of2.json", {"meta": meta, "rows": [
              row("forge_sr", 45.0, 135.0),
              row("optax_unrolled:remat=none:master=float32:mem=0.95", 125.0, 180.0, remat="none",
                  param_dtype="float32", mem_fraction=0.95),
              {**row("optax_clip_unrolled", 0, 0), "error": "OOM"}]})]
  lines = results_tables.headline_table(runs).splitlines()
  body = [l for l in lines if l.startswith("| ") and not l.startswith("| implementation")]
  assert [l.split(" | ")[0][2:] + " " + l.split(" | ")[1] for l in body] == [  # HEADLINE_ROWS order
      "optax.adamw bf16 / bf16", "FORGE adamw bf16 SR / bf16", "optax.adamw bf16 / bf16",
      "FORGE adamw bf16 SR / int8", "optax clip_by_global_norm(1.0) + adamw bf16 / bf16",
      "optax.adamw fp32 / fp32"]
  assert "| 45.00 | 0.75x | 135.0 | 0.90x | 100 | [models_part2of2]" in body[1]  # against scanned optax
  assert "| 30.00 | 0.60x | 240.0 | 2.00x |" in body[3]  # against unrolled remat-none optax
  assert "| unrolled | none | 95% | 125.00 | 2.50x | 180.0 | 1.50x |" in body[5]
  assert "| OOM |" in body[4]
  pending = results_tables.headline_section(tmp_path / "none", tmp_path / "none.json")
  assert pending.startswith(results_tables.PENDING) and "|" not in pending


_FAKE_NVIDIA_SMI = """
# nvidia-smi as experiments.gpu_clocks calls it: the name, then a busy, power-capped sample every
# 50 ms until terminated.
import datetime, sys, time
if any(a.startswith("--query-gpu=name") for a in sys.argv[1:]):
  print("Fake GPU")
  sys.exit(0)
while True:
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
  print(f"{now}, 1575 MHz, 3201 MHz, 690.00 W, 100 %, 55, 0x0000000000000004", flush=True)
  time.sleep(0.05)
"""


def test_clocks_sample_each_step_as_a_phase(tmp_path, monkeypatch, capsys):
  """--clocks: nvidia-smi samples while the steps run, each step a phase of the summary that the
  suite's record links; without nvidia-smi on the PATH, a usage error that says so."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "nvidia-smi"
  fake.write_text(f"#!{sys.executable}" + _FAKE_NVIDIA_SMI)
  fake.chmod(0o755)
  sleep = ["timeit", "-n1", "-r1", "import time; time.sleep(0.6)"]  # python -m timeit ...
  steps = lambda out, part, args: [reproduce.Step("first", sleep, 1, 60),
                                   reproduce.Step("second", sleep, 1, 60)]
  monkeypatch.setitem(reproduce.BUILDERS, "kernels", steps)
  monkeypatch.setattr(reproduce, "device_name", lambda: "Fake GPU")
  monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
  out = tmp_path / "run"
  record = reproduce.main(["--suite", "kernels", "--clocks", "--out", str(out)])
  assert [s["rc"] for s in record["steps"]] == [0, 0]
  assert record["clocks"] == "clocks/clocks.md"
  assert "[clocks/clocks.md](clocks/clocks.md)" in (out / "reproduce_kernels.md").read_text()
  phases = json.loads((out / "clocks" / "phases.json").read_text())["phases"]
  assert list(phases) == ["first", "second"]
  (a0, a1), (b0, b1) = phases["first"]["window"], phases["second"]["window"]
  assert a0 < a1 <= b0 < b1 and a1 - a0 >= 0.4
  summary = json.loads((out / "clocks" / "clocks.json").read_text())["summary"]
  for name in ("first", "second"):
    (band,) = summary[name]["bands"]
    assert band["samples"] >= 3 and band["reasons"] == ["SW power cap"], summary[name]
  # A bench_models step's rows become phases of their own, from their JSON's timed windows.
  rows = [{"model": "m", "batch": 1, "tokens": 8, "impl": "optax", "steps_window": [1.0, 2.0]},
          {"model": "m", "batch": 1, "tokens": 8, "impl": "forge", "error": "OOM"}]
  (out / "rows.json").write_text(json.dumps({"meta": {}, "rows": rows}))
  bench = reproduce.Step("rows", ["experiments.bench_models", "--out", str(out)], 1, 60,
                         env={"BENCH_TAG": "rows"})
  assert reproduce.row_windows(bench) == [("rows: m 1x8 optax", [1.0, 2.0])]
  assert reproduce.row_windows(reproduce.Step("first", sleep, 1, 60)) == []
  assert reproduce.row_windows(dataclasses.replace(bench, env={"BENCH_TAG": "absent"})) == []
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  with pytest.raises(SystemExit):
    reproduce.main(["--suite", "kernels", "--clocks", "--out", str(out)])
  assert "nvidia-smi, which is not on the PATH" in capsys.readouterr().err
