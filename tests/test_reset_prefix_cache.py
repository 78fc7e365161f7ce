"""`LLM.reset_prefix_cache()` (vLLM's): after it no request reads K/V computed before it; while a request still holds
blocks it changes nothing and says so."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams

from .helpers import assert_matches_hf, assert_no_block_leaked, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def cached_tokens(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY, **kwargs) -> tuple[list[int], int]:
    out = llm.generate([prompt], params, use_tqdm=False, **kwargs)[0]
    return out["token_ids"], out.num_cached_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_after_a_reset_a_replayed_prompt_is_computed_again(tiny_model, overlap):
    prompt = random_prompts(seed=60, lengths=[40])[0]  # 2 full blocks of 16 the cache can serve
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16, overlap_scheduling=overlap)
    first, hits = cached_tokens(llm, prompt)
    assert hits == 0
    again, hits = cached_tokens(llm, prompt)
    assert hits == 32 and again == first  # (the control: the cache serves a replay)
    assert llm.reset_prefix_cache() is True
    assert_no_block_leaked(llm)  # (no block lost: every one free, the counts consistent)
    after, hits = cached_tokens(llm, prompt)
    assert hits == 0, "a prompt replayed after reset_prefix_cache was served from the cache"
    assert_matches_hf(tiny_model, [prompt], [{"token_ids": after}], 6)
    assert cached_tokens(llm, prompt)[1] == 32  # what it computed after the reset is cached again


def test_a_reset_forgets_every_salts_cache(tiny_model):
    prompt = random_prompts(seed=61, lengths=[40])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    for _ in range(2):
        hits = llm.generate([salted], GREEDY, use_tqdm=False)[0].num_cached_tokens
    assert hits == 32
    assert llm.reset_prefix_cache() is True
    assert llm.generate([salted], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_reset_while_a_request_holds_blocks_changes_nothing_and_warns(tiny_model):
    prompt, other = random_prompts(seed=62, lengths=[40, 20])
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    cached_tokens(llm, prompt)  # its blocks now cached
    llm.add_request(other, GREEDY)
    llm.step()  # `other` holds its two blocks (20 prompt tokens and the first one it generates)
    with pytest.warns(RuntimeWarning, match=r"unfinished requests still hold KV blocks \(2\); nothing was reset"):
        assert llm.reset_prefix_cache() is False
    while not llm.is_finished():
        llm.step()
    assert cached_tokens(llm, prompt)[1] == 32, "a refused reset still emptied the cache"
    assert llm.reset_prefix_cache() is True  # (once the request is done)
    assert cached_tokens(llm, prompt)[1] == 0


def test_a_draft_model_after_a_reset_still_decodes_hfs_tokens(tiny_model):
    """The draft's K/V sits in the target's blocks, trusted where it recorded a block's tokens: a reset gives every
    block new (empty) tokens, so no record of a block before it matches after."""
    from nanoref.testing import EVERY_STEP

    spec = {"model": tiny_model, "num_speculative_tokens": 3, **EVERY_STEP}
    prompt = random_prompts(seed=63, lengths=[40])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hits = []
    for reset in (False, True, False):  # a cold run, a run after a reset, then a replay the cache serves
        if reset:
            assert llm.reset_prefix_cache() is True
        tokens, hit = cached_tokens(llm, prompt, params)
        assert_matches_hf(tiny_model, [prompt], [{"token_ids": tokens}], 12)
        hits.append(hit)
    assert hits == [0, 0, 32]


def test_a_reset_waits_for_a_step_in_flight_on_another_thread(tiny_model):
    """AsyncLLM's thread form steps the engine on its own thread: a reset must not run between a step's admission
    and its forward (it would clear the hashes of blocks just handed out as hits)."""
    import threading

    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    results = []
    with llm._lock:  # (a step holds it from scheduling to its outputs)
        other = threading.Thread(target=lambda: results.append(llm.reset_prefix_cache()))
        other.start()
        other.join(timeout=0.5)
        assert other.is_alive() and not results, "reset_prefix_cache ran while a step held the engine"
    other.join(timeout=30)
    assert results == [True]
