"""Primitives the optimizer rules may use, in a form every backend lowers.

The rules run in three places: XLA (the optax face and the reference backend),
Pallas kernels lowered through Triton, and Mosaic GPU kernels. Any primitive
that one of those cannot lower gets its portable spelling here, once.
"""

import jax.numpy as jnp


def sqrt(x):
  """Square root of a non-negative float array."""
  return jnp.sqrt(x)
