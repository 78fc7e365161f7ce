"""Probe: is a decode step faster as two sub-batches replayed on two CUDA streams?

A decode step at large batch is mostly paged attention, bound by memory bandwidth, and the rest is small GEMMs and
element-wise kernels bound by latency (docs/benchmarks.md, "Where a decode step goes"). Split the batch in two
independent halves, each its own CUDA graph, and replay them on two streams: while one half reads K/V, the other's
small kernels could run beside it (the idea behind nano-batching schedulers). This times, on Qwen3-0.6B's shapes
with random weights and a paged K/V cache of random contexts (100-1499 tokens):

- one graph of the whole batch (what the engine replays);
- the two halves' graphs one after the other on one stream (the cost of splitting: weights read twice, smaller
  GEMMs);
- the two halves' graphs on two streams at once.

    python benchmarks/split_decode_probe.py --batch 256

The layers are plain torch ops around nanoref's Triton paged decode kernel (no fused norms, no sampler), so the
absolute step time is above the engine's; the ratios are the point. CUDA only.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoref.ops import attention_triton as tri  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS, PAGE = 1024, 16, 8, 128, 3072, 151936, 28, 256
MAX_CONTEXT = 1500
DTYPE = torch.bfloat16


def make_problem(batch: int, seed: int = 0) -> dict:
    """Random weights of Qwen3-0.6B's shapes and a paged K/V cache holding `batch` random contexts."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def weight(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPE, generator=g) * 0.02

    layers = [
        dict(
            qkv=weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            o=weight(HIDDEN, HEADS * HEAD_DIM),
            gate_up=weight(2 * INTER, HIDDEN),
            down=weight(HIDDEN, INTER),
            norm1=torch.ones(HIDDEN, device="cuda", dtype=DTYPE),
            norm2=torch.ones(HIDDEN, device="cuda", dtype=DTYPE),
        )
        for _ in range(LAYERS)
    ]
    blocks_per_seq = math.ceil(MAX_CONTEXT / PAGE)
    k_cache = torch.randn(batch * blocks_per_seq, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    return dict(
        layers=layers,
        lm_head=weight(VOCAB, HIDDEN),
        k_cache=k_cache,  # (num_blocks, PAGE, Hk, D), one cache that every layer reads
        v_cache=torch.randn_like(k_cache),
        context_lens=torch.randint(100, MAX_CONTEXT, (batch,), device="cuda", dtype=torch.int32, generator=g),
        block_tables=torch.randperm(batch * blocks_per_seq, device="cuda", generator=g).view(batch, -1).int(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(DTYPE) * weight


def decode_forward(p: dict, hidden: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor):
    """hidden (B, hidden) -> next token ids (B,): each layer's GEMMs, paged attention and norms."""
    for w in p["layers"]:
        qkv = rms_norm(hidden, w["norm1"]) @ w["qkv"].T  # (B, (H + 2 Hk) * D)
        q = qkv[:, : HEADS * HEAD_DIM].reshape(-1, 1, HEADS, HEAD_DIM)  # (B, 1, H, D)
        attn = tri.paged_decode_attention(q, p["k_cache"], p["v_cache"], context_lens, block_tables)
        hidden = hidden + attn.reshape(-1, HEADS * HEAD_DIM) @ w["o"].T  # (B, hidden)
        gate_up = rms_norm(hidden, w["norm2"]) @ w["gate_up"].T  # (B, 2 * I)
        hidden = hidden + (F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]) @ w["down"].T
    return (hidden @ p["lm_head"].T).argmax(-1)  # (B,)


def record(p: dict, rows: torch.Tensor) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the decode forward over the sequences `rows` (its own inputs and memory pool)."""
    hidden = torch.randn(len(rows), HIDDEN, device="cuda", dtype=DTYPE)
    context_lens, block_tables = p["context_lens"][rows].clone(), p["block_tables"][rows].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile the kernels) outside the capture
        for _ in range(2):
            decode_forward(p, hidden, context_lens, block_tables)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_forward(p, hidden, context_lens, block_tables)
    return graph


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("split_decode_probe.py needs a CUDA GPU")
    with torch.inference_mode():
        p = make_problem(args.batch)
        kv_bytes = 2 * int(p["context_lens"].sum()) * KV_HEADS * HEAD_DIM * 2 * LAYERS  # K and V, every layer
        rows = torch.arange(args.batch, device="cuda")
        whole = record(p, rows)
        halves = [record(p, part) for part in rows.chunk(2)]
        streams = [torch.cuda.Stream() for _ in halves]

        def one_stream() -> None:
            for graph in halves:
                graph.replay()

        def two_streams() -> None:
            main_stream = torch.cuda.current_stream()
            for graph, stream in zip(halves, streams):
                stream.wait_stream(main_stream)
                with torch.cuda.stream(stream):
                    graph.replay()
            for stream in streams:
                main_stream.wait_stream(stream)

        timings = {
            "one graph of the whole batch": time_ms(whole.replay),
            "two halves, one stream": time_ms(one_stream),
            "two halves, two streams": time_ms(two_streams),
        }
    print(f"{torch.cuda.get_device_name()}; batch {args.batch}, mean context {p['context_lens'].float().mean():.0f}")
    print("| replay | ms per step | vs one graph | K/V read at |")
    print("|---|---|---|---|")
    base = timings["one graph of the whole batch"]
    for name, ms in timings.items():
        print(f"| {name} | {ms:.3f} | {base / ms:.3f}x | {kv_bytes / ms / 1e9:,.0f} GB/s |")


if __name__ == "__main__":
    main()
