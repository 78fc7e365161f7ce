"""Linear layers that know how to load HF checkpoint shards into fused weights.

HF checkpoints store q_proj, k_proj, v_proj (and gate_proj, up_proj) separately; nanoref packs each
group into one weight so a layer does one matmul instead of three. Each parameter carries a
`weight_loader(param, loaded_weight, shard_id)` that copies a checkpoint tensor into its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T (+ b). x: (N, in) -> (N, out)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output axis (gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.output_sizes = output_sizes

    def shard_rows(self, shard_id: int | str) -> slice:
        index = int(shard_id)
        return slice(self.offsets[index], self.offsets[index] + self.output_sizes[index])

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded_weight)
        rows = self.shard_rows(shard_id)
        target = param.data[rows]
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"checkpoint shard {shard_id!r} has shape {tuple(loaded_weight.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded_weight)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output rows [q (H*D) | k (Hk*D) | v (Hk*D)]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def shard_rows(self, shard_id: int | str) -> slice:
        return super().shard_rows({"q": 0, "k": 1, "v": 2}[shard_id])
