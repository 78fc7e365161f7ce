"""LoRA adapters' cost: tokens per second of the base model beside every request on one adapter and requests spread
over four adapters in one batch.

    OMP_NUM_THREADS=1 python benchmarks/lora.py                 # this CPU, the built-in model
    python benchmarks/lora.py --model path/to/Qwen3-0.6B --device cuda --batch 64 --max-tokens 128

Configurations (each its own engine, built once; requests greedy, `ignore_eos`, exactly `--max-tokens` output
tokens; adapters random, rank `--rank` on all seven projections, made with peft into a temporary folder):
- `base`: enable_lora off (the baseline);
- `lora-off-rows`: enable_lora on (max_loras=4), every request on the base model: what the slots cost when unused;
- `1-adapter`: every request on one adapter;
- `4-adapters`: the requests spread over four adapters, round robin, in the same batches.
Every timed run sends prompts that engine has not served (fresh seeds: the prefix cache answers nothing); each
configuration runs `--runs` times, their order reversed on every other run; the table gives medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from nanoref import LLM, LoRARequest, SamplingParams  # noqa: E402
from nanoref.llm import DEFAULT_MODEL  # noqa: E402
from nanoref.testing import make_random_lora  # noqa: E402

CONFIGS = ("base", "lora-off-rows", "1-adapter", "4-adapters")


def prompts_for(seed: int, batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        adapters = [
            LoRARequest(f"a{i}", i + 1, str(make_random_lora(Path(root) / f"a{i}", args.model, rank=args.rank, seed=i)))
            for i in range(4)
        ]
        common = dict(device=args.device, num_kvcache_blocks=None if args.device == "cuda" else 512)
        lora = dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank)
        engines = {
            "base": LLM(args.model, **common),
            **{name: LLM(args.model, **common, **lora) for name in CONFIGS[1:]},
        }
        requests = {
            "base": None,
            "lora-off-rows": None,
            "1-adapter": adapters[0],
            "4-adapters": [adapters[i % 4] for i in range(args.batch)],
        }
        vocab = engines["base"].config.hf_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for name, llm in engines.items():  # warm-up (adapters read, first-call costs)
            llm.generate(prompts_for(999, args.batch, args.prompt_len, vocab), params, False, requests[name])
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        seed = 0
        for run in range(args.runs):
            for name in CONFIGS if run % 2 == 0 else reversed(CONFIGS):
                seed += 1
                prompts = prompts_for(seed, args.batch, args.prompt_len, vocab)
                start = time.perf_counter()
                engines[name].generate(prompts, params, False, requests[name])
                if args.device == "cuda":
                    torch.cuda.synchronize()
                rates[name].append(args.batch * args.max_tokens / (time.perf_counter() - start))
    base = statistics.median(rates["base"])
    print(f"{args.model}: batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} output tokens, "
          f"rank {args.rank}, {args.device}, median of {args.runs}")  # fmt: skip
    print(f"| {'configuration':<14} | {'output tok/s':>12} | {'vs base':>8} |")
    print(f"|{'-' * 16}|{'-' * 14}|{'-' * 10}|")
    for name in CONFIGS:
        rate = statistics.median(rates[name])
        print(f"| {name:<14} | {rate:>12.0f} | {rate / base:>7.2f}x |")


if __name__ == "__main__":
    main()
