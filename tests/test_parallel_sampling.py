"""n samples of one prompt: one prefill of the prompt shared through the prefix cache, seeds seed + i, and
generate's "outputs" list."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nanoref import LLM, SamplingParams
from nanoref.serving.async_llm import AsyncLLM

from .helpers import assert_no_block_leaked, random_prompts


def prefill_tokens(llm) -> int:
    return sum(step.num_tokens for step in llm.metrics.steps if step.kind == "prefill")


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_four_samples_prefill_their_prompt_about_once(tiny_model, overlap):
    llm = LLM(tiny_model, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, overlap_scheduling=overlap)
    prompt = random_prompts(seed=1, lengths=[70])[0]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, n=4, ignore_eos=True), use_tqdm=False)
    assert prefill_tokens(llm) < 2 * len(prompt)  # 4 separate prefills would compute 4x
    assert [sample["index"] for sample in out[0]["outputs"]] == [0, 1, 2, 3]
    assert len({tuple(sample["token_ids"]) for sample in out[0]["outputs"]}) > 1, "temperature 1 samples differ"
    assert_no_block_leaked(llm)


def alone(folder, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each sample of `params` (n of them, seeded) run as a request of its own, seed + i, on an engine with no
    prefix cache: no sample reads blocks another computed."""
    llm = LLM(folder, device="cpu", num_kvcache_blocks=64, enable_prefix_caching=False)
    each = [replace(params, n=1, seed=params.seed + i) for i in range(params.n)]
    return [out["token_ids"] for out in llm.generate([prompt] * params.n, each, use_tqdm=False)]


def test_samples_sharing_their_prompt_equal_each_sample_run_alone(tiny_model):
    # (greedy takes only n=1, as in vLLM: seeded samples, each compared to its own seed run alone)
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    prompts = random_prompts(seed=2, lengths=[21, 40])
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, n=3, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.block_manager.num_hit_blocks >= 2 * 2, "samples 1 and 2 read sample 0's prompt blocks"
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == output["outputs"][0]["token_ids"]
        assert [sample["token_ids"] for sample in output["outputs"]] == alone(tiny_model, prompt, params)
    assert_no_block_leaked(llm)


def test_sample_i_of_a_seeded_request_is_the_request_seeded_seed_plus_i(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    prompt = random_prompts(seed=3, lengths=[30])[0]
    together = llm.generate([prompt], SamplingParams(max_tokens=8, seed=7, n=3, ignore_eos=True), use_tqdm=False)
    for i, sample in enumerate(together[0]["outputs"]):
        alone = llm.generate([prompt], SamplingParams(max_tokens=8, seed=7 + i, ignore_eos=True), use_tqdm=False)
        assert sample["token_ids"] == alone[0]["token_ids"]


def test_n_with_preemption_stays_exact_and_leaks_no_block(tiny_model):
    llm = LLM(tiny_model, device="cpu", kvcache_block_size=16, num_kvcache_blocks=10)
    prompts = random_prompts(seed=4, lengths=[40, 35])
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=40, n=3, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(step.preempted for step in llm.metrics.steps), "the KV budget was meant to force preemption"
    for prompt, output in zip(prompts, outputs):
        assert [sample["token_ids"] for sample in output["outputs"]] == alone(tiny_model, prompt, params)
    assert_no_block_leaked(llm)


def test_n_1_output_has_no_outputs_list(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert set(out) == {"text", "token_ids", "finish_reason"}


def test_aborting_sample_0_before_its_prefill_drops_nothing_and_leaks_nothing(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    samples = llm.add_samples([5] * 20, SamplingParams(temperature=1.0, max_tokens=4, n=3, ignore_eos=True))
    llm.abort_request(samples[0])  # the others wait for nothing now: they are queued and run
    while not llm.is_finished():
        llm.step()
    assert [seq.finish_reason for seq in samples] == ["abort", "length", "length"]
    assert_no_block_leaked(llm)


def test_greedy_sampling_takes_only_n_1_as_vllm_and_a_refused_request_queues_nothing(tiny_model):
    """vLLM's `_verify_greedy_sampling`: temperature 0 with n > 1 is a ValueError in its words (the samples would all
    be the same); the engine checks again (a field reassigned after the params were made) before queuing anything."""
    with pytest.raises(ValueError, match=r"^n must be 1 when using greedy sampling, got 2\.$"):
        SamplingParams(temperature=0, n=2)
    assert SamplingParams(temperature=0, n=1).n == 1 and SamplingParams(temperature=0.01, n=2).n == 2
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    params = SamplingParams(temperature=1.0, max_tokens=2, n=3)
    params.temperature = 0
    with pytest.raises(ValueError, match=r"n must be 1 when using greedy sampling, got 3\."):
        llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    with pytest.raises(ValueError, match=r"n must be 1 when using greedy sampling, got 3\."):
        llm.add_samples([1, 2, 3], params)
    assert llm.is_finished() and not llm.output_processor.held_samples
    assert_no_block_leaked(llm)

    engine = AsyncLLM(llm)
    try:
        with pytest.raises(ValueError, match=r"n must be 1 when using greedy sampling, got 3\."):
            engine.generate([1, 2, 3], params)
        assert engine._engine._inbox.empty() and not engine._requests and llm.is_finished()
    finally:
        engine.close()
