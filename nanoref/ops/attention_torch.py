"""Torch reference attention with flash-attn's argument names: the torch backend (the reference, and the CPU's
fallback where nanoref's C++ kernels cannot be built).

Two entry points mirror flash-attn:
- `varlen_attention` ~ `flash_attn_varlen_func`: flat queries of many sequences, causal within each.
  With `block_table`, `k`/`v` are the paged caches and each sequence's keys are read through its block
  table (prefix-cache hits and chunked prefill: the keys include history the queries do not).
- `paged_decode_attention` ~ `flash_attn_with_kvcache`: one query token per sequence, `(B, 1, H, D)`,
  against `cache_seqlens[b]` tokens of history found through `block_table[b]`.

Both loop over sequences and call PyTorch's scaled_dot_product_attention per sequence: slow but plain,
and free of padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache layer.

    cache: (num_blocks, block_size, Hk, D); block_table_row: (max_blocks,) physical block ids.
    Returns (length, Hk, D), contiguous in logical order wherever the blocks lie.
    """
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table_row[:num_blocks].long()]  # (num_blocks, block_size, Hk, D)
    return blocks.flatten(0, 1)[:length]  # (length, Hk, D), in the cache's dtype


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence. q: (Lq, H, D); k, v: (Lk, Hk, D); queries are the last Lq of the Lk positions."""
    len_q, len_k = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, Lq, D), (Hk, Lk, D), (Hk, Lk, D)
    mask = None
    is_causal = causal and len_q > 1 and len_q == len_k  # no history: SDPA's own (top-left) causal mask fits
    if causal and len_q > 1 and len_q != len_k:
        # bottom-right aligned: query i sits at position len_k - len_q + i
        q_pos = torch.arange(len_k - len_q, len_k, device=q.device)[:, None]  # (Lq, 1)
        mask = torch.arange(len_k, device=q.device)[None, :] <= q_pos  # (Lq, Lk)
    # enable_gqa: query head h reads KV head h // group, without copying each K/V head `group` times
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
    )  # (H, Lq, D)
    return out.transpose(0, 1)  # (Lq, H, D)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (Nq, H, D). Without block_table k, v: (Nk, Hk, D) flat; with it, paged caches. -> (Nq, H, D)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q_lo, q_hi = starts_q[b], starts_q[b + 1]
        len_k = starts_k[b + 1] - starts_k[b]
        if block_table is None:
            kb = k[starts_k[b] : starts_k[b + 1]]  # (Lk, Hk, D)
            vb = v[starts_k[b] : starts_k[b + 1]]
        else:
            kb = gather_paged(k, block_table[b], len_k)  # (Lk, Hk, D)
            vb = gather_paged(v, block_table[b], len_k)
        if kb.dtype != q.dtype:  # K/V as an 8-bit cache holds them (kv_cache_dtype="fp8") are read in q's dtype
            kb, vb = kb.to(q.dtype), vb.to(q.dtype)
        out[q_lo:q_hi] = _attend(q[q_lo:q_hi], kb, vb, scale, causal)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """q: (B, Lq, H, D); caches: (num_blocks, block_size, Hk, D); cache_seqlens: (B,). -> (B, Lq, H, D).

    Decode passes Lq = 1: the newest token against its whole history. As in flash-attn, Lq > 1 means
    the last Lq tokens of each history, causal among themselves (mask aligned bottom-right).
    Gathers every sequence's blocks into one padded (B, Lmax, Hk, D) tensor and masks positions past
    each sequence's length. No Python loop and no host sync, so a CUDA graph can capture it.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    batch, max_blocks = block_table.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    len_q, num_heads = q.shape[1], q.shape[2]
    # -1 padding reads block 0, masked below. index_select copies whole blocks (one contiguous row each); advanced
    # indexing k_cache[blocks] computes the same gather several times slower on a CPU.
    flat_blocks = block_table.long().clamp(min=0).flatten()  # (B * max_blocks,)
    k = k_cache.index_select(0, flat_blocks).view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache.index_select(0, flat_blocks).view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    if k.dtype != q.dtype:  # an 8-bit cache (kv_cache_dtype="fp8") is read in q's dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hk, Lmax, D): strided views, SDPA reads them in place
    key_pos = torch.arange(max_blocks * block_size, device=q.device)  # (Lmax,)
    lens = cache_seqlens.long()[:, None, None, None]  # (B, 1, 1, 1)
    if len_q == 1:
        # One query per sequence: a KV head's `group` query heads can stand in SDPA's query-length axis, so each
        # K/V head is read once, not copied `group` times (repeat_interleave was ~a quarter of a CPU decode step),
        # and one fused SDPA call replaces a dozen small ops per layer (scores, scale, mask, softmax, weighted sum).
        q_grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, Hk, group, D)
        visible = key_pos < lens  # (B, 1, 1, Lmax): inside the history, the same for every query row
        out = F.scaled_dot_product_attention(q_grouped, k, v, attn_mask=visible, scale=scale)  # (B, Hk, group, D)
        return out.reshape(batch, 1, num_heads, head_dim)  # (B, 1, H, D): head h = kv_head * group + g, in order
    # Lq > 1: the last Lq tokens of each history; query i sits at position len - Lq + i
    query_pos = lens - len_q + torch.arange(len_q, device=q.device)[:, None]  # (B, 1, Lq, 1)
    visible = key_pos <= query_pos if causal else key_pos < lens  # (B, 1, Lq, Lmax); causal implies < len
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=visible, scale=scale, enable_gqa=True
    )  # (B, H, Lq, D): query head h reads KV head h // group
    return out.transpose(1, 2)  # (B, Lq, H, D)
