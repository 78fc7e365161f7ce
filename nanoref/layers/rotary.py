"""Rotary position embedding, neox style (Qwen3): rotate the two halves of each head.

Each flat token carries its own position (its index inside its own sequence), so RoPE needs no
batch axis: cos/sin are looked up per token from a table built once.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoref.layers.layernorm import rms_norm
from nanoref.utils.compile import on_cuda
from nanoref.utils.seams import seam


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, H, D); cos, sin: (N, D/2). Pairs element i with i + D/2 (neox layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (N, H, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # (N, 1, D/2): same rotation for every head
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)  # (N, H, D)


def rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (N,); q: (N, H, D); k: (N, Hk, D); caches: (P, D/2) -> rotated (q, k)."""
    cos = cos_cache[positions]  # (N, D/2)
    sin = sin_cache[positions]  # (N, D/2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> torch.Tensor:
    """Qwen3's per-head RMSNorm, then RoPE, over query and key heads side by side: x: (N, heads, D); weight:
    (heads, D), each head's norm weight; positions: (N,); caches: (P, D/2) -> (N, heads, D).

    The same arithmetic as rms_norm and apply_rotary on q and k apart, in one pass: half the small ops and one
    cos/sin lookup per layer instead of two norms, two rotations and two lookups.
    """
    return apply_rotary(rms_norm(x, weight, eps), cos_cache[positions], sin_cache[positions])


def norm_rotary_qk(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> torch.Tensor:
    """`norm_rotary` with the query and key heads' norm weights apart: q_weight (H, D), k_weight (Hk, D) (q_norm's
    and k_norm's (D,) weights expanded: views), x: (N, H + Hk, D) -> (N, H + Hk, D). Joined here, inside the
    compiled function, the join is part of Inductor's kernels on CUDA (a reduction and a pointwise kernel per half,
    on an H100); joined by the caller, it was an eager copy kernel of its own in every layer of every step."""
    return norm_rotary(x, torch.cat([q_weight, k_weight]), eps, positions, cos_cache, sin_cache)


# eager: two table lookups and ~10 kernels per tensor (casts, halves, four products, cat); compiled: one
# kernel for q and k together, reading each table row once (utils/compile.py)
rotary_qk_cuda = on_cuda(rotary_qk)
norm_rotary_qk_cuda = on_cuda(norm_rotary_qk)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (D/2,)
        positions = torch.arange(max_position, dtype=torch.float32)  # (P,)
        freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
        # float32 tables: built once, small, and exact enough for long positions
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # (P, D/2)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)  # (P, D/2)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotate = seam("apply_rotary", apply_rotary)
        if rotate is apply_rotary:  # nanoref's own: on CUDA one compiled kernel for q and k together
            return rotary_qk_cuda(positions, q, k, self.cos_cache, self.sin_cache)
        cos = self.cos_cache[positions]  # (N, D/2)
        sin = self.sin_cache[positions]  # (N, D/2)
        return rotate(q, cos, sin), rotate(k, cos, sin)
