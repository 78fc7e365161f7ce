"""generate's outputs read as vLLM's RequestOutput / CompletionOutput (and stay Nano-vLLM's dicts)."""

from __future__ import annotations

import math
import pickle

import pytest

from nanoref import LLM, SamplingParams
from nanoref.engine.output_processor import CompletionOutput, GenerateOutput, Logprob


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kvcache_blocks=64)  # the built-in tiny model, with its tokenizer


def test_vllms_quickstart_runs_as_it_is(llm):
    """vLLM's offline quickstart, with only the import changed (greedy, so that it can be compared)."""
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0, max_tokens=8)
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    seen = []
    for prompt, output in zip(prompts, outputs):
        generated_text = output.outputs[0].text
        assert output.prompt == prompt
        assert generated_text == output["text"] and output.outputs[0].token_ids == output["token_ids"]
        assert output.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert (
            output.finished
            and output.outputs[0].finished()
            and output.outputs[0].finish_reason == output["finish_reason"]
        )
        assert output.outputs[0].index == 0 and len(output.outputs) == 1 and "outputs" not in output
        assert isinstance(output.request_id, str)
        seen.append(output.request_id)
    assert len(set(seen)) == len(prompts), "each request needs its own request_id"
    alone = llm.generate(prompts[1], sampling_params, use_tqdm=False)[0]
    assert alone.outputs[0].text == outputs[1].outputs[0].text


def test_a_prompt_of_token_ids_has_no_prompt_text(llm):
    ids = [5, 6, 7, 8]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt is None and out.prompt_token_ids == ids
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None and out.metrics is None


def test_n_samples_are_every_output_in_index_order(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4)
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs == out["outputs"] and all(isinstance(c, CompletionOutput) for c in out.outputs)
    assert out.outputs[0].token_ids == out["token_ids"] and out.outputs[0].text == out["text"]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three samples at temperature 1 were all the same"


def test_logprobs_read_in_vllms_form_with_the_chosen_token_and_the_top_n(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate(["def add(a, b):"], params, use_tqdm=False)[0]
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) == len(out["logprobs"])
    for token_id, position, ours in zip(sample.token_ids, sample.logprobs, out["logprobs"]):
        assert token_id in position and position[token_id].logprob == ours.logprob
        assert position[token_id].rank == ours.rank
        top = sorted(((i, p) for i, p in position.items() if i in ours.top), key=lambda item: item[1].rank)
        assert [p.rank for _, p in top] == [1, 2, 3] and all(isinstance(p, Logprob) for _, p in top)
        assert top[0][1].logprob == max(ours.top.values())
        assert position[token_id].decoded_token == llm.tokenizer.decode([token_id])
    assert math.isclose(sample.cumulative_logprob, sum(entry.logprob for entry in out["logprobs"]))
    prompt_ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in position and len(position) in (2, 3)  # the top 2, and the prompt's token if not in them


def test_stop_reason_is_the_stop_string_or_the_stop_token_id(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    free = llm.generate(["def add(a, b):"], greedy, use_tqdm=False)[0]
    token = free["token_ids"][2]
    by_id = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[token]),
                         use_tqdm=False)[0]  # fmt: skip
    assert by_id.outputs[0].finish_reason == "stop" and by_id.outputs[0].stop_reason == token
    assert "stop_reason" not in by_id  # (the dict has the key only where stop strings were asked for)
    text = free["text"]
    stop = text[len(text) // 2 :][:2]
    by_text = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
                           use_tqdm=False)[0]  # fmt: skip
    assert by_text.outputs[0].stop_reason == stop == by_text["stop_reason"]
    assert free.outputs[0].stop_reason is None


def test_an_output_pickles_and_compares_as_the_dict_it_is(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, logprobs=1), use_tqdm=False)[0]
    back = pickle.loads(pickle.dumps(out))
    assert isinstance(back, GenerateOutput) and back == out and dict(back) == dict(out)
    assert back.outputs[0].logprobs == out.outputs[0].logprobs and back.prompt == "Hello"
    assert back.prompt_token_ids == out.prompt_token_ids and back.request_id == out.request_id


def test_chat_returns_the_same_outputs(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert isinstance(out[0], GenerateOutput) and out[0].outputs[0].text == out[0]["text"]
    assert "Hi" in out[0].prompt and out[0].prompt.endswith("assistant\n")  # the template's text, as vLLM's chat
    assert out[0].prompt_token_ids == llm.tokenizer.encode(out[0].prompt)


def test_get_tokenizer_is_the_engines_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Hello, my name is")
    assert (
        tokenizer is llm.tokenizer
        and llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids == ids
    )


# -- AsyncLLM's outputs, as vLLM's AsyncLLM gives them (RequestOutputKind.CUMULATIVE, its default) --------------------
def test_async_outputs_read_as_vllms_cumulative_request_outputs(llm):
    """vLLM's AsyncLLM loop, `async for output in engine.generate(...)`, then `output.outputs[0].text`: each output
    holds the whole text so far, the last one the finished completion, equal to offline generate's."""
    import asyncio

    from nanoref.serving.async_llm import AsyncLLM

    from .helpers import SERVER_TIMEOUT

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, stop=["\n\n\n"])
    expected = llm.generate(["Hello, my name is"], params, use_tqdm=False)[0]
    engine = AsyncLLM(llm)
    try:

        async def served() -> list:
            return [output async for output in engine.generate("Hello, my name is", params, "request-1")]

        outputs = asyncio.run(asyncio.wait_for(served(), SERVER_TIMEOUT))
    finally:
        engine.close()
    texts = [output.outputs[0].text for output in outputs]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))  # cumulative, never a delta
    final = outputs[-1]
    assert final.finished and final.request_id == "request-1" and final.prompt == "Hello, my name is"
    completion = final.outputs[0]
    assert completion.text == expected.outputs[0].text and completion.token_ids == expected.outputs[0].token_ids
    assert completion.finish_reason == expected.outputs[0].finish_reason and completion.finished()
    assert completion.logprobs == expected.outputs[0].logprobs  # vLLM's form, decoded tokens and all
    assert len(outputs[0].outputs[0].logprobs) == len(outputs[0].outputs[0].token_ids)  # (so far, not ahead)
    assert all(output.outputs[0].finish_reason is None for output in outputs[:-1])


def test_num_cached_tokens_counts_the_prompt_tokens_the_prefix_cache_served():
    """vLLM's RequestOutput.num_cached_tokens: a prompt of 40 ids sent again finds its 2 full blocks of 16 cached."""
    llm = LLM(num_kvcache_blocks=64, kvcache_block_size=16)
    prompt = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.generate([prompt[:20]], params, use_tqdm=False)[0].num_cached_tokens == 16  # (one full block)


def test_async_generate_takes_vllms_priority_and_its_outputs_carry_the_lora_request(tmp_path):
    """vLLM's AsyncLLM.generate(..., lora_request=, priority=): priority is one integer for the one request (0: the
    engine serves first come, first served, as vLLM without its priority policy), and every output, and each of its
    `.outputs`, names the LoRARequest it ran under (None: the base model), as LLM.generate's do."""
    import asyncio

    pytest.importorskip("peft")
    from nanoref import DEFAULT_MODEL, LoRARequest
    from nanoref.serving.async_llm import AsyncLLM
    from nanoref.testing import make_random_lora

    from .helpers import SERVER_TIMEOUT

    lora = LoRARequest("a", 1, str(make_random_lora(tmp_path / "a", DEFAULT_MODEL, rank=4, seed=3)))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = AsyncLLM(LLM(DEFAULT_MODEL, device="cpu", enable_lora=True, num_kvcache_blocks=64), owns_llm=True)
    try:
        with pytest.raises(ValueError, match="Got priority 2 but Priority scheduling is not enabled"):
            engine.generate("Hello", params, "r0", priority=2)
        with pytest.raises(TypeError, match="priority must be an integer"):
            engine.generate("Hello", params, "r0", priority=[0])

        async def served(request_id: str, adapter: LoRARequest | None) -> list:
            outputs = engine.generate("Hello", params, request_id, lora_request=adapter, priority=0)
            return [output async for output in outputs]

        adapted = asyncio.run(asyncio.wait_for(served("r1", lora), SERVER_TIMEOUT))
        base = asyncio.run(asyncio.wait_for(served("r2", None), SERVER_TIMEOUT))
    finally:
        engine.close()
    assert adapted[-1].finished and all(out.lora_request is lora for out in adapted)
    assert all(out.outputs[0].lora_request is lora for out in adapted)
    assert all(out.lora_request is None and out.outputs[0].lora_request is None for out in base)
