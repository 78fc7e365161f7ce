"""Qwen3-MoE's experts as two grouped matmuls: fixed shapes and no host sync, so a CUDA graph can record them.

The reference, `nanoref.models.qwen3_moe.moe_experts`, runs one expert at a time on the tokens that chose it.
How many tokens that is depends on the routing, so its shapes change from step to step, it must ask the device
which tokens went where (a host sync per expert), and a CUDA graph, which replays fixed kernels on fixed
shapes, cannot record it. Here every (token, slot) pair is a row of one matrix, sorted so that each expert's
rows sit together, and every shape depends on N, K and E alone, never on which experts were picked:

    pairs   (N*K,)          pair p = (token p // K, slot p % K) was routed to expert topk_ids.flatten()[p]
    sort    order (N*K,)    the pairs in expert order (stable: a token's rows keep their order inside an expert)
    ends    offsets (E,)    where each expert's run of sorted rows ends (an expert nobody chose: an empty run)
    gather  (N*K, hidden)   the token of each sorted row
    GEMM    (N*K, 2 I)      ONE grouped matmul: rows [offsets[e-1], offsets[e]) times expert e's gate_up
    SwiGLU  (N*K, I)
    GEMM    (N*K, hidden)   one grouped matmul with each expert's down
    back    (N, hidden)     each row scaled by its router weight, un-sorted to pair order, summed over the K slots

A grouped matmul `grouped_mm(x, w, offsets) -> (M, n)` takes x (M, k) rows sorted by expert, w (E, n, k)
stacked like `nn.Linear` weights and offsets (E,) int32 run ends; rows [offsets[e-1], offsets[e]) are
multiplied by w[e].T. Three of them:
- `grouped_mm_torch`: PyTorch's `torch._grouped_mm` (a private API). On Hopper and Blackwell GPUs in bf16 it is
  one CUTLASS kernel; on other GPUs and dtypes it loops over the groups after reading offsets on the host (a
  sync, so not for CUDA graphs), which is fine on a CPU.
- `grouped_mm_triton`: nanoref's own Triton kernel (moe_grouped_triton.py): any dtype, any GPU; on a CPU it runs
  under the interpreter.
- `grouped_mm_per_row`: pure torch, for reading and for tests: each row's expert weight is gathered and applied
  by one batched matmul. Fixed shapes too, but it copies an (n, k) matrix per row: tiny sizes only.
`pick_grouped_mm` chooses one for a device and dtype. Sorting the pairs into runs (`sort_by_expert`, `row_experts`)
lives in moe_runs.py, which both matmul files read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from nanoref.ops.activation import silu_and_mul
from nanoref.ops.moe_runs import row_experts, sort_by_expert
from nanoref.ops.triton_setup import triton_available
from nanoref.utils.tracing import trace, tracing_enabled

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# -- grouped matmuls: (M, k) sorted rows x (E, n, k) weights -> (M, n) --------------------------------


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm: rows [offsets[e-1], offsets[e]) of x (M, k) times w[e].T; w (E, n, k) -> (M, n)."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)  # (M, k) @ (E, k, n) run by run -> (M, n)


def grouped_mm_per_row(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same product in plain torch: every row gathers its own expert's weight. For tests and teaching only:
    it copies an (n, k) matrix per row, M * n * k elements (at Qwen3-30B-A3B's shapes, 6 MB per row in bf16)."""
    w_rows = w.index_select(0, row_experts(offsets, x.shape[0]))  # (M, n, k): row r's expert weight
    return torch.bmm(w_rows, x.unsqueeze(-1)).squeeze(-1)  # (M, n, k) @ (M, k, 1) -> (M, n)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """nanoref's Triton grouped matmul (moe_grouped_triton.py), imported on first use: importing it imports Triton,
    which on a CPU must first switch the interpreter on (triton_setup.py)."""
    from nanoref.ops.moe_grouped_triton import grouped_mm

    return grouped_mm(x, w, offsets)


def torch_grouped_mm_is_one_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs as one CUTLASS kernel here (no host sync): bf16 on Hopper or Blackwell."""
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def torch_grouped_mm_aligned(dtype: torch.dtype, *dims: int) -> bool:
    """torch._grouped_mm wants every row stride a multiple of 16 bytes (its kernels load rows with TMA)."""
    return all(dim * dtype.itemsize % 16 == 0 for dim in dims)


@functools.cache
def _pick(device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> GroupedMM | None:
    aligned = torch_grouped_mm_aligned(dtype, hidden_size, intermediate_size)
    if device.type == "cuda":
        if aligned and torch_grouped_mm_is_one_kernel(device, dtype):
            return grouped_mm_torch
        return grouped_mm_triton if triton_available() else None  # else no grouped matmul that a graph can record
    if aligned and hasattr(torch, "_grouped_mm"):
        return grouped_mm_torch  # a CPU: its loop over groups is right and fast enough
    return grouped_mm_per_row


def pick_grouped_mm(w_gate_up: torch.Tensor) -> GroupedMM | None:
    """The grouped matmul for experts stacked like w_gate_up (E, 2 I, hidden), on its device and in its dtype.

    None on a GPU where no grouped matmul without a host sync serves (neither torch._grouped_mm's CUTLASS
    kernel nor Triton): the caller then keeps the per-expert loop.
    """
    device = w_gate_up.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _pick(device, w_gate_up.dtype, w_gate_up.shape[2], w_gate_up.shape[1] // 2)


def grouped_path_serves(w_gate_up: torch.Tensor) -> bool:
    """Whether the model should run these experts grouped: on a GPU, where a grouped matmul without host sync
    exists for them. A CPU keeps the readable loop (nothing to record there, and the loop is the reference)."""
    return w_gate_up.is_cuda and pick_grouped_mm(w_gate_up) is not None


# -- the experts ----------------------------------------------------------------------------------


def moe_experts_grouped(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    grouped_mm: GroupedMM | None = None,
) -> torch.Tensor:
    """`moe_experts`' contract, computed with two grouped matmuls over all experts at once.

    hidden (N, hidden); topk_weights (N, K) in hidden's dtype; topk_ids (N, K) int64 in [0, E);
    w_gate_up (E, 2 I, hidden); w_down (E, hidden, I). Returns (N, hidden): row n = sum over k of
    topk_weights[n, k] * expert_{topk_ids[n, k]}(hidden[n]). grouped_mm: None = `pick_grouped_mm`'s choice.
    """
    num_tokens, top_k = topk_ids.shape
    if grouped_mm is None:
        grouped_mm = pick_grouped_mm(w_gate_up)
        if grouped_mm is None:
            raise RuntimeError(
                f"no grouped matmul serves {w_gate_up.dtype} on {w_gate_up.device} without a host sync "
                "(torch._grouped_mm needs bf16 on a Hopper or Blackwell GPU, the Triton kernel needs triton)"
            )
    order, offsets = sort_by_expert(topk_ids, w_gate_up.shape[0])  # (N*K,), (E,)
    x = hidden.index_select(0, order // top_k)  # (N*K, hidden): sorted row r holds the token of pair order[r]
    gate_up = grouped_mm(x, w_gate_up, offsets)  # (N*K, 2 I)
    y = grouped_mm(silu_and_mul(gate_up), w_down, offsets)  # (N*K, I) -> (N*K, hidden)
    y = y * topk_weights.flatten().index_select(0, order).unsqueeze(-1)  # (N*K, hidden): times the router weight
    # Back to pair order, then a sum over each token's K rows: deterministic (index_add_ on a GPU adds a token's
    # K rows with atomics, in no fixed order) and summed in float32 whatever the model's dtype.
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # (N*K, hidden): row p is pair p = (p // K, p % K)
    out = pairs.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32)  # (N, hidden)
    if tracing_enabled():  # fixed shapes: the same whatever the routing, unlike the loop's per-expert stages
        trace("moe.grouped", order=order, offsets=offsets, x=x, gate_up=gate_up, y=y)
    return out.to(hidden.dtype)
