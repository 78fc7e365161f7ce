"""vLLM's cache_salt offline: prompt dicts {"prompt": text, "cache_salt": s} / {"prompt_token_ids": ids,
"cache_salt": s} in `LLM.generate` (and AsyncLLM.generate); the prefix cache shares K/V only between requests of the
same salt, a salt combines with prompt_logprobs' and a LoRA adapter's, and a bad salt is refused before anything is
queued. (The server's cache_salt: tests/test_server_fields.py.)"""

from __future__ import annotations

import asyncio

import pytest

from nanoref import DEFAULT_MODEL, LLM, LoRARequest, SamplingParams
from nanoref.lora.hooks import SaltedAdapter, adapter_of
from nanoref.serving.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(300, 350))  # three full 16-token blocks to share, and a partial one


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kvcache_blocks=128)


def cached_tokens(llm: LLM, prompt, params: SamplingParams = GREEDY) -> int:
    """Prompt tokens the request found in the prefix cache (one call: the earlier calls' blocks are cached)."""
    return llm.generate([prompt], params, use_tqdm=False, return_metrics=True)[0]["metrics"].num_cached_tokens


def salted(salt: str | None, ids: list[int] = PROMPT) -> dict:
    return {"prompt_token_ids": ids, "cache_salt": salt}


def test_the_prefix_cache_shares_blocks_only_between_requests_of_the_same_salt(llm):
    ids = [token + 1 for token in PROMPT]  # (a prompt no other test caches)
    hits = [cached_tokens(llm, prompt) for prompt in (ids, salted("a", ids), salted("b", ids))]
    assert hits == [0, 0, 0], "a salted request read K/V computed without its salt"
    again = [cached_tokens(llm, prompt) for prompt in (salted("a", ids), salted("b", ids), ids, salted(None, ids))]
    assert all(hit >= 48 for hit in again), f"the same salt (or none) again should hit every full block: {again}"
    llm.generate([salted("c", ids)], GREEDY, use_tqdm=False)  # (the step records say the same: no block hit)
    assert sum(step.num_hit_blocks for step in llm.metrics.steps) == 0
    llm.generate([salted("c", ids)], GREEDY, use_tqdm=False)
    assert sum(step.num_hit_blocks for step in llm.metrics.steps) == 3


def test_a_salted_prompt_dict_generates_what_the_plain_prompt_does(llm):
    text = "Beautiful is better than"
    plain = llm.generate([text], GREEDY, use_tqdm=False)[0]
    for prompt in (
        {"prompt": text, "cache_salt": "s1"},
        {"prompt_token_ids": plain.prompt_token_ids, "cache_salt": "s1"},
    ):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out["token_ids"] == plain["token_ids"]
        assert out.prompt_token_ids == plain.prompt_token_ids
    assert llm.generate({"prompt": text, "cache_salt": "s2"}, GREEDY, use_tqdm=False)[0].prompt == text


def test_samples_of_a_salted_request_share_their_prompt_under_its_salt(llm):
    """n > 1: samples 1..n-1 take sample 0's prompt blocks (they are queued once it computed them), salted too."""
    ids = [token + 2 for token in PROMPT]
    outs = llm.generate([salted("n", ids)], SamplingParams(n=3, max_tokens=2), use_tqdm=False, return_metrics=True)
    assert len(outs[0]["outputs"]) == 3
    assert cached_tokens(llm, salted("n", ids)) >= 48 and cached_tokens(llm, salted("other", ids)) == 0


@pytest.mark.parametrize(
    ("salt", "error", "message"),
    [
        ("", ValueError, "must be a non-empty string"),
        ("x" * 129, ValueError, "must be at most 128 characters"),
        ("user@example", ValueError, "must not contain"),
        ("a/b", ValueError, "must not contain"),
        ("a\\b", ValueError, "must not contain"),
        ("a\x00b", ValueError, "must not contain"),
        (7, TypeError, "must be a non-empty string"),
        (b"bytes", TypeError, "must be a non-empty string"),
    ],
)
def test_a_bad_salt_is_refused_and_leaves_nothing_queued(llm, salt, error, message):
    with pytest.raises(error, match=f"prompt 1: cache_salt {message}"):
        llm.generate([salted("fine"), salted(salt)], GREEDY, use_tqdm=False)
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.config.num_kvcache_blocks
    assert llm.generate([salted("x" * 128)], GREEDY, use_tqdm=False)[0]["token_ids"]  # (128 characters: fine)


def test_prompt_dicts_still_refuse_other_keys(llm):
    with pytest.raises(ValueError, match="'cache_salt', and nothing else"):
        llm.generate([{"prompt": "hi", "cache_salt": "a", "multi_modal_data": {}}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="nothing else"):
        llm.generate([{"cache_salt": "a"}], GREEDY, use_tqdm=False)


def test_prompt_logprobs_keep_the_requests_salt_inside_their_own(llm):
    """prompt_logprobs give a request a salt of its own (every prompt position computed); a salt the request sent
    stays inside it: both apply, neither overwrites the other."""
    samples = llm.make_samples(salted("mine"), SamplingParams(prompt_logprobs=1, n=2))
    assert [seq.cache_salt for seq in samples] == [("prompt_logprobs", samples[0].seq_id, "mine")] * 2
    ids = [token + 3 for token in PROMPT]
    cached_tokens(llm, salted("pl", ids))
    scored = llm.generate([salted("pl", ids)], SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    assert all(entry is not None for entry in scored[0]["prompt_logprobs"][1:])  # (computed, not read from cache)


def test_a_salt_and_a_lora_adapter_both_apply(tmp_path):
    """Under an adapter, the cache shares blocks only between requests of the same adapter and the same salt, and
    the adapter still runs (a salt never replaces it); with prompt_logprobs too."""
    pytest.importorskip("peft", reason="peft is not installed (it writes the random adapter)")
    from nanoref.testing import make_random_lora

    lora = LoRARequest("salted", 1, str(make_random_lora(tmp_path / "salted", DEFAULT_MODEL, rank=4, seed=3)))
    llm = LLM(DEFAULT_MODEL, device="cpu", enable_lora=True, num_kvcache_blocks=64)

    def run(prompt, params=GREEDY, adapter=lora):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter, return_metrics=True)[0]
        return out["token_ids"], out["metrics"].num_cached_tokens

    base, _ = run(PROMPT, adapter=None)
    under, hit = run(salted("a"))
    assert under != base and hit == 0  # (the adapter changes what greedy picks)
    assert run(PROMPT) == (under, 0)  # the adapter without the salt: apart
    assert run(salted("b")) == (under, 0)  # another salt: apart
    assert run(salted("a"), adapter=None)[1] == 0  # the salt without the adapter: apart
    tokens, hit = run(salted("a"))
    assert tokens == under and hit >= 48  # the same adapter and salt: shared
    samples = llm.make_samples(salted("a"), SamplingParams(prompt_logprobs=1), lora_request=lora)
    assert samples[0].cache_salt == SaltedAdapter(("prompt_logprobs", samples[0].seq_id, "a"), lora)
    assert adapter_of(samples[0]) == lora
    assert run(salted("a"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1))[0] == under


def test_asyncllm_takes_a_salted_prompt_dict(llm):
    """AsyncLLM.generate: the salt reaches the engine (the same prompt under another salt hits nothing), and a bad
    one raises before anything is queued."""
    ids = [token + 4 for token in PROMPT]

    async def run(engine: AsyncLLM, prompt) -> list[int]:
        tokens = []
        async for out in engine.generate(prompt, GREEDY):
            tokens += out.token_ids
        return tokens

    async def main() -> tuple[list[list[int]], list[int]]:
        engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=128), owns_llm=True)
        try:
            with pytest.raises(ValueError, match="cache_salt must not contain"):
                engine.generate(salted("a/b", ids), GREEDY)
            outs, hits = [], []
            for salt in ("a", "b", "a"):
                before = engine.stats().prefix_cache_hit_tokens
                outs.append(await run(engine, salted(salt, ids)))
                hits.append(engine.stats().prefix_cache_hit_tokens - before)
            return outs, hits
        finally:
            await engine.shutdown()

    outs, hits = asyncio.run(main())
    assert outs[0] == outs[1] == outs[2] == llm.generate([ids], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert hits[:2] == [0, 0] and hits[2] >= 48, hits
