"""Tiny random Qwen3 checkpoints for tests and notebooks, built with HF transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_QWEN3: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def make_tiny_qwen3(folder: str | Path, seed: int = 0, initializer_range: float = 0.1, **overrides: Any) -> Path:
    """Save a random `Qwen3ForCausalLM` (HF format, safetensors, float32) to `folder`; return the path.

    initializer_range is larger than HF's 0.02 so that a random model's logits are well separated and
    greedy decoding is not decided by float rounding.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    settings = {**TINY_QWEN3, **overrides}
    theta = settings.pop("rope_theta", 10_000.0)
    config = Qwen3Config(
        **settings,
        initializer_range=initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    folder = Path(folder)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in test and notebook output
    try:
        model.save_pretrained(folder)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return folder
