"""Where a speculative verify step's time goes, beside a plain decode step, at several batch sizes.

    python benchmarks/profile_speculative.py --model qwen3-0.6b-random --batches 1,8,64,256

Each phase of the verify step (proposing, building inputs and running the target's forward, the acceptance rule,
postprocessing) is timed with the device synchronized at its edges, so the phases add up to the step; the plain
engine's decode step is timed whole. Times are medians over the decode steps of one generate per batch size, on
prompts neither engine has served. The synchronizing costs a little overlap: use the table for proportions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from speculative import make_models, random_prompts, repeat_prompts  # noqa: E402

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.testing import EVERY_STEP  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(times: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            times[name].append(time.perf_counter() - start)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--proposer", choices=["ngram", "draft-random"], default="ngram")
    args = parser.parse_args()
    models = make_models(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # every decode step verifies (the policy off): the point is what a verify step costs
    spec = {"num_speculative_tokens": args.k, **EVERY_STEP}
    if args.proposer == "ngram":
        spec.update(method="ngram", prompt_lookup_max=3)
    else:  # a draft of the target's shapes with other random weights (qwen3-0.6b-random only)
        spec.update(model=models["random"])
    # two engines in one process: the first takes 40% of the memory, the second up to 85% in all
    plain = LLM(models["target"], device=device, gpu_memory_utilization=0.4)
    speculative = LLM(models["target"], device=device, speculative_config=spec, gpu_memory_utilization=0.85)
    vocab = plain.config.hf_config.vocab_size
    loop = speculative.step_loop
    times: dict[str, list[float]] = defaultdict(list)
    loop.proposer.propose = timed(times, "propose", loop.proposer.propose)
    runner = speculative.model_runner
    runner.run_forward = timed(times, "forward", runner.run_forward)
    loop.accept = timed(times, "accept", loop.accept)
    loop.postprocess = timed(times, "postprocess", loop.postprocess)
    loop.verify = timed(times, "verify (all of it)", loop.verify)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def prompts(seed: int, count: int):
        if args.model == "builtin":
            return repeat_prompts(seed, count)
        return random_prompts(seed, count, args.prompt_len, vocab)

    seed = 10_000
    print("| batch | plain decode step (ms) | verify step (ms) | propose | forward | accept | postprocess |"
          " tokens per step | verify / plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        for llm in (plain, speculative):  # warm-up (compile, graphs)
            llm.generate(prompts(seed, min(batch, 4)), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            seed += 1
        times.clear()
        plain.generate(prompts(seed, batch), params, use_tqdm=False)
        seed += 1
        plain_steps = [s.elapsed for s in plain.metrics.steps if s.kind == "decode" and s.num_seqs == batch]
        speculative.generate(prompts(seed, batch), params, use_tqdm=False)
        seed += 1
        steps = [s for s in speculative.metrics.steps if s.kind == "decode"]
        gained = sum(s.num_seqs + s.num_accepted_tokens for s in steps) / max(1, sum(s.num_seqs for s in steps))
        # the verify steps only: run_forward also times the prefill steps, which come first
        forward = times["forward"][-len(times["verify (all of it)"]) :]
        m = {name: statistics.median(values) * 1e3 for name, values in times.items() if values}
        m["forward"] = statistics.median(forward) * 1e3
        plain_ms = statistics.median(plain_steps) * 1e3
        print(
            f"| {batch} | {plain_ms:.2f} | {m['verify (all of it)'] + m['postprocess']:.2f} | {m['propose']:.2f} |"
            f" {m['forward']:.2f} | {m['accept']:.2f} | {m['postprocess']:.2f} | {gained:.2f} |"
            f" {(m['verify (all of it)'] + m['postprocess']) / plain_ms:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
