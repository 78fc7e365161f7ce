"""The offline API against vLLM's spellings and bad input: each bad value is named, nothing is left behind."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from tqdm.std import tqdm

from nanoref import LLM, SamplingParams

from .helpers import assert_no_block_leaked

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def builtin_llm():
    """The built-in tiny model: it has a tokenizer, so text prompts work."""
    return LLM(num_kvcache_blocks=32, max_model_len=128)


# -- vLLM's spellings -----------------------------------------------------------------------------
def test_generate_takes_one_string_as_vllm_does(builtin_llm):
    assert builtin_llm.generate("Hello", GREEDY, use_tqdm=False) == builtin_llm.generate(
        ["Hello"], GREEDY, use_tqdm=False
    )
    assert len(builtin_llm.generate("Hello", GREEDY, use_tqdm=False)) == 1


def test_use_tqdm_may_be_the_bar_factory_as_in_vllm(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    bars = []

    def make_bar(*args, **kwargs):
        bars.append(tqdm(*args, file=io.StringIO(), **kwargs))
        return bars[-1]

    llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=functools.partial(make_bar, leave=False))
    assert len(bars) == 1 and bars[0].total == 2 and bars[0].n == 2 and not bars[0].leave


def test_a_bar_factory_that_raises_leaves_nothing_queued(tiny_model):
    """tqdm.notebook's bar raises where ipywidgets is missing ("IProgress not found"): the call raises, and the next
    call runs its own requests only (they used to stay queued, and the next call ran them too)."""
    llm = LLM(tiny_model, num_kvcache_blocks=16)

    def notebook_bar(*args, **kwargs):
        raise ImportError("IProgress not found. Please update jupyter and ipywidgets.")

    with pytest.raises(ImportError, match="IProgress"):
        llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=notebook_bar)
    assert llm.is_finished()
    out = llm.generate([[7, 8]], GREEDY, use_tqdm=False, return_metrics=True)
    assert len(llm.metrics.requests) == 1 and out[0]["metrics"].num_prompt_tokens == 2
    assert_no_block_leaked(llm)


def test_top_k_minus_one_is_off_as_in_vllm(tiny_model):
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingParams(top_k=-2)
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    off, minus_one = (SamplingParams(temperature=1.0, max_tokens=6, seed=5, top_k=k) for k in (0, -1))
    assert llm.generate([[1, 2, 3]], minus_one, use_tqdm=False) == llm.generate([[1, 2, 3]], off, use_tqdm=False)
    minus_one.top_k = -1  # reassigned after it was made: still off, not a bad value
    assert llm.generate([[1, 2, 3]], minus_one, use_tqdm=False) == llm.generate([[1, 2, 3]], off, use_tqdm=False)


def test_max_tokens_none_generates_up_to_max_model_len_as_in_vllm(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16, max_model_len=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 32 - 3 and out[0]["finish_reason"] == "length"


@pytest.mark.parametrize("name, dtype", [("half", torch.float16), ("float", torch.float32)])
def test_vllms_dtype_names_are_taken(tiny_model, name, dtype):
    assert LLM(tiny_model, dtype=name, num_kvcache_blocks=4, attention_backend="torch").config.dtype == dtype


# -- bad values are named -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=["float32"]), r"dtype must be one of \['auto', 'float32'"),
        (dict(kv_cache_dtype=["fp8"]), "kv_cache_dtype must be one of"),
    ],
)
def test_unhashable_engine_values_are_named(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **kwargs)


@pytest.mark.parametrize("model", [None, 3, ["folder"]])
def test_a_model_that_is_not_a_path_is_named(model):
    with pytest.raises(TypeError, match=f"model must be the path of a model folder .* got {type(model).__name__}"):
        LLM(model)


@pytest.mark.parametrize("params", [3, {"max_tokens": 3}, "greedy"])
def test_sampling_params_of_the_wrong_kind_are_named(tiny_model, params):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    with pytest.raises(TypeError, match="sampling_params must be None, a SamplingParams or a list of them"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert llm.is_finished()
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]


def test_a_kv_cache_larger_than_memory_is_named_not_allocated(tiny_model):
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=10000000000 needs .* GiB for the KV cache on cpu"):
        LLM(tiny_model, num_kvcache_blocks=10**10)
    llm = LLM(tiny_model, num_kvcache_blocks=16)  # the next engine is built and serves
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert_no_block_leaked(llm)


def test_sampling_params_take_keywords_only():
    # (vLLM's first field is n: a positional value would bind to another field here, silently)
    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        SamplingParams(2)
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_vllm_prompt_dicts_are_prompts(builtin_llm):
    # vLLM's TextPrompt and TokensPrompt: the same tokens as the text and the ids themselves
    params = SamplingParams(temperature=0, max_tokens=4)
    ids = builtin_llm.tokenizer.encode("Beautiful is")
    plain = builtin_llm.generate(["Beautiful is", ids], params, use_tqdm=False)
    dicts = builtin_llm.generate([{"prompt": "Beautiful is"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [out["token_ids"] for out in dicts] == [out["token_ids"] for out in plain]
    assert (
        builtin_llm.generate({"prompt": "Beautiful is"}, params, use_tqdm=False)[0]["token_ids"]
        == plain[0]["token_ids"]
    )


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ({"prompt": "x", "multi_modal_data": {"image": None}}, ValueError, "multi_modal_data"),
        ({"prompt": "x", "prompt_token_ids": [1]}, ValueError, "nothing else"),
        ({"text": "x"}, ValueError, "'prompt'"),
        ({"prompt": [1, 2]}, TypeError, "must be a string"),
    ],
)
def test_a_prompt_dict_with_what_the_engine_does_not_do_is_refused(builtin_llm, prompt, error, match):
    with pytest.raises(error, match=match):
        builtin_llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert builtin_llm.is_finished()
