"""Reading a local Hugging Face model folder: config.json, *.safetensors, tokenizer files.

Every way a folder can be wrong is a `ModelFolderError` naming the file: a hub id instead of a path, a
missing folder, a config.json that is not UTF-8 JSON, unreadable or missing weights, tensors that match
no parameter or have the wrong shape or dtype, a tensor in two shards, a broken tokenizer. Parsing the
config into a model's settings and building the model belong to `nanoref.models`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanoref.utils.progress import tqdm


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
            f"    hf download {model} --local-dir ./{str(model).split('/')[-1]}"
        )
    if path.exists():
        raise ModelFolderError(f"model path {str(path)!r} is a file; pass the folder that holds config.json")
    raise ModelFolderError(f"model folder {str(path)!r} does not exist")


def read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFolderError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    return read_json_object(config_path, "a model config")


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file that holds one object (what: the words for it in an error) -> the object."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ModelFolderError(f"{path} is not UTF-8 text: {error}") from None
    except json.JSONDecodeError as error:
        raise ModelFolderError(f"{path} is not valid JSON: {error}") from None
    except RecursionError:
        raise ModelFolderError(f"{path} is nested too deeply to be {what}") from None
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{path} must hold a JSON object")
    return raw


INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The folder's *.safetensors weights: where it has model.safetensors.index.json, the files its weight_map lists
    (as vLLM reads a sharded checkpoint: another *.safetensors beside the shards, such as a whole
    model.safetensors left from an earlier save, is not part of it). Only regular files (or links to one) are
    weights: opening a FIFO of that name would block forever and a folder would fail with a bare OSError, so either
    is named here instead."""
    files = sorted(folder.glob("*.safetensors"))
    if (folder / INDEX_FILE).is_file():
        weight_map = read_json_object(folder / INDEX_FILE, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ModelFolderError(f"{folder / INDEX_FILE}: weight_map must map tensor names to shard file names")
        listed = set(weight_map.values())
        files = [path for path in files if path.name in listed]
    for path in files:
        if not path.is_file():
            kind = "a folder" if path.is_dir() else "a broken link" if not path.exists() else "not a regular file"
            raise ModelFolderError(
                f"{path} is {kind}: every *.safetensors entry of a model folder must be a weights file"
            )
    return files


# which part of a parameter a checkpoint tensor fills: None = all of it, else what its weight_loader understands
Shard = int | str | tuple[int, int | None] | None


def checkpoint_names(model: nn.Module) -> dict[str, tuple[str, Shard]]:
    """Every tensor name a checkpoint may hold for `model` -> (the parameter it fills, which shard of it).

    A parameter's own name always counts (the checkpoint holds it whole); a fused parameter also counts under
    the names of its pieces (`packed_modules_mapping`: q_proj, k_proj, v_proj are shards "q", "k", "v" of
    qkv_proj). A model whose pieces that mapping cannot name (Qwen3-MoE's per-expert weights, stacked into one
    3-D parameter) lists them itself in `checkpoint_shards()`.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    names: dict[str, tuple[str, Shard]] = {}
    for param_name, _ in model.named_parameters(remove_duplicate=False):
        names[param_name] = (param_name, None)
        for part, (fused, shard) in packed.items():
            if f".{fused}." in param_name:
                names[param_name.replace(fused, part)] = (param_name, shard)
    if hasattr(model, "checkpoint_shards"):
        names.update(model.checkpoint_shards())
    return names


# a checkpoint this large gets a progress bar over its shards while it loads (vLLM shows one): an 8B model's 16 GB
# take tens of seconds to read. The tiny models of the notebooks and tests load in well under a second and show none
PROGRESS_MIN_BYTES = 2 * 2**30


def load_weights(model: nn.Module, folder: Path, show_progress: bool = True) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; fail on anything unmatched. show_progress:
    a bar over the shards where they hold PROGRESS_MIN_BYTES or more (a tensor-parallel rank other than 0: none)."""
    files = weight_files(folder)
    large = sum(file.stat().st_size for file in files) >= PROGRESS_MIN_BYTES
    bar = tqdm(total=len(files), desc="Loading safetensors checkpoint shards", unit="shard", disable=not (
        show_progress and large), dynamic_ncols=True)  # fmt: skip
    try:
        _load_files(model, folder, files, bar)
    finally:
        bar.close()


def _load_files(model: nn.Module, folder: Path, files: list[Path], bar: tqdm) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    names = checkpoint_names(model)
    loaded: dict[str, str] = {}  # checkpoint tensor -> the file it came from
    filled: dict[str, dict[Shard, str]] = {}  # parameter -> {shard it got: from which checkpoint tensor}
    tied_head: tuple[str, torch.Tensor] | None = None  # a tied checkpoint's own lm_head.weight, checked below
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in loaded:
                        raise ModelFolderError(f"{file.name}: tensor {name!r} is also in {loaded[name]}")
                    loaded[name] = file.name
                    tensor = handle.get_tensor(name)
                    if not tensor.dtype.is_floating_point:
                        raise ModelFolderError(f"{file.name}: tensor {name!r} has dtype {tensor.dtype}, not a float")
                    if tied and name == "lm_head.weight":
                        tied_head = (file.name, tensor)  # tied: the embedding is the head, so it must agree
                        continue
                    if name not in names:
                        raise ModelFolderError(f"{file.name}: tensor {name!r} matches no parameter of the model")
                    param_name, shard = names[name]
                    got = filled.setdefault(param_name, {})
                    if got and (shard is None or None in got):  # e.g. fused experts.gate_up_proj beside experts.0.*
                        other = next(iter(got.values()))
                        raise ModelFolderError(
                            f"{file.name}: tensor {name!r} and tensor {other!r} both fill {param_name!r}: "
                            "a checkpoint holds a parameter either whole or in pieces, not both"
                        )
                    got[shard] = name
                    _load_tensor(params[param_name], file.name, name, tensor, shard)
        except SafetensorError as error:  # truncated, empty or not a safetensors file at all
            raise ModelFolderError(f"{file}: not a readable safetensors file: {error}") from None
        bar.update(1)
    if tied_head is not None:
        file_name, head = tied_head
        embedding = params["model.embed_tokens.weight"]
        full_shape = getattr(embedding, "full_shape", tuple(embedding.shape))
        mine = getattr(embedding, "shard_of", lambda t: t)(head)  # tensor parallel: this rank's rows only
        if tuple(head.shape) != tuple(full_shape) or not torch.equal(
            mine.to(embedding.dtype), embedding.data[: mine.shape[0]]
        ):
            raise ModelFolderError(
                f"{folder / 'config.json'} sets tie_word_embeddings: true, but {file_name} holds an lm_head.weight "
                "that differs from model.embed_tokens.weight; set tie_word_embeddings to false to use it"
            )
    # what a complete checkpoint provides: every parameter, whole or in all of its pieces
    pieces: dict[str, dict[Shard, str]] = {}  # parameter -> {shard: the checkpoint name that fills it}
    for name, (param_name, shard) in names.items():
        if shard is not None:
            pieces.setdefault(param_name, {})[shard] = name
    missing = []
    for param_name in params:
        got = filled.get(param_name, {})
        if None in got or (tied and param_name == "lm_head.weight"):
            continue
        expected = pieces.get(param_name, {None: param_name})
        missing += [name for shard, name in expected.items() if shard not in got]
    if missing:
        missing.sort()
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelFolderError(f"{folder}: the checkpoint lacks {len(missing)} tensors: {shown}{absent_shards(folder)}")


def absent_shards(folder: Path) -> str:
    """Where the folder's model.safetensors.index.json lists shard files that are not there (a download cut short):
    a sentence naming them, for the error about the tensors they held; else ""."""
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        absent = sorted({name for name in weight_map.values() if not (folder / name).exists()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no index, or one that cannot tell
        return ""
    if not absent:
        return ""
    shown = ", ".join(absent[:5]) + (" ..." if len(absent) > 5 else "")
    return (
        f" (model.safetensors.index.json lists {len(absent)} shard files that are not in the folder: {shown}; "
        "a download cut short? fetch them again)"
    )


def _load_tensor(param: nn.Parameter, file_name: str, name: str, tensor: torch.Tensor, shard: Shard) -> None:
    """Copy one checkpoint tensor into its parameter (or its shard of a fused one)."""
    tensor = tensor.to(param.dtype)
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
    except ValueError as error:
        raise ModelFolderError(f"{file_name}: tensor {name!r}: {error}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")  # a folder with one of these has one


def tokenizer_files(folder: Path) -> list[str]:
    """The folder's tokenizer files among TOKENIZER_FILES (none: the folder has no tokenizer)."""
    return [name for name in TOKENIZER_FILES if (folder / name).exists()]


def load_tokenizer(folder: Path, use_fast: bool = True) -> Any | None:
    """The folder's HF tokenizer, or None when it has none (token-id prompts still work). use_fast=False: the slow
    (Python) tokenizer (vLLM's tokenizer_mode="slow"), which needs the folder's vocabulary files."""
    present = tokenizer_files(folder)
    if not present:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), use_fast=use_fast)
    except Exception as error:  # corrupt JSON, missing keys, unknown classes: all "this folder's tokenizer"
        raise ModelFolderError(
            f"{folder}: the tokenizer ({', '.join(present)}) could not be loaded: {type(error).__name__}: {error}"
        ) from None
    if not use_fast and tokenizer.is_fast:  # (transformers 5 loads most tokenizers fast whatever it is asked)
        raise ModelFolderError(
            f"tokenizer_mode='slow': {folder} has no slow tokenizer that this transformers version loads; use 'auto'"
        )
    # nanoref checks prompt lengths against max_model_len itself, with its own message; without this the
    # tokenizer first warns about its own (often unrelated) model_max_length
    tokenizer.model_max_length = 1 << 62
    return tokenizer
