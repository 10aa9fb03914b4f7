"""Save and restore a whole TrainState (weights, FORGE states, optax states, step).

Built on ``orbax.checkpoint`` (the ``checkpoint`` extra): arrays are written
exactly, so a restored state resumes bit for bit. The static parts of the
state (``apply_fn``, ``optimizer``) are not saved; ``like`` supplies them.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import jax


# Written with every checkpoint (orbax's custom metadata, committed with it): what a later
# version needs to read it. Absent: written before 2026-12-05, int8 scales [..., K, N // block].
FORMAT = {"int8_scales": "block_major"}


class CheckpointReadError(ValueError):
  """A checkpoint whose files cannot be read back (corrupted, or cut short by a crash)."""


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
    if "custom_metadata" not in inspect.signature(ckptr.save).parameters:
      raise ImportError("saving a TrainState records its format in orbax's custom metadata: "
                        "pip install 'orbax-checkpoint>=0.11.2'")
    ckptr.save(path, state, force=force, custom_metadata={"forge_jax": FORMAT})
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
    The restored TrainState. A checkpoint written before TrainState counted
    skipped steps restores with ``skipped_steps`` 0; one written before int8 scales were
    stored block-major (``[..., K, N // block]``, forge-jax before 2026-12-05) restores with
    its scales transposed to ``[..., N // block, K]``.

  Raises:
    ValueError: when the checkpoint does not match ``like``'s structure, shapes or
      dtypes (orbax would cast a stored array to ``like``'s dtype), naming the first
      entries that differ.
    CheckpointReadError: when its files cannot be read (its metadata, or its arrays once
      the metadata matched ``like``): a corrupted checkpoint, where an older one may serve.
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no checkpoint at {path}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as ckptr:
    stored = _stored_arrays(ckptr, path)
    no_skipped = (stored is not None and getattr(abstract, "skipped_steps", None) is not None
                  and ("skipped_steps",) not in stored)
    if no_skipped:
      abstract = abstract.replace(skipped_steps=None)
    old_scales = stored is not None and _format(ckptr, path).get("int8_scales") != "block_major"
    row_major = _row_major_scales(stored, abstract) if old_scales else set()
    wanted = abstract
    if row_major:
      abstract = _map_paths(abstract, row_major, _swapped_struct)
    if stored is not None:
      _check_matches(path, stored, abstract)
    try:
      state = ckptr.restore(path, abstract)
    except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore raise many types)
      what = ("its metadata cannot be read" if stored is None else
              "its entries match the given state but their data cannot be read")
      raise CheckpointReadError(
          f"the checkpoint at {path} is corrupted or incomplete ({what}): {_first_lines(e)}"
      ) from e
  if no_skipped:
    state = state.replace(skipped_steps=jax.numpy.zeros([], jax.numpy.int32))
  if row_major:
    want = {_path_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(wanted)[0]}
    state = _map_paths(state, row_major, lambda a, p: jax.jit(
        lambda v: jax.numpy.swapaxes(v, -1, -2), out_shardings=want[p].sharding)(a))
  return state


def _format(ckptr, path: str) -> dict:
  """The ``FORMAT`` a checkpoint was written with ({} before there was one)."""
  try:
    custom = getattr(ckptr.metadata(path), "custom_metadata", None) or {}
  except Exception:  # pylint: disable=broad-except  (an orbax without this metadata API)
    return {}
  return dict(custom.get("forge_jax", {}))


def _row_major_scales(stored: dict, abstract) -> set:
  """Paths of a matrix's int8 scales, which ``abstract`` holds block-major (``[..., N // block,
  K]``), in a checkpoint written before: stored ``[..., K, N // block]`` (square ones too)."""
  out = set()
  for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    names = _path_names(p)
    shape = tuple(getattr(leaf, "shape", ()))
    if (names and names[-1] == "scale" and len(shape) >= 2
        and names in stored and tuple(stored[names][0]) == shape[:-2] + shape[:-3:-1]):
      out.add(names)
  return out


def _map_paths(tree, paths: set, fn):
  return jax.tree_util.tree_map_with_path(
      lambda p, a: fn(a, _path_names(p)) if _path_names(p) in paths else a, tree)


def _swapped_struct(a, _):
  """``a``'s ShapeDtypeStruct with its last two axes (and their sharding) swapped."""
  sharding = a.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *spec[:-2], spec[-1], spec[-2]))
  return jax.ShapeDtypeStruct(a.shape[:-2] + (a.shape[-1], a.shape[-2]), a.dtype, sharding=sharding)


def _first_lines(e: BaseException, lines: int = 4, chars: int = 600) -> str:
  text = "\n".join(str(e).strip().splitlines()[:lines])
  return text if len(text) <= chars else text[:chars] + " ..."


def _path_names(key_path) -> tuple:
  return tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in key_path)


def _stored_arrays(ckptr, path: str):
  """``{path names: (shape, dtype)}`` of the stored arrays, or None where this orbax's
  metadata cannot be read (then only orbax's own checks run)."""
  try:
    meta = ckptr.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    if tree is None:
      return None
    return {_path_names(p): (tuple(getattr(m, "shape", None) or ()), jax.numpy.dtype(m.dtype))
            for p, m in jax.tree_util.tree_flatten_with_path(
                tree, is_leaf=lambda x: hasattr(x, "dtype"))[0] if hasattr(m, "dtype")}
  except Exception:  # pylint: disable=broad-except  (an orbax without this metadata API)
    return None


def _listing(items, n: int = 5) -> str:
  items = sorted(items)
  return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _check_matches(path: str, stored: dict, abstract) -> None:
  """Refuses a checkpoint whose entries, shapes or dtypes differ from ``abstract``'s, in a few
  lines (orbax's own message lists every subtree of both sides)."""
  expected = {_path_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  name = "/".join
  problems = []
  missing = [name(p) for p in expected if p not in stored]
  extra = [name(p) for p in stored if p not in expected]
  if missing:
    problems.append(f"expected but not stored: {_listing(missing)}")
  if extra:
    problems.append(f"stored but not expected: {_listing(extra)}")
  shapes = [f"{name(p)}: stored {stored[p][0]}, expected {tuple(leaf.shape)}"
            for p, leaf in expected.items()
            if p in stored and stored[p][0] and tuple(stored[p][0]) != tuple(leaf.shape)]
  if shapes:
    problems.append("other shapes: " + _listing(shapes))
  if problems:
    raise ValueError(
        f"the checkpoint at {path} does not match the given state (another model, optimizer "
        "or configuration?): " + "; ".join(problems) + ".")
  dtypes = [f"{name(p)}: stored {stored[p][1]}, expected {leaf.dtype}"
            for p, leaf in expected.items() if stored[p][1] != leaf.dtype]
  if dtypes:
    raise ValueError(
        f"the checkpoint at {path} holds other dtypes than the given state (another "
        "precision?): " + _listing(dtypes) + ". Restore into a state of the same dtypes."
    )
