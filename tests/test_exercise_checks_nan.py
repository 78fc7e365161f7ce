"""Every check whose answer is a float tensor names NaN in it as an ExerciseFailure (never a raw error)."""

from __future__ import annotations

import functools

import pytest
import torch

from nanoref import exercises
from nanoref.utils.seams import SEAMS

from .helpers import own_answers

# seams whose answers hold no float tensor, so no NaN: ids, block ids, a sequence, int buffers, a Triton kernel,
# a stop string's place in a text, kept tokens and the acceptance rule's (bool, int64) pair
NO_FLOAT_ANSWER = {
    "prefill_metadata", "find_cached_prefix", "choose_preemption_victim", "pad_decode_batch",
    "find_stop_string", "stop_hold_back", "accept_greedy", "rejection_sample",
}  # fmt: skip
WRITES_INTO_ITS_LAST_ARGUMENT = {"merge_splits"}  # merge_splits(partial, lse, out) -> None
NOT_A_PYTHON_FUNCTION = {"store_kvcache_kernel"}  # a @triton.jit kernel: no Python wrapper can stand in for it


def nan_like(value):
    """value with every float tensor in it filled with NaN (ints, e.g. top-k ids, left as they are)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.full_like(value, torch.nan)
    if isinstance(value, tuple):
        return tuple(nan_like(v) for v in value)
    return value


def all_nan(name, fn):
    @functools.wraps(fn)
    def answer(*args, **kwargs):
        result = fn(*args, **kwargs)
        if name in WRITES_INTO_ITS_LAST_ARGUMENT:
            args[-1].fill_(torch.nan)
        return nan_like(result)

    return answer


@pytest.mark.parametrize("name", sorted(set(SEAMS) - NO_FLOAT_ANSWER - NOT_A_PYTHON_FUNCTION))
def test_an_all_nan_answer_is_an_exercise_failure_naming_nan(name):
    answers = own_answers()
    if name not in answers:
        pytest.skip(f"{name} is a Triton seam and Triton is not installed")
    with pytest.raises(exercises.ExerciseFailure, match="NaN"):
        getattr(exercises, f"check_{name}")(all_nan(name, answers[name]), engine=False)
