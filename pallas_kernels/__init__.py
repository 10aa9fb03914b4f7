"""Pallas GPU kernels for FORGE, each with a plain-jnp reference beside it.

This package is a leaf: it imports jax only. A kernel receives the optimizer's
elementwise update as a function argument (plus its per-step scalars) and
knows nothing of optimizers, Flax or models.
"""

__all__: list[str] = []
