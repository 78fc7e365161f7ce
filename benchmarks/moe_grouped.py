"""Qwen3-MoE's experts: the per-expert loop against the grouped path, at one Qwen3-30B-A3B sparse layer's shapes.

    python benchmarks/moe_grouped.py                                  # a CUDA GPU: check, time, table, JSON, figure
    python benchmarks/moe_grouped.py --out-dir DIR --figure-dir DIR   # write the results somewhere else (the
                                                                      # markdown links the figure in figures/)
    python benchmarks/moe_grouped.py --device cpu --quick             # anywhere: tiny shapes, to exercise the script

Shapes: hidden 2048, 128 experts, top-8, moe_intermediate_size 768, bf16, random weights; N tokens of random
hidden states routed by a random router through `route()` (as the model routes them), N in 1 ... 4096.
Methods, all on the same inputs:
- loop: `moe_experts`, the reference (one expert at a time; it asks the device which tokens went where, a
  host sync per expert)
- grouped, torch._grouped_mm / grouped, triton: `moe_experts_grouped` with each grouped matmul, eager
- the same "(graph)": replayed from a CUDA graph, as the engine's decode runs it (no launch overhead)
Each is first checked against the loop run in float32 (relative error of the whole output). Times: CUDA
events around single calls after warm-up, median over repetitions (on a CPU: perf_counter). TFLOP/s counts the
two matmuls (6 N K hidden I); GB/s counts the weights of the experts that got a token, each read once (the
least any method must read), so at small N it is the figure that matters.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanoref.models.qwen3_moe import moe_experts, route  # noqa: E402
from nanoref.ops.moe_grouped import (  # noqa: E402
    grouped_mm_per_row,
    grouped_mm_torch,
    grouped_mm_triton,
    moe_experts_grouped,
    torch_grouped_mm_aligned,
    torch_grouped_mm_is_one_kernel,
)
from nanoref.ops.triton_setup import triton_available  # noqa: E402

QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, top_k=8, inter=768)
QUICK = dict(hidden_size=64, num_experts=8, top_k=2, inter=32)
TOKENS = (1, 8, 64, 256, 1024, 4096)
QUICK_TOKENS = (1, 8, 64)
MAX_ERROR = 2e-2  # relative error of a bf16 result against float32: a wrong result is ~1


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def problem(num_tokens: int, shapes: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Hidden states (N, hidden) routed by a random router, and random experts scaled so values stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden_size, num_experts, inter = shapes["hidden_size"], shapes["num_experts"], shapes["inter"]
    hidden = torch.randn(num_tokens, hidden_size, generator=g, device=device).to(dtype)  # (N, hidden)
    router = torch.randn(num_experts, hidden_size, generator=g, device=device).to(dtype)  # (E, hidden)
    _, topk_weights, topk_ids = route(hidden, router, shapes["top_k"], norm_topk_prob=True)  # (N, K), (N, K)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=g, device=device) / hidden_size**0.5
    w_down = torch.randn(num_experts, hidden_size, inter, generator=g, device=device) / inter**0.5
    return hidden, topk_weights, topk_ids, w_gate_up.to(dtype), w_down.to(dtype)


def methods(device: torch.device, dtype: torch.dtype, shapes: dict, quick: bool) -> dict[str, Callable]:
    """name -> fn(*problem); the grouped matmuls that serve here, each eager and (on CUDA) from a graph."""
    grouped = {}
    if hasattr(torch, "_grouped_mm") and torch_grouped_mm_aligned(dtype, shapes["hidden_size"], shapes["inter"]):
        # off a Hopper/Blackwell GPU in bf16, torch._grouped_mm loops over groups after a host sync: still timed
        fast = device.type != "cuda" or torch_grouped_mm_is_one_kernel(device, dtype)
        grouped["torch._grouped_mm" + ("" if fast else " (its looping fallback)")] = grouped_mm_torch
    if triton_available() and (device.type == "cuda" or quick):  # the interpreter: tiny shapes only
        grouped["triton"] = grouped_mm_triton
    if device.type == "cpu" and quick:  # it copies an expert weight per row: 200 GB at 4096 tokens of 30B-A3B
        grouped["per-row torch"] = grouped_mm_per_row
    fns: dict[str, Callable] = {"loop": moe_experts}
    for name, grouped_mm in grouped.items():
        fns[f"grouped, {name}"] = lambda *p, grouped_mm=grouped_mm: moe_experts_grouped(*p, grouped_mm)
    return fns


def time_eager(fn: Callable, device: torch.device, budget_s: float) -> float:
    """Median seconds of one call, after warm-up (which also compiles Triton kernels)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        times = []
        while not times or (sum(times) < budget_s and len(times) < 50):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(10, min(200, int(budget_s / max(start.elapsed_time(end) / 1e3, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for begin, finish in events:
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize(device)
    return statistics.median(begin.elapsed_time(finish) / 1e3 for begin, finish in events)


def time_graph(fn: Callable, device: torch.device, budget_s: float) -> float:
    """The same call recorded once in a CUDA graph, then replayed: median seconds of one replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up outside the capture (Triton compiles on first use)
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    seconds = time_eager(graph.replay, device, budget_s)
    del graph
    return seconds


def relative_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    return float((out.float() - truth).norm() / truth.norm().clamp_min(1e-30))


def measure(num_tokens: int, shapes: dict, dtype, device, quick: bool, budget_s: float) -> list[dict]:
    args = problem(num_tokens, shapes, dtype, device)
    topk_ids = args[2]
    # the truth: the loop in float32 on the same (rounded) inputs
    truth = moe_experts(*(t.float() if t.is_floating_point() else t for t in args))
    hidden_size, inter, top_k = shapes["hidden_size"], shapes["inter"], shapes["top_k"]
    flops = 6 * num_tokens * top_k * hidden_size * inter  # gate_up (2 I x hidden) and down (hidden x I), per pair
    hit = int(topk_ids.unique().numel())  # experts that got a token: their weights must be read
    weight_bytes = hit * 3 * inter * hidden_size * dtype.itemsize
    rows = []
    for name, fn in methods(device, dtype, shapes, quick).items():
        variants = [(name, time_eager)]
        if device.type == "cuda" and name != "loop":  # the loop cannot be recorded (data-dependent shapes)
            variants.append((f"{name} (graph)", time_graph))
        for label, timer in variants:
            row = dict(tokens=num_tokens, method=label, experts_hit=hit)
            try:
                row["rel_error"] = relative_error(fn(*args), truth)
                seconds = timer(lambda fn=fn: fn(*args), device, budget_s)
                row.update(us=seconds * 1e6, TFLOPs=flops / seconds / 1e12, weight_GBps=weight_bytes / seconds / 1e9)
                if row["rel_error"] > MAX_ERROR:
                    row["note"] = f"WRONG: relative error {row['rel_error']:.2g} > {MAX_ERROR}"
            except Exception as failure:  # one method failing must not lose the others' numbers
                row["note"] = f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:120]}"
            rows.append(row)
            print(f"  N {num_tokens:>5} {label:<40} " + (f"{row['us']:10.1f} us" if "us" in row else row["note"]))
    loop = next((r["us"] for r in rows if r["method"] == "loop" and "us" in r), None)
    for row in rows:
        if loop and "us" in row:
            row["speedup"] = loop / row["us"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown_table(rows: list[dict]) -> str:
    keys = ["tokens", "method", "us", "speedup", "TFLOPs", "weight_GBps", "experts_hit", "rel_error", "note"]
    keys = [k for k in keys if any(k in r for r in rows)]
    fmt = dict(us="{:.1f}", speedup="{:.2f}x", TFLOPs="{:.1f}", weight_GBps="{:.0f}", rel_error="{:.1e}")
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [fmt.get(k, "{}").format(row[k]) if k in row else "" for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no figure")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["tokens"], r) for r in rows if r["method"] == method and "us" in r)
        if not pts:
            continue
        style = dict(marker="o", ls="--" if "graph" in method else "-", lw=1.6, ms=4)
        if method == "loop":
            style.update(color="black", marker="s")
        left.plot([n for n, _ in pts], [r["us"] for _, r in pts], label=method, **style)
        if method != "loop":
            right.plot([n for n, _ in pts], [r.get("speedup", float("nan")) for _, r in pts], **style)
    tokens = sorted({r["tokens"] for r in rows})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [str(n) for n in tokens])  # the measured token counts only
        ax.minorticks_off()
        ax.set_xlabel("tokens N")
        ax.grid(color="0.9")
    left.set_yscale("log")
    left.set_ylabel("time per layer (µs)")
    right.set_yscale("log")
    right.axhline(1, color="black", lw=1)
    right.set_ylabel("speedup over the eager loop")
    right.set_title('dashed "(graph)": replayed from a CUDA graph, against the loop run eagerly', fontsize=8)
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (hidden 64, 8 experts, top-2, I 32)")
    parser.add_argument("--tokens", help="comma-separated token counts (default 1,8,64,256,1024,4096)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of repetitions per timing (about)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--figure-dir", type=Path, default=ROOT / "figures")
    parser.add_argument("--plot", type=Path, metavar="JSON", help="only redraw the figure of a results file")
    args = parser.parse_args()
    if args.plot:
        record = json.loads(args.plot.read_text())
        shape_text = ", ".join(f"{k} {v}" for k, v in record["shapes"].items())
        title = f"Qwen3-MoE experts, one layer ({shape_text}), {record['dtype']}, {record['machine']}"
        draw(record["rows"], args.figure_dir / f"{args.plot.stem}.png", title)
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, but torch sees no CUDA GPU here (try --device cpu --quick)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = QUICK if args.quick else QWEN3_30B_A3B
    tokens = tuple(map(int, args.tokens.split(","))) if args.tokens else QUICK_TOKENS if args.quick else TOKENS
    dtype = torch.bfloat16
    name = device_name(device)
    tag = "cpu" if device.type == "cpu" else ("h200" if "H200" in name else re.sub(r"\W+", "_", name).lower())
    stem = f"moe_grouped_{tag}" + ("_quick" if args.quick else "")
    started = time.time()
    print(f"{name}: one sparse layer, {shapes}, {dtype}, N in {tokens}")
    rows = []
    for num_tokens in tokens:
        rows += measure(num_tokens, shapes, dtype, device, args.quick, args.budget)
    table = markdown_table(rows)
    print("\n" + table)

    versions = f"torch {torch.__version__}"
    if triton_available():
        import triton

        versions += f", triton {triton.__version__}"
    shape_text = ", ".join(f"{k} {v}" for k, v in shapes.items())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = dict(machine=name, versions=versions, date=time.strftime("%Y-%m-%d"), dtype=str(dtype), shapes=shapes,
                  command=" ".join(["python", "benchmarks/moe_grouped.py", *sys.argv[1:]]), rows=rows)  # fmt: skip
    (args.out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    figure = args.figure_dir / f"{stem}.png"
    drew = draw(rows, figure, f"Qwen3-MoE experts, one layer ({shape_text}), {dtype}, {name}")
    timer = "CUDA events" if device.type == "cuda" else "perf_counter"
    text = f"""# Qwen3-MoE experts, loop against grouped: one {name}

`{record["command"]}`, measured {record["date"]} on one {name} ({versions}, Python {platform.python_version()}).
One sparse layer's experts ({shape_text}), {dtype}, random weights, tokens routed by a random router. Median
time of one call after warm-up ({timer}); "(graph)": replayed from a CUDA graph, as the engine's decode runs
it. speedup: the loop's time over the method's. TFLOP/s: 6 N K hidden I. weight_GBps: the weights of the experts
hit (experts_hit), each counted once. rel_error: against the loop in float32 on the same inputs.

{table}
""" + (f"\n![time and speedup](../../figures/{figure.name})\n" if drew else "")
    (args.out_dir / f"{stem}.md").write_text(text)
    print(
        f"\nwrote {args.out_dir / stem}.json and .md"
        + (f", {figure}" if drew else "")
        + f" in {time.time() - started:.0f} s"
    )
    if any("note" in r for r in rows):
        sys.exit("some methods failed or were wrong: see the note column")


if __name__ == "__main__":
    main()
