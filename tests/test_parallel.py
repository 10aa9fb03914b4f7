"""Tensor- and sequence-parallel FORGE on 8 CPU devices equals the single-device run.

All multi-device work runs in one subprocess (tests/_parallel_cases.py, which needs
``--xla_force_host_platform_device_count=8`` before jax starts), compiling each configuration
once; the tests below read its records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import forge_jax
import models
from tests._xla_flags import fast_cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-3


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  out = tmp_path_factory.mktemp("parallel") / "records.json"
  # jax's persistent compilation cache, fresh for the process: its runs build programs that an
  # earlier run compiled (each build's jit(model.init) is a new function), loaded instead of
  # compiled again: 45 to 48 s instead of 57 to 60 s for the process on one core, same records.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=fast_cpu_flags("--xla_force_host_platform_device_count=8"),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("parallel_jax_cache")),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  proc = subprocess.run([sys.executable, "-m", "tests._parallel_cases", str(out)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return json.loads(out.read_text())


def _of(records, kind, **match):
  found = [r for r in records if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]
  assert found, (kind, match)
  return found


def _is_state(key: str) -> bool:
  return key.startswith("[1]") or key.startswith("[2]")


def _check_diffs(diffs: dict, weight_atol: float, state_rtol: float):
  """Weights within ``weight_atol``; optimizer states within ``state_rtol`` of their largest
  entry (a count or norm exactly)."""
  bad = []
  for key, (diff, scale) in diffs.items():
    tol = state_rtol * scale if _is_state(key) else weight_atol
    if diff > tol:
      bad.append(f"{key}: {diff:.3g} > {tol:.3g} (max |ref| {scale:.3g})")
  assert not bad, "\n".join(bad)


def test_tensor_parallel_equals_one_device(records):
  """Llama (untied, vocabulary-parallel head) and Qwen3 (tied, q/k norms), GQA, scanned (remat
  none and full) and unrolled, P in {1, 2, 4, 8}, sequence parallelism on and off: after 3
  AdamW steps the losses, grad norms, every weight and every optimizer state equal the
  single-device FORGE run. Tolerances: float32 rounding of reassociated sums, as Adam passes
  it on in 3 steps (its normalization turns a rounding-level change of a near-zero gradient
  into up to a few 1e-3 of lr); a wrong slice or a missing reduction is off by O(lr)."""
  runs = _of(records, "model")
  seen = {(r["name"], r["p"], r["sp"]) for r in runs}
  assert {p for _, p, _ in seen} == {1, 2, 4, 8} and {sp for *_, sp in seen} == {True, False}
  assert {n for n, *_ in seen} == {"llama", "qwen3", "llama_unrolled"}
  assert {r["remat"] for r in runs} == {"none", "full"}
  for r in runs:
    np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=2e-6, err_msg=str(r["name"]))
    np.testing.assert_allclose(r["norms"], r["ref_norms"], rtol=2e-5, err_msg=str(r["name"]))
    _check_diffs(r["diffs"], weight_atol=2e-2 * LR, state_rtol=2e-3)


def test_tensor_parallel_equals_optax(records):
  """FORGE on 4 devices with sequence parallelism against optax (flax Dense) on one device."""
  (r,) = _of(records, "optax")
  np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=1e-5)
  # optax's Adam divides by sqrt(nu_hat) + eps in another association than the fused rule.
  _check_diffs({k: v for k, v in r["diffs"].items() if not k.startswith("[1]")},
               weight_atol=5e-2 * LR, state_rtol=5e-3)


def test_low_precision_states_and_stochastic_rounding(records):
  """bfloat16 weights with stochastic rounding and int8 states (blocks of 8 along N) on 4
  devices with sequence parallelism: the losses follow the single-device run; a weight differs
  from it by at most one bfloat16 step and a state by one int8 code step (the rounding bits
  are the same, keyed on each element's global index, so only a value that lands within
  float32 rounding of a rounding boundary can go the other way)."""
  (r,) = _of(records, "lowp")
  np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=1e-5)
  for key, (diff, scale) in r["diffs"].items():
    if key.startswith("[0]"):  # bfloat16 weights: one step is 2**-8 relative (2**-7 below)
      assert diff <= scale * 2 ** -7, (key, diff, scale)
    else:  # int8 codes (as float32: up to 127) and float32 scales
      assert diff <= scale / 100, (key, diff, scale)


def test_rounding_bits_do_not_depend_on_the_split(records):
  """A bfloat16 weight with stochastic rounding and int8 states,
  updated whole and column- or row-split over 4 devices from exact inputs: bit for bit equal.
  And a per-array clipping stabilizer (``layer_clip``) keeps the whole weight's norm."""
  for layout in ("column", "row"):
    (r,) = _of(records, "bits", layout=layout)
    assert r["equal"] and r["other_stream_differs"] and r["layer_norm_equal"], r
    assert "tensor" in r["sharded"], r


def test_no_collective_of_a_weight_state_or_gradient(records):
  """The compiled steps move activations only: every all-gather / all-reduce / reduce-scatter
  has a token-shaped operand [B, L, ...] or [B, L] or one element (squared norms, the loss, the
  element of dX the update is ordered after),
  except norm scales' gradients: [D] under sequence parallelism (each device saw part of the
  tokens), Qwen3's q/k norms' [H] (each device saw part of the heads); none has the shape of a FORGE weight or state (whole, per layer, or a device's
  slice) or of the [V, D] embedding."""
  hlos = _of(records, "hlo")
  assert {h["p"] for h in hlos} == {2, 4, 8}
  for h in hlos:
    assert h["collectives"], h
    tokens = tuple(h["tokens"])
    for op, shapes, banned in h["collectives"]:
      assert not banned, (h["name"], h["p"], op, shapes)
      for s in map(tuple, shapes):
        ok = s[:2] == tokens or int(np.prod(s)) == 1 or (len(s) == 1 and s[0] <= 64)
        assert ok, (h["name"], h["p"], h["sp"], op, shapes)


def test_checkpoint_restores_on_another_mesh(records):
  """Saved from 4 devices, restored onto 2 and onto one: the same values, in the new layout."""
  for p in (2, None):
    (r,) = _of(records, "checkpoint", p=p)
    assert r["equal"] and r["same_layout"], r


@pytest.mark.parametrize("name, match", [
    ("batch_split", r"split into 2 parts over 8 devices by the mesh axes \['data'\].*all-reduced"),
    ("data_parallel_batch", r"split over 8 devices"),  # no tensor_parallel (a flax MLP)
    ("heads", r"num_heads=12 is not divisible by the 'tensor' axis size 8"),
    ("kv_heads", r"num_kv_heads=4 is not divisible by the 'tensor' axis size 8"),
    ("quant_block", r"quantization blocks per row.*not divisible by the 'tensor' axis size 8"),
    ("no_axis", r"axis='tensor' is not an axis of the mesh"),
    ("sequence", r"a sequence of 12 tokens is not divisible by the 'tensor' axis size 8"),
])
def test_errors(records, name, match):
  import re  # pylint: disable=g-import-not-at-top
  (r,) = _of(records, "error", name=name)
  assert r["raised"] is not None and re.search(match, r["raised"], re.S), r


def test_replicated_batch_trains_without_tensor_parallel(records):
  """The data-parallel error's counterpart: the same MLP and step on a batch replicated over
  the 8 devices trains."""
  (r,) = _of(records, "data_parallel")
  assert r["replicated_loss_finite"], r


def test_no_mesh_adds_no_op():
  """Without tensor_parallel the model's step is the same program as before (no sharding
  constraint, no shard_map)."""
  cfg = models.get_config("tiny-llama", linear="forge", forge_backend="xla")
  opt = forge_jax.sgd(1e-2)
  model = models.CausalLM(cfg, optimizer=opt)
  tokens = np.zeros((1, 9), np.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])
  state = jax.eval_shape(lambda v: forge_jax.TrainState.create(model.apply, v, opt), variables)
  loss = lambda apply_fn, v, t: models.cross_entropy(apply_fn(v, t[:, :-1]), t[:, 1:])
  import functools  # pylint: disable=g-import-not-at-top
  text = str(jax.make_jaxpr(lambda s, t: forge_jax.train_step(s, t, functools.partial(loss, model.apply)))(
      state, jax.ShapeDtypeStruct(tokens.shape, np.int32)))
  assert "sharding_constraint" not in text and "shard_map" not in text


def test_tensor_parallel_config_errors():
  mesh = Mesh(np.array(jax.devices()[:1]), ("tensor",))
  tp = forge_jax.TensorParallel(mesh)
  assert tp.size == 1 and tp.kernel_spec("row", 3) == jax.sharding.PartitionSpec(None, "tensor", None)
  with pytest.raises(ValueError, match="layout='diagonal' is not one of"):
    tp.kernel_spec("diagonal")
  with pytest.raises(ValueError, match="must be a jax.sharding.Mesh"):
    forge_jax.TensorParallel("tensor")
  explicit = jax.make_mesh((1,), ("tensor",), axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(ValueError, match="need an Auto axis"):
    forge_jax.TensorParallel(explicit)
  # The kernels hash their own tile grid's element index: refused for a slice of a weight.
  opt = forge_jax.sgd(1e-2, precision=forge_jax.Precision(weight_rounding="stochastic"))
  w = np.zeros((8, 16), jax.numpy.bfloat16)
  x, dy = np.ones((4, 8), np.float32), np.ones((4, 16), np.float32)
  with pytest.raises(ValueError, match="backend='interpret'.*index in the device's slice"):
    forge_jax.fused_linear_update(x, dy, w, opt.init(w), opt, "interpret",
                                  element_offset=(0, 16, 32))
  dense = forge_jax.Dense(4, optimizer=forge_jax.sgd(1e-2), parallel="column")
  with pytest.raises(ValueError, match="go together"):
    dense.init(jax.random.key(0), np.zeros((2, 3), np.float32))


def test_bench_models_mesh_row_option():
  """``forge:mesh=1`` puts a bench_models row on a 1-device mesh (its cost against no mesh)."""
  from experiments import bench_models  # pylint: disable=g-import-not-at-top
  assert bench_models.parse_spec("forge:mesh=1") == ("forge", {"mesh": 1})
  assert bench_models.row_settings("forge_int8:mesh=8")["mesh"] == 8
  assert "mesh" not in bench_models.row_settings("forge")
  for bad in ("optax:mesh=1", "forge:mesh=0", "forge:mesh=two"):
    with pytest.raises(ValueError, match="tensor-parallel size"):
      bench_models.parse_spec(bad)
