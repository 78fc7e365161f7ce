"""Exercise checks draw fresh inputs on every call without touching the learner's global RNG."""

from __future__ import annotations

import pytest
import torch

from nanoref import exercises
from nanoref.engine.model_runner import pad_decode_batch
from nanoref.exercises.common import input_generator
from nanoref.layers.activation import silu_and_mul
from nanoref.layers.embed_head import vocab_parallel_embed
from nanoref.layers.rotary import apply_rotary
from nanoref.layers.sampler import apply_top_k_top_p
from nanoref.models.qwen3_moe import moe_experts, route

# the checks whose inputs are fresh on every call (the others take a fixed seed), with nanoref's own answers
FRESH_CHECKS = {
    "apply_rotary": apply_rotary,
    "silu_and_mul": silu_and_mul,
    "apply_top_k_top_p": apply_top_k_top_p,
    "pad_decode_batch": pad_decode_batch,
    "vocab_parallel_embed": vocab_parallel_embed,
    "moe_route": route,
    "moe_experts": moe_experts,
}


@pytest.mark.parametrize("name", sorted(FRESH_CHECKS))
def test_a_check_leaves_the_global_rng_alone(name):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    getattr(exercises, f"check_{name}")(FRESH_CHECKS[name], engine=False)
    assert torch.equal(torch.get_rng_state(), state), f"check_{name} drew from torch's global RNG"


def test_input_generator_is_fresh_per_call_and_seedable():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    draws = [torch.randint(0, 2**31, (4,), generator=input_generator()).tolist() for _ in range(3)]
    assert len({tuple(d) for d in draws}) == 3, "unseeded checks must see other inputs on every call"
    assert torch.equal(torch.get_rng_state(), state)
    a, b = (torch.randn(4, generator=input_generator(seed=5)) for _ in range(2))
    assert torch.equal(a, b), "a seeded check (hidden tests) must see the same inputs every time"
