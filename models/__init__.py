"""Flax LLMs of the Llama-3.x and Qwen3 families, with Hugging Face checkpoint I/O.

Public API:

* :class:`ModelConfig` (frozen dataclass), :class:`RopeScaling`, the named
  ``PRESETS`` (qwen3-0.6b ... qwen3-32b, llama-3.1-8b, tiny-qwen3, tiny-llama)
  and :func:`get_config`.
* :class:`CausalLM` (``tokens_BxL -> logits_BxLxV``), built from
  :class:`DecoderStack` (the layer loop, scanned or unrolled) of
  :class:`DecoderBlock`; :func:`param_labels` says which parameters FORGE
  updates in the backward and which are left to optax.
* :func:`cross_entropy`: the next-token loss in float32 without a float32
  copy of the logits (same value and gradient as optax's, up to rounding).
* Checkpoints: :func:`load_checkpoint`, :func:`save_checkpoint` and the
  lower-level converters in :mod:`models.hf_io`.
* :mod:`models.nnx` (imported on its own): the same models in Flax NNX, with
  the same configs, parameter tree and checkpoints.

Example::

  cfg, params = models.load_checkpoint("path/to/Qwen3-0.6B", dtype="bfloat16")
  logits_BxLxV = models.CausalLM(cfg).apply({"params": params}, tokens_BxL)
"""

from models._config import FORGE_BACKENDS
from models._config import PRESETS
from models._config import ModelConfig
from models._config import RopeScaling
from models._config import get_config
from models._layers import dense
from models._loss import cross_entropy
from models._model import CausalLM
from models._model import DecoderBlock
from models._model import DecoderStack
from models._model import check_tensor_parallel
from models._model import param_labels
from models._model import shard_train_state
from models._layers import TENSOR_PARALLEL_LAYOUT
from models.hf_io import config_from_hf
from models.hf_io import config_to_hf
from models.hf_io import load_checkpoint
from models.hf_io import params_from_hf
from models.hf_io import params_to_hf
from models.hf_io import save_checkpoint

__all__ = [
    "FORGE_BACKENDS",
    "PRESETS",
    "CausalLM",
    "DecoderBlock",
    "DecoderStack",
    "ModelConfig",
    "RopeScaling",
    "TENSOR_PARALLEL_LAYOUT",
    "config_from_hf",
    "config_to_hf",
    "check_tensor_parallel",
    "cross_entropy",
    "dense",
    "get_config",
    "load_checkpoint",
    "param_labels",
    "params_from_hf",
    "params_to_hf",
    "save_checkpoint",
    "shard_train_state",
]
