"""Model definitions in the flat layout."""

from nanoref.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

# HF `architectures` names this package can serve
MODEL_REGISTRY = {"Qwen3ForCausalLM": Qwen3ForCausalLM}

__all__ = ["MODEL_REGISTRY", "Qwen3Config", "Qwen3ForCausalLM"]
