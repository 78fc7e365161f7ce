"""Kernel benchmark: the Triton KV store and paged decode attention against the copy bandwidth and peers.

    python benchmarks/kernel_bench.py                       # on a CUDA GPU: check, then time, table + figure
    python benchmarks/kernel_bench.py --sweep               # first sweep the kernels' tile settings (--sweep-prefill)
    python benchmarks/kernel_bench.py --plot benchmarks/results/kernels_h200.json   # anywhere: redraw the figure
    python benchmarks/kernel_bench.py --compare OLD.py      # the kernels of an older attention_triton.py vs the current
    python benchmarks/kernel_bench.py --mixed OUT.md        # decode over mixed contexts: batch order vs longest first
    python benchmarks/kernel_bench.py --mixed OUT.md --baseline OLD.py   # ... beside an older kernel (bf16 and fp8)
    python benchmarks/kernel_bench.py --cascade OUT.md --batches 64,48,32   # decode over a prefix every sequence shares

OLD.py is nanoref/ops/attention_triton.py as an older commit had it, e.g.
`git show 177e2ae:nanoref/ops/attention_triton.py > /tmp/old_attention_triton.py`.

1. Checks correctness on the GPU (Triton against the torch reference and the naive padded oracle).
2. Measures the device-to-device copy bandwidth (bytes read + written per second): the ceiling.
3. Times with `triton.testing.do_bench` (median) at Qwen3-0.6B's attention shapes (16 query heads,
   8 KV heads, head_dim 128, bf16):
   - store_kvcache: N tokens' K and V rows into random slots; bytes = read + written.
   - paged decode attention: batch B, every sequence `ctx` tokens long, its blocks scattered at random
     in the cache (block sizes 16 and 256); bytes = the K/V read (q and the output are negligible).
   - peers: PyTorch SDPA after gathering each sequence's pages into padded `(B, Hk, ctx, D)` K/V (the
     same problem), and, as yardsticks on an easier problem, SDPA and compiled FlexAttention over such
     contiguous tensors ready-made (no paging; FlexAttention's paged form is still experimental).
   - varlen causal prefill (equal-length sequences, no history): TFLOP/s against SDPA with is_causal.
4. Prints the tables, writes the measurements as JSON (`--json`) and as markdown (`--markdown`), and draws the
   figure from them (`--figure`); `--plot JSON` redraws it from a JSON file, without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanoref.ops import attention_torch, naive_padded_attention, store_kvcache_torch  # noqa: E402
from nanoref.ops import attention_triton as tri  # noqa: E402
from nanoref.ops.store_kvcache_triton import store_kvcache_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16
ROW_BYTES = KV_HEADS * HEAD_DIM * 2  # one token's K (or V) in bf16


def bench(fn) -> float:
    """Median milliseconds of one call of fn, replayed from a CUDA graph (as the engine's decode runs).

    The graph takes Python and launch overhead out: tens of microseconds that would otherwise swamp
    the small problems and say nothing about the kernels. `do_bench` flushes the L2 cache between calls.
    """
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (TB/s).

    Timed without a graph: a captured copy_ becomes a memcpy node, served by the slower copy engines.
    """
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e9


def mixed_problem(batch: int, lens: torch.Tensor, block_size: int, heads: int, width_ctx: int = 4096, seed: int = 0):
    """A paged cache of `batch` sequences of the given lengths (B,), block tables `width_ctx` tokens wide (a decode
    graph's are sized for max_model_len), blocks scattered at random; `heads` query heads."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = width_ctx // block_size
    num_blocks = batch * width
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device="cuda", generator=g).view(batch, width).int()
    q = torch.randn(batch, 1, heads, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)  # (B, 1, H, D)
    return q, k_cache, v_cache, block_table, lens.to(device="cuda", dtype=torch.int32)


def paged_problem(batch: int, ctx: int, block_size: int, seed: int = 0):
    """A paged cache holding `batch` sequences of `ctx` tokens in randomly scattered blocks."""
    width_ctx = math.ceil(ctx / block_size) * block_size
    return mixed_problem(batch, torch.full((batch,), ctx), block_size, HEADS, width_ctx, seed)


def dense_from_paged(k_cache, block_table, ctx):
    """(B, Hk, ctx, D) contiguous: what SDPA and dense FlexAttention read."""
    blocks = k_cache[block_table.long()]  # (B, blocks, block_size, Hk, D)
    return blocks.flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()


# -- 1. correctness --------------------------------------------------------------------------------


def check_correctness() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [1, 15, 16, 17, 300, 1029, 4000]  # not multiples of the block sizes, and exact multiples
    for block_size in (16, 256):
        blocks = [math.ceil(n / block_size) for n in lens]
        num_blocks = sum(blocks) + 5
        k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        v_cache = torch.randn_like(k_cache)
        order = torch.randperm(num_blocks, device="cuda", generator=g)
        block_table = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32, device="cuda")
        used = 0
        for b, nb in enumerate(blocks):
            block_table[b, :nb] = order[used : used + nb]
            used += nb
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        k_flat = torch.cat([attention_torch.gather_paged(k_cache, block_table[b], n) for b, n in enumerate(lens)])
        v_flat = torch.cat([attention_torch.gather_paged(v_cache, block_table[b], n) for b, n in enumerate(lens)])
        cu = lambda xs: torch.tensor([0, *itertools.accumulate(xs)], dtype=torch.int32, device="cuda")
        oracle = naive_padded_attention(q.squeeze(1), k_flat, v_flat, cu([1] * len(lens)), cu(lens))  # (B, H, D)
        reference = attention_torch.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table)
        for splits in (0, 1, 4):
            out = tri.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table, num_splits=splits)
            torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out.squeeze(1).float(), oracle.float(), atol=2e-2, rtol=2e-2)
        q_lens = [1, 15, 3, 17, 300, 29, 1000]
        qp = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        args = (cu(q_lens), cu(lens), max(q_lens), max(lens))
        out = tri.varlen_attention(qp, k_cache, v_cache, *args, block_table=block_table)
        oracle = naive_padded_attention(qp, k_flat, v_flat, cu(q_lens), cu(lens))
        torch.testing.assert_close(out.float(), oracle.float(), atol=2e-2, rtol=2e-2)
        key, value = (torch.randn(500, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g) for _ in "kv")
        slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:500]
        slots[::7] = -1
        caches = [k_cache.clone() for _ in range(4)]
        store_kvcache_triton(key, value, caches[0], caches[1], slots)
        store_kvcache_torch(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    print("correctness on the GPU: paged decode (splits auto/1/4), paged varlen prefill, store_kvcache: OK")


# -- 2.-3. timing ---------------------------------------------------------------------------------


def time_store(num_tokens: int) -> dict:
    num_blocks = max(64, 2 * num_tokens // 16)
    k_cache = torch.zeros(num_blocks, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    key, value = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in "kv")
    slots = torch.randperm(num_blocks * 16, device="cuda")[:num_tokens]
    moved = 2 * 2 * num_tokens * ROW_BYTES  # K and V, read and written
    triton_ms = bench(lambda: store_kvcache_triton(key, value, k_cache, v_cache, slots))
    torch_ms = bench(lambda: store_kvcache_torch(key, value, k_cache, v_cache, slots))
    return dict(
        tokens=num_tokens, MB=moved / 1e6, triton_us=triton_ms * 1e3, triton_TBps=moved / triton_ms / 1e9,
        torch_us=torch_ms * 1e3, torch_TBps=moved / torch_ms / 1e9,
    )  # fmt: skip


def triton_decode_ms(problem) -> float:
    q, k_cache, v_cache, block_table, seqlens = problem
    return bench(lambda: tri.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table))


_flex = None


def flex_attention_compiled():
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex = torch.compile(flex_attention)
    return _flex


def time_decode(batch: int, ctx: int, block_sizes=(16, 256), peers: bool = True) -> list[dict]:
    rows = []
    kv_bytes = 2 * batch * ctx * ROW_BYTES  # K and V read once

    def add(method: str, ms: float, **extra) -> None:
        rows.append(dict(method=method, batch=batch, ctx=ctx, us=ms * 1e3, TBps=kv_bytes / ms / 1e9, **extra))

    dense = None
    for block_size in block_sizes:
        problem = paged_problem(batch, ctx, block_size)
        q, k_cache, v_cache, block_table, _ = problem
        ms = triton_decode_ms(problem)
        max_context = block_table.shape[1] * block_size
        block_n = tri.decode_launch(batch, DTYPE).block_n
        splits = tri.choose_num_splits(batch, KV_HEADS, max_context, tri._num_sms(q.device), block_n)
        add(f"triton paged, block {block_size}", ms, splits=splits)
        if dense is None and peers:
            k = dense_from_paged(k_cache, block_table, ctx)  # (B, Hk, ctx, D)
            v = dense_from_paged(v_cache, block_table, ctx)
            dense = (q.transpose(1, 2).contiguous(), k, v)  # q: (B, H, 1, D)
        del problem, k_cache, v_cache  # free the paged cache before the next block size's
    if peers:
        qd, k, v = dense
        problem = paged_problem(batch, ctx, 16)

        def gather_then_sdpa(q, k_cache, v_cache, block_table, seqlens):
            k = dense_from_paged(k_cache, block_table, ctx)  # (B, Hk, ctx, D)
            v = dense_from_paged(v_cache, block_table, ctx)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)

        ms = bench(lambda: gather_then_sdpa(*problem))
        add("SDPA, gathered from pages", ms)
        del problem
        ms = bench(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))
        add("SDPA, dense (no paging)", ms)
        flex = flex_attention_compiled()
        flex(qd, k, v, enable_gqa=True)  # compile outside the timing
        ms = bench(lambda: flex(qd, k, v, enable_gqa=True))
        add("FlexAttention, dense (no paging)", ms)
    torch.cuda.empty_cache()
    return rows


def mixed_methods(problem, baseline, flash_attn_with_kvcache) -> dict:
    """The decode calls time_mixed_decode times on one problem, checked first against the torch reference."""
    q, k_cache, v_cache, table, seqlens = problem
    longest_first = tri.decode_schedule(seqlens)
    expected = attention_torch.paged_decode_attention(q, k_cache, v_cache, seqlens, table)
    got = tri.paged_decode_attention(q, k_cache, v_cache, seqlens, table, scheduler_metadata=longest_first)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    methods = {
        "triton, batch order": lambda: tri.paged_decode_attention(q, k_cache, v_cache, seqlens, table),
        "triton, longest first": lambda: tri.paged_decode_attention(
            q, k_cache, v_cache, seqlens, table, scheduler_metadata=longest_first
        ),
        "triton, longest first, sorted in the call": lambda: tri.paged_decode_attention(
            q, k_cache, v_cache, seqlens, table, scheduler_metadata=tri.decode_schedule(seqlens)
        ),
    }
    # kv_cache_dtype="fp8": the same K/V as 8-bit floats, half the bytes (checked against the reference on them)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    expected8 = attention_torch.paged_decode_attention(q, k8, v8, seqlens, table)
    got8 = tri.paged_decode_attention(q, k8, v8, seqlens, table, scheduler_metadata=longest_first)
    torch.testing.assert_close(got8.float(), expected8.float(), atol=2e-2, rtol=2e-2)
    methods["triton, fp8 cache, longest first"] = lambda: tri.paged_decode_attention(
        q, k8, v8, seqlens, table, scheduler_metadata=longest_first
    )
    # the 16-bit tiles before DECODE_LAUNCH's 128 keys
    launch = dataclasses.replace(tri.DECODE_LAUNCH, block_n=64)
    methods["triton, longest first, block_n 64"] = functools.partial(
        with_decode_launch, launch, tri.paged_decode_attention, q, k_cache, v_cache, seqlens, table,
        scheduler_metadata=longest_first,
    )  # fmt: skip
    # beside decode_launch's 8-bit tiles (128 keys in 4 warps, 2 stages; 64 in 2 warps from DECODE_8BIT_WIDE_BATCH)
    for block_n, stages in ((32, 2), (64, 2), (128, 3)):
        launch = dataclasses.replace(tri.DECODE_LAUNCH_8BIT, block_n=block_n, num_stages=stages)
        got8 = with_decode_launch(launch, tri.paged_decode_attention, q, k8, v8, seqlens, table)
        torch.testing.assert_close(got8.float(), expected8.float(), atol=2e-2, rtol=2e-2)
        methods[f"triton, fp8 cache, longest first, block_n {block_n} stages {stages}"] = functools.partial(
            with_decode_launch, launch, tri.paged_decode_attention, q, k8, v8, seqlens, table,
            scheduler_metadata=longest_first,
        )  # fmt: skip
    if baseline is not None:
        methods["baseline kernel, batch order"] = lambda: baseline.paged_decode_attention(
            q, k_cache, v_cache, seqlens, table
        )
        if "scheduler_metadata" in inspect.signature(baseline.paged_decode_attention).parameters:
            methods["baseline kernel, longest first"] = lambda: baseline.paged_decode_attention(
                q, k_cache, v_cache, seqlens, table, scheduler_metadata=longest_first
            )
            methods["baseline kernel, fp8 cache, longest first"] = lambda: baseline.paged_decode_attention(
                q, k8, v8, seqlens, table, scheduler_metadata=longest_first
            )
    if flash_attn_with_kvcache is not None and k_cache.shape[1] % 256 == 0:
        methods["flash-attn"] = lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True
        )
    return methods


def with_decode_launch(launch, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the decode kernel's tile settings set to `launch` (any batch, any cache dtype)."""
    saved = tri.decode_launch
    tri.decode_launch = lambda batch, cache_dtype: launch
    try:
        return fn(*args, **kwargs)
    finally:
        tri.decode_launch = saved


def time_mixed_decode(copy_tbps: float, baseline_path: Path | None) -> list[dict]:
    """Decode over a batch of mixed contexts (101-2,048 tokens, as a run of Nano-vLLM's workload has mid-way), in
    batch order and longest first (`scheduler_metadata`), beside flash-attn where installed and an older kernel
    (`--baseline`). Each sequence's programs take time in proportion to its context: the order decides how
    evenly the SMs end the step."""
    baseline = load_baseline(baseline_path) if baseline_path else None
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    rows = []
    # Qwen3-0.6B's and -8B's query heads; batch 16: too few programs for one wave, so contexts are split
    for heads, batch in itertools.product((16, 32), (256, 128, 64, 16)):
        lens = torch.randint(101, 2049, (batch,), generator=torch.Generator().manual_seed(batch))
        kv_bytes = 2 * int(lens.sum()) * ROW_BYTES
        for block_size in (16, 256) if heads == 16 else (256,):
            problem = mixed_problem(batch, lens, block_size, heads)
            for method, fn in mixed_methods(problem, baseline, flash_attn_with_kvcache).items():
                ms = bench(fn)
                tbps = kv_bytes / (2 if "fp8" in method else 1) / ms / 1e9  # the bytes it really read
                rows.append(dict(heads=heads, batch=batch, block=block_size, method=method, us=ms * 1e3, TBps=tbps,
                                 of_copy=tbps / copy_tbps))  # fmt: skip
                print(f"  H {heads} batch {batch} block {block_size} {method}: {ms * 1e3:.1f} us, {tbps:.2f} TB/s")
            del problem
            torch.cuda.empty_cache()
    return rows


def with_prefix_rows(rows: int, fn):
    """fn() with the cascade prefix pass's tile at `rows` query rows."""
    saved, tri.PREFIX_ROWS = tri.PREFIX_ROWS, rows
    try:
        return fn()
    finally:
        tri.PREFIX_ROWS = saved


def time_cascade_decode(copy_tbps: float, batches=(256, 128, 64, 16, 8), prefix: int = 1024) -> list[dict]:
    """Decode where every sequence starts with the same `prefix` cached tokens (a system prompt the prefix cache
    shares: the same blocks in every table) and then has 101-2,048 of its own: plain decode (each sequence reads the
    prefix, mostly from the L2 cache after the first), cascade attention (`shared_prefix_lens`: the prefix read once
    per 64 query rows), plain decode over the sequences' own tokens alone (what the prefix costs on top), and
    flash-attn beside. Checked against the torch reference first."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    rows = []
    for batch, block_size in itertools.product(batches, (16, 256)):
        own = torch.randint(101, 2049, (batch,), generator=torch.Generator().manual_seed(batch))
        q, k_cache, v_cache, table, seqlens = mixed_problem(batch, own + prefix, block_size, HEADS)
        shared_blocks = prefix // block_size
        table[:, :shared_blocks] = table[0, :shared_blocks]  # every sequence's prefix in row 0's blocks
        prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device="cuda")
        order = tri.decode_schedule(seqlens)
        expected = attention_torch.paged_decode_attention(q, k_cache, v_cache, seqlens, table)
        got = tri.paged_decode_attention(
            q, k_cache, v_cache, seqlens, table, scheduler_metadata=order, shared_prefix_lens=prefix_lens
        )
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
        own_table = table[:, shared_blocks:].contiguous()  # the sequences' own tokens as if they had no prefix
        own_lens = seqlens - prefix
        decode = functools.partial(tri.paged_decode_attention, q, k_cache, v_cache)
        methods = {
            "plain": functools.partial(decode, seqlens, table, scheduler_metadata=order),
            "cascade": functools.partial(
                decode, seqlens, table, scheduler_metadata=order, shared_prefix_lens=prefix_lens
            ),
            "own tokens only": functools.partial(
                decode, own_lens, own_table, scheduler_metadata=tri.decode_schedule(own_lens)
            ),
        }
        methods["cascade, 128 query rows a prefix program"] = functools.partial(
            with_prefix_rows, 128, methods["cascade"]
        )  # (PREFIX_ROWS: the prefix pass's tile height)
        if flash_attn_with_kvcache is not None and block_size % 256 == 0:
            methods["flash-attn"] = functools.partial(
                flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True
            )
        own_bytes = 2 * int(own.sum()) * ROW_BYTES  # the K/V only one sequence reads
        for method, fn in methods.items():
            ms = bench(fn)
            rows.append(dict(batch=batch, block=block_size, method=method, us=ms * 1e3,
                             own_TBps=own_bytes / ms / 1e9))  # fmt: skip
            print(f"  batch {batch} block {block_size} {method}: {ms * 1e3:.1f} us")
        del q, k_cache, v_cache, table, decode, methods
        torch.cuda.empty_cache()
    return rows


def sweep_decode_launch() -> None:
    """Try tile settings at the headline shapes; keep the best for the timings that follow."""
    candidates = [
        tri.Launch(block_n=n, num_warps=w, num_stages=s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
    ]
    shapes = [(64, 1024), (64, 4096), (256, 1024), (256, 4096), (4, 4096)]
    problems = {(b, c, bs): paged_problem(b, c, bs) for b, c in shapes for bs in (16, 256)}
    best, best_score = None, -1.0
    print("\ndecode tile sweep (TB/s of K/V read; geometric mean over shapes and block sizes)")
    for launch in candidates:
        tri.DECODE_LAUNCH = launch
        rates = []
        for (b, c, _bs), problem in problems.items():
            ms = triton_decode_ms(problem)
            rates.append(2 * b * c * ROW_BYTES / ms / 1e9)
        score = math.exp(sum(map(math.log, rates)) / len(rates))
        print(f"  {launch}: {score:.2f}  (min {min(rates):.2f}, max {max(rates):.2f})")
        if score > best_score:
            best, best_score = launch, score
    tri.DECODE_LAUNCH = best
    print(f"  best: {best}")
    del problems
    torch.cuda.empty_cache()


PREFILL_SHAPES = [(1, 4096), (4, 1024), (16, 1024), (64, 256), (16, 4096)]  # (sequences, tokens each)


def prefill_problem(batch: int, seqlen: int, seed: int = 0):
    """Flat varlen inputs for `batch` causal sequences of `seqlen` tokens, and their padded SDPA view."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = batch * seqlen
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)  # (N, H, D)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g) for _ in "kv")  # (N, Hk, D)
    cu = torch.arange(0, n + 1, seqlen, dtype=torch.int32, device="cuda")
    return q, k, v, cu, seqlen


def causal_flops(batch: int, seqlen: int) -> float:
    return 4 * batch * HEADS * HEAD_DIM * seqlen * (seqlen + 1) / 2  # QK^T and PV over the causal half


def triton_prefill(problem):
    q, k, v, cu, seqlen = problem
    return tri.varlen_attention(q, k, v, cu, cu, seqlen, seqlen, causal=True)


def sdpa_prefill(problem):
    q, k, v, cu, seqlen = problem
    batch = cu.numel() - 1
    to_heads = lambda x: x.view(batch, seqlen, -1, HEAD_DIM).transpose(1, 2)  # (B, heads, L, D), a view
    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)  # (N, H, D)


def time_prefill() -> list[dict]:
    rows = []
    for batch, seqlen in PREFILL_SHAPES:
        problem = prefill_problem(batch, seqlen)
        flops = causal_flops(batch, seqlen)
        row = dict(sequences=batch, tokens_each=seqlen)
        for name, fn in (("triton", triton_prefill), ("sdpa", sdpa_prefill)):
            ms = bench(lambda fn=fn, problem=problem: fn(problem))
            row[f"{name}_us"], row[f"{name}_TFLOPs"] = ms * 1e3, flops / ms / 1e9
        rows.append(row)
    return rows


def sweep_prefill_launch() -> None:
    """Try prefill tile settings (each checked against SDPA first); keep the fastest correct one."""
    candidates = PREFILL_CANDIDATES
    problems = [prefill_problem(b, L) for b, L in PREFILL_SHAPES]
    expected = sdpa_prefill(problems[1])
    best, best_score = None, -1.0
    print("\nprefill tile sweep (TFLOP/s, geometric mean over shapes)")
    for launch in candidates:
        tri.PREFILL_LAUNCH = launch
        try:
            error = (triton_prefill(problems[1]).float() - expected.float()).abs().max().item()
        except Exception as failure:  # e.g. out of shared memory for the biggest tiles
            print(f"  {launch}: failed ({type(failure).__name__})")
            continue
        if error > 2e-2:
            print(f"  {launch}: wrong (max error {error:.3g})")
            continue
        rates = [causal_flops(p[3].numel() - 1, p[4]) / bench(lambda p=p: triton_prefill(p)) / 1e9 for p in problems]
        score = math.exp(sum(map(math.log, rates)) / len(rates))
        print(f"  {launch}: {score:.0f}  (min {min(rates):.0f}, max {max(rates):.0f})")
        if score > best_score:
            best, best_score = launch, score
    tri.PREFILL_LAUNCH = best
    print(f"  best: {best}")


# -- old kernels against new (--compare) --------------------------------------------------------------


def load_baseline(path: Path):
    """An older nanoref/ops/attention_triton.py (from git history), imported under its own name."""
    import importlib.util

    name = "baseline_attention_triton"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: its dataclass looks its module up
        spec.loader.exec_module(module)
    return sys.modules[name]


PREFILL_CANDIDATES = [  # (tile rows = tokens x GQA heads, keys per tile, warps, stages); the default first
    tri.PREFILL_LAUNCH,
    tri.Launch(block_m=128, block_n=64, num_warps=8, num_stages=2),
    tri.Launch(block_m=128, block_n=64, num_warps=8, num_stages=4),
    tri.Launch(block_m=128, block_n=128, num_warps=8, num_stages=2),
    # 64 rows in 4 warps: half the registers and shared memory, so two programs share an SM and overlap
    tri.Launch(block_m=64, block_n=64, num_warps=4, num_stages=3),
    tri.Launch(block_m=64, block_n=64, num_warps=4, num_stages=2),
]  # 128 rows in 4 warps, or 256 rows, spill registers (sm_90 compile)


def check_prefill_gqa() -> None:
    """The new prefill at GQA 1, 2 and 4 on ragged lengths (GQA 2 in every candidate tiling) against the oracle."""
    g = torch.Generator(device="cuda").manual_seed(2)
    lens = [1, 63, 64, 65, 200, 1000]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    for heads, kv_heads in ((8, 8), (16, 8), (16, 4)):
        q = torch.randn(sum(lens), heads, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        k, v = (torch.randn(sum(lens), kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g) for _ in "kv")
        oracle = naive_padded_attention(q, k, v, cu, cu)
        for launch in PREFILL_CANDIDATES if heads == 2 * kv_heads else PREFILL_CANDIDATES[:1]:  # few compiles
            out = tri.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), launch=launch)
            torch.testing.assert_close(out.float(), oracle.float(), atol=2e-2, rtol=2e-2)
    print("correctness on the GPU: GQA-stacked prefill, GQA 1/2/4 (GQA 2 in every candidate tiling): OK")


def percent(part: float, whole: float) -> str:
    return f"{100 * whole / part:.0f}%"  # part and whole are times: the share of SDPA's speed


def new_prefill(problem, launch: tri.Launch | None, module=tri):
    """The prefill problem through `module`'s varlen_attention (the old one takes no launch settings)."""
    q, k, v, cu, seqlen = problem
    extra = {} if launch is None else dict(launch=launch)
    return module.varlen_attention(q, k, v, cu, cu, seqlen, seqlen, causal=True, **extra)


def compare_prefill(old_path: Path) -> tuple[str, str]:
    """Old prefill vs new (default tiles, and the sweep's best) vs SDPA; the tile sweep's lines."""
    old = load_baseline(old_path)
    problems = [prefill_problem(b, L) for b, L in PREFILL_SHAPES]
    sdpa = [bench(lambda p=p: sdpa_prefill(p)) for p in problems]
    old_ms = [bench(lambda p=p: new_prefill(p, None, old)) for p in problems]
    sweep_lines, timings = [], {}
    for i, launch in enumerate(PREFILL_CANDIDATES):  # timings by index: a Launch is not hashable
        try:
            timings[i] = [bench(lambda p=p, launch=launch: new_prefill(p, launch)) for p in problems]
        except Exception as failure:  # e.g. out of shared memory for the biggest tiles
            sweep_lines.append(f"  {launch}: failed ({type(failure).__name__}: {str(failure)[:80]})")
            continue
        shares = [s / t for s, t in zip(sdpa, timings[i])]
        mean = math.exp(sum(map(math.log, shares)) / len(shares))
        sweep_lines.append(
            f"  rows {launch.block_m:>3} keys {launch.block_n:>3} warps {launch.num_warps} stages "
            f"{launch.num_stages}: {mean:.0%} of SDPA (geomean), " + " ".join(f"{x:.0%}" for x in shares)
        )
    best = min(timings, key=lambda i: sum(map(math.log, timings[i])))  # the lowest geometric mean time
    sweep_lines.append(f"  best: {PREFILL_CANDIDATES[best]}")
    sweep_lines += kernel_resources(tri.varlen_attention_kernel, "varlen_attention_kernel (bf16 variants)")
    new = timings.get(0)  # the default tiles come first
    rows = []
    for i, (batch, seqlen) in enumerate(PREFILL_SHAPES):
        flops = causal_flops(batch, seqlen)
        row = dict(sequences=batch, tokens_each=seqlen, old_us=old_ms[i] * 1e3)
        row["new_us"] = new[i] * 1e3 if new else float("nan")
        row["best_tiles_us"] = timings[best][i] * 1e3
        row["sdpa_us"] = sdpa[i] * 1e3
        row["new_TFLOPs"] = flops / (new[i] if new else float("nan")) / 1e9
        row["old_of_sdpa"] = percent(old_ms[i], sdpa[i])
        row["new_of_sdpa"] = percent(new[i], sdpa[i]) if new else ""
        row["best_of_sdpa"] = percent(timings[best][i], sdpa[i])
        rows.append(row)
    fmt = dict(old_us="{:.1f}", new_us="{:.1f}", best_tiles_us="{:.1f}", sdpa_us="{:.1f}", new_TFLOPs="{:.0f}")
    return markdown_table(rows, fmt), "\n".join(sweep_lines)


SMALL_BATCHES, SMALL_CONTEXTS = (1, 2, 4, 8, 16), (1024, 4096, 8192)


def time_small_decode(batch: int, ctx: int, old, num_sms: int) -> tuple[dict, str]:
    """One small-batch shape: old splits vs new vs dense SDPA, and the new kernel at each split count."""
    q, k_cache, v_cache, block_table, seqlens = paged_problem(batch, ctx, 16)
    qd = q.transpose(1, 2).contiguous()  # (B, H, 1, D)
    k, v = dense_from_paged(k_cache, block_table, ctx), dense_from_paged(v_cache, block_table, ctx)
    sdpa = bench(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))
    old_ms = bench(lambda: old.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table))
    new_ms = bench(lambda: tri.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table))
    old_splits = old.choose_num_splits(batch, KV_HEADS, ctx, num_sms, old.DECODE_LAUNCH.block_n)
    new_splits = tri.choose_num_splits(batch, KV_HEADS, ctx, num_sms, tri.decode_launch(batch, DTYPE).block_n)
    row = dict(batch=batch, ctx=ctx, old_splits=old_splits, new_splits=new_splits, old_us=old_ms * 1e3,
               new_us=new_ms * 1e3, sdpa_dense_us=sdpa * 1e3, old_of_sdpa=percent(old_ms, sdpa),
               new_of_sdpa=percent(new_ms, sdpa))  # fmt: skip
    times = {}
    for splits in (s for s in (1, 2, 4, 8, 16, 32, 64) if s * 64 <= ctx):
        decode = functools.partial(tri.paged_decode_attention, q, k_cache, v_cache, seqlens, block_table)
        times[splits] = bench(functools.partial(decode, num_splits=splits))
    fastest = min(times, key=times.get)
    line = f"  B {batch:>2} ctx {ctx:>4}: " + " ".join(f"{s}:{t * 1e3:.1f}" for s, t in times.items())
    return row, line + f"  fastest {fastest} ({percent(times[fastest], sdpa)} of SDPA)"


def compare_small_decode(old_path: Path) -> tuple[str, str]:
    """Paged decode at small batches (block 16): old splits vs new vs dense SDPA; time at each split count."""
    old = load_baseline(old_path)
    num_sms = tri._num_sms(torch.device("cuda"))
    rows, sweep = [], []
    for batch in SMALL_BATCHES:
        for ctx in SMALL_CONTEXTS:
            row, line = time_small_decode(batch, ctx, old, num_sms)
            rows.append(row)
            sweep.append(line)
            torch.cuda.empty_cache()
    fmt = dict(old_us="{:.1f}", new_us="{:.1f}", sdpa_dense_us="{:.1f}")
    return markdown_table(rows, fmt), "\n".join(sweep)


def kernel_resources(kernel, name: str) -> list[str]:
    """Registers, spills and shared memory of each compiled variant of a kernel, and programs one SM holds."""
    props = torch.cuda.get_device_properties(0)
    lines = []
    try:  # Triton internals: the per-device cache of compiled kernels (first item of each device's entry)
        for compiled in kernel.device_caches[torch.cuda.current_device()][0].values():
            regs, shared, warps = compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps
            by_regs = props.regs_per_multiprocessor // max(1, regs * 32 * warps)
            by_shared = props.shared_memory_per_multiprocessor // max(1, shared + 1024)
            fits = min(by_regs, by_shared)
            line = (f"  {name}: {warps} warps, {compiled.metadata.num_stages} stages, {regs} registers/thread, "
                    f"{compiled.n_spills} spills, {shared} B shared -> {fits} programs/SM")  # fmt: skip
            if line not in lines:
                lines.append(line)
    except Exception as failure:
        lines.append(f"  {name}: resources unknown ({type(failure).__name__}: {failure})")
    return lines


def decode_occupancy() -> str:
    """How many decode programs one SM holds at once, against what choose_num_splits assumes."""
    q, k_cache, v_cache, block_table, seqlens = paged_problem(4, 1024, 16)
    tri.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table)  # compiles it
    lines = kernel_resources(tri.paged_decode_kernel, "paged_decode_kernel")
    lines.append(
        f"  choose_num_splits counts {tri.DECODE_PROGRAMS_PER_SM} programs/SM (DECODE_PROGRAMS_PER_SM), "
        f"{tri.DECODE_PROGRAMS_PER_SM_SMALL} for a batch of at most {tri.SMALL_BATCH_PROGRAMS_PER_SM} programs/SM"
    )
    return "\n".join(lines)


def compare(old_path: Path, out: Path) -> None:
    """Old kernels against new, in one run: prefill (with a tile sweep) and small-batch paged decode."""
    import triton

    gpu = torch.cuda.get_device_name()
    started = time.time()
    check_correctness()
    check_prefill_gqa()
    prefill_table, prefill_sweep = compare_prefill(old_path)
    print("\nprefill tile sweep (share of SDPA's speed per shape)\n" + prefill_sweep)
    print("\nvarlen causal prefill: old kernel vs new vs SDPA\n" + prefill_table)
    occupancy = decode_occupancy()
    print("\n" + occupancy)
    decode_table, split_sweep = compare_small_decode(old_path)
    print("\npaged decode, split count sweep (splits:us)\n" + split_sweep)
    print("\npaged decode, small batches (block 16): old vs new vs dense SDPA\n" + decode_table)
    text = f"""# Attention kernels, old against new: one {gpu}

`python benchmarks/kernel_bench.py --compare`, measured {time.strftime("%Y-%m-%d")} on one {gpu} (torch
{torch.__version__}, triton {triton.__version__}). Medians of `do_bench` over CUDA-graph replays, L2 flushed.
Qwen3-0.6B attention shapes (16 query heads, 8 KV heads, head_dim 128), bf16. "old" is
{old_path.name} (an older nanoref/ops/attention_triton.py); "of_sdpa" is SDPA's time over the kernel's (100% =
as fast as SDPA).

## Varlen causal prefill

New default tiles: {tri.PREFILL_LAUNCH}. best_tiles: the sweep's best by geometric mean.

{prefill_table}

Tile sweep:

```
{prefill_sweep}
```

## Paged decode, small batches

```
{occupancy}
```

{decode_table}

Time (us) at each split count:

```
{split_sweep}
```
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"\nwrote {out} in {time.time() - started:.0f} s")


# -- 4. report ------------------------------------------------------------------------------------


def write_tables(out: Path, title: str, about: str, rows: list[dict], fmt: dict, copy_tbps: float) -> None:
    """A timing mode's results: OUT.md (title, what was timed, the table) and OUT.json beside it; printed too."""
    machine, date = torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
    text = f"# {title} ({machine}, {date})\n\n{about}\n\n" + markdown_table(rows, fmt)
    print("\n" + text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    record = dict(machine=machine, date=date, copy_TBps=copy_tbps, rows=rows)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


def markdown_table(rows: list[dict], fmt: dict) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.get(k, "{}").format(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


# how each method is drawn: every line its own marker and dash, so lines that coincide (the two Triton block sizes
# often do, and SDPA on gathered pages at small batches) stay visible; hollow markers let the one beneath show
_STYLES = {
    "triton paged, block 16": dict(color="tab:blue", marker="o", ls="-", lw=2.2, ms=5, zorder=6),
    "triton paged, block 256": dict(color="tab:orange", marker="s", ls="--", lw=1.6, ms=8, mfc="none", zorder=7),
    "SDPA, gathered from pages": dict(color="tab:green", marker="^", ls="-.", lw=1.4, ms=9, mfc="none", zorder=8),
    "SDPA, dense (no paging)": dict(color="0.45", marker="x", ls=":", lw=1.4, ms=6, zorder=3),
    "FlexAttention, dense (no paging)": dict(color="tab:purple", marker="v", ls=":", lw=1.4, ms=5, zorder=3),
}


def draw(decode_rows: list[dict], copy_tbps: float, path: Path, gpu: str) -> None:
    """One panel per batch size, K/V read against context. The y axis is logarithmic: at batch 1 the kernels reach a
    few percent of the copy bandwidth, and a linear axis scaled to the copy line would flatten them onto zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in decode_rows))
    batches = [b for b in (1, 16, 64, 256) if any(r["batch"] == b for r in decode_rows)]
    contexts = sorted({r["ctx"] for r in decode_rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, batch in zip(axes, batches):
        for method in methods:
            pts = sorted((r["ctx"], r["TBps"]) for r in decode_rows if r["batch"] == batch and r["method"] == method)
            ax.plot([c for c, _ in pts], [t for _, t in pts], label=method, **_STYLES.get(method, {}))
        ax.axhline(
            copy_tbps, color="black", ls="--", lw=1, label=f"copy bandwidth ({copy_tbps:.2f} TB/s, read + write)"
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])  # measured ones only
        ax.minorticks_off()
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.grid(axis="y", color="0.9")
    axes[0].set_ylabel("K/V read (TB/s, log scale)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"Paged decode attention, Qwen3-0.6B shapes (16/8 heads, d=128, bf16), {gpu}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot(record_path: Path, figure: Path) -> None:
    """Redraw the figure from the measurements a run wrote (`--json`); no GPU needed."""
    record = json.loads(record_path.read_text())
    missing = {"machine", "copy_TBps", "decode"} - set(record)
    if missing:
        sys.exit(f"{record_path} is not a results file of benchmarks/kernel_bench.py: it has no {sorted(missing)}")
    draw(record["decode"], record["copy_TBps"], figure, record["machine"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="sweep the kernels' tile settings first")
    parser.add_argument("--sweep-prefill", action="store_true", help="sweep the prefill kernel's tile settings only")
    parser.add_argument("--batches", help="decode batch sizes (default 1,4,16,64,128,256; --cascade: 256,128,64,16,8)")
    parser.add_argument("--contexts", default="128,512,1024,2048,4096,8192")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/kernels_h200.json",
                        help="where the measurements go (what --plot reads)")  # fmt: skip
    parser.add_argument("--markdown", type=Path, default=ROOT / "benchmarks/results/kernels_h200.md")
    parser.add_argument("--figure", type=Path, default=ROOT / "figures/kernels_h200.png")
    parser.add_argument("--plot", type=Path, metavar="JSON", help="only redraw --figure from a results file (no GPU)")
    parser.add_argument(
        "--compare", type=Path, metavar="OLD.py", help="an older attention_triton.py's kernels against the current ones"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels_compare_h200.md")
    parser.add_argument(
        "--mixed",
        type=Path,
        metavar="OUT.md",
        help="only time decode over mixed contexts, in batch order and longest first (+ OUT.json)",
    )
    parser.add_argument("--baseline", type=Path, metavar="OLD.py", help="with --mixed: an older kernel beside")
    parser.add_argument(
        "--cascade",
        type=Path,
        metavar="OUT.md",
        help="only time decode over a 1,024-token prefix every sequence shares: plain, cascade attention (+ OUT.json)",
    )
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.figure)
        print(f"drew {args.figure} from {args.plot}")
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_bench.py needs a CUDA GPU (on a CPU the tests check the kernels, interpreted)")
    if args.compare:
        compare(args.compare, args.out)
        return
    if args.cascade or args.mixed:
        copy_tbps = copy_bandwidth()
        if args.cascade:
            title, out = "Paged decode over a shared prefix", args.cascade
            batches = tuple(map(int, (args.batches or "256,128,64,16,8").split(",")))
            rows, fmt = time_cascade_decode(copy_tbps, batches), dict(us="{:.1f}", own_TBps="{:.2f}")
            about = ("Every sequence: the same 1,024 cached tokens (the same blocks), then 101-2,048 of its own; 16 "
                     "query heads, 8 KV heads, head_dim 128, bf16; own_TBps: the K/V of the sequences' own tokens "
                     "over the time.")  # fmt: skip
        else:
            title, out = "Paged decode over mixed contexts", args.mixed
            rows, fmt = time_mixed_decode(copy_tbps, args.baseline), dict(us="{:.1f}", TBps="{:.2f}", of_copy="{:.0%}")
            about = "Contexts drawn uniformly from 101-2,048 tokens; 8 KV heads, head_dim 128, bf16; TB/s of K/V read."
        write_tables(out, title, f"Copy bandwidth {copy_tbps:.2f} TB/s. {about}", rows, fmt, copy_tbps)
        return
    import triton

    gpu = torch.cuda.get_device_name()
    started = time.time()
    check_correctness()
    copy_tbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_tbps:.2f} TB/s (read + written)")
    if args.sweep:
        sweep_decode_launch()
    if args.sweep or args.sweep_prefill:
        sweep_prefill_launch()
    prefill_rows = time_prefill()
    prefill_table = markdown_table(prefill_rows, dict(triton_us="{:.1f}", triton_TFLOPs="{:.0f}", sdpa_us="{:.1f}",
                                                      sdpa_TFLOPs="{:.0f}"))  # fmt: skip
    print("\nvarlen causal prefill\n" + prefill_table)

    store_rows = [time_store(n) for n in (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)]
    for r in store_rows:
        r["triton_of_copy"] = r["triton_TBps"] / copy_tbps
    fmt = dict(MB="{:.3f}", triton_us="{:.1f}", triton_TBps="{:.2f}", torch_us="{:.1f}", torch_TBps="{:.2f}",
               triton_of_copy="{:.0%}", us="{:.1f}", TBps="{:.2f}", of_copy="{:.0%}")  # fmt: skip
    store_table = markdown_table(store_rows, fmt)
    print("\nstore_kvcache\n" + store_table)

    decode_rows = []
    args.batches = args.batches or "1,4,16,64,128,256"
    for batch in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            decode_rows += time_decode(batch, ctx)
            print(f"  decode batch {batch} ctx {ctx}: " + ", ".join(
                f"{r['method']} {r['TBps']:.2f}" for r in decode_rows[-5:]))  # fmt: skip
    for r in decode_rows:
        r["of_copy"] = r["TBps"] / copy_tbps
    decode_table = markdown_table(decode_rows, fmt)
    print("\npaged decode attention\n" + decode_table)

    headline = [r for r in decode_rows if r["batch"] >= 64 and r["ctx"] >= 1024]
    summary = []
    for method in dict.fromkeys(r["method"] for r in headline):
        mine = [r["TBps"] for r in headline if r["method"] == method]
        summary.append(dict(method=method, min_TBps=min(mine), median_TBps=sorted(mine)[len(mine) // 2],
                            min_of_copy=min(mine) / copy_tbps))  # fmt: skip
    summary_table = markdown_table(summary, dict(min_TBps="{:.2f}", median_TBps="{:.2f}", min_of_copy="{:.0%}"))
    print("\nbatch >= 64 and context >= 1024\n" + summary_table)

    launch = tri.DECODE_LAUNCH
    options = f"{' --sweep' if args.sweep else ''} --batches {args.batches} --contexts {args.contexts}"
    text = f"""# Kernel benchmark: one {gpu}

`python benchmarks/kernel_bench.py{options}`, measured {time.strftime("%Y-%m-%d")}
on one {gpu} (torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}).
Every time is the median of `triton.testing.do_bench` over a CUDA-graph replay of one call (no Python or
launch overhead, as in the engine's graphed decode; L2 flushed between calls). Shapes: Qwen3-0.6B
attention (16 query heads, 8 KV heads, head_dim 128), bf16. Copy bandwidth measured in the same run:
**{copy_tbps:.2f} TB/s** (2 GiB device-to-device, bytes read + written). Decode kernel launch settings:
block_n {launch.block_n}, num_warps {launch.num_warps}, num_stages {launch.num_stages}; split-KV count
from `choose_num_splits` (column `splits`).

## Paged decode attention, batch >= 64 and context >= 1024

Bytes = the K/V read. "SDPA, gathered from pages" solves the same problem as the paged kernel: it gathers
each sequence's blocks into padded `(B, Hk, ctx, D)` tensors, then calls SDPA. The two "no paging" rows
read such contiguous tensors ready-made (the gather not counted): an easier problem, shown as a yardstick.

{summary_table}

## Varlen causal prefill

`varlen_attention` on flat `(N, H, D)` tokens of equal-length causal sequences (the engine's prefill without
history), against SDPA with `is_causal` on the same tokens viewed as padded `(B, H, L, D)`. FLOPs = QK^T and PV
over the causal half. Tiles: block_m {tri.PREFILL_LAUNCH.block_m}, block_n {tri.PREFILL_LAUNCH.block_n},
num_warps {tri.PREFILL_LAUNCH.num_warps}, num_stages {tri.PREFILL_LAUNCH.num_stages}.

{prefill_table}

## store_kvcache

N tokens' K and V rows (2 KiB each) into random slots; bytes = read + written. The torch column is
the reference in its CUDA-graph form (`index_put`; each skipped token repeats a stored token's write).
Below a few thousand tokens the time is launch latency, not bandwidth.

{store_table}

## Paged decode attention, every shape

Every sequence of the batch holds `ctx` tokens, its blocks scattered at random through the cache.

{decode_table}
"""
    record = dict(
        machine=gpu,
        versions=f"torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}",
        date=time.strftime("%Y-%m-%d"),
        command=" ".join(["python", "benchmarks/kernel_bench.py", *sys.argv[1:]]),
        shapes=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE)),
        copy_TBps=copy_tbps,
        prefill=prefill_rows,
        store=store_rows,
        decode=decode_rows,
    )
    for path in (args.json, args.markdown):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    args.markdown.write_text(text)
    plot(args.json, args.figure)  # the figure from the file, as --plot draws it
    print(f"\nwrote {args.json}, {args.markdown} and {args.figure} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
