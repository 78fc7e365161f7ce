"""LoRA adapters served per request: PEFT folders read and checked (adapters.py), device slots and the batched
delta in the flat layout (manager.py, ops/lora.py), wired into the engine by `LLM(enable_lora=True)` through the
core's hooks (hooks.py)."""

from nanoref.lora.adapters import LoRAAdapterError
from nanoref.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest"]
