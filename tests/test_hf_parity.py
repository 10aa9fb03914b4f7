"""Logits parity with Hugging Face transformers (PyTorch, CPU), through shared safetensors files.

Both directions: a transformers model saved with ``save_pretrained`` is loaded
by :func:`models.load_checkpoint`, and a checkpoint written by
:func:`models.save_checkpoint` is loaded by ``from_pretrained``; the logits of
the two implementations must agree in float32 to ``ATOL``/``RTOL``.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

import models
from models import hf_io
from models._layers import rope_inv_frequencies

torch = transformers = None  # imported by import_torch_and_transformers


def import_torch_and_transformers():
  """Imports torch and transformers into this module (other test modules that use its functions
  call it too), or skips the calling test without them."""
  global torch, transformers  # pylint: disable=global-statement
  torch = pytest.importorskip(
      "torch", reason="the parity tests need torch (pip install -e '.[test]')")
  transformers = pytest.importorskip(
      "transformers", reason="the parity tests need transformers (pip install -e '.[test]')")


@pytest.fixture(scope="module", autouse=True)
def _torch_and_transformers():
  """Imported when this module's tests run, not when pytest collects it: every xdist worker
  collects every module, and torch with transformers take about 5 s of CPU to import."""
  import_torch_and_transformers()


# Compile time dominates these tests (tests/conftest.py); the logits stay within ATOL/RTOL.
pytestmark = pytest.mark.usefixtures("fast_cpu_compiles", "legacy_cpu_emitter")

# float32 on CPU, logits of order 1 from 2-layer models: observed max error 3.3e-6 (2026-11-29).
ATOL = RTOL = 2e-5

CASES = {
    "qwen3-tied": models.get_config("tiny-qwen3"),
    "qwen3-untied": models.get_config("tiny-qwen3", tie_word_embeddings=False),
    "llama-llama3-rope-untied": models.get_config("tiny-llama"),
    "llama-plain-rope-tied": models.get_config("tiny-llama", tie_word_embeddings=True,
                                               rope_scaling=None),
}


def _hf_model_from_dir(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager")
  return model.eval()


def _random_hf_checkpoint(cfg, path, seed=0):
  """A transformers model with every weight random (norm scales too), saved to ``path``."""
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(hf_io.config_to_hf(cfg)))
  hf_config = transformers.AutoConfig.from_pretrained(path)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Norm scales start at 1: perturb them so that a mixed-up scale shows.
      noise = torch.randn_like(p)
      p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
  model.save_pretrained(path)
  return model


def _tokens(cfg, seed=3):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(2, 24))


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens)).logits.numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_checkpoint_loads_with_equal_logits(tmp_path, case):
  cfg = CASES[case]
  hf_model = _random_hf_checkpoint(cfg, tmp_path)
  tokens = _tokens(cfg)
  expected = _hf_logits(hf_model, tokens)
  for scan_layers in (True, False):
    loaded_cfg, params = models.load_checkpoint(tmp_path, scan_layers=scan_layers)
    assert loaded_cfg == dataclasses.replace(cfg, scan_layers=scan_layers)
    logits = jax.jit(models.CausalLM(loaded_cfg).apply)({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["qwen3-tied", "llama-llama3-rope-untied"])
def test_saved_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, case):
  cfg = CASES[case]
  model = models.CausalLM(cfg)
  tokens = _tokens(cfg)
  params = jax.jit(model.init)(jax.random.key(5), tokens)["params"]
  # Random norm scales, as above.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * (1 + 0.2 * jax.random.normal(jax.random.key(len(path)), x.shape))
      if path[-1].key == "scale" else x, params)
  # Sharded, as large checkpoints are.
  models.save_checkpoint(tmp_path, cfg, params, max_shard_bytes=100_000)
  hf_model = _hf_logits(_hf_model_from_dir(tmp_path), tokens)
  logits = jax.jit(model.apply)({"params": params}, tokens)
  np.testing.assert_allclose(np.asarray(logits), hf_model, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["llama-llama3-rope-untied", "qwen3-tied"])
def test_rope_frequencies_match_transformers(tmp_path, case):
  cfg = CASES[case]
  hf_model = _random_hf_checkpoint(cfg, tmp_path)
  hf_inv_freq = hf_model.model.rotary_emb.inv_freq.numpy()
  np.testing.assert_allclose(rope_inv_frequencies(cfg), hf_inv_freq, rtol=1e-6)
  if cfg.rope_scaling is not None:  # the scaling really changes something
    plain = rope_inv_frequencies(dataclasses.replace(cfg, rope_scaling=None))
    assert not np.allclose(plain, hf_inv_freq)
