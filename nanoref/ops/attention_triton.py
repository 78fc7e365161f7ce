"""Triton attention over the paged KV cache, with the torch reference's (and flash-attn's) arguments.

- `paged_decode_attention` ~ `flash_attn_with_kvcache`: flash-decoding. One program per (sequence,
  KV head, split) walks the pages its block table names with an online softmax. The query heads that
  share the KV head (GQA) are rows of one tile, so each K/V byte is read from memory once. When the
  batch alone cannot fill the GPU, each sequence's context is cut into splits run side by side, and a
  second kernel merges their partial results through their log-sum-exps.
- `varlen_attention` ~ `flash_attn_varlen_func`: causal prefill over flat queries. With
  `block_table`, keys and values are read from the paged cache, so a prefix-cache hit or an earlier
  chunk of a chunked prefill needs no copy. One program per (query tile, KV head): as in decode, the
  group's query heads are rows of one tile, so each K/V tile is loaded once per group. Key tiles wholly
  below the causal diagonal skip the mask; only the diagonal's (and the sequence end's) pay for it.

References: `nanoref.ops.attention_torch` (same arguments) and `naive_padded_attention` (the oracle).
On a CPU these kernels run under the Triton interpreter (see triton_setup.py); there `tl.dot` on
bf16 operands is wrong (an interpreter bug), so the interpreter path upcasts every dot to float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from nanoref.ops.triton_setup import import_triton, interpreting
from nanoref.utils.seams import seam

triton = import_triton()
import triton.language as tl  # noqa: E402  (after import_triton: the interpreter switch comes first)

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) == exp2(x * log2(e)), and exp2 is one instruction


@dataclass
class Launch:
    """Tile sizes and launch settings: on a GPU, speed depends on these; benchmarks/kernel_bench.py sweeps them."""

    block_m: int = 64  # query rows per tile (prefill: tokens x the GQA group's heads; decode's are fixed by GQA)
    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


# Decode tiles by the cache's dtype and the batch (`decode_launch`). Measured on an H100 over kernel_bench.py's mixed
# contexts (benchmarks/results/kernels_launch_h100.md): 16-bit caches read 128-key tiles (4 warps, 3 stages), which
# tie 64-key ones from 128 sequences up and win 3-16% below (fewer, longer iterations
# where few programs run); float32 keeps 64 keys (128 at 3 stages would not fit shared memory beside a second program)
DECODE_LAUNCH = Launch(block_n=128, num_warps=4, num_stages=3)
DECODE_LAUNCH_FP32 = Launch(block_n=64, num_warps=4, num_stages=3)
# 128 rows (64 tokens x GQA 2's heads): two warpgroups of 64 rows, so 8 warps. On an H200 it tied 64 rows / 4 warps
# (69% of SDPA, geometric mean) and led on long sequences (benchmarks/results/kernels_compare_h200.md)
PREFILL_LAUNCH = Launch(block_m=128, block_n=64, num_warps=8, num_stages=3)
# An 8-bit cache (kv_cache_dtype="fp8"): a 128-key tile moves the bytes of a 64-key bf16 tile per iteration. On an
# H100 it read 61-83% of copy bandwidth over mixed contexts, against 46-62% at 64 keys (with K/V widened to bf16),
# and 8 warps lost everywhere (benchmarks/results/kernels_mixed_fp8_h100.md). Its widened tiles live in registers
# (213-246 a thread against bf16's 96: two programs an SM), and 2 stages beat 3 at batch 32-256 by 3-7%
# (benchmarks/results/kernels_fp8_tiles_h100.md). From DECODE_8BIT_WIDE_BATCH sequences on, 64-key tiles in 2 warps
# (four programs an SM) are 2-5% faster; below it they lose up to 40% (too few programs to hide the loads).
DECODE_LAUNCH_8BIT = Launch(block_n=128, num_warps=4, num_stages=2)
DECODE_LAUNCH_8BIT_WIDE = Launch(block_n=64, num_warps=2, num_stages=3)
DECODE_8BIT_WIDE_BATCH = 192
# The cascade prefix pass keeps the tiles it was measured with (benchmarks/results/kernels_cascade_h100.md)
PREFIX_LAUNCH = Launch(block_n=64, num_warps=4, num_stages=3)
PREFIX_LAUNCH_8BIT = Launch(block_n=128, num_warps=4, num_stages=2)
INTERPRETER_LAUNCH = Launch(block_m=64, block_n=64)  # few big tiles: the interpreter pays per iteration


@triton.jit
def _attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of keys and values into the online softmax: running max m_i, sum l_i, output acc.

    q: (M, D) query rows; k, v: (N, D); visible: (M, N), False where a key must not count. Base 2 throughout:
    qk_scale carries log2(e), so exp2 gives the softmax's exp. Returns the new (m_i, l_i, acc).
    """
    # K/V in q's dtype: an 8-bit cache (kv_cache_dtype="fp8") widens here, after its half-size load (to float16 in
    # the decode kernel: WIDE_F16); the interpreter's q is float32 (UPCAST: its tl.dot is wrong on bf16 operands).
    # A no-op where the dtypes agree
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (M, N)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # (M,)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at zero
    alpha = tl.exp2(m_i - m_safe)  # (M,): rescales what was summed under the old max
    p = tl.exp2(scores - m_safe[:, None])  # (M, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # (M, D)
    return m_new, l_i, acc


# The ints that change with the batch (a block table's width, the split count and the strides it sets) are not
# specialised on: Triton would otherwise compile a variant per value class (1, a multiple of 16, other), each a
# second or more, in the middle of a run (seen on an H200: prefill steps of 50 ms taking 1.3-1.7 s).
@triton.jit(do_not_specialize=["stride_bt", "stride_ob", "stride_os", "stride_lb", "stride_ls"])
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seqlens_ptr, out_ptr, lse_ptr,
    order_ptr,  # (B,) the sequences in the order their programs start (ORDERED), e.g. longest context first
    prefix_lens_ptr,  # (B,) with SKIP_PREFIX: each sequence's shared prefix (0: none), read by shared_prefix_kernel
    qk_scale,  # softmax_scale * log2(e)
    stride_qb, stride_qm, stride_qh,  # q (B, Lq, H, D)
    stride_kblock, stride_kslot, stride_kh,  # caches (num_blocks, block_size, Hk, D)
    stride_bt,  # block_table (B, max_blocks)
    stride_ob, stride_os, stride_om, stride_oh,  # out (B, S, Lq, H, D): S = 1 is the final output
    stride_lb, stride_ls, stride_lm,  # lse (B, S, Lq, H) float32, base 2
    split_len,  # context tokens per split (a multiple of BLOCK_N)
    LEN_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ORDERED: tl.constexpr,
    WIDE_F16: tl.constexpr,  # an 8-bit cache under a half-precision q: the tiles' dots run in float16
    SKIP_PREFIX: tl.constexpr,  # start each sequence's keys after its shared prefix (cascade: read once elsewhere)
    TILE_IN_PAGE: tl.constexpr,  # every tile starts at a multiple of BLOCK_N, which divides PAGE
):  # fmt: skip
    # The GPU starts programs in grid order, axis 0 fastest: a sequence's KV heads start side by side, and with
    # ORDERED the sequences start in order_ptr's order. Longest first, the short programs fill the SMs at the end
    # of the step instead of one long program running on alone (a mixed batch's tail).
    kv_head = tl.program_id(0)
    rank = tl.program_id(1)
    split = tl.program_id(2)
    if ORDERED:
        seq = tl.load(order_ptr + rank).to(tl.int32)
    else:
        seq = rank
    seqlen = tl.load(seqlens_ptr + seq)

    # Tile rows are (query token, query head of this KV head's group): GROUP * LEN_Q of BLOCK_M used.
    rows = tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < LEN_Q * GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + q_idx[:, None] * stride_qm + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    elif WIDE_F16:
        # 8-bit K/V widen to float16 exactly (e4m3 and e5m2 both lie inside it), one convert per pair of values
        # where bfloat16 takes two more. q joins them with the softmax scale folded in (|q| * 0.13 for head_dim
        # 128), so that a q past float16's 65,504 still fits; scores come out scaled, so the tiles' factor is 1.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    q_pos = seqlen - LEN_Q + q_idx  # the queries are the newest LEN_Q tokens of the history

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = split * split_len
    if SKIP_PREFIX:
        start += tl.load(prefix_lens_ptr + seq)
    end = tl.minimum(seqlen, start + split_len)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # logical token positions of this tile
        k, v = _load_kv_tile(  # (BLOCK_N, BLOCK_D) each: logical position -> block table -> slot; zeros from end
            k_cache_ptr, v_cache_ptr, block_table_ptr, seq, 0, kv_head, n0, end, dims, dim_ok,
            stride_kblock, stride_kslot, stride_kh, stride_kblock, stride_kslot, stride_kh, stride_bt,
            BLOCK_N, True, PAGE, True, TILE_IN_PAGE,
        )  # fmt: skip
        visible = (pos < end)[None, :]  # (1, BLOCK_N), broadcast over the rows
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])  # (BLOCK_M, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION)

    seen = l_i > 0.0  # False for a split past the sequence's end
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_rows = seq * stride_ob + split * stride_os + q_idx * stride_om + head * stride_oh  # (BLOCK_M,)
    tl.store(
        out_ptr + out_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # (BLOCK_M,)
    tl.store(lse_ptr + seq * stride_lb + split * stride_ls + q_idx * stride_lm + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ps", "stride_lb", "stride_ls"])
def merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr,
    num_splits,
    stride_pb, stride_ps, stride_pm, stride_ph,  # partial (B, S, Lq, H, D) float32
    stride_lb, stride_ls, stride_lm,  # lse (B, S, Lq, H)
    stride_ob, stride_om, stride_oh,  # out (B, Lq, H, D)
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = sum_s w_s * partial_s with w_s = 2**lse_s / sum 2**lse: each split's share of the softmax."""
    seq = tl.program_id(0)
    q_idx = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    lse = tl.load(
        lse_ptr + seq * stride_lb + splits * stride_ls + q_idx * stride_lm + head, mask=split_ok, other=float("-inf")
    )  # (BLOCK_S,)
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # (BLOCK_S,): 0 for empty splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row = seq * stride_pb + q_idx * stride_pm + head * stride_ph
    partial = tl.load(
        partial_ptr + row + splits[:, None] * stride_ps + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # (BLOCK_D,)
    tl.store(
        out_ptr + seq * stride_ob + q_idx * stride_om + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@triton.jit(do_not_specialize=["batch", "stride_bt", "stride_ob", "stride_os", "stride_lb", "stride_ls"])
def shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, prefix_lens_ptr, out_ptr, lse_ptr,
    qk_scale,  # softmax_scale * log2(e)
    batch,
    stride_bt,  # block_table (B, max_blocks)
    stride_qb, stride_qm, stride_qh,  # q (B, Lq, H, D)
    stride_kblock, stride_kslot, stride_kh,  # caches (num_blocks, block_size, Hk, D)
    stride_ob, stride_os, stride_om, stride_oh,  # out (B, S, Lq, H, D) float32: this kernel's splits come first
    stride_lb, stride_ls, stride_lm,  # lse (B, S, Lq, H) float32, base 2
    LEN_Q: tl.constexpr, GROUP: tl.constexpr, SEQS: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, WIDE_F16: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,  # BLOCK_N divides PAGE (the splits start at multiples of BLOCK_N)
):  # fmt: skip
    """Cascade attention's first pass: the keys that many sequences share (a system prompt's blocks), read once for
    SEQS sequences at a time instead of once per sequence.

    prefix_lens (B,): P for each sequence whose first P tokens are the shared prefix, 0 for the others. One
    program: SEQS sequences' queries for one KV head (rows: sequence, query token, query head of the group),
    against one split of the P prefix keys, found through the block table of the first sequence that has them.
    Every query sees every prefix key (they precede it), so the only mask is the prefix's end (and rows without the
    prefix, which see nothing). Writes a partial output and its log-sum-exp per split, as paged_decode_kernel's
    splits, for merge_splits_kernel (0 and -inf for a row that saw no key).
    """
    kv_head = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    # P and the first sequence with the prefix, found in prefix_lens (a few hundred ints, from the L2 cache), so that
    # no second input has to agree with it
    prefix_len = tl.full([], 0, tl.int32)
    owner = tl.full([], 0, tl.int32) + batch
    for i in range(0, batch, 128):
        index = i + tl.arange(0, 128)
        lens = tl.load(prefix_lens_ptr + index, mask=index < batch, other=0)
        prefix_len = tl.maximum(prefix_len, tl.max(lens, 0))
        owner = tl.minimum(owner, tl.min(tl.where(lens > 0, index, batch), 0))
    split_len = (prefix_len + tl.num_programs(2) * BLOCK_N - 1) // (tl.num_programs(2) * BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(prefix_len, start + split_len)

    rows = tl.arange(0, BLOCK_M)
    seq = tile * SEQS + rows // (LEN_Q * GROUP)
    q_idx = rows % (LEN_Q * GROUP) // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < SEQS * LEN_Q * GROUP) & (seq < batch)
    shares = tl.load(prefix_lens_ptr + seq, mask=row_ok, other=0) > 0  # (BLOCK_M,) the row's sequence has it
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq[:, None] * stride_qb + q_idx[:, None] * stride_qm + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    elif WIDE_F16:  # (see paged_decode_kernel)
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        k, v = _load_kv_tile(  # (BLOCK_N, BLOCK_D) each, through the owner's block table; zeros past the split
            k_cache_ptr, v_cache_ptr, block_table_ptr, owner, 0, kv_head, n0, end, dims, dim_ok,
            stride_kblock, stride_kslot, stride_kh, stride_kblock, stride_kslot, stride_kh, stride_bt,
            BLOCK_N, True, PAGE, True, TILE_IN_PAGE,
        )  # fmt: skip
        visible = shares[:, None] & pos_ok[None, :]  # (BLOCK_M, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION)

    seen = l_i > 0.0  # False for a split past the prefix's end, or a row without it
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_rows = seq * stride_ob + split * stride_os + q_idx * stride_om + head * stride_oh  # (BLOCK_M,)
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # (BLOCK_M,)
    tl.store(lse_ptr + seq * stride_lb + split * stride_ls + q_idx * stride_lm + head, lse, mask=row_ok)


@triton.jit
def _attend_full_tile(q, k, v, qk_scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """`_attend_tile` for a tile that every row sees whole (causal prefill below the diagonal): no mask.

    With no masked score, a row's max is finite from its first tile on, so the guard for all-masked rows goes
    too, and the scale folds into the exponent's one multiply-add. qk_scale must be positive (the launcher
    checks): then max(s) * scale == max(s * scale).
    """
    k = k.to(q.dtype)  # (see _attend_tile)
    v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N), not yet scaled
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)  # (M,)
    alpha = tl.exp2(m_i - m_new)  # (M,): 0 on the first tile (m_i = -inf)
    p = tl.exp2(scores * qk_scale - m_new[:, None])  # (M, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)  # (M, D): the MMA accumulates in place
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(
    k_ptr, v_ptr, block_table_ptr, seq, k_start, kv_head, n0, len_k, dims, dim_ok,
    stride_kblock, stride_kn, stride_kh, stride_vblock, stride_vn, stride_vh, stride_bt,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):  # fmt: skip
    """Keys and values at positions n0 .. n0 + BLOCK_N of one sequence: (BLOCK_N, BLOCK_D) each.

    Paged: logical position -> physical block (through the block table) -> slot in that block. TILE_IN_PAGE:
    the caller's tiles start at multiples of BLOCK_N and BLOCK_N divides PAGE, so a tile lies in one block: one
    table entry for the tile and consecutive slots, instead of one lookup per key (128 loads of the same entry
    for a 128-key tile). MASKED: positions from len_k on read as zeros (the sequence's or split's last tile);
    unmasked tiles lie wholly inside the sequence.
    """
    pos = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical positions
    if PAGED:
        if TILE_IN_PAGE:  # n0 < len_k: the entry is the sequence's own
            block = tl.load(block_table_ptr + seq * stride_bt + n0 // PAGE)
            slot = n0 % PAGE + tl.arange(0, BLOCK_N)
        elif MASKED:
            block = tl.load(block_table_ptr + seq * stride_bt + pos // PAGE, mask=pos < len_k, other=0)
            slot = pos % PAGE
        else:
            block = tl.load(block_table_ptr + seq * stride_bt + pos // PAGE)
            slot = pos % PAGE
        block = block.to(tl.int64)
        k_off = block * stride_kblock + slot * stride_kn + kv_head * stride_kh  # (BLOCK_N,)
        v_off = block * stride_vblock + slot * stride_vn + kv_head * stride_vh
    else:
        k_off = (k_start + pos).to(tl.int64) * stride_kn + kv_head * stride_kh
        v_off = (k_start + pos).to(tl.int64) * stride_vn + kv_head * stride_vh
    if MASKED:
        kv_mask = (pos < len_k)[:, None] & dim_ok[None, :]
    else:
        kv_mask = dim_ok[None, :]  # only the columns past HEAD_DIM (none when it is a power of two)
    k = tl.load(k_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit(do_not_specialize=["stride_bt"])  # (see paged_decode_kernel)
def varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_table_ptr,
    qk_scale,  # softmax_scale * log2(e), > 0
    stride_qn, stride_qh,  # q (Nq, H, D)
    stride_kblock, stride_kn, stride_kh,  # flat k (Nk, Hk, D): stride_kblock unused; paged: as in decode
    stride_vblock, stride_vn, stride_vh,  # v likewise (a view of a fused qkv output strides apart from k)
    stride_on, stride_oh,  # out (Nq, H, D)
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,  # paged, and BLOCK_N divides PAGE (the tiles start at multiples of BLOCK_N)
):  # fmt: skip
    """One program: BLOCK_T query tokens of one sequence, for all GROUP query heads that share one KV head.

    The group's heads are stacked into the tile's rows (row = token * GROUP + head in group, as in decode), so
    each K/V tile is loaded once for the whole group and every tl.dot has GROUP times more rows.
    """
    # The GPU starts programs in grid order, axis 0 fastest: the tiles of one (sequence, KV head) run side by side
    # and share its K/V through the L2 cache; the longest (latest query tokens, causal) start first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    len_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_T >= len_q:  # the grid is sized for the longest sequence
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    len_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start

    rows = tl.arange(0, BLOCK_M)
    token = m_block * BLOCK_T + rows // GROUP  # (BLOCK_M,) query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # (BLOCK_M,) query head
    row_ok = (rows < BLOCK_T * GROUP) & (token < len_q)  # BLOCK_M > BLOCK_T * GROUP when GROUP is not a power of 2
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64) * stride_qn + head * stride_qh  # (BLOCK_M,)
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = len_k - len_q + token  # bottom-right aligned: the queries are the last len_q keys' positions

    # Keys [0, full) are visible to every row of the tile: no mask. Keys [full, hi) need one: the diagonal
    # (causal) and the sequence's ragged end. Keys from hi on are never visible.
    first_pos = len_k - len_q + m_block * BLOCK_T  # the tile's first query sees keys 0 .. first_pos
    if CAUSAL:
        hi = tl.minimum(len_k, first_pos + BLOCK_T)
        full = (first_pos + 1) // BLOCK_N * BLOCK_N
    else:
        hi = len_k
        full = len_k // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, full, BLOCK_N):
        k, v = _load_kv_tile(
            k_ptr, v_ptr, block_table_ptr, seq, k_start, kv_head, n0, len_k, dims, dim_ok,
            stride_kblock, stride_kn, stride_kh, stride_vblock, stride_vn, stride_vh, stride_bt,
            BLOCK_N, PAGED, PAGE, False, TILE_IN_PAGE,
        )  # fmt: skip
        m_i, l_i, acc = _attend_full_tile(q, k, v, qk_scale, m_i, l_i, acc, PRECISION)
    for n0 in range(full, hi, BLOCK_N):
        k, v = _load_kv_tile(
            k_ptr, v_ptr, block_table_ptr, seq, k_start, kv_head, n0, len_k, dims, dim_ok,
            stride_kblock, stride_kn, stride_kh, stride_vblock, stride_vn, stride_vh, stride_bt,
            BLOCK_N, PAGED, PAGE, True, TILE_IN_PAGE,
        )  # fmt: skip
        pos = n0 + tl.arange(0, BLOCK_N)
        visible = (pos < len_k)[None, :]  # (1, BLOCK_N)
        if CAUSAL:  # query i sees keys up to position len_k - len_q + i
            visible = visible & (pos[None, :] <= q_pos[:, None])  # (BLOCK_M, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_rows = (q_start + token).to(tl.int64) * stride_on + head * stride_oh
    tl.store(
        out_ptr + out_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


# -- launchers ------------------------------------------------------------------------------------


def _dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast to float32 before tl.dot, tl.dot input precision)."""
    # float32 on a GPU: "ieee", not the default TF32, so float32 results match the torch reference
    return interpreting(), "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# Decode programs one SM runs at once, as choose_num_splits counts them. What fits depends on the tiles (an H100's
# compile, triton 3.6: 128-key bf16 tiles 166 registers x 128 threads and 72 KB of shared memory, three an SM; 8-bit
# tiles two, or four in 2 warps; benchmarks/kernel_bench.py --compare prints them). Counting more than fit
# oversubscribes the SMs on purpose: on an H100 over mixed contexts, with decode_launch's tiles, 4 beat 8 by 3-5% at
# 48-64 sequences (16 tied or lost), and lost to 8 by 6-13% at 32 sequences and 1-5% below, where a step is short and
# more, shorter splits hide the loads' latency (benchmarks/results/kernels_launch_h100.md, bf16 and fp8 caches). So
# a batch of at most SMALL_BATCH_PROGRAMS_PER_SM programs an SM (Qwen3's 8 KV heads on 132 SMs: up to 33 sequences,
# so the decode graph buckets 32 and 48 fall on the measured sides) counts DECODE_PROGRAMS_PER_SM_SMALL, and a
# larger one DECODE_PROGRAMS_PER_SM.
DECODE_PROGRAMS_PER_SM = 4
DECODE_PROGRAMS_PER_SM_SMALL = 8
SMALL_BATCH_PROGRAMS_PER_SM = 2

# Cascade attention's shared-prefix pass (shared_prefix_kernel): query rows per program (sequences x query tokens x
# the GQA group's heads; 128 was slower at every batch on an H100, benchmarks/results/kernels_cascade_h100.md), and
# at most this many splits of the prefix, chosen so that its programs fill the SMs once
PREFIX_ROWS = 64
MAX_PREFIX_SPLITS = 16


def decode_programs_per_sm(programs: int, num_sms: int) -> int:
    """Decode programs an SM is counted to run at once, for a batch of `programs` (sequences x KV heads)."""
    small = programs <= SMALL_BATCH_PROGRAMS_PER_SM * num_sms
    return DECODE_PROGRAMS_PER_SM_SMALL if small else DECODE_PROGRAMS_PER_SM


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, num_sms: int, block_n: int, min_split_len: int = 64
) -> int:
    """Splits per sequence so that the (batch * kv_heads * splits) programs fill the GPU in one wave.

    A small batch makes few programs (one per sequence and KV head): most SMs idle, and each program walks
    its whole context one tile after another, a chain of memory round trips. Splits run side by side
    shorten the chain and fill the SMs, for the fixed price of one merge launch. The count is rounded
    down to what the GPU is counted to run at once (`decode_programs_per_sm` per SM): one program more would
    start a second wave that the whole step waits for. Each split keeps at least one tile (min_split_len or block_n
    tokens, whichever is more; on an H200 a sweep of every split count found one-tile splits the fastest at every
    small-batch shape once the one-wave cap holds: benchmarks/results/kernels_compare_h200.md), and there are at
    most 64 (the merge loads them all in one tile).
    Depends only on shapes (not on the lengths in cache_seqlens), so a CUDA graph can capture it.
    """
    programs = batch * num_kv_heads
    fit = max(1, decode_programs_per_sm(programs, num_sms) * num_sms // programs)
    return max(1, min(fit, max_context // max(min_split_len, block_n), 64))


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split-KV partial outputs into out, weighting each split by its share of the softmax.

    partial: (B, S, Lq, H, D) float32, each split's output normalised over its own keys; lse: (B, S, Lq, H)
    float32, each split's log-sum-exp in base 2 (-inf for a split that saw no key); out: (B, Lq, H, D), written.
    """
    batch, num_splits, len_q, num_heads, head_dim = partial.shape
    merge_splits_kernel[(batch, len_q * num_heads)](
        partial, lse, out,
        num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), partial.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip


def decode_schedule(cache_seqlens: torch.Tensor) -> torch.Tensor:
    """(B,) int64: the batch's sequences longest context first, the order `paged_decode_attention` starts them.

    A decode step's programs (one per sequence and KV head) outnumber what the SMs run at once, and each takes
    time in proportion to its context. In batch order a long sequence can start last and run on alone while
    the other SMs idle; started longest first, the last programs to start are the shortest (longest-processing-
    time-first scheduling), and the step ends when the bytes are read. One small sort per step, on the device
    (so a CUDA graph replays it)."""
    return torch.argsort(cache_seqlens, descending=True)


def decode_launch(batch: int, cache_dtype: torch.dtype) -> Launch:
    """The decode kernel's tiles for `batch` sequences over a cache of `cache_dtype` (see DECODE_LAUNCH).

    Shapes only, so each decode CUDA graph (one per batch bucket) captures its own."""
    if interpreting():
        return INTERPRETER_LAUNCH
    if cache_dtype.itemsize == 1:  # kv_cache_dtype="fp8"
        return DECODE_LAUNCH_8BIT_WIDE if batch >= DECODE_8BIT_WIDE_BATCH else DECODE_LAUNCH_8BIT
    return DECODE_LAUNCH if cache_dtype.itemsize == 2 else DECODE_LAUNCH_FP32


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    num_splits: int = 0,
    scheduler_metadata: torch.Tensor | None = None,
    shared_prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (B, Lq, H, D); caches: (num_blocks, block_size, Hk, D); cache_seqlens: (B,). -> (B, Lq, H, D).

    num_splits: as in flash-attn, 0 picks a split count from the shapes; 1 turns splitting off.
    scheduler_metadata: (B,) int, a permutation of the batch: the order in which the sequences' programs start
    (`decode_schedule(cache_seqlens)`: longest context first). Computed once per step and shared by the layers,
    as flash-attn 3's `scheduler_metadata`; it changes the speed, never the result. None: batch order.
    shared_prefix_lens: (B,) int32: cascade attention (vLLM's name for it; FlashInfer's "cascade inference").
    P for each sequence whose first P keys are one shared run of cached tokens (the same blocks in its block table
    as in the others': a system prompt the prefix cache shares), 0 for the others; P must not pass any of those
    sequences' first query. `shared_prefix_kernel` reads those keys once for up to PREFIX_ROWS query rows at a
    time, this kernel each sequence's keys after them, and the merge joins the two by their log-sum-exps: the same
    result, with the prefix's bytes read about B / 32 times fewer (Qwen3-0.6B's GQA). A tensor, so that a CUDA
    graph replays it with each step's values (all 0: no shared prefix; the passes still run).
    """
    batch, len_q, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]  # (num_blocks, block_size, Hk, D)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q, k_cache and v_cache need a contiguous last axis, and the caches equal strides")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    group = num_heads // num_kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    upcast, precision = _dot_settings(q.dtype)
    eight_bit = k_cache.element_size() == 1  # kv_cache_dtype="fp8"
    launch = decode_launch(batch, k_cache.dtype)
    block_n = launch.block_n
    max_context = block_table.shape[1] * page
    if num_splits <= 0:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, _num_sms(q.device), block_n)
    split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, split_len)

    out = torch.empty_like(q)  # (B, Lq, H, D)
    cascade = shared_prefix_lens is not None
    if cascade:
        prefix = shared_prefix_lens
        if prefix.shape != (batch,) or prefix.dtype != torch.int32 or prefix.device != q.device:
            raise ValueError(
                f"shared_prefix_lens must be ({batch},) int32 on {q.device}, got {tuple(prefix.shape)} "
                f"{prefix.dtype} on {prefix.device}"
            )
        prefix_launch = INTERPRETER_LAUNCH if interpreting() else PREFIX_LAUNCH_8BIT if eight_bit else PREFIX_LAUNCH
        seqs_per_tile = max(1, PREFIX_ROWS // (len_q * group))
        tiles = triton.cdiv(batch, seqs_per_tile)
        prefix_splits = max(1, min(_num_sms(q.device) // (tiles * num_kv_heads), MAX_PREFIX_SPLITS))
    else:
        prefix_splits = 0
    if num_splits == 1 and not cascade:
        partial = out.unsqueeze(1)  # (B, 1, Lq, H, D): the one split writes the answer directly
    else:  # (B, S, Lq, H, D): the shared prefix's splits first, then each sequence's own
        partial = torch.empty(
            batch, prefix_splits + num_splits, len_q, num_heads, head_dim, device=q.device, dtype=torch.float32
        )
    lse = torch.empty(batch, prefix_splits + num_splits, len_q, num_heads, device=q.device, dtype=torch.float32)
    wide_f16 = eight_bit and not upcast and q.dtype in (torch.bfloat16, torch.float16)
    if cascade:
        shared_prefix_kernel[(num_kv_heads, tiles, prefix_splits)](
            q, k_cache, v_cache, block_table, shared_prefix_lens, partial, lse,
            scale * LOG2E,
            batch,
            block_table.stride(0),
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            partial.stride(0), partial.stride(1), partial.stride(2), partial.stride(3),
            lse.stride(0), lse.stride(1), lse.stride(2),
            LEN_Q=len_q, GROUP=group, SEQS=seqs_per_tile,
            BLOCK_M=max(16, triton.next_power_of_2(seqs_per_tile * len_q * group)),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page, BLOCK_N=prefix_launch.block_n,
            UPCAST=upcast, PRECISION=precision, WIDE_F16=wide_f16, TILE_IN_PAGE=page % prefix_launch.block_n == 0,
            num_warps=prefix_launch.num_warps, num_stages=prefix_launch.num_stages,
        )  # fmt: skip
    suffix, suffix_lse = partial[:, prefix_splits:], lse[:, prefix_splits:]  # (views: each sequence's own splits)
    ordered = scheduler_metadata is not None
    if ordered and (
        scheduler_metadata.shape != (batch,)
        or scheduler_metadata.dtype not in (torch.int32, torch.int64)
        or scheduler_metadata.device != q.device
    ):
        raise ValueError(
            f"scheduler_metadata must be ({batch},) int32 or int64 on {q.device}, a permutation of the batch "
            f"(decode_schedule's), got {tuple(scheduler_metadata.shape)} {scheduler_metadata.dtype} on "
            f"{scheduler_metadata.device}"
        )
    paged_decode_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, block_table, cache_seqlens, suffix, suffix_lse,
        scheduler_metadata if ordered else cache_seqlens,  # (never read without ORDERED)
        shared_prefix_lens if cascade else cache_seqlens,  # (never read without SKIP_PREFIX)
        scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        suffix.stride(0), suffix.stride(1), suffix.stride(2), suffix.stride(3),
        suffix_lse.stride(0), suffix_lse.stride(1), suffix_lse.stride(2),
        split_len,
        LEN_Q=len_q, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(len_q * group)),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page, BLOCK_N=block_n,
        CAUSAL=causal, UPCAST=upcast, PRECISION=precision, ORDERED=ordered, WIDE_F16=wide_f16, SKIP_PREFIX=cascade,
        TILE_IN_PAGE=page % block_n == 0 and not cascade,  # (a shared prefix may end mid-tile)
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if partial.shape[1] > 1:
        seam("merge_splits", merge_splits)(partial, lse, out)
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    block_table: torch.Tensor | None = None,
    *,
    launch: Launch | None = None,
) -> torch.Tensor:
    """q: (Nq, H, D). Without block_table k, v: (Nk, Hk, D) flat; with it, paged caches. -> (Nq, H, D).

    launch: tile settings (default PREFILL_LAUNCH, or INTERPRETER_LAUNCH on a CPU); its block_m counts tile
    rows, which hold block_m // group query tokens times the group's query heads.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last axis (head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if scale <= 0:
        raise ValueError(f"softmax_scale must be positive, got {scale}")
    upcast, precision = _dot_settings(q.dtype)
    launch = launch or (INTERPRETER_LAUNCH if interpreting() else PREFILL_LAUNCH)
    paged = block_table is not None
    if paged:  # (num_blocks, block_size, Hk, D)
        page, k_strides, v_strides = k.shape[1], k.stride()[:3], v.stride()[:3]
        stride_bt = block_table.stride(0)
    else:  # (Nk, Hk, D): no block axis
        page, k_strides, v_strides = 1, (0, *k.stride()[:2]), (0, *v.stride()[:2])
        stride_bt, block_table = 0, cu_seqlens_k  # never read; any int tensor fills the pointer slot
    group = num_heads // num_kv_heads
    block_t = max(1, launch.block_m // group)  # query tokens per tile
    block_m = max(16, triton.next_power_of_2(block_t * group))  # tile rows; tl.dot wants at least 16
    out = torch.empty_like(q)
    batch = cu_seqlens_q.numel() - 1
    grid = (triton.cdiv(max_seqlen_q, block_t), num_kv_heads, batch)
    varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_table,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        *k_strides,
        *v_strides,
        out.stride(0), out.stride(1),
        stride_bt,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_N=launch.block_n, PAGED=paged, PAGE=page,
        CAUSAL=causal, UPCAST=upcast, PRECISION=precision, TILE_IN_PAGE=paged and page % launch.block_n == 0,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return out
