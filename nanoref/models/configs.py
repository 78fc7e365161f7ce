"""config.json, parsed and checked: the fields a Qwen3 or Qwen3-MoE forward reads, as plain dataclasses.

Each model class names its parser (`config_class`); `nanoref.models.load_model_config` calls its `from_dict` on
the folder's config.json once. Nothing here builds a tensor: a bad field fails here, with its name, before any
weight is read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Qwen3Config:
    """The fields of an HF `config.json` that a Qwen3 forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    # the checkpoint's dtype as config.json names it ("dtype", or transformers 4's "torch_dtype"), None where it
    # names none: what dtype="auto" keeps on CUDA (nanoref.config.parse_dtype)
    dtype: str | None = None

    REQUIRED = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    )

    # transformers' values for fields a config.json leaves out (its Qwen3Config's; Qwen3MoeConfig has its own)
    ABSENT = {"head_dim": 128, "num_key_value_heads": 32}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], absent: dict[str, int] | None = None) -> Qwen3Config:
        """Parse and check an HF config.json dict; ValueError names the first bad field. absent: transformers' values
        for fields it leaves out (default: Qwen3Config's, ABSENT); without a head_dim there, hidden_size // heads."""
        absent = Qwen3Config.ABSENT if absent is None else absent
        missing = [key for key in cls.REQUIRED if key not in raw]
        if missing:
            raise ValueError(f"config.json lacks required Qwen3 fields: {', '.join(missing)}")
        # transformers 5 keeps rope_theta inside rope_parameters; transformers 4 at the top level. Where both dicts
        # are given, transformers 5 runs rope_scaling's RoPE (Qwen3's guide adds one for YaRN), its rope_theta, else
        # the top level's, else 10,000 (its default, as transformers 4's): each dict is checked
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        for key in ("rope_parameters", "rope_scaling"):
            given = raw.get(key) or {}
            if not isinstance(given, dict):
                raise ValueError(f"{key} must be a JSON object, got {given!r}")
            rope_type = given.get("rope_type", given.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"{key}: rope type {rope_type!r} is not supported (only 'default' RoPE)")
        heads = _integer(raw, "num_attention_heads")
        hidden = _integer(raw, "hidden_size")
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
        config = cls(
            vocab_size=_integer(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_integer(raw, "intermediate_size"),
            num_hidden_layers=_integer(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            # (null: as many as the heads, as in transformers)
            num_key_value_heads=_integer(raw, "num_key_value_heads", default=heads, absent=absent),
            head_dim=_integer(raw, "head_dim", default=hidden // heads, absent=absent),
            max_position_embeddings=_integer(raw, "max_position_embeddings", minimum=2),
            rms_norm_eps=_positive_number(raw, "rms_norm_eps", 1e-6),
            rope_theta=_positive_number(rope, "rope_theta", _positive_number(raw, "rope_theta", 10_000.0)),
            tie_word_embeddings=_boolean(raw, "tie_word_embeddings", False),
            attention_bias=_boolean(raw, "attention_bias", False),
            eos_token_id=list(eos_ids),
            dtype=raw.get("dtype") if raw.get("dtype") is not None else raw.get("torch_dtype"),  # (transformers' order)
        )
        if config.num_attention_heads % config.num_key_value_heads:
            why = "" if "num_key_value_heads" in raw else ": transformers' default where config.json has none"
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads}{why})"
            )
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
        bad_eos = [e for e in eos_ids if e >= config.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_id {bad_eos[0]} is outside the vocabulary [0, {config.vocab_size})")
        _check_the_forward_is_nanorefs(raw, config.num_hidden_layers)
        return config


def _check_the_forward_is_nanorefs(raw: dict[str, Any], num_layers: int) -> None:
    """Fields that would change the forward to one nanoref does not run (a SiLU MLP attending over the whole context
    in every layer), and a dtype that names no dtype: ValueError naming the field, rather than another model's
    output, or transformers' error when the tokenizer loads."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Qwen3's MLP uses 'silu')")
    # transformers' rule: layer_types where given; else layers from max_window_layers (28) on slide, where
    # use_sliding_window is on and sliding_window (4096) is not null
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types must be a list of num_hidden_layers ({num_layers}) entries, got {layer_types!r:.80}"
            )
        other = [kind for kind in layer_types if kind != "full_attention"]
        if other:
            raise ValueError(f"layer_types holds {other[0]!r:.40}: nanoref runs 'full_attention' layers only")
    elif sliding_window(raw) is not None and raw.get("max_window_layers", 28) < num_layers:
        raise ValueError(
            "use_sliding_window is on (layers from max_window_layers on would attend over a window of "
            f"{sliding_window(raw)} tokens): nanoref attends over the whole context"
        )
    if raw.get("dual_chunk_attention_config") is not None:  # (Qwen3-2507's config_1m.json; vLLM runs it)
        raise ValueError(
            "dual_chunk_attention_config: nanoref runs plain RoPE and attention over the whole context, not dual chunk "
            "attention; use the model's config.json without it (its usual context length)"
        )
    for key in ("quantization_config", "compression_config"):  # (vLLM reads the second where the first is absent)
        quantization = raw.get(key)
        if quantization is not None:  # (its weights are float8 or packed integers, read with scales nanoref has not)
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ValueError(
                f"{key}: the checkpoint is quantized ({method!r:.40}); nanoref runs unquantized weights "
                "only (bfloat16, float16 or float32)"
            )
    for key in ("dtype", "torch_dtype"):  # (transformers 5's name and 4's; dtype="auto" reads it, parse_dtype)
        value = raw.get(key)
        if value is not None and not (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
            raise ValueError(f"{key} must name a torch dtype (e.g. 'bfloat16'), got {value!r:.40}")


def sliding_window(raw: dict[str, Any]) -> Any:
    """The window config.json asks for (transformers' rule): sliding_window (4096 where absent) where
    use_sliding_window is on, else None."""
    return raw.get("sliding_window", 4096) if raw.get("use_sliding_window") else None


def _integer(
    raw: dict[str, Any], key: str, default: int | None = None, minimum: int = 1, absent: dict[str, int] | None = None
) -> int:
    """raw[key], checked; absent[key] where the key is not there, and default where it is null (or absent from both)."""
    value = raw.get(key, (absent or {}).get(key))
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_number(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{key} must be a positive finite number, got {value!r}")
    return float(value)


def _boolean(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass(kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    """The fields of an HF Qwen3-MoE `config.json` that a forward needs: the dense Qwen3 ones, plus routing."""

    num_experts: int  # E: experts per sparse layer (config.json: num_experts, or num_local_experts)
    num_experts_per_tok: int  # K: experts each token is routed to (top-k)
    moe_intermediate_size: int  # I of each expert's SwiGLU MLP
    norm_topk_prob: bool = False  # renormalise the K kept probabilities to sum to 1
    decoder_sparse_step: int = 1  # every decoder_sparse_step-th layer is sparse
    mlp_only_layers: list[int] = field(default_factory=list)  # layers that stay dense whatever the step

    # transformers' Qwen3MoeConfig: 4 KV heads where config.json names none, and no head_dim field (its attention
    # takes hidden_size // heads)
    ABSENT = {"num_key_value_heads": 4}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3MoeConfig:
        """Parse and check an HF Qwen3-MoE config.json dict; ValueError names the first bad field."""
        dense = Qwen3Config.from_dict(raw, absent=Qwen3MoeConfig.ABSENT)  # the dense fields, checked the dense way
        # transformers 5 writes num_experts as num_local_experts (an attribute_map alias); the hub's files say
        # num_experts. Either will do, but not two different values.
        if "num_experts" in raw and "num_local_experts" in raw and raw["num_experts"] != raw["num_local_experts"]:
            raise ValueError(
                f"num_experts ({raw['num_experts']!r}) and num_local_experts ({raw['num_local_experts']!r}) disagree"
            )
        key = "num_local_experts" if "num_local_experts" in raw and "num_experts" not in raw else "num_experts"
        missing = [name for name in (key, "num_experts_per_tok", "moe_intermediate_size") if name not in raw]
        if missing:
            raise ValueError(f"config.json lacks required Qwen3-MoE fields: {', '.join(missing)}")
        num_experts = _integer(raw, key, minimum=0)  # (0: every layer dense, as in transformers and vLLM)
        top_k = _integer(raw, "num_experts_per_tok")
        if top_k > num_experts > 0:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be at most {key} ({num_experts}): "
                "a token cannot be routed to more experts than there are"
            )
        layers = dense.num_hidden_layers
        mlp_only = raw.get("mlp_only_layers")
        mlp_only = [] if mlp_only is None else mlp_only  # HF treats null as []
        if not isinstance(mlp_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only
        ):
            raise ValueError(f"mlp_only_layers must be a list of layer indices in [0, {layers}), got {mlp_only!r}")
        if sliding_window(raw) is not None:  # (transformers' Qwen3-MoE: then every layer slides)
            raise ValueError("use_sliding_window must be false: nanoref attends over the whole context")
        return cls(
            **asdict(dense),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=_integer(raw, "moe_intermediate_size"),
            norm_topk_prob=_boolean(raw, "norm_topk_prob", False),
            decoder_sparse_step=_integer(raw, "decoder_sparse_step", default=1),
            mlp_only_layers=list(mlp_only),
        )

    def mlp_sizes_used(self) -> dict[str, int]:
        """The MLP widths some layer has: intermediate_size where a layer is dense, moe_intermediate_size where one
        is sparse (a size no layer has splits nothing under tensor parallelism)."""
        sparse = [self.is_sparse(index) for index in range(self.num_hidden_layers)]
        sizes = {"intermediate_size": self.intermediate_size} if not all(sparse) else {}
        return sizes | ({"moe_intermediate_size": self.moe_intermediate_size} if any(sparse) else {})

    def is_sparse(self, layer_index: int) -> bool:
        """Whether decoder layer `layer_index` has the MoE block (HF's rule), not a dense MLP."""
        return (
            layer_index not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )
