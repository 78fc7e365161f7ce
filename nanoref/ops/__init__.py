"""Kernels and their references: KV store, varlen prefill, paged decode, and the naive oracle.

The backends that pick among them (torch, Triton, flash-attn) live in `nanoref.ops.backends`, which
imports these modules; this package's `__init__` does not import it back.
"""

from nanoref.ops.attention_torch import gather_paged, paged_decode_attention, varlen_attention
from nanoref.ops.naive import naive_padded_attention, pad_flat
from nanoref.ops.store_kvcache import store_kvcache_torch

__all__ = [
    "gather_paged",
    "naive_padded_attention",
    "pad_flat",
    "paged_decode_attention",
    "store_kvcache_torch",
    "varlen_attention",
]
