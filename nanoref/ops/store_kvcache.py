"""Writing each new token's K/V into its slot of the paged cache (torch reference).

A cache layer is `(num_blocks, block_size, Hk, D)` (Hk = num_kv_heads, D = head_dim). Viewed as rows of
`Hk * D` values, slot `s = block_id * block_size + offset` is row `s`, so a token's K/V is one row copy.
Slot -1 marks a token whose K/V must not be stored (padding in the static buffers that CUDA graphs replay).
"""

from __future__ import annotations

import torch

from nanoref.utils.tracing import trace


def check_kvcache_layout(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The layouts a row copy relies on; a clear message beats a silently scrambled cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value: the last axis (head_dim) must be contiguous")
    if key.stride(1) != head_dim or value.stride(1) != head_dim:
        raise ValueError("key/value: heads must be packed (stride of the head axis == head_dim)")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim)")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache rows hold {tuple(k_cache.shape[2:])} but key rows are {(num_kv_heads, head_dim)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one row of num_kv_heads * head_dim values per slot)")
    if slot_mapping.dim() != 1 or slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping must hold one slot per token: {slot_mapping.numel()} for {num_tokens} tokens")


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's element type. An 8-bit float cache (kv_cache_dtype="fp8") saturates at the format's largest
    value, as vLLM's fp8 kernels do: a plain cast of a larger value would give inf (e5m2) instead. Values already in
    that type are returned as they are."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize == 1 and dtype.is_floating_point:
        largest = torch.finfo(dtype).max
        x = x.clamp(-largest, largest)
    return x.to(dtype)


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """8-bit float rows as uint8 (the same bytes): row copies of float8 tensors are not implemented on every device."""
    return rows.view(torch.uint8) if rows.dtype.itemsize == 1 else rows


def store_kvcache_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: (N, Hk, D); caches: (num_blocks, block_size, Hk, D); slot_mapping: (N,), -1 = skip."""
    check_kvcache_layout(key, value, k_cache, v_cache, slot_mapping)
    row = key.shape[1] * key.shape[2]
    k_rows = _as_bytes(k_cache.view(-1, row))  # (num_blocks * block_size, Hk * D): slot s is row s
    v_rows = _as_bytes(v_cache.view(-1, row))
    key_rows = _as_bytes(to_cache_dtype(key.reshape(-1, row), k_cache.dtype))  # (N, Hk * D)
    value_rows = _as_bytes(to_cache_dtype(value.reshape(-1, row), v_cache.dtype))  # (N, Hk * D)
    keep = slot_mapping >= 0  # (N,)
    if key.is_cuda and torch.cuda.is_current_stream_capturing():
        # A boolean mask needs the host to learn how many tokens survive, which a CUDA graph cannot
        # record. Instead every skipped token repeats the write of the first stored token: the same
        # value to the same slot twice changes nothing. (Graph batches always start with a real token.)
        first = keep.int().argmax()  # (): a token that is stored
        source = torch.where(keep, torch.arange(keep.numel(), device=keep.device), first)  # (N,)
        k_rows[slot_mapping[source]] = key_rows[source]
        v_rows[slot_mapping[source]] = value_rows[source]
    else:
        # one nonzero shared by K and V, then row copies: index_copy_ is about twice as fast on a CPU as boolean
        # masks (each its own nonzero) feeding an advanced-index assignment
        kept = keep.nonzero().squeeze(1)  # (n,): the tokens that are stored
        slots = slot_mapping.index_select(0, kept)  # (n,)
        k_rows.index_copy_(0, slots, key_rows.index_select(0, kept))  # (n, Hk * D) -> rows `slots`
        v_rows.index_copy_(0, slots, value_rows.index_select(0, kept))
    trace("store_kvcache", key=key, slot_mapping=slot_mapping, k_cache=k_cache)
