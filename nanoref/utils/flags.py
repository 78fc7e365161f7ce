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
