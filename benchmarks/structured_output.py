"""Structured output's cost: output tokens per second of plain requests beside requests constrained by a grammar,
alone and mixed in one batch.

    OMP_NUM_THREADS=1 python benchmarks/structured_output.py          # this CPU, the built-in model
    python benchmarks/structured_output.py --model path/to/Qwen3-0.6B --device cuda --batch 64 --max-tokens 128

Configurations (one engine; requests greedy, `ignore_eos`, `--max-tokens` output tokens at most): `plain` (no
constraint), `half` (every other request constrained), `all` (every request constrained). The constraint
(`--constraint`): `regex`, `[a-z ]{4096}` (it cannot be complete sooner: every request makes `--max-tokens` tokens;
a character class over the whole vocabulary, the matcher's costliest kind of state), or `json`, a JSON schema of an
object with a list of strings (a request may end sooner: the table counts the tokens made). Each step fills the
constrained rows' bitmasks on the host (together, in threads where there are cores to spare), uploads them and
masks those rows' logits; the grammar is compiled once, before the timed runs. Every timed run
sends prompts the engine has not served; configurations alternate order; the table gives medians of `--runs`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from nanoref import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoref.llm import DEFAULT_MODEL  # noqa: E402

CONFIGS = ("plain", "half", "all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--constraint", choices=("regex", "json"), default="regex")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, num_kvcache_blocks=None if args.device == "cuda" else 512)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    words = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}}}}
    constraint = (
        StructuredOutputsParams(regex="[a-z ]{4096}")
        if args.constraint == "regex"
        else StructuredOutputsParams(json=words, disable_any_whitespace=True)
    )
    constrained = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True, structured_outputs=constraint
    )
    params = {
        "plain": [plain] * args.batch,
        "half": [constrained if i % 2 else plain for i in range(args.batch)],
        "all": [constrained] * args.batch,
    }
    vocab = llm.config.hf_config.vocab_size
    seed = 0

    def run(config: str) -> float:
        nonlocal seed
        seed += 1
        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).tolist()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params[config], use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o["token_ids"]) for o in outputs) / elapsed

    for config in CONFIGS:  # warm-up (and the grammar's one compile)
        run(config)
    rates: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for index in range(args.runs):
        for config in CONFIGS if index % 2 == 0 else reversed(CONFIGS):
            rates[config].append(run(config))
    base = statistics.median(rates["plain"])
    print("| configuration | output tok/s | vs plain |\n|---|---|---|")
    for config in CONFIGS:
        rate = statistics.median(rates[config])
        print(f"| {config} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
