"""RMSNorm, plain and with the residual add fused in.

Statistics are computed in float32 and the result is cast back before the weight multiply: the mean
of squares overflows or loses precision in bf16/fp16, while keeping activations in low precision
saves memory and bandwidth. The two forms are small pure functions so `torch.compile` can fuse them
(notebook 02 measures where that pays); on CUDA the layer runs their compiled forms.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoref.ops.backends import resolve_backend
from nanoref.utils.compile import on_cuda
from nanoref.utils.seams import seam


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., hidden) -> (..., hidden): x * rsqrt(mean(x^2) + eps) * weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `residual = x + residual; out = rms_norm(residual)`: returns (out, new residual).

    The add happens in float32 too; the new residual is handed back in the input dtype.
    """
    dtype = x.dtype
    summed = x.float() + residual.float()
    new_residual = summed.to(dtype)
    normed = summed * torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(dtype), new_residual


# On CUDA each form is ~8 small kernels eager and one compiled: RMSNorm runs twice per layer plus per-head
# on q and k, so this is most of a decode step's kernel launches (utils/compile.py).
rms_norm_cuda = on_cuda(rms_norm)
add_rms_norm_cuda = on_cuda(add_rms_norm)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # the engine's kernels (ops/backends.py: the model runner hands its own down): a backend's fused RMSNorm (cpp),
        # else the functions above (compiled on CUDA)
        self.backend = resolve_backend("torch", torch.device("cpu"))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = self.backend
        if residual is None:
            return seam("rms_norm", kernels.rms_norm or rms_norm_cuda)(x, self.weight, self.eps)
        return seam("add_rms_norm", kernels.add_rms_norm or add_rms_norm_cuda)(x, residual, self.weight, self.eps)
