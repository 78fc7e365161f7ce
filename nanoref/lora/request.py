"""`LoRARequest`: which adapter a request runs under, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (what the server lists and a request's `model` picks); lora_int_id: a
    positive integer that identifies it for the engine (its slot, its prefix-cache entries); lora_path: the PEFT
    adapter folder (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
