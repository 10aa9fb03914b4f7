"""Flax LLMs (Llama-3.x and Qwen3 families) built on forge_jax layers."""

__all__: list[str] = []
