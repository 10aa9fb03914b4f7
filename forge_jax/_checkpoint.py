"""Save and restore a whole TrainState (weights, FORGE states, optax states, step).

Built on ``orbax.checkpoint`` (the ``checkpoint`` extra): arrays are written
exactly, so a restored state resumes bit for bit. The static parts of the
state (``apply_fn``, ``optimizer``) are not saved; ``like`` supplies them.
"""

from __future__ import annotations

import os
from typing import Any

import jax


def _ocp():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "saving a TrainState needs orbax-checkpoint: pip install 'forge-jax[checkpoint]'"
    ) from e
  return ocp


def save_train_state(directory: str | os.PathLike, state: Any, *, force: bool = False) -> str:
  """Writes ``state`` (a :class:`forge_jax.TrainState`) to ``directory``.

  Args:
    directory: a new directory (absolute or relative path).
    state: the train state; its arrays are written as they are.
    force: overwrite an existing checkpoint at ``directory``.

  Returns:
    The absolute path written.
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(directory))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state, force=force)
    ckptr.wait_until_finished()
  return path


def restore_train_state(directory: str | os.PathLike, like: Any) -> Any:
  """Reads a state written by :func:`save_train_state`.

  Args:
    directory: what :func:`save_train_state` wrote.
    like: a TrainState of the same model and optimizer (for example a freshly
      created one, or ``jax.eval_shape`` of one): gives the structure, shapes,
      dtypes and static fields.

  Returns:
    The restored TrainState.

  Raises:
    ValueError: when the checkpoint does not match ``like``'s structure or shapes.
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(directory))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as ckptr:
    try:
      return ckptr.restore(path, abstract)
    except (ValueError, KeyError) as e:
      raise ValueError(
          f"the checkpoint at {path} does not match the given state (another model, "
          f"optimizer or configuration?): {e}"
      ) from e
