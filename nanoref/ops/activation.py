"""SwiGLU's gate as a plain function: silu(gate) * up of x = [gate | up].

The layer that calls it (with its exercise seam and, on CUDA, compiled) is `nanoref.layers.activation.SiluAndMul`;
the function sits down here so that ops which need it, such as Qwen3-MoE's grouped experts, import nothing above ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (N, 2 * I) = [gate | up] -> (N, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
