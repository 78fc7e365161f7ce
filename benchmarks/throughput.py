"""End-to-end generation throughput on Nano-vLLM's benchmark workload.

The workload (as Nano-vLLM's bench.py): Python's `random` seeded with 0; 256 sequences; prompt
lengths uniform in [100, 1024] of random ids in [0, 10000]; max_tokens uniform in [100, 1024];
temperature 0.6; ignore_eos. Throughput = output tokens / wall time of one `generate` call (after a
short warm-up). Totals: 142,827 prompt tokens, 133,966 output tokens.

    python benchmarks/throughput.py --random-qwen3-0.6b                 # GPU: Qwen3-0.6B shapes, random bf16 weights
    python benchmarks/throughput.py --model path/to/Qwen3-0.6B --enforce-eager
    python benchmarks/throughput.py --model nanoref/default_model --num-seqs 8 --max-input-len 64 --max-output-len 32

Prints a table row per configuration and, with --out, appends it as Markdown to a results file.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from random import randint, seed

import torch

from nanoref import LLM, SamplingParams
from nanoref.testing import QWEN3_0_6B, make_random_qwen3


def random_qwen3_0_6b(folder: Path) -> Path:
    """Qwen3-0.6B's architecture with random bf16 weights (initialised on the GPU when there is one)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_random_qwen3(folder, QWEN3_0_6B, dtype=torch.bfloat16, device=device)


def workload(
    num_seqs: int, max_input_len: int, max_output_len: int, vocab_size: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    seed(0)
    # ids in [0, 10000], folded into the vocabulary of a model smaller than that (same random stream)
    prompts = [[randint(0, 10000) % vocab_size for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len))
        for _ in range(num_seqs)
    ]
    return prompts, params


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a local Qwen3 folder")
    source.add_argument(
        "--random-qwen3-0.6b",
        dest="random_qwen3_0_6b",
        action="store_true",
        help="Qwen3-0.6B shapes, random bf16 weights",
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kvcache-block-size", type=int, default=None)
    parser.add_argument("--out", type=Path, help="append the result row (Markdown) to this file")
    parser.add_argument("--json", type=Path, help="write the result as JSON")
    args = parser.parse_args()

    folder = Path(args.model) if args.model else random_qwen3_0_6b(Path(tempfile.mkdtemp()) / "qwen3-0.6b-random")
    start = time.perf_counter()
    llm = LLM(
        folder,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(args.max_model_len, 2 * max(args.max_input_len, args.max_output_len) + 64),
        kvcache_block_size=args.kvcache_block_size,
    )
    load_s = time.perf_counter() - start
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, llm.config.hf_config.vocab_size)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o["token_ids"]) for o in outputs)
    assert output_tokens == sum(p.max_tokens for p in params), "ignore_eos: every request runs to max_tokens"
    result = {
        "device": device_name(),
        "model": "Qwen3-0.6B (random bf16)" if args.random_qwen3_0_6b else str(folder),
        "dtype": str(llm.config.dtype).removeprefix("torch."),
        "backend": llm.model_runner.backend.name,
        "cuda_graphs": llm.model_runner.decode_graphs is not None,
        "block_size": llm.config.kvcache_block_size,
        "kv_blocks": llm.model_runner.num_kvcache_blocks,
        "num_seqs": args.num_seqs,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": output_tokens,
        "preemptions": llm.scheduler.num_preemptions,
        "load_s": round(load_s, 1),
        "time_s": round(elapsed, 2),
        "output_tok_per_s": round(output_tokens / elapsed, 1),
        "torch": torch.__version__,
    }
    header = "| " + " | ".join(result) + " |"
    row = "| " + " | ".join(str(v) for v in result.values()) + " |"
    print(header)
    print("|" + "---|" * len(result))
    print(row)
    if args.out:
        new = not args.out.exists()
        with args.out.open("a") as f:
            if new:
                f.write(header + "\n|" + "---|" * len(result) + "\n")
            f.write(row + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
