"""The optax face of forge_jax's optimizers.

Each alias here (``adamw``, ``lion``, ...) has optax 0.2.8's name, signature
and defaults and returns a :class:`ForgeOptimizer`: a genuine
``optax.GradientTransformationExtraArgs`` (so it drops into any optax loop,
``optax.chain`` included) that also carries its :class:`ElementwiseRule`, the
form the fused kernels execute. ``update`` is built from that same rule, so
the numbers of the optax path and the fused path come from one definition.

Differences from optax, on purpose:

* The state is one flat ``NamedTuple`` per optimizer (``count`` first, then the
  slots, e.g. ``AdamState(count, mu, nu)``), not optax's tuple of chained
  states; the slot names are optax's.
* The update is computed in float32 (or wider) whatever the parameter dtype,
  as the kernels do; updates are returned in the gradient's dtype and slots
  are stored in their own dtype (``mu_dtype`` etc.). For float32 parameters
  the numbers equal optax's to float32 rounding.
* Complex parameters are not supported (FORGE fuses real-valued GEMMs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from forge_jax import _rules
from forge_jax._rules import ElementwiseRule, ScalarOrSchedule

MaskOrFn = Optional[Union[Any, Callable[[Any], Any]]]


class ForgeOptimizer(optax.GradientTransformationExtraArgs):
  """An optax gradient transformation that FORGE can also run inside a GEMM.

  It behaves exactly like the ``optax.GradientTransformationExtraArgs`` it is
  (``init``, ``update``, usable in ``optax.chain``), and adds:

  Attributes:
    rule: the :class:`ElementwiseRule` (per-step scalars + elementwise update)
      that the fused kernels call on each gradient tile.
    mask: the weight-decay mask given to the alias (or ``None``).
  """

  # The rule and mask ride on the `update` function object: libraries rebuild
  # NamedTuples field by field (flax does for module attributes), which would
  # drop anything stored on the instance itself.
  @property
  def rule(self) -> ElementwiseRule:
    return self.update.forge_rule

  @property
  def mask(self) -> MaskOrFn:
    return self.update.forge_mask

  def decay_mask(self, params) -> Any:
    """A pytree of Python bools, one per leaf of ``params``: apply weight decay?"""
    if self.mask is None:
      return jax.tree.map(lambda _: True, params)
    mask = self.mask(params) if callable(self.mask) else self.mask
    # The mask may be a prefix of params: broadcast each mask leaf.
    return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask, params)


def _make(rule: ElementwiseRule, mask: MaskOrFn = None) -> ForgeOptimizer:
  """Builds the optax face (init/update) of ``rule``."""

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    for leaf in leaves:
      if jnp.iscomplexobj(leaf):
        raise NotImplementedError(
            f"forge_jax.{rule.name}: complex parameters are not supported "
            f"(got a leaf of dtype {jnp.result_type(leaf)}); use optax for them."
        )
    per_leaf = jax.tree.map(rule.init_slots, params)
    slots = [
        jax.tree.map(lambda _, s: s[i], params, per_leaf)
        for i in range(len(rule.slot_names))
    ]
    return rule.state_cls(jnp.zeros([], jnp.int32), *slots)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if rule.uses_weight and params is None:
      raise ValueError(
          f"forge_jax.{rule.name} with weight decay needs the current params: "
          "call update(grads, state, params)."
      )
    scalars = rule.scalars(state.count)
    slot_trees = tuple(state[1:])
    if params is None:
      params = jax.tree.map(lambda _: None, updates)
      decay = jax.tree.map(lambda _: False, updates)
    else:
      decay = opt.decay_mask(params)
    treedef = jax.tree.structure(updates)
    g_leaves = treedef.flatten_up_to(updates)
    p_leaves = treedef.flatten_up_to(params)
    d_leaves = treedef.flatten_up_to(decay)
    s_leaves = [treedef.flatten_up_to(t) for t in slot_trees]
    new_u, new_s = [], [[] for _ in slot_trees]
    for i, (g, p, d) in enumerate(zip(g_leaves, p_leaves, d_leaves)):
      slots = tuple(s[i] for s in s_leaves)
      u, slots_out = apply_rule(rule, g, p, slots, scalars, decay=d)
      new_u.append(u)
      for j, s in enumerate(slots_out):
        new_s[j].append(s)
    new_state = rule.state_cls(
        _rules.safe_increment(state.count),
        *[treedef.unflatten(s) for s in new_s],
    )
    return treedef.unflatten(new_u), new_state

  update_fn.forge_rule = rule
  update_fn.forge_mask = mask
  opt = ForgeOptimizer(init_fn, update_fn)
  return opt


def apply_rule(rule: ElementwiseRule, g, w, slots, scalars, *, decay: bool = True):
  """Runs ``rule.update`` on whole arrays in float32; casts results back.

  Returns ``(u, new_slots)`` with ``u`` in ``g``'s dtype and each slot in its
  own storage dtype. This is the XLA reference the kernels are tested against.
  """
  compute = jnp.promote_types(jnp.result_type(g), jnp.float32)
  up = lambda x: None if x is None else jnp.asarray(x).astype(compute)
  u, new_slots = rule.update(
      up(g), up(w), tuple(up(s) for s in slots), scalars, decay=decay
  )
  new_slots = tuple(n.astype(s.dtype) for n, s in zip(new_slots, slots))
  return u.astype(jnp.result_type(g)), new_slots


def as_forge_optimizer(optimizer) -> ForgeOptimizer:
  """Returns ``optimizer`` if FORGE can fuse it; raises a clear error otherwise."""
  if isinstance(optimizer, ForgeOptimizer):
    return optimizer
  if isinstance(optimizer, optax.GradientTransformation):
    raise ValueError(
        f"{optimizer!r} is a plain optax transformation: FORGE can only fuse an "
        "elementwise optimizer whose rule it knows. Build it with forge_jax "
        "(forge_jax.adamw, forge_jax.lion, ...). Transformations that need a "
        "global reduction, such as optax.clip_by_global_norm, cannot run inside "
        "the GEMM: every tile would need every other tile's gradient first."
    )
  raise TypeError(f"expected a forge_jax optimizer, got {type(optimizer).__name__}.")


# ----------------------------------------------------------------------------
# The aliases (optax 0.2.8 names, signatures and defaults).
# ----------------------------------------------------------------------------


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
) -> ForgeOptimizer:
  r"""The Adam optimizer (Kingma & Ba, 2015), as ``optax.adam``.

  With :math:`t` = ``count + 1`` and learning rate :math:`\alpha_t`:

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
    \hat m_t = m_t / (1-\beta_1^t), \quad \hat v_t = v_t / (1-\beta_2^t), \\
    u_t = -\alpha_t \, \hat m_t / (\sqrt{\hat v_t + \bar\varepsilon} + \varepsilon).

  With ``nesterov=True`` (NAdam, Dozat 2016),
  :math:`\hat m_t = \beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)`.

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    mu_dtype: storage dtype of the first moment (``None``: the parameter's).
    nesterov: use Nesterov momentum (NAdam).

  Returns:
    A :class:`ForgeOptimizer` with state ``AdamState(count, mu, nu)``.

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2015.
  """
  return _make(
      _rules.AdamRule(learning_rate, b1, b2, eps, eps_root, mu_dtype, None, nesterov)
  )


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
) -> ForgeOptimizer:
  r"""Adam with decoupled weight decay (Loshchilov & Hutter, 2019), as ``optax.adamw``.

  The Adam direction of :func:`adam` plus :math:`\lambda w_t`, all scaled by the
  learning rate: :math:`u_t = -\alpha_t (\hat m_t / (\sqrt{\hat v_t +
  \bar\varepsilon} + \varepsilon) + \lambda w_t)`.

  .. warning::
    As in optax (and unlike ``torch.optim.AdamW``) the default weight decay is
    ``1e-4`` and it is multiplied by the learning rate.

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    mu_dtype: storage dtype of the first moment (``None``: the parameter's).
    weight_decay: decay rate :math:`\lambda` (float or schedule).
    mask: a pytree of bools (or a prefix of the params, or a function of the
      params returning one): ``True`` where weight decay applies.
    nesterov: use Nesterov momentum (NAdamW).

  Returns:
    A :class:`ForgeOptimizer` with state ``AdamState(count, mu, nu)``.

  References:
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return _make(
      _rules.AdamRule(
          learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, nesterov
      ),
      mask,
  )


nadam = functools.partial(adam, nesterov=True)
nadam.__doc__ = r"""NAdam (Dozat, 2016): :func:`adam` with ``nesterov=True``, as ``optax.nadam``."""

nadamw = functools.partial(adamw, nesterov=True)
nadamw.__doc__ = r"""NAdamW: :func:`adamw` with ``nesterov=True``, as ``optax.nadamw``."""


def radam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
) -> ForgeOptimizer:
  r"""Rectified Adam (Liu et al., 2020), as ``optax.radam``.

  With :math:`\rho_\infty = 2/(1-\beta_2) - 1` and
  :math:`\rho_t = \rho_\infty - 2t\beta_2^t/(1-\beta_2^t)`: when
  :math:`\rho_t \ge` ``threshold`` the Adam direction is multiplied by
  :math:`r_t = \sqrt{(\rho_t-4)(\rho_t-2)\rho_\infty / ((\rho_\infty-4)(\rho_\infty-2)\rho_t)}`;
  otherwise the update is the bias-corrected momentum :math:`\hat m_t` alone.
  Both branches are per-step scalars, so the rule stays elementwise.

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    threshold: the :math:`\rho_t` from which the variance is tractable.
    nesterov: use Nesterov momentum.

  Returns:
    A :class:`ForgeOptimizer` with state ``AdamState(count, mu, nu)``.

  References:
    Liu et al., `On the Variance of the Adaptive Learning Rate and Beyond
    <https://arxiv.org/abs/1908.03265>`_, 2020.
  """
  return _make(
      _rules.RAdamRule(learning_rate, b1, b2, eps, eps_root, threshold, nesterov)
  )


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: MaskOrFn = None,
) -> ForgeOptimizer:
  r"""Lion (Chen et al., 2023), as ``optax.lion``.

  .. math::
    c_t = \mathrm{sign}((1-\beta_1) g_t + \beta_1 m_{t-1}), \quad
    m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t, \quad
    u_t = -\alpha_t (c_t + \lambda w_t).

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    b1: interpolation between momentum and gradient for the direction.
    b2: decay rate of the momentum.
    mu_dtype: storage dtype of the momentum (``None``: the parameter's).
    weight_decay: decay rate :math:`\lambda` (float or schedule).
    mask: where weight decay applies (see :func:`adamw`).

  Returns:
    A :class:`ForgeOptimizer` with state ``LionState(count, mu)``.

  References:
    Chen et al., `Symbolic Discovery of Optimization Algorithms
    <https://arxiv.org/abs/2302.06675>`_, 2023.
  """
  return _make(_rules.LionRule(learning_rate, b1, b2, mu_dtype, weight_decay), mask)


def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> ForgeOptimizer:
  r"""RMSProp (Tieleman & Hinton, 2012), as ``optax.rmsprop``.

  .. math::
    \nu_t = \rho \nu_{t-1} + (1-\rho) g_t^2, \quad
    u_t = -\alpha_t \, g_t / \sqrt{\nu_t + \varepsilon}.

  ``centered`` subtracts the squared mean :math:`\mu_t^2` (an EMA of
  :math:`g`) inside the root; ``bias_correction`` divides the moments by
  :math:`1-\rho^t`; ``momentum`` then applies ``optax.trace`` to the scaled
  update (:math:`\tau_t = u_t + \beta \tau_{t-1}`; Nesterov returns
  :math:`u_t + \beta\tau_t`).

  .. warning::
    As in optax, ``eps`` is inside the square root by default; PyTorch puts it
    outside (``eps_in_sqrt=False``).

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    decay: decay rate :math:`\rho` of the moments.
    eps: the stabilising term.
    initial_scale: initial value of :math:`\nu`.
    eps_in_sqrt: put ``eps`` inside the square root.
    centered: use the centered (variance) form.
    momentum: momentum decay, or ``None`` for none.
    nesterov: Nesterov momentum (needs ``momentum``).
    bias_correction: bias-correct the moments.

  Returns:
    A :class:`ForgeOptimizer`; its state holds ``count``, ``nu``, and ``mu``
    when centered and ``trace`` with momentum.

  References:
    Hinton, `Lecture 6.5 - rmsprop
    <https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_;
    Graves, `Generating Sequences With Recurrent Neural Networks
    <https://arxiv.org/abs/1308.0850>`_, 2013 (centered).
  """
  return _make(
      _rules.RMSPropRule(
          learning_rate, decay, eps, initial_scale, eps_in_sqrt, centered,
          momentum, nesterov, bias_correction,
      )
  )


def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
) -> ForgeOptimizer:
  r"""AdaGrad (Duchi et al., 2011), as ``optax.adagrad``.

  .. math::
    G_t = G_{t-1} + g_t^2, \quad u_t = -\alpha_t \, g_t / \sqrt{G_t + \varepsilon}
    \ (0 \text{ where } G_t = 0).

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    initial_accumulator_value: initial value of :math:`G`.
    eps: added inside the square root.

  Returns:
    A :class:`ForgeOptimizer` with state ``AdagradState(count, sum_of_squares)``.

  References:
    Duchi et al., `Adaptive Subgradient Methods for Online Learning and
    Stochastic Optimization <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
  """
  return _make(_rules.AdagradRule(learning_rate, initial_accumulator_value, eps))


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
) -> ForgeOptimizer:
  r"""Stochastic gradient descent with optional momentum, as ``optax.sgd``.

  Without momentum :math:`u_t = -\alpha_t g_t`. With momentum :math:`\beta`:
  :math:`\tau_t = g_t + \beta\tau_{t-1}` and :math:`u_t = -\alpha_t \tau_t`
  (Nesterov: :math:`u_t = -\alpha_t (g_t + \beta\tau_t)`). No dampening.

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    momentum: momentum decay :math:`\beta`, or ``None`` for plain SGD.
    nesterov: use Nesterov momentum.
    accumulator_dtype: storage dtype of the momentum (``None``: the parameter's).

  Returns:
    A :class:`ForgeOptimizer` with state ``SGDState(count)`` or
    ``SGDMomentumState(count, trace)``.

  References:
    Sutskever et al., `On the importance of initialization and momentum in deep
    learning <http://proceedings.mlr.press/v28/sutskever13.pdf>`_, 2013.
  """
  return _make(_rules.SGDRule(learning_rate, momentum, nesterov, accumulator_dtype))
