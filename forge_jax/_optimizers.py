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

Every alias also takes ``precision=`` (a :class:`forge_jax.Precision`):
stochastic rounding of bfloat16 weights and bfloat16/int8 state storage,
the same in ``update`` as in the fused kernels. The default is the behaviour
above, unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from forge_jax import _lowp
from forge_jax import _rules
from forge_jax._lowp import Precision
from forge_jax._rules import ElementwiseRule, ScalarOrSchedule
from pallas_kernels import numerics

MaskOrFn = Optional[Union[Any, Callable[[Any], Any]]]


class ForgeOptimizer(optax.GradientTransformationExtraArgs):
  """An optax gradient transformation that FORGE can also run inside a GEMM.

  It behaves exactly like the ``optax.GradientTransformationExtraArgs`` it is
  (``init``, ``update``, usable in ``optax.chain``), and adds:

  Attributes:
    rule: the :class:`ElementwiseRule` (per-step scalars + elementwise update)
      that the fused kernels call on each gradient tile.
    mask: the weight-decay mask given to the alias (or ``None``).
    precision: the :class:`forge_jax.Precision` of weights and states.
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

  @property
  def precision(self) -> Precision:
    return getattr(self.update, "forge_precision", _lowp.DEFAULT)

  def decay_mask(self, params) -> Any:
    """A pytree of Python bools, one per leaf of ``params``: apply weight decay?"""
    if self.mask is None:
      return jax.tree.map(lambda _: True, params)
    mask = self.mask(params) if callable(self.mask) else self.mask
    # The mask may be a prefix of params: broadcast each mask leaf.
    return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask, params)


def _make(
    rule: ElementwiseRule, mask: MaskOrFn = None, precision: Optional[Precision] = None
) -> ForgeOptimizer:
  """Builds the optax face (init/update) of ``rule``, storing as ``precision`` says."""
  precision = _lowp.DEFAULT if precision is None else precision
  if not isinstance(precision, Precision):
    raise ValueError(
        f"precision={precision!r} must be a forge_jax.Precision (or None for the default)."
    )
  _lowp.check_rule(rule, precision)

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    for leaf in leaves:
      if jnp.iscomplexobj(leaf):
        raise NotImplementedError(
            f"forge_jax.{rule.name}: complex parameters are not supported "
            f"(got a leaf of dtype {jnp.result_type(leaf)}); use optax for them."
        )
    per_leaf = jax.tree.map(lambda w: _lowp.init_slots(rule, precision, w), params)
    slots = [
        jax.tree.map(lambda _, s: s[i], params, per_leaf)
        for i in range(len(rule.slot_names))
    ]
    steps = [jax.tree.map(lambda _: jnp.asarray(v, jnp.float32), params)
             for v in rule.step_init_values()]
    return rule.state_cls(jnp.zeros([], jnp.int32), *steps, *slots)

  def update_fn(updates, state, params=None, *, forge_decay_mask=None, **extra_args):
    # forge_decay_mask: the decay mask of `params`, computed by the caller
    # (forge_jax.train_step evaluates a callable mask on the full params, as
    # optax would, and passes it here for the parameters FORGE does not manage).
    del extra_args
    if rule.uses_weight and params is None:
      raise ValueError(
          f"forge_jax.{rule.name} with weight decay needs the current params: "
          "call update(grads, state, params)."
      )
    if precision.stochastic and params is None:
      raise ValueError(
          f"forge_jax.{rule.name} with weight_rounding='stochastic' needs the current "
          "params (the update lands on a stochastically rounded weight): call "
          "update(grads, state, params)."
      )
    slot_trees = rule.slots_of(state)
    step_trees = rule.step_values(state)
    scalars = None if step_trees else rule.scalars(state.count)
    if params is None:
      params = jax.tree.map(lambda _: None, updates)
      decay = jax.tree.map(lambda _: False, updates)
    else:
      decay = opt.decay_mask(params) if forge_decay_mask is None else forge_decay_mask
    treedef = jax.tree.structure(updates)
    g_leaves = treedef.flatten_up_to(updates)
    p_leaves = treedef.flatten_up_to(params)
    d_leaves = treedef.flatten_up_to(decay)
    s_leaves = [treedef.flatten_up_to(t) for t in slot_trees]
    st_leaves = [treedef.flatten_up_to(t) for t in step_trees]
    new_u, new_s = [], [[] for _ in slot_trees]
    for i, (g, p, d) in enumerate(zip(g_leaves, p_leaves, d_leaves)):
      slots = tuple(s[i] for s in s_leaves)
      if step_trees:  # the stabilizers' scalars come from each leaf's step fields
        scalars = rule.scalars(state.count, *(t[i] for t in st_leaves))
      u, slots_out = apply_rule(
          rule, g, p, slots, scalars, decay=d, precision=precision, step=state.count, stream=i
      )
      new_u.append(u)
      for j, s in enumerate(slots_out):
        new_s[j].append(s)
    new_steps = _next_steps(rule, g_leaves, st_leaves)
    new_state = rule.state_cls(
        _rules.safe_increment(state.count),
        *[treedef.unflatten(s) for s in new_steps],
        *[treedef.unflatten(s) for s in new_s],
    )
    return treedef.unflatten(new_u), new_state

  update_fn.forge_rule = rule
  update_fn.forge_mask = mask
  update_fn.forge_precision = precision
  opt = ForgeOptimizer(init_fn, update_fn)
  return opt


def _sq_norm(g) -> jax.Array:
  return jnp.sum(jnp.square(jnp.asarray(g).astype(jnp.float32)))


def _next_steps(rule: ElementwiseRule, g_leaves, st_leaves) -> list:
  """Each step field's new leaves: from the norm of all of ``g_leaves`` (global
  scope) or of each leaf's own gradient (layer scope)."""
  if not st_leaves:
    return []
  if rule.norm_scope == "global":
    total = sum((_sq_norm(g) for g in g_leaves), jnp.zeros((), jnp.float32))
    sq = [total] * len(g_leaves)
  else:
    sq = [_sq_norm(g) for g in g_leaves]
  per_leaf = [rule.next_step(tuple(t[i] for t in st_leaves), sq[i]) for i in range(len(g_leaves))]
  return [[leaf[j] for leaf in per_leaf] for j in range(len(st_leaves))]


def apply_rule(
    rule: ElementwiseRule,
    g,
    w,
    slots,
    scalars,
    *,
    decay: bool = True,
    precision: Optional[Precision] = None,
    step=None,
    stream=0,
):
  """Runs ``rule.update`` on whole arrays in float32; stores results back.

  Returns ``(u, new_slots)``: each slot stored as it came in (its float
  dtype, or re-quantized if int8), ``u`` in ``g``'s dtype. With
  ``precision.weight_rounding="stochastic"`` and a bfloat16 ``w``, ``u`` is
  float32 and lands exactly on the stochastically rounded new weight:
  ``optax.apply_updates`` gives ``round(w + u)`` as the kernels do (exact
  unless one update changes a weight's magnitude by more than 2**15; then
  within one bfloat16 ulp). ``step`` (the count) and ``stream`` (which
  parameter) seed its random bits. This is the XLA reference the kernels are
  tested against.
  """
  precision = _lowp.DEFAULT if precision is None else precision
  compute = jnp.promote_types(jnp.result_type(g), jnp.float32)
  up = lambda x: None if x is None else jnp.asarray(x).astype(compute)
  stored = tuple(_lowp.from_float_view(s) for s in slots)
  u, new_slots = rule.update(
      up(g), up(w), tuple(_lowp.decode_slot(s, compute) for s in stored), scalars, decay=decay
  )
  round_w = precision.stochastic and w is not None and jnp.result_type(w) != compute
  bits = None
  if round_w or any(numerics.codec_of(s).needs_bits for s in stored):
    if step is None:
      raise ValueError("apply_rule with stochastic rounding needs step= (the count).")
    bits = _lowp.element_bits(precision, jnp.shape(g), step, stream)
  new_slots = tuple(
      _lowp.view_like(_lowp.encode_slot(n, s, _value_bits(bits, s, j + 1)), like)
      for j, (n, s, like) in enumerate(zip(new_slots, stored, slots))
  )
  if round_w:
    w32 = up(w)
    new_w = numerics.stochastic_round(w32 + u, bits, jnp.result_type(w))
    # Both are bfloat16 values: their difference is exact in float32.
    return new_w.astype(compute) - w32, new_slots
  return u.astype(jnp.result_type(g)), new_slots


def _value_bits(bits, slot, i):
  if bits is None or not numerics.codec_of(slot).needs_bits:
    return None
  return numerics.value_bits(bits, i)


def as_forge_optimizer(optimizer) -> ForgeOptimizer:
  """Returns ``optimizer`` if FORGE can fuse it; raises a clear error otherwise."""
  if isinstance(optimizer, ForgeOptimizer):
    return optimizer
  if isinstance(optimizer, optax.MultiSteps):
    raise ValueError(
        "optax.MultiSteps (gradient accumulation over micro-batches) cannot wrap a FORGE "
        "optimizer: FORGE applies each layer's update inside its backward pass, so every "
        "micro-batch's backward pass would be an optimizer step, and there is no gradient to "
        "accumulate (that pool is what FORGE removes). The largest effective batch is the "
        "largest batch one train_step fits; use optax with optax.MultiSteps for larger ones.")
  if isinstance(optimizer, optax.GradientTransformation):
    init_name = getattr(optimizer.init, "__qualname__", "")
    if "apply_if_finite" in init_name:
      raise ValueError(
          "optax.apply_if_finite cannot wrap a FORGE optimizer (FORGE updates each layer inside "
          "its backward pass, before any check after it): forge_jax.train_step skips a step "
          "whose loss is not finite itself (skip_nonfinite=True, the default), and FORGE "
          "kernels keep an element whose gradient is not finite (Precision(nonfinite='skip')). "
          "Pass the forge_jax optimizer itself.")
    if "inject_hyperparams" in init_name:
      raise ValueError(
          "optax.inject_hyperparams cannot wrap a FORGE optimizer: its hyperparameters live in "
          "the optax state, which FORGE's kernels (inside the backward pass) do not read. Give a "
          "hyperparameter that changes during training as a schedule instead: a function of "
          "the int32 step count, e.g. forge_jax.adamw(learning_rate=optax.cosine_decay_schedule("
          "...)).")
    raise ValueError(
        f"{optimizer!r} is a plain optax transformation: FORGE can only fuse an "
        "elementwise optimizer whose rule it knows. Build it with forge_jax "
        "(forge_jax.adamw, forge_jax.lion, ...). Transformations that need a "
        "global reduction, such as optax.clip_by_global_norm, cannot run inside "
        "the GEMM: every tile would need every other tile's gradient first. Clipping by "
        "the previous step's global norm can (forge_jax.adamw(..., clip_prev_norm=1.0); "
        "docs/stabilizers.md)."
    )
  raise TypeError(f"expected a forge_jax optimizer, got {type(optimizer).__name__}.")


# ----------------------------------------------------------------------------
# Stabilizers (no gradient pool): an option of every alias.
# ----------------------------------------------------------------------------


def stabilize(
    optimizer: ForgeOptimizer,
    *,
    clip_prev_norm: Optional[float] = None,
    update_clip: Optional[float] = None,
    layer_clip: Optional[float] = None,
    layer_clip_decay: float = 0.98,
) -> ForgeOptimizer:
  r"""``optimizer`` with stabilizers that FORGE can fuse (no gradient pool).

  Every alias takes the same keywords (``forge_jax.adamw(1e-3,
  clip_prev_norm=1.0)`` is ``stabilize(forge_jax.adamw(1e-3),
  clip_prev_norm=1.0)``); docs/stabilizers.md compares them.

  Args:
    optimizer: a forge_jax optimizer without stabilizers.
    clip_prev_norm: multiply step :math:`t`'s gradient by
      :math:`\min(1, c / \|g_{t-1}\|)`, the *previous* step's global gradient
      norm (the current one is only known once every gradient tile has been
      consumed). Step 0 is not clipped. The optax face measures the norm of
      the gradients it is given (state field ``prev_norm``);
      :func:`forge_jax.train_step` sets it to the exact global norm of the
      whole model, the FORGE kernels' tiles included. A non-finite norm is
      not carried: the last finite one stays.
    update_clip: clip each element of the update to :math:`[-clpha_t,
      clpha_t]` (:math:`lpha_t` the learning rate), i.e. the rule's
      direction, weight decay included, to :math:`[-c, c]`.
    layer_clip: AdaGC-style per-array clipping: multiply each parameter
      array's gradient by :math:`\min(1, \lambda e / \|g_{t-1}\|)`, its own
      previous norm against :math:`\lambda` times an EMA :math:`e` of its
      clipped norms (state fields ``prev_norm`` and ``norm_ema``). Steps 0
      and 1 are not clipped. Exclusive with ``clip_prev_norm``.
    layer_clip_decay: the EMA's decay (AdaGC's 0.98).

  Returns:
    A :class:`ForgeOptimizer` with the same mask and precision whose rule is a
    ``StabilizedRule``; with ``clip_prev_norm``/``layer_clip`` its state has
    the step fields after ``count``.
  """
  opt = as_forge_optimizer(optimizer)
  if isinstance(opt.rule, _rules.StabilizedRule):
    raise ValueError(
        f"{opt.rule!r} already has stabilizers: pass them all in one call."
    )
  if clip_prev_norm is None and update_clip is None and layer_clip is None:
    return opt
  rule = _rules.StabilizedRule(opt.rule, clip_prev_norm, update_clip, layer_clip, layer_clip_decay)
  return _make(rule, opt.mask, opt.precision)


_STABILIZER_ARGS = ("clip_prev_norm", "update_clip", "layer_clip", "layer_clip_decay")


def _with_stabilizers(alias):
  """Adds :func:`stabilize`'s keywords to an alias."""

  @functools.wraps(alias)
  def wrapped(*args, **kwargs):
    extra = {k: kwargs.pop(k) for k in _STABILIZER_ARGS if k in kwargs}
    return stabilize(alias(*args, **kwargs), **extra)

  sig = inspect.signature(alias)
  wrapped.__signature__ = sig.replace(parameters=[
      *sig.parameters.values(),
      *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY,
                          default=0.98 if k == "layer_clip_decay" else None)
        for k in _STABILIZER_ARGS),
  ])
  wrapped.__doc__ = (alias.__doc__ or "") + (
      "\n  Also takes the stabilizers of :func:`forge_jax.stabilize` "
      "(``clip_prev_norm``, ``update_clip``, ``layer_clip``, ``layer_clip_decay``).\n"
  )
  return wrapped


# ----------------------------------------------------------------------------
# The aliases (optax 0.2.8 names, signatures and defaults).
# ----------------------------------------------------------------------------


@_with_stabilizers
def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
    precision: Optional[Precision] = None,
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
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

  Returns:
    A :class:`ForgeOptimizer` with state ``AdamState(count, mu, nu)``.

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2015.
  """
  return _make(
      _rules.AdamRule(learning_rate, b1, b2, eps, eps_root, mu_dtype, None, nesterov),
      precision=precision,
  )


@_with_stabilizers
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
    precision: Optional[Precision] = None,
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
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

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
      precision,
  )


nadam = functools.partial(adam, nesterov=True)
nadam.__doc__ = r"""NAdam (Dozat, 2016): :func:`adam` with ``nesterov=True``, as ``optax.nadam``."""

nadamw = functools.partial(adamw, nesterov=True)
nadamw.__doc__ = r"""NAdamW: :func:`adamw` with ``nesterov=True``, as ``optax.nadamw``."""


@_with_stabilizers
def radam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
    precision: Optional[Precision] = None,
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
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

  Returns:
    A :class:`ForgeOptimizer` with state ``AdamState(count, mu, nu)``.

  References:
    Liu et al., `On the Variance of the Adaptive Learning Rate and Beyond
    <https://arxiv.org/abs/1908.03265>`_, 2020.
  """
  return _make(
      _rules.RAdamRule(learning_rate, b1, b2, eps, eps_root, threshold, nesterov),
      precision=precision,
  )


@_with_stabilizers
def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: MaskOrFn = None,
    *,
    precision: Optional[Precision] = None,
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
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

  Returns:
    A :class:`ForgeOptimizer` with state ``LionState(count, mu)``.

  References:
    Chen et al., `Symbolic Discovery of Optimization Algorithms
    <https://arxiv.org/abs/2302.06675>`_, 2023.
  """
  return _make(_rules.LionRule(learning_rate, b1, b2, mu_dtype, weight_decay), mask, precision)


@_with_stabilizers
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
    *,
    precision: Optional[Precision] = None,
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
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

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
      ),
      precision=precision,
  )


@_with_stabilizers
def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
    *,
    precision: Optional[Precision] = None,
) -> ForgeOptimizer:
  r"""AdaGrad (Duchi et al., 2011), as ``optax.adagrad``.

  .. math::
    G_t = G_{t-1} + g_t^2, \quad u_t = -\alpha_t \, g_t / \sqrt{G_t + \varepsilon}
    \ (0 \text{ where } G_t = 0).

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    initial_accumulator_value: initial value of :math:`G`.
    eps: added inside the square root.
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

  Returns:
    A :class:`ForgeOptimizer` with state ``AdagradState(count, sum_of_squares)``.

  References:
    Duchi et al., `Adaptive Subgradient Methods for Online Learning and
    Stochastic Optimization <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
  """
  return _make(_rules.AdagradRule(learning_rate, initial_accumulator_value, eps), precision=precision)


@_with_stabilizers
def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
    *,
    precision: Optional[Precision] = None,
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
    precision: how weights and states are stored (:class:`forge_jax.Precision`;
      ``None``: as optax).

  Returns:
    A :class:`ForgeOptimizer` with state ``SGDState(count)`` or
    ``SGDMomentumState(count, trace)``.

  References:
    Sutskever et al., `On the importance of initialization and momentum in deep
    learning <http://proceedings.mlr.press/v28/sutskever13.pdf>`_, 2013.
  """
  return _make(
      _rules.SGDRule(learning_rate, momentum, nesterov, accumulator_dtype), precision=precision
  )


@_with_stabilizers
def adam_atan2(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    a: float = 1.27,
    b: float = 1.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: Optional[ScalarOrSchedule] = 1e-4,
    mask: MaskOrFn = None,
    *,
    precision: Optional[Precision] = None,
) -> ForgeOptimizer:
  r"""Adam-atan2 (Everett et al., 2024): Adam with ``atan2`` in place of the division.

  optax 0.2.8 has no such alias (nor ``optax.contrib``); the arguments follow
  :func:`adamw`'s, with ``eps``/``eps_root`` replaced by the paper's ``a`` and ``b``:

  .. math::
    u_t = -\alpha_t \left(a \operatorname{atan2}(\hat m_t, b\sqrt{\hat v_t})
      + \lambda w_t\right).

  No epsilon: :math:`\operatorname{atan2}(\hat m, b\sqrt{\hat v}) \approx \hat
  m/(b\sqrt{\hat v})` where :math:`|\hat m| \ll b\sqrt{\hat v}`, every element
  of the direction is bounded by :math:`a\pi/2`, and a zero gradient history
  gives a zero step. ``atan2`` is spelled from elementary operations
  (``forge_jax._math.atan2``, within 3 float32 ulp) so every backend runs the
  same arithmetic. ``weight_decay=None`` never reads the weight.

  Args:
    learning_rate: a float or an optax schedule evaluated at ``count``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    a: the output scale (the paper's 1.27).
    b: the scale of the second moment's root (the paper's 1).
    mu_dtype: storage dtype of the first moment (``None``: the parameter's).
    weight_decay: decoupled decay rate :math:`\lambda` (float or schedule), as
      :func:`adamw` (the same default), or ``None``.
    mask: where weight decay applies (see :func:`adamw`).
    precision: how weights and states are stored (:class:`forge_jax.Precision`).

  Returns:
    A :class:`ForgeOptimizer` with state ``AdamState(count, mu, nu)``.

  References:
    Everett et al., `Scaling Exponents Across Parameterizations and Optimizers
    <https://arxiv.org/abs/2407.05872>`_, 2024.
  """
  return _make(_rules.AdamAtan2Rule(learning_rate, b1, b2, a, b, mu_dtype, weight_decay),
               mask, precision)
