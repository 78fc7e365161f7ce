"""A grouped matmul in Triton: rows sorted by expert, each run of rows times its own expert's weight.

Same arguments as `torch._grouped_mm` used the way moe_grouped.py uses it: x (M, k) rows sorted by expert,
w (E, n, k) stacked like `nn.Linear` weights, offsets (E,) int32 run ends -> out (M, n). It exists because
`torch._grouped_mm` has a single-kernel path only for bf16 on Hopper and Blackwell; this kernel serves any dtype
and GPU without a host sync (so a decode CUDA graph can record it), and on a CPU runs under the interpreter.

One program per (tile of BLOCK_M sorted rows, tile of BLOCK_N output columns); the grid depends on M and n
only. Because rows are sorted, a tile holds one run of rows per expert it touches, in order (at decode, M = N*K
is small and a tile spans many experts; in a long prefill, most tiles lie inside one expert's run). The program
walks those experts: for each, it loads only that expert's rows (the others read as zero, so they add exactly
0 to the accumulator) and multiplies them by that expert's weight tile. So every weight tile is read once per
row tile that needs it, and an expert with no row in the tile costs nothing.

Under the interpreter, storing a float32 accumulator as bf16 truncates (rounds toward zero) where a GPU rounds
to nearest, so there bf16 results lie about twice as far from the exact ones as torch's (tests allow for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoref.ops.moe_runs import row_experts
from nanoref.ops.triton_setup import import_triton, interpreting

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton: the interpreter switch comes first)


@dataclass
class Launch:
    block_m: int = 64  # sorted rows per tile
    block_n: int = 64  # output columns per tile
    block_k: int = 64  # reduction step
    num_warps: int = 4
    num_stages: int = 3


GPU_LAUNCH = Launch()
INTERPRETER_LAUNCH = Launch(block_m=32, block_n=64, block_k=64)  # few tiles: the interpreter pays per iteration


@triton.jit
def grouped_mm_kernel(
    x_ptr, w_ptr, out_ptr, expert_ptr,
    M, N, K,
    stride_xm,  # x (M, K), unit stride along K
    stride_we, stride_wn,  # w (E, N, K), unit stride along K
    stride_om,  # out (M, N), unit stride along N
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # sorted rows of this tile
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    row_ok = rows < M
    col_ok = cols < N
    expert = tl.load(expert_ptr + rows, mask=row_ok, other=-1)  # (BLOCK_M,): -1 past the end matches no expert
    last = tl.max(expert, 0)  # rows are sorted by expert: the tile's experts are first..last, each one run
    e = tl.min(tl.where(row_ok, expert, last), 0)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1) row starts
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    while e <= last:
        mine = expert == e  # (BLOCK_M,): this expert's rows of the tile
        w_cols = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # (1, BLOCK_N) rows of w[e]
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            # other experts' rows load as zeros (and are not read): they add exactly 0 to their accumulator rows
            a = tl.load(x_rows + ks[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
            if UPCAST:  # the interpreter's tl.dot is wrong on bf16 operands
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)  # w[e].T's tile: b[k, n] = w[e, n, k]
        e = tl.min(tl.where(expert > e, expert, last + 1), 0)  # the tile's next expert (last + 1: done)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, launch: Launch | None = None) -> torch.Tensor:
    """x (M, k) rows sorted by expert, w (E, n, k), offsets (E,) run ends -> (M, n): rows
    [offsets[e-1], offsets[e]) times w[e].T, accumulated in float32 (rows past offsets[-1]: unspecified)."""
    num_rows, k = x.shape
    num_experts, n, w_k = w.shape
    if w_k != k or offsets.shape != (num_experts,):
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and offsets {tuple(offsets.shape)} do not fit "
            "(x (M, k), w (E, n, k), offsets (E,))"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(2) != 1:
        w = w.contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)  # (M, n)
    if num_rows == 0:
        return out
    expert = row_experts(offsets, num_rows).to(torch.int32)  # (M,): each row's expert
    launch = launch or (INTERPRETER_LAUNCH if interpreting() else GPU_LAUNCH)
    grid = (triton.cdiv(num_rows, launch.block_m), triton.cdiv(n, launch.block_n))
    grouped_mm_kernel[grid](
        x, w, out, expert,
        num_rows, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        # float32 on a GPU: "ieee", not the default TF32, so float32 results match the torch reference
        UPCAST=interpreting(), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return out
