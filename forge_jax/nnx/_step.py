"""``forge_jax.nnx.Optimizer`` and ``forge_jax.nnx.train_step``: the NNX face of the train step.

The step is :func:`forge_jax.train_step` itself: the model's variables are
laid out as its ``params`` / ``forge_state`` collections (FORGE kernels and
their :class:`OptState` at the same paths), the loss merges them back into the
model inside the jitted, donated step, and the new values are written into the
model and the optimizer afterwards. The reuse and data-parallel checks, the
non-finite guard, the exact gradient norm and the optax form for everything
FORGE does not manage are the Linen step's.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import jax
from flax import nnx
from flax import traverse_util
from flax.nnx import filterlib

from forge_jax import _dense
from forge_jax import _optimizers
from forge_jax import _train
from forge_jax.nnx import _linear
from forge_jax.nnx import _stack

FORGE_STATE = _dense.FORGE_STATE
# The key, in TrainState.model_state, of the variables neither optax nor FORGE trains.
_REST = "nnx_rest"


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each variable of a model goes in the Linen step's collections (static, hashable).

  ``entries[i]`` is ``(kind, path)`` of the ``i``-th variable in the flattening order of the
  model's state: ``"params"`` (trained: FORGE kernels and the optax form's parameters),
  ``"forge"`` (an :class:`OptState`, kept under its kernel's path) or ``"rest"`` (passed
  through unchanged).
  """

  graphdef: Any
  treedef: Any
  entries: tuple


def _layout(model, wrt):
  """The model's layout and state (its variables, in the layout's order:
  ``jax.tree.leaves(state, is_leaf=_is_variable)``)."""
  graphdef, state = nnx.split(model)
  trained = filterlib.to_predicate(wrt)
  with_paths, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
  entries = []
  for keypath, var in with_paths:
    key = tuple(_key_name(k) for k in keypath)
    if isinstance(var, _linear.OptState):
      entries.append(("forge", key))
    elif trained(key, var):
      entries.append(("params", key))
    else:
      entries.append(("rest", key))
  params = {key for kind, key in entries if kind == "params"}
  missing = sorted("/".join(_stack.kernel_key(key)) for kind, key in entries
                   if kind == "forge" and _stack.kernel_key(key) not in params)
  if missing:
    raise ValueError(
        f"the FORGE kernels {missing} are not selected by the optimizer's wrt filter: FORGE "
        "updates them in their backward pass, so they must be trained (wrt=nnx.Param).")
  return _Layout(graphdef, jax.tree.structure(state), tuple(entries)), state


def _variables(state) -> list:
  return jax.tree.leaves(state, is_leaf=_is_variable)


def _values(layout: _Layout, params, forge, rest) -> list:
  """The value of each variable of the layout (in its order) from the three collections."""
  flat_p, flat_f = _dense.flat_variables(params), _dense.flat_variables(forge)
  out = []
  for kind, key in layout.entries:
    if kind == "params":
      out.append(flat_p[key])
    elif kind == "forge":
      out.append(flat_f[_stack.kernel_key(key)])
    else:
      out.append(rest["/".join(key)])
  return out


def _state_of(layout: _Layout, params, forge, rest):
  """The model's state (an ``nnx.State``) from the three collections."""
  leaves = [leaf for v in _values(layout, params, forge, rest) for leaf in jax.tree.leaves(v)]
  return jax.tree.unflatten(layout.treedef, leaves)


def name_layers(model) -> None:
  """Gives every :class:`forge_jax.nnx.Linear` in ``model`` its module path (``forge_path``)."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, _linear.Linear):
      node.forge_path = tuple(str(k) for k in path)


@dataclasses.dataclass(frozen=True)
class _Loss:
  """``loss_fn(model, batch)`` as the Linen step's ``loss(variables, batch)`` (hashable: two are
  equal for equal layouts and loss functions, partials built alike included)."""

  layout: _Layout
  loss_fn: Callable

  @classmethod
  def of(cls, layout: _Layout, loss_fn: Callable) -> "_Loss":
    return cls(layout, _train.StaticFunction(loss_fn))

  @property
  def __wrapped__(self) -> Callable:
    """The user's loss function (what train_step's RetraceWarning names)."""
    return self.loss_fn.fn

  def __call__(self, variables, batch):
    state = _state_of(self.layout, variables["params"], variables[FORGE_STATE], variables[_REST])
    model = nnx.merge(self.layout.graphdef, state)
    name_layers(model)
    return self.loss_fn(model, batch)


class Optimizer(nnx.Pytree if hasattr(nnx, "Pytree") else nnx.Object):
  """The optimizer of an NNX model with FORGE layers, in the style of ``nnx.Optimizer``.

  Args:
    model: the model; its :class:`forge_jax.nnx.Linear` layers must be built
      with the same ``tx``.
    tx: the forge_jax optimizer (``forge_jax.adamw(...)`` etc.): FORGE layers
      run its elementwise rule inside their backward pass; every other
      variable ``wrt`` selects (embeddings, norms, biases, ``nnx.Linear``
      kernels) gets its optax form.
    wrt: the filter of the trained variables (as ``nnx.Optimizer``'s); it must
      select the FORGE kernels. Variables it leaves out (other than FORGE
      states) are passed to the model unchanged.

  Attributes (each an :class:`OptState`): ``step``, ``opt_state`` (the optax
  form's state), ``prev_grad_norm`` (what ``clip_prev_norm`` clips by) and
  ``skipped_steps`` (steps skipped for a non-finite loss). The FORGE kernels'
  states live in the model, in each Linear's ``kernel_opt``.
  """

  def __init__(self, model, tx, *, wrt: Any = nnx.Param):
    tx = _optimizers.as_forge_optimizer(tx)
    layout, model_state = _layout(model, wrt)
    params, forge, _ = _collections(layout, [v.get_value() for v in _variables(model_state)])
    state = _train.TrainState.create(None, {"params": params, FORGE_STATE: forge}, tx)
    self.tx = tx
    self.wrt = wrt
    self.step = _linear.OptState(state.step)
    self.opt_state = _linear.OptState(state.opt_state)
    self.prev_grad_norm = _linear.OptState(state.prev_grad_norm)
    self.skipped_steps = _linear.OptState(state.skipped_steps)


def _collections(layout: _Layout, values) -> tuple[dict, dict, dict]:
  """``(params, forge_state, rest)`` of the Linen step from the variables' values."""
  params, forge, rest = {}, {}, {}
  for (kind, key), value in zip(layout.entries, values, strict=True):
    if kind == "params":
      params[key] = value
    elif kind == "forge":
      forge[_stack.kernel_key(key)] = value
    else:
      rest["/".join(key)] = value
  return traverse_util.unflatten_dict(params), traverse_util.unflatten_dict(forge), rest


def _as_train_state(layout: _Layout, values, optimizer) -> _train.TrainState:
  params, forge, rest = _collections(layout, values)
  return _train.TrainState(
      step=optimizer.step.get_value(), apply_fn=None, optimizer=optimizer.tx, params=params,
      forge_state=forge, opt_state=optimizer.opt_state.get_value(), model_state={_REST: rest},
      prev_grad_norm=optimizer.prev_grad_norm.get_value(),
      skipped_steps=optimizer.skipped_steps.get_value())


def _train_state(model, optimizer):
  """The model's layout, the Linen step's TrainState of ``model`` and ``optimizer``, and the
  model's state (its variables, which the step's results are written into)."""
  layout, model_state = _layout(model, optimizer.wrt)
  values = [v.get_value() for v in _variables(model_state)]
  return layout, model_state, _as_train_state(layout, values, optimizer)


def train_step(model, optimizer: Optimizer, batch: Any, loss_fn: Callable, has_aux: bool = False,
               skip_nonfinite: bool = True):
  """One FORGE training step of an NNX model, updating ``model`` and ``optimizer`` in place.

  Args:
    model: the NNX model (its buffers are donated to the step and replaced by
      the new ones).
    optimizer: its :class:`Optimizer`.
    batch: any pytree, passed to ``loss_fn``.
    loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux=True``); hashable (a module-level function or a
      ``functools.partial``), as it is a static argument of the jitted step.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    skip_nonfinite: as :func:`forge_jax.train_step`'s.

  Returns:
    the metrics of :func:`forge_jax.train_step`: ``loss``, ``grad_norm`` (the
    exact global gradient norm), ``clip_scale``, ``skipped`` (a non-finite
    loss: nothing was updated), ``skipped_steps`` and ``aux`` if any.

  Variables outside ``wrt`` (RNG counters, batch statistics) are read, not
  updated: a loss that draws random numbers draws the same ones each step.
  The step is jitted (and donates the model's buffers) by itself; it also runs
  inside ``nnx.jit`` (``nnx.jit(train_step, static_argnums=3)``).

  Raises:
    ValueError: while tracing, before anything changes, when a FORGE layer's
      backward pass would run more than once in the step, or under
      ``vmap``/``pmap``/``shard_map``, or when the batch is split over devices.
  """
  layout, model_state, state = _train_state(model, optimizer)
  new, metrics = _train.train_step(state, batch, _Loss.of(layout, loss_fn), has_aux,
                                   skip_nonfinite)
  _write_back(model, optimizer, layout, model_state, new)
  return metrics


def _write_back(model, optimizer: Optimizer, layout: _Layout, model_state,
                new: _train.TrainState) -> None:
  # Into the split's variables (new Variable objects cost more than the step's other Python
  # work on a many-layer model), then into the model (a no-op where they are the model's own).
  for var, value in zip(_variables(model_state), _values(layout, new.params, new.forge_state,
                                           new.model_state[_REST]), strict=True):
    var.set_value(value)
  nnx.update(model, model_state)
  _write_optimizer(optimizer, new)


def _write_optimizer(optimizer: Optimizer, new: _train.TrainState) -> None:
  optimizer.step.set_value(new.step)
  optimizer.opt_state.set_value(new.opt_state)
  optimizer.prev_grad_norm.set_value(new.prev_grad_norm)
  optimizer.skipped_steps.set_value(new.skipped_steps)


class _Compiled:
  """The compiled step (``jax.stages.Compiled``'s attributes: ``as_text``, ``memory_analysis``,
  ...), callable as ``compiled(model, optimizer, batch) -> metrics`` like :func:`train_step`.

  The first call walks the model's graph (``nnx.split``); later calls with the same model
  and optimizer read and write the variables found then, as ``nnx.cached_partial`` does: on
  an unrolled model that walk is most of the step's Python time. Lower again after changing
  the model's structure.
  """

  def __init__(self, compiled, layout):
    self._compiled, self._layout = compiled, layout
    self._bound = None  # (weakref to model, weakref to optimizer, the model's variables)

  def __getattr__(self, name):
    return getattr(self._compiled, name)

  def _bound_variables(self, model, optimizer):
    bound = self._bound
    if bound is not None and bound[0]() is model and bound[1]() is optimizer:
      return bound[2]
    return None

  def __call__(self, model, optimizer: Optimizer, batch: Any):
    variables = self._bound_variables(model, optimizer)
    if variables is not None:
      values = [v.get_value() for v in variables]
      new, metrics = self._compiled(_as_train_state(self._layout, values, optimizer), batch)
      new_values = _values(self._layout, new.params, new.forge_state, new.model_state[_REST])
      for var, value in zip(variables, new_values, strict=True):
        var.set_value(value)
      _write_optimizer(optimizer, new)
      return metrics
    layout, model_state, state = _train_state(model, optimizer)
    if layout != self._layout:
      raise ValueError("this compiled step was lowered for a model of another structure: "
                       "lower and compile it again for this model.")
    new, metrics = self._compiled(state, batch)
    _write_back(model, optimizer, layout, model_state, new)
    variables = _variables(model_state)
    # Bound only where the split handed out the model's own variables (writing into them
    # then updates the model, with no second walk).
    own = {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    if all(id(v) in own for v in variables):
      self._bound = (weakref.ref(model), weakref.ref(optimizer), variables)
    return metrics


class _Lowered:
  def __init__(self, lowered, layout):
    self._lowered, self._layout = lowered, layout

  def __getattr__(self, name):
    return getattr(self._lowered, name)

  def compile(self, *args, **kwargs) -> _Compiled:
    return _Compiled(self._lowered.compile(*args, **kwargs), self._layout)


def _lower(model, optimizer: Optimizer, batch: Any, loss_fn: Callable, has_aux: bool = False,
           skip_nonfinite: bool = True):
  """``train_step``'s jitted step lowered for these arguments; ``.compile()`` gives a step
  callable as ``compiled(model, optimizer, batch)``."""
  layout, _, state = _train_state(model, optimizer)
  return _Lowered(_train.train_step.lower(state, batch, _Loss.of(layout, loss_fn), has_aux,
                                          skip_nonfinite), layout)


train_step.lower = _lower  # type: ignore[attr-defined]
