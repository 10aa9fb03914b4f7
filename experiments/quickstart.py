"""Quickstart: forge_jax's optimizers side by side with optax's.

Trains a small MLP regression with each optimizer twice, once through optax
and once through forge_jax's optax face (the same elementwise rule the fused
kernels run), and prints the final losses and the largest parameter
difference. Later issues grow this into a FORGE vs optax training run.

    python -m experiments.quickstart
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import forge_jax


def _init(key, sizes):
  params = []
  for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
    params.append({"w": jax.random.normal(k, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)})
  return params


def _loss(params, x, y):
  h = x
  for layer in params[:-1]:
    h = jax.nn.gelu(h @ layer["w"] + layer["b"])
  out = h @ params[-1]["w"] + params[-1]["b"]
  return jnp.mean((out - y) ** 2)


def train(optimizer, steps: int, key):
  k_data, k_init = jax.random.split(key)
  x = jax.random.normal(k_data, (256, 16))
  y = jnp.sin(x[:, :4] * 2.0)
  params = _init(k_init, [16, 64, 64, 4])
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for _ in range(steps):
    params, state, loss = step(params, state)
  return params, float(loss)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args(argv)
  key = jax.random.PRNGKey(0)
  configs = {
      "adamw": dict(learning_rate=3e-3, weight_decay=1e-2),
      "nadamw": dict(learning_rate=3e-3),
      "radam": dict(learning_rate=3e-3),
      "lion": dict(learning_rate=3e-4),
      "rmsprop": dict(learning_rate=1e-3, centered=True),
      "adagrad": dict(learning_rate=3e-2),
      "sgd": dict(learning_rate=3e-2, momentum=0.9, nesterov=True),
  }
  print(f"{args.steps} steps of a 16-64-64-4 MLP regression on {jax.devices()[0].platform}")
  print(f"{'optimizer':<10} {'optax loss':>12} {'forge_jax loss':>15} {'max |param diff|':>17}")
  for name, kwargs in configs.items():
    p_ref, l_ref = train(getattr(optax, name)(**kwargs), args.steps, key)
    p_ours, l_ours = train(getattr(forge_jax, name)(**kwargs), args.steps, key)
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), p_ref, p_ours)))
    print(f"{name:<10} {l_ref:>12.6f} {l_ours:>15.6f} {diff:>17.2e}")


if __name__ == "__main__":
  main()
