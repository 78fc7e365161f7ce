"""Model definitions in the flat layout, and building one for a parsed config."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from nanoref.models.configs import Qwen3Config, Qwen3MoeConfig
from nanoref.models.qwen3 import Qwen3ForCausalLM
from nanoref.models.qwen3_moe import Qwen3MoeForCausalLM
from nanoref.utils.loader import ModelFolderError, absent_shards, read_config, resolve_model_folder, weight_files

# HF `architectures` names this package can serve; each class's `config_class` parses its config.json
MODEL_REGISTRY = {"Qwen3ForCausalLM": Qwen3ForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}


def load_model_config(model: str | Path) -> tuple[Path, str, Qwen3Config]:
    """Check a model folder and parse its config.json once. Returns (folder, architecture, config)."""
    if not isinstance(model, (str, os.PathLike)):  # (pathlib's own TypeError would not say which argument)
        raise TypeError(f"model must be the path of a model folder (str or Path), got {type(model).__name__}")
    folder = resolve_model_folder(model)
    raw = read_config(folder)
    config_path = folder / "config.json"
    architectures = raw.get("architectures", [])
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ModelFolderError(f"{config_path}: architectures must be a list of class names, got {architectures!r}")
    supported = [name for name in architectures if name in MODEL_REGISTRY]
    if not supported:
        found = ", ".join(architectures) or f"none (model_type={raw.get('model_type')!r})"
        raise ModelFolderError(
            f"{folder}: architecture {found} is not supported; nanoref serves {', '.join(MODEL_REGISTRY)}"
        )
    if not weight_files(folder):
        raise ModelFolderError(f"{folder} holds no *.safetensors weights{absent_shards(folder)}")
    try:
        config = MODEL_REGISTRY[supported[0]].config_class.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise ModelFolderError(f"{config_path}: {error}") from None
    return folder, supported[0], config


def build_model(
    architecture: str, config: Qwen3Config, device: torch.device, dtype: torch.dtype, max_model_len: int
) -> nn.Module:
    """An uninitialised model of `architecture` on `device`: weights in `dtype` (the loader fills them),
    RoPE tables in float32 for positions below `max_model_len`."""
    with torch.device(device):
        model = MODEL_REGISTRY[architecture](config, max_model_len)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.eval()


__all__ = [
    "MODEL_REGISTRY",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "build_model",
    "load_model_config",
]
