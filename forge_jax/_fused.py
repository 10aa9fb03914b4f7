"""``fused_linear_update``: one linear layer's weight update without its gradient.

For a layer ``y = x @ w`` with output cotangent ``dy``, the weight gradient is
``x.T @ dy``. This entry point hands ``x``, ``dy``, ``w`` and ``w``'s optimizer
state to a backend that computes that product tile by tile and applies the
optimizer's elementwise rule to each tile as soon as it is complete:

* ``"pallas"``: the Pallas kernel lowered through Triton (any CUDA GPU);
* ``"interpret"``: the same kernel in Pallas interpret mode (CPU tests);
* ``"mosaic"``: the warp-specialized Hopper kernel lowered through Mosaic GPU
  (:mod:`pallas_kernels.mosaic`; sm_90 only). Calls it cannot take
  (shapes off its tiling, float32 ``x``, a non-Hopper GPU) run on
  ``"pallas"`` instead, with one :class:`BackendFallbackWarning` per distinct
  reason. It takes int8 optimizer states and stochastically rounded weights
  too;
* ``"mosaic_interpret"``: that kernel under the Mosaic GPU interpreter (CPU
  tests; falls back to ``"xla"``);
* ``"xla"``: the reference: one float32 dot plus the same rule, fused by XLA
  as it sees fit (the default on CPU, and the baseline in benchmarks);
* ``"auto"``: on a Hopper GPU, the faster of the Mosaic kernel and ``"xla"`` for the
  layer's tokens, shape, weight dtype, state format and rounding, from the
  measured table of this GPU (:mod:`forge_jax._auto`). Off
  the table: the Mosaic kernel. Where it cannot run (not a Hopper GPU, shapes or
  dtypes off its tiling), the Triton kernel for float states with weights rounded
  to nearest, ``"xla"`` for int8 states and stochastically rounded weights,
  silently (nobody asked for Mosaic);
  ``"xla"`` off GPUs (see :func:`_resolve_backend`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional
import warnings

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

from forge_jax import _auto
from forge_jax import _lowp
from forge_jax import _optimizers
from forge_jax import _rules
import pallas_kernels
from pallas_kernels import numerics

BACKENDS = ("auto", "xla", "pallas", "interpret", "mosaic", "mosaic_interpret")
# "auto" on a GPU with float states: the Mosaic kernel, "pallas" (no warning) where it
# cannot run (not a Hopper GPU, shapes or dtypes off its tiling).
_AUTO_MOSAIC = "auto:mosaic"
# "auto" on a GPU with int8 states or stochastically rounded weights: the Mosaic kernel, "xla"
# (no warning) where it cannot run (the Triton kernel is slower than XLA there).
_AUTO_MOSAIC_OR_XLA = "auto:mosaic_or_xla"
_AUTO = (_AUTO_MOSAIC, _AUTO_MOSAIC_OR_XLA)
_MOSAIC_BACKENDS = ("mosaic", "mosaic_interpret", *_AUTO)


class BackendFallbackWarning(UserWarning):
  """A backend could not take a call and another one ran it (said once per reason)."""


# (backend, reason) pairs already warned about in this process.
_FALLBACK_WARNED: set = set()


def _platform() -> str:
  return jax.default_backend()


def _resolve_backend(backend: str, quantized_slots: bool = False, stochastic_weights: bool = False,
                     *, case: Optional[tuple] = None) -> str:
  """The backend to run: ``backend`` itself, or what ``"auto"`` picks.

  ``case``: ``(t, k, n, weight dtype name, state format)`` of the call (see
  :mod:`forge_jax._auto`), for ``"auto"`` to look up in the measured table.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}.")
  platform = _platform()
  if backend == "auto":
    if platform != "gpu":
      return "xla"
    # The rule for a call outside the table: the Mosaic kernel, from per-layer times side by
    # side on the H200 (AdamW, bf16 weights, experiments/results/h200/):
    # - int8 slots: 1.43-1.64x faster than XLA at T=1024 since its int8 epilogue runs as a
    #   loop (int8_loop/: 4096x4096 0.161 against 0.230 ms, with SR weights 0.148 against
    #   0.234; 4096x14336 0.456 against 0.743, with SR 0.460 against 0.755);
    # - stochastically rounded weights, float states: 1.10-1.23x faster than XLA on the large
    #   shapes (int8_epilogue/lowp/, T=1024: 4096x4096 0.112 against 0.129 ms; 4096x14336
    #   0.335 against 0.411; 1.07-1.08x slower at 4096x1024);
    # - float states (Llama-3.1-8B pure bf16, 1x1024 tokens: 144.8 ms a step against 169.0
    #   with the Triton kernel, bench_models_mosaic.md).
    # Where the kernel cannot run (_mosaic_problem says): the Triton kernel for float states
    # rounded to nearest, XLA for the two above (the Triton kernel is slower than XLA there).
    rule = _AUTO_MOSAIC_OR_XLA if quantized_slots or stochastic_weights else _AUTO_MOSAIC
    # The table compares the Mosaic kernel with XLA: it says nothing where the kernel cannot run.
    if case is not None and _mosaic_device_problem() is None:
      choice = _auto.table().choose(*case, sr=stochastic_weights)
      if choice == "xla":
        return "xla"
    return rule
  if backend in ("pallas", "mosaic") and platform != "gpu":
    raise ValueError(
        f"backend={backend!r} needs a GPU, but jax's default backend is {platform!r}: "
        "use backend='xla' (the reference), 'interpret' (the Pallas kernel in "
        "interpret mode) or 'mosaic_interpret' (the Mosaic GPU kernel under its "
        "interpreter) here."
    )
  return backend


def _mosaic_device_problem() -> Optional[str]:
  """Why this device cannot run the Mosaic kernel (not a Hopper GPU, no Mosaic GPU), or None."""
  try:
    from pallas_kernels.mosaic import config as mosaic_config  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except  (a jax without Mosaic GPU)
    return f"Mosaic GPU is not available in this jax ({type(e).__name__}: {e})"
  return mosaic_config.device_problem()


def _mosaic_problem(x, dy, w, slots, config, compute_grad_sq_norm):
  """``(reason, None)`` if the Mosaic GPU kernel cannot take this call, else ``(None, config)``.

  Asks the kernel once (``select_config``); ``config`` is the caller's ``MosaicTileConfig`` or
  ``None`` (the kernel's per-operand default).
  """
  try:
    from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except  (a jax without Mosaic GPU)
    return f"Mosaic GPU is not available in this jax ({type(e).__name__}: {e})", None
  cfg, reason = mosaic.select_config(x, dy, w, slots, config,
                                     compute_grad_sq_norm=compute_grad_sq_norm)
  return (None, cfg) if cfg is not None else (reason, None)


# The checkpoint name of a product that stacked_dot computes with the Mosaic stacked GEMM.
STACKED_DOT_NAME = "forge_jax.stacked_dot"


# The most rows (tokens) a stacked product takes the Mosaic GEMM for. Measured on the H200,
# Llama-3.1-8B scanned without remat: at 1x1024 tokens 124.7 ms a step with it against 130.1 with
# XLA's slice + dot; per layer at T=4096 it runs 0.94-1.06x unrolled XLA's GEMMs. At 8x1024
# (8192 rows) the step takes 690.2 ms with it against 681.4 without (2026-12-04, same run;
# experiments/results/h200/scanned): no gain there.
STACKED_GEMM_MAX_ROWS = 4096


def _stacked_gemm(x, stack, dtype, transpose: bool, backend: str, precision):
  """The Mosaic stacked GEMM if it takes ``x @ stack[l]`` for this backend, else None (XLA's
  dynamic slice and dot). Not under ``"mosaic_interpret"``: a scanned block runs under
  ``jax.checkpoint``, whose partial evaluation cannot take the interpreter's ordered callbacks
  (the kernel's interpreter tests are in ``tests/test_stacked_matmul.py``)."""
  if backend not in ("auto", "mosaic") or _platform() != "gpu" or _mosaic_device_problem() is not None:
    return None
  if precision not in (None, jax.lax.Precision.DEFAULT) or not x.dtype == stack.dtype == dtype:
    return None
  # Importable: _mosaic_device_problem imported pallas_kernels.mosaic (and so Mosaic GPU).
  from pallas_kernels.mosaic import stacked_matmul as sm  # pylint: disable=g-import-not-at-top
  x2 = jax.ShapeDtypeStruct((int(np.prod(x.shape[:-1])), x.shape[-1]), x.dtype)
  if x2.shape[0] > STACKED_GEMM_MAX_ROWS:
    return None
  if sm.problem(x2, stack, transpose, sm.StackedMatmulConfig()) is not None:
    return None
  return sm.stacked_matmul


def stack_buffer(shape, dtype, *, tag: int = 0) -> jax.Array:
  """A buffer that a loop over layers fills slice by slice before anything reads it: on a GPU
  where the Mosaic kernels run, allocated without a write (``pallas_kernels.mosaic.uninitialized``;
  zero-filling the stacked residuals of Llama-3.1-8B at 1x1024 took about 2 ms of a 125 ms step
  on the H200), elsewhere zeros. With several devices zeros too: XLA's partitioner shards a
  zero fill like the values written into it, but would replicate a custom call's output.
  ``tag``: distinct per buffer of one step (see there)."""
  if _platform() == "gpu" and jax.device_count() == 1 and _mosaic_device_problem() is None:
    from pallas_kernels.mosaic.uninitialized import uninitialized  # pylint: disable=g-import-not-at-top
    return uninitialized(shape, dtype, tag)
  return jnp.zeros(shape, dtype)


def stacked_dot(x, stack, layer, *, transpose: bool = False, dtype=None, backend: str = "auto",
                precision=None):
  """``x @ stack[layer]`` over ``x``'s last axis (``x @ stack[layer].T`` with ``transpose``), the
  layer cast to ``dtype`` (default ``x``'s).

  Inside a scan over layers XLA copies ``stack[layer]`` out of the stack before its dot (on the
  H200, Llama-3.1-8B at 1x1024: about 15 ms of a 130 ms step). Where ``backend`` runs the Mosaic
  kernel on a Hopper GPU (``"auto"``, ``"mosaic"``) and the shapes fit its tiling (bf16 or f16
  operands of ``dtype``; rows, K and N multiples of 128, 64 and 128; at most
  ``STACKED_GEMM_MAX_ROWS`` rows), the product is
  :func:`pallas_kernels.mosaic.stacked_matmul.stacked_matmul`, which reads the layer in place;
  elsewhere XLA's ``dynamic_index_in_dim`` and ``dot_general``.
  """
  dtype = x.dtype if dtype is None else jnp.dtype(dtype)
  gemm = _stacked_gemm(x, stack, dtype, transpose, backend, precision)
  if gemm is not None:
    y = gemm(x.reshape(-1, x.shape[-1]), stack, layer, transpose_w=transpose)
    # Behind a barrier: where a product is both read and saved into a stack of residuals, XLA's
    # GPU compiler (jax 0.11.2) otherwise fuses a second launch of the GEMM with that stack's
    # dynamic-update-slice (Llama-3.1-8B's q, k and v: 3 more GEMMs a layer, ~2.8 ms of a 119 ms
    # step at 1x1024 on the H200); behind it the product is computed once and copied.
    y = jax.lax.optimization_barrier(y)
    # Named, so that a remat policy can judge it as the dot it stands for (forge_jax._stack).
    y = checkpoint_name(y, STACKED_DOT_NAME)
    return y.reshape(*x.shape[:-1], y.shape[-1])
  w = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(dtype)
  dims = (((x.ndim - 1,), (1 if transpose else 0,)), ((), ()))
  return jax.lax.dot_general(x, w, dims, precision=precision)


@dataclasses.dataclass(frozen=True)
class _RuleUpdate:
  """``rule.update`` with ``decay`` bound: hashable and equal by value (unlike a
  ``functools.partial``), so that the kernels' trace cache serves every layer
  of a model with one trace per shape."""

  rule: Any
  decay: bool

  def __call__(self, g, w, slots, s):
    return self.rule.update(g, w, slots, s, decay=self.decay)


def _update_fn(rule, decay: bool, precision) -> Any:
  """The elementwise rule every backend runs: the optimizer's, guarded against non-finite
  gradient elements unless ``precision.nonfinite == "propagate"``. The Mosaic epilogue, the
  Triton kernel and ``"xla"`` all apply it through ``pallas_kernels.contract.apply_update``, so
  they cannot differ in it."""
  update_fn = _RuleUpdate(rule, decay)
  return pallas_kernels.skip_non_finite(update_fn) if precision.skips_non_finite else update_fn


def _run_mosaic(backend, x, dy, w, slots, scalars, update_fn, *, layer, config,
                compute_grad_sq_norm, write_back=None):
  """The Mosaic GPU kernel, or a fallback backend if it cannot run this call.

  An explicit ``"mosaic"``/``"mosaic_interpret"`` warns once per reason;
  ``"auto"`` (``_AUTO_MOSAIC``) promised no kernel, so it falls back silently,
  and a Triton ``TileConfig`` given with it means the Triton kernel.
  """
  auto = backend in _AUTO
  if auto and isinstance(config, pallas_kernels.TileConfig):
    reason, cfg = "a Triton TileConfig was given", None
  else:
    reason, cfg = _mosaic_problem(x, dy, w, slots, config, compute_grad_sq_norm)
  if reason is None:
    from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top

    interpret = backend == "mosaic_interpret"
    if interpret and cfg.num_sms is None:
      cfg = dataclasses.replace(cfg, num_sms=1)  # one interpreted block, not 132
    return mosaic.fused_dw_update_mosaic(
        x, dy, w, slots, scalars, update_fn, layer=layer, config=cfg, config_checked=True,
        compute_grad_sq_norm=compute_grad_sq_norm, interpret=interpret, **(write_back or {}),
    )
  # The Triton kernel takes float32 and bfloat16 inputs only (float16 goes to XLA).
  triton_dtypes = all(a.dtype in (jnp.float32, jnp.bfloat16) for a in (x, dy))
  fallback = "xla" if backend in ("mosaic_interpret", _AUTO_MOSAIC_OR_XLA) or not triton_dtypes else "pallas"
  if not auto and (backend, reason) not in _FALLBACK_WARNED:
    _FALLBACK_WARNED.add((backend, reason))
    warnings.warn(
        f"fused_linear_update(backend={backend!r}): {reason}; running backend={fallback!r} "
        "instead (said once per reason).",
        BackendFallbackWarning, stacklevel=4,
    )
  kwargs = {} if write_back is None else {"write_back": write_back}
  return _run_backend(
      fallback, x, dy, w, slots, scalars, update_fn, layer=layer,
      config=config if isinstance(config, pallas_kernels.TileConfig) else None,
      compute_grad_sq_norm=compute_grad_sq_norm, **kwargs,
  )


def _run_backend(backend, x, dy, w, slots, scalars, update_fn, *, layer, config,
                 compute_grad_sq_norm, write_back):
  if backend in _MOSAIC_BACKENDS:
    return _run_mosaic(
        backend, x, dy, w, slots, scalars, update_fn, layer=layer, config=config,
        compute_grad_sq_norm=compute_grad_sq_norm, write_back=write_back,
    )
  if config is not None and type(config).__name__ not in ("TileConfig", "MosaicTileConfig"):
    raise ValueError(
        f"config={config!r} is not a tile configuration: pass "
        "pallas_kernels.TileConfig (backends 'pallas', 'interpret'), "
        "pallas_kernels.mosaic.MosaicTileConfig (the Mosaic backends) or None."
    )
  if backend in ("pallas", "interpret") and config is not None and not isinstance(config, pallas_kernels.TileConfig):
    raise ValueError(f"config={config!r} is not a TileConfig: backend={backend!r} takes "
                     "pallas_kernels.TileConfig or None.")
  if backend == "xla":
    return pallas_kernels.fused_dw_update_reference(
        x, dy, w, slots, scalars, update_fn, layer=layer,
        compute_grad_sq_norm=compute_grad_sq_norm, **write_back,
    )
  return pallas_kernels.fused_dw_update(
      x, dy, w, slots, scalars, update_fn, layer=layer, config=config,
      compute_grad_sq_norm=compute_grad_sq_norm, interpret=backend == "interpret",
      **write_back,
  )


def _check_inputs(x, dy, w, state, rule, layer):
  w_ndim = 2 if layer is None else 3
  if w.ndim != w_ndim:
    what = "a [K, N] weight" if layer is None else "stacked [L, K, N] weights with `layer`"
    raise ValueError(f"expected {what}, got w of shape {w.shape}.")
  if layer is not None:
    try:
      index = int(layer)
    except (TypeError, jax.errors.ConcretizationTypeError):  # traced: clamped, see the docstring
      index = 0
    if not 0 <= index < w.shape[0]:
      raise ValueError(f"layer={index} is out of range for {w.shape[0]} stacked weights "
                       f"(w {w.shape}): pass 0 <= layer < {w.shape[0]}.")
  k, n = w.shape[-2:]
  if k == 0 or n == 0:
    raise ValueError(f"w has shape {w.shape}: a linear layer needs K, N >= 1.")
  if x.ndim < 2 or dy.ndim < 2:
    raise ValueError(
        f"x and dy need a token axis: got x {x.shape} and dy {dy.shape}; "
        "pass x as [..., K] and dy as [..., N] with the same leading dims."
    )
  if x.shape[-1] != k or dy.shape[-1] != n or x.shape[:-1] != dy.shape[:-1]:
    raise ValueError(
        f"shapes do not match a linear layer y = x @ w: x {x.shape}, dy {dy.shape}, "
        f"w {w.shape}; need x [..., {k}] and dy [..., {n}] with equal leading dims."
    )
  for name, a in (("x", x), ("dy", dy), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} has dtype {a.dtype}; FORGE needs floating inputs.")
  if not isinstance(state, rule.state_cls):
    raise ValueError(
        f"state is a {type(state).__name__}, but this {rule.name} optimizer's state "
        f"is a {rule.state_cls.__name__}: pass optimizer.init(w)."
    )
  for name, slot in zip(rule.slot_names, rule.slots_of(state)):
    if not hasattr(slot, "shape") or slot.shape != w.shape:
      raise ValueError(
          f"state.{name} has shape {getattr(slot, 'shape', type(slot))}, expected the "
          f"weight's {w.shape}: pass optimizer.init(w) for this very weight."
      )


def _layer_entry(value, layer):
  """A step field's entry for ``layer`` (one per layer in a stack), else itself."""
  if layer is not None and jnp.ndim(value) == 1:
    return jax.lax.dynamic_index_in_dim(value, layer, keepdims=False)
  return value


def _set_layer_entry(value, new, layer):
  """``value`` with ``layer``'s entry set to ``new``. A stack sharing one scalar
  (as it shares one count) keeps it: the caller writes it once per step."""
  if layer is None:
    return new
  if jnp.ndim(value) == 1:
    return jax.lax.dynamic_update_index_in_dim(value, new.astype(value.dtype), layer, 0)
  return value


def _order_after(scalars, after):
  """``scalars`` with a data dependency on ``after`` and unchanged values."""
  leaves, treedef = jax.tree.flatten(scalars)
  return jax.tree.unflatten(treedef, [leaves[0] + pallas_kernels.zero_after(after), *leaves[1:]])


def fused_linear_update(
    x: jax.Array,
    dy: jax.Array,
    w: jax.Array,
    state: Any,
    optimizer: _optimizers.ForgeOptimizer,
    backend: str = "auto",
    *,
    layer: Optional[jax.Array] = None,
    after: Optional[jax.Array] = None,
    decay: bool = True,
    config: Any = None,
    return_grad_sq_norm: bool = False,
    stream: Any = 0,
    element_offset: Optional[tuple] = None,
    sum_sq_over: Optional[str] = None,
    apply: Optional[jax.Array] = None,
):
  """Applies one optimizer step to ``w`` from ``x`` and ``dy``, never forming ``dW``.

  Equivalent to ``g = x.T @ dy`` (float32) followed by
  ``updates, state = optimizer.update(g, state, w); w = apply_updates(w, updates)``,
  except that the gradient exists only one tile at a time inside the kernel.

  Args:
    x: the layer input, [..., K] (leading dims are flattened into tokens).
    dy: the cotangent of the layer output, [..., N].
    w: the weight [K, N] (float32 or bfloat16), or stacked weights [L, K, N]
      with ``layer`` selecting the one to update.
    state: ``optimizer.init(w)``: ``count`` plus slots shaped like ``w``. With
      stacked weights ``count`` may also be one count per layer ([L]).
    optimizer: a forge_jax optimizer (``forge_jax.adamw(...)``, ...).
    backend: ``"auto"``, ``"xla"``, ``"pallas"``, ``"interpret"``,
      ``"mosaic"`` or ``"mosaic_interpret"`` (see the module docstring;
      ``"auto"`` picks the faster of the Mosaic kernel and ``"xla"`` on a GPU
      from the measured table of that GPU (``forge_jax._auto``), and ``"xla"``
      off GPUs).
    layer: int32 scalar index into stacked ``w`` and slots. The returned
      ``count`` is then left unchanged: advance it once per step, after the
      last layer. A concrete index outside ``[0, L)`` is an error; a traced
      one is clamped into it (as ``lax.dynamic_index_in_dim`` does).
    after: an array that must be computed before ``w`` is overwritten, e.g.
      ``dX = dY @ W.T``, which reads the old weight. The update is made to
      depend on one element of it, so XLA orders every read of the old weight
      first and can update ``w`` in place instead of protecting it with a copy
      (``lax.optimization_barrier`` alone does not order it on every backend).
    decay: apply weight decay to this weight. The optimizer's ``mask``
      describes a params tree and is not consulted here; ``forge_jax.Dense``
      passes its ``decay`` attribute (``TrainState.create`` checks that the
      mask does not exclude a FORGE kernel).
    config: the kernel's tile configuration (``None``: per-shape default):
      a ``TileConfig`` for ``"pallas"``/``"interpret"``, a
      ``MosaicTileConfig`` for the Mosaic backends.
    return_grad_sq_norm: also return ``sum(dW**2)`` (float32), accumulated
      tile by tile inside the kernel.
    stream: which weight this is (an int or uint32 scalar), folded into the
      stochastic-rounding seed so that different weights get independent
      random bits (``forge_jax.Dense`` passes a hash of its module path).
    element_offset: ``(row0, col0, N)`` when ``w`` is the slice starting at
      (``row0``, ``col0``) of a ``[K, N]`` weight split over devices (tensor
      parallelism, :mod:`forge_jax._parallel`): stochastic rounding then hashes
      each element's index in the whole weight, so its bits do not depend on the
      split. Only the ``"xla"`` backend takes it when bits are drawn.
    sum_sq_over: a mesh axis name (inside ``jax.shard_map``): the squared
      gradient norm is summed over it, the whole weight's (what a per-layer
      stabilizer and ``return_grad_sq_norm`` see).
    apply: a boolean scalar (may be traced): where it is false the weight and
      the optimizer state (count and norm fields included) come back bit for
      bit as they were; the kernels still compute the gradient (and its norm)
      and store nothing. ``forge_jax.train_step`` skips a step with a
      non-finite loss this way, with no ``lax.cond``.

  The optimizer's :class:`forge_jax.Precision` decides the write-back: with
  ``weight_rounding="stochastic"`` a bfloat16 ``w`` is rounded with bits
  hashed from (seed, stream, the step count, ``layer``, element index); int8
  slots (from ``optimizer.init``) are dequantized, updated in float32 and
  re-quantized per block.

  Returns:
    ``(new_w, new_state)``, or ``(new_w, new_state, grad_sq_norm)``.
  """
  opt = _optimizers.as_forge_optimizer(optimizer)
  rule = opt.rule
  _check_inputs(x, dy, w, state, rule, layer)
  x2 = x.reshape(-1, x.shape[-1])
  dy2 = dy.reshape(-1, dy.shape[-1])
  count = state.count
  if layer is not None and jnp.ndim(count) == 1:  # a stack of per-layer counts
    count = jax.lax.dynamic_index_in_dim(count, layer, keepdims=False)
  # Stabilizers' step fields (the norm to clip by), per layer in a stack as the count.
  step = tuple(_layer_entry(v, layer) for v in rule.step_values(state))
  scalars = rule.scalars(count, *step)
  if after is not None:
    scalars = _order_after(scalars, after)
  precision = opt.precision
  update_fn = _update_fn(rule, decay, precision)
  weight_codec = _lowp.weight_codec(precision, w.dtype)
  # How the backend writes the results back: the seed and step are used only by codecs that
  # round stochastically (the weight's, or a slot's); with `apply`, nothing where it is false.
  write_back = dict(weight_codec=weight_codec, seed=numerics.stream_seed(precision.seed, stream), step=count)
  if apply is not None:
    write_back["apply"] = jnp.asarray(apply, bool)
  # int8 codes may arrive as their float view (see forge_jax.train_step).
  slots = tuple(_lowp.from_float_view(s) for s in rule.slots_of(state))
  for name, q in zip(rule.slot_names, slots):
    if isinstance(q, numerics.QuantizedArray):
      pallas_kernels.check_quantized(q, f"state.{name}")
  case = (x2.shape[0], *w.shape[-2:], jnp.dtype(w.dtype).name, _auto.state_format(slots))
  resolved = _resolve_backend(backend, any(isinstance(q, numerics.QuantizedArray) for q in slots),
                              stochastic_weights=weight_codec.needs_bits, case=case)
  if x2.shape[0] == 0:
    resolved = "xla"  # no tokens: dW = 0, the decay-only step (the kernels need a tile of tokens)
  draws_bits = weight_codec.needs_bits or any(
      isinstance(q, numerics.QuantizedArray) and q.codec.needs_bits for q in slots)
  if element_offset is not None and draws_bits:
    if resolved != "xla":
      raise ValueError(
          f"backend={backend!r} ({resolved}) draws stochastic-rounding bits from each "
          "element's index in its own tile grid, which under tensor parallelism is the index "
          "in the device's slice, not in the whole weight: the rounded values would depend on "
          "the number of devices. Use backend='xla' or 'auto' (which takes 'xla' for "
          "stochastic rounding) for tensor-parallel layers with stochastic rounding.")
    from forge_jax import _parallel  # pylint: disable=g-import-not-at-top
    write_back["index"] = _parallel.global_element_index(w.shape, element_offset)
  new_w, new_slots, sq = _run_backend(
      resolved,
      x2, dy2, w, slots, scalars, update_fn,
      layer=layer, config=config, write_back=write_back,
      compute_grad_sq_norm=return_grad_sq_norm or rule.norm_scope is not None,
  )
  if sum_sq_over is not None and sq is not None:
    sq = jax.lax.psum(sq, sum_sq_over)
  new_slots = tuple(_lowp.view_like(n, s) for n, s in zip(new_slots, rule.slots_of(state)))
  # A stack's layers are updated one call each within one step: the caller
  # advances the shared count once, after the last layer.
  count = state.count if layer is not None else _rules.safe_increment(state.count)
  new_step = rule.step_values(state)
  if new_step:  # this weight's own norm; forge_jax.train_step sets the global one
    new_step = tuple(_set_layer_entry(v, n, layer)
                     for v, n in zip(new_step, rule.next_step(step, sq)))
  if apply is not None:
    keep = lambda new, old: jnp.where(apply, new, old)
    count = keep(count, state.count)
    new_step = tuple(map(keep, new_step, rule.step_values(state)))
  new_state = rule.state_cls(count, *new_step, *new_slots)
  if return_grad_sq_norm:
    return new_w, new_state, sq
  return new_w, new_state
