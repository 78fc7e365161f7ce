"""Qwen3's q/k norm and RoPE in one pass over the joint (N, H + Hk, D) heads equal the two-by-two reference,
and a learner's rms_norm or apply_rotary still takes over the engine's q/k path through its seam."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.layers.layernorm import rms_norm
from nanoref.layers.rotary import RotaryEmbedding, apply_rotary, norm_rotary, rotary_qk
from nanoref.ops import attention_cpp
from nanoref.ops.backends import use_backend
from nanoref.utils import seams

needs_cpp = pytest.mark.skipif(bool(attention_cpp.missing_build_tools()), reason="the cpp kernels cannot be built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_norm_rotary_equals_q_and_k_apart(dtype):
    g = torch.Generator().manual_seed(0)
    num_tokens, heads, kv_heads, dim = 7, 4, 2, 32
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q_weight, k_weight = (torch.rand(dim, generator=g).to(dtype) + 0.5 for _ in range(2))
    positions = torch.randint(0, 100, (num_tokens,), generator=g)
    rope = RotaryEmbedding(dim, 128, 10_000.0)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    q_ref, k_ref = rotary_qk(
        positions, rms_norm(q, q_weight, 1e-6), rms_norm(k, k_weight, 1e-6), rope.cos_cache, rope.sin_cache
    )
    qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)
    weight = torch.cat([q_weight.expand(heads, dim), k_weight.expand(kv_heads, dim)])
    out = norm_rotary(qk, weight, 1e-6, positions, rope.cos_cache, rope.sin_cache)
    assert torch.equal(out[:, :heads], q_ref) and torch.equal(out[:, heads:], k_ref)  # the same arithmetic


def test_a_learner_apply_rotary_replaces_the_joint_path(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    prompts, params = [[5, 6, 7, 8], list(range(3, 30))], SamplingParams(temperature=0, max_tokens=4)
    reference = llm.generate(prompts, params, use_tqdm=False)
    calls = []

    def my_apply_rotary(x, cos, sin):
        calls.append(tuple(x.shape))
        return apply_rotary(x, cos, sin)

    with seams.use(apply_rotary=my_apply_rotary):
        assert llm.generate(prompts, params, use_tqdm=False) == reference
    layers = llm.config.hf_config.num_hidden_layers
    heads, kv_heads = llm.config.hf_config.num_attention_heads, llm.config.hf_config.num_key_value_heads
    assert len(calls) == 2 * layers * 4  # q and k apart, every layer of every step (one prefill, three decodes)
    assert {shape[1] for shape in calls} == {heads, kv_heads}


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_cpp)])
def test_the_fused_norm_rotary_runs_unless_a_seam_replaced_rms_norm_or_apply_rotary(tiny_model, backend):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16, attention_backend=backend)
    fused_calls = []
    engine_norm_rotary = llm.model_runner.backend.norm_rotary or norm_rotary  # the cpp backend's kernel, or nanoref's

    def counting_norm_rotary(*args):
        fused_calls.append(args[0].shape)
        return engine_norm_rotary(*args)

    use_backend(llm.model_runner.model, dataclasses.replace(llm.model_runner.backend, norm_rotary=counting_norm_rotary))
    prompts, params = [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3)
    reference = llm.generate(prompts, params, use_tqdm=False)
    layers = llm.config.hf_config.num_hidden_layers
    assert len(fused_calls) == layers * 3  # by default: the one-pass path, every layer of every step
    learner_calls = []

    def my_rms_norm(x, weight, eps):
        learner_calls.append(tuple(x.shape))
        return rms_norm(x, weight, eps)

    fused_calls.clear()
    with seams.use(rms_norm=my_rms_norm):
        assert llm.generate(prompts, params, use_tqdm=False) == reference
    assert fused_calls == []  # a learner's rms_norm: the readable path, whose q_norm and k_norm call it
    assert len(learner_calls) >= 2 * layers * 3


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_cpp)])
def test_the_readable_and_the_fused_norm_rotary_of_a_layer_give_the_same_numbers(tiny_model, backend):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16, attention_backend=backend)
    attn = llm.model_runner.model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    num_tokens = 9
    qkv = torch.randn(num_tokens, attn.q_size + 2 * attn.kv_size, generator=g)  # (N, (H + 2 Hk) * D)
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    with torch.no_grad():
        fused = attn.norm_rotary(positions, qkv)
        with seams.use(apply_rotary=lambda x, cos, sin: apply_rotary(x, cos, sin)):  # not nanoref's own object
            readable = attn.norm_rotary(positions, qkv)
    assert [tuple(t.shape) for t in fused] == [
        (num_tokens, attn.num_heads, attn.head_dim),
        (num_tokens, attn.num_kv_heads, attn.head_dim),
    ]
    for a, b in zip(
        fused, readable
    ):  # torch: the same arithmetic; cpp's kernel sums each row's squares in its own order
        torch.testing.assert_close(a, b, atol=0 if backend == "torch" else 1e-6, rtol=0 if backend == "torch" else 1e-6)
