"""config.json fields read as transformers reads them: greedy output token-exact with HF on the same folder."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.config import EngineConfig, parse_dtype
from nanoref.testing import TINY_QWEN3, make_random_qwen3, make_tiny_qwen3, make_tiny_qwen3_moe

from .helpers import assert_matches_hf, copy_with_config, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def assert_greedy_matches_hf(folder):
    prompts = random_prompts(seed=3, lengths=[8, 21])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=16, max_model_len=128)
    assert_matches_hf(folder, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), GREEDY.max_tokens)


def no_theta(config):
    del config["rope_parameters"]  # (make_tiny_qwen3 writes rope_theta 10,000 there)


# transformers 5: rope_scaling over rope_parameters; its rope_theta, else the top level's, else 10,000
ROPE_EDITS = {
    "no-theta-anywhere": no_theta,
    "top-level-theta": lambda c: no_theta(c) or c.update(rope_theta=3000.0),
    "rope-parameters-over-top-level": lambda c: c.update(rope_theta=3000.0),
    "rope-scaling-over-rope-parameters": lambda c: c.update(
        rope_scaling={"rope_type": "default", "rope_theta": 3000.0}
    ),
    "rope-scaling-without-theta": lambda c: c.update(rope_scaling={"rope_type": "default"}, rope_theta=3000.0),
}


@pytest.mark.parametrize("edit", ROPE_EDITS.values(), ids=ROPE_EDITS.keys())
def test_rope_theta_is_read_as_transformers_reads_it(tmp_path, tiny_model, edit):
    assert_greedy_matches_hf(copy_with_config(tmp_path, tiny_model, edit))


def test_moe_rope_theta_default_is_transformers(tmp_path):
    folder = make_tiny_qwen3_moe(tmp_path / "moe", num_hidden_layers=2)
    assert_greedy_matches_hf(copy_with_config(tmp_path, folder, no_theta))


def test_dense_head_dim_default_is_transformers_128(tmp_path):
    """transformers' Qwen3Config takes head_dim 128 where config.json has none (not hidden_size // heads = 16)."""
    folder = make_tiny_qwen3(tmp_path / "dense", head_dim=128)
    assert_greedy_matches_hf(copy_with_config(tmp_path, folder, lambda c: c.pop("head_dim")))


def test_moe_head_dim_default_is_hidden_size_over_heads(tmp_path):
    """transformers' Qwen3MoeConfig has no head_dim field: its attention takes hidden_size // heads."""
    folder = make_tiny_qwen3_moe(tmp_path / "moe", num_hidden_layers=2)  # (head_dim 16 = 64 // 4)
    assert_greedy_matches_hf(copy_with_config(tmp_path, folder, lambda c: c.pop("head_dim")))


def test_dense_kv_heads_default_is_transformers_32(tmp_path):
    """transformers' Qwen3Config takes 32 KV heads where config.json names none (not as many as the heads)."""
    folder = make_tiny_qwen3(tmp_path / "dense", num_attention_heads=64, num_key_value_heads=32)
    assert_greedy_matches_hf(copy_with_config(tmp_path, folder, lambda c: c.pop("num_key_value_heads")))


def test_moe_kv_heads_default_is_transformers_4(tmp_path):
    folder = make_tiny_qwen3_moe(tmp_path / "moe", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    assert_greedy_matches_hf(copy_with_config(tmp_path, folder, lambda c: c.pop("num_key_value_heads")))


def test_kv_heads_transformers_default_that_does_not_divide_the_heads_says_so(tmp_path, tiny_model):
    folder = copy_with_config(tmp_path, tiny_model, lambda c: c.pop("num_key_value_heads"))  # (4 heads)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(32: transformers' default where config.json has none"):
        LLM(folder, device="cpu")


def no_dtype(config):
    config.pop("dtype", None)
    config.pop("torch_dtype", None)


# config.json's dtype -> what dtype="auto" runs on CUDA (vLLM's "auto": float16 and bfloat16 kept, the rest bfloat16)
CHECKPOINT_DTYPES = {
    "float16": (lambda c: c.update(dtype="float16"), torch.float16),
    "half": (lambda c: c.update(dtype="half"), torch.float16),  # (torch.half: ran bfloat16)
    "bfloat16": (lambda c: c.update(dtype="bfloat16"), torch.bfloat16),
    "float32": (lambda c: c.update(dtype="float32"), torch.bfloat16),
    "none-named": (no_dtype, torch.bfloat16),
    "transformers4-torch_dtype": (lambda c: no_dtype(c) or c.update(torch_dtype="float16"), torch.float16),
    "dtype-over-torch_dtype": (lambda c: c.update(dtype="bfloat16", torch_dtype="float16"), torch.bfloat16),
}


@pytest.mark.parametrize("edit, on_cuda", CHECKPOINT_DTYPES.values(), ids=CHECKPOINT_DTYPES.keys())
def test_auto_dtype_keeps_the_checkpoints_half_type_on_cuda(tmp_path, tiny_model, edit, on_cuda, monkeypatch):
    """dtype="auto" reads config.json's dtype: on CUDA (the resolution itself: no GPU here) as vLLM's "auto"; on a
    CPU float32 whatever the checkpoint's (token-exact with HF in float32)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # (an H100)
    config = EngineConfig(copy_with_config(tmp_path, tiny_model, edit), device="cpu")
    assert config.dtype == torch.float32
    for dtype in ("auto", None):
        assert parse_dtype(dtype, torch.device("cuda"), config.hf_config.dtype) == on_cuda
    assert parse_dtype("float32", torch.device("cuda"), config.hf_config.dtype) == torch.float32  # (asked: as asked)


@pytest.mark.parametrize("edit", [edit for edit, _ in CHECKPOINT_DTYPES.values()], ids=CHECKPOINT_DTYPES.keys())
def test_auto_dtype_is_float16_on_a_gpu_without_bfloat16(tmp_path, tiny_model, edit, monkeypatch):
    """vLLM's "auto" on a T4 or V100 (compute capability below 8.0) is float16 whatever the checkpoint's: nanoref ran
    a bfloat16 (or float32) checkpoint in bfloat16 there, which such a GPU only emulates."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    config = EngineConfig(copy_with_config(tmp_path, tiny_model, edit), device="cpu")
    for dtype in ("auto", None, "float16", "half", torch.float16):
        assert parse_dtype(dtype, torch.device("cuda"), config.hf_config.dtype) == torch.float16
    assert parse_dtype("float32", torch.device("cuda"), config.hf_config.dtype) == torch.float32
    for dtype in ("bfloat16", torch.bfloat16):  # asked for: vLLM's ValueError, in its words
        with pytest.raises(ValueError) as error:
            parse_dtype(dtype, torch.device("cuda"), config.hf_config.dtype)
        assert str(error.value) == (
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your Tesla T4 GPU has "
            "compute capability 7.5. You can use float16 instead by explicitly setting the `dtype` flag in CLI, for "
            "example: --dtype=half."
        )
    assert parse_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # (a CPU: as asked)


def test_float16_checkpoint_runs_in_float16_on_cuda_and_float32_on_a_cpu(tmp_path):
    folder = make_random_qwen3(tmp_path / "fp16", TINY_QWEN3, seed=1, initializer_range=0.1, dtype=torch.float16)
    config = EngineConfig(folder, device="cpu")
    assert (config.hf_config.dtype, config.dtype) == ("float16", torch.float32)
    assert parse_dtype("auto", torch.device("cuda"), config.hf_config.dtype) == torch.float16
    assert_greedy_matches_hf(folder)
