"""The torch backend's fast paths against the naive padded oracle, on fresh random inputs.

Decode runs one SDPA call with a KV head's query group in the query axis, Lq > 1 runs SDPA with `enable_gqa`,
varlen prefill without history uses SDPA's own causal mask, and the KV store copies rows with index_copy_.
"""

from __future__ import annotations

import pytest
import torch

from nanoref.ops import naive_padded_attention, paged_decode_attention, store_kvcache_torch, varlen_attention

from .helpers import cu, random_paged_cache


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (6, 2), (8, 4)])
def test_decode_group_order_matches_naive(heads, kv_heads):
    """Query head h must read KV head h // group: a group laid out in the wrong order would still run."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lens = [3, 16, 29, 50]
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, 16, kv_heads, 16, torch.float32, g)
    q = torch.randn(len(lens), 1, heads, 16, generator=g)  # (B, 1, H, D)
    out = paged_decode_attention(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), block_table)
    ref = naive_padded_attention(q.squeeze(1), k_flat, v_flat, cu([1] * len(lens)), cu(lens))
    torch.testing.assert_close(out.squeeze(1), ref, atol=2e-5, rtol=2e-5)


def test_decode_several_queries_not_causal_sees_whole_history():
    g = torch.Generator().manual_seed(7)
    lens, len_q = [4, 21, 35], 3
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, 16, 2, 16, torch.float32, g)
    q = torch.randn(len(lens), len_q, 4, 16, generator=g)  # (B, Lq, H, D)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, seqlens, block_table, causal=False)
    ref = naive_padded_attention(q.flatten(0, 1), k_flat, v_flat, cu([len_q] * len(lens)), cu(lens), causal=False)
    torch.testing.assert_close(out.flatten(0, 1), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 3)])
def test_varlen_without_history_matches_naive(heads, kv_heads):
    g = torch.Generator().manual_seed(heads + kv_heads)
    lens = [1, 7, 20]
    q = torch.randn(sum(lens), heads, 16, generator=g)
    k = torch.randn(sum(lens), kv_heads, 16, generator=g)
    v = torch.randn(sum(lens), kv_heads, 16, generator=g)
    out = varlen_attention(q, k, v, cu(lens), cu(lens), max(lens), max(lens), causal=True)
    torch.testing.assert_close(out, naive_padded_attention(q, k, v, cu(lens), cu(lens)), atol=2e-5, rtol=2e-5)


def test_store_kvcache_with_every_slot_skipped_writes_nothing():
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(4, 8, 2, 16, generator=g), torch.randn(4, 8, 2, 16, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    store_kvcache_torch(key, value, k_cache, v_cache, torch.tensor([-1, -1, -1]))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
