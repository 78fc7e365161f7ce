"""Tensor parallelism on GPUs: tp=2 against tp=1, for correctness and for throughput.

1. Token-exact: a tiny float32 Qwen3 (KV heads split, and a model with one KV head replicated) generates
   the same greedy tokens with tensor_parallel_size=2 as with 1, CUDA graphs on.
2. Throughput: nanoref's benchmark workload (Nano-vLLM's bench.py: 256 requests, 100-1024 prompt and
   100-1024 output tokens, temperature 0.6) on Qwen3-8B's architecture with random bf16 weights, tp=1 and
   tp=2 in separate processes, alternating (A B B A ...), medians of every timed run; each timed run starts
   with an empty prefix cache (the same prompts would otherwise skip most of their prefill after the first run).
3. Where the all-reduces cost time: in the tp=2 engine, each rank times one all-reduce of a (B, hidden)
   bf16 activation for the batch sizes decode and prefill use, and a profile of some decode steps splits
   the GPU's time between NCCL kernels and the rest.

    python benchmarks/tp_scaling.py --out benchmarks/results/tp_scaling_h200x2.json --rounds 1 --runs 2

Needs two CUDA GPUs on one host (--smoke: a CPU). Writes JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from beside_peer import workload  # noqa: E402  (the same 256-request stream)


# -- functions every rank runs (importable by name from this module: the workers are other processes) ---
def allreduce_micros(runner, rows: list[int], repeats: int = 50) -> dict[int, float]:
    """One all-reduce of a (rows, hidden) activation in the model's dtype, µs (median of `repeats`)."""
    import torch

    all_reduce = runner.parallel.group.all_reduce  # the engine's own process groups (it never makes a default one)
    hidden = runner.config.hf_config.hidden_size
    result = {}
    for n in rows:
        x = torch.randn(n, hidden, device=runner.device, dtype=runner.config.dtype)
        for _ in range(5):
            all_reduce(x)
        times = []
        for _ in range(repeats):
            if x.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                all_reduce(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:  # (--smoke on a CPU)
                t0 = time.perf_counter()
                all_reduce(x)
                times.append((time.perf_counter() - t0) * 1e6)
        result[n] = statistics.median(times)
    return result


# -- one engine per process --------------------------------------------------------------------------
def run_engine(folder: str, tp: int, runs: int, profile: bool, smoke: bool = False) -> dict:
    import torch

    from nanoref import LLM, SamplingParams

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    start = time.perf_counter()
    options = dict(device="cpu", max_model_len=512) if smoke else dict(max_model_len=4096)
    llm = LLM(folder, tensor_parallel_size=tp, max_num_seqs=512, max_num_batched_tokens=16384, **options)
    load_s = time.perf_counter() - start
    prompts, max_tokens = workload(num_seqs=4, max_input_len=120, max_output_len=110) if smoke else workload()
    # warm-up on a quarter of the prompts: long prefills and large decode batches compile their kernels here, not
    # in the first timed run (after a 3-token warm-up the first run's prefill took 7.4 s on an H200, a cold one 3.4 s)
    llm.generate(prompts[: len(prompts) // 4], SamplingParams(max_tokens=8, temperature=0.6), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    times, decode_ms, prefill_ms, hit_blocks = [], [], [], []
    for _ in range(runs):
        # every timed run prefills its whole prompts: without this, the runs after the first hit the prefix cache
        llm.scheduler.block_manager.forget_cached_prefixes()
        sync()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        times.append(time.perf_counter() - t0)
        assert sum(len(o["token_ids"]) for o in outputs) == sum(max_tokens)
        steps = llm.metrics.steps
        decode_ms.append(statistics.mean(s.elapsed for s in steps if s.kind == "decode") * 1e3)
        prefill_ms.append(sum(s.elapsed for s in steps if s.kind == "prefill") * 1e3)
        hit_blocks.append(sum(s.num_hit_blocks for s in steps))
    result = dict(
        tp=tp,
        times=times,
        output_tokens=sum(max_tokens),
        decode_step_ms=decode_ms,
        prefill_total_ms=prefill_ms,
        prefix_hit_blocks=hit_blocks,
        load_s=load_s,
        kv_blocks=llm.model_runner.num_kvcache_blocks,
        graphs=llm.model_runner.decode_graphs is not None,
        backend=llm.model_runner.backend.name,
    )
    if tp > 1:
        rows = [1, 16, 64, 256, 512, 4096, 16384]
        per_rank = llm.model_runner.run_on_all_ranks(allreduce_micros, rows)
        result["allreduce_us"] = {str(n): per_rank[0][n] for n in rows}
        layers = llm.config.hf_config.num_hidden_layers
        result["allreduces_per_step"] = 2 * layers + 1  # o_proj and down_proj per layer, and the embedding
    if profile:
        result["profile"] = profile_decode(llm, batch=8, prompt_len=64) if smoke else profile_decode(llm)
    llm.close()
    return result


def profile_decode(llm, batch: int = 256, prompt_len: int = 512, steps: int = 16) -> dict:
    """GPU time of `steps` decode steps at `batch` (contexts ~prompt_len), split into NCCL kernels and the rest
    (rank 0's view). The requests are admitted and prefilled before the profiler starts: no prefill is counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanoref import SamplingParams

    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 16)
    for i in range(batch):
        llm.add_request([7 + i % 100] * prompt_len, params)
    while llm.step()[1].kind != "decode":  # the prefills
        pass
    for _ in range(4):  # settle into the steady state
        llm.step()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:  # CPU: --smoke
        for _ in range(steps):
            assert llm.step()[1].kind == "decode"
        if on_gpu:
            torch.cuda.synchronize()
    llm.abort_all()
    total = nccl = 0.0
    top: list[tuple[float, str]] = []
    for event in prof.key_averages():
        if event.device_type.name != "CUDA":  # kernels only (a CPU op's device time repeats its kernels')
            continue
        device_us = event.self_device_time_total
        total += device_us
        top.append((device_us, event.key[:80]))
        if "nccl" in event.key.lower():
            nccl += device_us
    top.sort(reverse=True)
    return dict(
        gpu_us_per_step=total / steps,
        nccl_us_per_step=nccl / steps,
        nccl_share=nccl / total if total else None,
        decode_steps=steps,
        batch=batch,
        top_kernels=top[:12],
    )


def check_exact(root: Path) -> dict:
    """tp=2 against tp=1, greedy, float32 tiny models, CUDA graphs on (each LLM in this process, in turn)."""
    from nanoref import LLM, SamplingParams
    from nanoref.testing import make_tiny_qwen3

    results = {}
    prompts = [[(i * 37 + j * 11) % 256 for j in range(n)] for i, n in enumerate([1, 9, 33, 70, 130])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for name, overrides in {"gqa2": {}, "mqa": dict(num_key_value_heads=1)}.items():
        folder = make_tiny_qwen3(root / name, seed=3, **overrides)
        one = LLM(folder, dtype="float32").generate(prompts, params, use_tqdm=False)
        with LLM(folder, dtype="float32", tensor_parallel_size=2) as llm:
            two = llm.generate(prompts, params, use_tqdm=False)
            graphs = llm.model_runner.decode_graphs is not None
        same = [a["token_ids"] == b["token_ids"] for a, b in zip(one, two)]
        results[name] = dict(token_exact=all(same), per_prompt=same, graphs=graphs)
    return results


def make_model(folder: Path, smoke: bool = False) -> Path:
    import torch

    from nanoref.testing import QWEN3_8B, make_random_qwen3, make_tiny_qwen3

    if smoke:  # a CPU check of this script: tiny model, 4 requests
        return make_tiny_qwen3(folder, vocab_size=10001)
    return make_random_qwen3(folder, QWEN3_8B, dtype=torch.bfloat16, device="cuda", initializer_range=0.02)


# -- the parent: alternate processes, collect, print ------------------------------------------------
def launch(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return dict(error=proc.stderr[-2000:], args=args)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    parser.add_argument("--rounds", type=int, default=1, help="processes per tp size (alternating)")
    parser.add_argument("--runs", type=int, default=2, help="timed generate calls per process")
    parser.add_argument("--skip-exact", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="check this script on a CPU: tiny model, 4 requests")
    parser.add_argument("--worker", nargs=3, metavar=("FOLDER", "TP", "PROFILE"), help=argparse.SUPPRESS)
    parser.add_argument("--exact-worker", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        folder, tp, prof = args.worker
        print(json.dumps(run_engine(folder, int(tp), args.runs, prof == "1", args.smoke)))
        return
    if args.exact_worker:
        print(json.dumps(check_exact(Path(args.exact_worker))))
        return
    summary: dict = {}
    runs: list[dict] = []

    def save() -> None:  # after every process: a run cut short by a time limit keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**summary, "runs": runs}, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_exact and not args.smoke:
            summary["token_exact"] = launch(["--exact-worker", tmp])
            print("token-exact:", summary["token_exact"], flush=True)
            save()
        t0 = time.perf_counter()
        folder = make_model(Path(tmp) / "qwen3-8b", args.smoke)
        print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
        order = []
        for round_index in range(args.rounds):
            order += [1, 2] if round_index % 2 == 0 else [2, 1]
        for i, tp in enumerate(order):
            profile_this = tp == 2 and i == order.index(2)
            flags = ["--runs", str(args.runs)] + (["--smoke"] if args.smoke else [])
            result = launch(["--worker", str(folder), str(tp), "1" if profile_this else "0", *flags])
            print(json.dumps(result)[:600], flush=True)
            runs.append(result)
            save()
    ok = [r for r in runs if "error" not in r]
    for tp in (1, 2):
        times = [t for r in ok if r["tp"] == tp for t in r["times"]]
        if times:
            tokens = next(r["output_tokens"] for r in ok if r["tp"] == tp)
            steps = [d for r in ok if r["tp"] == tp for d in r["decode_step_ms"]]
            summary[f"tp{tp}"] = dict(
                median_s=statistics.median(times),
                tok_per_s=tokens / statistics.median(times),
                decode_step_ms=statistics.median(steps),
                n=len(times),
            )
    if "tp1" in summary and "tp2" in summary:
        summary["scaling"] = summary["tp2"]["tok_per_s"] / summary["tp1"]["tok_per_s"]
    print("| tp | runs | median s | tok/s | mean decode step ms |\n|---|---|---|---|---|")
    for tp in (1, 2):
        if f"tp{tp}" in summary:
            s = summary[f"tp{tp}"]
            print(f"| {tp} | {s['n']} | {s['median_s']:.1f} | {s['tok_per_s']:,.0f} | {s['decode_step_ms']:.2f} |")
    if "scaling" in summary:
        print(f"scaling tp2/tp1: {summary['scaling']:.2f}x")
    save()


if __name__ == "__main__":
    main()
