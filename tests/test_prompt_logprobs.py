"""Prompt log-probabilities (vLLM's `SamplingParams.prompt_logprobs`): each prompt token after the first scored on
the tokens before it, from the prefill's logits at every prompt position, against log_softmax of HF transformers'
logits over the whole prompt. Also where the engine would skip positions or compute them twice: a prompt already in
the prefix cache, a prompt split into chunks, n samples, preemption, the overlapped loop and other attention
backends.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.layers.logits_processors import TokenLogprobs
from nanoref.llm import DEFAULT_MODEL
from nanoref.ops import attention_cpp
from nanoref.serving.async_llm import AsyncLLM

from .helpers import assert_no_block_leaked, hf_model, random_prompts

MAX_TOKENS = 4


def hf_prompt_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, V): log_softmax of HF's logits at positions 0..P-2, which score prompt tokens 1..P-1."""
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def assert_equal_to_hf(folder, prompt: list[int], entries: list, num_top: int) -> None:
    """Entry 0 is None; entry t is prompt token t's TokenLogprobs: its logprob and rank in HF's log_softmax at
    position t - 1, and HF's top num_top there, most likely first."""
    assert entries is not None and len(entries) == len(prompt), "one entry per prompt token"
    assert entries[0] is None, "the first prompt token has no tokens before it to be scored on"
    expected = hf_prompt_logprobs(folder, prompt)
    for t, (entry, row) in enumerate(zip(entries[1:], expected), start=1):
        token = prompt[t]
        assert isinstance(entry, TokenLogprobs) and entry.token_id == token, f"position {t}"
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4), f"position {t}"
        assert entry.rank == int((row >= row[token] - 1e-6).sum()), f"position {t}"
        top = row.topk(num_top)
        assert list(entry.top) == top.indices.tolist(), f"position {t}"
        assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4), f"position {t}"


def scoring(num_top: int = 2, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=num_top, **kwargs)


@pytest.mark.parametrize("num_top", [0, 3])
def test_prompt_logprobs_equal_hf_log_softmax_at_every_prompt_position(tiny_model, num_top):
    prompts = random_prompts(seed=31, lengths=[1, 2, 9, 23])
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts + prompts[2:3], [scoring(num_top)] * 4 + [plain], use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_equal_to_hf(tiny_model, prompt, output["prompt_logprobs"], num_top)
    assert "prompt_logprobs" not in outputs[4]  # only where asked
    # scoring the prompt changes nothing about the completion
    assert outputs[2]["token_ids"] == outputs[4]["token_ids"]
    assert_no_block_leaked(llm)


def test_a_prompt_the_prefix_cache_holds_still_gets_every_position_scored(tiny_model):
    """The prompt's blocks are in the cache (an earlier request computed them): the scoring request computes every
    position anyway, while a request that does not score still hits the cache."""
    prompt = random_prompts(seed=32, lengths=[45])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64, kvcache_block_size=16)
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([prompt], plain, use_tqdm=False, return_metrics=True)[0]
    assert first["metrics"].num_cached_tokens == 0
    scored = llm.generate([prompt], scoring(), use_tqdm=False, return_metrics=True)[0]
    assert scored["metrics"].num_cached_tokens == 0, "the prefix cache served positions that had to be scored"
    assert_equal_to_hf(tiny_model, prompt, scored["prompt_logprobs"], 2)
    assert scored["token_ids"] == first["token_ids"]
    # twice in a row: its own earlier blocks do not serve it either
    again = llm.generate([prompt], scoring(), use_tqdm=False, return_metrics=True)[0]
    assert again["prompt_logprobs"] == scored["prompt_logprobs"]
    hit = llm.generate([prompt], plain, use_tqdm=False, return_metrics=True)[0]
    assert hit["metrics"].num_cached_tokens == 32, "a request that does not score still reads the cache"
    assert_no_block_leaked(llm)


def test_a_prompt_split_over_chunked_prefill_steps_is_scored_once_per_position(tiny_model):
    """Prompts longer than a step's token budget, several in one step: each chunk scores its own positions."""
    prompts = random_prompts(seed=33, lengths=[50, 21, 37])
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64, kvcache_block_size=16, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, [scoring(1), scoring(4), scoring(0)], use_tqdm=False)
    assert sum(step.kind == "prefill" for step in llm.metrics.steps) >= 7, "the prompts were meant to be chunked"
    for prompt, output, num_top in zip(prompts, outputs, [1, 4, 0]):
        assert_equal_to_hf(tiny_model, prompt, output["prompt_logprobs"], num_top)
    assert_no_block_leaked(llm)


def test_n_samples_score_their_prompt_once_and_share_its_blocks(tiny_model):
    prompt = random_prompts(seed=34, lengths=[40])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64, kvcache_block_size=16)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2, n=3)
    output = llm.generate([prompt], params, use_tqdm=False, return_metrics=True)[0]
    assert_equal_to_hf(tiny_model, prompt, output["prompt_logprobs"], 2)
    assert all("prompt_logprobs" not in sample for sample in output["outputs"])  # the request's, given once
    assert [sample["metrics"].num_cached_tokens for sample in output["outputs"]] == [0, 32, 32], (
        "samples 1 and 2 were meant to read sample 0's prompt blocks"
    )
    assert_no_block_leaked(llm)


def test_preemption_neither_loses_nor_repeats_prompt_entries(tiny_model):
    """So few KV blocks that decode preempts: a preempted request recomputes its prompt (partly from its own
    cached blocks) and keeps exactly one entry per prompt token."""
    prompts = random_prompts(seed=35, lengths=[40, 30, 35])
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=9, kvcache_block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(step.preempted for step in llm.metrics.steps), "the KV budget was meant to force preemption"
    for prompt, output in zip(prompts, outputs):
        assert_equal_to_hf(tiny_model, prompt, output["prompt_logprobs"], 1)
    assert_no_block_leaked(llm)


def test_the_overlapped_loop_scores_prompts_as_the_plain_loop_does(tiny_model):
    prompts = random_prompts(seed=36, lengths=[12, 30])
    params = [scoring(2), SamplingParams(temperature=0.8, seed=1, max_tokens=8, prompt_logprobs=1)]
    plain = LLM(tiny_model, device="cpu", num_kvcache_blocks=64, overlap_scheduling=False)
    overlapped = LLM(tiny_model, device="cpu", num_kvcache_blocks=64, overlap_scheduling=True)
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert overlapped.generate(prompts, params, use_tqdm=False) == expected
    assert_equal_to_hf(tiny_model, prompts[1], expected[1]["prompt_logprobs"], 1)


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_equal_hf(tiny_model):
    """CUDA's defaults (decode graphs, the overlapped loop, pinned non-blocking copies of the rows to score), a
    cached prompt and chunked prefill, in float32: the scores equal HF's on the CPU."""
    prompts = random_prompts(seed=39, lengths=[50, 9, 33])
    llm = LLM(tiny_model, device="cuda", dtype="float32", max_num_batched_tokens=32, kvcache_block_size=16)
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts, plain, use_tqdm=False)  # their blocks are in the prefix cache now
    outputs = llm.generate(prompts, [scoring(2), scoring(0), scoring(5)], use_tqdm=False)
    for prompt, output, num_top in zip(prompts, outputs, [2, 0, 5]):
        assert_equal_to_hf(tiny_model, prompt, output["prompt_logprobs"], num_top)
    assert_no_block_leaked(llm)


needs_cpp = pytest.mark.skipif(
    bool(attention_cpp.missing_build_tools()), reason="the cpp attention kernel cannot be built here"
)


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("cpp", marks=needs_cpp),
        pytest.param("triton", marks=[pytest.mark.slow]),  # (on a CPU the Triton interpreter runs every program)
    ],
)
def test_prompt_logprobs_on_each_cpu_attention_backend(tiny_model, backend):
    """The cached history a later chunk attends to goes through the backend's paged kernels."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = random_prompts(seed=37, lengths=[20, 7])
    llm = LLM(
        tiny_model, device="cpu", dtype="float32", attention_backend=backend, max_num_batched_tokens=16,
        num_kvcache_blocks=32, kvcache_block_size=16,
    )  # fmt: skip
    assert llm.model_runner.backend.name == backend
    outputs = llm.generate(prompts, scoring(2), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_equal_to_hf(tiny_model, prompt, output["prompt_logprobs"], 2)


@pytest.mark.parametrize(
    "value, message",
    [
        (21, "integer in \\[0, 20\\]"),
        (-2, "integer in \\[0, 20\\]"),
        (False, "integer in \\[0, 20\\]"),
        ("3", "integer in \\[0, 20\\]"),
    ],
)
def test_a_bad_prompt_logprobs_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=f"prompt_logprobs.*{message}"):
        SamplingParams(prompt_logprobs=value)


def test_async_llm_gives_prompt_logprobs_on_sample_0s_first_output():
    """(On the built-in model: AsyncLLM streams text, which needs a tokenizer.)"""
    llm = LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=64)
    prompt = llm.tokenizer.encode("Beautiful is better than ugly. Explicit is better than implicit.")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=3, n=2)
    engine = AsyncLLM(llm)

    async def collect() -> list:
        return [out async for out in engine.generate(prompt, params)]

    try:
        outputs = asyncio.run(collect())
    finally:
        engine.close()
    # vLLM's RequestOutput.prompt_logprobs, on sample 0's first output: None, then {token id: Logprob} of the prompt
    # token and HF's top 3 at its position
    vllm_form = outputs[0].prompt_logprobs
    assert vllm_form[0] is None and len(vllm_form) == len(prompt)
    for t, (position, row) in enumerate(zip(vllm_form[1:], hf_prompt_logprobs(DEFAULT_MODEL, prompt)), start=1):
        token = prompt[t]
        assert set(position) == {token, *row.topk(3).indices.tolist()}, f"position {t}"
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4), f"position {t}"
        assert position[token].rank == int((row >= row[token] - 1e-6).sum()), f"position {t}"
        assert position[token].decoded_token == llm.tokenizer.decode([token]), f"position {t}"
    assert all(out.prompt_logprobs is None for out in outputs[1:])
    # and in nanoref's form (the server's echo reads it)
    carrying = [out for out in outputs if out.prompt_token_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0 and carrying[0] is outputs[0]
    assert_equal_to_hf(DEFAULT_MODEL, prompt, carrying[0].prompt_token_logprobs, 3)
    assert carrying[0].prompt_token_ids == prompt
