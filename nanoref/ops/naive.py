"""The oracle: attention the slow, obvious way, on padded `(B, H, L, D)` tensors.

Every faster path in nanoref (varlen, paged, Triton, flash-attn) is checked against this one. It
pads each sequence to the longest, masks the padding and the future explicitly, and runs plain
matmul + softmax in (at least) float32, so there is nothing clever in it to get wrong.
"""

from __future__ import annotations

import math

import torch


def pad_flat(x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat `(N, H, D)` plus boundaries -> padded `(B, H, L, D)` and a `(B, L)` validity mask."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    batch, max_len = len(lens), max(lens, default=0)
    padded = x.new_zeros(batch, max_len, *x.shape[1:])  # (B, L, H, D)
    valid = torch.zeros(batch, max_len, dtype=torch.bool, device=x.device)  # (B, L)
    for b, (start, length) in enumerate(zip(cu_seqlens[:-1].tolist(), lens)):
        padded[b, :length] = x[start : start + length]
        valid[b, :length] = True
    return padded.transpose(1, 2), valid  # (B, H, L, D), (B, L)


def naive_padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Reference attention for flat varlen inputs.

    q: (Nq, H, D); k, v: (Nk, Hk, D) with H a multiple of Hk (GQA). Sequence b owns query rows
    `cu_seqlens_q[b]:cu_seqlens_q[b+1]` and key rows `cu_seqlens_k[b]:cu_seqlens_k[b+1]`. When a
    sequence has more keys than queries (cached history), its queries are the *last* ones, so the
    causal mask is aligned bottom-right: query i sees keys 0 .. (Lk - Lq + i).
    Returns (Nq, H, D) in q's dtype.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    compute = torch.promote_types(q.dtype, torch.float32)  # at least float32; float64 stays float64
    qp, q_valid = pad_flat(q.to(compute), cu_seqlens_q)  # (B, H, Lq, D)
    kp, k_valid = pad_flat(k.to(compute), cu_seqlens_k)  # (B, Hk, Lk, D)
    vp, _ = pad_flat(v.to(compute), cu_seqlens_k)  # (B, Hk, Lk, D)
    kp = kp.repeat_interleave(group, dim=1)  # (B, H, Lk, D): query head h reads KV head h // group
    vp = vp.repeat_interleave(group, dim=1)  # (B, H, Lk, D)

    scores = (qp @ kp.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    mask = k_valid[:, None, None, :]  # (B, 1, 1, Lk): padded keys never count
    if causal:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(q.device)
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(q.device)
        q_pos = torch.arange(qp.shape[2], device=q.device)[None, :] + (k_lens - q_lens)[:, None]  # (B, Lq)
        k_pos = torch.arange(kp.shape[2], device=q.device)  # (Lk,)
        mask = mask & (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # (B, 1, Lq, Lk)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf -> 0
    out = probs @ vp  # (B, H, Lq, D)

    out = out.transpose(1, 2)  # (B, Lq, H, D)
    return out[q_valid].to(q.dtype)  # (Nq, H, D): drop the padding again
