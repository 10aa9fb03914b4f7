"""Tensor-parallel FORGE runs on 8 CPU devices, against single-device runs (tests/test_parallel.py).

Run as ``python -m tests._parallel_cases OUT.json`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: it writes one JSON record per check.
Each configuration is compiled once (``train_step.lower(...).compile()``: the HLO it reads is
the executable that runs).
"""

from __future__ import annotations

import functools
import json
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import forge_jax
import models

STEPS = 3
LR = 1e-3
B, L = 3, 16  # B differs from the layer count: no activation has a stacked weight slice's shape
# GQA at every split: 16 query heads, 8 kv heads (head_dim 4, so that N * H = D = 64).
HEADS = dict(num_heads=16, num_kv_heads=8, head_dim=4)
COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                        r"collective-permute)(-start)?\(")
SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")

RECORDS = []


def record(**kw):
  RECORDS.append(kw)
  print(json.dumps(kw), flush=True)


def optimizer(precision=None):
  # eps well above float32 rounding of the gradients: Adam divides by sqrt(v) + eps, which turns
  # a rounding-level difference of a near-zero gradient into an lr-sized step otherwise.
  return forge_jax.adamw(LR, eps=1e-6, weight_decay=0.1, precision=precision)


def loss_fn(apply_fn, variables, tokens):
  logits = apply_fn(variables, tokens[:, :-1]).astype(jnp.float32)
  return models.cross_entropy(logits, tokens[:, 1:])


def tokens_for(cfg):
  return jax.random.randint(jax.random.key(1), (B, L + 1), 0, cfg.vocab_size)


def mesh_of(p: int, *, data: int = 1) -> Mesh:
  devices = np.array(jax.devices()[: p * data]).reshape(data, p)
  return Mesh(devices, ("data", "tensor"))


def build(cfg, opt, tp):
  model = models.CausalLM(cfg, optimizer=opt, tensor_parallel=tp)
  tokens = tokens_for(cfg)
  variables = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])
  state = forge_jax.TrainState.create(model.apply, variables, opt)
  if tp is not None:
    state = models.shard_train_state(tp, state)
  return model, state, tokens


def run(cfg, opt, tp):
  """3 steps; returns (host copy of the state, losses, grad norms, compiled HLO text)."""
  model, state, tokens = build(cfg, opt, tp)
  loss = functools.partial(loss_fn, model.apply)
  compiled = forge_jax.train_step.lower(state, tokens, loss).compile()
  losses, norms = [], []
  for _ in range(STEPS):
    state, metrics = compiled(state, tokens)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return state, losses, norms, compiled.as_text()


def host(state):
  tree = (state.params, state.forge_state, state.opt_state)
  return {jax.tree_util.keystr(p): np.asarray(jnp.asarray(v, jnp.float32))
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def compare(ref, out) -> dict:
  """Per leaf: max |difference| and max |reference|."""
  assert ref.keys() == out.keys(), set(ref) ^ set(out)
  return {k: (float(np.max(np.abs(ref[k] - out[k]), initial=0.0)),
              float(np.max(np.abs(ref[k]), initial=0.0))) for k in ref}


def collectives(hlo: str) -> list:
  found = []
  for line in hlo.splitlines():
    m = COLLECTIVE.search(line)
    if m:
      shapes = [tuple(int(d) for d in dims.split(",") if d) for _, dims in SHAPE.findall(m.group(1))]
      found.append((m.group(2), shapes))
  return found


def weight_shapes(state) -> set:
  """Shapes of every FORGE kernel and optimizer-state array: whole, per layer of a stack, and
  per device's slice."""
  shapes = set()
  for leaf in jax.tree.leaves((_forge_kernels(state), state.forge_state)):
    if leaf.ndim < 2:
      continue
    shard = leaf.sharding.shard_shape(leaf.shape)
    for s in (leaf.shape, shard):
      shapes.add(tuple(s))
      shapes.add(tuple(s[1:]) if len(s) == 3 else tuple(s))
  return shapes


def _forge_kernels(state):
  paths = set(forge_jax._train.forge_paths(state.forge_state))  # pylint: disable=protected-access
  flat = forge_jax._dense.flat_variables(state.params)  # pylint: disable=protected-access
  return [v for p, v in flat.items() if p in paths]


def model_cases():
  llama = models.get_config("tiny-llama", linear="forge", forge_backend="xla", **HEADS)
  qwen = models.get_config("tiny-qwen3", linear="forge", forge_backend="xla", **HEADS)
  # (name, config, P, sequence parallel); each is compared with the single-device run of its
  # config at remat "none" (remat changes no parameter's layout).
  return [
      # Each run costs a compile of the step on 8 devices: P=1 (a mesh of one), P=2 without
      # sequence parallelism (all-reduce after row-parallel layers), P=4 with it and full remat,
      # P=8 with it; Qwen3 adds the tied head and q/k norms.
      ("llama", llama, [(1, False, "none"), (4, True, "full"), (8, True, "none")]),
      ("qwen3", qwen, [(2, False, "none")]),
      ("llama_unrolled", dataclasses_replace(llama, scan_layers=False), [(8, True, "none")]),
  ]


def dataclasses_replace(cfg, **kw):
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(cfg, **kw)


def check_models():
  """Returns a trained tensor-parallel state (for the checkpoint check)."""
  kept = {}
  for name, cfg, runs in model_cases():
    ref_state, ref_losses, ref_norms, _ = run(cfg, optimizer(), None)
    ref = host(ref_state)
    for p, sp, remat in runs:
      tp = forge_jax.TensorParallel(mesh_of(p), "tensor", sequence_parallel=sp)
      state, losses, norms, hlo = run(dataclasses_replace(cfg, remat=remat), optimizer(), tp)
      record(kind="model", name=name, p=p, sp=sp, remat=remat, ref_losses=ref_losses,
             losses=losses, ref_norms=ref_norms, norms=norms, diffs=compare(ref, host(state)))
      kept[(name, p, sp)] = (state, losses)
      if p > 1:
        banned = weight_shapes(state)
        vocab_dim = (cfg.vocab_size, cfg.hidden_size)
        record(kind="hlo", name=name, p=p, sp=sp, remat=remat, tokens=[B, L],
               collectives=[(op, shapes, any(s in banned or s == vocab_dim for s in shapes))
                            for op, shapes in collectives(hlo)])
    if name == "llama":
      # The optax-trained model (flax Dense) on one device, against the TP=4 FORGE run above.
      flax_cfg = dataclasses_replace(cfg, linear="flax")
      flax_state, flax_losses, _, _ = run(flax_cfg, optimizer(), None)
      state, losses = kept[(name, 4, True)]
      # The weights (FORGE's states and optax's moments live in different trees).
      params = lambda st: {k: v for k, v in host(st).items() if k.startswith("[0]")}
      record(kind="optax", name=name, losses=losses, ref_losses=flax_losses,
             diffs=compare(params(flax_state), params(state)))
  return kept[("llama", 8, True)][0]


def check_low_precision():
  """bfloat16 weights with stochastic rounding and int8 states: P=2 and 4 against one device."""
  cfg = models.get_config("tiny-llama", linear="forge", forge_backend="xla",
                          param_dtype="bfloat16", **HEADS)
  precision = forge_jax.Precision(weight_rounding="stochastic", state_dtype="int8", block_size=8,
                                  min_quantized_size=1024, seed=3)
  ref_state, ref_losses, _, _ = run(cfg, optimizer(precision), None)
  ref = host(ref_state)
  for p in (4,):
    tp = forge_jax.TensorParallel(mesh_of(p), "tensor", sequence_parallel=True)
    state, losses, _, _ = run(cfg, optimizer(precision), tp)
    record(kind="lowp", p=p, losses=losses, ref_losses=ref_losses, diffs=compare(ref, host(state)))


def check_layer_bits():
  """One weight's update, whole and split over 4 devices, from exactly representable inputs
  (so every dW element is exact whatever the summation order): with stochastic rounding the
  results must agree bit for bit, which holds only if each slice hashes global indices."""
  mesh = mesh_of(4)
  tp = forge_jax.TensorParallel(mesh, "tensor")
  precision = forge_jax.Precision(weight_rounding="stochastic", state_dtype="int8", block_size=8,
                                  min_quantized_size=1, seed=5)
  opt = forge_jax.adamw(1e-2, precision=precision)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(-4, 5, (32, 24)) / 8, jnp.float32)
  w = jnp.asarray(rng.normal(size=(24, 64)) * 0.05, jnp.bfloat16)
  state = opt.init(w)
  for layout in ("column", "row"):
    dy = jnp.asarray(rng.integers(-4, 5, (32, 64)) / 16, jnp.float32)
    whole = forge_jax.fused_linear_update(x, dy, w, state, opt, "xla", return_grad_sq_norm=True,
                                          stream=7)
    spec = tp.kernel_spec(layout)
    put = lambda t: jax.device_put(t, jax.tree.map(
        lambda a: NamedSharding(mesh, spec if jnp.ndim(a) == 2 else P()), t))
    split = jax.jit(functools.partial(
        forge_jax._parallel.sharded_linear_update, tp, layout, "w",  # pylint: disable=protected-access
        optimizer=opt, backend="xla", stream=7))(x, dy, put(w), put(state))
    leaves = lambda t: [np.asarray(jnp.asarray(a, jnp.float32)) for a in jax.tree.leaves(t)]
    equal = all(np.array_equal(a, b) for a, b in zip(leaves(whole), leaves(split)))
    # The bits do matter: another stream (other bits) changes some weights.
    other = forge_jax.fused_linear_update(x, dy, w, state, opt, "xla", stream=8)[0]
    # A per-array stabilizer keeps an EMA of the array's gradient norm: each slice must see the
    # whole weight's (the psum of the slices' squared norms), not its own.
    clipped = forge_jax.adamw(1e-2, layer_clip=1.0)
    cstate = clipped.init(w.astype(jnp.float32))
    whole_c = forge_jax.fused_linear_update(x, dy, w.astype(jnp.float32), cstate, clipped, "xla")
    split_c = jax.jit(functools.partial(
        forge_jax._parallel.sharded_linear_update, tp, layout, "w",  # pylint: disable=protected-access
        optimizer=clipped, backend="xla"))(x, dy, put(w.astype(jnp.float32)), put(cstate))
    layer_norm_equal = all(
        np.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(leaves(whole_c), leaves(split_c[:2])))
    record(kind="bits", layout=layout, equal=equal, layer_norm_equal=layer_norm_equal,
           sharded=str(split[0].sharding.spec),
           other_stream_differs=bool(np.any(np.asarray(other, np.float32)
                                            != np.asarray(whole[0], np.float32))))


def check_checkpoint(state):
  """A state trained on P=8 (with sequence parallelism), restored on P=2 and on one device."""
  cfg = models.get_config("tiny-llama", linear="forge", forge_backend="xla", **HEADS)
  opt = optimizer()
  saved = host(state)
  with tempfile.TemporaryDirectory() as d:
    forge_jax.save_train_state(f"{d}/ckpt", state)
    for p in (2, None):
      tp = None if p is None else forge_jax.TensorParallel(mesh_of(p), "tensor")
      _, like, _ = build(cfg, opt, tp)
      restored = forge_jax.restore_train_state(f"{d}/ckpt", like)
      same_layout = all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in
                        zip(jax.tree.leaves(restored), jax.tree.leaves(like)))
      diffs = compare(saved, host(restored))
      record(kind="checkpoint", p=p, equal=all(d == 0 for d, _ in diffs.values()),
             same_layout=same_layout)


def attempt(name, fn):
  try:
    fn()
    record(kind="error", name=name, raised=None)
  except ValueError as e:
    record(kind="error", name=name, raised=str(e))


def check_errors():
  llama = models.get_config("tiny-llama", linear="forge", forge_backend="xla", **HEADS)
  tp8 = forge_jax.TensorParallel(mesh_of(8), "tensor")

  def batch_split():
    tp = forge_jax.TensorParallel(mesh_of(4, data=2), "tensor")
    model, state, tokens = build(llama, optimizer(), tp)
    tokens = jax.device_put(jnp.concatenate([tokens, tokens]), NamedSharding(tp.mesh, P("data")))
    forge_jax.train_step(state, tokens, functools.partial(loss_fn, model.apply))

  attempt("batch_split", batch_split)

  def data_parallel():
    """Without tensor_parallel, a batch split over a 'data' mesh is refused (each device would
    hold a partial gradient); a replicated one trains."""
    from tests.test_flax_binding import MLP, _mse  # pylint: disable=g-import-not-at-top
    opt = forge_jax.sgd(1e-2)
    model = MLP(opt)
    x, y = jnp.ones((16, 8)), jnp.ones((16, 4))
    state = forge_jax.TrainState.create(model.apply, model.init(jax.random.key(0), x), opt)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    loss = functools.partial(_mse, model.apply)
    attempt("data_parallel_batch", lambda: forge_jax.train_step(
        state, jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data"))), loss))
    replicated = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P()))
    _, metrics = forge_jax.train_step(state, replicated, loss)
    record(kind="data_parallel", replicated_loss_finite=bool(jnp.isfinite(metrics["loss"])))

  data_parallel()
  attempt("heads", lambda: build(dataclasses_replace(llama, num_heads=12, num_kv_heads=4), optimizer(), tp8))
  attempt("kv_heads", lambda: build(dataclasses_replace(llama, num_kv_heads=4), optimizer(), tp8))

  def quant_block():
    precision = forge_jax.Precision(state_dtype="int8", block_size=8, min_quantized_size=1024)
    model, state, tokens = build(llama, optimizer(precision), tp8)  # k/v: N/P = 32/8 = 4
    forge_jax.train_step(state, tokens, functools.partial(loss_fn, model.apply))

  attempt("quant_block", quant_block)
  attempt("no_axis", lambda: forge_jax.TensorParallel(Mesh(np.array(jax.devices()), ("data",)), "tensor"))
  tp8_sp = forge_jax.TensorParallel(mesh_of(8), "tensor", sequence_parallel=True)
  attempt("sequence", lambda: models.CausalLM(llama, optimizer(), tp8_sp).init(
      jax.random.key(0), jnp.zeros((2, 12), jnp.int32)))


def main(out_path):
  check_errors()
  check_layer_bits()
  trained = check_models()
  check_low_precision()
  check_checkpoint(trained)
  with open(out_path, "w") as f:
    json.dump(RECORDS, f)


if __name__ == "__main__":
  main(sys.argv[1])
