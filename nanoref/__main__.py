"""`python -m nanoref "prompt"`: generate text from the command line."""

from __future__ import annotations

import argparse
import sys

from nanoref.llm import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanoref",
        description="Generate text with nanoref's paged engine. Without --model it uses the tiny model "
        "shipped in the package (trained on the Zen of Python and stdlib docstrings: a toy, for demos).",
    )
    parser.add_argument("prompts", nargs="*", default=["Beautiful is better than"], help="one or more prompts")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a local Hugging Face Qwen3 folder")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    sampling.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt (default 48)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    sampling.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    engine.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: per device)")
    engine.add_argument(
        "--attention-backend", default="auto", help="auto, torch, triton, cpp, flash_attn or flash_attn+triton"
    )
    engine.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many ranks (one per GPU, or gloo processes on a CPU); under torchrun, "
        "the number of processes it starts",
    )
    engine.add_argument("--trace", action="store_true", help="print the shapes of the first two engine steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nanoref import LLM, SamplingParams, trace_shapes
    from nanoref.utils.loader import ModelFolderError

    try:
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        if args.trace:
            with trace_shapes(max_steps=2):
                outputs = llm.generate(args.prompts, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        llm.close()  # tensor parallel: stop the other ranks now (nothing to do on one device)
    except (ModelFolderError, ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompts, outputs):
        print(f"{prompt}{output['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
