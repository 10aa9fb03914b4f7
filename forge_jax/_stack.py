"""A stack of identical blocks whose backward pass updates stacked weights in place.

Large-model trainers scan over layers (``nn.scan``) for compile time. Under a
scan, autodiff builds the cotangent of every stacked parameter as a *new*
stacked buffer, so a per-layer FORGE layer that returns its new weight as a
cotangent would hold two copies of the stacked weights and states
(measured: 8.84 GiB vs optax's 7.19, ``../shared/FINDINGS.md``).

:class:`ScannedStack` instead wraps the whole stack in one ``jax.custom_vjp``:

* forward: ``lax.scan`` over the layers that takes each block's VJP and saves,
  stacked over layers, the residuals its activation checkpointing keeps
  (``remat``/``remat_policy``, as ``nn.remat``/``jax.checkpoint``: the
  default saves only each block's input and recomputes the rest; without
  remat it saves what the block's backward needs but elementwise functions of
  it (:func:`save_all_but_elementwise`); a
  ``jax.checkpoint_policies`` policy saves what it allows). The residuals
  never include the stacked kernels and states: the backward reads them live;
* backward: a ``fori_loop`` from the last layer to the first that carries the
  stacked FORGE kernels and their optimizer states. For layer ``l`` it runs
  the block's VJP from the saved residuals (recomputing what they lack),
  handing each ``forge_jax.Dense`` its kernel and state as a (stack, layer)
  box (:class:`forge_jax._dense.StackSlice`): the fused kernel updates layer
  ``l`` inside the stacked buffers, in place, with no per-layer slice copies.
  The gradients of the other stacked parameters (norm scales, biases) are
  collected into a stacked gradient, which is small.

Without a ``"forge_state"`` collection (initialization, evaluation, or a model
whose blocks use ``flax.linen.Dense`` and are trained by optax) the stack is an
ordinary ``nn.scan`` over the block, with the same activation checkpointing,
so FORGE and optax runs of one model are compared with matched activation
memory.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax import traverse_util

from forge_jax import _dense
from forge_jax import _fused

FORGE_STATE = _dense.FORGE_STATE


class _Body(nn.Module):
  """Adapts ``block(x, *args) -> x`` to the ``(carry, x) -> (carry, y)`` of nn.scan."""

  block: Callable[..., nn.Module]

  @nn.compact
  def __call__(self, carry, *args):
    return self.block(name="block")(carry, *args), None


def _index(tree, l):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, keepdims=False), tree)


def _update(tree, new, l):
  return jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), l, 0), tree, new)


def _zeros_ct(x):
  if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _depends_on_inputs(jaxpr, inputs=None) -> list[bool]:
  """For each output of ``jaxpr``, whether it may depend on the inputs marked in ``inputs``
  (default: all), rather than only on constants. Conservative: the outputs of an equation
  that reads a dependent value all depend, except that calls (jit, remat, custom
  derivatives) are followed inside, where a mask built from iotas stays constant."""
  Literal = jax.extend.core.Literal
  varying = {v for v, d in zip(jaxpr.invars, inputs or [True] * len(jaxpr.invars)) if d}
  for eqn in jaxpr.eqns:
    reads = [not isinstance(v, Literal) and v in varying for v in eqn.invars]
    if not any(reads):
      continue
    inner = _called_jaxpr(eqn)
    writes = _depends_on_inputs(inner, reads) if inner is not None else [True] * len(eqn.outvars)
    varying.update(v for v, d in zip(eqn.outvars, writes) if d)
  return [not isinstance(v, Literal) and v in varying for v in jaxpr.outvars]


def _called_jaxpr(eqn):
  """The jaxpr an equation calls once with its own inputs and outputs, or None (loops too)."""
  if eqn.primitive.name in ("scan", "while"):
    return None
  for name in ("jaxpr", "call_jaxpr"):
    inner = getattr(eqn.params.get(name), "jaxpr", eqn.params.get(name))
    if (hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars)
        and len(inner.outvars) == len(eqn.outvars)):
      return inner
  return None


class _Residuals(struct.PyTreeNode):
  """What the forward scan saves for the backward loop, and where each leaf of a layer's VJP goes.

  ``treedef`` is the structure of one layer's VJP; ``where[i]`` says where its
  ``i``-th leaf comes from in the backward loop at layer ``l``: ``("stacked", j)``,
  layer ``l`` of ``stacked[j]``; ``("shared", j)``, ``shared[j]`` (the same at
  every layer); ``("live", j)``, the loop's ``j``-th live value.
  """

  stacked: list
  shared: list
  treedef: Any = struct.field(pytree_node=False)
  where: tuple = struct.field(pytree_node=False)


# Elementwise and layout primitives: cheap to recompute in the backward pass, where XLA fuses
# them into the ops that read them. ``name`` (``checkpoint_name``) is the identity: a named
# value is saved where what it names is (a product, an attention output), and recomputed where
# that is elementwise (Llama's ``mlp_hidden = silu(gate) * up``, from the saved gate and up).
_ELEMENTWISE = frozenset({
    "abs", "add", "add_any", "and", "broadcast_in_dim", "concatenate", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expand_dims", "ge", "gt",
    "integer_pow", "iota", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "name",
    "ne", "neg", "not", "or", "pow", "reduce_precision", "reshape", "rsqrt", "select_n", "sign",
    "sin", "slice", "split", "sqrt", "square", "squeeze", "sub", "tanh", "transpose",
})


def save_all_but_elementwise(prim, *_, **__) -> bool:
  """The residual policy of a scanned stack without activation checkpointing: save the output
  of every operation except elementwise and layout ones, which the backward pass recomputes.
  ``checkpoint_name`` counts as the identity it is: a named value is saved where the value it
  names would be.

  An unrolled step keeps its activations live and XLA fuses the cheap ops between them into
  their consumers. A scan has no such freedom: every residual of a layer's VJP is written to a
  stacked buffer of its own. Saved as they are, jax's residuals of a Llama block include
  several elementwise functions of one value (the gate projection ``g``, ``sigmoid(g)``,
  ``silu(g)``, ...) and float32 upcasts of bfloat16 activations: on the H200, Llama-3.1-8B at
  1x1024, 3.4 GB more stacked residuals than the values they are computed from, written in
  the forward pass and read back in the backward.
  """
  return prim.name not in _ELEMENTWISE


def _policy(remat: bool, policy: Any) -> Callable:
  """A stacked block's residual policy: ``policy`` (default: only the block's input) when
  ``remat``, else :func:`save_all_but_elementwise`."""
  if not remat:
    return save_all_but_elementwise
  if policy is None:
    return jax.checkpoint_policies.nothing_saveable
  return _StackedGemmAsDot(policy)


class _StackedGemmAsDot:
  """``policy`` that judges a product of the Mosaic stacked GEMM (a stacked layer's forward
  product on a Hopper GPU, named by ``forge_jax._fused.stacked_dot``) as the ``dot_general`` it
  stands for, so that ``dots_saveable`` and its kin save it as they save XLA's dot. Hashable and
  equal by the policy it wraps."""

  def __init__(self, policy: Callable):
    self.policy = policy

  def __call__(self, prim, *avals, **params):
    if params.get("name") == _fused.STACKED_DOT_NAME:
      return self.policy(jax.lax.dot_general_p, *avals,
                         dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
                         preferred_element_type=None)
    return self.policy(prim, *avals, **params)

  def __eq__(self, other):
    return isinstance(other, _StackedGemmAsDot) and other.policy == self.policy

  def __hash__(self):
    return hash((_StackedGemmAsDot, self.policy))


def _checkpointed(fn: Callable, remat: bool, policy: Any) -> Callable:
  """``fn`` under ``jax.checkpoint`` with :func:`_policy`."""
  # Under a scan, CSE across iterations cannot undo the remat (flax's advice for remat in scan).
  return jax.checkpoint(fn, policy=_policy(remat, policy), prevent_cse=False)


def _stack_vjp(block_apply: Callable, length: int, remat: bool = True, policy: Any = None):
  """The custom-VJP function of a whole stack, for one block structure.

  The forward scan takes each block's VJP (``jax.vjp`` of the block, under
  ``jax.checkpoint(policy=policy)`` when ``remat``) and saves its residuals
  stacked over layers (once, where they do not vary with the layer), except
  those that are the block's own inputs: the
  stacked FORGE kernels and states, the layer index, the slices of the other
  parameters and the broadcast ``args``, recognized by identity (as
  ``jax.vjp`` itself tells the arguments it keeps from the values it
  computes). The backward loop hands those back from its live values, so no
  residual is a copy of a weight: each layer's backward reads the stacks the
  loop carries, which it has not yet updated at that layer.
  """

  def split(params, forge):
    flat_p, flat_f = _dense.flat_variables(params), _dense.flat_variables(forge)
    managed = sorted(flat_f)  # FORGE kernels, by path inside the block
    rest = sorted(p for p in flat_p if p not in flat_f)
    return flat_p, flat_f, managed, rest

  def layer_vjp(block, managed, rest, kernels, states, rest_p, l, x_l):
    """Layer ``l``'s output and VJP, and the values it was given that a residual may be."""
    # FORGE kernels and states enter the block as (stack, layer) boxes: each forge_jax.Dense
    # reads its layer from the stacked buffer and, in the backward pass, updates it there, so
    # the backward loop carries the stacks through the kernels in place, with no per-layer
    # slice copies. Other parameters are sliced as usual.
    rest_l = [_index(a, l) for a in rest_p]
    p_l = traverse_util.unflatten_dict({
        **{p: _dense.StackSlice(k, l) for p, k in zip(managed, kernels)},
        **dict(zip(rest, rest_l)),
    })
    f_l = traverse_util.unflatten_dict({p: _dense.StackSlice(s, l) for p, s in zip(managed, states)})
    y, vjp_fn = jax.vjp(block, p_l, f_l, x_l)
    return y, vjp_fn, jax.tree.leaves((kernels, states, rest_l)) + [l]

  @jax.custom_vjp
  def run(params, forge, x, args):
    def body(carry, layer_vars):
      p, f = layer_vars
      return block_apply(p, f, carry, args), None

    y, _ = jax.lax.scan(body, x, (params, forge), length=length)
    return y

  def fwd(params, forge, x, args):
    flat_p, flat_f, managed, rest = split(params, forge)
    kernels, states = [flat_p[p] for p in managed], [flat_f[p] for p in managed]
    rest_p = [flat_p[p] for p in rest]
    block = _checkpointed(lambda p, f, x_l: block_apply(p, f, x_l, args), remat, policy)
    stack_types = {(a.shape, a.dtype) for a in jax.tree.leaves((kernels, states)) if a.ndim > 1}
    layout = {}  # set while a layer is traced

    def layer(x_l, l):
      """Layer l's output and the residuals it saves (each once), and where its VJP's leaves go."""
      y, vjp_fn, given = layer_vjp(block, managed, rest, kernels, states, rest_p, l, x_l)
      live = {id(v): i for i, v in enumerate(given + jax.tree.leaves(args))}
      leaves, layout["treedef"] = jax.tree.flatten(vjp_fn)
      where, saved, index = [], [], {}
      for leaf in leaves:
        if id(leaf) in live:
          where.append(("live", live[id(leaf)]))
        elif id(leaf) in index:  # one value kept for several uses (x of q, k and v): saved once
          where.append(("saved", index[id(leaf)]))
        else:
          if (jnp.shape(leaf), jnp.result_type(leaf)) in stack_types:
            raise NotImplementedError(
                "a residual of a ScannedStack block has the shape and dtype of a whole stacked "
                "FORGE kernel or state: this jax's jax.vjp does not keep the stacks it is given "
                "as they are, and saving them per layer would copy the stack once per layer. "
                "Please report it with the jax version.")
          index[id(leaf)] = len(saved)
          where.append(("saved", len(saved)))
          saved.append(leaf)
      layout["where"] = where
      return y, saved

    # Residuals that depend on neither the layer's input nor its index (functions of `args`
    # alone, e.g. a broadcast attention mask) are the same at every layer: kept once, in the
    # loop's carry, instead of stacked.
    probe = jax.make_jaxpr(layer)(x, jnp.int32(0))
    n_y = len(jax.tree.leaves(x))
    varying = _depends_on_inputs(probe.jaxpr)[n_y:]
    shared_init = [jnp.zeros(a.shape, a.dtype) for a, v in zip(probe.out_avals[n_y:], varying) if not v]

    # The stacked residuals are carried buffers that each layer writes its slice of, allocated
    # without the pass over them that lax.scan's zero-filled outputs cost.
    stacked_init = [_fused.stack_buffer((length, *a.shape), a.dtype, tag=j) for j, (a, v)
                    in enumerate(zip(probe.out_avals[n_y:], varying)) if v]

    def body(l, carry):
      x_l, _, stacked = carry
      y, saved = layer(x_l, l)
      per_layer = [a for a, v in zip(saved, varying) if v]
      stacked = [jax.lax.dynamic_update_index_in_dim(buf, a, l, 0) for buf, a in zip(stacked, per_layer)]
      return y, [a for a, v in zip(saved, varying) if not v], stacked

    y, shared, stacked = jax.lax.fori_loop(0, length, body, (x, shared_init, stacked_init))
    slot = {}  # saved index -> (kind, index in its list)
    for j, v in enumerate(varying):
      kind = "stacked" if v else "shared"
      slot[j] = (kind, sum(1 for k, _ in slot.values() if k == kind))
    where = tuple(w if w[0] == "live" else slot[w[1]] for w in layout["where"])
    return y, (params, forge, args, _Residuals(stacked, shared, layout["treedef"], where))

  def bwd(res, dy):
    params, forge, args, saved = res
    flat_p, _, managed, rest = split(params, forge)
    rest_p = [flat_p[p] for p in rest]

    def body(i, carry):
      dx, kernels, states, sq, grads = carry
      l = length - 1 - i
      # The block's VJP at layer l from its saved residuals and the loop's live values: the
      # stacks it carries (updated at the layers above l only), slices of the other parameters.
      given = jax.tree.leaves((kernels, states, [_index(a, l) for a in rest_p])) + [l]
      live = given + jax.tree.leaves(args)
      found = {"live": live, "stacked": _index(saved.stacked, l), "shared": saved.shared}
      vjp_fn = jax.tree.unflatten(saved.treedef, [found[kind][j] for kind, j in saved.where])
      ct_p, ct_f, dx = vjp_fn(dx)
      ct_p, ct_f = _dense.flat_variables(ct_p), _dense.flat_variables(ct_f)
      # A FORGE kernel's cotangent is its new (stacked) value; its state's is
      # the new state stack (counts untouched: train_step advances them once).
      kernels = [ct_p[p].stack for p in managed]
      states = [
          _dense.KernelState(ct_f[p].stack.opt._replace(count=old.opt.count), old.grad_sq_norm)
          for p, old in zip(managed, states)
      ]
      sq = [q + ct_f[p].stack.grad_sq_norm for q, p in zip(sq, managed)]
      grads = _update(grads, [ct_p[p] for p in rest], l)
      return dx, kernels, states, sq, grads

    flat_f = _dense.flat_variables(forge)
    kernels = [flat_p[p] for p in managed]
    states = [flat_f[p] for p in managed]
    sq = [jnp.zeros((length,), jnp.float32) for _ in managed]
    grads = [jnp.zeros_like(flat_p[p]) for p in rest]
    with _dense.apply_bound_here():
      dx, kernels, states, sq, grads = jax.lax.fori_loop(
          0, length, body, (dy, kernels, states, sq, grads)
      )
    ct_params = traverse_util.unflatten_dict({**dict(zip(managed, kernels)), **dict(zip(rest, grads))})
    ct_forge = traverse_util.unflatten_dict({
        p: _dense.KernelState(
            s.opt._replace(count=_zeros_ct(s.opt.count)), q
        )
        for p, s, q in zip(managed, states, sq)
    })
    return ct_params, ct_forge, dx, jax.tree.map(_zeros_ct, args)

  run.defvjp(fwd, bwd)
  return run


class ScannedStack(nn.Module):
  """``length`` identical blocks, scanned, trained in place by FORGE.

  Parameters and FORGE states are stacked along a leading axis of size
  ``length`` under ``<name>/layers/block/...`` (the layout of
  ``nn.scan(..., variable_axes={True: 0})``).

  Attributes:
    block: a zero-argument factory of the block module (for example
      ``functools.partial(MyBlock, config)``); the block maps ``(x, *args)``
      to a new ``x`` of the same shape and dtype. ``args`` are broadcast to
      every layer and are not differentiated.
    length: the number of layers.
    remat: activation checkpointing of each block, as ``nn.remat``: with
      ``False`` the forward pass saves every activation the block's backward
      needs except elementwise ones (:func:`save_all_but_elementwise`; fastest,
      most memory); with ``True`` it saves what
      ``remat_policy`` allows and the backward recomputes the rest.
    remat_policy: a ``jax.checkpoint_policies`` policy (e.g. ``dots_saveable``,
      or ``save_anything_except_these_names(...)`` for tensors the block
      names with ``jax.ad_checkpoint.checkpoint_name``); ``None``: save
      nothing inside a block (only its input).

  Both paths, FORGE's and the plain ``nn.scan``, checkpoint alike, and no
  policy saves the FORGE kernels or states: the backward reads the live
  stacks. Restrictions of the FORGE path: the block must be deterministic (no
  RNGs) and must not create other mutable collections.
  """

  block: Callable[..., nn.Module]
  length: int
  remat: bool = True
  remat_policy: Any = None

  @nn.compact
  def __call__(self, x, *args):
    if self.remat_policy is not None and not (self.remat and callable(self.remat_policy)):
      raise ValueError(
          f"ScannedStack(remat={self.remat!r}, remat_policy={self.remat_policy!r}): a policy "
          "is a callable from jax.checkpoint_policies (e.g. "
          "jax.checkpoint_policies.dots_saveable) and needs remat=True; remat=False saves "
          "everything without one.")
    forge_training = self.has_variable(FORGE_STATE, "layers") and not self.is_initializing()
    if not forge_training:
      body = nn.remat(_Body, policy=_policy(self.remat, self.remat_policy), prevent_cse=False)
      scan = nn.scan(
          body,
          variable_axes={True: 0},
          split_rngs={"params": True},
          in_axes=(nn.broadcast,) * len(args),
          length=self.length,
      )
      y, _ = scan(self.block, name="layers")(x, *args)
      return y
    variables = self.variables
    unknown = set(variables) - {"params", FORGE_STATE}
    if unknown:
      raise ValueError(
          f"forge_jax.ScannedStack cannot carry the collections {sorted(unknown)} "
          "through its fused backward pass; only 'params' and 'forge_state'."
      )
    params = variables["params"]["layers"]
    forge = variables[FORGE_STATE]["layers"]
    block_factory = self.block

    # The blocks' FORGE kernels take their streams from their full paths: two stacks
    # of the same block draw independent rounding bits, and train_step sees which
    # kernels' backward passes ran under the paths of their variables.
    prefix = (*_dense._PATH_PREFIX.get(), *self.scope.path, "layers")

    def block_apply(p, f, x_l, args_l):
      try:
        with _dense.path_prefix(prefix):
          y, _ = _Body(block_factory).apply({"params": p, FORGE_STATE: f}, x_l, *args_l)
      except flax.errors.InvalidRngError as e:
        raise ValueError(
            f"a block of ScannedStack {'/'.join(self.scope.path)} draws random numbers "
            "(dropout?). Its FORGE path runs the blocks without RNGs, because the backward "
            "pass may recompute a block and would need the same random bits again: make the "
            "block deterministic while training with FORGE, or unroll the layers."
        ) from e
      return y

    return _stack_vjp(block_apply, self.length, self.remat, self.remat_policy)(params, forge, x, tuple(args))
