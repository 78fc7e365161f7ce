"""`python -m nanoref "prompt"`: generate text from the command line."""

from __future__ import annotations

import argparse
import os
import sys

from nanoref.llm import DEFAULT_MODEL
from nanoref.utils.flags import add_engine_flags, dashed_flags, engine_settings, name_the_flag

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a tool stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        # the console script an install puts on PATH is named `nanoref`; a module run's argv[0] is __main__.py
        prog="nanoref" if os.path.basename(sys.argv[0]) == "nanoref" else "python -m nanoref",
        description="Generate text with nanoref's paged engine. Without --model it uses the tiny model "
        "shipped in the package (trained on the Zen of Python and stdlib docstrings: a toy, for demos).",
    )
    parser.add_argument(
        "prompts",
        nargs="*",
        default=["Beautiful is better than"],
        help='one or more (default: "Beautiful is better than")',
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a local Hugging Face Qwen3 folder")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    sampling.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt (default 48)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    sampling.add_argument(
        "--min-p", type=float, default=0.0, help="keep tokens at least min_p times as likely as the top one (0 = off)"
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    engine = parser.add_argument_group("engine")
    add_engine_flags(engine, "; under torchrun, the number of processes it starts")
    engine.add_argument("--trace", action="store_true", help="print the shapes of the first two engine steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 2 bad input (arguments, model folder), 1 a runtime failure, 130 Ctrl-C, 141 the reader
    of stdout went away (`| head -1`). A failure is one `error: ...` line on stderr, never a traceback."""
    parser = build_parser()
    # (prompts before, between and after the options; --max_model_len too, as vLLM takes it)
    args = parser.parse_intermixed_args(dashed_flags(sys.argv[1:] if argv is None else argv))
    try:
        _run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # what Python's docs advise for `| head`: stop quietly, and point stdout at devnull so that the interpreter's
        # own flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except BadInput as error:
        print(f"error: {name_the_flag(parser, str(error))}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ImportError) as error:  # TensorParallelError, a backend that cannot run here...
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    from nanoref import LLM, SamplingParams, trace_shapes

    for index, prompt in enumerate(args.prompts):
        _require_utf8(index, prompt)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(args.model, **engine_settings(args))  # (--seed seeds the engine, as vLLM's: the prompts draw from it)
    except (ValueError, TypeError) as error:  # ModelFolderError is a ValueError
        raise BadInput(error) from None
    with llm:  # leaving it (also on Ctrl-C or a closed stdout) stops tensor-parallel workers, if any
        if llm.tokenizer is None:
            raise BadInput(
                f"{args.model} has no tokenizer (no tokenizer.json, tokenizer_config.json or vocab.json): the command "
                "line takes text prompts, so copy the tokenizer files of the model's family into that folder"
            )
        try:
            if args.trace:
                with trace_shapes(max_steps=2):
                    outputs = llm.generate(args.prompts, params, use_tqdm=False)
            else:
                outputs = llm.generate(args.prompts, params, use_tqdm=False)
        except (ValueError, TypeError) as error:  # a prompt longer than the model allows, ...
            raise BadInput(error) from None
    for prompt, output in zip(args.prompts, outputs):
        print(f"{prompt}{output['text']}")
    sys.stdout.flush()  # a closed pipe shows here, inside main's handling, not in the interpreter's exit


class BadInput(Exception):
    """What the user passed cannot work (exit status 2); the message says what to change."""


def _require_utf8(index: int, prompt: str) -> None:
    # Python decodes argv with surrogateescape: bytes that are not UTF-8 arrive as lone surrogates
    raw = prompt.encode("utf-8", "surrogateescape")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadInput(
            f"prompt {index} is not valid UTF-8 (byte {raw[error.start]:#04x} at byte {error.start}): "
            "pass prompts as UTF-8 text"
        ) from None


if __name__ == "__main__":
    sys.exit(main())
