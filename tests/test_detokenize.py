"""SamplingParams(detokenize=False), vLLM's switch for callers that want token ids only (its throughput benchmarks):
the same tokens as with text, no text made anywhere (offline, streamed, AsyncLLM), logprobs without decoded tokens."""

from __future__ import annotations

import asyncio

import pytest

from nanoref import LLM, SamplingParams
from nanoref.engine import detokenizer, output_processor
from nanoref.serving.async_llm import AsyncLLM

from .helpers import SERVER_TIMEOUT

PROMPTS = ["Beautiful is better than", "Flat is better than"]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def no_decoding(monkeypatch) -> None:
    """Any decode of a completion's text from here on fails the test."""

    def refuse(*args, **kwargs):
        pytest.fail("a completion's text was decoded")

    monkeypatch.setattr(output_processor.OutputProcessor, "decode", refuse)
    monkeypatch.setattr(output_processor.IncrementalDetokenizer, "__init__", refuse)
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "__init__", refuse)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm, monkeypatch):
    params = dict(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1)
    texts = llm.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    assert all(out["text"] for out in texts)  # the control: with text
    no_decoding(monkeypatch)
    ids = llm.generate(PROMPTS, SamplingParams(**params, detokenize=False), use_tqdm=False)
    assert [out["token_ids"] for out in ids] == [out["token_ids"] for out in texts]
    assert [out["text"] for out in ids] == ["", ""] and ids[0].outputs[0].text == ""
    chosen = ids[0].outputs[0].logprobs[0][ids[0]["token_ids"][0]]  # vLLM's form: no decoded_token
    assert chosen.decoded_token is None and chosen.logprob == texts[0].outputs[0].logprobs[0][chosen_id(texts)].logprob
    assert all(entry.decoded_token is None for entry in ids[0].prompt_logprobs[1].values())
    assert texts[0].outputs[0].logprobs[0][chosen_id(texts)].decoded_token  # (the control)


def chosen_id(outputs) -> int:
    return outputs[0]["token_ids"][0]


def test_detokenize_false_streams_tokens_without_text(llm, monkeypatch):
    expected = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    no_decoding(monkeypatch)
    pieces = list(llm.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, detokenize=False)))
    assert [t for piece in pieces for t in piece.token_ids] == expected["token_ids"]
    assert all(piece.text == "" for piece in pieces) and pieces[-1].finished


def test_detokenize_false_through_async_llm(monkeypatch):
    llm = LLM(device="cpu")
    expected = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    engine = AsyncLLM(llm)
    try:

        async def served() -> list:
            params = SamplingParams(temperature=0.0, max_tokens=6, detokenize=False)
            return [out async for out in engine.generate(PROMPTS[0], params)]

        no_decoding(monkeypatch)
        outs = asyncio.run(asyncio.wait_for(served(), SERVER_TIMEOUT))
    finally:
        engine.close()
    assert outs[-1].cumulative_token_ids == expected["token_ids"] and outs[-1].finished
    assert all(out.text == "" and out.cumulative_text == "" for out in outs)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["."], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be True or False, got 'no'"):
        SamplingParams(detokenize="no")


def test_detokenize_false_streams_from_a_folder_without_a_tokenizer(tiny_model):
    llm = LLM(str(tiny_model), device="cpu")  # (no tokenizer: generate gives token ids alone)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False)
    expected = llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0]["token_ids"]
    pieces = list(llm.stream([3, 1, 4, 1, 5], params))
    assert [t for piece in pieces for t in piece.token_ids] == expected and len(expected) == 5
    assert all(piece.text == "" for piece in pieces) and pieces[-1].finished
    with pytest.raises(
        ValueError, match=r"has no tokenizer: a stream of text needs one \(token ids only: detokenize=False\)"
    ):  # (the control, naming the way out)
        llm.stream([3, 1, 4, 1, 5], SamplingParams(max_tokens=5))
