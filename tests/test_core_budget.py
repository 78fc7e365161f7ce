"""The core stays the size a learner reads beside Nano-vLLM's: the five files of the same roles hold at most
CORE_BUDGET code lines together, and `LLMEngine.step` at most STEP_BUDGET (features live in their own modules)."""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from pathlib import Path

import nanoref
from nanoref.engine.llm_engine import LLMEngine

CORE = ["sequence", "block_manager", "scheduler", "model_runner", "llm_engine"]
CORE_BUDGET = 730
STEP_BUDGET = 12
SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """The lines that hold code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docstrings)
    return len(lines)


def test_code_lines_counts_code_only():
    source = (
        '"""A module."""\n\n# a comment\ndef f(x):\n    """Its docstring,\n    two lines."""\n'
        "    return (x +\n            1)  # why\n"
    )
    assert code_lines(source) == 3  # def, and the return's two lines


def test_the_five_core_files_stay_within_their_budget():
    engine = Path(nanoref.__file__).parent / "engine"
    counts = {name: code_lines((engine / f"{name}.py").read_text()) for name in CORE}
    assert sum(counts.values()) <= CORE_BUDGET, f"{counts}: {sum(counts.values())} code lines > {CORE_BUDGET}"


def test_llm_engine_step_stays_short():
    lines = code_lines(textwrap.dedent(inspect.getsource(LLMEngine.step)))
    assert lines <= STEP_BUDGET, f"LLMEngine.step has {lines} code lines > {STEP_BUDGET}"
