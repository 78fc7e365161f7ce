"""LoRA adapters as PEFT saves them, read and checked against the model they adapt.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with, per adapted projection, `...layers.{i}.self_attn.q_proj.lora_A.weight` (r, in)
and `...lora_B.weight` (out, r). nanoref fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`
(layers/linear.py), so each checkpoint projection lands on a (fused module, piece) of the flat model; a piece keeps
its own A and B. Everything that can be wrong with a folder is found here, before any slot is touched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# checkpoint projection -> (nanoref module inside a decoder layer, piece of a fused module or None)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}
# adapter_config.json settings nanoref does not serve, with the value that means "not used"; the LoRA variants
# among them (DoRA, aLoRA, QA-LoRA, Arrow, BD-LoRA, KaSA, MonteCLoRA) compute something else than s (x A^T) B^T
UNSUPPORTED = {
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
    "lora_bias": False,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "arrow_config": None,
    "use_bdlora": None,
    "kasa_config": None,
    "monteclora_config": None,
}
# settings read below, and those that do not change what a trained adapter computes at inference (how it was
# trained or initialised, which modules it adapts: its weights say that); any other setting with a value is refused,
# since a later peft's setting may change the forward, and serving the adapter without it would be silently wrong
READ = {"peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "bias"}
INERT = {
    "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "exclude_modules", "lora_dropout", "init_lora_weights", "layers_to_transform", "layers_pattern",
    "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "velora_config", "runtime_config", "ensure_weight_tying", "qalora_group_size",
    "fan_in_fan_out",  # (for GPT-2's Conv1D: on an nn.Linear, every Qwen3 projection, peft sets it to False)
}  # fmt: skip
PEFT_LORA_ALPHA = 8  # peft's LoraConfig default: what peft scales by when adapter_config.json has no lora_alpha
PEFT_LORA_R = 8  # peft's LoraConfig default rank, where adapter_config.json has no r


class LoRAAdapterError(ValueError):
    """A LoRA adapter folder that nanoref cannot serve; the message names the folder and the problem."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: (layer, module, piece) -> (A (r, in), B (out, r))."""

    name: str
    int_id: int
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    weights: dict[tuple[int, str, int | None], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def expected_shapes(config, module: str, piece: int | None) -> tuple[int, int]:
    """(in, out) of one checkpoint projection of a Qwen3 decoder layer with this config."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        ("self_attn.qkv_proj", 0): (hidden, q),
        ("self_attn.qkv_proj", 1): (hidden, kv),
        ("self_attn.qkv_proj", 2): (hidden, kv),
        ("self_attn.o_proj", None): (q, hidden),
        ("mlp.gate_up_proj", 0): (hidden, inter),
        ("mlp.gate_up_proj", 1): (hidden, inter),
        ("mlp.down_proj", None): (inter, hidden),
    }[module, piece]


def load_adapter(
    path: str | Path, name: str, int_id: int, config, max_lora_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check the PEFT adapter in `path` for a model with this (parsed) config, whose slots hold `dtype`;
    LoRAAdapterError naming the problem otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    if not folder.is_dir():
        raise LoRAAdapterError(f"{where}: no such folder")
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoRAAdapterError(f"{where}: adapter_config.json is missing (a PEFT adapter folder has one)")
    if not weights_file.is_file():
        also = (
            " (adapter_model.bin is not read: save with safe_serialization=True)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise LoRAAdapterError(f"{where}: adapter_model.safetensors is missing{also}")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise LoRAAdapterError(f"{where}: adapter_config.json is not valid JSON ({error})") from None
    if not isinstance(settings, dict):
        raise LoRAAdapterError(f"{where}: adapter_config.json must hold an object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {settings['peft_type']!r}; only LORA adapters are served")
    for key, neutral in UNSUPPORTED.items():
        value = settings.get(key, neutral)
        if value not in (neutral, None) and value != {} and value != []:
            raise LoRAAdapterError(f"{where}: {key}={value!r} is not supported")
    for key, value in settings.items():
        if key not in UNSUPPORTED and key not in READ and key not in INERT and value not in (None, False, {}, []):
            raise LoRAAdapterError(f"{where}: {key}={value!r} is not a setting nanoref knows, so it is not served")
    if settings.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={settings['bias']!r} is not supported (only 'none')")
    rank, alpha = settings.get("r", PEFT_LORA_R), settings.get("lora_alpha", PEFT_LORA_ALPHA)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{where}: its rank r={rank} is above max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = settings.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise LoRAAdapterError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")
    targets = settings.get("target_modules") or []
    if not isinstance(targets, (str, list)) or not all(isinstance(target, str) for target in targets):
        raise LoRAAdapterError(f"{where}: target_modules must be a list of module names or a regex, got {targets!r}")
    # (a regex is left to the weights' own check; a name may be a dotted path, which peft matches by its end, as
    # "model.layers.0.self_attn.q_proj": its last part is the projection, as vLLM reads it)
    for target in [] if isinstance(targets, str) else targets:
        if target.rsplit(".", 1)[-1] not in TARGETS:
            raise LoRAAdapterError(
                f"{where}: target module {target!r} is not one nanoref adapts (it adapts {', '.join(TARGETS)})"
            )
    try:
        tensors = load_file(weights_file)
    except (SafetensorError, OSError) as error:
        raise LoRAAdapterError(f"{where}: adapter_model.safetensors cannot be read ({error})") from None
    weights = _collect(tensors, where, config, rank)
    _check_finite(weights, where, dtype)
    if not weights:
        raise LoRAAdapterError(f"{where}: adapter_model.safetensors holds no lora_A/lora_B weights")
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return LoRAAdapter(name, int_id, rank, float(scaling), weights)


def _check_finite(weights: dict, where: str, dtype: torch.dtype) -> None:
    """LoRAAdapterError naming the first weight that is NaN or infinite in the slots' dtype (float16 overflows past
    65,504). Not vLLM's check, whose kernels compute each row with its own adapter alone: nanoref's masked product
    (ops/lora.py) multiplies every slot's A and B by 0 for the rows of other slots, and 0 x NaN is NaN, so such an
    adapter in a slot would turn every row of every step NaN, base-model rows and other adapters' alike."""
    for (layer, module, piece), pair in weights.items():
        for label, tensor in zip(("lora_A", "lora_B"), pair):
            if not torch.isfinite(tensor.to(dtype)).all():
                where_in = f"layer {layer} {module}" + ("" if piece is None else f" piece {piece}")
                raise LoRAAdapterError(
                    f"{where}: {where_in}: {label} holds NaN or infinite values"
                    + (f" (in {str(dtype).removeprefix('torch.')})" if dtype != torch.float32 else "")
                )


def _collect(tensors: dict, where: str, config, rank: int) -> dict:
    """The checkpoint's lora_A/lora_B pairs by (layer, module, piece), every shape checked."""
    pairs: dict[tuple[int, str, int | None], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        if len(parts) < 4 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
            raise LoRAAdapterError(f"{where}: unexpected tensor {key!r} (only lora_A / lora_B weights are served)")
        projection = parts[-3]
        if projection not in TARGETS or "layers" not in parts:
            raise LoRAAdapterError(f"{where}: tensor {key!r} adapts {projection!r}, which nanoref does not adapt")
        layer = parts[parts.index("layers") + 1]
        if not layer.isdigit():
            raise LoRAAdapterError(f"{where}: tensor {key!r} names no layer number after 'layers'")
        layer = int(layer)
        if not 0 <= layer < config.num_hidden_layers:
            raise LoRAAdapterError(
                f"{where}: tensor {key!r} names layer {layer}; the model has {config.num_hidden_layers}"
            )
        module, piece = TARGETS[projection]
        if module.startswith("mlp.") and getattr(config, "is_sparse", lambda index: False)(layer):
            raise LoRAAdapterError(
                f"{where}: tensor {key!r} adapts {projection!r} of layer {layer}, a sparse (mixture-of-experts) layer "
                "whose experts nanoref does not adapt"
            )
        pairs.setdefault((layer, module, piece), {})[parts[-2]] = tensor
    weights = {}
    for (layer, module, piece), pair in sorted(pairs.items(), key=str):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(
                f"{where}: layer {layer} {module} has only {sorted(pair)}, not both lora_A and lora_B"
            )
        size_in, size_out = expected_shapes(config, module, piece)
        a, b = pair["lora_A"], pair["lora_B"]
        if tuple(a.shape) != (rank, size_in) or tuple(b.shape) != (size_out, rank):
            raise LoRAAdapterError(
                f"{where}: layer {layer} {module} piece {piece}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit this model (expected ({rank}, {size_in}) and ({size_out}, {rank}))"
            )
        weights[layer, module, piece] = (a.float(), b.float())
    return weights
