"""A notebook imports nanoref's function under an exercise's name to teach with it; the learner's answer cell then
defines its own. Where that cell failed, was deleted or moved below its test, the name still holds nanoref's, which
would pass every check (and nbgrader would give full marks): checked from a notebook cell, it fails, saying so."""

from __future__ import annotations

import importlib

import pytest

import nanoref.exercises as exercises
from nanoref.exercises import ExerciseFailure

from .helpers import needs_xgrammar

# the exercises whose notebook imports nanoref's function under the exercise's own name
SHADOWED = [
    ("rms_norm", "nanoref.layers.layernorm"),
    ("add_rms_norm", "nanoref.layers.layernorm"),
    ("apply_top_k_top_p", "nanoref.layers.sampler"),
    ("find_stop_string", "nanoref.engine.detokenizer"),
    ("stop_hold_back", "nanoref.engine.detokenizer"),
    ("accept_greedy", "nanoref.speculative.acceptance"),
    ("rejection_sample", "nanoref.speculative.acceptance"),
    pytest.param("apply_token_bitmask", "nanoref.layers.logits_processors", marks=needs_xgrammar),
    ("lora_delta", "nanoref.ops.lora"),
]
NOTEBOOK_CELL = "/tmp/ipykernel_4242/0123456789.py"  # (the file name ipykernel compiles a cell under)


def run_as_a_cell(source: str, namespace: dict) -> None:
    exec(compile(source, NOTEBOOK_CELL, "exec"), namespace)


@pytest.mark.parametrize(("name", "module"), SHADOWED)
def test_nanorefs_own_function_under_the_exercises_name_fails_from_a_notebook(name, module):
    namespace = {
        "check": getattr(exercises, f"check_{name}"),
        name: getattr(importlib.import_module(module), name),
        "nanorefs": getattr(importlib.import_module(module), name),
    }
    with pytest.raises(ExerciseFailure, match=rf"{name} here is nanoref's own \({module}\.{name}\), not your answer"):
        run_as_a_cell(f"check({name}, engine=False)", namespace)
    # the control: a function the cell defines (here one that calls nanoref's) is the learner's, and passes
    run_as_a_cell(f"def {name}(*args, **kwargs):\n    return nanorefs(*args, **kwargs)\ncheck({name}, engine=False)",
                  namespace)  # fmt: skip
