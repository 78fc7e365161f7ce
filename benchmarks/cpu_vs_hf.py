"""nanoref against HF transformers `generate` on a CPU: one batch of 32 prompts of varied lengths.

The model is the built-in tiny Qwen3 (nanoref/default_model) in float32; every request is greedy and produces
`--tokens` tokens (ignore_eos for nanoref, min_new_tokens for HF). HF runs the batch as one left-padded
`generate` call with its dynamic KV cache; nanoref runs `LLM.generate` on the same prompts. Each engine runs
`--runs` times, alternating, after one warm-up each; the script prints every run, the medians and the ratio.

    python benchmarks/cpu_vs_hf.py [--seqs 32] [--tokens 64] [--runs 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from random import Random

import torch


def prompts_for(num_seqs: int, vocab: int) -> list[list[int]]:
    rng = Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 128))] for _ in range(num_seqs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from nanoref import DEFAULT_MODEL, LLM, SamplingParams

    hf_logging.disable_progress_bar()
    llm = LLM(DEFAULT_MODEL, device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    prompts = prompts_for(args.seqs, llm.vocab_size)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run_nanoref() -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o["token_ids"]) == args.tokens for o in outputs)
        return elapsed

    def run_hf() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == width + args.tokens
        return elapsed

    run_nanoref(), run_hf()  # warm-up
    times: dict[str, list[float]] = {"nanoref": [], "hf": []}
    for index in range(args.runs):
        order = [("nanoref", run_nanoref), ("hf", run_hf)]
        for name, run in order if index % 2 == 0 else order[::-1]:
            times[name].append(run())
    tokens = args.seqs * args.tokens
    for name, values in times.items():
        each = ", ".join(f"{tokens / t:,.0f}" for t in values)
        print(f"{name:8s} output tok/s per run: {each}; median {tokens / statistics.median(values):,.0f}")
    ratio = statistics.median(times["hf"]) / statistics.median(times["nanoref"])
    print(
        f"nanoref / HF: {ratio:.2f}x ({args.seqs} prompts of 8-128 tokens, {args.tokens} tokens each, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
