"""``forge_jax.nnx.ScannedStack``: ``length`` identical NNX blocks, scanned, updated in place.

The block's variables are stacked along a leading layer axis (built with
``nnx.vmap`` over the block's constructor, as the NNX scan-over-layers recipe
does). With FORGE kernels in the block the stack runs the Linen
:class:`forge_jax.ScannedStack`'s custom VJP (:func:`forge_jax._stack._stack_vjp`):
its backward loop carries the stacked kernels and optimizer states and each
layer's fused update writes its layer inside them, in place. Without FORGE
kernels (a block of ``flax.nnx.Linear``, trained by optax) it is a plain
``lax.scan`` with the same activation checkpointing, so both are compared with
matched activation memory.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx
from flax import traverse_util

from forge_jax import _dense
from forge_jax import _stack
from forge_jax.nnx import _linear


def _key(path) -> tuple[str, ...]:
  return tuple(str(k) for k in path)


def kernel_key(key: tuple[str, ...]) -> tuple[str, ...]:
  """The path of the kernel an :class:`OptState` at ``key`` belongs to (``.../kernel_opt``)."""
  if key[-1] != "kernel_opt":
    raise ValueError(
        f"an OptState at {'/'.join(key)}: FORGE states live in a forge_jax.nnx.Linear's "
        "`kernel_opt`, next to the `kernel` it trains.")
  return (*key[:-1], "kernel")


class ScannedStack(nnx.Module):
  """``length`` identical blocks, scanned; FORGE kernels in them are updated in place.

  Args:
    block: ``block(rngs) -> nnx.Module``, the constructor of one block, or a
      block module whose variables are already stacked along a leading axis of
      size ``length`` (``nnx.vmap`` of such a constructor, as the NNX
      scan-over-layers recipe builds it); the block maps ``(x, *args)`` to a
      new ``x`` of the same shape and dtype (``args`` are broadcast to every
      layer and not differentiated).
    length: the number of layers.
    rngs: the :class:`flax.nnx.Rngs` the blocks are initialized from (split per
      layer); only with a constructor.
    remat: activation checkpointing of each block, as ``nnx.remat``: ``False``
      saves every activation the backward needs but elementwise ones
      (``forge_jax.save_all_but_elementwise``); ``True`` saves what
      ``remat_policy`` allows and recomputes the rest.
    remat_policy: a ``jax.checkpoint_policies`` policy; ``None``: only each block's input.

  The stacked block is the attribute ``block`` (its variables have a leading
  axis of size ``length``). It may hold ``nnx.Param`` and
  :class:`forge_jax.nnx.OptState` variables only: the FORGE path runs the
  blocks without RNGs or other mutable state, because the backward pass may
  recompute a block.
  """

  def __init__(self, block: Callable[[nnx.Rngs], nnx.Module] | nnx.Module, length: int, *,
               rngs: nnx.Rngs | None = None, remat: bool = True, remat_policy: Any = None):
    if remat_policy is not None and not (remat and callable(remat_policy)):
      raise ValueError(
          f"ScannedStack(remat={remat!r}, remat_policy={remat_policy!r}): a policy is a callable "
          "from jax.checkpoint_policies (e.g. jax.checkpoint_policies.dots_saveable) and needs "
          "remat=True; remat=False saves everything without one.")

    if isinstance(block, nnx.Module):
      shapes = {tuple(jax.numpy.shape(a))[:1] for a in jax.tree.leaves(nnx.state(block))}
      if shapes != {(length,)}:
        raise ValueError(
            f"ScannedStack(block=<{type(block).__name__}>, length={length}): every variable of "
            f"a stacked block needs a leading axis of size {length}; found leading sizes "
            f"{sorted(shapes)}. Build it with nnx.vmap over the block's constructor, or pass "
            "the constructor and rngs=.")
      self.block = block
    else:
      if rngs is None:
        raise ValueError("ScannedStack(block=<constructor>, ...) needs rngs= to initialize the "
                         "blocks.")

      @nnx.split_rngs(splits=length)
      @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=length)
      def make(rngs):
        return block(rngs)

      self.block = make(rngs)
    self.length = length
    self.remat = remat
    self.remat_policy = remat_policy

  def __call__(self, x, *args):
    graphdef, state = nnx.split(self.block)
    flat = [(path, var) for path, var in nnx.to_flat_state(state)]
    policy = self.remat_policy
    if not any(isinstance(v, _linear.OptState) for _, v in flat):
      def body(x_l, s_l):
        return nnx.merge(graphdef, s_l)(x_l, *args), None
      body = _stack._checkpointed(body, self.remat, policy)
      y, _ = jax.lax.scan(body, x, state, length=self.length)
      return y

    params, forge = {}, {}
    for path, var in flat:
      key = _key(path)
      if isinstance(var, _linear.OptState):
        forge[kernel_key(key)] = var.get_value()
      elif isinstance(var, nnx.Param):
        params[key] = var.get_value()
      else:
        raise ValueError(
            f"the block of a forge_jax.nnx.ScannedStack holds {type(var).__name__} at "
            f"{'/'.join(key)}: its FORGE path carries only nnx.Param and forge_jax.nnx.OptState "
            "through its backward pass (a block may be recomputed there, and would need the same "
            "random bits or state again). Make the block deterministic while training with "
            "FORGE, or unroll the layers.")

    def block_apply(p, f, x_l, args_l):
      # p, f: this layer's variables; FORGE kernels and states come as (stack, layer) boxes,
      # which the Linear updates inside the stacked buffers.
      fp, ff = _dense.flat_variables(p), _dense.flat_variables(f)
      items = [(path, var.copy(ff[kernel_key(_key(path))] if isinstance(var, _linear.OptState)
                               else fp[_key(path)])) for path, var in flat]
      return nnx.merge(graphdef, nnx.from_flat_state(items))(x_l, *args_l)

    run = _stack._stack_vjp(block_apply, self.length, self.remat, policy)
    return run(traverse_util.unflatten_dict(params), traverse_util.unflatten_dict(forge), x,
               tuple(args))
