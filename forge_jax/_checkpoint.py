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
    ValueError: when the checkpoint does not match ``like``'s structure, shapes or
      dtypes (orbax would cast a stored array to ``like``'s dtype).
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(directory))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as ckptr:
    _check_dtypes(ckptr, path, abstract)
    try:
      return ckptr.restore(path, abstract)
    except (ValueError, KeyError) as e:
      raise ValueError(
          f"the checkpoint at {path} does not match the given state (another model, "
          f"optimizer or configuration?): {e}"
      ) from e


def _path_names(key_path) -> tuple:
  return tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in key_path)


def _check_dtypes(ckptr, path: str, abstract) -> None:
  """Refuses a stored array whose dtype differs from ``abstract``'s at the same path. Where
  this orbax's metadata cannot be read or its paths do not line up, it checks nothing."""
  try:
    meta = ckptr.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    stored = {_path_names(p): jax.numpy.dtype(m.dtype)
              for p, m in jax.tree_util.tree_flatten_with_path(
                  tree, is_leaf=lambda x: hasattr(x, "dtype"))[0] if hasattr(m, "dtype")}
  except Exception:  # pylint: disable=broad-except  (an orbax without this metadata API)
    return
  wrong = []
  for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    have = stored.get(_path_names(p))
    if have is not None and have != leaf.dtype:
      wrong.append(f"{'/'.join(_path_names(p))}: stored {have}, expected {leaf.dtype}")
  if wrong:
    raise ValueError(
        f"the checkpoint at {path} holds other dtypes than the given state (another "
        "precision?): " + "; ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        + ". Restore into a state of the same dtypes."
    )
