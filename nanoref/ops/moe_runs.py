"""The (token, slot) pairs of a Qwen3-MoE layer sorted into one run of rows per expert (see moe_grouped.py).

Both grouped matmuls read these: the pure-torch one and the Triton kernel (moe_grouped_triton.py), so they sit
below both, in a file of their own.
"""

from __future__ import annotations

import torch


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids (N, K) in [0, E) -> order (N*K,) int64, offsets (E,) int32.

    order[r] is the pair (flat index into topk_ids) of sorted row r; expert e's rows are
    [offsets[e-1], offsets[e]) (offsets[-1] == N*K), empty for an expert nobody chose.
    """
    flat = topk_ids.flatten()  # (N*K,): pair p = (token p // K, slot p % K)
    # stable: equal experts keep pair order, so the result does not depend on how the sort breaks ties
    sorted_ids, order = torch.sort(flat, stable=True)  # (N*K,), (N*K,)
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)  # (E,)
    # Expert e's run ends after the last sorted id <= e: one binary search per expert. This is the cumulative
    # sum of per-expert counts without computing them: torch.bincount on CUDA sizes its output from the largest
    # id (a host sync), and scatter_add_ would need atomics.
    offsets = torch.searchsorted(sorted_ids, experts, right=True)  # (E,)
    return order, offsets.to(torch.int32)  # int32: what torch._grouped_mm takes


def row_experts(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Run ends (E,) -> (num_rows,) int64: the expert of each sorted row (the first e whose run ends past it).

    Rows at or past offsets[-1] belong to no run; they get E - 1, so that indexing with the result stays in
    bounds (a grouped matmul leaves such rows unspecified).
    """
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)  # (M,)
    expert = torch.searchsorted(offsets, rows, right=True)  # (M,): how many runs end at or before the row
    return expert.clamp_(max=offsets.shape[0] - 1)
