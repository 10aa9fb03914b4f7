"""Walking a jaxpr, shared by the tests that inspect a traced step."""

from __future__ import annotations

from typing import Iterator

import jax


def eqns(jaxpr) -> Iterator:
  """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from eqns(sub)
