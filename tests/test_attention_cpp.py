"""The cpp backend: nanoref's C++ paged decode kernel against the naive padded oracle, and end to end against HF.

The kernel is built on first use (`torch.utils.cpp_extension.load_inline`); these tests skip where this machine
cannot build it (no C++ compiler or no ninja), and say so.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.ops import attention_cpp, naive_padded_attention
from nanoref.ops.backends import choose_backend

from .helpers import TINY_CONFIGS, cu, hf_greedy, random_paged_cache, random_prompts, shared_prefix_prompts

needs_build = pytest.mark.skipif(
    bool(attention_cpp.missing_build_tools()),
    reason=f"the cpp kernel cannot be built here: missing {attention_cpp.missing_build_tools()}",
)


def decode_against_naive(lens, len_q, heads, kv_heads, head_dim, block_size, dtype, causal, seed):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, block_size, kv_heads, head_dim, dtype, g)
    q = torch.randn(len(lens), len_q, heads, head_dim, generator=g).to(dtype)  # (B, Lq, H, D)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = attention_cpp.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table, causal=causal)
    ref = naive_padded_attention(q.flatten(0, 1), k_flat, v_flat, cu([len_q] * len(lens)), cu(lens), causal=causal)
    return out.flatten(0, 1), ref  # (B * Lq, H, D) each


@needs_build
@pytest.mark.parametrize("head_dim", attention_cpp.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_decode_matches_naive_float32(head_dim, heads, kv_heads):
    # lengths across page edges: 1 token, exactly one page, one past it, several pages
    lens = [1, 16, 17, 40, 75]
    out, ref = decode_against_naive(lens, 1, heads, kv_heads, head_dim, 16, torch.float32, True, head_dim + heads)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_build
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_several_queries_per_sequence(causal, block_size):
    """Lq > 1: the last Lq tokens of each history, causal among themselves (aligned bottom-right) or not."""
    out, ref = decode_against_naive([3, 20, 33, 64], 3, 8, 2, 32, block_size, torch.float32, causal, block_size)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    out, ref = decode_against_naive([5, 31, 90], 1, 8, 2, 64, 16, dtype, True, 11)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_build
def test_query_as_strided_view_of_fused_projection():
    """In the model, q is a view into the fused qkv output: its token axis strides past k and v."""
    g = torch.Generator().manual_seed(5)
    lens, heads, kv_heads, dim = [9, 26], 4, 2, 32
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, 16, kv_heads, dim, torch.float32, g)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, : heads * dim].view(len(lens), 1, heads, dim)  # (B, 1, H, D), not contiguous
    assert not q.is_contiguous()
    out = attention_cpp.paged_decode_attention(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), block_table)
    ref = naive_padded_attention(q.squeeze(1).contiguous(), k_flat, v_flat, cu([1, 1]), cu(lens))
    torch.testing.assert_close(out.squeeze(1), ref, atol=2e-5, rtol=2e-5)


@needs_build
def test_bad_arguments_raise_clear_errors():
    q = torch.randn(2, 1, 4, 32)
    cache = torch.randn(4, 16, 2, 32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        attention_cpp.paged_decode_attention(q, cache, cache, torch.tensor([3, 4]), table)  # int64 lengths
    with pytest.raises(RuntimeError, match="one dtype"):
        attention_cpp.paged_decode_attention(q.double(), cache, cache, torch.tensor([3, 4], dtype=torch.int32), table)


def test_choose_backend_refuses_what_cpp_cannot_serve(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="CPU only"):
        choose_backend("cpp", torch.device("cuda"), torch.bfloat16, None, 128)
    with pytest.raises(ValueError, match="head_dim"):
        choose_backend("cpp", cpu, torch.float32, None, 48)
    monkeypatch.setattr(attention_cpp.shutil, "which", lambda name: None)
    monkeypatch.setattr(attention_cpp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        choose_backend("cpp", cpu, torch.float32, None, 32)


@needs_build
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name == "gqa4-bias" else []) for name in TINY_CONFIGS]
)
def test_greedy_matches_hf(tiny_models, name):
    folder = tiny_models[name]
    prompts = random_prompts(seed=21, lengths=[1, 7, 16, 17, 33, 50])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(folder, device="cpu", attention_backend="cpp", num_kvcache_blocks=256)
    assert llm.config.attention_backend == "cpp"
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert output["token_ids"] == hf_greedy(folder, prompt, params.max_tokens), f"prompt {i} differs from HF"


@needs_build
@pytest.mark.slow  # preemption and prefix hits stay token-exact in the quick loop on the torch backend
def test_greedy_matches_hf_under_preemption_and_prefix_hits(tiny_model):
    prompts = shared_prefix_prompts(seed=22, prefix_len=32, suffix_lens=[5, 12, 20, 3, 9, 27])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(
        tiny_model, device="cpu", attention_backend="cpp", num_kvcache_blocks=12, kvcache_block_size=16, max_num_seqs=8
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.block_manager.num_hit_blocks > 0
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)


@needs_build
def test_loading_the_kernel_leaves_sys_path_alone():
    # a fresh interpreter: this one may have imported setuptools already (whose first import changes sys.path)
    script = (
        "import sys\n"
        "from nanoref.ops import attention_cpp\n"
        "before = list(sys.path)\n"
        "attention_cpp.load()\n"
        "added = [p for p in sys.path if p not in before]\n"
        "assert sys.path == before, f'sys.path gained {added}'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
