"""The prefix cache is keyed to the forward that made it: K/V computed inside a `use(...)` block never serves a step
outside it (nor the reverse), however the engine is driven: generate, add_request/step, requests queued before the
block, a prompt chunked across the block's end, the overlapped loop."""

from __future__ import annotations

import pytest

from nanoref.utils import seams

from .helpers import assert_matches_hf, assert_no_block_leaked, random_prompts
from .test_seams_scope import GREEDY, engine, run_steps, under_wrong, wrong_rms_norm


@pytest.mark.parametrize("overlap", [False, True])
def test_kv_stepped_under_use_is_never_served_to_a_later_plain_call(tiny_model, overlap):
    prompt = random_prompts(seed=42, lengths=[40])[0]  # 2 full blocks the cache could serve
    llm = engine(tiny_model, overlap_scheduling=overlap)
    with seams.use(rms_norm=wrong_rms_norm):
        llm.add_request(prompt, GREEDY)
        run_steps(llm)
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_model, [prompt], outputs, 6)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_queued_before_the_block_neither_serves_nor_is_served_across_it(tiny_model, overlap):
    """generate inside the block finds the engine busy with a plain request: it must still not hit the plain K/V
    cached before, and the K/V it computes must not serve the plain calls after it."""
    cached, queued = random_prompts(seed=43, lengths=[40, 37])
    llm = engine(tiny_model, overlap_scheduling=overlap)
    llm.generate([cached], GREEDY, use_tqdm=False)  # nanoref's K/V of `cached` in the cache
    llm.add_request(queued, GREEDY)  # queued outside the block, run inside it
    with seams.use(rms_norm=wrong_rms_norm):
        inside = llm.generate([cached], GREEDY, use_tqdm=False)
    assert inside == under_wrong(tiny_model, [cached]), "the learner's forward was served nanoref's K/V"
    after = llm.generate([cached, queued], GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_model, [cached, queued], after, 6)
    assert_no_block_leaked(llm)


def test_a_prompt_chunked_across_the_end_of_a_block_publishes_no_mixed_kv(tiny_model):
    """Chunked prefill: its first chunk runs inside use(...), the rest after it. Its later blocks attend to K/V of
    the learner's forward, so they belong to no forward's cache."""
    prompt = random_prompts(seed=44, lengths=[40])[0]
    llm = engine(tiny_model, max_num_batched_tokens=16)
    llm.add_request(prompt, GREEDY)
    with seams.use(rms_norm=wrong_rms_norm):
        llm.step()  # tokens 0..15: block 0, the learner's
    run_steps(llm)  # the rest under nanoref's forward
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_model, [prompt], outputs, 6)
    assert_no_block_leaked(llm)


def test_each_forward_still_hits_its_own_cached_prefix(tiny_model):
    """Keying costs no hits: inside the block the learner's K/V serves the learner's forward, and afterwards
    nanoref's K/V (cached before the block) still serves nanoref's."""
    prompt = random_prompts(seed=45, lengths=[40])[0]
    llm = engine(tiny_model)
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)
    with seams.use(rms_norm=wrong_rms_norm):
        first = llm.generate([prompt], GREEDY, use_tqdm=False)
        second = llm.generate([prompt], GREEDY, use_tqdm=False, return_metrics=True)
    assert first == [{k: v for k, v in second[0].items() if k != "metrics"}]
    assert second[0]["metrics"].num_cached_tokens == 32
    again = llm.generate([prompt], GREEDY, use_tqdm=False, return_metrics=True)
    assert again[0]["metrics"].num_cached_tokens == 32 and again[0]["token_ids"] == plain[0]["token_ids"]


def test_a_learners_prefix_lookup_hits_the_cache_of_a_learners_forward(tiny_model):
    """The capstone runs every exercise at once: a learner's find_cached_prefix (which knows only chain_hash) must
    still find the K/V the learner's forward cached."""
    from nanoref.engine.block_manager import find_cached_prefix

    prompt = random_prompts(seed=46, lengths=[40])[0]
    llm = engine(tiny_model)
    with seams.use(rms_norm=wrong_rms_norm, find_cached_prefix=lambda *args: find_cached_prefix(*args)):
        llm.generate([prompt], GREEDY, use_tqdm=False)
        again = llm.generate([prompt], GREEDY, use_tqdm=False, return_metrics=True)
    assert again[0]["metrics"].num_cached_tokens == 32
