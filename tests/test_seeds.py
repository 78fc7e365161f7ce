"""Seeds: a seeded request draws the same whatever its prompt's chunking."""

from __future__ import annotations

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
