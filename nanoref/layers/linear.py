"""Linear layers that know how to load HF checkpoint shards into fused and tensor-parallel weights.

HF checkpoints store q_proj, k_proj, v_proj (and gate_proj, up_proj) separately; nanoref packs each
group into one weight so a layer does one matmul instead of three. Each parameter carries a
`weight_loader(param, loaded_weight, shard_id)` that copies a checkpoint tensor into its rows.

Under tensor parallelism (parallel/state.py) a checkpoint tensor is always read whole and each rank keeps
its slice: column-parallel layers keep some output rows (their heads, their part of the intermediate),
row-parallel layers keep the matching input columns and all-reduce their partial outputs. The loaders
check the whole tensor's shape first, so a wrong checkpoint fails the same way on one rank or many.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoref.parallel.state import all_reduce, get_parallel_state, tp_rank, tp_size
from nanoref.utils.weak import WeakBoundMethod


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str = "checkpoint tensor") -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} ({size}) must divide evenly over tensor_parallel_size={parts}")
    return size // parts


class Linear(nn.Module):
    """y = x W^T (+ b). x: (N, in) -> (N, out). Replicated: every rank holds all of W (the MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = WeakBoundMethod(self.weight_loader)  # (weakly: no layer <-> parameter cycle)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = WeakBoundMethod(self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """W split along its input features: rank r holds columns [r in/N, (r+1) in/N) and receives the matching
    slice of x (what the column-parallel layer before it produced); its x_r W_r^T is a partial sum of y, and
    one all-reduce adds the ranks' partial sums. x: (N, in/N) -> (N, out), the same on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, name: str = "row_parallel") -> None:
        """name: what a shape trace calls this layer's all-reduce (`<name>.all_reduce`), e.g. "o_proj"."""
        self.parallel = get_parallel_state()  # the group this layer's all-reduce runs in
        self.name = name
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.full_input_size = input_size
        super().__init__(_divide(input_size, self.tp_size, "the input size of a row-parallel layer"), output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if param.dim() == 1:  # the bias: whole on every rank, added once after the all-reduce
            return default_weight_loader(param, loaded_weight)
        _check_shape(loaded_weight, (param.shape[0], self.full_input_size))
        columns = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * columns, columns))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        # (N, out): the sum of every rank's partial product
        y = all_reduce(F.linear(x, self.weight), self.parallel, f"{self.name}.all_reduce")
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output axis (gate_up_proj), column-parallel:
    rank r keeps its slice of each piece, side by side, [gate_r | up_r], so SwiGLU stays local."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.full_output_sizes = list(output_sizes)
        local = self.local_sizes(output_sizes)
        super().__init__(input_size, sum(local), bias)
        self.offsets = [sum(local[:i]) for i in range(len(local))]
        self.output_sizes = local  # this rank's rows of each piece

    def local_sizes(self, output_sizes: list[int]) -> list[int]:
        """Rows of each piece on one rank."""
        return [_divide(size, self.tp_size, "a column-parallel projection's output size") for size in output_sizes]

    def piece_rows(self, index: int) -> tuple[int, int]:
        """(first row, row count) of this rank's slice of piece `index`, in the piece's checkpoint tensor."""
        rows = self.output_sizes[index]
        return self.tp_rank * rows, rows

    def shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    def shard_rows(self, shard_id: int | str) -> slice:
        """Where piece `shard_id` sits in this rank's fused weight."""
        index = self.shard_index(shard_id)
        return slice(self.offsets[index], self.offsets[index] + self.output_sizes[index])

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:  # the fused tensor whole (nanoref's own name): split it into its pieces
            _check_shape(loaded_weight, (sum(self.full_output_sizes), *param.shape[1:]))
            for index, piece in enumerate(loaded_weight.split(self.full_output_sizes)):
                self._load_piece(param, piece, index)
            return
        index = self.shard_index(shard_id)
        expected = (self.full_output_sizes[index], *param.shape[1:])
        _check_shape(loaded_weight, expected, f"checkpoint shard {shard_id!r}")
        self._load_piece(param, loaded_weight, index)

    def _load_piece(self, param: nn.Parameter, piece: torch.Tensor, index: int) -> None:
        start, rows = self.piece_rows(index)
        target = param.data[self.offsets[index] : self.offsets[index] + rows]
        target.copy_(piece.narrow(0, start, rows))


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: output rows [q (H*D) | k (Hk*D) | v (Hk*D)], split by heads.

    Rank r of N keeps query heads [r H/N, (r+1) H/N) and the KV heads they read. With Hk >= N each rank
    keeps Hk/N KV heads of its own; with fewer KV heads than ranks (N a multiple of Hk) each KV head is
    replicated on the N/Hk ranks whose query heads share it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = local_heads(num_heads, num_kv_heads, tp_size())
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def local_sizes(self, output_sizes: list[int]) -> list[int]:
        return [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]

    def piece_rows(self, index: int) -> tuple[int, int]:
        if index == 0:
            return self.tp_rank * self.num_heads * self.head_dim, self.num_heads * self.head_dim
        first_kv_head = self.tp_rank * self.total_num_kv_heads // self.tp_size  # replicated: ranks share one
        return first_kv_head * self.head_dim, self.num_kv_heads * self.head_dim

    def shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id]


def local_heads(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on each of `world_size` ranks; ValueError when the heads cannot be split."""
    if num_heads % world_size:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of tensor_parallel_size ({world_size})")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({world_size}) must divide one "
            "another: KV heads are split across the ranks, or each replicated on several"
        )
    return num_heads // world_size, max(1, num_kv_heads // world_size)
