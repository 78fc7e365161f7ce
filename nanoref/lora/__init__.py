"""LoRA adapters served per request: PEFT folders, device slots, the batched delta in the flat layout."""

from nanoref.lora.request import LoRARequest

__all__ = ["LoRARequest"]
