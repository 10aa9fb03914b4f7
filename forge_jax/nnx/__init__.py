"""forge-jax for Flax NNX: FORGE layers, stacks and the train step as NNX objects.

* :class:`Linear`: ``flax.nnx.Linear``'s attributes and parameters plus its
  optimizer; its backward pass updates the kernel and its optimizer state (an
  :class:`OptState` variable, ``kernel_opt``) in place, through the same custom
  VJP and fused kernels as the Linen :class:`forge_jax.Dense`.
* :class:`ScannedStack`: identical blocks stacked over a leading layer axis
  (``nnx.vmap``-built), scanned, with FORGE kernels updated inside the stacks.
* :class:`Optimizer` and :func:`train_step`: ``train_step(model, optimizer,
  batch, loss_fn)`` runs :func:`forge_jax.train_step` on the model's variables
  and writes the results back into ``model`` and ``optimizer``.

Example::

  opt = forge_jax.adamw(1e-3)
  model = MyModel(optimizer=opt, rngs=nnx.Rngs(0))   # uses forge_jax.nnx.Linear
  optimizer = forge_jax.nnx.Optimizer(model, opt, wrt=nnx.Param)
  metrics = forge_jax.nnx.train_step(model, optimizer, batch, loss_fn)
"""

from forge_jax.nnx._linear import Linear
from forge_jax.nnx._linear import OptState
from forge_jax.nnx._stack import ScannedStack
from forge_jax.nnx._step import Optimizer
from forge_jax.nnx._step import train_step

__all__ = ["Linear", "OptState", "Optimizer", "ScannedStack", "train_step"]
