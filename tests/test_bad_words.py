"""bad_words (vLLM's): the completion never contains a banned word's tokens."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.engine.output_processor import bad_words_token_ids
from nanoref.engine.sampling_inputs import banned_next
from nanoref.testing import EVERY_STEP

PROMPTS = ["Beautiful is better than", "Explicit is better than", "Simple is better than"]
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)
# float32 on a GPU too (the CPU's default): two engines' greedy tokens are compared, and in bfloat16 the random model
# has near ties (two logits one bfloat16 step apart) that a kernel variant's rounding decides
ENGINE = dict(num_kvcache_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_banned_next_masks_a_words_last_token_only_after_the_rest_of_it():
    words = [[7], [3, 4, 5]]
    assert banned_next(words, [], 0) == [7]
    assert banned_next(words, [1, 3, 4], 0) == [7, 5]
    assert banned_next(words, [3, 4, 1], 0) == [7]
    assert banned_next(words, [4], 0) == [7]


def test_a_words_tokens_are_banned_as_written_and_after_a_space(llm):
    tokenizer = llm.get_tokenizer()

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert len(encode("is")) == len(encode(" is")) and encode("is") != encode(" is")  # (the case this checks)
    assert bad_words_token_ids(tokenizer, ["  is"]) == [encode("is"), encode(" is")]
    longer = " Beautiful"  # (with its space: more tokens than without, so only the word as written)
    if len(encode(longer)) != len(encode(longer.strip())):
        assert bad_words_token_ids(tokenizer, [longer]) == [encode(longer.strip())]


def test_greedy_output_never_holds_a_bad_word(llm):
    """The greedy completions repeat the Zen of Python; ban a word they hold (one of several tokens, and one of
    one token): each is gone from every completion, and the completions differ from the free ones there."""
    tokenizer = llm.get_tokenizer()
    free = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    texts = [out["text"] for out in free]
    words = [word for word in ("implicit", " complex", " ugly", "nested", " better") if any(word in t for t in texts)]
    # and a word of one token that the completions hold (as written or after a space)
    single = next(
        text.strip()
        for out in free
        for t in out["token_ids"]
        if (text := tokenizer.decode([t])).strip().isalpha() and [t] in bad_words_token_ids(tokenizer, [text.strip()])
    )
    words.append(single)
    assert len(words) >= 3, texts
    banned = bad_words_token_ids(tokenizer, words)
    assert any(len(ids) > 1 for ids in banned) and any(len(ids) == 1 for ids in banned), banned
    assert any(contains(out["token_ids"], ids) for out in free for ids in banned)
    kept = llm.generate(PROMPTS, SamplingParams(**GREEDY, bad_words=words), use_tqdm=False)
    for out in kept:
        assert not any(contains(out["token_ids"], ids) for ids in banned), (out["text"], words)
    seeded = llm.generate(PROMPTS, SamplingParams(**{**GREEDY, "temperature": 1.0}, seed=3, bad_words=words), False)
    for out in seeded:
        assert not any(contains(out["token_ids"], ids) for ids in banned)


def test_speculative_verify_steps_honour_bad_words():
    spec = {"method": "ngram", "num_speculative_tokens": 3, **EVERY_STEP, "prompt_lookup_max": 3}
    llm = LLM(speculative_config=spec, num_kvcache_blocks=64)
    tokenizer = llm.get_tokenizer()
    free = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    words = [w for w in (" better", " than", " is") if any(w in out["text"] for out in free)]
    banned = bad_words_token_ids(tokenizer, words)
    kept = llm.generate(PROMPTS, SamplingParams(**GREEDY, bad_words=words), use_tqdm=False)
    assert all(not any(contains(out["token_ids"], ids) for ids in banned) for out in kept)
    assert sum(record.num_draft_tokens for record in llm.metrics.steps) > 0, "no verify step ran"


def test_the_overlapped_loop_keeps_bad_words(llm):
    """A word of several tokens (the loop waits for the tokens), and one of one token (a mask: it runs ahead)."""
    overlapped = LLM(**ENGINE, overlap_scheduling=True)
    for words in ([" better than"], ["is"]):
        banned = bad_words_token_ids(overlapped.get_tokenizer(), words)
        plain = llm.generate(PROMPTS, SamplingParams(**GREEDY, bad_words=words), use_tqdm=False)
        ahead = overlapped.generate(PROMPTS, SamplingParams(**GREEDY, bad_words=words), use_tqdm=False)
        assert [o["token_ids"] for o in ahead] == [o["token_ids"] for o in plain]
        assert not any(contains(out["token_ids"], ids) for out in ahead for ids in banned)


@pytest.mark.parametrize("value", ["ugly", [""], ["  "], [3], "x y"])
def test_bad_bad_words_are_refused_by_name(value):
    with pytest.raises(ValueError, match="bad_words must be None or a list of non-blank strings"):
        SamplingParams(bad_words=value)
