"""Kernels and their references: KV store, varlen prefill, paged decode, and the naive oracle."""

from nanoref.ops.attention_torch import gather_paged, paged_decode_attention, varlen_attention
from nanoref.ops.backends import BACKEND_NAMES, AttentionBackend, resolve_backend
from nanoref.ops.naive import naive_padded_attention, pad_flat
from nanoref.ops.store_kvcache import store_kvcache, store_kvcache_torch

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "gather_paged",
    "naive_padded_attention",
    "pad_flat",
    "paged_decode_attention",
    "resolve_backend",
    "store_kvcache",
    "store_kvcache_torch",
    "varlen_attention",
]
