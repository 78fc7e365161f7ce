"""Exercise checks leave the learner's global RNG alone; the unseeded ones draw fresh inputs on every call."""

from __future__ import annotations

import pytest
import torch

from nanoref import exercises
from nanoref.exercises.common import input_generator
from nanoref.utils.seams import SEAMS

from .helpers import own_answers


@pytest.mark.parametrize("name", list(SEAMS))
def test_a_check_leaves_the_global_rng_alone(name):
    answers = own_answers()
    if name not in answers and name in ("store_kvcache_kernel", "merge_splits"):
        pytest.skip(f"{name} is a Triton seam and Triton is not installed")
    assert name in answers, f"seam {name!r} has no answer in tests/helpers.py own_answers(): add it"
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    getattr(exercises, f"check_{name}")(answers[name], engine=False)
    assert torch.equal(torch.get_rng_state(), state), f"check_{name} drew from torch's global RNG"


def test_input_generator_is_fresh_per_call_and_seedable():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    draws = [torch.randint(0, 2**31, (4,), generator=input_generator()).tolist() for _ in range(3)]
    assert len({tuple(d) for d in draws}) == 3, "unseeded checks must see other inputs on every call"
    assert torch.equal(torch.get_rng_state(), state)
    a, b = (torch.randn(4, generator=input_generator(seed=5)) for _ in range(2))
    assert torch.equal(a, b), "a seeded check (hidden tests) must see the same inputs every time"
