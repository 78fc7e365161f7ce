"""The offline API as code written for vLLM's `LLM` calls it: generate's and chat's arguments, and requests that
could never make a token refused before they are queued."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.sampling_params import StructuredOutputsParams

from .helpers import assert_no_block_leaked, needs_xgrammar

GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kvcache_blocks=64)  # the built-in tiny model, with its tokenizer and chat template


# -- generate's priority (vLLM's) ----------------------------------------------------------------------------
def test_priority_of_zeros_is_taken_as_vllm_takes_it_without_priority_scheduling(llm):
    plain = llm.generate(["Hello", "Hi"], GREEDY, use_tqdm=False)
    ranked = llm.generate(["Hello", "Hi"], GREEDY, use_tqdm=False, priority=[0, 0])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]


def test_a_priority_other_than_0_is_vllms_error_and_queues_nothing(llm):
    with pytest.raises(ValueError, match=r"Got priority 2 but Priority scheduling is not enabled"):
        llm.generate(["Hello", "Hi"], GREEDY, use_tqdm=False, priority=[0, 2])
    assert llm.is_finished()
    assert_no_block_leaked(llm)


@pytest.mark.parametrize(
    "priority, error, match",
    [
        ([0], ValueError, "priority has 1 entries for 2 prompts"),
        (0, TypeError, "priority must be None or a list of integers"),
        ([0, True], TypeError, "priority must be None or a list of integers"),
    ],
)
def test_a_priority_list_of_the_wrong_length_or_kind_is_named(llm, priority, error, match):
    with pytest.raises(error, match=match):
        llm.generate(["Hello", "Hi"], GREEDY, use_tqdm=False, priority=priority)
    assert llm.is_finished()


# -- chat ------------------------------------------------------------------------------------------------------
def test_chat_of_an_empty_list_of_conversations_returns_no_outputs_as_generate_does(llm):
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert llm.chat([], GREEDY, use_tqdm=False) == []  # vLLM reads [] as a list of no conversations
    assert llm.is_finished()


def test_chat_still_refuses_a_conversation_without_messages(llm):
    with pytest.raises(TypeError, match="conversation 0: messages must be a non-empty list"):
        llm.chat([[]], GREEDY, use_tqdm=False)


# -- allowed_token_ids with structured output ------------------------------------------------------------------
@needs_xgrammar
def test_allowed_token_ids_that_the_grammar_never_allows_first_are_refused_before_anything_is_queued(llm):
    """Before, the request ran, every token of its first step masked, and ended at once on a token neither allowed
    (an empty text, finish_reason "stop"), with only a RuntimeWarning to tell why."""

    letters = llm.tokenizer.encode("xyz")  # no digit among them
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        allowed_token_ids=letters,
        structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
    )
    with pytest.raises(ValueError, match="prompt 0: allowed_token_ids and structured_outputs have no token in common"):
        llm.generate(["Count:"], params, use_tqdm=False)
    assert llm.is_finished()
    assert_no_block_leaked(llm)


@needs_xgrammar
def test_allowed_token_ids_with_a_first_token_in_common_with_the_grammar_still_generate(llm):

    digit = llm.tokenizer.encode("7")
    assert len(digit) == 1
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        ignore_eos=True,
        allowed_token_ids=[*llm.tokenizer.encode("xyz"), *digit],
        structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
    )
    out = llm.generate(["Count:"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == digit * 4 and out.text == "7777"


@needs_xgrammar
def test_the_engine_process_form_refuses_them_too_where_the_request_is_made():
    from nanoref.serving.async_llm import AsyncLLM

    engine = AsyncLLM.from_model(engine_process=True, device="cpu", num_kvcache_blocks=64)
    try:
        params = SamplingParams(
            max_tokens=8,
            allowed_token_ids=engine.tokenizer.encode("xyz"),
            structured_outputs=StructuredOutputsParams(choice=["0", "1"]),
        )
        with pytest.raises(ValueError, match="allowed_token_ids and structured_outputs have no token in common"):
            engine.generate("Count:", params)
        assert not engine._requests
    finally:
        engine.close()


# -- SamplingParams as vLLM checks it ------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [2.5, 3, 100.0])
def test_a_temperature_above_2_is_refused_as_vllm_refuses_it(temperature):
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\] \(0 = greedy\), got"):
        SamplingParams(temperature=temperature)


def test_temperature_2_itself_is_taken():
    assert SamplingParams(temperature=2).temperature == 2


# -- RequestOutput.lora_request (vLLM's) ------------------------------------------------------------------------
def test_each_output_names_the_lora_request_it_ran_under_as_vllm_outputs_do(tiny_model, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (make_random_lora writes a PEFT adapter)")
    from nanoref import LoRARequest
    from nanoref.testing import make_random_lora

    adapter = LoRARequest("sql", 1, str(make_random_lora(tmp_path / "sql", tiny_model, rank=4, seed=3)))
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    params = SamplingParams(temperature=1.0, max_tokens=2, n=2, seed=None)
    outputs = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False, lora_request=[adapter, None])
    assert outputs[0].lora_request is adapter and outputs[1].lora_request is None
    assert [c.lora_request for c in outputs[0].outputs] == [adapter, adapter]
    assert [c.lora_request for c in outputs[1].outputs] == [None, None]
    plain = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.lora_request is None and plain.outputs[0].lora_request is None


@pytest.mark.parametrize(
    "method, words",
    [
        ("encode", r"LLM\.encode\(\) is only supported for pooling models\."),
        ("embed", r"Embedding API is not supported by this model\."),
        ("classify", r"Classification API is not supported by this model\."),
        ("score", r"LLM\.score\(\) is only supported for pooling models\."),
        ("reward", r"LLM\.encode\(\) is only supported for pooling models\."),  # (vLLM's reward calls its encode)
    ],
)
def test_vllms_pooling_methods_say_the_model_is_not_a_pooling_model(llm, method, words):
    """vLLM's LLM.embed/classify/score/reward/encode on a generative model: a ValueError in the words vLLM's own
    method raises there (not an AttributeError), naming the method called, and nothing is queued."""
    args = (["a", "b"], ["c"]) if method == "score" else (["Hello"],)
    with pytest.raises(ValueError, match=rf"^{words} \(LLM\.{method}\(\) is for pooling models"):
        getattr(llm, method)(*args)
    assert llm.is_finished()
