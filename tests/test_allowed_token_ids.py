"""allowed_token_ids (vLLM's): a request samples only among the ids it names."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.layers.logits_processors import both_allowed, pack_token_ids, unpack_bitmask
from nanoref.testing import EVERY_STEP

PROMPTS = ["def add(a, b):", "Beautiful is better than", "class Sequence:"]


@pytest.mark.parametrize("vocab", [64, 1000, 1001, 151936])
def test_pack_token_ids_sets_exactly_their_bits_on_fresh_ids(vocab):
    seed = torch.seed()
    ids = torch.randint(vocab, (int(torch.randint(1, 50, ())),)).tolist() + [vocab - 1, 31 % vocab]
    allowed = unpack_bitmask(pack_token_ids(ids, vocab)[None], vocab)[0]  # (V,) bool
    assert torch.nonzero(allowed).flatten().tolist() == sorted(set(ids)), f"seed {seed}"


def test_a_row_with_two_allowed_sets_takes_what_both_allow():
    a, b, c = (pack_token_ids(ids, 96) for ids in ([1, 2, 40, 95], [2, 95, 7], [5]))
    rows, packed = both_allowed([3, 0, 3], torch.stack([a, c, b]))
    assert rows == [3, 0]
    assert [torch.nonzero(unpack_bitmask(packed, 96)[i]).flatten().tolist() for i in range(2)] == [[2, 95], [5]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kvcache_blocks=64)


@pytest.mark.parametrize("seed", [None, 4], ids=["batch", "seeded"])
def test_sampling_stays_among_the_allowed_ids(llm, seed):
    allowed = [11, 222, 333, 400]
    params = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True, seed=seed, allowed_token_ids=allowed)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert set(out["token_ids"]) <= set(allowed)
    free = llm.generate(PROMPTS, SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True, seed=seed), False)
    assert any(not set(out["token_ids"]) <= set(allowed) for out in free)


def test_greedy_takes_the_most_likely_allowed_id(llm):
    """The unconstrained step's top 20 (raw logprobs, which no mask changes): allowed = its 5th, 10th and 15th, so
    greedy must take the 5th."""
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0]
    ranked = list(first["logprobs"][0].top)  # most likely first
    allowed = [ranked[14], ranked[4], ranked[9]]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20, allowed_token_ids=allowed)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert out["token_ids"] == [ranked[4]]
    assert list(out["logprobs"][0].top) == ranked  # logprobs stay the model's raw ones (vLLM's default)


def test_speculative_verify_steps_stay_among_the_allowed_ids():
    spec = {"method": "ngram", "num_speculative_tokens": 3, **EVERY_STEP, "prompt_lookup_max": 3}
    llm = LLM(speculative_config=spec, num_kvcache_blocks=64)
    allowed = [11, 222, 333, 400, 13]
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(set(out["token_ids"]) <= set(allowed) for out in outs)
    assert sum(record.num_draft_tokens for record in llm.metrics.steps) > 0, "no verify step ran"


@pytest.mark.parametrize("value", [[], [-1], "abc", [1.5], [True, 2], 7])
def test_bad_allowed_token_ids_are_refused_by_name(value):
    with pytest.raises(ValueError, match="allowed_token_ids must be None or a non-empty list"):
        SamplingParams(allowed_token_ids=value)


def test_an_allowed_id_outside_the_vocabulary_is_refused_and_nothing_is_queued(llm):
    with pytest.raises(ValueError, match=r"prompt 1: allowed_token_ids: token ids \[100000\] are outside"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(allowed_token_ids=[5, 100000])], use_tqdm=False)
    assert llm.is_finished()
