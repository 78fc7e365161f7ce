"""min_p (vLLM's): a sampled token is at least min_p times as likely as the most likely one."""

from __future__ import annotations

import math

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.layers.sampler import Sampler, apply_min_p, sampling_probs
from nanoref.testing import EVERY_STEP

PROMPTS = ["def add(a, b):", "Beautiful is better than", "class Sequence:", "The block manager"]


def test_apply_min_p_keeps_what_the_probability_rule_keeps_on_fresh_logits():
    seed = torch.seed()  # fresh inputs every run; the seed is in the message to replay a failure
    logits = torch.randn(64, 1000) * torch.rand(64, 1)[:, :] * 6  # rows from nearly flat to peaked
    min_p = torch.rand(64)
    min_p[:4] = torch.tensor([0.0, 1.0, 1e-6, 0.5])
    kept = apply_min_p(logits, min_p) > float("-inf")  # (B, V)
    probs = logits.softmax(dim=-1)
    want = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    assert torch.equal(kept, want), f"seed {seed}: rows {torch.nonzero((kept != want).any(-1)).flatten().tolist()}"
    assert kept[0].all() and kept[1].sum() == 1 and kept.any(dim=-1).all()


def test_min_p_comes_before_top_p_as_in_vllm():
    """p = [0.5, 0.3, 0.1, 0.1]: min_p 0.3 keeps the first two (0.625, 0.375 once renormalised), and top_p 0.6 on
    what is left keeps the first alone. The other order would keep two (0.5 < 0.6 before the second)."""
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    probs = sampling_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.tensor([0.6]),
                           torch.tensor([0.3]))  # fmt: skip
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    only_min_p = sampling_probs(logits, torch.ones(1), None, None, torch.tensor([0.3]))
    assert torch.allclose(only_min_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_the_tensors_only_sampler_takes_min_p():
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0]]).repeat(256, 1)
    ids = Sampler()(logits, torch.ones(256), torch.zeros(256, dtype=torch.int64), torch.ones(256),
                    min_p=torch.full((256,), 0.5))  # fmt: skip
    assert set(ids.tolist()) == {0, 1}


def below_min_p(outputs, min_p: float) -> int:
    """Chosen tokens less than min_p times as likely as the top one (logprobs at temperature 1: the same softmax)."""
    count = 0
    for out in outputs:
        for entry in out["logprobs"]:
            if entry.logprob < max(entry.top.values()) + math.log(min_p) - 1e-4:
                count += 1
    return count


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kvcache_blocks=64)


@pytest.mark.parametrize("seeded", [False, True], ids=["batch", "seeded"])
def test_no_sampled_token_is_below_min_p(llm, seeded):
    params = dict(temperature=1.0, max_tokens=32, logprobs=20, ignore_eos=True, seed=7 if seeded else None)
    free = llm.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    assert below_min_p(free, 0.3) > 0, "without min_p no token fell below 0.3 of the top one: the check is too weak"
    kept = llm.generate(PROMPTS, SamplingParams(**params, min_p=0.3), use_tqdm=False)
    assert below_min_p(kept, 0.3) == 0


def test_speculative_verify_steps_sample_under_min_p(tiny_model):
    spec = {"method": "ngram", "num_speculative_tokens": 3, **EVERY_STEP, "prompt_lookup_max": 3}
    llm = LLM(speculative_config=spec, num_kvcache_blocks=64)
    params = dict(temperature=1.0, max_tokens=32, logprobs=20, ignore_eos=True)
    free = llm.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    assert below_min_p(free, 0.3) > 0
    kept = llm.generate(PROMPTS, SamplingParams(**params, min_p=0.3), use_tqdm=False)
    assert below_min_p(kept, 0.3) == 0
    assert sum(record.num_draft_tokens for record in llm.metrics.steps) > 0, "no verify step ran"


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", None])
def test_a_bad_min_p_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=value)


def test_greedy_ignores_min_p(llm):
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    with_min_p = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, min_p=0.9), use_tqdm=False)
    assert [o["token_ids"] for o in plain] == [o["token_ids"] for o in with_min_p]
