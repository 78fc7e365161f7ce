"""SwiGLU's gate: the MLP computes gate and up in one fused matmul, then silu(gate) * up."""

from __future__ import annotations

import torch
from torch import nn

from nanoref.ops.activation import silu_and_mul  # the plain function (ops below need it too)
from nanoref.ops.backends import resolve_backend
from nanoref.utils.compile import on_cuda
from nanoref.utils.seams import seam

__all__ = ["SiluAndMul", "silu_and_mul", "silu_and_mul_cuda"]


# eager: chunk, silu, multiply = two kernels and an (N, I) temporary; compiled: one kernel (utils/compile.py)
silu_and_mul_cuda = on_cuda(silu_and_mul)


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # the engine's kernels (ops/backends.py): a backend's fused kernel (cpp), else silu_and_mul_cuda
        self.backend = resolve_backend("torch", torch.device("cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return seam("silu_and_mul", self.backend.silu_and_mul or silu_and_mul_cuda)(x)
