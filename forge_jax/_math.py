"""Primitives the optimizer rules may use, in a form every backend lowers.

The rules run in three places: XLA (the optax face and the reference backend),
Pallas kernels lowered through Triton, and Mosaic GPU kernels. Any primitive
that one of those cannot lower gets its portable spelling here, once.
"""

import jax.numpy as jnp


def sqrt(x):
  """Square root of a non-negative float array."""
  return jnp.sqrt(x)


_TAN_PI_8 = 0.41421356237309503
_PI_4 = 0.7853981633974483
_PI_2 = 1.5707963267948966
_PI = 3.141592653589793


def atan2(y, x):
  """``arctan2(y, x)`` of float32 arrays from add, mul, div, abs, compares and selects.

  Mosaic GPU lowers ``atan2_p`` to the MLIR ``math.atan2`` op, which becomes a
  libdevice call that its pipeline may not link; this spelling needs nothing
  beyond the primitives every rule already uses, and it is the one definition
  all backends run, so the kernels equal the optax face exactly.

  Within 3 float32 ulp of the correctly rounded ``arctan2`` wherever the
  result is a normal float (tests/test_stabilizers.py), with its values at
  zeros, infinities and NaN; the sign of a zero input is not read (``y = -0``
  gives ``+0`` or ``+pi``, ``x = -0`` the ``x = +0`` result). Cephes'
  ``atanf`` polynomial on ``[-tan(pi/8), tan(pi/8)]`` after an octant reduction.
  """
  ay, ax = jnp.abs(y), jnp.abs(x)
  swap = ay > ax
  num = jnp.where(swap, ax, ay)  # num <= den: the ratio is in [0, 1]
  den = jnp.where(swap, ay, ax)
  # Above tan(pi/8): atan(r) = pi/4 + atan((r - 1) / (r + 1)). inf/inf lands here too.
  mid = (num > _TAN_PI_8 * den) | (num == jnp.inf)
  t = jnp.where(mid, num - den, num) / jnp.where(mid, num + den, den)
  t = jnp.where(num == den, 0.0, t)  # 0/0 and inf/inf (a finite num == den gives 0 anyway)
  z = t * t
  p = ((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1
  r = jnp.where(mid, _PI_4, 0.0) + (p * z * t + t)
  r = jnp.where(swap, _PI_2 - r, r)
  r = jnp.where(x < 0, _PI - r, r)
  return jnp.where(y < 0, -r, r)
