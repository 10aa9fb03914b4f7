"""backend="auto" reads its measured table (forge_jax/auto_table.json); the script that writes it."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax
from experiments import _timing
from experiments import bench_fused_dw
from experiments import bench_lowp
from forge_jax import _auto
from forge_jax import _fused
from forge_jax import _lowp
import pallas_kernels

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")  # tests/conftest.py

BF16, F32 = jnp.bfloat16, jnp.float32


def _table(*entries, **provenance) -> _auto.Table:
  return _auto.Table.from_json({"provenance": provenance, "entries": [
      dict(t=t, k=k, n=n, weight=w, states=s, sr=sr, choice=c) for t, k, n, w, s, sr, c in entries]})


@pytest.fixture
def fake_gpu(monkeypatch):
  """A GPU as "auto" sees it; the Mosaic route records its backend and runs the XLA reference."""
  calls = []

  def run_mosaic(backend, x, dy, w, slots, scalars, update_fn, *, write_back=None, config=None,
                 **kw):
    calls.append(backend)
    return pallas_kernels.fused_dw_update_reference(x, dy, w, slots, scalars, update_fn, **kw,
                                                    **(write_back or {}))

  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  monkeypatch.setattr(_fused, "_run_mosaic", run_mosaic)
  return calls


def _use(monkeypatch, table):
  monkeypatch.setattr(_auto, "table", lambda: table)


def test_auto_follows_the_table_and_flips_with_it(fake_gpu, monkeypatch):
  """The same call goes to the kernel or to XLA as the table says (T = all tokens: 2 x 512)."""
  kx, kd, kw = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (2, 512, 256), F32).astype(BF16)
  dy = jax.random.normal(kd, (2, 512, 128), F32).astype(BF16)
  w = (0.02 * jax.random.normal(kw, (256, 128), F32)).astype(BF16)
  opt = forge_jax.adamw(1e-3, weight_decay=0.1)
  want, _ = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="xla")
  for choice, ran in (("mosaic", [_fused._AUTO_MOSAIC]), ("xla", [])):
    _use(monkeypatch, _table((1024, 256, 128, "bfloat16", "bfloat16", False, choice)))
    fake_gpu.clear()
    got, _ = forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, backend="auto")
    assert fake_gpu == ran, choice
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))


def test_auto_int8_states_follow_the_table_and_the_rule(fake_gpu, monkeypatch):
  """int8 states: what the table picks, and off the table the rule (the kernel), with XLA (not
  the slower Triton kernel) as the fallback where the kernel cannot run."""
  opt = forge_jax.adamw(1e-3, precision=forge_jax.Precision(state_dtype="int8", min_quantized_size=0))
  w = jnp.zeros((256, 128), F32)
  state = opt.init(w)
  assert _auto.state_format(opt.rule.slots_of(state)) == "int8"
  x, dy = jnp.ones((1024, 256), BF16), jnp.ones((1024, 128), BF16)
  _use(monkeypatch, _table((1024, 256, 128, "float32", "int8", False, "mosaic")))
  forge_jax.fused_linear_update(x, dy, w, state, opt, backend="auto")
  assert fake_gpu == [_fused._AUTO_MOSAIC_OR_XLA]
  fake_gpu.clear()
  _use(monkeypatch, _table((1024, 256, 128, "float32", "int8", False, "xla")))
  forge_jax.fused_linear_update(x, dy, w, state, opt, backend="auto")
  assert fake_gpu == []  # the table: XLA
  _use(monkeypatch, _table((1024, 256, 128, "float32", "float32", False, "xla")))  # no int8 entry
  forge_jax.fused_linear_update(x, dy, w, state, opt, backend="auto")
  assert fake_gpu == [_fused._AUTO_MOSAIC_OR_XLA]  # the rule: the kernel


def test_resolve_backend_outside_the_table_keeps_the_rule(monkeypatch):
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  _use(monkeypatch, _table((1024, 4096, 4096, "bfloat16", "bfloat16", False, "xla"),
                           (1024, 4096, 4096, "bfloat16", "int8", False, "mosaic")))
  resolve = lambda case, **kw: _fused._resolve_backend("auto", case=case, **kw)
  assert resolve((1024, 4096, 4096, "bfloat16", "bfloat16")) == "xla"
  assert resolve((1024, 4096, 4096, "bfloat16", "int8"), quantized_slots=True) == _fused._AUTO_MOSAIC_OR_XLA
  # Far from every measured shape, or tokens, or another storage: the rule.
  assert resolve((1024, 4096, 151936, "bfloat16", "bfloat16")) == _fused._AUTO_MOSAIC
  assert resolve((64, 4096, 4096, "bfloat16", "bfloat16")) == _fused._AUTO_MOSAIC
  assert resolve((1024, 4096, 4096, "float32", "float32")) == _fused._AUTO_MOSAIC
  # Stochastically rounded weights: the kernel, XLA (not the Triton kernel) where it cannot run.
  assert (resolve((1024, 4096, 4096, "bfloat16", "bfloat16"), stochastic_weights=True)
          == _fused._AUTO_MOSAIC_OR_XLA)
  assert resolve(None, quantized_slots=True) == _fused._AUTO_MOSAIC_OR_XLA
  monkeypatch.setattr(_fused, "_platform", lambda: "cpu")
  assert resolve((1024, 4096, 4096, "bfloat16", "int8"), quantized_slots=True) == "xla"


def test_lookup_buckets_tokens_and_shapes():
  key = ("bfloat16", "bfloat16", False)
  table = _table((512, 4096, 4096, *key, "xla"), (4096, 4096, 4096, *key, "mosaic"),
                 (4096, 1024, 3072, *key, "xla"))
  choose = lambda t, k, n: table.choose(t, k, n, *key)
  assert choose(1000, 4096, 4096) == "xla"  # log2 1000 = 9.97: nearer 512 than 4096
  assert choose(2900, 4096, 4096) == "mosaic"  # 11.50: nearer 4096
  assert choose(8192, 4096, 4096) == "mosaic"  # one octave above the largest: still its bucket
  assert choose(256, 4096, 4096) == "xla"  # one octave below the smallest
  assert choose(200, 4096, 4096) is None and choose(9000, 4096, 4096) is None
  assert choose(4096, 4096, 3584) == "mosaic"  # nearest shape: 4096x4096
  assert choose(4096, 1024, 2048) == "xla"  # nearest shape: 1024x3072
  assert choose(4096, 4096, 14336) is None  # 1.8 octaves from 4096x4096
  assert table.choose(4096, 4096, 4096, "bfloat16", "int8", False) is None
  assert table.lookup(2900, 4096, 4000, *key).t == 4096


def test_bad_tables_are_refused(tmp_path):
  with pytest.raises(ValueError, match="choice='kernel'"):
    _table((512, 64, 64, "float32", "float32", False, "kernel"))
  with pytest.raises(ValueError, match="states='fp8'"):
    _table((512, 64, 64, "float32", "fp8", False, "xla"))
  path = tmp_path / "t.json"
  path.write_text("{")
  with pytest.raises(ValueError, match="cannot read the auto table"):
    _auto.read_table(path)
  path.write_text(json.dumps({"entries": []}))
  with pytest.raises(ValueError, match="'provenance' and 'entries'"):
    _auto.read_table(path)


def test_state_format():
  f32, bf16 = jnp.zeros((4, 64), F32), jnp.zeros((4, 64), BF16)
  assert _auto.state_format((f32, f32)) == "float32"
  assert _auto.state_format((bf16,)) == "bfloat16"
  assert _auto.state_format((f32, bf16)) == "mixed"
  assert _auto.state_format(()) == "none"
  opt = forge_jax.adamw(1e-3, precision=forge_jax.Precision(state_dtype="int8", min_quantized_size=0))
  assert _auto.state_format(opt.rule.slots_of(opt.init(f32))) == "int8"


SHIPPED_TABLES = [(_auto.TABLE_PATH, "NVIDIA H200")] + [
    (path, {"H100": "NVIDIA H100 80GB HBM3"}[marker]) for marker, path in _auto.DEVICE_TABLES]


@pytest.mark.parametrize("path, device", SHIPPED_TABLES, ids=lambda v: getattr(v, "name", v))
def test_committed_table_covers_every_preset_layer(path, device):
  """Each shipped table parses, was measured on the GPU it is read on, and has an entry near every
  block projection of the presets at every measured T and storage configuration; unmeasured, it
  is the rule without a table."""
  table = _auto.read_table(path)
  assert {"measured", "device", "date", "jax", "commit"} <= set(table.provenance)
  assert _auto.table_path(device) == path
  if table.provenance["measured"]:
    assert table.provenance["device"] == device
  shapes = bench_fused_dw.preset_shapes()
  assert len(shapes) == 27
  for t in bench_fused_dw.AUTO_TOKENS:
    for config, (w_dtype, _) in bench_fused_dw.AUTO_CONFIGS.items():
      for k, n in shapes:
        key = bench_fused_dw.auto_case_key(config, w_dtype, t, k, n)
        choice = table.choose(**key)
        assert choice in _auto.CHOICES, (config, t, k, n)
        if not table.provenance["measured"]:
          assert choice == "mosaic"
  if table.provenance["measured"]:  # each entry the faster of its two times (the kernel on a tie)
    for e in table.entries:
      assert e.choice == ("mosaic" if e.kernel_ms <= e.xla_ms else "xla"), e


def test_auto_reads_the_table_of_its_gpu_or_the_one_it_is_given(monkeypatch, tmp_path):
  """An H100 of any make reads the H100 table, other GPUs the H200's; FORGE_JAX_AUTO_TABLE wins
  over both, and a table it names that cannot be read says so and how to go back."""
  monkeypatch.delenv(_auto.TABLE_ENV, raising=False)
  h100 = dict(_auto.DEVICE_TABLES)["H100"]
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"):
    assert _auto.table_path(kind) == h100
  for kind in ("NVIDIA H200", "NVIDIA GH200 480GB", ""):
    assert _auto.table_path(kind) == _auto.TABLE_PATH
  mine = tmp_path / "mine.json"
  mine.write_text(_table((1024, 64, 64, "float32", "float32", False, "xla"),
                         measured=True).dumps())
  monkeypatch.setenv(_auto.TABLE_ENV, str(mine))
  assert _auto.table_path("NVIDIA H100 80GB HBM3") == mine
  assert _auto.table().choose(1024, 64, 64, "float32", "float32", sr=False) == "xla"
  monkeypatch.setenv(_auto.TABLE_ENV, str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match=r"missing\.json.*FORGE_JAX_AUTO_TABLE.*unset it"):
    _auto.table()


def test_shape_classes_lie_within_the_lookup_radius():
  classes = bench_fused_dw.shape_classes(bench_fused_dw.preset_shapes(), first=[(4096, 4096)])
  assert classes[0][0] == (4096, 4096)
  assert sorted(m for _, ms in classes for m in ms) == sorted(bench_fused_dw.preset_shapes())
  for rep, members in classes:
    assert all(bench_fused_dw._distance(rep, m) <= _auto.SHAPE_RADIUS for m in members), rep


def test_auto_table_script_dry_run(tmp_path):
  """The script end to end on CPU (interpreted kernel, one tiny case): a table the package reads."""
  out = tmp_path / "run"
  assert bench_fused_dw.main(["--auto-table", "--dry-run", "--configs", "bf16", "--shapes", "64x128",
                              "--tokens", "32", "--commit", "abc123", "--out", str(out)]) == 0
  table = _auto.read_table(out / "auto_table.json")
  assert table.provenance["commit"] == "abc123" and table.provenance["measured"] is False
  assert table.provenance["device"] and table.provenance["jax"] == jax.__version__
  (entry,) = table.entries
  assert (entry.t, entry.k, entry.n, entry.weight, entry.states, entry.sr) == (32, 64, 128, "bfloat16", "bfloat16", False)
  assert entry.kernel_ms > 0 and entry.xla_ms > 0
  assert entry.choice == ("mosaic" if entry.kernel_ms <= entry.xla_ms else "xla")
  assert "| 32 | 64x128" in (out / "auto_table.md").read_text()
  assert sorted(p.name for p in out.iterdir()) == ["auto_table.json", "auto_table.md", "auto_table_rows.json"]


def test_auto_table_script_measures_each_shape_it_is_given(tmp_path):
  """--shapes: every shape measured, even two of one class (the presets are measured by class)."""
  assert bench_fused_dw._class_key(64, 128) == bench_fused_dw._class_key(64, 96)
  assert bench_fused_dw.main(["--auto-table", "--dry-run", "--configs", "bf16", "--shapes", "64x128",
                              "64x96", "--tokens", "32", "--out", str(tmp_path)]) == 0
  table = _auto.read_table(tmp_path / "auto_table.json")
  assert sorted((e.k, e.n) for e in table.entries) == [(64, 96), (64, 128)]


def test_auto_table_script_merges_an_earlier_run(tmp_path):
  """--merge: the earlier run's measured cases are kept as measured (not timed again), the
  rest measured; a run on another device or jax is refused."""
  base = ["--auto-table", "--dry-run", "--configs", "bf16", "--shapes", "64x128", "--commit", "abc123"]
  assert bench_fused_dw.main([*base, "--tokens", "32", "--out", str(tmp_path / "a")]) == 0
  first = json.loads((tmp_path / "a" / "auto_table_rows.json").read_text())
  assert bench_fused_dw.main([*base, "--tokens", "32", "64", "--out", str(tmp_path / "b"),
                              "--merge", str(tmp_path / "a" / "auto_table_rows.json")]) == 0
  rows = json.loads((tmp_path / "b" / "auto_table_rows.json").read_text())["rows"]
  assert [r["t"] for r in rows] == [32, 64]
  assert rows[0]["kernel_row"] == first["rows"][0]["kernel_row"]
  assert rows[0]["measured_in"]["commit"] == "abc123"
  assert "measured_in" not in rows[1] and rows[1]["kernel_row"]["ms"] > 0
  table = _auto.read_table(tmp_path / "b" / "auto_table.json")
  assert [e.t for e in table.entries] == [32, 64] and table.provenance["merged"][0]["cases"] == 1
  assert "1 cases measured earlier (commit abc123" in (tmp_path / "b" / "auto_table.md").read_text()
  first["info"]["jax"] = "0.0.1"
  (tmp_path / "other.json").write_text(json.dumps(first))
  with pytest.raises(SystemExit, match="jax '0.0.1'"):
    bench_fused_dw.main([*base, "--tokens", "32", "--out", str(tmp_path / "c"),
                         "--merge", str(tmp_path / "other.json")])


def test_auto_table_script_remeasures_the_configurations_named(tmp_path):
  """--merge with --remeasure: the named configurations' earlier rows are dropped and measured
  again, the others kept; without --merge it is refused."""
  base = ["--auto-table", "--dry-run", "--configs", "bf16", "bf16_int8", "--shapes", "64x128",
          "--tokens", "32"]
  assert bench_fused_dw.main([*base, "--commit", "abc123", "--out", str(tmp_path / "a")]) == 0
  earlier = str(tmp_path / "a" / "auto_table_rows.json")
  assert bench_fused_dw.main([*base, "--commit", "def456", "--out", str(tmp_path / "b"),
                              "--merge", earlier, "--remeasure", "bf16_int8"]) == 0
  rows = {r["config"]: r for r in json.loads((tmp_path / "b" / "auto_table_rows.json").read_text())["rows"]}
  assert rows["bf16"]["measured_in"]["commit"] == "abc123"
  assert "measured_in" not in rows["bf16_int8"] and rows["bf16_int8"]["kernel_row"]["ms"] > 0
  with pytest.raises(SystemExit, match="pass --merge"):
    bench_fused_dw.main([*base, "--out", str(tmp_path / "c"), "--remeasure", "bf16_int8"])


def test_auto_table_script_time_limit_writes_what_it_has(tmp_path):
  assert bench_fused_dw.main(["--auto-table", "--dry-run", "--time-limit", "0", "--out", str(tmp_path)]) == 0
  assert _auto.read_table(tmp_path / "auto_table.json").entries == ()
  rows = json.loads((tmp_path / "auto_table_rows.json").read_text())["rows"]
  assert rows and all(r["status"] == "skipped: time limit" for r in rows)


def test_auto_table_plan_fits_one_gpu_call():
  """The default plan, by the script's own estimate (H200 compile times), fits a 9-minute call."""
  classes = bench_fused_dw.shape_classes(bench_fused_dw.preset_shapes())
  plan = bench_fused_dw.auto_plan(classes, bench_fused_dw.AUTO_TOKENS, list(bench_fused_dw.AUTO_CONFIGS))
  assert len(plan) == len(classes) * 4 * 6
  assert bench_fused_dw.auto_estimate_s(plan, "mosaic", workers=8) + 30 <= 9 * 60


def test_the_table_speaks_for_hopper_gpus_only(monkeypatch):
  """On a GPU the Mosaic kernel cannot run on, "auto" keeps the rule whatever the table says."""
  from pallas_kernels.mosaic import config as mosaic_config

  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  _use(monkeypatch, _table((1024, 4096, 4096, "bfloat16", "bfloat16", False, "xla")))
  case = (1024, 4096, 4096, "bfloat16", "bfloat16")
  assert _fused._resolve_backend("auto", case=case) == "xla"
  monkeypatch.setattr(mosaic_config, "device_problem", lambda: "needs a Hopper GPU (sm_90, wgmma); A100 is sm_8.0")
  assert _fused._resolve_backend("auto", case=case) == _fused._AUTO_MOSAIC


def _hlo(compiled) -> str:
  """The compiled program without its source locations (the callers' files differ)."""
  blocks = compiled.as_text().split("\n\n")
  text = "\n\n".join(b for b in blocks if not b.lstrip().startswith(
      ("FileNames", "FunctionNames", "FileLocations", "StackFrames")))
  return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_the_timed_program_is_one_layer_update_per_call_in_place():
  """What --auto-table times per call is the update a model step runs per layer. Its first H200
  run (2026-12-02) chained its calls in one jit without the Dense backward's barrier: XLA fused
  one call's update into the next (the intermediate weight and int8 codes never written, their
  arithmetic recomputed) and timed int8 states at 1.54 ms where bench_lowp timed 0.56."""
  t, k, n, calls = 32, 64, 256, 2
  compile_, _, init, update, result = bench_fused_dw.auto_runner(t, k, n, "bf16_int8", "xla", calls)
  hlo = _hlo(compile_())
  # One GEMM, in a loop of `calls` (a static trip count: no host round trip per call).
  assert len(re.findall(r" dot\(", hlo)) == 1
  assert len(re.findall(r" while\(", hlo)) == 1 and f'"known_trip_count":{{"n":"{calls}"}}' in hlo
  # Every carry leaf (weight, count, int8 codes and scales, grad norm, x, dy) donated, updated in place.
  leaves = len(jax.tree.leaves(jax.eval_shape(init, *bench_fused_dw.make_inputs(t, k, n))))
  aliases = re.search(r"input_output_alias=\{ (.*?) \}, ", hlo).group(1)
  assert aliases == ", ".join(f"{{{i}}}: ({i}, {{}}, may-alias)" for i in range(leaves))
  # Run: `calls` updates, each from the last one's weight and state, the grad norm live.
  x, dy, w0 = bench_fused_dw.make_inputs(t, k, n)
  carry = update.run(init(x, dy, w0))
  opt = bench_fused_dw._auto_optimizer("bf16_int8")
  w, state = jnp.asarray(w0, BF16), opt.init(jnp.asarray(w0, BF16))
  sq_sum = 0.0
  for _ in range(calls):
    w, state, sq = forge_jax.fused_linear_update(x, dy, w, state, opt, "xla", return_grad_sq_norm=True,
                                                 stream=_timing.LAYER_STREAM)
    sq_sum += float(sq)
  assert int(carry[1].count) == calls and float(carry[2]) == pytest.approx(sq_sum, rel=1e-5)
  got_w, got_slots = result(carry)
  np.testing.assert_allclose(np.asarray(got_w, F32), np.asarray(w, F32), rtol=0, atol=2.0**-9)
  for got, want in zip(got_slots, opt.rule.slots_of(state)):
    np.testing.assert_allclose(got, _lowp.decode_slot(want, F32), rtol=1e-6, atol=0)


@pytest.mark.parametrize("lowp, auto", [("bf16_rtn_int8", "bf16_int8"), ("fp32", "fp32"),
                                        ("bf16_sr_bf16", "bf16_sr")])
def test_bench_lowp_and_the_auto_table_time_the_same_program(lowp, auto):
  """One timing function for both harnesses: the compiled program of a case is the same text."""
  assert bench_fused_dw.LOWP_CONFIGS[auto] == lowp
  t, k, n = 32, 64, 256
  x, dy, w0 = bench_fused_dw.make_inputs(t, k, n)
  _, update, _ = bench_lowp.fused_runner(x, dy, w0, lowp, "xla", calls=3)
  mine = _hlo(update.run.lower(update.carry_shapes(t, k, n)).compile())
  assert mine == _hlo(bench_fused_dw.auto_runner(t, k, n, auto, "xla", 3)[0]())


def test_auto_and_lowp_config_names_are_the_same_storage():
  for auto, lowp in bench_fused_dw.LOWP_CONFIGS.items():
    w_dtype, fields = bench_fused_dw.AUTO_CONFIGS[auto]
    assert bench_lowp.CONFIGS[lowp] == (w_dtype, forge_jax.Precision(**fields)), auto
  assert set(bench_fused_dw.LOWP_CONFIGS) == set(bench_fused_dw.AUTO_CONFIGS)


def test_layer_update_refuses_no_calls():
  with pytest.raises(ValueError, match="calls=0 must be >= 1"):
    _timing.layer_update(bench_fused_dw._auto_optimizer("bf16"), "xla", BF16, calls=0)


def test_compare_lowp_puts_both_programs_side_by_side(tmp_path):
  rows = {"rows": [{"t": 1024, "k": 4096, "n": 1024, "config": "bf16", "kernel_row": {"ms": 0.03},
                    "xla_row": {"ms": 0.06}},
                   {"t": 1024, "k": 4096, "n": 4096, "config": "bf16", "status": "skipped: time limit"}]}
  lowp = {"rows": [{"shape": "1024x4096x1024", "config": "bf16_rtn_bf16", "impl": "mosaic", "ms": 0.03},
                   {"shape": "1024x4096x1024", "config": "bf16_rtn_bf16", "impl": "xla", "ms": 0.05}]}
  (tmp_path / "auto_table_rows.json").write_text(json.dumps(rows))
  (tmp_path / "lowp.json").write_text(json.dumps(lowp))
  assert bench_fused_dw.main(["--compare-lowp", str(tmp_path / "lowp.json"), "--out", str(tmp_path)]) == 0
  text = (tmp_path / "auto_vs_lowp.md").read_text()
  assert "| 1024x4096x1024 | bf16_rtn_bf16 | mosaic | 0.0300 | 0.0300 | 1.00 |" in text
  assert "| 1024x4096x1024 | bf16_rtn_bf16 | xla | 0.0600 | 0.0500 | 1.20 |" in text


def test_layer_update_refuses_to_time_a_mosaic_fallback():
  """A case the Mosaic kernel cannot take would run its fallback under the kernel's name."""
  update = _timing.layer_update(bench_fused_dw._auto_optimizer("bf16_sr_int8"), "mosaic_interpret", BF16,
                                calls=1)
  with pytest.raises(ValueError, match="backend='mosaic_interpret' cannot run this layer .*K=40"):
    update.run.lower(update.carry_shapes(64, 40, 256))


def test_regret_prices_the_tables_pick_on_other_shapes(tmp_path):
  """--regret: each measured case's time under the table's pick (its nearest entry; off the
  table, the kernel) over the faster backend's."""
  table = _table((1024, 4096, 1024, "bfloat16", "bfloat16", False, "xla"),
                 (1024, 4096, 4096, "bfloat16", "bfloat16", False, "mosaic"), measured=True)
  (tmp_path / "table.json").write_text(table.dumps())

  def row(t, k, n, kernel_ms, xla_ms):
    return dict(t=t, k=k, n=n, weight="bfloat16", states="bfloat16", sr=False, config="bf16",
                kernel_row={"ms": kernel_ms}, xla_row={"ms": xla_ms})

  rows = [row(1024, 5120, 1024, 0.02, 0.03),  # nearest 4096x1024: XLA, 1.5x the kernel
          row(1024, 4096, 12288, 0.40, 0.42),  # 2.2 octaves from every entry: off the table
          row(1024, 4096, 4096, 0.11, 0.10),  # the kernel, 1.1x XLA
          dict(row(1024, 4096, 4096, 0.1, 0.1), xla_row={"status": "error"})]  # no time: left out
  (tmp_path / "rows.json").write_text(json.dumps({"info": {}, "rows": rows}))
  text, cases = bench_fused_dw.auto_regret(tmp_path / "table.json", [tmp_path / "rows.json"])
  assert [(c["k"], c["n"], c["pick"], round(c["regret"], 3)) for c in cases] == [
      (5120, 1024, "xla", 1.5), (4096, 4096, "mosaic", 1.1), (4096, 12288, "mosaic", 1.0)]
  assert cases[0]["entry"] == "1024x4096x1024" and cases[2]["entry"] is None
  assert "3 cases; 2 more than 1.03x the faster backend; worst 1.500x." in text
  assert bench_fused_dw.main(["--regret", str(tmp_path / "table.json"), str(tmp_path / "rows.json"),
                              "--out", str(tmp_path / "out")]) == 0
  assert (tmp_path / "out" / "auto_regret.md").read_text() == text


def test_auto_table_script_members_measures_the_other_shapes_and_writes_the_regret(tmp_path):
  """--members: each class's shapes but its representative are measured, and auto_regret.md
  reads them through the table "auto" would read here; the presets' members are the shapes
  the table serves through a nearest entry."""
  members = bench_fused_dw.class_members(bench_fused_dw.preset_shapes(),
                                         bench_fused_dw.block_shapes("llama-3.1-8b"))
  reps = [rep for rep, _ in bench_fused_dw.shape_classes(bench_fused_dw.preset_shapes())]
  assert members and not set(members) & set(reps)
  assert sorted(members + reps) == sorted(bench_fused_dw.preset_shapes())
  assert bench_fused_dw.main(["--auto-table", "--dry-run", "--members", "--configs", "bf16",
                              "--shapes", "64x128", "64x96", "--tokens", "32", "--out", str(tmp_path)]) == 0
  (member,) = bench_fused_dw.class_members([(64, 128), (64, 96)])  # the other represents the class
  rows = json.loads((tmp_path / "auto_table_rows.json").read_text())["rows"]
  assert [(r["k"], r["n"]) for r in rows] == [member]
  regret = (tmp_path / "auto_regret.md").read_text()
  assert str(_auto.table_path(jax.devices()[0].device_kind)) in regret
  assert f"| 32 | {member[0]}x{member[1]} | bf16 |" in regret and "1 cases;" in regret
  assert not (tmp_path / "auto_table_with_members.json").exists()  # the table read is another device's
  with pytest.raises(SystemExit, match="every class has one shape"):
    bench_fused_dw.main(["--auto-table", "--dry-run", "--members", "--configs", "bf16",
                         "--shapes", "64x128", "--tokens", "32", "--out", str(tmp_path / "b")])


def test_union_joins_a_members_run_to_its_table_so_auto_reads_those_cases_exactly(tmp_path):
  """--union: a --members run's measured cases join the table (a later table wins on the same
  case), so "auto" reads them exactly; tables of another device are refused."""
  base = _table((1024, 4096, 1024, "bfloat16", "bfloat16", False, "mosaic"),
                (1024, 4096, 4096, "bfloat16", "bfloat16", False, "mosaic"),
                device="H", jax="j", date="d1", commit="c1", measured=True)
  members = _table((1024, 5120, 1024, "bfloat16", "bfloat16", False, "xla"),
                   (1024, 4096, 4096, "bfloat16", "bfloat16", False, "xla"),
                   device="H", jax="j", date="d2", commit="c2", measured=True)
  for name, table in (("base", base), ("members", members)):
    (tmp_path / f"{name}.json").write_text(table.dumps())
  assert bench_fused_dw.main(["--union", str(tmp_path / "base.json"), str(tmp_path / "members.json"),
                              "--out", str(tmp_path / "out")]) == 0
  union = _auto.read_table(tmp_path / "out" / "auto_table.json")
  assert len(union.entries) == 3 and union.provenance["date"] == "d1"
  assert union.provenance["added"] == [{"date": "d2", "commit": "c2", "command": None,
                                        "cases_measured": None}]
  assert union.choose(1024, 5120, 1024, "bfloat16", "bfloat16", False) == "xla"  # was 4096x1024's
  assert union.choose(1024, 4096, 4096, "bfloat16", "bfloat16", False) == "xla"  # the later wins
  assert union.choose(1024, 4096, 1024, "bfloat16", "bfloat16", False) == "mosaic"
  later = _table((1024, 4096, 1024, "bfloat16", "bfloat16", False, "xla"),
                 device="H", jax="j", date="d3", commit="c3", measured=True)
  (tmp_path / "later.json").write_text(later.dumps())
  again = bench_fused_dw.union_table([tmp_path / "out" / "auto_table.json", tmp_path / "later.json"])
  assert [a["date"] for a in again.provenance["added"]] == ["d2", "d3"]  # the union's own kept
  assert again.choose(1024, 4096, 1024, "bfloat16", "bfloat16", False) == "xla"
  other = _table((1024, 64, 64, "bfloat16", "bfloat16", False, "xla"), device="G", jax="j")
  (tmp_path / "other.json").write_text(other.dumps())
  with pytest.raises(ValueError, match="device 'G'"):
    bench_fused_dw.union_table([tmp_path / "base.json", tmp_path / "other.json"])
  with pytest.raises(SystemExit):  # the command line: a usage error
    bench_fused_dw.main(["--union", str(tmp_path / "base.json"), str(tmp_path / "other.json"),
                         "--out", str(tmp_path / "bad")])
  assert not (tmp_path / "bad" / "auto_table.json").exists()


def test_layer_update_cycles_its_calls_through_state_sets():
  """--cold-states: call j updates state set j % sets (each set in place), the weight shared."""
  t, k, n, calls, sets = 32, 64, 256, 4, 2
  opt = bench_fused_dw._auto_optimizer("bf16_int8")
  update = _timing.layer_update(opt, "xla", BF16, calls=calls, state_sets=sets)
  x, dy, w0 = bench_fused_dw.make_inputs(t, k, n)
  carry = update.run(update.init(x, dy, w0))
  w, states, sq_sum = jnp.asarray(w0, BF16), [opt.init(jnp.asarray(w0, BF16))] * sets, 0.0
  for j in range(calls):
    w, states[j % sets], sq = forge_jax.fused_linear_update(
        x, dy, w, states[j % sets], opt, "xla", return_grad_sq_norm=True, stream=_timing.LAYER_STREAM)
    sq_sum += float(sq)
  assert [int(s.count) for s in carry[1]] == [calls // sets] * sets
  assert float(carry[2]) == pytest.approx(sq_sum, rel=1e-5)
  got_w, got_slots = update.result(carry)
  np.testing.assert_allclose(np.asarray(got_w, F32), np.asarray(w, F32), rtol=0, atol=2.0**-9)
  for got, want in zip(got_slots, opt.rule.slots_of(states[0])):
    np.testing.assert_allclose(got, _lowp.decode_slot(want, F32), rtol=1e-6, atol=0)
  with pytest.raises(ValueError, match="state_sets=3 must be a divisor of calls=4"):
    _timing.layer_update(opt, "xla", BF16, calls=4, state_sets=3)


def test_state_sets_reach_the_cold_bytes_in_powers_of_two():
  assert _timing.state_sets_for(300_000_000) == 1
  assert _timing.state_sets_for(67_000_000) == 4  # 4096x4096, bf16 states
  assert _timing.state_sets_for(8_900_000) == 16  # 4096x1024, int8 states: at most one per call
  assert _timing.state_sets_for(8_900_000, calls=4) == 4


def test_bench_lowp_cold_states_rows_record_their_sets():
  x_rows = bench_lowp.bench_shape(16, 64, 256, ["bf16_rtn_int8"], ["xla"], interpret=False,
                                  timing=dict(warmup=0, iters=1, repeats=1), calls=4, cold_states=True)
  (row,) = x_rows
  assert row["status"] == "ok" and row["state_sets"] == 4 and row["calls_per_dispatch"] == 4


def test_layer_update_with_dx_writes_the_old_weights_product_then_updates():
  t, k, n, calls = 32, 64, 256, 2
  opt = bench_fused_dw._auto_optimizer("bf16")
  x, dy, w0 = bench_fused_dw.make_inputs(t, k, n)
  plain = _timing.layer_update(opt, "xla", BF16, calls=calls)
  with_dx = _timing.layer_update(opt, "xla", BF16, calls=calls, with_dx=True)
  before = plain.run(plain.init(x, dy, w0))  # the weight the last call reads
  w_prev = _timing.layer_update(opt, "xla", BF16, calls=calls - 1)
  w_prev = w_prev.run(w_prev.init(x, dy, w0))[0]
  carry = with_dx.run(with_dx.init(x, dy, w0))
  np.testing.assert_array_equal(np.asarray(carry[0], F32), np.asarray(before[0], F32))
  want_dx = jnp.dot(dy, w_prev.astype(dy.dtype).T).astype(x.dtype)
  np.testing.assert_allclose(np.asarray(carry[5], F32), np.asarray(want_dx, F32), rtol=2e-2, atol=1e-3)
  init, product = _timing.dx_product(BF16, calls)
  out = product.run(init(x, dy, w0))
  np.testing.assert_allclose(np.asarray(out[1], F32),
                             np.asarray(jnp.dot(dy, jnp.asarray(w0, BF16).T).astype(x.dtype), F32),
                             rtol=2e-2, atol=1e-3)


def test_bench_lowp_with_dx_times_the_product_beside_the_backward():
  rows = bench_lowp.bench_shape(16, 64, 256, ["bf16_rtn_bf16", "bf16_sr_int8"], ["xla"],
                                interpret=False, timing=dict(warmup=0, iters=1, repeats=1), calls=2,
                                with_dx=True)
  assert [(r["impl"], r["config"], r["status"]) for r in rows] == [
      ("dx", "bf16_rtn_bf16", "ok"), ("xla", "bf16_rtn_bf16", "ok"),
      ("dx", "bf16_sr_int8", "ok"), ("xla", "bf16_sr_int8", "ok")]
  assert rows[0]["ms"] == rows[2]["ms"]  # one bf16 weight: the product timed once
  assert "With dX (--with-dx)" in bench_lowp.markdown(
      {"command": "c", "date": "d", "device": "cpu", "jax": "j", "jaxlib": "j", "triton": None},
      rows, ["dx", "xla"])
