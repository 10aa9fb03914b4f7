"""The optimizer rule, evaluated so that Mosaic GPU can lower it.

The rule (shared with XLA and the Triton kernel) is traced once on an epilogue sub-tile and its
jaxpr evaluated in the kernel, with ``sqrt`` spelled from ``rsqrt`` where this jax's Mosaic GPU
cannot lower it (jax 0.10.2, 0.11.1) and ``array / scalar`` as ``array * (1 / scalar)``: the same
number on the GPU, whose float32 division is ``div.full.f32`` (that product for divisors in
[2**-126, 2**126]); within 1 ulp under the interpreter. On the GPU, with ``fast_math``, the
remaining ``sqrt`` and tile / tile divisions are PTX's ftz approximations
(:func:`fast_math_rewrite`). Why: docs/mosaic_kernel.md, "The rule, from its jaxpr".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import lax
import jax.extend.core as jex_core
import jax.numpy as jnp

Array = jax.Array
# The kernel is lowered with warpgroup semantics on every jax version: jax >= 0.11's default
# (jax 0.10's is "Lane"), what jax's own Hopper matmul asks for, and what every H200 run used.
LOWERING_SEMANTICS = "Warpgroup"


def portable_sqrt(x: Array) -> Array:
  """``sqrt`` from ``rsqrt``: within a few ulp for finite ``x > 0``; NaN for ``x < 0`` and NaN
  as ``sqrt``; the ``where`` keeps ``sqrt(+-0) == +-0`` and ``sqrt(inf) == inf`` (``0 * inf``
  would be NaN)."""
  root = x * lax.rsqrt(x)
  return jnp.where(x == 0, x, jnp.where(x == jnp.inf, x, root))


# Primitive -> portable spelling, applied where this jax's Mosaic GPU has no lowering for it.
REWRITES: dict[Any, Callable[..., Array]] = {jex_core.primitives.sqrt_p: portable_sqrt}
_INLINED_CALLS = {
    jex_core.primitives.jit_p: "jaxpr",
    jex_core.primitives.closed_call_p: "call_jaxpr",
    jex_core.primitives.custom_jvp_call_p: "call_jaxpr",
}


def lowers_natively(prim) -> bool:
  """Whether this jax's Mosaic GPU has a warpgroup lowering rule for ``prim``. Private API:
  any surprise counts as "no", which only costs the portable spelling."""
  try:
    from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # pylint: disable=g-import-not-at-top

    return any(prim in table for (lowering_sem, primitive_sem), table
               in mgpu_lowering.mosaic_lowering_rules.items()
               if lowering_sem.name == LOWERING_SEMANTICS and primitive_sem.name == "Warpgroup")
  except Exception:  # pylint: disable=broad-except
    return False


def active_rewrites(force: bool = False) -> dict[Any, Callable[..., Array]]:
  """The rewrites the kernel applies on this jax (all of them with ``force``)."""
  return {prim: fn for prim, fn in REWRITES.items() if force or not lowers_natively(prim)}


def _is_scalar(v) -> bool:
  return tuple(getattr(v.aval, "shape", ())) == ()


def ptx_pointwise(instr: str, *xs: Array) -> Array:
  """One PTX float32 instruction (``instr d, a[, b]``) per element of WGMMA-layout tiles, as
  inline Mosaic GPU code (``FragmentedArray._lift_fast_instr``: private API, present in jax
  0.10.2-0.11.2)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top

  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout,) * len(xs),
                     return_type=plgpu.ShapeDtypeStruct(xs[0].shape, jnp.float32, layout=layout))
  def _instr(ctx, *arrays):  # pylint: disable=unused-argument
    return arrays[0]._pointwise(mgpu.FragmentedArray._lift_fast_instr(instr), *arrays[1:])  # pylint: disable=protected-access

  return _instr(*xs)


def _has_inline_ptx() -> bool:
  """Whether this jax has what :func:`ptx_pointwise` uses (else the exact forms stay)."""
  try:
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return hasattr(plgpu, "inline_mgpu") and hasattr(mgpu.FragmentedArray, "_lift_fast_instr")


def _tile_f32(invals, outvar) -> bool:
  """Whether an equation's operands and result are float32 tiles of one 2-d shape."""
  shape = tuple(outvar.aval.shape)
  return (len(shape) == 2 and outvar.aval.dtype == jnp.float32
          and all(getattr(v, "shape", None) == shape and v.dtype == jnp.float32 for v in invals))


def fast_math_rewrite(eqn, invals):
  """``sqrt`` and tile / tile division as PTX's ``sqrt.approx.ftz.f32`` / ``div.approx.ftz.f32``
  (the forms without denormal range handling), or None for any other equation. Equal to the
  default lowering (``sqrt.approx.f32``, ``div.full.f32``) wherever operands and result are
  normal floats, zeros, infinities or NaN and the divisor's magnitude is below 2**126; a
  denormal operand or result counts as zero (docs/mosaic_kernel.md, "The rule, from its jaxpr")."""
  prim = eqn.primitive
  if not _tile_f32(invals, eqn.outvars[0]) or not _has_inline_ptx():
    return None
  if prim is jex_core.primitives.sqrt_p:
    return [ptx_pointwise("sqrt.approx.ftz.f32", *invals)]
  if prim is lax.div_p:
    return [ptx_pointwise("div.approx.ftz.f32", *invals)]
  return None


def eval_for_mosaic(closed_jaxpr, *args, rewrites: dict[Any, Callable[..., Array]],
                    fast_math: bool = False) -> list:
  """Evaluates a closed jaxpr as the kernel does (see the module docstring), inlining nested
  ``jit`` / ``closed_call`` / ``custom_jvp_call`` bodies so their primitives are rewritten too;
  with ``fast_math``, :func:`fast_math_rewrite` first."""
  # jax 0.10: a ClosedJaxpr wraps a Jaxpr; jax 0.11: one class, ``.jaxpr`` is the object itself.
  jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
  env = dict(zip(jaxpr.constvars, getattr(closed_jaxpr, "consts", ())))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    prim = eqn.primitive
    if fast_math and (fast := fast_math_rewrite(eqn, invals)) is not None:
      outvals = fast
    elif prim in rewrites:
      outvals = [rewrites[prim](*invals)]
    elif prim is lax.div_p and _is_scalar(eqn.invars[1]) and not _is_scalar(eqn.invars[0]):
      outvals = [invals[0] * (1.0 / invals[1])]
    elif prim in _INLINED_CALLS:
      outvals = eval_for_mosaic(eqn.params[_INLINED_CALLS[prim]], *invals, rewrites=rewrites,
                                fast_math=fast_math)
    else:
      outvals = prim.bind(*invals, **prim.get_bind_params(eqn.params))
      outvals = outvals if prim.multiple_results else [outvals]
    env.update(zip(eqn.outvars, outvals))
  return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class TracedRule:
  """``update_fn`` traced once on one epilogue sub-tile; called as the rule itself."""

  closed_jaxpr: Any
  out_tree: Any
  force_rewrites: bool = False
  fast_math: bool = False  # fast_math_rewrite (on the GPU; the interpreter has no inline PTX)

  def __call__(self, g, w, slots, scalar_leaves):
    outs = eval_for_mosaic(self.closed_jaxpr, g, w, *slots, *scalar_leaves,
                           rewrites=active_rewrites(self.force_rewrites), fast_math=self.fast_math)
    return jax.tree.unflatten(self.out_tree, outs)


def trace_rule(update_fn, shape, num_slots: int, scalars, *, force_rewrites: bool = False,
               fast_math: bool = False) -> TracedRule:
  """Traces ``update_fn`` on float32 tiles of ``shape``; ValueError unless it is elementwise
  and returns one new value per slot."""
  tile = jax.ShapeDtypeStruct(shape, jnp.float32)
  scalar_avals = jax.tree.map(lambda _: jax.ShapeDtypeStruct((), jnp.float32), scalars)
  closed, out_shape = jax.make_jaxpr(update_fn, return_shape=True)(
      tile, tile, (tile,) * num_slots, scalar_avals)
  if len(out_shape[1]) != num_slots:
    raise ValueError(f"update_fn returned {len(out_shape[1])} slots for {num_slots} given")
  for s in jax.tree.leaves(out_shape):
    if tuple(s.shape) != tuple(shape):
      raise ValueError(f"update_fn must be elementwise: got an output of shape {s.shape}")
  return TracedRule(closed, jax.tree.structure(out_shape), force_rewrites, fast_math)
