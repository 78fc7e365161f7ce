"""A learner with a GPU: every exercise check accepts nanoref's own answer with the engine on CUDA (compiled Triton
kernels read GPU memory; the engine compares with HF in float32). Marked `gpu`; the CPU runs the same checks in the
test_exercises_*.py files."""

from __future__ import annotations

import pytest

from nanoref import exercises
from nanoref.utils.seams import SEAMS

from .helpers import own_answers

pytestmark = pytest.mark.gpu


# a check's engine run that needs an optional package: skipped, naming it, where that package is not installed
NEEDS = {"apply_token_bitmask": "xgrammar"}


@pytest.mark.parametrize("name", list(SEAMS))
def test_every_check_accepts_nanorefs_own_answer_on_a_gpu(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"check_{name} runs structured output, which needs {NEEDS[name]}")
    answers = own_answers()
    assert name in answers, f"seam {name!r} has no answer in this test: add it"
    getattr(exercises, f"check_{name}")(answers[name])
