"""SamplingParams and generate's outputs where vLLM (V1) defines them: each expected value is vLLM's rule worked by
hand on the tokens the engine generates, not the engine's own answer."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kvcache_blocks=64)  # the built-in tiny model, with its byte-level tokenizer


@pytest.fixture(scope="module")
def free(llm):
    """A greedy completion without stop rules, its token ids and the text each token adds."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    ids = out["token_ids"]
    texts = [llm.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    pieces = [texts[0]] + [texts[i][len(texts[i - 1]) :] for i in range(1, len(ids))]
    assert "".join(pieces) == out["text"] and out["finish_reason"] == "length"
    return ids, pieces, out["text"]


def a_token_with_its_own_text(free) -> int:
    """The index of a token (not the first) whose text has 2+ characters and occurs once in the completion."""
    ids, pieces, text = free
    for i in range(1, len(ids)):
        if len(pieces[i]) >= 2 and text.count(pieces[i]) == 1 and pieces[i].strip():
            return i
    raise AssertionError("no token with a text of its own")


# -- stop strings and min_tokens ----------------------------------------------------------------------------
def test_a_stop_string_completed_by_the_last_of_the_min_tokens_does_not_stop(llm, free):
    """vLLM (v1/engine/detokenizer.py, PR 22014) checks stop strings only once the completion has more than
    min_tokens tokens, and never in the text of the first min_tokens alone: the token after them must complete it."""
    ids, pieces, text = free
    i = a_token_with_its_own_text(free)  # token i (0-based) is completion token number i + 1
    stop = pieces[i]

    def run(min_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=len(ids), min_tokens=min_tokens, stop=[stop])
        return llm.generate([PROMPT], params, use_tqdm=False)[0]

    past = run(min_tokens=i)  # token number i + 1 > min_tokens completes it: it stops there
    assert past["finish_reason"] == "stop" and past["stop_reason"] == stop
    assert past["token_ids"] == ids[: i + 1] and past["text"] == text[: text.index(stop)]
    within = run(min_tokens=i + 1)  # token number i + 1 is the last of min_tokens: not checked, and never again
    assert within["finish_reason"] == "length" and within["stop_reason"] is None
    assert within["token_ids"] == ids and within["text"] == text


# -- the stop token's text ------------------------------------------------------------------------------------
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_stop_token_that_is_not_special_is_left_out_of_the_text(llm, free, skip_special_tokens):
    """vLLM leaves the token that ended the completion (EOS, a stop_token_ids entry) out of the text unless
    include_stop_str_in_output, special or not (v1/engine/detokenizer.py: update(..., stop_terminated)); it stays in
    token_ids."""
    ids, pieces, _ = free
    i = a_token_with_its_own_text(free)
    assert ids.index(ids[i]) == i  # it first occurs there
    params = dict(temperature=0, max_tokens=len(ids), stop_token_ids=[ids[i]], skip_special_tokens=skip_special_tokens)
    out = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out.outputs[0].stop_reason == ids[i]
    assert out["token_ids"] == ids[: i + 1] and out["text"] == "".join(pieces[:i])
    kept = llm.generate([PROMPT], SamplingParams(**params, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept["token_ids"] == ids[: i + 1] and kept["text"] == "".join(pieces[: i + 1])
    # a stream (text grown token by token) agrees
    seq = llm.add_request(PROMPT, SamplingParams(**params), stream=True)
    while not llm.is_finished():
        llm.step()
    assert llm.output_processor.text_so_far(seq) == "".join(pieces[:i])


# -- logprobs in vLLM's form ----------------------------------------------------------------------------------
def test_each_position_of_logprobs_starts_with_the_chosen_token(llm):
    """vLLM's dict per position (logprobs.py, append_logprobs_for_next_position) inserts the sampled (or prompt)
    token first, then the top N ranked 1..N: a chosen token that is among the top N keeps the first place and takes
    its top-N rank."""
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=24, logprobs=5, prompt_logprobs=5)
    out = llm.generate(["Once upon a time there was"], params, use_tqdm=False)[0]
    sample = out.outputs[0]
    positions = [*zip(sample.token_ids, sample.logprobs), *zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    inside = 0
    for token_id, position in positions:
        assert next(iter(position)) == token_id
        chosen = position[token_id]
        ranks = sorted(p.rank for i, p in position.items() if i != token_id or chosen.rank <= 5)
        assert ranks == [1, 2, 3, 4, 5] and len(position) == (5 if chosen.rank <= 5 else 6)
        inside += 1 < chosen.rank <= 5
    assert inside > 0, "no chosen token ranked 2..5: the check above never saw the case it is for"


# -- validation: what vLLM's SamplingParams takes ---------------------------------------------------------------
def test_vllms_spellings_of_no_seed_and_of_one_logprob_are_taken():
    """vLLM's SamplingParams.__post_init__ reads seed=-1 as None (no seed of its own) and logprobs=True,
    prompt_logprobs=True as 1."""
    params = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True)
    assert params.seed is None and params.logprobs == 1 and params.prompt_logprobs == 1
    assert type(params.logprobs) is int and type(params.prompt_logprobs) is int
    for bad in (dict(seed=-(2**63) - 1), dict(logprobs=False), dict(prompt_logprobs=False)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.parametrize("field, kind", [("logprobs", "sample"), ("prompt_logprobs", "prompt")])
def test_logprobs_of_minus_one_is_taken_and_the_engine_refuses_it_against_its_own_max_logprobs(field, kind):
    """vLLM's SamplingParams takes -1 (every token of the vocabulary); its engine reads it as the vocabulary's size and
    refuses it against its max_logprobs, in its words, naming that engine's limit (5 here, not the default 20)."""
    params = SamplingParams(max_tokens=2, **{field: -1})
    assert getattr(params, field) == -1
    llm = LLM(num_kvcache_blocks=16, max_logprobs=5)
    vocab_size = 1024  # the built-in model's (nanoref/default_model/config.json)
    words = rf"^prompt 0: Requested {kind} logprobs of {vocab_size}, which is greater than max allowed: 5 "
    with pytest.raises(ValueError, match=words + r"\(the engine's max_logprobs; -1 asks for every token of the"):
        llm.generate([PROMPT], params, use_tqdm=False)
    assert llm.is_finished()


def test_logprobs_of_minus_one_gives_every_token_where_max_logprobs_covers_the_vocabulary(tmp_path):
    """A vocabulary no larger than max_logprobs: -1 is served as vLLM serves it, every token at each position."""
    from nanoref.testing import make_tiny_qwen3

    llm = LLM(make_tiny_qwen3(tmp_path / "sixteen", vocab_size=16), device="cpu", num_kvcache_blocks=8, max_logprobs=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    assert [sorted(position) for position in out.outputs[0].logprobs] == [list(range(16))] * 3
    assert [sorted(position) for position in out.prompt_logprobs[1:]] == [list(range(16))] * 3


def test_a_seed_of_minus_one_samples_as_an_unseeded_request(llm):
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=4, logprobs=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out["token_ids"]) == 4 and all(len(position) in (1, 2) for position in out.outputs[0].logprobs)


@pytest.mark.parametrize("bias", [-1000.0, float("-inf")])
def test_a_logit_bias_beyond_minus_100_is_taken_and_bans_the_token(tiny_model, bias):
    """vLLM's SamplingParams takes any logit_bias and adds it as given (v1/sample/logits_processor builtin
    LogitBiasLogitsProcessor): -1000 or -inf bans a token. HF's sequence_bias (the same addition) is the reference."""
    from .helpers import hf_model

    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    prompt = [5, 6, 5, 6, 7]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    banned = free["token_ids"][0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={banned: bias})
    assert params.logit_bias == {banned: bias}  # as given, not clamped
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf_model(tiny_model).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
            sequence_bias={(banned,): -1000.0}, eos_token_id=None,
        )[0, len(prompt):].tolist()  # fmt: skip
    assert banned not in out["token_ids"] and out["token_ids"] == want
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True, logit_bias={banned: bias})
    assert banned not in llm.generate([prompt], sampled, use_tqdm=False)[0]["token_ids"]


def test_a_nan_logit_bias_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: float("nan")})
