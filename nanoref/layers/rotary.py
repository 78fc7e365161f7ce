"""Rotary position embedding, neox style (Qwen3): rotate the two halves of each head.

Each flat token carries its own position (its index inside its own sequence), so RoPE needs no
batch axis: cos/sin are looked up per token from a table built once.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoref.utils.seams import seam


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, H, D); cos, sin: (N, D/2). Pairs element i with i + D/2 (neox layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (N, H, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # (N, 1, D/2): same rotation for every head
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)  # (N, H, D)


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
        cos = self.cos_cache[positions]  # (N, D/2)
        sin = self.sin_cache[positions]  # (N, D/2)
        rotate = seam("apply_rotary", apply_rotary)
        return rotate(q, cos, sin), rotate(k, cos, sin)
