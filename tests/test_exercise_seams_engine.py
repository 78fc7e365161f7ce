"""Every exercise seam is consulted by the engine inside `use(...)`, and only there; each has its checker."""

from __future__ import annotations

import functools

import pytest

import nanoref.exercises as exercises
from nanoref import LLM, SamplingParams
from nanoref.engine.block_manager import find_cached_prefix
from nanoref.engine.model_runner import prefill_metadata
from nanoref.engine.scheduler import choose_preemption_victim
from nanoref.exercises.common import random_prompts
from nanoref.layers.layernorm import add_rms_norm, rms_norm
from nanoref.ops import attention_torch
from nanoref.utils import seams

# a shared 70-token prefix (prefix-cache hits), and contexts past one 64-key tile (so decode can split)
PROMPTS = [list(range(5, 75)), list(range(5, 75)) + [3, 4, 5, 6, 7], [9, 8, 7]]


def defaults() -> dict:
    """seam -> (nanoref's own function, engine settings under which the engine reaches it)."""
    table = {
        "prefill_metadata": (prefill_metadata, {}),
        "rms_norm": (rms_norm, {}),
        "add_rms_norm": (add_rms_norm, {}),
        "paged_decode_attention": (attention_torch.paged_decode_attention, {}),
        "find_cached_prefix": (find_cached_prefix, {"max_num_batched_tokens": 80}),
        "choose_preemption_victim": (choose_preemption_victim, {"num_kvcache_blocks": 5}),  # preempts
    }
    try:
        from nanoref.ops import attention_triton
        from nanoref.ops.store_kvcache_triton import store_kvcache_kernel
    except ImportError:
        return table
    from nanoref.ops.triton_setup import kernel_device

    # the engine runs where the kernels do: the GPU they compile for, or the CPU under the interpreter (float32: the
    # comparison with nanoref's own output is token-exact)
    triton = {"attention_backend": "triton", "device": str(kernel_device()), "dtype": "float32", "enforce_eager": True}
    table["store_kvcache_kernel"] = (store_kvcache_kernel, triton)
    table["merge_splits"] = (attention_triton.merge_splits, triton)
    return table


class Counting:
    """Stands in for a seam's default and counts the engine's calls (or kernel launches) through it."""

    def __init__(self, function) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)

    def __getitem__(self, grid):  # a Triton kernel is launched as kernel[grid](...)
        self.calls += 1
        return self.function[grid]


@pytest.mark.parametrize("name", sorted(defaults()))
def test_the_engine_calls_a_seam_only_inside_use(tiny_model, name):
    default, settings = defaults()[name]
    llm = LLM(tiny_model, **{"num_kvcache_blocks": 32, **settings})
    params = SamplingParams(temperature=0, max_tokens=3)
    prompts = PROMPTS
    if name == "choose_preemption_victim":  # four requests growing in 5 blocks of 16: one must step back
        prompts, params = (
            random_prompts(seed=1234, lengths=[5, 23, 17, 40], vocab=256),
            SamplingParams(temperature=0, max_tokens=12),
        )
    reference = llm.generate(prompts, params, use_tqdm=False)
    counting = Counting(default)
    extra = {}
    if name == "merge_splits":  # splits only happen past one 64-key tile: force 2 per decode step
        from nanoref.ops import attention_triton

        extra["paged_decode_attention"] = functools.partial(attention_triton.paged_decode_attention, num_splits=2)
    with seams.use(**{name: counting}, **extra):
        replaced = llm.generate(prompts, params, use_tqdm=False)
    assert counting.calls, f"the engine never called seam {name!r}"
    assert replaced == reference, f"nanoref's own {name} through the seam changed the output"
    calls = counting.calls
    assert llm.generate(prompts, params, use_tqdm=False) == reference
    assert counting.calls == calls and not seams.active(), f"seam {name!r} was used outside the block"


def test_every_seam_has_a_checker():
    for name in seams.SEAMS:
        assert callable(getattr(exercises, f"check_{name}", None)), f"nanoref.exercises has no check_{name}"


def test_prefix_cache_is_not_shared_across_a_change_of_forward(tiny_model):
    """K/V cached by nanoref's forward must not serve a learner's forward (or the other way round): an idle engine
    forgets its cached prefixes when a `use(...)` block begins or ends."""

    def swapped_silu_and_mul(x):  # a plausible learner bug: gate and up swapped
        up, gate = x.chunk(2, dim=-1)
        return up * gate.sigmoid() * gate

    prompt = list(range(5, 75))  # 70 tokens: four full 16-token blocks the second call could hit
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(tiny_model, num_kvcache_blocks=32)
    plain = llm.generate([prompt], params, use_tqdm=False)
    with seams.use(silu_and_mul=swapped_silu_and_mul):
        fresh = LLM(tiny_model, num_kvcache_blocks=32).generate([prompt], params, use_tqdm=False)
        assert fresh != plain, "the swapped activation should change the tokens, or this test proves nothing"
        assert llm.generate([prompt], params, use_tqdm=False) == fresh, "K/V cached by the plain forward was reused"
    assert llm.generate([prompt], params, use_tqdm=False) == plain, "K/V cached inside use(...) was reused after it"
    llm.scheduler.block_manager.check_invariants()
