"""Hugging Face checkpoint I/O: ``config.json`` + ``safetensors`` weights.

Reads and writes the layout of ``LlamaForCausalLM`` and ``Qwen3ForCausalLM``
(one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``)
without torch. Tensor names and layouts::

  model.embed_tokens.weight                         [V, D]  -> embed_tokens/embedding
  model.layers.{i}.input_layernorm.weight           [D]     -> .../input_layernorm/scale
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  [out, in] -> .../{q,k,v,o}_proj/kernel [in, out]
  model.layers.{i}.self_attn.{q,k}_norm.weight      [H]     -> .../{q,k}_norm/scale  (Qwen3)
  model.layers.{i}.post_attention_layernorm.weight  [D]
  model.layers.{i}.mlp.{gate,up,down}_proj.weight   [out, in] -> kernel [in, out]
  model.norm.weight                                 [D]     -> norm/scale
  lm_head.weight                                    [V, D]  -> lm_head/kernel [D, V] (untied only)

Per-layer tensors go to ``decoder/layers/block`` stacked on a leading axis
when ``cfg.scan_layers``, else to ``decoder/layers_{i}``
(:func:`models._model.layer_path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from models._config import ModelConfig, RopeScaling
from models._model import layer_path

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_ARCHITECTURE_OF = {family: arch for arch, family in ARCHITECTURES.items()}
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Buffers, not parameters, that some older Llama checkpoints carry.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_LIST_AT_MOST = 8


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One HF tensor: its name (``{i}`` = layer), Flax path, HF shape, transpose?"""

  name: str
  path: tuple[str, ...]
  shape: tuple[int, ...]
  transpose: bool


def _layer_entries(cfg: ModelConfig) -> list[_Entry]:
  d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  q, kv = cfg.num_heads * h, cfg.num_kv_heads * h
  p = "model.layers.{i}."
  out = [_Entry(p + f"{norm}.weight", (norm, "scale"), (d,), False)
         for norm in ("input_layernorm", "post_attention_layernorm")]
  attn_shapes = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q)}
  for proj, shape in attn_shapes.items():
    out.append(_Entry(p + f"self_attn.{proj}.weight", ("self_attn", proj, "kernel"), shape, True))
    if cfg.attention_bias:
      out.append(
          _Entry(p + f"self_attn.{proj}.bias", ("self_attn", proj, "bias"), shape[:1], False))
  if cfg.qk_norm:
    out += [_Entry(p + f"self_attn.{n}.weight", ("self_attn", n, "scale"), (h,), False)
            for n in ("q_norm", "k_norm")]
  for proj, shape in {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}.items():
    out.append(_Entry(p + f"mlp.{proj}.weight", ("mlp", proj, "kernel"), shape, True))
  return out


def _global_entries(cfg: ModelConfig) -> list[_Entry]:
  v, d = cfg.vocab_size, cfg.hidden_size
  out = [_Entry("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, d), False),
         _Entry("model.norm.weight", ("norm", "scale"), (d,), False)]
  if not cfg.tie_word_embeddings:
    out.append(_Entry("lm_head.weight", ("lm_head", "kernel"), (v, d), True))
  return out


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor name of the HF checkpoint of ``cfg``, with its HF shape."""
  shapes = {e.name: e.shape for e in _global_entries(cfg)}
  for i in range(cfg.num_layers):
    shapes.update({e.name.format(i=i): e.shape for e in _layer_entries(cfg)})
  return shapes


# ----------------------------------------------------------------------------- config.json


def config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """A :class:`ModelConfig` from a HF ``config.json`` dict.

  Accepts the classic ``rope_theta`` + ``rope_scaling`` keys and transformers
  5's ``rope_parameters``. ``overrides`` set any field, e.g. the implementation
  switches (``scan_layers``, ``linear``, ``dtype`` ...).
  """
  archs = hf.get("architectures") or []
  unsupported = [a for a in archs if a not in ARCHITECTURES]
  if unsupported or not archs:
    raise ValueError(
        f"Unsupported architecture {archs or hf.get('model_type')!r}: models reads only "
        f"{' and '.join(ARCHITECTURES)} checkpoints"
    )
  family = ARCHITECTURES[archs[0]]
  only = [("hidden_act", "silu"), ("mlp_bias", False), ("use_sliding_window", False)]
  for key, supported in only:
    if hf.get(key, supported) != supported:
      raise ValueError(f"Unsupported {archs[0]} config: {key}={hf[key]!r} "
                       f"(models supports only {supported!r})")
  heads = hf["num_attention_heads"]
  rope_theta, rope_scaling = _rope_from_hf(hf)
  fields = dict(
      family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=float(rope_theta),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_scaling=rope_scaling,
      max_position_embeddings=hf.get("max_position_embeddings", 8192),
      attention_bias=bool(hf.get("attention_bias", False)),
      init_std=float(hf.get("initializer_range", 0.02)),
  )
  return ModelConfig(**{**fields, **overrides})


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, Optional[RopeScaling]]:
  params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise ValueError(f"Unsupported rope type {kind!r} in config.json: "
                     "models supports 'default' and 'llama3'")
  return theta, RopeScaling(
      factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The HF ``config.json`` dict of ``cfg`` (classic keys, read by transformers 4 and 5)."""
  s = cfg.rope_scaling
  hf = {
      "architectures": [_ARCHITECTURE_OF[cfg.family]], "model_type": cfg.family,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
      "rope_scaling": None if s is None else {"rope_type": "llama3", **dataclasses.asdict(s)},
      "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
      "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": cfg.param_dtype,
  }
  if cfg.family == "llama":
    hf["mlp_bias"] = False
  else:
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
  return hf


# ----------------------------------------------------------------------------- weights


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """The ``params`` collection of ``CausalLM(cfg)`` from HF-named tensors.

  Kernels are transposed to [in, out], per-layer tensors stacked when
  ``cfg.scan_layers``, everything cast to ``cfg.param_dtype``. ``tensors`` may
  be a lazy mapping: each tensor is read once, when it is needed.

  Raises:
    ValueError: naming the missing, unexpected or wrongly shaped tensors.
  """
  _check_names(set(tensors), cfg, tensors)
  dtype = jnp.dtype(cfg.param_dtype)

  def fetch(entry: _Entry, name: str) -> np.ndarray:
    array = np.asarray(tensors[name])
    if tuple(array.shape) != entry.shape:
      raise ValueError(f"Tensor {name!r} has shape {tuple(array.shape)}, expected {entry.shape} "
                       f"for {_describe(cfg)}")
    return (array.T if entry.transpose else array).astype(dtype)

  params: dict[str, Any] = {}
  for e in _global_entries(cfg):
    _put(params, e.path, jnp.asarray(fetch(e, e.name)))
  for e in _layer_entries(cfg):
    per_layer = [fetch(e, e.name.format(i=i)) for i in range(cfg.num_layers)]
    if cfg.scan_layers:
      _put(params, layer_path(cfg, 0) + e.path, jnp.asarray(np.stack(per_layer)))
    else:
      for i, array in enumerate(per_layer):
        _put(params, layer_path(cfg, i) + e.path, jnp.asarray(array))
  return params


def _check_names(given: set[str], cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
  given = {n for n in given if not n.endswith(_IGNORED_SUFFIXES)}
  expected = set(hf_tensor_shapes(cfg))
  if cfg.tie_word_embeddings and "lm_head.weight" in given:
    # Some tied checkpoints still store the head; accept it only as the same tensor.
    head, embedding = (np.asarray(tensors[n])
                       for n in ("lm_head.weight", "model.embed_tokens.weight"))
    if not np.array_equal(head, embedding):
      raise ValueError("config.json ties the embeddings (tie_word_embeddings=true) but the "
                       "checkpoint's 'lm_head.weight' differs from 'model.embed_tokens.weight'")
    given.discard("lm_head.weight")
  missing, extra = sorted(expected - given, key=_natural), sorted(given - expected, key=_natural)
  problems = []
  if missing:
    problems.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
  if extra:
    problems.append(f"unexpected {len(extra)} tensor(s): {_listing(extra)}")
  if problems:
    raise ValueError(f"Checkpoint does not match {_describe(cfg)}: " + "; ".join(problems))


def params_to_hf(params: Mapping[str, Any], cfg: ModelConfig,
                 dtype: Optional[str] = None) -> dict[str, np.ndarray]:
  """HF-named numpy tensors ([out, in] weights) from ``CausalLM(cfg)`` params.

  Args:
    params: the ``params`` collection, laid out as ``cfg.scan_layers`` says.
    cfg: the model's config.
    dtype: dtype of the written tensors (e.g. ``"bfloat16"``); default: as stored.
  """
  cast = (lambda a: a) if dtype is None else (lambda a: a.astype(jnp.dtype(dtype)))

  def to_hf(entry: _Entry, name: str, array: np.ndarray) -> np.ndarray:
    array = array.T if entry.transpose else array
    if tuple(array.shape) != entry.shape:
      raise ValueError(f"params for {name!r} have HF shape {tuple(array.shape)}, "
                       f"expected {entry.shape} for {_describe(cfg)}")
    return np.ascontiguousarray(cast(array))

  written = {e.path for e in _global_entries(cfg)}
  for e in _layer_entries(cfg):
    written.update({layer_path(cfg, 0) + e.path} if cfg.scan_layers else
                   {layer_path(cfg, i) + e.path for i in range(cfg.num_layers)})
  out = {e.name: to_hf(e, e.name, np.asarray(_get(params, e.path, cfg)))
         for e in _global_entries(cfg)}
  for e in _layer_entries(cfg):
    if cfg.scan_layers:
      path = layer_path(cfg, 0) + e.path
      stacked = np.asarray(_get(params, path, cfg))
      if stacked.shape[:1] != (cfg.num_layers,):
        raise ValueError(f"params {'/'.join(path)} have shape {stacked.shape}: expected "
                         f"{cfg.num_layers} stacked layers on the leading axis")
      layers = list(stacked)
    else:
      layers = [np.asarray(_get(params, layer_path(cfg, i) + e.path, cfg))
                for i in range(cfg.num_layers)]
    for i, array in enumerate(layers):
      name = e.name.format(i=i)
      out[name] = to_hf(e, name, array)
  extra = sorted("/".join(p) for p in traverse_util.flatten_dict(params) if p not in written)
  if extra:
    raise ValueError(
        f"params hold {extra} that {_describe(cfg)} (attention_bias={cfg.attention_bias}) "
        "does not write: they would be lost. Save with the config the model was trained with.")
  return out


# ----------------------------------------------------------------------------- files


def load_checkpoint(path: str | pathlib.Path, **overrides) -> tuple[ModelConfig, dict[str, Any]]:
  """Reads a HF checkpoint directory: ``(cfg, params)`` for ``CausalLM(cfg)``.

  Args:
    path: a directory with ``config.json`` and ``model.safetensors`` (or shards
      listed in ``model.safetensors.index.json``).
    **overrides: :class:`ModelConfig` fields to set, e.g. ``scan_layers=False``,
      ``param_dtype="bfloat16"``, ``linear="forge"``.
  """
  path = pathlib.Path(path)
  config_file = path / CONFIG_NAME
  if not config_file.is_file():
    raise FileNotFoundError(f"No {CONFIG_NAME} in {path}")
  cfg = config_from_hf(json.loads(config_file.read_text()), **overrides)
  with _open_tensors(path) as tensors:
    return cfg, params_from_hf(tensors, cfg)


def save_checkpoint(path: str | pathlib.Path, cfg: ModelConfig, params: Mapping[str, Any], *,
                    dtype: Optional[str] = None, base_config: Optional[Mapping[str, Any]] = None,
                    max_shard_bytes: Optional[int] = None) -> None:
  """Writes ``config.json`` and the weights in the HF layout.

  Args:
    path: output directory (created if needed; a checkpoint's weights already there,
      single-file or sharded, are replaced).
    cfg: the model's config.
    params: the ``params`` collection of ``CausalLM(cfg)``.
    dtype: dtype of the written tensors, e.g. ``"bfloat16"``; default: as stored.
    base_config: a ``config.json`` dict whose other keys (token ids, ...) to keep.
    max_shard_bytes: split into ``model-0000k-of-0000n.safetensors`` shards of at
      most this size (one tensor may exceed it) plus an index; default: one file.
  """
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = params_to_hf(params, cfg, dtype)
  # The base config's rope and dtype keys in either transformers spelling would
  # contradict (and, for transformers 5's, override) the ones written here.
  base = {k: v for k, v in (base_config or {}).items() if k not in _DERIVED_KEYS}
  hf = {**base, **config_to_hf(cfg)}
  if dtype is not None:
    hf["torch_dtype"] = dtype
  hf["dtype"] = hf["torch_dtype"]  # transformers 5's name
  _remove_weights(path)  # a layout written before would shadow (or mix with) this one
  (path / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
  metadata = {"format": "pt"}  # transformers refuses safetensors files without it.
  if max_shard_bytes is None:
    save_file(tensors, path / WEIGHTS_NAME, metadata=metadata)
    return
  shards: list[dict[str, np.ndarray]] = [{}]
  for name, array in tensors.items():
    if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + array.nbytes > max_shard_bytes:
      shards.append({})
    shards[-1][name] = array
  weight_map = {}
  for k, shard in enumerate(shards):
    file_name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, path / file_name, metadata=metadata)
    weight_map.update(dict.fromkeys(shard, file_name))
  total_size = sum(a.nbytes for a in tensors.values())
  index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
  (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


_DERIVED_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")


def _remove_weights(path: pathlib.Path) -> None:
  """Deletes the weight files of a checkpoint at ``path`` (single file, index and shards)."""
  if (path / INDEX_NAME).is_file():
    for name in set(json.loads((path / INDEX_NAME).read_text()).get("weight_map", {}).values()):
      # Only the index's own shard files: bare .safetensors names in this directory.
      if pathlib.PurePath(name).name == name and name.endswith(".safetensors"):
        (path / name).unlink(missing_ok=True)
    (path / INDEX_NAME).unlink()
  for stale in [path / WEIGHTS_NAME, *path.glob("model-*-of-*.safetensors")]:
    stale.unlink(missing_ok=True)


class _LazyTensors(Mapping):
  """Name -> numpy array, read from the open safetensors file that holds it."""

  def __init__(self, file_of: dict[str, Any]):
    self._file_of = file_of

  def __getitem__(self, name: str) -> np.ndarray:
    return self._file_of[name].get_tensor(name)

  def __iter__(self) -> Iterator[str]:
    return iter(self._file_of)

  def __len__(self) -> int:
    return len(self._file_of)


@contextlib.contextmanager
def _open_tensors(path: pathlib.Path) -> Iterator[_LazyTensors]:
  if (path / INDEX_NAME).is_file():
    weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
  elif (path / WEIGHTS_NAME).is_file():
    weight_map = None
  else:
    raise FileNotFoundError(f"No {WEIGHTS_NAME} or {INDEX_NAME} in {path}")
  with contextlib.ExitStack() as stack:
    if weight_map is None:
      handle = stack.enter_context(_safe_open(path / WEIGHTS_NAME))
      yield _LazyTensors(dict.fromkeys(handle.keys(), handle))
      return
    handles = {name: stack.enter_context(_safe_open(path / name))
               for name in sorted(set(weight_map.values()))}
    yield _LazyTensors({t: handles[f] for t, f in weight_map.items()})


def _safe_open(file: pathlib.Path):
  """``safe_open`` whose errors name the file (safetensors' own say only what is wrong)."""
  if not file.is_file():
    raise FileNotFoundError(f"{file} is missing (listed in {INDEX_NAME}?)")
  try:
    return safe_open(file, framework="np")
  except Exception as e:  # pylint: disable=broad-except  (safetensors raises its own types)
    raise ValueError(
        f"cannot read {file} ({file.stat().st_size:,} bytes): {e}. The file is truncated or "
        "not a safetensors file: copy or download it again."
    ) from e


# ----------------------------------------------------------------------------- helpers


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Mapping[str, Any], path: tuple[str, ...], cfg: ModelConfig) -> Any:
  node = tree
  for key in path:
    if not isinstance(node, Mapping) or key not in node:
      raise ValueError(f"params have no {'/'.join(path)}, expected for {_describe(cfg)}")
    node = node[key]
  return node


def _describe(cfg: ModelConfig) -> str:
  return (f"{_ARCHITECTURE_OF[cfg.family]}(num_layers={cfg.num_layers}, "
          f"hidden_size={cfg.hidden_size}, tie_word_embeddings={cfg.tie_word_embeddings}, "
          f"scan_layers={cfg.scan_layers})")


def _natural(name: str) -> tuple:
  # "layers.10" after "layers.9".
  return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _listing(names: list[str]) -> str:
  shown = ", ".join(repr(n) for n in names[:_LIST_AT_MOST])
  more = len(names) - _LIST_AT_MOST
  return shown + (f", ... ({more} more)" if more > 0 else "")
