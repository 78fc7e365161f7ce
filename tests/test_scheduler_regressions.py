"""Regressions for the failure modes Nano-vLLM-style engines are known for.

A prompt served entirely from the prefix cache, prefix-cache state after preemption, a preempted
sequence that comes back through the prefix cache, prompts at and past max_model_len, requests
that fit only thanks to max_model_len, and the decode CUDA-graph batch buckets.
"""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.cuda_graphs import batch_buckets
from nanoref.engine.block_manager import chain_hash

from .helpers import hf_greedy, random_prompts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_clean(llm: LLM) -> None:
    manager = llm.scheduler.block_manager
    manager.check_invariants([])
    assert llm.is_finished() and manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize(
    "length,cached,computed",
    [
        (32, 16, 16),  # whole blocks: the last block is recomputed, so the query is never empty
        (33, 32, 1),  # one token past the blocks: a one-token query over 32 cached tokens
    ],
)
def test_prompt_entirely_in_prefix_cache(tiny_model, length, cached, computed):
    """The same prompt twice: the second time every block but the one holding the last token is a hit,
    and the output is the same."""
    prompt = random_prompts(seed=30, lengths=[length])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    first = llm.generate([prompt], greedy(6), use_tqdm=False)
    second = llm.generate([prompt], greedy(6), use_tqdm=False, return_metrics=True)
    prefill = llm.metrics.steps[0]
    assert (prefill.kind, prefill.num_tokens, prefill.num_hit_tokens) == ("prefill", computed, cached)
    assert second[0]["metrics"].num_cached_tokens == cached
    assert second[0]["token_ids"] == first[0]["token_ids"] == hf_greedy(tiny_model, prompt, 6)
    assert_clean(llm)


def test_same_prompt_while_the_first_is_still_decoding(tiny_model):
    """The second request shares the first's blocks (ref count 2) while both decode; neither writes
    into a shared block, so both produce the single-request output."""
    prompt = random_prompts(seed=31, lengths=[40])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    a = llm.add_request(prompt, greedy(8))
    llm.step()  # a's prefill: its two full blocks are now in the cache
    llm.step()  # a decodes once
    b = llm.add_request(prompt, greedy(8))
    _, record = llm.step()
    assert (record.kind, record.seqs, record.num_hit_tokens) == ("prefill", [(b.seq_id, 8)], 32)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert [llm.scheduler.block_manager.blocks[i].ref_count for i in shared] == [2, 2]
    while not llm.is_finished():
        llm.step()
    expected = hf_greedy(tiny_model, prompt, 8)
    assert a.completion_token_ids == b.completion_token_ids == expected
    assert_clean(llm)


# Three 20-token prompts asking for 40 tokens each, 16-token blocks and only 6 KV blocks. Worked out
# by hand: the prefill takes 2 blocks each (all 6). After 12 decode steps every sequence holds 33
# tokens and needs a third block: the newest (request 2) is preempted. At 49 tokens request 0 needs a
# fourth: request 1 is preempted, its third block (partial, never hashed) goes to request 0, its two
# full blocks stay in the free list with their hashes. When request 0 finishes, request 1 comes back:
# 32 of its 49 tokens (the prompt and 12 generated tokens) are prefix-cache hits, 17 are recomputed.
def preemption_workload(tiny_model) -> tuple[LLM, list[list[int]], SamplingParams]:
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=6, kvcache_block_size=16, max_num_seqs=8)
    return llm, random_prompts(seed=32, lengths=[20, 20, 20]), greedy(40)


def test_prefix_cache_state_after_preemption(tiny_model):
    llm, prompts, params = preemption_workload(tiny_model)
    seqs = [llm.add_request(p, params) for p in prompts]
    manager = llm.scheduler.block_manager
    victims = []
    while len(victims) < 2:
        _, record = llm.step()
        victims += record.preempted
    assert victims == [seqs[2].seq_id, seqs[1].seq_id] and record.index == 29
    victim = seqs[1]
    assert victim.block_table == [] and victim.num_computed_tokens == 0 and victim.num_hashed_blocks == 0
    assert victim.num_tokens == 49 and list(llm.scheduler.waiting) == [victim, seqs[2]]
    # its full blocks stay cached (ref count 0, in the free list), under the hashes of its own tokens
    h0 = chain_hash(victim.token_ids[:16])
    h1 = chain_hash(victim.token_ids[16:32], h0)
    for h in (h0, h1):
        block = manager.blocks[manager.hash_to_block_id[h]]
        assert block.ref_count == 0 and block.block_id in manager.free_block_ids
    manager.check_invariants([s for s in seqs if s.block_table])


def test_preempted_sequence_comes_back_through_prefix_cache(tiny_model):
    llm, prompts, params = preemption_workload(tiny_model)
    out = llm.generate(prompts, params, use_tqdm=False, return_metrics=True)
    ids = [o["metrics"].seq_id for o in out]
    steps = llm.metrics.steps
    assert [(r.index, r.preempted) for r in steps if r.preempted] == [(13, [ids[2]]), (29, [ids[1]])]
    comeback = steps[40]  # request 0 finished in step 39 (1 + 39 tokens)
    assert (comeback.kind, comeback.seqs, comeback.num_hit_tokens) == ("prefill", [(ids[1], 17)], 32)
    assert comeback.num_hit_tokens > len(prompts[1])  # hits reach into tokens it had generated itself
    assert [o["metrics"].num_preemptions for o in out] == [0, 1, 1]
    assert sum(r.num_preemptions for r in steps) == llm.scheduler.num_preemptions == 2
    for prompt, output in zip(prompts, out):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, 40)
    assert_clean(llm)


def test_prompt_lengths_at_max_model_len(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=8, max_model_len=32)
    longest = random_prompts(seed=33, lengths=[31])[0]
    out = llm.generate([longest], greedy(10), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 1  # 31 + 1 = max_model_len: one token, then stop
    for length in (32, 100):
        with pytest.raises(ValueError, match=f"the prompt has {length} tokens but max_model_len is 32"):
            llm.generate([list(range(length))], greedy(1), use_tqdm=False)
    assert llm.generate([longest], greedy(10), use_tqdm=False) == out
    assert_clean(llm)


def test_request_that_fits_only_because_of_max_model_len(tiny_model):
    """max_tokens far past the cache is fine when max_model_len caps the sequence inside it."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=4, max_model_len=64)  # 4 blocks = 64 tokens
    out = llm.generate([list(range(10))], greedy(1000), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 54
    other = LLM(tiny_model, device="cpu", num_kvcache_blocks=4, max_model_len=65)
    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        other.generate([list(range(10))], greedy(1000), use_tqdm=False)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8, 9, 16, 17, 31, 64, 100, 512])
def test_cuda_graph_buckets_cover_every_decode_batch(max_num_seqs):
    """Every decode batch size from 1 to max_num_seqs has a bucket that holds it (pure: no GPU needed)."""
    buckets = batch_buckets(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs and buckets[0] == 1
    for batch in range(1, max_num_seqs + 1):
        bucket = min(b for b in buckets if b >= batch)
        assert bucket - batch < 16  # padding stays bounded


def test_prefill_admits_up_to_max_num_seqs(tiny_model):
    """Sequences admitted in a step count once against max_num_seqs (not once queued and again running)."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16, max_num_seqs=4)
    out = llm.generate(random_prompts(seed=34, lengths=[5] * 6), greedy(3), use_tqdm=False, return_metrics=True)
    first = llm.metrics.steps[0]
    assert (first.kind, first.num_seqs, first.num_waiting) == ("prefill", 4, 2)
    assert max(r.num_seqs for r in llm.metrics.steps) == 4
    assert [len(o["token_ids"]) for o in out] == [3] * 6
