"""Random Qwen3 (and Qwen3-MoE) checkpoints for tests, notebooks and benchmarks, built with HF transformers."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

# a model small enough for a test to run it hundreds of times on a CPU
TINY_QWEN3: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "tie_word_embeddings": False,
}

# a tiny Qwen3-MoE: TINY_QWEN3's attention, 4 layers, each a sparse block of 8 experts (top-2) by default
TINY_QWEN3_MOE: dict[str, Any] = {
    **TINY_QWEN3,
    "num_hidden_layers": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# Qwen3-0.6B's architecture (its config.json), for benchmarks with random weights
QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}

# Qwen3-8B's architecture (its config.json), for tensor-parallel benchmarks with random weights
QWEN3_8B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}


def make_random_qwen3(
    folder: str | Path,
    settings: dict[str, Any],
    seed: int = 0,
    initializer_range: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    moe: bool = False,
    save_original_format: bool = True,
) -> Path:
    """Save a randomly initialised HF `Qwen3ForCausalLM` (`Qwen3MoeForCausalLM` with moe=True) with these config
    settings to `folder`. save_original_format=False: transformers' own stacked expert tensors (moe only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    settings = dict(settings)
    theta = settings.pop("rope_theta", 10_000.0)
    config = config_class(
        **settings,
        initializer_range=initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    devices = [torch.cuda.current_device()] if device != "cpu" and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        with torch.device(device):  # a GPU initialises a large model in a fraction of the CPU's time
            model = model_class(config).to(dtype).eval()
    folder = Path(folder)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in test and notebook output
    try:
        model.save_pretrained(folder, save_original_format=save_original_format)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return folder


def make_tiny_qwen3(folder: str | Path, seed: int = 0, initializer_range: float = 0.1, **overrides: Any) -> Path:
    """Save a random tiny `Qwen3ForCausalLM` (HF format, safetensors, float32) to `folder`; return the path.

    overrides replace entries of TINY_QWEN3. initializer_range is larger than HF's 0.02 so that a
    random model's logits are well separated and greedy decoding is not decided by float rounding.
    """
    return make_random_qwen3(folder, {**TINY_QWEN3, **overrides}, seed=seed, initializer_range=initializer_range)


def make_tiny_qwen3_moe(
    folder: str | Path,
    seed: int = 0,
    initializer_range: float = 0.1,
    save_original_format: bool = True,
    **overrides: Any,
) -> Path:
    """Save a random tiny `Qwen3MoeForCausalLM` (HF format, safetensors, float32) to `folder`; return the path.

    overrides replace entries of TINY_QWEN3_MOE (num_experts, num_experts_per_tok, norm_topk_prob,
    decoder_sparse_step, mlp_only_layers, ...). The experts are saved one tensor each, as on the hub;
    save_original_format=False keeps transformers' stacked `experts.gate_up_proj` / `experts.down_proj`.
    """
    return make_random_qwen3(
        folder,
        {**TINY_QWEN3_MOE, **overrides},
        seed=seed,
        initializer_range=initializer_range,
        moe=True,
        save_original_format=save_original_format,
    )


def make_random_lora(
    folder: str | Path,
    base_folder: str | Path,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
    use_rslora: bool = False,
    scale: float = 0.3,
) -> Path:
    """Save a random PEFT LoRA adapter for the model in `base_folder` to `folder` (with `peft`); return the path.

    Both A and B are random (a freshly initialised adapter has B = 0 and changes nothing), B scaled by `scale` so
    that the adapted model's greedy tokens differ from the base model's without being noise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            # (peft asks transformers' deprecated `is_gradient_checkpointing`: a FutureWarning naming site-packages)
            warnings.simplefilter("ignore", FutureWarning)
            base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
            config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = get_peft_model(base, config)
                for name, param in model.named_parameters():
                    if "lora_A" in name:
                        param.data.normal_(0, 1 / param.shape[1] ** 0.5)
                    elif "lora_B" in name:
                        param.data.normal_(0, scale / param.shape[1] ** 0.5)
            model.save_pretrained(folder)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return Path(folder)


# speculative_config settings that verify proposals in every decode step, whatever the batch size and acceptance
# (nanoref/speculative/policy.py turns speculation off where it would not pay): for tests and lessons about the
# mechanism
EVERY_STEP = {"disable_by_batch_size": 0, "min_tokens_per_step": 0}

# notebook -> the optional packages its cells need beyond the dev extra's test tools (Triton publishes Linux wheels
# only; the others are extras of their own): the notebook tests skip such a notebook, naming what is missing
NOTEBOOK_NEEDS = {
    "03_triton_kv_store": ("triton",),
    "04_paged_decode_attention": ("triton",),
    # (its stored outputs hold every run: Triton's, structured output's and LoRA's against peft)
    "10_capstone": ("triton", "xgrammar", "peft"),
    "11_serving": ("fastapi", "uvicorn", "prometheus_client", "openai"),
    "13_structured_output": ("xgrammar", "jsonschema"),
    "14_lora": ("peft",),
}


def missing_packages(notebook: str) -> list[str]:
    """The packages notebook (its stem, "13_structured_output") needs that this environment lacks."""
    import importlib.util

    return [name for name in NOTEBOOK_NEEDS.get(notebook, ()) if importlib.util.find_spec(name) is None]
