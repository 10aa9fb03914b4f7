"""TrainState and the in-place train step for models with FORGE layers.

One call of :func:`train_step` runs forward and backward. During the backward
pass every FORGE layer has already written its new kernel and optimizer state
(see :mod:`forge_jax._dense`); the step then takes those as they are,
applies the same optimizer's optax form to the parameters FORGE does not
manage (embeddings, norms, biases, tied heads), and returns the loss and
metrics. The state is donated, so the whole update happens in place.

Before anything is updated the step checks, from the jaxpr of its backward
pass, that every FORGE backward pass runs exactly once and not under a mapped
axis (:mod:`forge_jax._reuse`), and it computes the loss first: a non-finite
loss skips the whole backward pass and leaves the state as it was.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax import traverse_util
from jax.extend import core as jex_core

from forge_jax import _dense
from forge_jax import _lowp
from forge_jax import _optimizers
from forge_jax import _reuse
from forge_jax import _rules
from pallas_kernels.contract import grad_sq_terms

FORGE_STATE = _dense.FORGE_STATE


def forge_paths(forge_state) -> frozenset:
  """Paths (tuples of names) of the params that FORGE manages."""
  flat = _dense.flat_variables(forge_state)
  return frozenset(flat)


def _split(params, paths):
  """(forge-managed params as a flat dict, the rest with None at those paths)."""
  flat = _dense.flat_variables(params)
  missing = [p for p in paths if p not in flat]
  if missing:
    raise ValueError(
        f"the forge_state collection has entries with no matching parameter: {missing}"
    )
  managed = {p: flat[p] for p in paths}
  rest = traverse_util.unflatten_dict({p: (None if p in paths else v) for p, v in flat.items()})
  return managed, rest


def _merge(rest, managed):
  flat = traverse_util.flatten_dict(rest, keep_empty_nodes=False)
  flat = {p: v for p, v in flat.items() if v is not None}
  flat.update(managed)
  return traverse_util.unflatten_dict(flat)


class TrainState(struct.PyTreeNode):
  """Everything a FORGE training step reads and rewrites.

  Attributes:
    step: the number of steps taken (int32).
    apply_fn: the model's apply function (usually ``model.apply``).
    optimizer: the forge_jax optimizer: FORGE layers run its elementwise rule
      inside their backward pass; the other parameters get its optax form.
    params: the ``"params"`` collection, FORGE kernels included.
    forge_state: the ``"forge_state"`` collection: per FORGE kernel its
      optimizer state (:class:`forge_jax.KernelState`).
    opt_state: the optax-form state of the parameters FORGE does not manage.
    model_state: any other variable collections (passed to apply unchanged).
    prev_grad_norm: the exact global gradient norm of the last step that had a
      finite one (float32; 0 before the first step): what an optimizer with
      ``clip_prev_norm`` clips the next step by. Advance it with
      :func:`carry_grad_norm`.
    skipped_steps: the number of steps skipped for a non-finite loss (int32;
      ``step`` does not count them).
  """

  step: jax.Array
  apply_fn: Callable = struct.field(pytree_node=False)
  optimizer: _optimizers.ForgeOptimizer = struct.field(pytree_node=False)
  params: Any = None
  forge_state: Any = None
  opt_state: Any = None
  model_state: Any = None
  prev_grad_norm: Any = None
  skipped_steps: Any = None

  @classmethod
  def create(cls, apply_fn: Callable, variables: Any, optimizer) -> "TrainState":
    """Builds the state from ``model.init(...)``'s variables.

    Variables without a ``"forge_state"`` collection (a model without FORGE
    layers) give a state whose every parameter is trained by the optimizer's
    optax form. ``optimizer`` must be the one the model's FORGE layers were
    built with (``train_step`` raises otherwise). The state holds ``variables``'
    arrays themselves, which the first ``train_step`` donates: build each run's
    state from a copy (``jax.tree.map(jnp.copy, variables)``) to start several
    runs from the same variables.

    Raises:
      ValueError: if the optimizer's weight-decay mask excludes a FORGE kernel.
    """
    optimizer = _optimizers.as_forge_optimizer(optimizer)
    variables = _dense.unfreeze(variables)
    if "params" not in variables:
      raise ValueError("variables must hold a 'params' collection (from model.init).")
    forge_state = variables.get(FORGE_STATE, {})
    paths = forge_paths(forge_state)
    managed, rest = _split(variables["params"], paths)
    _check_decay_mask(optimizer, variables["params"], paths)
    model_state = {k: v for k, v in variables.items() if k not in ("params", FORGE_STATE)}
    return cls(
        step=jnp.zeros([], jnp.int32),
        apply_fn=apply_fn,
        optimizer=optimizer,
        params=variables["params"],
        forge_state=forge_state,
        opt_state=optimizer.init(rest),
        model_state=model_state,
        prev_grad_norm=jnp.zeros((), jnp.float32),
        skipped_steps=jnp.zeros([], jnp.int32),
    )

  @property
  def variables(self) -> dict:
    """The variables to pass to ``apply_fn``."""
    return {"params": self.params, FORGE_STATE: self.forge_state, **self.model_state}


def _check_decay_mask(optimizer, params, paths):
  if optimizer.mask is None or not paths:
    return
  mask = _dense.flat_variables(optimizer.decay_mask(params))
  excluded = sorted("/".join(p) for p in paths if not mask.get(p, True))
  if excluded:
    raise ValueError(
        f"the optimizer's weight-decay mask excludes FORGE kernels {excluded}. The "
        "mask governs the parameters optax updates; a FORGE kernel decays when its "
        "forge_jax.Dense has decay=True (the default): set decay=False on those "
        "layers and leave them True in the mask."
    )


class NoBackwardPassWarning(UserWarning):
  """FORGE kernels whose backward pass was not seen while train_step was traced."""


def _without_backward_pass(paths, counts) -> frozenset:
  """The FORGE kernels whose backward pass does not run in the step (their output does not
  reach the loss), which it keeps as they are; warns, naming them."""
  missing = frozenset(p for p in paths if "/".join(p[:-1]) not in counts)
  if missing:
    warnings.warn(
        f"no backward pass of FORGE kernels {sorted('/'.join(p) for p in missing)} was traced "
        "in this step: their output does not reach the loss (a layer the loss does not use, or "
        "one behind jax.lax.stop_gradient). FORGE updates a kernel inside its backward pass, so "
        "train_step keeps them, their optimizer states and counts as they are, where optax "
        "would update them with a zero gradient (weight decay, momentum). Use "
        "flax.linen.Dense for layers that are frozen or unused in some steps.",
        NoBackwardPassWarning, stacklevel=4)
  return missing


def _leaf_sq_norms(tree) -> list:
  """Each leaf's squared norm, NaN where the leaf has a non-finite element (as the kernels
  compute theirs: pallas_kernels.contract.grad_sq_terms), in the same pass."""
  leaves = [x for x in jax.tree.leaves(tree) if x is not None]
  return [jnp.sum(grad_sq_terms(x.astype(jnp.float32))) for x in leaves]


def _nonfinite_count(sq_norms) -> jax.Array:
  """How many of the squared norms (one per parameter array, one per layer of a stack) are NaN:
  the arrays whose gradient has a non-finite element."""
  return sum((jnp.sum(jnp.isnan(q)).astype(jnp.int32) for q in sq_norms), jnp.zeros((), jnp.int32))


def carry_grad_norm(prev_norm, grad_norm, applied=True) -> jax.Array:
  """The norm the next step clips by (``TrainState.prev_grad_norm``).

  ``grad_norm`` where this step was applied and its norm is finite; otherwise
  ``prev_norm``, the last finite norm. A step skipped for a non-finite loss
  passes ``applied=False`` (a traced bool is fine).
  """
  prev_norm = jnp.zeros((), jnp.float32) if prev_norm is None else prev_norm
  kept = _rules.carry_norm(prev_norm, grad_norm)
  return jnp.where(applied, kept, jnp.asarray(prev_norm, jnp.float32))


def _set_prev_norm(forge_state, opt_state, norm):
  """Every ``prev_norm`` step field (FORGE kernels' and optax-form states) set to ``norm``."""
  fill = lambda v: jnp.broadcast_to(norm, jnp.shape(v)).astype(jnp.float32)
  flat = {p: ks._replace(opt=ks.opt._replace(prev_norm=fill(ks.opt.prev_norm)))
          for p, ks in _dense.flat_variables(forge_state).items()}
  opt_state = opt_state._replace(prev_norm=jax.tree.map(fill, opt_state.prev_norm))
  return traverse_util.unflatten_dict(flat) if flat else forge_state, opt_state


def _clip_scale(rule, forge_state, opt_state, prev_norm) -> jax.Array:
  """The factor the stabilizer applies to this step's gradient (the smallest one
  over parameter arrays with per-layer clipping; 1 without clipping)."""
  if rule.norm_scope is None:
    return jnp.ones((), jnp.float32)
  if rule.norm_scope == "global":
    return rule.grad_scale(prev_norm)
  steps = [rule.step_values(ks.opt) for ks in _dense.flat_variables(forge_state).values()]
  leaves = [jax.tree.leaves(t) for t in rule.step_values(opt_state)]
  steps += list(zip(*leaves))
  scales = [jnp.min(rule.grad_scale(*st)) for st in steps]
  return jnp.min(jnp.stack(scales)) if scales else jnp.ones((), jnp.float32)
def _backward_jaxpr(vjp_fn, loss, optimizer, apply=None):
  """The step's whole backward pass as a jaxpr, checked to run each FORGE backward pass once;
  with ``apply``, its FORGE updates run only where ``apply`` is true."""
  with _dense.fused_backward(optimizer, apply=apply):
    jaxpr, ct_shape = jax.make_jaxpr(vjp_fn, return_shape=True)(jnp.ones_like(loss))
  counts = _reuse.count_backward_passes(jaxpr)
  _reuse.check_single_use(counts)
  _reuse.check_new_values_unmixed(jaxpr)
  return jaxpr, jax.tree.structure(ct_shape), counts


def _plain(tree):
  """``tree`` as nested dicts (a FrozenDict or dict alike), so both branches of a cond return
  the same pytree structure."""
  return traverse_util.unflatten_dict(_dense.flat_variables(tree)) if tree else tree


def _apply_cotangents(state: TrainState, paths, cts, finite, kept=frozenset()):
  """The step's new (params, forge_state, opt_state, step, grad_norm, nonfinite_grads) from the
  backward pass's cotangents. FORGE kernels and states come updated (or, where ``finite`` is
  false, kept) by their layers, those in ``kept`` (no backward pass) as they were; the rest is
  updated by the optax form and kept where ``finite`` is false."""
  keep_if_skipped = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  ct_params, ct_forge = cts
  ct_forge = _lowp.from_float_view(ct_forge)
  # FORGE kernels: the cotangent is the new kernel (already updated in place).
  new_managed, grads_rest = _split(ct_params, paths)
  old_managed, params_rest = _split(state.params, paths)
  new_managed.update((p, old_managed[p]) for p in kept)
  # A callable mask sees the whole params (FORGE kernels included), as with optax; the
  # parameters optax updates here are that mask's values at their paths.
  extra = {}
  if state.optimizer.mask is not None:
    extra["forge_decay_mask"] = _split(state.optimizer.decay_mask(state.params), paths)[1]
  updates, opt_state = state.optimizer.update(grads_rest, state.opt_state, params_rest, **extra)
  opt_state = keep_if_skipped(opt_state, state.opt_state)
  params_rest = keep_if_skipped(optax.apply_updates(params_rest, updates), params_rest)
  params = _merge(params_rest, new_managed)

  flat_ct = _dense.flat_variables(ct_forge)
  flat_old = _dense.flat_variables(state.forge_state)
  new_forge, forge_sq = {}, []
  for p, ct in flat_ct.items():
    old = flat_old[p]
    if p in kept:
      new_forge[p] = old
      continue
    count = jnp.where(finite, _rules.safe_increment(old.opt.count), old.opt.count)
    new_forge[p] = _dense.KernelState(ct.opt._replace(count=count), old.grad_sq_norm)
    forge_sq.append(ct.grad_sq_norm)  # one per layer of a ScannedStack
  rest_sq = _leaf_sq_norms(grads_rest)
  total = lambda sqs: sum((jnp.sum(q) for q in sqs), jnp.zeros((), jnp.float32))
  grad_norm = jnp.where(finite, jnp.sqrt(total(forge_sq) + total(rest_sq)), jnp.nan)
  nonfinite = jnp.where(finite, _nonfinite_count(forge_sq + rest_sq), 0)
  step = jnp.where(finite, _rules.safe_increment(state.step), state.step)
  return params, traverse_util.unflatten_dict(new_forge), opt_state, step, grad_norm, nonfinite


def _train_step(state: TrainState, batch, loss_fn, has_aux: bool, skip_nonfinite: bool = True):
  _reuse.check_no_mapped_axis()
  paths = forge_paths(state.forge_state)
  rule = state.optimizer.rule
  prev_norm = state.prev_grad_norm
  if prev_norm is None:  # a TrainState built without create()
    prev_norm = jnp.zeros((), jnp.float32)
  if rule.norm_scope == "global":
    # The kernels and the optax form clip by the whole model's previous norm.
    state = state.replace(**dict(zip(
        ("forge_state", "opt_state"), _set_prev_norm(state.forge_state, state.opt_state, prev_norm))))
  clip_scale = _clip_scale(rule, state.forge_state, state.opt_state, prev_norm)

  def loss_of(params, forge_state):
    variables = {"params": params, FORGE_STATE: forge_state, **state.model_state}
    return loss_fn(variables, batch)

  # int8 state codes cross the VJP as a float view (integer inputs get no
  # cotangent, and the new states come back as cotangents).
  forge_view = _lowp.to_float_view(state.forge_state)

  def linearize():
    if has_aux:
      return jax.vjp(loss_of, state.params, forge_view, has_aux=True)
    return (*jax.vjp(loss_of, state.params, forge_view), None)

  # A non-finite loss skips the step, as optax.apply_if_finite does. Each FORGE layer's kernel
  # takes the flag and, where it is false, stores nothing (no lax.cond: a cond per layer cost
  # an unrolled Llama-3.1-8B step 6% on the H200, XLA's GPU conditional reading its predicate
  # on the host; results/h200/guard); the rest is selected. The flag is known only after the
  # forward pass, so the backward pass is traced once with a placeholder for it in every
  # FORGE layer (_reuse.apply_flag_p; a ScannedStack binds one outside its loop), checked,
  # and rewritten to take the flag as an input in place of the placeholders, also in the
  # bodies of jax.checkpoints (nn.remat) and jit calls (a jitted apply in the loss)
  # (_reuse.thread_apply_flag). A FORGE backward pass
  # that jax took from its cache (a jitted apply's transpose, traced by an earlier step without
  # the guard) may have no placeholder: then, and for a placeholder that cannot be rewritten
  # (in a loop body), the whole backward pass goes in one cond, where the flag is true (the
  # cond keeps the forward residuals live to its end). Everything is traced and checked
  # before anything is updated.
  loss, vjp_fn, aux = linearize()
  if not hasattr(loss, "shape"):
    raise ValueError(
        f"loss_fn returned a {type(loss).__name__}, not a scalar loss: with (loss, aux), pass "
        "has_aux=True to train_step.")
  if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise ValueError(
        f"loss_fn must return a real scalar loss (with has_aux=True: (loss, aux)), as jax.grad "
        f"needs; it returned shape {jnp.shape(loss)}, dtype {jnp.result_type(loss)}. "
        "Reduce a per-example loss to one value (.mean() or .sum()).")
  bwd, ct_tree, counts = _backward_jaxpr(
      vjp_fn, loss, state.optimizer, apply=_reuse.DEFERRED if skip_nonfinite else None)
  kept = _without_backward_pass(paths, counts)
  finite = jnp.isfinite(loss) if skip_nonfinite else jnp.ones((), bool)
  threaded = _reuse.thread_apply_flag(bwd)
  whole_cond = skip_nonfinite and (threaded is None or bool(_reuse.unguarded_paths(bwd)))

  def cotangents(flag):
    """The backward pass's cotangents, every FORGE update taking ``flag`` (true where the
    placeholders stay)."""
    if threaded is None:
      out = jex_core.jaxpr_as_fun(bwd)(jnp.ones_like(loss))
    else:
      out = jex_core.jaxpr_as_fun(threaded)(flag, jnp.ones_like(loss))
    return jax.tree.unflatten(ct_tree, out)

  if whole_cond:
    def unchanged(_):
      return (_plain(state.params), _plain(state.forge_state), state.opt_state, state.step,
              jnp.full((), jnp.nan, jnp.float32), jnp.zeros((), jnp.int32))
    def backward(_):
      out = _apply_cotangents(state, paths, cotangents(jnp.ones((), bool)), True, kept)
      return (_plain(out[0]), _plain(out[1]), *out[2:])
    params, forge_state, opt_state, step, grad_norm, nonfinite = jax.lax.cond(
        finite, backward, unchanged, None)
  else:
    params, forge_state, opt_state, step, grad_norm, nonfinite = _apply_cotangents(
        state, paths, cotangents(finite), finite, kept)
  skipped = jnp.zeros([], jnp.int32) if state.skipped_steps is None else state.skipped_steps
  skipped = jnp.where(finite, skipped, _rules.safe_increment(skipped))
  metrics = {"loss": loss, "grad_norm": grad_norm, "clip_scale": clip_scale,
             "skipped": jnp.logical_not(finite), "skipped_steps": skipped,
             "nonfinite_grads": nonfinite}
  if has_aux:
    metrics["aux"] = aux
  # A skipped step keeps the last finite norm (its own is NaN).
  new_prev_norm = carry_grad_norm(prev_norm, grad_norm, applied=finite)
  if rule.norm_scope == "global":
    forge_state, opt_state = _set_prev_norm(forge_state, opt_state, new_prev_norm)
  new_state = state.replace(
      step=step,
      params=params,
      forge_state=forge_state,
      opt_state=opt_state,
      prev_grad_norm=new_prev_norm,
      skipped_steps=skipped,
  )
  return new_state, metrics


_train_step_jit = jax.jit(_train_step, static_argnums=(2, 3, 4), donate_argnums=(0,))


def _explicit_split(tracer) -> int:
  """Over how many devices a traced array is split by explicit mesh axes (1: not split)."""
  sharding = getattr(jax.typeof(tracer), "sharding", None)
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if not spec or mesh is None:
    return 1
  sizes = dict(mesh.shape)
  n = 1
  for entry in spec:
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      n *= sizes.get(name, 1) if name is not None else 1
  return n


def _split_axes(sharding) -> list:
  """The mesh axes (of size > 1) a NamedSharding splits an array over."""
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None:
    return []
  sizes = dict(mesh.shape)
  names = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))]
  return [n for n in names if sizes.get(n, 1) > 1]


def _split_parts(sharding) -> int:
  """Into how many parts a NamedSharding splits an array (0 for other shardings)."""
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None:
    return 0
  sizes = dict(mesh.shape)
  return int(np.prod([sizes[n] for e in spec if e is not None
                      for n in (e if isinstance(e, tuple) else (e,))]))


def _check_not_data_parallel(state: TrainState, batch):
  if not forge_paths(state.forge_state):
    return
  for leaf in jax.tree.leaves(batch):
    if isinstance(leaf, jax.core.Tracer):
      # Under a user's jit the sharding is known only with explicit mesh axes (jax.set_mesh
      # with AxisType.Explicit); otherwise jit computes the whole batch's step.
      devices = _explicit_split(leaf)
      sharding = getattr(jax.typeof(leaf), "sharding", None)
    else:
      sharding = getattr(leaf, "sharding", None)
      devices = 0 if sharding is None or sharding.is_fully_replicated else len(sharding.device_set)
    if devices > 1:
      axes = _split_axes(sharding)
      parts = _explicit_split(leaf) if isinstance(leaf, jax.core.Tracer) else (
          _split_parts(sharding) or devices)
      split = (f"over {devices} devices" if parts == devices else
               f"into {parts} parts over {devices} devices")
      where = f" by the mesh axes {axes}" if axes else ""
      raise ValueError(
          f"the batch is split {split}{where} ({sharding}). "
          "Under data parallelism (or FSDP) each FORGE weight would need the all-reduced "
          "gradient of the whole batch before its update, but the fused kernel "
          "consumes each device's partial gradient tile by tile and never forms "
          "it. Replicate the batch over those axes (tensor parallelism, "
          "forge_jax.TensorParallel, splits the weights instead and keeps each "
          "slice's gradient complete), or train these layers with "
          "flax.linen.Dense + optax."
      )


def train_step(state: TrainState, batch: Any, loss_fn: Callable, has_aux: bool = False,
               skip_nonfinite: bool = True):
  """One FORGE training step: forward, backward with fused updates, optax for the rest.

  Args:
    state: the :class:`TrainState` (donated: its buffers are updated in place;
      do not use the old state after the call).
    batch: any pytree, passed to ``loss_fn``.
    loss_fn: ``loss_fn(variables, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux=True``); call ``state.apply_fn(variables, ...)`` inside. It is
      a static argument of the jitted step: a module-level function, or a
      ``functools.partial`` of one (partials built alike, from equal or
      identical arguments, are one step: one trace and compile). A new
      function object at each call (a lambda inside the training loop)
      traces and compiles the step each time (``RetraceWarning``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    skip_nonfinite: skip the whole step when the loss is not finite, as
      ``optax.apply_if_finite`` does (the default). ``False`` takes every
      step as it comes (``metrics["skipped"]`` is then always false); the
      kernels' per-element guard is the optimizer's ``Precision(nonfinite=)``.

  Returns:
    ``(new_state, metrics)`` with ``metrics["loss"]``, ``metrics["grad_norm"]``
    (the exact global gradient norm: the FORGE kernels' part is accumulated
    tile by tile inside the fused kernels), ``metrics["clip_scale"]`` (the
    factor the optimizer's ``clip_prev_norm`` applied to this step's gradient;
    with ``layer_clip`` the smallest over parameter arrays; 1 without
    clipping), ``metrics["skipped"]`` (the loss was
    not finite: nothing was updated, ``grad_norm`` is NaN),
    ``metrics["skipped_steps"]`` (all such steps so far) and ``metrics["aux"]``
    if any, and ``metrics["nonfinite_grads"]``: how many parameter arrays
    (FORGE kernels, each layer of a ``ScannedStack`` counted apart, and the
    others) had a gradient element that is NaN or infinite (0 on a skipped
    step). A finite loss with such a gradient takes the step; by default
    (``Precision(nonfinite="skip")``) every FORGE kernel element whose
    gradient is not finite keeps its weight and optimizer state, the others
    are updated, the optax-managed parameters take optax's update (NaN
    there), and ``grad_norm`` is NaN (README, "Non-finite values").

  Raises:
    ValueError: while tracing, before anything changes, when a FORGE layer's
      backward pass would run more than once in the step (the message names
      its module path) or under ``pmap``/``shard_map``/``vmap``, or when the
      batch is split over devices.
  """
  _check_not_data_parallel(state, batch)
  loss_fn = StaticFunction(loss_fn)
  _warn_new_loss_function(loss_fn, state)
  try:
    return _train_step_jit(state, batch, loss_fn, has_aux, bool(skip_nonfinite))
  except (RuntimeError, ValueError) as e:  # jax: "Buffer has been deleted or donated"
    deleted = _deleted_leaves(state)
    if not deleted:
      raise
    raise ValueError(
        f"this TrainState's arrays were donated to an earlier train_step ({deleted[0]}"
        f"{f' and {len(deleted) - 1} more' if len(deleted) > 1 else ''} deleted): train_step "
        "updates the state in place and returns the new one, so continue from the state it "
        "returned. TrainState.create shares the buffers of the variables it is given, so those "
        "are gone after the first step as well: to start another run from the same variables, "
        "create each state from a copy (jax.tree.map(jnp.copy, variables)) or init again."
    ) from e


class _ByIdentity:
  """A value compared by identity (an array, or anything unhashable)."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.value is self.value

  def __hash__(self):
    return id(self.value)


def _static_key(value):
  """``value`` as part of a jit cache key: a functools.partial by its function and arguments
  (recursively), arrays and unhashable values by identity, anything else as itself."""
  if isinstance(value, functools.partial):
    return (functools.partial, _static_key(value.func), tuple(_static_key(a) for a in value.args),
            tuple(sorted((k, _static_key(v)) for k, v in value.keywords.items())))
  if isinstance(value, (jax.Array, np.ndarray)):
    return _ByIdentity(value)
  try:
    hash(value)
  except TypeError:
    return _ByIdentity(value)
  return value


class StaticFunction:
  """A loss function as the jitted step's static argument. ``functools.partial`` objects built
  alike (the same function, arguments equal or identical) are one key, so
  ``train_step(state, batch, functools.partial(loss_fn, model.apply))`` in a loop traces and
  compiles once, where a partial object on its own compares by identity."""

  __slots__ = ("fn", "_key", "_hash")

  def __init__(self, fn: Callable):
    self.fn = fn
    self._key = _static_key(fn)
    self._hash = hash(self._key)

  def __eq__(self, other):
    return isinstance(other, StaticFunction) and self._key == other._key

  def __hash__(self):
    return self._hash

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)


class RetraceWarning(UserWarning):
  """train_step is given a different ``loss_fn`` at each call, so it traces and compiles anew."""


_WARNED = object()
# (a loss function's code, the state's structure) -> the distinct static keys seen with them
_LOSS_CODES: dict = {}
_RETRACE_WARN_AT = 4  # distinct loss_fn keys for one state (a few variants are legitimate)


def _warn_new_loss_function(loss_fn: "StaticFunction", state) -> None:
  """Warns (once per code and state structure) when ``loss_fn`` is the fourth distinct static
  argument with the code of earlier ones for states of one structure (one model and
  optimizer): a lambda written inside a training loop, or a functools.partial whose arguments
  change from call to call (an array compares by identity). ``loss_fn`` is a static argument
  of the jitted step, so each one traces and compiles the step again."""
  fn = loss_fn.fn
  while isinstance(fn, functools.partial) or hasattr(fn, "__wrapped__"):
    fn = fn.func if isinstance(fn, functools.partial) else fn.__wrapped__
  code = getattr(fn, "__code__", None)
  if code is None:
    return
  where = (code, jax.tree.structure(state))
  seen = _LOSS_CODES.setdefault(where, set())
  if seen is _WARNED:
    return
  seen.add(loss_fn)
  if len(seen) >= _RETRACE_WARN_AT:
    _LOSS_CODES[where] = _WARNED
    warnings.warn(
        f"train_step got {len(seen)} different loss_fn arguments with the code of "
        f"{getattr(fn, '__qualname__', fn)} ({code.co_filename}:{code.co_firstlineno}): loss_fn "
        "is a static argument of the jitted step, so each new one traces and compiles the step "
        "again. Define the function once outside the training loop (a module-level function, "
        "or a functools.partial of one: partials built alike are one step), and pass values "
        "that change from step to step (an RNG key, an array) in the batch: in a partial they "
        "are constants of the compiled step, and arrays compare by identity.",
        RetraceWarning, stacklevel=3)


def _deleted_leaves(state) -> list:
  """Paths of ``state``'s arrays whose buffers were donated (deleted)."""
  return [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(state)
          if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
          and leaf.is_deleted()]


def _lower(state: TrainState, batch: Any, loss_fn: Callable, has_aux: bool = False,
           skip_nonfinite: bool = True):
  _check_not_data_parallel(state, batch)
  return _train_step_jit.lower(state, batch, StaticFunction(loss_fn), has_aux, bool(skip_nonfinite))


train_step.lower = _lower  # type: ignore[attr-defined]
