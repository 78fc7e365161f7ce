"""LoRA adapters: PEFT folders, device slots, the batched delta in the flat layout (not yet wired into requests:
see manager.py)."""

from nanoref.lora.request import LoRARequest

__all__ = ["LoRARequest"]
