"""SwiGLU's gate: the MLP computes gate and up in one fused matmul, then silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoref.utils.seams import seam


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (N, 2 * I) = [gate | up] -> (N, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return seam("silu_and_mul", silu_and_mul)(x)
