"""The attention module: store this step's K/V in the paged cache, then attend through the backend.

Prefill: flat varlen causal attention over the step's tokens. When some of a sequence's keys are
already in the cache (a prefix-cache hit, or an earlier chunk of a chunked prefill), the engine sets
`block_tables` and the keys and values are read back from the paged cache instead of from this
step's fresh K/V, with `cu_seqlens_k` running ahead of `cu_seqlens_q`.
Decode: one query per sequence; it gets a length-1 sequence axis, (B, 1, H, D), because decode
kernels (flash-attn's `flash_attn_with_kvcache`) take a batch of short query blocks against a cache. A speculative
verify step uses that: k + 1 queries per sequence, (B, k + 1, H, D), causal among themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoref.ops.backends import AttentionBackend, resolve_backend
from nanoref.ops.store_kvcache import to_cache_dtype
from nanoref.utils.context import get_context
from nanoref.utils.seams import seam
from nanoref.utils.tracing import trace


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # views into the engine's one big cache tensor; empty until the model runner allocates it
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        self.backend: AttentionBackend = resolve_backend("torch", torch.device("cpu"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (N, H, D); k, v: (N, Hk, D) -> (N, H, D)."""
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel() and context.slot_mapping is not None:
            self.backend.store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        if context.is_prefill:
            if context.block_tables is not None:  # history in the cache: read every key from there
                k, v = k_cache, v_cache
            elif k_cache.numel() and k_cache.dtype != k.dtype:
                # a cache of narrower floats (kv_cache_dtype="fp8"): attend to K/V as the cache holds them, as a
                # later chunk or a prefix-cache hit of this prompt will (the same tokens whichever path they take)
                k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)
            trace("attn.varlen", q=q, k=k, v=v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k)
            out = self.backend.varlen(
                q,
                k,
                v,
                cu_seqlens_q=context.cu_seqlens_q,
                cu_seqlens_k=context.cu_seqlens_k,
                max_seqlen_q=context.max_seqlen_q,
                max_seqlen_k=context.max_seqlen_k,
                softmax_scale=self.scale,
                causal=True,
                block_table=context.block_tables,
            )  # (N, H, D)
        else:
            # (N, H, D) -> (B, Lq, H, D): a query block per sequence, of one token (Lq = 1: q.unsqueeze(1)) or of
            # a speculative verify step's k + 1 (Lq = k + 1, causal among themselves)
            num_tokens, num_heads, head_dim = q.shape
            q = q.reshape(num_tokens // context.decode_query_len, context.decode_query_len, num_heads, head_dim)
            trace(
                "attn.decode",
                q=q,
                k_cache=k_cache,
                context_lens=context.context_lens,
                block_tables=context.block_tables,
            )
            decode = seam("paged_decode_attention", self.backend.decode)
            extra = {}  # a learner's function (a seam) takes flash-attn's arguments only
            if self.backend.decode_schedule is not None and decode is self.backend.decode:
                if context.scheduler_metadata is None:  # the step's first layer: one schedule serves every layer
                    context.scheduler_metadata = self.backend.decode_schedule(context.context_lens)
                extra["scheduler_metadata"] = context.scheduler_metadata
            if context.shared_prefix_lens is not None and decode is self.backend.decode:
                extra["shared_prefix_lens"] = context.shared_prefix_lens  # (set where the backend reads it)
            out = decode(
                q,
                k_cache,
                v_cache,
                cache_seqlens=context.context_lens,
                block_table=context.block_tables,
                softmax_scale=self.scale,
                causal=True,
                **extra,
            ).reshape(num_tokens, num_heads, head_dim)  # (B, Lq, H, D) -> (N, H, D)
        trace("attn.out", out=out)
        return out
