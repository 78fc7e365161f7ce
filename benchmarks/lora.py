"""LoRA adapters' cost: tokens per second of the base model beside every request on one adapter and requests spread
over four adapters in one batch.

    OMP_NUM_THREADS=1 python benchmarks/lora.py                 # this CPU, the built-in model
    python benchmarks/lora.py --model path/to/Qwen3-0.6B --device cuda --workload nano-vllm

Configurations (requests `ignore_eos`, exactly their `max_tokens` output tokens; adapters random, rank `--rank` on
all seven projections, made with peft into a temporary folder):
- `base`: an engine with enable_lora off (the baseline);
- `lora-off-rows`: an engine with enable_lora on (max_loras=4), every request on the base model: what the slots
  cost when unused;
- `1-adapter`: the same engine, every request on one adapter;
- `4-adapters`: the same engine, the requests spread over four adapters, round robin, in the same batches.
Workloads: `fixed` (`--batch` greedy requests of `--prompt-len` random ids and `--max-tokens` output tokens) or
`nano-vllm` (Nano-vLLM's bench.py: 256 requests, 100-1024 prompt ids, 100-1024 output tokens, temperature 0.6;
see beside_peer.py). Every timed run sends prompts that engine has not served (fresh seeds: the prefix cache
answers nothing); each configuration runs `--runs` times, their order reversed on every other run; the table gives
medians. Both engines get the same number of KV blocks.
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


def requests_for(workload: str, seed: int, args: argparse.Namespace, vocab: int) -> tuple[list, list]:
    """(prompts as id lists, SamplingParams per prompt) of one run, drawn with `seed`."""
    if workload == "nano-vllm":
        from beside_peer import workload as nano_vllm_workload

        prompts, max_tokens = nano_vllm_workload(seed)
        return prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    return prompts, [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)] * args.batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", choices=("fixed", "nano-vllm"), default="fixed")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    with tempfile.TemporaryDirectory() as root:
        adapters = [
            LoRARequest(f"a{i}", i + 1, str(make_random_lora(Path(root) / f"a{i}", args.model, rank=args.rank, seed=i)))
            for i in range(4)
        ]
        # both engines get the same KV cache: the first sizes its own (its share of the GPU, or 512 blocks on a CPU),
        # the second takes as many blocks (a GPU's memory fraction counts for the whole process, not per engine)
        first = dict(gpu_memory_utilization=0.45) if args.device == "cuda" else dict(num_kvcache_blocks=512)
        base = LLM(args.model, device=args.device, **first)
        blocks = base.model_runner.config.num_kvcache_blocks
        lora = LLM(args.model, device=args.device, num_kvcache_blocks=blocks, enable_lora=True, max_loras=4,
                   max_lora_rank=args.rank)  # fmt: skip
        engines = {"base": base, "lora-off-rows": lora, "1-adapter": lora, "4-adapters": lora}

        def adapters_for(name: str, count: int) -> LoRARequest | list | None:
            return {"1-adapter": adapters[0], "4-adapters": [adapters[i % 4] for i in range(count)]}.get(name)

        vocab = base.config.hf_config.vocab_size
        for name in CONFIGS:  # warm-up (adapters read, first-call costs)
            prompts, params = requests_for("fixed", 999, args, vocab)
            engines[name].generate(prompts, params, False, adapters_for(name, len(prompts)))
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        seed = 0
        for run in range(args.runs):
            for name in CONFIGS if run % 2 == 0 else reversed(CONFIGS):
                seed += 1
                prompts, params = requests_for(args.workload, seed, args, vocab)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outputs = engines[name].generate(prompts, params, False, adapters_for(name, len(prompts)))
                if args.device == "cuda":
                    torch.cuda.synchronize()
                tokens = sum(len(o["token_ids"]) for o in outputs)
                assert tokens == sum(p.max_tokens for p in params)
                rates[name].append(tokens / (time.perf_counter() - start))
                print(f"run {run}, {name}: {rates[name][-1]:,.0f} output tok/s", flush=True)
    base_rate = statistics.median(rates["base"])
    shape = "Nano-vLLM's bench.py workload" if args.workload == "nano-vllm" else (
        f"batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} output tokens")  # fmt: skip
    print(f"{args.model}: {shape}, rank {args.rank}, {args.device}, median of {args.runs}")
    print(f"| {'configuration':<14} | {'output tok/s':>12} | {'vs base':>8} |")
    print(f"|{'-' * 16}|{'-' * 14}|{'-' * 10}|")
    for name in CONFIGS:
        rate = statistics.median(rates[name])
        print(f"| {name:<14} | {rate:>12.0f} | {rate / base_rate:>7.2f}x |")


if __name__ == "__main__":
    main()
