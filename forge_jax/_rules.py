"""Elementwise optimizer rules: the one definition of each update.

Every optimizer FORGE can fuse is *elementwise*: the new value of one weight
depends only on that weight, its gradient and its own optimizer-state slots,
plus a handful of scalars that depend on the step count alone (learning rate,
bias corrections, RAdam's rectification). A rule therefore has two parts:

* ``scalars(count)``: the per-step scalars, computed once per step outside any
  kernel (schedules and powers are evaluated here), as a ``NamedTuple`` of
  float32 0-d arrays;
* ``update(g, w, slots, s, *, decay=True)``: plain ``jnp`` arithmetic on one
  element or one tile. ``g`` is the gradient, ``w`` the weight (``None`` for
  rules that never read it), ``slots`` the state slots in the order of
  ``state_cls._fields[1:]`` and ``s`` the scalars. It returns the update ``u``
  (the weight becomes ``w + u``, as in ``optax.apply_updates``) and the new
  slots. No pytree operations and no Python branching on values, so a Pallas
  kernel epilogue can call it on a register tile.

The arithmetic mirrors optax 0.2.8 operation by operation (same association,
same divisions), so the optax-protocol path in :mod:`forge_jax._optimizers`
matches ``optax`` to float32 rounding and the kernels match the XLA reference.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _math

Array = jax.Array
ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]

_F32 = jnp.float32


def safe_increment(count: Array) -> Array:
  """``count + 1`` that saturates at the dtype's maximum (as optax's), in two lax operations
  (``jnp.where`` traces a jitted call; a step calls this a few times per FORGE layer)."""
  count = jnp.asarray(count)
  max_value = np.array(np.iinfo(count.dtype).max, count.dtype)
  return jax.lax.min(count, max_value - 1) + np.array(1, count.dtype)


def _schedule_value(value: ScalarOrSchedule, count: Array) -> Array:
  return value(count) if callable(value) else value


def _f32_tuple(cls, **fields):
  """``cls`` of the fields as float32 scalars: numpy's for Python numbers (no device array per
  hyperparameter and layer while tracing), jax's for traced values."""
  as_f32 = lambda v: np.float32(v) if isinstance(v, (int, float)) else jnp.asarray(v, _F32)
  return cls(**{k: as_f32(v) for k, v in fields.items()})


# ----------------------------------------------------------------------------
# State containers: `count` first, then the slots, in optax's naming.
# ----------------------------------------------------------------------------


class AdamState(NamedTuple):
  """State of adam, adamw, nadam, nadamw and radam (optax's ``ScaleByAdamState``)."""

  count: Array  # shape=(), dtype=int32
  mu: Any
  nu: Any


class LionState(NamedTuple):
  """State of lion (optax's ``ScaleByLionState``)."""

  count: Array
  mu: Any


class RMSPropState(NamedTuple):
  """State of plain rmsprop (optax's ``ScaleByRmsState`` + the schedule count)."""

  count: Array
  nu: Any


class RMSPropMomentumState(NamedTuple):
  """State of rmsprop with momentum (``nu`` plus optax's ``TraceState.trace``)."""

  count: Array
  nu: Any
  trace: Any


class CenteredRMSPropState(NamedTuple):
  """State of centered rmsprop (optax's ``ScaleByRStdDevState``)."""

  count: Array
  mu: Any
  nu: Any


class CenteredRMSPropMomentumState(NamedTuple):
  """State of centered rmsprop with momentum."""

  count: Array
  mu: Any
  nu: Any
  trace: Any


class AdagradState(NamedTuple):
  """State of adagrad (optax's ``ScaleByRssState``)."""

  count: Array
  sum_of_squares: Any


class SGDState(NamedTuple):
  """State of plain sgd: only the step count (for schedules)."""

  count: Array


class SGDMomentumState(NamedTuple):
  """State of sgd with momentum (optax's ``TraceState``)."""

  count: Array
  trace: Any


# ----------------------------------------------------------------------------
# The rule interface.
# ----------------------------------------------------------------------------


class ElementwiseRule(abc.ABC):
  """An optimizer written as an elementwise update plus per-step scalars."""

  state_cls: ClassVar[type]
  name: ClassVar[str]

  @property
  def slot_names(self) -> tuple[str, ...]:
    return self.state_cls._fields[1 + len(self.step_fields):]

  # Per-step scalar state after ``count`` and before the slots (one float32 per
  # parameter array: the gradient norm a stabilizer clips by). None for the
  # plain optimizers; see StabilizedRule.
  @property
  def step_fields(self) -> tuple[str, ...]:
    return ()

  @property
  def norm_scope(self) -> Optional[str]:
    """Which gradient norm ``next_step`` wants: ``"global"``, ``"layer"`` or None."""
    return None

  def step_init_values(self) -> tuple[float, ...]:
    return tuple(0.0 for _ in self.step_fields)

  def step_values(self, state) -> tuple:
    """The step fields of ``state``."""
    return tuple(state[1:1 + len(self.step_fields)])

  def slots_of(self, state) -> tuple:
    """The slots of ``state`` (everything after ``count`` and the step fields)."""
    return tuple(state[1 + len(self.step_fields):])

  def next_step(self, step: tuple, grad_sq_norm) -> tuple:
    """The step fields after a step whose gradient had squared norm ``grad_sq_norm``."""
    del grad_sq_norm
    return step

  @property
  def uses_weight(self) -> bool:
    """Whether ``update`` reads ``w`` (weight decay)."""
    return False

  def slot_dtypes(self, param_dtype) -> tuple[Any, ...]:
    """Storage dtype of each slot for a parameter of ``param_dtype``."""
    return tuple(param_dtype for _ in self.slot_names)

  def slot_init_values(self) -> tuple[float, ...]:
    """The value every element of each slot starts at."""
    return tuple(0.0 for _ in self.slot_names)

  def init_slots(self, w: Array) -> tuple[Array, ...]:
    """The initial slots of one parameter array."""
    return tuple(
        jnp.full(jnp.shape(w), v, dtype)
        for v, dtype in zip(self.slot_init_values(), self.slot_dtypes(w.dtype))
    )

  @abc.abstractmethod
  def scalars(self, count: Array, *step) -> NamedTuple:
    """Per-step scalars from the step count *before* this step's increment (and
    the step fields, for rules that have them)."""

  @abc.abstractmethod
  def update(self, g, w, slots, s, *, decay: bool = True):
    """Elementwise update: returns ``(u, new_slots)``; the weight becomes ``w + u``."""


def _check_learning_rate(learning_rate):
  if learning_rate is None:
    raise ValueError(
        "learning_rate=None (no scaling) is not supported by forge_jax: pass a "
        "float or an optax schedule."
    )


def _check_dtype(name: str, dtype):
  if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
    raise ValueError(f"{name}={dtype!r} must be a floating dtype or None.")


# ----------------------------------------------------------------------------
# Adam family: adam, adamw, nadam, nadamw.
# ----------------------------------------------------------------------------


class AdamScalars(NamedTuple):
  neg_lr: Array
  weight_decay: Array
  b1: Array
  one_minus_b1: Array
  b2: Array
  one_minus_b2: Array
  eps: Array
  eps_root: Array
  bc1: Array  # 1 - b1**t
  bc2: Array  # 1 - b2**t
  bc1_next: Array  # 1 - b1**(t+1), for Nesterov


@dataclasses.dataclass(frozen=True)
class AdamRule(ElementwiseRule):
  """Adam, with optional decoupled weight decay and Nesterov momentum.

  ``weight_decay=None`` is plain Adam (the rule never reads the weight).
  """

  learning_rate: ScalarOrSchedule
  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0
  mu_dtype: Any = None
  weight_decay: Optional[ScalarOrSchedule] = None
  nesterov: bool = False

  state_cls: ClassVar[type] = AdamState
  name: ClassVar[str] = "adam"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)
    _check_dtype("mu_dtype", self.mu_dtype)

  @property
  def uses_weight(self) -> bool:
    return self.weight_decay is not None

  def slot_dtypes(self, param_dtype):
    mu = param_dtype if self.mu_dtype is None else jnp.dtype(self.mu_dtype)
    return (mu, param_dtype)

  def moment_scalars(self, count) -> dict:
    """The learning rate, weight decay, betas and bias corrections of step ``count``, as
    optax computes them (Python floats where the hyperparameters are)."""
    count_inc = safe_increment(count)
    b1, b2 = self.b1, self.b2
    wd = 0.0 if self.weight_decay is None else _schedule_value(self.weight_decay, count)
    return dict(
        neg_lr=-1 * _schedule_value(self.learning_rate, count),
        weight_decay=wd,
        b1=b1,
        one_minus_b1=1 - b1,
        b2=b2,
        one_minus_b2=1 - b2,
        bc1=1 - b1**count_inc,
        bc2=1 - b2**count_inc,
    )

  def scalars(self, count):
    return _f32_tuple(
        AdamScalars,
        **self.moment_scalars(count),
        eps=self.eps,
        eps_root=self.eps_root,
        bc1_next=1 - self.b1 ** safe_increment(safe_increment(count)),
    )

  def update(self, g, w, slots, s, *, decay=True):
    mu, nu = slots
    mu = s.one_minus_b1 * g + s.b1 * mu
    nu = s.one_minus_b2 * (g * g) + s.b2 * nu
    mu_hat = _adam_mu_hat(mu, g, s, self.nesterov)
    nu_hat = nu / s.bc2
    u = mu_hat / (_math.sqrt(nu_hat + s.eps_root) + s.eps)
    if self.weight_decay is not None and decay:
      u = u + s.weight_decay * w
    return s.neg_lr * u, (mu, nu)


def _adam_mu_hat(mu, g, s, nesterov: bool):
  if nesterov:
    return s.b1 * (mu / s.bc1_next) + s.one_minus_b1 * (g / s.bc1)
  return mu / s.bc1


# ----------------------------------------------------------------------------
# RAdam.
# ----------------------------------------------------------------------------


class RAdamScalars(NamedTuple):
  neg_lr: Array
  b1: Array
  one_minus_b1: Array
  b2: Array
  one_minus_b2: Array
  eps: Array
  eps_root: Array
  bc1: Array
  bc2: Array
  bc1_next: Array
  rectify: Array  # 1.0 where rho_t >= threshold, else 0.0
  r: Array  # the rectification factor (0 where not rectified)


@dataclasses.dataclass(frozen=True)
class RAdamRule(ElementwiseRule):
  """Rectified Adam (Liu et al., 2020), as ``optax.radam``."""

  learning_rate: ScalarOrSchedule
  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0
  threshold: Any = 5.0
  nesterov: bool = False

  state_cls: ClassVar[type] = AdamState
  name: ClassVar[str] = "radam"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)

  def scalars(self, count):
    b1, b2 = self.b1, self.b2
    count_inc = safe_increment(count)
    ro_inf = 2.0 / (1.0 - b2) - 1.0
    b2t = b2**count_inc
    ro = ro_inf - 2 * count_inc * b2t / (1 - b2t)
    rectify = ro >= self.threshold
    r = jnp.sqrt(
        (ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro)
    )
    return _f32_tuple(
        RAdamScalars,
        neg_lr=-1 * _schedule_value(self.learning_rate, count),
        b1=b1,
        one_minus_b1=1 - b1,
        b2=b2,
        one_minus_b2=1 - b2,
        eps=self.eps,
        eps_root=self.eps_root,
        bc1=1 - b1**count_inc,
        bc2=1 - b2**count_inc,
        bc1_next=1 - b1 ** safe_increment(count_inc),
        rectify=jnp.where(rectify, 1.0, 0.0),
        r=jnp.where(rectify, r, 0.0),
    )

  def update(self, g, w, slots, s, *, decay=True):
    del w, decay
    mu, nu = slots
    mu = s.one_minus_b1 * g + s.b1 * mu
    nu = s.one_minus_b2 * (g * g) + s.b2 * nu
    mu_hat = _adam_mu_hat(mu, g, s, self.nesterov)
    nu_hat = nu / s.bc2
    rectified = s.r * mu_hat / (_math.sqrt(nu_hat + s.eps_root) + s.eps)
    # optax selects with jnp.where on the step's scalar flag. A blend with the
    # flag (exactly 0.0 or 1.0) gives the same values (x*1 + y*0 == x for
    # finite y) and needs no scalar-predicate select, which Mosaic GPU cannot
    # lower under warpgroup semantics ("implicit broadcast").
    u = rectified * s.rectify + mu_hat * (1.0 - s.rectify)
    return s.neg_lr * u, (mu, nu)


# ----------------------------------------------------------------------------
# Lion.
# ----------------------------------------------------------------------------


class LionScalars(NamedTuple):
  neg_lr: Array
  weight_decay: Array
  b1: Array
  one_minus_b1: Array
  b2: Array
  one_minus_b2: Array


@dataclasses.dataclass(frozen=True)
class LionRule(ElementwiseRule):
  """Lion (Chen et al., 2023), as ``optax.lion``."""

  learning_rate: ScalarOrSchedule
  b1: Any = 0.9
  b2: Any = 0.99
  mu_dtype: Any = None
  weight_decay: Optional[ScalarOrSchedule] = 1e-3

  state_cls: ClassVar[type] = LionState
  name: ClassVar[str] = "lion"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)
    _check_dtype("mu_dtype", self.mu_dtype)

  @property
  def uses_weight(self) -> bool:
    return self.weight_decay is not None

  def slot_dtypes(self, param_dtype):
    return (param_dtype if self.mu_dtype is None else jnp.dtype(self.mu_dtype),)

  def scalars(self, count):
    wd = 0.0 if self.weight_decay is None else _schedule_value(self.weight_decay, count)
    return _f32_tuple(
        LionScalars,
        neg_lr=-1 * _schedule_value(self.learning_rate, count),
        weight_decay=wd,
        b1=self.b1,
        one_minus_b1=1.0 - self.b1,
        b2=self.b2,
        one_minus_b2=1 - self.b2,
    )

  def update(self, g, w, slots, s, *, decay=True):
    (mu,) = slots
    u = jnp.sign(s.one_minus_b1 * g + s.b1 * mu)
    mu = s.one_minus_b2 * g + s.b2 * mu
    if self.weight_decay is not None and decay:
      u = u + s.weight_decay * w
    return s.neg_lr * u, (mu,)


# ----------------------------------------------------------------------------
# RMSProp (plain, centered, momentum, Nesterov, bias correction).
# ----------------------------------------------------------------------------


class RMSPropScalars(NamedTuple):
  neg_lr: Array
  decay: Array
  one_minus_decay: Array
  eps: Array
  bc: Array  # 1 - decay**t, or 1 when bias_correction is off
  momentum: Array


_RMSPROP_STATES = {
    (False, False): RMSPropState,
    (False, True): RMSPropMomentumState,
    (True, False): CenteredRMSPropState,
    (True, True): CenteredRMSPropMomentumState,
}


@dataclasses.dataclass(frozen=True)
class RMSPropRule(ElementwiseRule):
  """RMSProp in optax's formulation (``eps`` inside the root by default)."""

  learning_rate: ScalarOrSchedule
  decay: Any = 0.9
  eps: Any = 1e-8
  initial_scale: Any = 0.0
  eps_in_sqrt: bool = True
  centered: bool = False
  momentum: Any = None
  nesterov: bool = False
  bias_correction: bool = False

  name: ClassVar[str] = "rmsprop"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)

  @property
  def state_cls(self):  # type: ignore[override]
    return _RMSPROP_STATES[(self.centered, self.momentum is not None)]

  def slot_init_values(self):
    values = {"mu": 0.0, "nu": self.initial_scale, "trace": 0.0}
    return tuple(values[n] for n in self.slot_names)

  def scalars(self, count):
    bc = 1 - self.decay ** safe_increment(count) if self.bias_correction else 1.0
    return _f32_tuple(
        RMSPropScalars,
        neg_lr=-1 * _schedule_value(self.learning_rate, count),
        decay=self.decay,
        one_minus_decay=1 - self.decay,
        eps=self.eps,
        bc=bc,
        momentum=0.0 if self.momentum is None else self.momentum,
    )

  def update(self, g, w, slots, s, *, decay=True):
    del w, decay
    named = dict(zip(self.slot_names, slots))
    nu = s.one_minus_decay * (g * g) + s.decay * named["nu"]
    nu_hat = nu / s.bc if self.bias_correction else nu
    new = {"nu": nu}
    if self.centered:
      mu = s.one_minus_decay * g + s.decay * named["mu"]
      mu_hat = mu / s.bc if self.bias_correction else mu
      nu_hat = nu_hat - mu_hat * mu_hat
      new["mu"] = mu
    if self.eps_in_sqrt:
      scaling = jax.lax.rsqrt(nu_hat + s.eps)
    else:
      scaling = 1 / (_math.sqrt(nu_hat) + s.eps)
    u = s.neg_lr * (scaling * g)
    if self.momentum is not None:
      u, new["trace"] = _trace(u, named["trace"], s.momentum, self.nesterov)
    return u, tuple(new[n] for n in self.slot_names)


def _trace(u, trace, momentum, nesterov: bool):
  """optax.trace: ``t = u + m * t``; Nesterov returns ``u + m * t``."""
  trace = u + momentum * trace
  return (u + momentum * trace if nesterov else trace), trace


# ----------------------------------------------------------------------------
# Adagrad.
# ----------------------------------------------------------------------------


class AdagradScalars(NamedTuple):
  neg_lr: Array
  eps: Array


@dataclasses.dataclass(frozen=True)
class AdagradRule(ElementwiseRule):
  """AdaGrad (Duchi et al., 2011), as ``optax.adagrad``."""

  learning_rate: ScalarOrSchedule
  initial_accumulator_value: Any = 0.1
  eps: Any = 1e-7

  state_cls: ClassVar[type] = AdagradState
  name: ClassVar[str] = "adagrad"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)

  def slot_init_values(self):
    return (self.initial_accumulator_value,)

  def scalars(self, count):
    return _f32_tuple(
        AdagradScalars,
        neg_lr=-1 * _schedule_value(self.learning_rate, count),
        eps=self.eps,
    )

  def update(self, g, w, slots, s, *, decay=True):
    del w, decay
    (sum_of_squares,) = slots
    sum_of_squares = g * g + sum_of_squares
    scaling = jnp.where(sum_of_squares > 0, jax.lax.rsqrt(sum_of_squares + s.eps), 0.0)
    return s.neg_lr * (scaling * g), (sum_of_squares,)


# ----------------------------------------------------------------------------
# SGD.
# ----------------------------------------------------------------------------


class SGDScalars(NamedTuple):
  neg_lr: Array
  momentum: Array


@dataclasses.dataclass(frozen=True)
class SGDRule(ElementwiseRule):
  """SGD with optional (Nesterov) momentum, as ``optax.sgd``."""

  learning_rate: ScalarOrSchedule
  momentum: Any = None
  nesterov: bool = False
  accumulator_dtype: Any = None

  name: ClassVar[str] = "sgd"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)
    _check_dtype("accumulator_dtype", self.accumulator_dtype)

  @property
  def state_cls(self):  # type: ignore[override]
    return SGDState if self.momentum is None else SGDMomentumState

  def slot_dtypes(self, param_dtype):
    if self.momentum is None:
      return ()
    dtype = self.accumulator_dtype
    return (param_dtype if dtype is None else jnp.dtype(dtype),)

  def scalars(self, count):
    return _f32_tuple(
        SGDScalars,
        neg_lr=-1 * _schedule_value(self.learning_rate, count),
        momentum=0.0 if self.momentum is None else self.momentum,
    )

  def update(self, g, w, slots, s, *, decay=True):
    del w, decay
    if self.momentum is None:
      return s.neg_lr * g, ()
    # optax: trace first, then scale by the learning rate.
    u, trace = _trace(g, slots[0], s.momentum, self.nesterov)
    return s.neg_lr * u, (trace,)


# ----------------------------------------------------------------------------
# Adam-atan2 (bounded updates, no epsilon).
# ----------------------------------------------------------------------------


class AdamAtan2Scalars(NamedTuple):
  neg_lr: Array
  weight_decay: Array
  b1: Array
  one_minus_b1: Array
  b2: Array
  one_minus_b2: Array
  bc1: Array  # 1 - b1**t
  bc2: Array  # 1 - b2**t
  a: Array
  b: Array


@dataclasses.dataclass(frozen=True)
class AdamAtan2Rule(ElementwiseRule):
  """Adam-atan2 (Everett et al., 2024): ``a * atan2(m_hat, b * sqrt(v_hat))``.

  The Adam direction with the division replaced by ``atan2``: no epsilon, and
  every element of the direction lies in ``[-a*pi/2, a*pi/2]`` whatever the
  gradient. ``weight_decay=None`` is plain (the rule never reads the weight).
  """

  learning_rate: ScalarOrSchedule
  b1: Any = 0.9
  b2: Any = 0.999
  a: Any = 1.27
  b: Any = 1.0
  mu_dtype: Any = None
  weight_decay: Optional[ScalarOrSchedule] = None

  state_cls: ClassVar[type] = AdamState
  name: ClassVar[str] = "adam_atan2"

  def __post_init__(self):
    _check_learning_rate(self.learning_rate)
    _check_dtype("mu_dtype", self.mu_dtype)
    for name in ("a", "b"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
        raise ValueError(
            f"adam_atan2: {name}={value!r} must be a finite number > 0 (the paper's "
            "a=1.27, b=1)."
        )

  uses_weight = AdamRule.uses_weight
  slot_dtypes = AdamRule.slot_dtypes
  moment_scalars = AdamRule.moment_scalars

  def scalars(self, count):
    return _f32_tuple(AdamAtan2Scalars, **self.moment_scalars(count), a=self.a, b=self.b)

  def update(self, g, w, slots, s, *, decay=True):
    mu, nu = slots
    mu = s.one_minus_b1 * g + s.b1 * mu
    nu = s.one_minus_b2 * (g * g) + s.b2 * nu
    u = s.a * _math.atan2(mu / s.bc1, s.b * _math.sqrt(nu / s.bc2))
    if self.weight_decay is not None and decay:
      u = u + s.weight_decay * w
    return s.neg_lr * u, (mu, nu)


# ----------------------------------------------------------------------------
# Stabilizers that need no gradient pool: any rule, wrapped.
# ----------------------------------------------------------------------------


def carry_norm(prev_norm, grad_norm):
  """The norm the next step clips by: ``grad_norm`` where finite, else ``prev_norm``.

  A step whose gradient norm overflowed (or is NaN) leaves the last finite
  norm in place, so one bad step cannot zero (``inf``) or disable (``NaN``)
  the clipping of the steps after it.
  """
  grad_norm = jnp.asarray(grad_norm, _F32)
  return jnp.where(jnp.isfinite(grad_norm), grad_norm, jnp.asarray(prev_norm, _F32))


_STEP_STATES: dict = {}


def _state_with_steps(inner_cls: type, fields: tuple[str, ...], prefix: str) -> type:
  """``inner_cls`` with ``fields`` inserted after ``count``; one class per pair."""
  key = (inner_cls, fields)
  if key not in _STEP_STATES:
    name = f"{prefix}{inner_cls.__name__}"
    cls = collections.namedtuple(name, ("count", *fields, *inner_cls._fields[1:]))
    cls.__module__ = __name__
    cls.__doc__ = (f"``{inner_cls.__name__}`` with the per-step scalars {fields} "
                   "(float32, one per parameter array) after ``count``.")
    globals()[name] = cls  # importable by name (pickle)
    _STEP_STATES[key] = cls
  return _STEP_STATES[key]


class StabilizerScalars(NamedTuple):
  inner: Any  # the wrapped rule's scalars
  grad_scale: Array  # multiplies the gradient (1 when no clip applies)
  update_bound: Array  # |u| <= update_bound per element (inf when off)


def _check_positive(name: str, value, *, upper=float("inf")):
  if value is None:
    return
  if not (isinstance(value, (int, float)) and not isinstance(value, bool)
          and 0 < value < upper):
    bound = "" if upper == float("inf") else f" and < {upper}"
    raise ValueError(f"{name}={value!r} must be a finite number > 0{bound}, or None for off.")


@dataclasses.dataclass(frozen=True)
class StabilizedRule(ElementwiseRule):
  """``inner`` with stabilizers that stay elementwise (no gradient pool).

  * ``clip_prev_norm=c``: the gradient is multiplied by
    ``min(1, c / n_{t-1})``, ``n_{t-1}`` the global gradient norm of the
    previous step (state field ``prev_norm``). Step 0 has none and is not
    clipped.
  * ``layer_clip=lam`` (AdaGC-style, per parameter array): the gradient is
    multiplied by ``min(1, lam * e / n_{t-1})``, ``n_{t-1}`` this array's own
    previous gradient norm and ``e`` an EMA (``layer_clip_decay``) of its
    clipped norms (state fields ``prev_norm``, ``norm_ema``). Steps 0 and 1
    are not clipped (no norm, then no average).
  * ``update_clip=c``: each element of the update is clipped to
    ``[-c * lr, c * lr]``, i.e. the rule's direction (weight decay included)
    to ``[-c, c]`` before the learning rate: bit for bit the same numbers.

  The scales and the bound are per-step scalars; the update stays elementwise.
  """

  inner: ElementwiseRule
  clip_prev_norm: Optional[float] = None
  update_clip: Optional[float] = None
  layer_clip: Optional[float] = None
  layer_clip_decay: float = 0.98

  def __post_init__(self):
    if not isinstance(self.inner, ElementwiseRule) or isinstance(self.inner, StabilizedRule):
      raise ValueError(
          f"StabilizedRule wraps a plain ElementwiseRule, got {self.inner!r}: pass every "
          "stabilizer in one call."
      )
    _check_positive("clip_prev_norm", self.clip_prev_norm)
    _check_positive("update_clip", self.update_clip)
    _check_positive("layer_clip", self.layer_clip)
    _check_positive("layer_clip_decay", self.layer_clip_decay, upper=1.0)
    if self.clip_prev_norm is not None and self.layer_clip is not None:
      raise ValueError(
          f"clip_prev_norm={self.clip_prev_norm!r} and layer_clip={self.layer_clip!r}: pass "
          "one (a global and a per-layer clip would each rescale what the other measured)."
      )

  def __getattr__(self, attr):
    # The inner rule's hyperparameters (learning_rate, mu_dtype, ...) read through.
    if attr.startswith("__") or attr == "inner":
      raise AttributeError(attr)
    return getattr(self.inner, attr)

  @property
  def name(self) -> str:  # type: ignore[override]
    return self.inner.name

  @property
  def step_fields(self):
    if self.clip_prev_norm is not None:
      return ("prev_norm",)
    if self.layer_clip is not None:
      return ("prev_norm", "norm_ema")
    return ()

  @property
  def norm_scope(self):
    if self.clip_prev_norm is not None:
      return "global"
    if self.layer_clip is not None:
      return "layer"
    return None

  @property
  def state_cls(self):  # type: ignore[override]
    inner = self.inner.state_cls
    if not self.step_fields:
      return inner
    prefix = "GlobalClip" if self.norm_scope == "global" else "LayerClip"
    return _state_with_steps(inner, self.step_fields, prefix)

  @property
  def slot_names(self):
    return self.inner.slot_names

  @property
  def uses_weight(self) -> bool:
    return self.inner.uses_weight

  def slot_dtypes(self, param_dtype):
    return self.inner.slot_dtypes(param_dtype)

  def slot_init_values(self):
    return self.inner.slot_init_values()

  def init_slots(self, w):
    return self.inner.init_slots(w)

  def grad_scale(self, *step) -> Array:
    """The factor on this step's gradient, from the step fields (float32)."""
    if self.norm_scope is None:
      return jnp.ones((), _F32)
    prev = jnp.asarray(step[0], _F32)
    if self.norm_scope == "global":
      limit = jnp.asarray(self.clip_prev_norm, _F32)
      clips = prev > limit  # prev == 0 (no norm yet): not clipped
    else:
      ema = jnp.asarray(step[1], _F32)
      limit = self.layer_clip * ema
      clips = (ema > 0) & (prev > limit)  # ema == 0 (no average yet): not clipped
    return jnp.where(clips, limit / jnp.where(clips, prev, 1.0), 1.0).astype(_F32)

  def scalars(self, count, *step):
    inner = self.inner.scalars(count)
    if self.update_clip is None:
      bound = jnp.asarray(jnp.inf, _F32)
    else:
      bound = (jnp.abs(inner.neg_lr) * self.update_clip).astype(_F32)
    return StabilizerScalars(inner, self.grad_scale(*step), bound)

  def next_step(self, step, grad_sq_norm):
    if self.norm_scope is None:
      return step
    norm = jnp.sqrt(jnp.asarray(grad_sq_norm, _F32))
    prev = jnp.asarray(step[0], _F32)
    new_prev = carry_norm(prev, norm)
    if self.norm_scope == "global":
      return (new_prev,)
    ema = jnp.asarray(step[1], _F32)
    d = self.layer_clip_decay
    # The EMA takes the previous step's norm as it was applied (clipped); the
    # first norm seen starts it.
    clipped = jnp.minimum(prev, self.layer_clip * ema)
    new_ema = jnp.where(ema > 0, d * ema + (1 - d) * clipped, prev).astype(_F32)
    return (new_prev, new_ema)

  def update(self, g, w, slots, s, *, decay=True):
    if self.norm_scope is not None:
      g = g * s.grad_scale
    u, new_slots = self.inner.update(g, w, slots, s.inner, decay=decay)
    if self.update_clip is not None:
      u = jnp.minimum(jnp.maximum(u, -s.update_bound), s.update_bound)
    return u, new_slots
