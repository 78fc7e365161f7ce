"""nanoref against HF transformers `generate` on a CPU: one batch of 32 prompts of varied lengths.

The model is the built-in tiny Qwen3 (nanoref/default_model) in float32; every request is greedy and produces
`--tokens` tokens (ignore_eos for nanoref, min_new_tokens for HF). HF runs the batch as one left-padded
`generate` call with its dynamic KV cache; nanoref runs `LLM.generate` on the same prompts, once per attention
backend named by `--backends` (default: torch, the plain PyTorch reference, and cpp, nanoref's C++ kernels and the
CPU default, where this machine can build them). Each engine runs `--runs` times after one warm-up, the engines in
turn and the order reversed every other round; the script prints every run, the medians, each nanoref's ratio to
HF, and whether the backends produced the same tokens. Each run's CPU time is measured too (the process's, which
with one thread is the engine's): on a machine shared with other work the wall-clock ratio moves with how much of
a core each run happened to get, the CPU-time ratio much less. The load average is printed before and after.

    python benchmarks/cpu_vs_hf.py [--seqs 32] [--tokens 64] [--runs 3] [--threads 1] [--backends torch cpp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from random import Random

import torch


def prompts_for(num_seqs: int, vocab: int) -> list[list[int]]:
    rng = Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 128))] for _ in range(num_seqs)]


def main() -> None:
    from nanoref.ops import attention_cpp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    default_backends = ["torch"] if attention_cpp.missing_build_tools() else ["torch", "cpp"]
    parser.add_argument("--backends", nargs="+", default=default_backends, help="nanoref attention backends")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from nanoref import DEFAULT_MODEL, LLM, SamplingParams

    hf_logging.disable_progress_bar()
    # an explicit KV budget: enough for the batch, and the same for every backend
    engines = {
        f"nanoref-{name}": LLM(
            DEFAULT_MODEL, device="cpu", dtype="float32", attention_backend=name, num_kvcache_blocks=1024
        )
        for name in args.backends
    }
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    prompts = prompts_for(args.seqs, hf.config.vocab_size)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    tokens_of: dict[str, list[list[int]]] = {}

    def nanoref_run(name: str, llm: LLM):
        def run() -> None:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens_of[name] = [o["token_ids"] for o in outputs]
            assert all(len(ids) == args.tokens for ids in tokens_of[name])

        return run

    def run_hf() -> None:
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                pad_token_id=0,
            )
        assert out.shape[1] == width + args.tokens

    runs = {name: nanoref_run(name, llm) for name, llm in engines.items()} | {"hf": run_hf}
    for run in runs.values():  # warm-up
        run()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in runs}  # wall clock
    cpu_times: dict[str, list[float]] = {name: [] for name in runs}  # the process's CPU time
    order = list(runs)
    for index in range(args.runs):
        for name in order if index % 2 == 0 else order[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            runs[name]()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    tokens = args.seqs * args.tokens
    for name, values in times.items():
        each = ", ".join(f"{tokens / t:,.0f}" for t in values)
        cpu = tokens / statistics.median(cpu_times[name])
        print(f"{name:14s} output tok/s per run: {each}; median {tokens / statistics.median(values):,.0f} "
              f"(per CPU second: {cpu:,.0f})")  # fmt: skip
    for name in engines:
        ratio = statistics.median(times["hf"]) / statistics.median(times[name])
        cpu_ratio = statistics.median(cpu_times["hf"]) / statistics.median(cpu_times[name])
        print(f"{name} / HF: {ratio:.2f}x (CPU time: {cpu_ratio:.2f}x)")
    if len(engines) > 1:
        same = len({str(t) for t in tokens_of.values()}) == 1
        print(f"nanoref backends produced {'the same' if same else 'DIFFERENT'} greedy tokens")
    load_after = os.getloadavg()
    print(
        f"({args.seqs} prompts of 8-128 tokens, {args.tokens} tokens each, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; load average {load_before[0]:.2f} before the timed runs, "
        f"{load_after[0]:.2f} after)"
    )


if __name__ == "__main__":
    main()
