"""How many times each FORGE backward pass runs in a step, read from the step's jaxpr.

A FORGE layer's backward pass overwrites its weight and returns the new weight
where autodiff expects a gradient. If it runs twice in one step (a parent
module called twice, a loss that applies the model twice, ``nn.scan`` or
``nn.vmap`` over a FORGE module), autodiff *adds* the two new weights; under a
mapped axis (``pmap``, ``shard_map``) each replica applies its own partial
update. Either way the weights come out silently wrong. In a branch of ``lax.cond`` it would
update only in the steps that take that branch, where optax updates every parameter.

Every FORGE backward pass binds :data:`backward_p`, an identity on its ``dy``
that carries the module path. :func:`count_backward_passes` walks the jaxpr of
a whole backward pass and counts those equations, multiplied by the trip count
of every loop around them. Reading the jaxpr, not Python side effects while
tracing, keeps the count right when jax reuses a cached trace (a ``jax.jit``'d
apply inside the loss). ``forge_jax.ScannedStack`` runs each layer's backward
pass once in a loop over its layers: those passes bind the marker with
``stacked=True`` and the innermost loop around them is not counted. The same jaxpr shows a
FORGE weight that the loss also uses outside its layer: autodiff adds that use's gradient to
the new weight (:func:`check_new_values_unmixed`).

train_step's non-finite guard gives each FORGE update a flag that is only known once the
forward pass has run. A FORGE backward pass traced under ``fused_backward(apply=DEFERRED)``
binds :data:`apply_flag_p` for it, a placeholder that train_step replaces with the flag, a new
input of the backward pass's jaxpr (:func:`thread_apply_flag`), so one linearization and one
trace of the backward pass serve both the checks and the step.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

backward_p = jex_core.Primitive("forge_jax_backward")
backward_p.def_impl(lambda dy, **_: dy)
# The input's own aval: its sharding and varying-manual-axes annotations pass through.
backward_p.def_abstract_eval(lambda dy, **_: dy)
mlir.register_lowering(backward_p, lambda ctx, dy, **_: [dy])
ad.deflinear2(backward_p, lambda ct, dy, **params: [ct])


# fused_backward(apply=DEFERRED): FORGE layers bind apply_flag_p for their flag.
DEFERRED = object()

# The placeholder of train_step's non-finite flag, a bool scalar, replaced by the flag
# (thread_apply_flag). Left in place (a whole backward pass inside train_step's lax.cond, which
# runs it only for a finite loss), it is true: apply.
apply_flag_p = jex_core.Primitive("forge_jax_apply_flag")
apply_flag_p.def_abstract_eval(lambda: jax.core.ShapedArray((), np.bool_))
apply_flag_p.def_impl(lambda: np.bool_(True))
mlir.register_lowering(apply_flag_p, lambda ctx: [mlir.ir_constant(np.bool_(True))])


def apply_flag(apply):
  """The flag a FORGE update takes from ``fused_backward(apply=apply)``: ``apply`` itself, or
  for :data:`DEFERRED` a placeholder bound here."""
  return apply_flag_p.bind() if apply is DEFERRED else apply


_CHECKPOINTS = ("remat2", "checkpoint")


def _thread(jaxpr, flag, memo: dict, threaded: dict):
  """``jaxpr`` (a core.Jaxpr) with every placeholder replaced by ``flag``, a Var the caller makes
  its input; None where one sits in a sub-jaxpr other than a jax.checkpoint's or a jit call's
  (a loop body), whose parameters this does not rewrite. ``threaded``: the bodies already
  rewritten, by identity, so that bodies jax shares stay shared."""
  subst: dict = {}
  fix = lambda vs: [subst.get(v, v) if isinstance(v, jex_core.Var) else v for v in vs]
  eqns = []
  for eqn in jaxpr.eqns:
    if subst:
      eqn = eqn.replace(invars=fix(eqn.invars))
    if eqn.primitive is apply_flag_p:
      subst[eqn.outvars[0]] = flag
      continue
    subs = [getattr(s, "jaxpr", s) for s in jex_core.jaxprs_in_params(eqn.params)]
    if any(_binds(sub, apply_flag_p, memo) for sub in subs):
      params = _with_flag_input(eqn, flag, memo, threaded)
      if params is None:
        return None
      eqn = eqn.replace(invars=[flag, *eqn.invars], params=params)
    eqns.append(eqn)
  return jaxpr.replace(eqns=eqns, outvars=fix(jaxpr.outvars))


def _threaded_body(body, flag, memo, threaded):
  """``body`` (a core.Jaxpr) taking the flag as its first input, or None (memoized by identity)."""
  if id(body) not in threaded:
    inner = jex_core.Var(flag.aval)
    new = _thread(body, inner, memo, threaded)
    threaded[id(body)] = None if new is None else new.replace(invars=[inner, *new.invars])
  return threaded[id(body)]


def _with_flag_input(eqn, flag, memo, threaded):
  """The parameters of ``eqn`` (a jax.checkpoint or a jit call whose body binds placeholders)
  with the flag as a new first operand, or None for any other primitive."""
  name = eqn.primitive.name
  if name in _CHECKPOINTS:
    body = _threaded_body(eqn.params["jaxpr"], flag, memo, threaded)
    return None if body is None else {**eqn.params, "jaxpr": body}
  if name in ("jit", "pjit"):
    # The flag's sharding and layout are left to the compiler, as a jit's unannotated input's.
    unspecified = [s for s in (*eqn.params["in_shardings"], *eqn.params["out_shardings"])
                   if type(s).__name__ == "UnspecifiedValue"]
    closed = eqn.params["jaxpr"]
    body = _threaded_body(closed.jaxpr, flag, memo, threaded)
    if body is None or not unspecified:
      return None
    return {**eqn.params, "jaxpr": jex_core.ClosedJaxpr(body, closed.consts),
            "in_shardings": (unspecified[0], *eqn.params["in_shardings"]),
            "in_layouts": (None, *eqn.params["in_layouts"]),
            "donated_invars": (False, *eqn.params["donated_invars"])}
  return None


def thread_apply_flag(closed_jaxpr):
  """``closed_jaxpr`` with the flag as a new first input in place of every placeholder, those in
  jax.checkpoint bodies (nn.remat) and jit calls (a jitted apply in the loss) included, or None
  where one sits elsewhere (see :func:`_thread`)."""
  flag = jex_core.Var(jax.core.ShapedArray((), np.bool_))
  body = _thread(closed_jaxpr.jaxpr, flag, {}, {})
  if body is None:
    return None
  return jex_core.ClosedJaxpr(body.replace(invars=[flag, *body.invars]), closed_jaxpr.consts)


def _refuse_batching(args, dims, *, path, stacked, guarded):
  del args, dims, stacked, guarded
  raise ValueError(
      f"the backward pass of the FORGE kernel {path} is being vmapped (jax.vmap or nn.vmap "
      "over a FORGE module, or over a train step): each mapped instance would apply its own "
      "update to the one weight. FORGE layers cannot run under vmap; use flax.linen.Dense "
      "for that layer, or forge_jax.ScannedStack for a stack of identical blocks."
  )


batching.primitive_batchers[backward_p] = _refuse_batching


def mark_backward(dy, path: str, stacked: bool = False, guarded: bool = False):
  """``dy``, marked as the cotangent of one backward pass of the FORGE kernel ``path``;
  ``guarded``: its update takes train_step's placeholder flag (or its value)."""
  return backward_p.bind(dy, path=path, stacked=stacked, guarded=guarded)


def unguarded_paths(jaxpr) -> set:
  """The FORGE kernels whose backward pass in ``jaxpr`` does not take train_step's placeholder
  flag: traced without it, in an earlier step whose transpose jax cached and reused here."""
  found: set = set()
  memo: dict = {}

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive is backward_p and not eqn.params["guarded"]:
        found.add(eqn.params["path"])
      for sub in jex_core.jaxprs_in_params(eqn.params):
        sub = getattr(sub, "jaxpr", sub)
        if _binds(sub, backward_p, memo):
          walk(sub)
  walk(getattr(jaxpr, "jaxpr", jaxpr))
  return found


# Primitives whose body runs once per device or shard, each on its part of the data. A
# tensor-parallel layer's own shard_map (forge_jax._parallel) holds no marker: the marker is
# bound on the whole dy before it, once per layer, and the shard_map only splits the update of
# the weight's slices, whose gradients are complete on each device.
_MAPPED = ("shard_map", "xla_pmap", "pmap")


class ReuseError(ValueError):
  """A FORGE backward pass that would run more than once, or per shard, in one step, or a
  FORGE weight that the loss also uses outside its layer."""


# A FORGE layer's backward pass returns its new weight and state where autodiff expects their
# cotangents. If the loss also uses the weight elsewhere (read from the variables: a tied
# embedding, a weight shared with another layer), autodiff adds that use's gradient to the new
# weight. Every new value is marked with new_value_p (an identity, no HLO); the step's
# backward pass must not add anything to a marked value.
new_value_p = jex_core.Primitive("forge_jax_new_value")
new_value_p.def_impl(lambda x, **_: x)
new_value_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(new_value_p, lambda ctx, x, **_: [x])


def mark_new_values(tree, path: str):
  """``tree``'s floating-point arrays, marked as the new values of the FORGE kernel ``path``."""
  def mark(a):
    if isinstance(a, jax.Array) and jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
      return new_value_p.bind(a, path=path)
    return a
  return jax.tree.map(mark, tree)


# Primitives that call their sub-jaxpr once with their operands as its inputs, in order.
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
# Loops whose body's outputs are the loop's, in order (a ScannedStack's new stacks leave its
# backward loop as its carry).
_LOOPS = ("scan", "while")


def _binds(jaxpr, prim, memo: dict) -> bool:
  """Whether ``jaxpr`` (a core.Jaxpr) binds ``prim`` at any depth (memoized by identity: jax
  shares the jaxprs of its small jitted functions between their uses)."""
  key = (id(jaxpr), prim)
  if key not in memo:
    memo[key] = any(
        eqn.primitive is prim or any(
            _binds(getattr(s, "jaxpr", s), prim, memo) for s in jex_core.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns)
  return memo[key]


def _mixed(jaxpr, marked_in, found, memo) -> list:
  """The FORGE path each output of ``jaxpr`` (a core.Jaxpr) carries a new value of (or None),
  given its inputs'; paths of new values that an ``add_any`` sums with anything go in ``found``.
  A value computed from a new value carries its path (conservatively: any use of one but a
  call's pass-through is unexpected in a backward pass)."""
  if not any(marked_in) and not _binds(jaxpr, new_value_p, memo):
    return [None] * len(jaxpr.outvars)
  env = {v: p for v, p in zip(jaxpr.invars, marked_in) if p}
  get = lambda v: env.get(v) if isinstance(v, jex_core.Var) else None
  for eqn in jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    subs = [getattr(s, "jaxpr", s) for s in jex_core.jaxprs_in_params(eqn.params)]
    if eqn.primitive is new_value_p:
      outs = [eqn.params["path"]]
    elif eqn.primitive.name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(ins):
      outs = _mixed(subs[0], ins, found, memo)
    else:
      if eqn.primitive.name == "add_any":
        found.update(p for p in ins if p)
      carried = next((p for p in ins if p), None)
      outs = [carried] * len(eqn.outvars)
      for sub in subs:  # a loop's body, a cond's branch: new values made and summed inside
        made = _mixed(sub, [None] * len(sub.invars), found, memo)
        if eqn.primitive.name in _LOOPS and len(made) == len(outs):  # the body's carry (and ys)
          outs = [o or m for o, m in zip(outs, made)]
    env.update((v, p) for v, p in zip(eqn.outvars, outs) if p)
  return [get(v) for v in jaxpr.outvars]


def check_new_values_unmixed(jaxpr) -> None:
  """Raises :class:`ReuseError` naming every FORGE kernel whose new weight or state the step's
  backward pass ``jaxpr`` sums with a gradient of another use."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  found: set = set()
  _mixed(jaxpr, [None] * len(jaxpr.invars), found, {})
  if found:
    raise ReuseError(
        f"the FORGE kernels {sorted(found)} are also used outside their forge_jax.Dense: the "
        "loss reads the weight (or its optimizer state) from the variables elsewhere (a tied "
        "embedding or output head, a weight shared with another layer), or differentiates "
        "through the layer inside the loss (a jax.grad in the loss: a gradient penalty, an "
        "adversarial input). A FORGE layer's backward pass returns the updated weight where "
        "the gradient goes, so autodiff would add the other use's gradient to the new weight. "
        "FORGE cannot train a weight used that way: use flax.linen.Dense for it (optax updates "
        "it), tie through a flax module (nn.Embed.attend, as models' tie_word_embeddings "
        "does), or wrap the other use in jax.lax.stop_gradient if it should not train the "
        "weight."
    )


def _count(jaxpr, mult: float, outer: float, memo=None) -> collections.Counter:
  """Uses per path in ``jaxpr`` (a core.Jaxpr) run ``mult`` times; ``outer``: the runs
  outside the innermost loop (a stacked layer's marker is counted that many times)."""
  memo = {} if memo is None else memo
  counts = collections.Counter()
  for eqn in jaxpr.eqns:
    prim = eqn.primitive
    if prim is backward_p:
      counts[eqn.params["path"]] += outer if eqn.params["stacked"] else mult
      continue
    subs = [s for s in jex_core.jaxprs_in_params(eqn.params)
            if _binds(getattr(s, "jaxpr", s), backward_p, memo)]
    if not subs:
      continue
    if prim.name in _MAPPED:
      inner = _count_all(subs, 1, 1, memo)
      if inner:
        raise ReuseError(
            f"the backward pass of the FORGE kernels {sorted(inner)} runs inside "
            f"{prim.name}: each device would update the weight from its own part of the batch "
            "and the replicas would drift apart. FORGE layers cannot run under a mapped axis "
            "(pmap, shard_map); call forge_jax.train_step outside it with the batch replicated, "
            "or use flax.linen.Dense + optax for data parallelism."
        )
      continue
    if prim.name == "cond":
      inner = _count_all(subs, 1, 1, memo)
      if inner:
        raise ReuseError(
            f"the backward pass of the FORGE kernels {sorted(inner)} runs inside a branch of "
            "lax.cond or lax.switch (nn.cond, nn.switch): such a layer would be updated only in "
            "the steps that take its branch, while optax updates every parameter at every step "
            "(with a zero gradient where a branch is not taken: weight decay, momentum). Compute "
            "both branches and select the result with jnp.where (each FORGE layer then runs once "
            "a step, with a zero gradient where it is not selected), or use flax.linen.Dense for "
            "that layer."
        )
      continue
    if prim.name == "scan":
      length = eqn.params["length"]
      counts.update(_count_all(subs, mult * length, mult, memo))
    elif prim.name == "while":
      counts.update(_count_all(subs, math.inf, mult, memo))
    else:
      counts.update(_count_all(subs, mult, outer, memo))
  return counts


def _count_all(subs, mult, outer, memo) -> collections.Counter:
  total = collections.Counter()
  for s in subs:
    total.update(_count(getattr(s, "jaxpr", s), mult, outer, memo))
  return total


def count_backward_passes(jaxpr) -> collections.Counter:
  """``{module path: runs}`` of the FORGE backward passes in ``jaxpr`` (a (Closed)Jaxpr).

  Raises:
    ReuseError: if one runs inside ``shard_map`` or ``pmap``.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return _count(jaxpr, 1, 1)


def check_single_use(counts: collections.Counter) -> None:
  """Raises :class:`ReuseError` naming every FORGE kernel whose backward pass runs twice."""
  reused = {p: n for p, n in counts.items() if n != 1}
  if not reused:
    return
  what = ", ".join(f"{p} ({'an unbounded loop' if n == math.inf else f'{int(n)} times'})"
                   for p, n in sorted(reused.items()))
  raise ReuseError(
      f"the backward pass of FORGE kernels runs more than once in one step: {what}. A FORGE "
      "layer overwrites its weight inside its backward pass and returns the new weight where "
      "the gradient goes, so a second run would add up two new weights. This happens when a "
      "module holding a forge_jax.Dense is applied twice (a parent module called twice, a loss "
      "that calls apply_fn twice, nn.scan or a loop over a FORGE module, gradient "
      "accumulation). Use flax.linen.Dense for a shared layer (optax updates it), give each use "
      "its own weights, concatenate the inputs into one apply, or use forge_jax.ScannedStack "
      "for a scanned stack of identical blocks."
  )


def check_no_mapped_axis() -> None:
  """Raises :class:`ReuseError` if the caller is being traced under pmap or shard_map."""
  names = [n for n in jex_core.unsafe_get_axis_names_DO_NOT_USE()]
  if names:
    raise ReuseError(
        f"forge_jax.train_step is traced under the mapped axes {names} (jax.pmap or "
        "jax.shard_map): each device would update the FORGE weights from its own part of the "
        "batch, and the replicas would drift apart (the fused kernel consumes each device's "
        "partial gradient tile by tile and never forms the all-reduced one). Call train_step "
        "outside pmap/shard_map with the batch replicated, or train with flax.linen.Dense + "
        "optax for data parallelism."
    )
