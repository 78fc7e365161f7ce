"""Speculative decoding on CUDA: the verify step (eager, varlen) and a draft's decode steps (its own CUDA graphs)."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.testing import EVERY_STEP

from .helpers import assert_matches_hf, assert_no_block_leaked, random_prompts
from .test_speculative import repetitive_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_greedy_on_cuda_equals_hf(tiny_models, backend, proposer):
    target, draft = tiny_models["gqa2-untied"], tiny_models["gqa4-bias"]
    if proposer == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4, **EVERY_STEP, "prompt_lookup_max": 3}
    else:
        spec = {
            "model": target,
            "num_speculative_tokens": 3,
            **EVERY_STEP,
        }  # (tiny models share their 256-token vocabulary)
    llm = LLM(target, device="cuda", dtype="float32", attention_backend=backend, speculative_config=spec,
              num_kvcache_blocks=64)  # fmt: skip
    if proposer == "draft":
        assert llm.model_runner.draft.decode_graphs is not None, "the draft's decode steps should replay graphs"
    prompts = repetitive_prompts(0, 4) + random_prompts(1, [7, 40])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(target, prompts, outputs, params.max_tokens)
    assert sum(step.num_accepted_tokens for step in llm.metrics.steps) > 0
    assert_no_block_leaked(llm)
    # a draft with other weights: proposals rejected, output still the target's
    other = LLM(target, device="cuda", dtype="float32", attention_backend=backend, num_kvcache_blocks=64,
                speculative_config={"model": draft, "num_speculative_tokens": 3, **EVERY_STEP})  # fmt: skip
    assert [o["token_ids"] for o in other.generate(prompts, params, use_tqdm=False)] == [
        o["token_ids"] for o in outputs
    ]


def test_speculative_sampling_on_cuda_in_bf16_runs_and_frees_its_blocks(tiny_model):
    llm = LLM(
        tiny_model, device="cuda", speculative_config={"model": tiny_model, "num_speculative_tokens": 4, **EVERY_STEP}
    )
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=3)
    first = llm.generate(random_prompts(2, [5, 9, 30]), params, use_tqdm=False)
    again = llm.generate(random_prompts(2, [5, 9, 30]), params, use_tqdm=False)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]  # seeded: the same tokens
    assert all(len(o["token_ids"]) == 32 or o["finish_reason"] == "stop" for o in first)
    assert_no_block_leaked(llm)


def test_the_policy_switches_between_overlapped_plain_steps_and_verify_steps_with_the_same_tokens(tiny_model):
    """Above disable_by_batch_size the speculative engine's decode steps run in the overlapped loop (one launched
    while the one before is postprocessed); once the batch shrinks, the step on the device is completed and verify
    steps take over. Greedy tokens are the plain engine's, and every block comes back."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 3, "min_tokens_per_step": 0}
    prompts = random_prompts(3, [5, 9, 30, 7, 12, 20])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 30, 40, 50)]
    # (a fixed cache and batch: two engines sized from the free memory and captured up to 512 rows took 31 s here)
    settings = dict(device="cuda", num_kvcache_blocks=64, max_num_seqs=16)
    expected = LLM(tiny_model, **settings).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model, speculative_config=spec, **settings)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    decode = [step for step in llm.metrics.steps if step.kind == "decode"]
    verify = [any(n > 1 for _, n in step.seqs) for step in decode]
    assert any(verify) and not all(verify), "both kinds of step should have run"
    assert all(not v for step, v in zip(decode, verify) if step.num_seqs > 3), "above the limit: plain steps"
    assert_no_block_leaked(llm)


def test_a_draft_proposes_its_k_tokens_with_one_host_sync(tiny_model):
    """The draft's k steps queue on the device one after another (each reads the ids the step before sampled where
    they are): the host waits once per verify step for the proposals, not once per draft step (a round trip per
    step cost about a plain decode step each at batch 1 on an H100)."""
    import warnings

    import torch

    spec = {"model": tiny_model, "num_speculative_tokens": 4, **EVERY_STEP}
    llm = LLM(tiny_model, device="cuda", dtype="float32", num_kvcache_blocks=64, speculative_config=spec)
    proposer = llm.speculative_loop.proposer
    propose, syncs = proposer.propose, []

    def counting(seqs, limits, sample):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                proposals = propose(seqs, limits, sample)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        return proposals

    proposer.propose = counting
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=1, ignore_eos=True)
    llm.generate(random_prompts(3, [5, 9, 30]), params, use_tqdm=False)
    assert len(syncs) > 2 and max(syncs[1:]) == 1, syncs  # (the first may compile)
