"""Loading a local Hugging Face model folder: config.json, *.safetensors, tokenizer files.

Every way a folder can be wrong gets its own message: a hub id instead of a path, a missing folder,
a config.json that is not JSON, no weights, an architecture nanoref does not implement, a checkpoint
whose tensors do not match the config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from nanoref.models import MODEL_REGISTRY, Qwen3Config


class ModelFolderError(ValueError):
    """The model folder is missing, malformed, or holds a model nanoref cannot serve."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_folder(model: str | Path) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not path.exists() and _HUB_ID.match(str(model)):
        raise ModelFolderError(
            f"{model!r} looks like a Hugging Face model id, but nanoref only loads local folders and never "
            f"downloads. Fetch it once, then pass the folder:\n"
            f"    huggingface-cli download {model} --local-dir ./{str(model).split('/')[-1]}"
        )
    if path.exists():
        raise ModelFolderError(f"model path {str(path)!r} is a file; pass the folder that holds config.json")
    raise ModelFolderError(f"model folder {str(path)!r} does not exist")


def read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFolderError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ModelFolderError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{config_path} must hold a JSON object")
    return raw


def load_model_config(model: str | Path) -> tuple[Path, str, Qwen3Config]:
    """Validate a folder and parse its config. Returns (folder, architecture, config)."""
    folder = resolve_model_folder(model)
    raw = read_config(folder)
    architectures = raw.get("architectures") or []
    supported = [name for name in architectures if name in MODEL_REGISTRY]
    if not supported:
        found = ", ".join(architectures) or f"none (model_type={raw.get('model_type')!r})"
        raise ModelFolderError(
            f"{folder}: architecture {found} is not supported; nanoref serves {', '.join(MODEL_REGISTRY)}"
        )
    if not weight_files(folder):
        raise ModelFolderError(f"{folder} holds no *.safetensors weights")
    try:
        config = Qwen3Config.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise ModelFolderError(f"{folder / 'config.json'}: {error}") from None
    return folder, supported[0], config


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def load_weights(model: nn.Module, folder: Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; fail on anything unmatched."""
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    # what a complete checkpoint provides: every parameter, and every shard of the fused ones
    expected: set[str] = set()
    for param_name in params:
        parts = [part for part, (fused, _) in packed.items() if f".{fused}." in param_name]  # e.g. q/k/v_proj
        if parts:
            expected |= {param_name.replace(packed[part][0], part) for part in parts}
        else:
            expected.add(param_name)
    if tied:
        expected.discard("lm_head.weight")
    loaded: set[str] = set()
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if tied and name == "lm_head.weight":
                    continue  # tied checkpoints may still carry it: the embedding is the head
                target, shard_id = name, None
                for checkpoint_part, (fused_part, shard) in packed.items():
                    if f".{checkpoint_part}." in name:
                        target, shard_id = name.replace(checkpoint_part, fused_part), shard
                        break
                param = params.get(target)
                if param is None:
                    raise ModelFolderError(f"{file.name}: tensor {name!r} matches no parameter of the model")
                tensor = handle.get_tensor(name).to(param.dtype)
                loader = getattr(param, "weight_loader", None)
                try:
                    if loader is None:
                        if param.shape != tensor.shape:
                            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                        param.data.copy_(tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except ValueError as error:
                    raise ModelFolderError(f"{file.name}: tensor {name!r}: {error}") from None
                loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelFolderError(f"{folder}: the checkpoint lacks {len(missing)} tensors: {shown}")


def load_model(model_path: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, Qwen3Config]:
    folder, architecture, config = load_model_config(model_path)
    with torch.device(device):
        model = MODEL_REGISTRY[architecture](config)
    for param in model.parameters():  # weights in the serving dtype; RoPE tables (buffers) stay float32
        param.data = param.data.to(dtype)
    load_weights(model, folder)
    return model.eval(), config
