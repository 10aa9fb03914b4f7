"""A stack of identical blocks whose backward pass updates stacked weights in place.

Large-model trainers scan over layers (``nn.scan``) for compile time. Under a
scan, autodiff builds the cotangent of every stacked parameter as a *new*
stacked buffer, so a per-layer FORGE layer that returns its new weight as a
cotangent would hold two copies of the stacked weights and states
(measured: 8.84 GiB vs optax's 7.19, ``../shared/FINDINGS.md``).

:class:`ScannedStack` instead wraps the whole stack in one ``jax.custom_vjp``:

* forward: ``lax.scan`` over the layers, saving only each block's input
  (activation checkpointing at block boundaries, like
  ``nn.remat(block, policy=nothing_saveable)``);
* backward: a ``fori_loop`` from the last layer to the first that carries the
  stacked FORGE kernels and their optimizer states. For layer ``l`` it
  recomputes the block from its saved input and runs the block's VJP, handing
  each ``forge_jax.Dense`` its kernel and state as a (stack, layer) box
  (:class:`forge_jax._dense.StackSlice`): the fused kernel updates layer
  ``l`` inside the stacked buffers, in place, with no per-layer slice copies.
  The gradients of the other stacked parameters (norm scales, biases) are
  collected into a stacked gradient, which is small.

Without a ``"forge_state"`` collection (initialization, evaluation, or a model
whose blocks use ``flax.linen.Dense`` and are trained by optax) the stack is an
ordinary ``nn.scan`` over the block, with the same block-boundary
checkpointing when ``remat=True``, so FORGE and optax runs of one model are
compared with matched activation checkpointing.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from forge_jax import _dense

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


def _stack_vjp(block_apply: Callable, length: int):
  """The custom-VJP function of a whole stack, for one block structure."""

  @jax.custom_vjp
  def run(params, forge, x, args):
    def body(carry, layer_vars):
      p, f = layer_vars
      return block_apply(p, f, carry, args), None

    y, _ = jax.lax.scan(body, x, (params, forge), length=length)
    return y

  def fwd(params, forge, x, args):
    def body(carry, layer_vars):
      p, f = layer_vars
      return block_apply(p, f, carry, args), carry  # save each block's input

    y, xs = jax.lax.scan(body, x, (params, forge), length=length)
    return y, (params, forge, xs, args)

  def bwd(res, dy):
    params, forge, xs, args = res
    flat_p, flat_f = _dense.flat_variables(params), _dense.flat_variables(forge)
    managed = sorted(flat_f)  # FORGE kernels, by path inside the block
    rest = sorted(p for p in flat_p if p not in flat_f)

    def unflat(kernels, others):
      return traverse_util.unflatten_dict({**dict(zip(managed, kernels)), **dict(zip(rest, others))})

    def body(i, carry):
      dx, kernels, states, sq, grads = carry
      l = length - 1 - i
      # FORGE kernels and states enter the block as (stack, layer) boxes: each
      # forge_jax.Dense updates its layer inside the stacked buffer, so the
      # loop carries the stacks through the kernels in place, with no
      # per-layer slice copies. Other parameters are sliced as usual.
      boxed = [_dense.StackSlice(k, l) for k in kernels]
      p_l = unflat(boxed, [_index(flat_p[p], l) for p in rest])
      f_l = traverse_util.unflatten_dict(
          {p: _dense.StackSlice(st, l) for p, st in zip(managed, states)})
      x_l = jax.lax.dynamic_index_in_dim(xs, l, keepdims=False)
      _, vjp_fn = jax.vjp(lambda p, f, x: block_apply(p, f, x, args), p_l, f_l, x_l)
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

    kernels = [flat_p[p] for p in managed]
    states = [flat_f[p] for p in managed]
    sq = [jnp.zeros((length,), jnp.float32) for _ in managed]
    grads = [jnp.zeros_like(flat_p[p]) for p in rest]
    dx, kernels, states, sq, grads = jax.lax.fori_loop(
        0, length, body, (dy, kernels, states, sq, grads)
    )
    ct_params = unflat(kernels, grads)
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
    remat: checkpoint at block boundaries in the plain ``nn.scan`` path too
      (the FORGE path always does), so that FORGE and optax runs compare
      with the same activation memory.
    remat_policy: the ``jax.checkpoint_policies`` policy for that plain path
      (default: save nothing inside a block).

  Restrictions of the FORGE path: the block must be deterministic (no RNGs)
  and must not create other mutable collections.
  """

  block: Callable[..., nn.Module]
  length: int
  remat: bool = True
  remat_policy: Any = None

  @nn.compact
  def __call__(self, x, *args):
    forge_training = self.has_variable(FORGE_STATE, "layers") and not self.is_initializing()
    if not forge_training:
      body = _Body
      if self.remat:
        policy = self.remat_policy or jax.checkpoint_policies.nothing_saveable
        body = nn.remat(_Body, policy=policy, prevent_cse=False)
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
            "pass recomputes each block and would need the same random bits again: make the "
            "block deterministic while training with FORGE, or unroll the layers."
        ) from e
      return y

    return _stack_vjp(block_apply, self.length)(params, forge, x, tuple(args))
