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
    "num_gpu_blocks_override",
    "gpu_memory_utilization",
)


# the engine flags both command lines take, under vLLM's names, beside the sizing ones: passed to the engine as
# they are (their defaults are the engine's own)
SHARED_SETTINGS = ("device", "dtype", "attention_backend", "kv_cache_dtype", "tensor_parallel_size", "enforce_eager")


def add_engine_flags(group: argparse._ActionsContainer, tensor_parallel_note: str = "") -> None:
    """The engine's flags of `python -m nanoref` and `python -m nanoref.serve`, defined once: --device, --dtype, the
    sizing flags (add_sizing_flags), --tensor-parallel-size (-tp), --seed, --attention-backend and --kv-cache-dtype.
    tensor_parallel_note: what one command adds to --tensor-parallel-size's help."""
    group.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or auto (vLLM's: cuda when available; the default, unless the environment's NANOREF_DEVICE "
        "names another)",
    )
    group.add_argument(
        "--dtype",
        default=None,
        help="auto, float32 (= float), float16 (= half) or bfloat16 (default auto: on CUDA the checkpoint's float16 or "
        "bfloat16, else bfloat16, and float16 on a GPU without bfloat16, before compute capability 8.0; float32 on a "
        "CPU)",
    )
    add_sizing_flags(group)
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many ranks (one per GPU, or gloo processes on a CPU; default 1)"
        + tensor_parallel_note,
    )
    group.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the engine's generator, which every request without a seed of its own draws from: the same "
        "seed and requests, the same tokens; an integer in [-2**63, 2**64) (default: fresh entropy, so runs differ; "
        "vLLM's default is 0, the same tokens every run: --seed 0 does that)",
    )
    group.add_argument(
        "--attention-backend",
        type=attention_backend_name,
        default="auto",
        help="auto, torch, triton, cpp, flash_attn or flash_attn+triton; in any case, and vLLM's names FLASH_ATTN and "
        "TRITON_ATTN too",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: K/V stored as 8-bit floats, half the memory",
    )


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine's settings from add_engine_flags' flags: SHARED_SETTINGS as given, and SIZING_SETTINGS and the
    seed only where given (the engine's own defaults, per device, otherwise)."""
    given = (name for name in (*SIZING_SETTINGS, "seed") if getattr(args, name) is not None)
    return {**{name: getattr(args, name) for name in SHARED_SETTINGS}, **{name: getattr(args, name) for name in given}}


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
        "model's limit, capped at 4096; vLLM's default is the model's limit uncapped: give it for more)",
    )
    group.add_argument("--num-kvcache-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    group.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="vLLM's name for --num-kvcache-blocks (give one)"
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: the share of the whole GPU's memory in use once the KV cache is made, memory other processes "
        "hold included (Nano-vLLM's rule; default 0.9); a CPU ignores it, as vLLM's does: its KV cache holds "
        "max-num-seqs full-length sequences, at most a quarter of the free RAM (--num-kvcache-blocks sets it)",
    )
    group.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run decode steps eagerly, without CUDA graphs (CUDA only)",
    )


# vLLM's --attention-backend names (its enum's, which its flag reads in any case) whose nanoref backend is another name
VLLM_ATTENTION_BACKENDS = {"triton_attn": "triton"}


def attention_backend_name(value: str) -> str:
    """--attention-backend's value as the engine names it: nanoref's names and vLLM's (FLASH_ATTN, TRITON_ATTN) in any
    case, as vLLM's flag reads them (lower-cased; the engine's error names one it does not know)."""
    lowered = value.lower()
    return VLLM_ATTENTION_BACKENDS.get(lowered, lowered)


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
