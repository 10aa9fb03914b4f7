"""``stacked_matmul``: one layer of a stacked weight read in place by a Mosaic GPU GEMM.

On a CPU: the Mosaic GPU interpreter runs the kernel (persistent tile loop, the ping-pong
pipeline, barriers, TMA in and out) against ``x @ w_stack[l]`` in float32; the real kernel
(wgmma's transposed view of the ``w`` block included, which the interpreter cannot read: there
the block goes through registers) is lowered for cuda, inside a ``lax.scan`` over the layers.

Tolerance: both sides sum bf16 products in float32, in different orders; the kernel's output is
rounded to bf16, so the two may differ by about one bf16 ulp of the result (``rtol=2**-7`` plus
an ``atol`` of that size against the result's scale).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
from jax import lax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

import forge_jax

from pallas_kernels.mosaic.stacked_matmul import StackedMatmulConfig, stacked_matmul
from tests._lowering import lower_for_cuda
from tests._gpu import gpu_case

pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")

BF16 = jnp.bfloat16
# 64x64 tiles on one block: a 128x192 output is six tiles, three per compute warpgroup, and a
# K of 128 two steps of a two-stage ring, so the ring wraps within and across tiles.
SMALL = StackedMatmulConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                            grid_tile_width=2, num_sms=1)
M, K, N, L = 128, 128, 192, 3
# Out of range: 7 is clamped to L - 1; -1 counts from the end; -5 (-2 from the end) is clamped to 0.
LAYERS = (0, 2, 7, -1, -5)


def _operands(transpose_w: bool):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (M, K), BF16)
  w = jax.random.normal(kw, (L, N, K) if transpose_w else (L, K, N), BF16)
  return x, w


def _expected(x, w, layer, transpose_w):
  w_l = np.asarray(lax.dynamic_index_in_dim(w, layer, keepdims=False), np.float32)
  return np.asarray(x, np.float32) @ (w_l.T if transpose_w else w_l)


def _check(got, want):
  got = np.asarray(got, np.float32)
  np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


def test_default_config_picks_the_tiling_by_how_many_tiles_fill_the_gpu():
  """64x128 tiles where 128x128 ones would leave more than half of the 132 SMs idle (Llama-3.1-8B's
  k/v projections at 1024 tokens: 64 tiles); both warpgroups on 128x256 tiles where those fill
  the SMs in one wave (a 1024x4096 result: 128 tiles); 128x128 tiles taken in turns otherwise."""
  from pallas_kernels.mosaic.stacked_matmul import SHARED_TILE, default_config  # pylint: disable=g-import-not-at-top
  assert default_config(1024, 1024) == dataclasses.replace(StackedMatmulConfig(), tile_m=64)
  for m, n in ((1024, 4096), (4096, 1024), (512, 8192), (2048, 2048)):
    assert default_config(m, n) == SHARED_TILE, (m, n)
  # More than one wave (448 and 512 tiles), at most half the SMs (64), or not a multiple of 256.
  for m, n in ((1024, 14336), (4096, 4096), (512, 4096), (1024, 1152)):
    assert default_config(m, n) == StackedMatmulConfig(), (m, n)
  assert SHARED_TILE.smem_bytes() <= 224 * 1024


@pytest.mark.parametrize("transpose_w", [False, True], ids=["forward", "transposed"])
def test_matches_the_layer_it_is_given(transpose_w):
  """A static layer, then layers traced inside a ``lax.map`` (a scan), some out of range, against
  ``lax.dynamic_index_in_dim``'s choice of layer."""
  x, w = _operands(transpose_w)
  run = functools.partial(stacked_matmul, transpose_w=transpose_w, config=SMALL, interpret=True)
  y = run(x, w, 1)
  assert y.shape == (M, N) and y.dtype == BF16
  _check(y, _expected(x, w, 1, transpose_w))
  ys = jax.jit(lambda ls: lax.map(lambda l: run(x, w, l), ls))(jnp.array(LAYERS, jnp.int32))
  for layer, got in zip(LAYERS, ys):
    _check(got, _expected(x, w, layer, transpose_w))
  # Every layer's product differs from the others' (a kernel reading a wrong layer fails).
  assert not np.allclose(_expected(x, w, 0, transpose_w), _expected(x, w, 2, transpose_w), atol=1)


# Both warpgroups on one block tile: 128x64 blocks of a 128x256 output, or 128x128 ones with
# each warpgroup's 64x128 result stored 64 columns at a time.
SHARED = {"m": dataclasses.replace(SMALL, wg_split="m"),
          "m_epi": dataclasses.replace(SMALL, tile_n=128, wg_split="m", epi_n=64)}


@pytest.mark.parametrize("split", sorted(SHARED))
@pytest.mark.parametrize("transpose_w", [False, True], ids=["forward", "transposed"])
def test_warpgroups_sharing_a_tile_match_the_layer(split, transpose_w):
  """With ``wg_split`` each warpgroup computes its half of every block tile from the stages
  both share; the halves land where they belong (a swapped half or a misplaced 64-column
  store fails) for layers traced inside a scan."""
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (M, K), BF16)
  w = jax.random.normal(kw, (L, 256, K) if transpose_w else (L, K, 256), BF16)
  run = functools.partial(stacked_matmul, transpose_w=transpose_w, config=SHARED[split],
                          interpret=True)
  ys = jax.jit(lambda ls: lax.map(lambda l: run(x, w, l), ls))(jnp.array((2, 0), jnp.int32))
  for layer, got in zip((2, 0), ys):
    _check(got, _expected(x, w, layer, transpose_w))


@pytest.mark.parametrize("transpose_w", [False, True], ids=["forward", "transposed"])
def test_lowers_for_cuda_reading_the_whole_stack(transpose_w):
  """The default (H200) config lowers for cuda inside a scan over 32 layers (Mosaic GPU checks
  its shared memory while lowering); the custom call takes the stack whole, and nothing slices
  it."""
  sds = jax.ShapeDtypeStruct
  x = sds((1024, 4096), BF16)
  w = sds((32, 1024, 4096) if transpose_w else (32, 4096, 1024), BF16)

  def scanned(x, w):  # the layer is the carry's counter: the scan slices nothing itself
    def step(carry, _):
      h, l = carry
      return (h + stacked_matmul(x, w, l, transpose_w=transpose_w)[:8, :8].sum(), l + 1), None
    return lax.scan(step, (jnp.zeros((), BF16), jnp.int32(0)), length=32)[0]

  text = lower_for_cuda(scanned, x, w)
  calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  assert len(calls) == 1
  stack = "32768x4096" if transpose_w else "131072x1024"  # [L*R, C]: every layer
  assert f"(tensor<1024x4096xbf16>, tensor<{stack}xbf16>, tensor<1xi32>)" in calls[0]
  for op in ("dynamic_slice", "gather"):
    assert op not in text.replace(calls[0], ""), op


@pytest.mark.parametrize("args, kwargs, match", [
    (((M, K), jnp.float32, (L, K, N), jnp.float32), {}, "bfloat16 or both float16"),
    (((M, K), BF16, (L, K, N), jnp.float16), {}, "bfloat16 or both float16"),
    (((M, K), BF16, (L, N, K), BF16), {}, r"x.shape\[1\]=128 must equal w_stack.shape\[1\]=192"),
    (((M, K), BF16, (L, K, N), BF16), dict(transpose_w=True), r"w_stack.shape\[2\] \(transpose_w\)"),
    (((M, K), BF16, (K, N), BF16), {}, r"w_stack \[L, K, N\]"),
    (((96, K), BF16, (L, K, N), BF16), {}, "M=96, N=192, K=128 must be multiples"),
    (((M, K), BF16, (L, K, N), BF16), dict(config=StackedMatmulConfig(tile_k=32)), "multiples of 64"),
    (((M, K), BF16, (L, K, N), BF16), dict(config=StackedMatmulConfig(max_concurrent_steps=1)),
     "at least 2"),
    (((256, K), BF16, (L, K, 256), BF16),
     dict(config=StackedMatmulConfig(tile_m=256, tile_n=256, max_concurrent_steps=4)), "shared memory"),
])
def test_refuses_what_it_cannot_take(args, kwargs, match):
  x_shape, x_dtype, w_shape, w_dtype = args
  sds = jax.ShapeDtypeStruct
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(functools.partial(stacked_matmul, **kwargs), sds(x_shape, x_dtype),
                   sds(w_shape, w_dtype), sds((), jnp.int32))


@pytest.mark.parametrize("layer", [jax.ShapeDtypeStruct((), jnp.float32),
                                   jax.ShapeDtypeStruct((2,), jnp.int32)])
def test_refuses_a_layer_that_is_no_integer_scalar(layer):
  sds = jax.ShapeDtypeStruct
  with pytest.raises(ValueError, match="layer must be an integer scalar"):
    jax.eval_shape(functools.partial(stacked_matmul, config=SMALL), sds((M, K), BF16),
                   sds((L, K, N), BF16), layer)


def test_one_trace_per_shape_whatever_mesh_context_or_layer_type(monkeypatch):
  # jit keys its trace cache on the abstract mesh in context: None at the top of a trace, an
  # empty AbstractMesh inside parts of jax's scan and AD. A scanned model reached the kernel from
  # both (20 traces of 8 distinct kernels in a Llama-3.1-8B step); and a Python int layer is a
  # weakly typed int32. All of these must be one trace.
  from pallas_kernels.mosaic import stacked_matmul as sm
  traces = []
  kernel = sm._kernel
  monkeypatch.setattr(sm, "_kernel", lambda *a, **k: traces.append(1) or kernel(*a, **k))
  x, w = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _operands(False))
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    jax.make_jaxpr(lambda x, w: stacked_matmul(x, w, jnp.int32(1), config=SMALL))(x, w)
  jax.make_jaxpr(lambda x, w: stacked_matmul(x, w, 1, config=SMALL))(x, w)
  jax.make_jaxpr(lambda x, w, l: stacked_matmul(x, w, l, config=SMALL))(x, w, jnp.int32(2))
  assert len(traces) == 1
  jax.make_jaxpr(lambda x, w: stacked_matmul(x, w, 1, config=SMALL, transpose_w=True))(
      x, jax.ShapeDtypeStruct((L, N, K), BF16))
  assert len(traces) == 2


def test_bench_smoke_times_checks_and_reports_every_program_and_tiling(tmp_path):
  """Every program and direction timed and checked; ``--config`` with two tilings (one with
  both warpgroups on a 128x64 tile) gives one checked ``stacked`` row per tiling and direction,
  named by its tile, side by side."""
  from experiments import bench_stacked_matmul as bench  # pylint: disable=g-import-not-at-top
  assert bench.main(["--smoke", "--tokens", "128", "--config", "64,64,64,2", "64,64,64,2,m,64",
                     "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "bench_stacked_matmul.json").read_text())
  rows = result["rows"]
  assert {(r["impl"], r["direction"]) for r in rows} == {
      (i, d) for i in bench.IMPLS for d in bench.DIRECTIONS}
  for row in rows:
    assert row["status"] == "ok" and row["ms"] > 0 and row["sum_ok"], row
    if row["impl"] == "stacked":
      assert row["layer_ok"] and set(row["layer_rel_err"]) == {"0", "1"}, row
  stacked = [r for r in rows if r["impl"] == "stacked"]
  assert sorted((r["direction"], r["tile"]) for r in stacked) == sorted(
      (d, t) for d in bench.DIRECTIONS for t in ("64x64x64/2", "64x64x64/2/m/e64"))
  table = (tmp_path / "bench_stacked_matmul.md").read_text()
  assert table.count("| ok |") == 4 and "| 64x64x64/2/m/e64 |" in table and "FAILED" not in table
  assert result["info"]["command"].startswith("python -m experiments.bench_stacked_matmul --smoke")


def test_bench_flags_a_kernel_that_reads_the_wrong_layer(tmp_path, monkeypatch):
  """The checks fail when the kernel's results do (here: a stand-in reading layer 0 always);
  ``--profile`` adds the device-time table."""
  from experiments import bench_stacked_matmul as bench  # pylint: disable=g-import-not-at-top

  def wrong_layer(x, w_stack, layer, *, transpose_w=False, config=None, interpret=False):
    del layer, config, interpret
    return jnp.dot(x, w_stack[0].T if transpose_w else w_stack[0])

  monkeypatch.setattr(bench, "stacked_matmul", wrong_layer)
  assert bench.main(["--smoke", "--impls", "xla_scan", "stacked", "--profile",
                     "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "bench_stacked_matmul.json").read_text())["rows"]
  stacked = [r for r in rows if r["impl"] == "stacked"]
  assert len(stacked) == 2 and not any(r["layer_ok"] or r["sum_ok"] for r in stacked)
  table = (tmp_path / "bench_stacked_matmul.md").read_text()
  assert table.count("FAILED") == 2
  # --profile: every program traced (a CPU has no device plane: no kinds, but the rows exist).
  assert all(r["profile"]["calls"] == bench.PROFILE_CALLS for r in rows)
  assert table.count("| 64x128x128 | forward | xla_scan |") == 1


class _Block(nn.Module):
  opt: object
  backend: str

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(forge_jax.Dense, optimizer=self.opt, param_dtype=BF16, dtype=BF16,
                              use_bias=False, backend=self.backend)
    return x + dense(128)(jax.nn.gelu(dense(256)(x)))


class _Stack(nn.Module):
  opt: object
  backend: str

  @nn.compact
  def __call__(self, x):
    return forge_jax.ScannedStack(functools.partial(_Block, self.opt, self.backend), 2)(x)


def _train(backend, steps=2):
  opt = forge_jax.adamw(1e-2)
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), BF16)  # 128 rows: one tile_m
  model = _Stack(opt, backend)
  variables = _Stack(opt, "xla").init(jax.random.key(0), x)
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  loss_fn = lambda v, b: jnp.mean(jnp.square(model.apply(v, b["x"]).astype(jnp.float32)))
  losses = []
  for _ in range(steps):
    state, metrics = forge_jax.train_step(state, {"x": x}, loss_fn)
    losses.append(float(metrics["loss"]))
  return state, losses


def _reference_spy(calls):
  """``stacked_matmul`` as XLA computes ``x @ w[l]`` (the same bits), recording each call."""
  def run(x, w_stack, layer, *, transpose_w=False, config=None, interpret=False):
    del config
    calls.append((x.shape, w_stack.shape, transpose_w, interpret))
    w = lax.dynamic_index_in_dim(w_stack, layer, keepdims=False)
    return lax.dot_general(x, w, (((1,), (1 if transpose_w else 0,)), ((), ())))
  return run


@pytest.mark.parametrize("backend", ["mosaic", "auto"])
def test_scanned_stack_reads_its_layers_in_place_on_a_hopper_gpu(fake_gpu, monkeypatch, backend):
  """On a Hopper GPU (faked) a ScannedStack's forward and dX products are ``stacked_matmul`` calls
  on the whole stacks, forward and transposed, never a slice; with the kernel computing what XLA
  does, training is bit for bit XLA's."""
  from pallas_kernels.mosaic import stacked_matmul as sm  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(sm, "stacked_matmul", _reference_spy(calls))
  want, want_losses = _train("xla")
  assert not calls
  got, got_losses = _train(backend)
  assert {(c[0], c[1], c[2]) for c in calls} == {
      ((128, 128), (2, 128, 256), False), ((128, 256), (2, 256, 128), False),
      ((128, 128), (2, 256, 128), True), ((128, 256), (2, 128, 256), True)}
  assert got_losses == want_losses
  for a, b in zip(jax.tree.leaves((want.params, want.forge_state)),
                  jax.tree.leaves((got.params, got.forge_state))):
    np.testing.assert_array_equal(a, b)


@gpu_case("the compiled kernel (a GPU case)")
def test_scanned_stack_with_the_compiled_kernel_trains_as_xla():
  want, want_losses = _train("xla")
  got, got_losses = _train("mosaic")
  np.testing.assert_allclose(got_losses, want_losses, rtol=2e-2)
  for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # bf16 products summed in other orders: the updated weights differ by about one bf16 ulp.
    np.testing.assert_allclose(b, a, rtol=2**-6, atol=2**-6 * np.abs(a).max())


def test_stacked_dot_falls_back_to_xla_off_its_tiling(fake_gpu, monkeypatch):
  """Rows off the kernel's tiling or too many, float32 operands, other backends: XLA's slice and
  dot."""
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  from pallas_kernels.mosaic import stacked_matmul as sm  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sm, "stacked_matmul", lambda *a, **k: pytest.fail("took the kernel"))
  w = jax.random.normal(jax.random.key(0), (3, 128, 256), BF16)
  for x, backend in ((jnp.ones((2, 40, 128), BF16), "mosaic"),
                     (jnp.ones((2, 4096, 128), BF16), "mosaic"),  # over STACKED_GEMM_MAX_ROWS
                     (jnp.ones((128, 128), jnp.float32), "mosaic"),
                     (jnp.ones((128, 128), BF16), "xla"),
                     (jnp.ones((128, 128), BF16), "mosaic_interpret")):
    got = _fused.stacked_dot(x, w.astype(x.dtype), 1, backend=backend)
    np.testing.assert_array_equal(got, x @ w[1].astype(x.dtype))


def test_stack_buffers_skip_the_zero_fill_only_on_one_hopper_gpu(fake_gpu, monkeypatch):
  """A scanned stack's residual buffers come from the empty kernel on one GPU; with several
  devices (which XLA's partitioner would not shard a custom call's output over) and off a GPU,
  they are zeros."""
  del fake_gpu
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  from pallas_kernels.mosaic import uninitialized  # pylint: disable=g-import-not-at-top
  made = []
  monkeypatch.setattr(uninitialized, "uninitialized",
                      lambda shape, dtype, tag=0: made.append((shape, tag)) or jnp.ones(shape, dtype))
  assert _fused.stack_buffer((2, 3), BF16, tag=5).all() and made == [((2, 3), 5)]
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  assert not _fused.stack_buffer((2, 3), BF16).any() and len(made) == 1
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  monkeypatch.setattr(_fused, "_platform", lambda: "cpu")
  assert not _fused.stack_buffer((2, 3), BF16).any() and len(made) == 1


def test_empty_kernels_of_one_shape_are_one_kernel():
  """Stack buffers of one shape made at several call sites lower to one Mosaic kernel (its hash
  covers the module's source locations), called once per buffer with distinct tags, so XLA
  keeps them apart; another shape is another kernel."""
  from pallas_kernels.mosaic.uninitialized import uninitialized  # pylint: disable=g-import-not-at-top

  def buffers():
    a = uninitialized((128, 256), jnp.float32, 0)
    b = uninitialized((128, 256), jnp.float32, 1)
    c = uninitialized((64, 256), jnp.float32, 2)
    return a, b, c

  text = lower_for_cuda(buffers)
  assert text.count("custom_call @mosaic_gpu_v2") == 2  # (128, 256) and (64, 256)
  kernel = re.search(r"func\.func private @(\w+)\(%arg0: tensor<1xi32>.*?-> tensor<128x256xf32>", text)
  assert kernel, text[:2000]
  calls = re.findall(rf"call @{kernel.group(1)}\((%\w+)\)", text)
  assert len(calls) == 2 and calls[0] != calls[1]


class _PolicyStack(nn.Module):
  policy: object

  @nn.compact
  def __call__(self, x):
    block = functools.partial(_Block, forge_jax.adamw(1e-2), "mosaic")
    return forge_jax.ScannedStack(block, 2, remat=True, remat_policy=self.policy)(x)


def _forward_residuals(policy):
  """The shapes a ScannedStack's forward scan saves per layer, from the train step's jaxpr."""
  x = jnp.ones((2, 64, 128), BF16)
  model = _PolicyStack(policy)
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.key(0), x),
                                      forge_jax.adamw(1e-2))
  loss_fn = lambda v, b: jnp.mean(jnp.square(model.apply(v, b["x"]).astype(jnp.float32)))
  jaxpr = jax.make_jaxpr(lambda s: forge_jax.train_step(s, {"x": x}, loss_fn))(state).jaxpr
  found = []

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "scan" and eqn.params.get("length") == 2 and len(eqn.outvars) > 1:
        found.append([tuple(v.aval.shape) for v in eqn.outvars[1:]])  # after the carried x
      for p in eqn.params.values():
        for sub in p if isinstance(p, (list, tuple)) else [p]:
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr)
  assert found, "no forward scan over the 2 layers in the step's jaxpr"
  return found[0]


def test_dots_saveable_saves_the_stacked_gemm_products(fake_gpu):
  """On a Hopper GPU a stacked layer's forward product is the Mosaic stacked GEMM, not a
  dot_general: ``dots_saveable`` must still save it (a [layers, rows, features] residual), where
  ``remat_policy=None`` saves only each block's input."""
  del fake_gpu
  saved = _forward_residuals(jax.checkpoint_policies.dots_saveable)
  assert (2, 128, 256) in saved, saved  # the first Dense's product, stacked over the 2 layers
  assert (2, 128, 256) not in _forward_residuals(None)


def test_a_scanned_model_never_slices_its_weight_stacks_on_a_hopper_gpu(monkeypatch):
  """The scanned Llama step as lowered for a Hopper GPU (the real kernels, the platform faked):
  no ``dynamic_slice`` reads a FORGE weight stack anywhere (forward products, dX products and the
  fused updates all take the whole stacks), where the ``"xla"`` route slices each of them; each
  product leaves its kernel through an optimization barrier; and no buffer of stacked residuals
  is zero-filled before the forward loop fills it."""
  import re  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from forge_jax import _fused  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_fused, "_platform", lambda: "gpu")
  buffers, stack_buffer = [], _fused.stack_buffer
  monkeypatch.setattr(_fused, "stack_buffer",
                      lambda shape, dtype, **kw: buffers.append((shape, dtype)) or stack_buffer(shape, dtype, **kw))
  # 128 rows, which no weight has, so that a slice of a stacked activation is not mistaken for one.
  cfg = models.get_config("tiny-llama", linear="forge", remat="none", scan_layers=True,
                          hidden_size=256, intermediate_size=384, head_dim=64, num_heads=4,
                          num_kv_heads=2, forge_backend="mosaic", dtype="bfloat16",
                          param_dtype="bfloat16")
  opt = forge_jax.adamw(1e-2)
  model = models.CausalLM(cfg, optimizer=opt)
  batch = jnp.zeros((2, 65), jnp.int32)
  state = forge_jax.TrainState.create(model.apply, model.init(jax.random.key(0), batch[:, :-1]), opt)

  def loss_fn(v, b):
    logits = model.apply(v, b[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

  text = lower_for_cuda(lambda s, b: forge_jax.train_step(s, b, loss_fn), state, batch)
  stacks = {"x".join(map(str, a.shape)) for a in jax.tree.leaves(state.params) if a.ndim == 3}
  assert len(stacks) == 4, stacks  # q/o, k/v, gate/up and down kernels
  slices = [line for line in re.findall(r"stablehlo\.dynamic_slice[^\n]*", text)
            if any(f"tensor<{s}xbf16>" in line for s in stacks)]
  assert text.count("stacked_matmul") and not slices, slices[:3]
  # Every product leaves through an optimization barrier: a product XLA could fuse into the
  # dynamic-update-slice of its residual stack is launched a second time for that fusion when it
  # has another reader (the q/k/v GEMMs on the H200, jax 0.11.2).
  products = re.findall(r"(%\S+) = (?:func\.)?call @_?stacked_matmul\w*\(", text)
  barriers = " ".join(re.findall(r"stablehlo\.optimization_barrier[^\n]*", text))
  assert len(products) == 14, products  # 7 forward, 7 dX
  unguarded = [p for p in products if not re.search(re.escape(p) + r"\b", barriers)]
  assert not unguarded, unguarded
  assert len(buffers) >= 8, buffers  # q, k, v, the gate and up products, ... per layer
  mlir = {"bfloat16": "bf16", "float32": "f32", "bool": "i1", "int32": "i32"}
  types = {"-> tensor<" + "x".join(map(str, shape)) + f"x{mlir[jnp.dtype(dtype).name]}>"
           for shape, dtype in buffers}
  zeroed = [line for line in re.findall(r"stablehlo\.broadcast_in_dim[^\n]*", text)
            if any(t in line for t in types)]
  assert not zeroed, zeroed[:3]
