"""Command lines' errors in the words the user typed: the flag, not the setting's Python name."""

from __future__ import annotations

import argparse
import re


def name_the_flag(parser: argparse.ArgumentParser, message: str) -> str:
    """The engine's message about a setting (`max_num_seqs must be ...`) led by the flag that set it
    (`--max-num-seqs: max_num_seqs must be ...`): the user typed the flag, not the setting's name."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    setting = re.match(r"[a-z_]+", message)
    flag = flags.get(setting.group()) if setting else None
    return f"{flag}: {message}" if flag else message


def dashed_flags(argv: list[str]) -> list[str]:
    """`argv` with each flag's underscores as dashes (`--max_model_len=512` -> `--max-model-len=512`), as vLLM's
    command line reads them; its values, and everything after a bare `--`, as they are."""
    spelled = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return spelled + argv[index:]
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            arg = name.replace("_", "-") + equals + value
        spelled.append(arg)
    return spelled


# the settings that size an engine (its memory), whose flags both command lines take under vLLM's names
# (--max-num-seqs -> max_num_seqs): passed to the engine only when given, the engine's own defaults (per device)
# applying otherwise; --enforce-eager (a switch, always passed) sizes it too
SIZING_SETTINGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "num_kvcache_blocks",
    "gpu_memory_utilization",
)


def add_sizing_flags(group: argparse._ActionsContainer) -> None:
    """The flags of SIZING_SETTINGS and --enforce-eager, the same in `python -m nanoref` and `python -m nanoref.serve`:
    what bounds an engine's memory on a small GPU. The engine checks their values (its messages, led by the flag)."""
    group.add_argument("--max-num-seqs", type=int, default=None, help="requests per step (default: per device)")
    group.add_argument(
        "--max-num-batched-tokens",
        type=human_readable_int,
        default=None,
        help="tokens per step, e.g. 8192, 8k or 8K (default: per device)",
    )
    group.add_argument(
        "--max-model-len",
        type=human_readable_int,
        default=None,
        help="the longest prompt + completion, in tokens, e.g. 32768, 32k (32,000) or 32K (32,768) (default: the "
        "model's limit, capped at 4096)",
    )
    group.add_argument("--num-kvcache-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: the share of the whole GPU's memory in use once the KV cache is made, memory other processes "
        "hold included (Nano-vLLM's rule; default 0.9); a CPU ignores it, as vLLM's does: its KV cache holds "
        "max-num-seqs full-length sequences, at most a quarter of the free RAM (--num-kvcache-blocks sets it)",
    )
    group.add_argument(
        "--enforce-eager", action="store_true", help="run decode steps eagerly, without CUDA graphs (CUDA only)"
    )


def human_readable_int(value: str) -> int:
    """vLLM's token counts on the command line: an integer, or one with a suffix, k / m / g (10**3, 10**6, 10**9:
    "25.6k" is 25,600) or K / M / G (2**10, 2**20, 2**30, whole numbers only: "32K" is 32,768)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", value.strip())
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer (or one like 8k or 32K): {value!r}") from None
    number, suffix = match.groups()
    if suffix.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"a binary suffix ({suffix}) takes a whole number, got {value!r}")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    return int(float(number) * scale) if suffix.islower() else int(number) * scale
