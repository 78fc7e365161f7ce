"""End to end: nanoref's greedy output is token-exact with HF transformers `generate`."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.utils.context import Context, reset_context, set_context

from .helpers import (
    TINY_CONFIGS,
    assert_exact_across_cached_calls,
    assert_exact_through_preemption,
    assert_matches_hf,
    assert_no_block_leaked,
    hf_model,
    random_prompts,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_matches_hf_ample_memory(tiny_models, name):
    folder = tiny_models[name]
    prompts = random_prompts(seed=1, lengths=[1, 7, 16, 17, 33, 50])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=256)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(folder, prompts, outputs, GREEDY.max_tokens)
    assert_no_block_leaked(llm)


# block size 32 in the slow suite: 16 chunks the same prompts in the quick loop
@pytest.mark.parametrize("block_size", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_greedy_matches_hf_chunked_prefill(tiny_model, block_size):
    """A token budget smaller than the prompts: every prompt is prefilled in several chunks."""
    prompts = random_prompts(seed=2, lengths=[45, 30, 70, 9])
    llm = LLM(
        tiny_model, device="cpu", num_kvcache_blocks=128, max_num_batched_tokens=13, kvcache_block_size=block_size
    )
    steps = []
    original_schedule = llm.scheduler.schedule

    def recording_schedule():
        seqs, is_prefill = original_schedule()
        steps.append((is_prefill, [seq.num_scheduled_tokens for seq in seqs]))
        return seqs, is_prefill

    llm.scheduler.schedule = recording_schedule
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_model, prompts, outputs, GREEDY.max_tokens)
    prefill_steps = [tokens for is_prefill, tokens in steps if is_prefill]
    assert all(sum(tokens) <= 13 for tokens in prefill_steps)
    assert len(prefill_steps) >= sum(len(p) for p in prompts) // 13  # the prompts really were split
    assert_no_block_leaked(llm)


# the quick loop's token-exact preemption tests: test_scheduler_regressions.py's
# test_preempted_sequence_comes_back_through_prefix_cache (recompute through the prefix cache) and
# test_overlap.py's test_overlapped_greedy_under_preemption[gqa1-tied] (a tied head)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa2-untied", "gqa1-tied"])
def test_greedy_matches_hf_under_preemption(tiny_models, name):
    """So few KV blocks that decode must preempt; prompts share prefixes, so recompute hits the cache."""
    assert_exact_through_preemption(
        tiny_models[name], suffix_lens=[5, 12, 20, 3, 9, 27], max_tokens=40, num_kvcache_blocks=12, max_num_seqs=8
    )


def test_prefix_cache_hits_across_calls_keep_output_exact(tiny_model):
    assert_exact_across_cached_calls(tiny_model, GREEDY.max_tokens)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_prefill_logits_allclose_hf(tiny_models, name):
    folder = tiny_models[name]
    prompts = random_prompts(seed=6, lengths=[3, 21, 40])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=32)
    runner = llm.model_runner
    ids = torch.tensor([t for p in prompts for t in p])  # (N,)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])  # (N,)
    cu = torch.tensor([0] + [sum(len(p) for p in prompts[: i + 1]) for i in range(len(prompts))], dtype=torch.int32)
    max_len = max(len(p) for p in prompts)
    set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len))
    try:
        with torch.inference_mode():
            hidden = runner.model(ids, positions)  # (N, hidden)
            set_context(Context(is_prefill=False))  # every row: logits for all tokens
            logits = runner.model.compute_logits(hidden)  # (N, vocab)
    finally:
        reset_context()
    hf = hf_model(folder)
    for prompt, start in zip(prompts, cu[:-1].tolist()):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]  # (L, vocab)
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, rtol=1e-4, atol=1e-4)
