"""Attention kernels (torch reference backend) against the naive padded oracle, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from nanoref.ops import (
    naive_padded_attention,
    paged_decode_attention,
    store_kvcache_torch,
    varlen_attention,
)
from nanoref.ops.triton_setup import triton_available

from .helpers import TOL, cu, random_paged_decode, random_paged_varlen, random_qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_varlen_attention_matches_naive(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lens = [1, 5, 17, 33]
    n, d = sum(lens), 32
    q, k, v = random_qkv(lens, heads, kv_heads, d, dtype, g)
    out = varlen_attention(q, k, v, cu(lens), cu(lens), max(lens), max(lens), causal=True)
    ref = naive_padded_attention(q, k, v, cu(lens), cu(lens), causal=True)
    assert out.shape == (n, heads, d) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_with_cached_history(block_size, dtype):
    """Queries are the last tokens of longer sequences whose keys are read through block tables."""
    g = torch.Generator().manual_seed(block_size)
    k_lens, q_lens = [20, 47, 16, 70], [3, 47, 1, 30]
    x = random_paged_varlen(q_lens, k_lens, block_size, 4, 2, 16, dtype, g)  # 4 query heads, 2 KV heads, D 16
    out = varlen_attention(
        x.q, x.k_cache, x.v_cache, x.cu_q, x.cu_k, max(q_lens), max(k_lens), causal=True, block_table=x.block_table
    )
    ref = x.oracle(causal=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_paged_decode_matches_naive(block_size, dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(block_size + heads)
    lens = [1, 15, 16, 17, 40, 77]  # not multiples of the block size, and exact multiples
    x = random_paged_decode(lens, block_size, heads, kv_heads, 32, dtype, g)  # q: (B, 1, H, D)
    out = paged_decode_attention(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, causal=True)
    ref = x.oracle(causal=True)  # (B, H, D)
    assert out.shape == x.q.shape
    torch.testing.assert_close(out.squeeze(1).float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_naive_oracle_against_dense_softmax():
    """The oracle itself, against a hand-written single-sequence softmax(QK^T)V with a causal mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    scores = torch.einsum("qhd,khd->hqk", q, k) / 8**0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(naive_padded_attention(q, k, v, cu([6]), cu([6])), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_writes_slots_and_skips_minus_one(dtype):
    g = torch.Generator().manual_seed(7)
    num_blocks, block_size, kv_heads, d = 6, 16, 2, 8
    key = torch.randn(5, kv_heads, d, generator=g).to(dtype)
    value = torch.randn(5, kv_heads, d, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, -1, 16 * 4 + 15, 16 + 0, -1])
    store_kvcache_torch(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.view(-1, kv_heads, d).clone(), before_v.view(-1, kv_heads, d).clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot], expected_v[slot] = key[token], value[token]
    assert torch.equal(k_cache.view(-1, kv_heads, d), expected_k)
    assert torch.equal(v_cache.view(-1, kv_heads, d), expected_v)


def triton_store(*args):
    if not triton_available():
        pytest.skip("Triton is not installed (Linux wheels only)")
    from nanoref.ops.store_kvcache_triton import store_kvcache_triton

    return store_kvcache_triton(*args)


@pytest.mark.parametrize("store", [store_kvcache_torch, triton_store], ids=["torch", "triton"])
def test_store_kvcache_rejects_bad_layouts(store):
    """Both stores share the layout checks: a layout a row copy cannot serve is an error, not a scrambled cache."""
    key = torch.randn(4, 2, 8)
    cache = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match="one slot per token"):
        store(key, key, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="packed"):
        wide = torch.randn(4, 2, 16)[:, :, :8]  # head axis stride 16 != head_dim 8
        store(wide, wide, cache, cache.clone(), torch.arange(4))
    with pytest.raises(ValueError, match="cache rows"):
        store(key, key, torch.zeros(2, 16, 4, 8), torch.zeros(2, 16, 4, 8), torch.arange(4))
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(2, 32, 2, 8)[:, ::2]  # every other slot
        store(key, key, strided, strided.clone(), torch.arange(4))


@pytest.mark.parametrize("len_q", [2, 5])
def test_paged_decode_with_several_queries_is_causal(len_q):
    """As flash_attn_with_kvcache: Lq new tokens at the end of each history, causal among themselves."""
    g = torch.Generator().manual_seed(len_q)
    lens = [len_q, 20, 33]
    x = random_paged_decode(lens, 16, 4, 2, 16, torch.float32, g, len_q=len_q)  # q: (B, Lq, H, D)
    out = paged_decode_attention(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    ref = x.oracle()
    torch.testing.assert_close(out.flatten(0, 1), ref, atol=2e-5, rtol=2e-5)
