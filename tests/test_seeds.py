"""Seeds: a seeded request draws the same whatever its prompt's chunking, LLM(seed=N) makes unseeded requests
repeat from one engine to the next, and neither touches the caller's RNGs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanoref import LLM, SamplingParams

from .helpers import random_prompts

SAMPLED = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)


def engine(folder, **kwargs) -> LLM:
    return LLM(folder, device="cpu", num_kvcache_blocks=32, **kwargs)


# -- a seeded request draws only for the rows that emit a token -----------------------------------
def test_a_seeded_request_gives_the_same_tokens_alone_and_chunked_beside_a_long_prompt(tiny_model):
    long, short = random_prompts(seed=50, lengths=[31, 6])
    seeded = SamplingParams(temperature=1.0, top_k=40, max_tokens=10, seed=2024, ignore_eos=True)
    llm = engine(tiny_model, max_num_batched_tokens=32)
    alone = llm.generate([short], seeded, use_tqdm=False)[0]
    beside = llm.generate([long, short], [SAMPLED, seeded], use_tqdm=False)[1]
    first = llm.metrics.steps[0]
    assert first.kind == "prefill" and first.num_tokens == 32, "the short prompt was not cut into chunks"
    assert beside == alone


def test_a_mid_prompt_chunk_draws_nothing_from_the_engines_generator(tiny_model):
    """Only the greedy request's chunks and a sampled request's last one: a chunk emits no token, so nothing is drawn
    (the engine's generator is where it was) until the step whose row really samples."""
    llm = engine(tiny_model, max_num_batched_tokens=16)
    state = llm.model_runner.generator.get_state()
    llm.add_request(random_prompts(seed=51, lengths=[40])[0], SAMPLED)
    llm.step()  # tokens 0..15: a chunk
    llm.step()  # tokens 16..31: a chunk
    assert torch.equal(llm.model_runner.generator.get_state(), state), "a mid-prompt chunk drew sampling noise"
    llm.step()  # the last 8 tokens: its row samples the first token
    assert not torch.equal(llm.model_runner.generator.get_state(), state)


# -- LLM(seed=...) --------------------------------------------------------------------------------
def rng_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def assert_same_rng_states(before: tuple) -> None:
    torch_state, python_state, numpy_state = rng_states()
    assert torch.equal(torch_state, before[0]), "the global torch RNG changed"
    assert python_state == before[1], "the global `random` state changed"
    assert all(np.array_equal(a, b) for a, b in zip(numpy_state, before[2])), "the global NumPy RNG changed"


def test_engines_with_the_same_seed_sample_the_same_tokens(tiny_model):
    prompts = random_prompts(seed=52, lengths=[5, 12, 3])
    params = [SAMPLED, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True), SAMPLED]
    first = engine(tiny_model, seed=7).generate(prompts, params, use_tqdm=False)
    second = engine(tiny_model, seed=7).generate(prompts, params, use_tqdm=False)
    assert first == second
    other = engine(tiny_model, seed=8).generate(prompts, params, use_tqdm=False)
    assert other != first


def test_without_a_seed_engines_sample_differently(tiny_model):
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    first = engine(tiny_model, seed=None).generate([[1, 2, 3]], params, use_tqdm=False)
    second = engine(tiny_model, seed=None).generate([[1, 2, 3]], params, use_tqdm=False)
    assert first != second  # 24 draws from 256 tokens repeating by chance: never in practice


@pytest.mark.parametrize("seed", [None, 7])
def test_an_engines_seed_leaves_the_global_rngs_alone(tiny_model, seed):
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    before = rng_states()
    llm = engine(tiny_model, seed=seed)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [SAMPLED, SamplingParams(temperature=0.7, top_k=5)], use_tqdm=False)
    assert_same_rng_states(before)


def test_a_negative_seed_is_torchs_for_the_engine_and_for_a_request(tiny_model):
    # vLLM's --seed and a request's "seed" take negative integers (torch.Generator.manual_seed maps -5 to 2**64 - 5):
    # both were refused here ("seed must be ... in [0, 2**64)")
    prompt = random_prompts(seed=53, lengths=[6])
    assert engine(tiny_model, seed=-5).generate(prompt, SAMPLED, use_tqdm=False) == engine(
        tiny_model, seed=2**64 - 5
    ).generate(prompt, SAMPLED, use_tqdm=False)
    llm = engine(tiny_model)
    seeded = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=seed) for seed in (-2, 2**64 - 2)]
    assert llm.generate(prompt, seeded[0], use_tqdm=False) == llm.generate(prompt, seeded[1], use_tqdm=False)


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64, 1.5, True, "7"])
def test_a_bad_engine_seed_is_refused(tiny_model, seed):
    with pytest.raises(ValueError, match=r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\)"):
        engine(tiny_model, seed=seed)


def test_llm_documents_its_seed():
    assert "seed:" in LLM.__doc__
