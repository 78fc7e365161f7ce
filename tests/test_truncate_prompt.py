"""truncate_prompt_tokens (vLLM's): a request uses only its prompt's last k tokens."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kvcache_blocks=64)  # the built-in tiny model: max_model_len 512


def test_the_last_k_tokens_are_the_prompt(llm):
    ids = list(range(3, 43))
    out = llm.generate([ids], SamplingParams(**GREEDY, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:]
    alone = llm.generate([ids[-10:]], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert out["token_ids"] == alone["token_ids"]
    whole = llm.generate([ids], SamplingParams(**GREEDY, truncate_prompt_tokens=100), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # (shorter than k: as it is)


def test_minus_one_fits_a_prompt_longer_than_the_context(llm):
    ids = [5 + i % 900 for i in range(700)]
    with pytest.raises(ValueError, match="max_model_len is 512"):
        llm.generate([ids], SamplingParams(**GREEDY), use_tqdm=False)
    out = llm.generate([ids], SamplingParams(**GREEDY, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-511:] and out["token_ids"] and out["finish_reason"] == "length"


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_a_bad_value_is_refused_by_name(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be None, -1 or an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=value)


def test_a_truncation_past_max_model_len_is_refused_and_nothing_is_queued(llm):
    with pytest.raises(ValueError, match=r"prompt 1: truncate_prompt_tokens \(600\) is greater than max_model_len"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(), SamplingParams(truncate_prompt_tokens=600)], use_tqdm=False)
    assert llm.is_finished()


def test_a_value_reassigned_after_the_params_were_made_is_named(llm):
    params = SamplingParams(truncate_prompt_tokens=4)
    params.truncate_prompt_tokens = "four"
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        llm.generate([[1, 2, 3, 4, 5]], params, use_tqdm=False)
    assert llm.is_finished()
