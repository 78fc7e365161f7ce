"""The Triton kernels' tile paths against the naive padded oracle (interpreter on CPU), on fresh random inputs.

Small tiles on purpose, so that tiny problems still cross every path: prefill's GQA group stacked into the tile
rows (ratios 1, 2, 3 and 4), its unmasked key tiles below the causal diagonal and the masked diagonal, with
lengths and histories that are not multiples of the tile; decode's split-KV at the split counts that
`choose_num_splits` gives a small batch on a full-size GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")
pytestmark = pytest.mark.slow  # the Triton interpreter runs every program in Python on a CPU

from nanoref.ops import naive_padded_attention  # noqa: E402
from nanoref.ops.attention_triton import (  # noqa: E402
    Launch,
    choose_num_splits,
    paged_decode_attention,
    varlen_attention,
)

from .helpers import TOL, cu, random_paged_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Launch(block_m=32, block_n=16)  # 32 rows: 32, 16, 10 (of 32) or 8 tokens for groups 1, 2, 3, 4


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (6, 2), (8, 2)])  # GQA 1, 2, 3 and 4
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_group_stacking_and_diagonal_split(dtype, heads, kv_heads, causal):
    g = torch.Generator().manual_seed(heads * 10 + causal)
    lens = [1, 13, 16, 17, 45]  # shorter than a tile, exact multiples of it, and ragged
    n, d = sum(lens), 16
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
    q, k, v, cu_lens = on_device(q, k, v, cu(lens))
    out = varlen_attention(q, k, v, cu_lens, cu_lens, max(lens), max(lens), causal=causal, launch=SMALL)
    oracle = naive_padded_attention(q, k, v, cu_lens, cu_lens, causal=causal)
    assert out.shape == (n, heads, d) and out.dtype == dtype
    torch.testing.assert_close(out.float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_varlen_history_through_block_tables_with_small_tiles(dtype, block_size, heads, kv_heads):
    """Queries at the end of longer cached sequences: the diagonal falls anywhere inside a key tile."""
    g = torch.Generator().manual_seed(block_size + heads)
    k_lens, q_lens = [37, 70, 16, 45], [5, 70, 1, 20]
    d = 16
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(k_lens, block_size, kv_heads, d, dtype, g)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    q, k_cache, v_cache, block_table, k_flat, v_flat, cu_q, cu_k = on_device(
        q, k_cache, v_cache, block_table, k_flat, v_flat, cu(q_lens), cu(k_lens)
    )
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    out = varlen_attention(q, k_cache, v_cache, *args, causal=True, block_table=block_table, launch=SMALL)
    oracle = naive_padded_attention(q, k_flat, v_flat, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out.float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_varlen_group_wider_than_the_tile():
    """block_m smaller than the group: one token per tile, its group's heads padded up to 16 rows."""
    g = torch.Generator().manual_seed(3)
    lens = [3, 9]
    q = torch.randn(sum(lens), 8, 16, generator=g)
    k, v = (torch.randn(sum(lens), 1, 16, generator=g) for _ in "kv")
    q, k, v, cu_lens = on_device(q, k, v, cu(lens))
    out = varlen_attention(q, k, v, cu_lens, cu_lens, max(lens), max(lens), launch=Launch(block_m=4, block_n=16))
    oracle = naive_padded_attention(q, k, v, cu_lens, cu_lens)
    torch.testing.assert_close(out, oracle, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_head_dim_not_a_power_of_two(causal):
    """head_dim 24 in tiles of 32 columns, with GQA 3 (30 of 32 rows used): every mask at once."""
    g = torch.Generator().manual_seed(24)
    lens = [7, 40]
    q = torch.randn(sum(lens), 6, 24, generator=g).to(torch.float16)
    k, v = (torch.randn(sum(lens), 2, 24, generator=g).to(torch.float16) for _ in "kv")
    q, k, v, cu_lens = on_device(q, k, v, cu(lens))
    out = varlen_attention(q, k, v, cu_lens, cu_lens, max(lens), max(lens), causal=causal, launch=SMALL)
    oracle = naive_padded_attention(q, k, v, cu_lens, cu_lens, causal=causal)
    torch.testing.assert_close(out.float(), oracle.float(), atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_varlen_rejects_a_scale_that_is_not_positive():
    q = torch.randn(4, 2, 16)
    lens = cu([4])
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        varlen_attention(q, q, q, lens, lens, 4, 4, softmax_scale=-0.25)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("min_split_len", [64, 128])
def test_small_batch_decode_splits_match_oracle(batch, heads, kv_heads, min_split_len):
    """A small batch on a 132-SM GPU: as many splits as the context allows, the last one ragged."""
    g = torch.Generator().manual_seed(batch * 100 + heads)
    lens = [300, 177][:batch]
    width = 300 // 16 + 1  # the block table's width, from which the split count is chosen
    splits = choose_num_splits(batch, kv_heads, width * 16, num_sms=132, block_n=64, min_split_len=min_split_len)
    assert splits == width * 16 // min_split_len  # small batch: the context length is what limits the count
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, 16, kv_heads, 32, torch.bfloat16, g)
    if block_table.shape[1] < width:
        block_table = torch.cat([block_table, block_table.new_full((batch, width - block_table.shape[1]), -1)], 1)
    q = torch.randn(batch, 1, heads, 32, generator=g).to(torch.bfloat16)  # (B, 1, H, D)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q, k_cache, v_cache, block_table, seqlens, k_flat, v_flat = on_device(
        q, k_cache, v_cache, block_table, seqlens, k_flat, v_flat
    )
    out = paged_decode_attention(q, k_cache, v_cache, seqlens, block_table, num_splits=splits)
    oracle = naive_padded_attention(q.squeeze(1), k_flat, v_flat, cu([1] * batch).to(DEVICE), cu(lens).to(DEVICE))
    torch.testing.assert_close(out.squeeze(1).float(), oracle.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (16, 8), (16, 4)])
def test_varlen_default_tiles_on_the_gpu(heads, kv_heads):
    """The compiled kernel with the launch settings a GPU uses (PREFILL_LAUNCH), at head_dim 128 in bf16: ragged
    lengths around the tile sizes, flat and with history read through block tables."""
    g = torch.Generator().manual_seed(heads + kv_heads)
    k_lens, q_lens = [1, 63, 64, 65, 300, 1000], [1, 63, 20, 65, 129, 1000]
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(k_lens, 16, kv_heads, 128, torch.bfloat16, g)
    q = torch.randn(sum(q_lens), heads, 128, generator=g).to(torch.bfloat16)
    q, k_cache, v_cache, block_table, k_flat, v_flat, cu_q, cu_k = (
        t.cuda() for t in (q, k_cache, v_cache, block_table, k_flat, v_flat, cu(q_lens), cu(k_lens))
    )
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    paged = varlen_attention(q, k_cache, v_cache, *args, causal=True, block_table=block_table)
    torch.testing.assert_close(paged, naive_padded_attention(q, k_flat, v_flat, cu_q, cu_k), atol=2e-2, rtol=2e-2)
    q_flat = torch.randn(sum(k_lens), heads, 128, generator=g).to(torch.bfloat16).cuda()  # no history: Lq == Lk
    flat = varlen_attention(q_flat, k_flat, v_flat, cu_k, cu_k, max(k_lens), max(k_lens), causal=True)
    torch.testing.assert_close(flat, naive_padded_attention(q_flat, k_flat, v_flat, cu_k, cu_k), atol=2e-2, rtol=2e-2)
