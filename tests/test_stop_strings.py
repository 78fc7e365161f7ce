"""Stop strings: matched on the completion's text across token boundaries, the text cut before them (or after,
with include_stop_str_in_output), never shown in part by a stream, the same offline and streamed."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")  # the built-in model: a real byte-level tokenizer


def seeded(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "max_tokens": 40, "seed": 3, **fields})


def straddling_stop(llm, completion: list[int]) -> tuple[str, int]:
    """A 3-character stop string that spans a token boundary of the completion, and the index of the token that
    completes it."""
    texts = [llm.tokenizer.decode(completion[: i + 1]) for i in range(len(completion))]
    for i in range(2, len(completion)):
        if len(texts[i - 1]) - len(texts[i - 2]) >= 2 and len(texts[i]) > len(texts[i - 1]):
            start = len(texts[i - 1]) - 2  # the last two characters of token i - 1, then the first of token i
            return texts[i][start : start + 3], i
    raise AssertionError("no token boundary to straddle")


def test_a_stop_string_across_tokens_ends_the_request_with_the_text_cut_before_it(llm):
    plain = llm.generate([PROMPT], seeded(), use_tqdm=False)[0]
    stop, last = straddling_stop(llm, plain["token_ids"])
    assert plain["text"].count(stop) >= 1
    out = llm.generate([PROMPT], seeded(stop=["never-there", stop]), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["text"] == plain["text"][: plain["text"].index(stop)]
    assert out["token_ids"] == plain["token_ids"][: last + 1]
    kept = llm.generate([PROMPT], seeded(stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept["text"] == plain["text"][: plain["text"].index(stop) + len(stop)]


def test_a_stop_string_found_in_the_text_of_a_stop_token_shown_in_the_output_is_the_stop_reason(llm):
    """include_stop_str_in_output shows a stop token's text; a stop string found in it ends the request with the text
    cut after it, and (as in vLLM, which looks for stop strings after the token's stop) is the `stop_reason`, not
    the token id. Without include_stop_str_in_output the token's text is hidden: the token id is the reason."""
    plain = llm.generate([PROMPT], seeded(), use_tqdm=False)[0]
    token, text_before = plain["token_ids"][1], llm.tokenizer.decode(plain["token_ids"][:1])
    token_text = llm.tokenizer.decode(plain["token_ids"][:2])[len(text_before) :]
    stop = next(c for c in token_text if c.isalnum())  # a character of the second token's text only
    assert stop not in text_before
    fields = dict(stop=[stop], stop_token_ids=[token])
    kept = llm.generate([PROMPT], seeded(**fields, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept["token_ids"] == plain["token_ids"][:2] and kept["finish_reason"] == "stop"
    assert kept["text"] == text_before + token_text[: token_text.index(stop) + 1]
    assert kept["stop_reason"] == kept.outputs[0].stop_reason == stop
    hidden = llm.generate([PROMPT], seeded(**fields), use_tqdm=False)[0]
    assert (hidden["text"], hidden["stop_reason"]) == (text_before, token)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_stream_never_shows_part_of_the_stop_string_and_ends_as_generate(llm, overlap):
    engine = LLM(device="cpu", overlap_scheduling=overlap)
    plain = engine.generate([PROMPT], seeded(), use_tqdm=False)[0]
    stop, _ = straddling_stop(engine, plain["token_ids"])
    params = seeded(stop=stop)
    seq = engine.add_request(PROMPT, params, stream=True)
    other = engine.add_request(PROMPT, seeded(seed=4, ignore_eos=True))  # runs alongside, without a detokenizer
    shown = []
    while not engine.is_finished():
        engine.step()
        shown.append(engine.output_processor.text_so_far(seq))
    offline = engine.generate([PROMPT], params, use_tqdm=False)[0]
    assert (
        engine.output_processor.text_so_far(seq) == offline["text"]
        and seq.stop_reason == stop
        and seq.finish_reason == "stop"
    )
    assert all(offline["text"].startswith(text) for text in shown), "a stream showed text that was then cut"
    assert other.output.detokenizer is None and other.finish_reason == "length"


def test_an_offline_request_without_stop_strings_is_not_detokenized_per_step(llm):
    seq = llm.add_request(PROMPT, seeded())
    assert seq.output.detokenizer is None
    llm.abort_request(seq)


def test_the_stop_string_that_ends_first_wins(llm):
    detokenizer = IncrementalDetokenizer(llm.tokenizer, ["cd", "abcde", "b"])
    detokenizer.add(llm.tokenizer.encode("xabcdef"))  # all three complete in what one add brings
    assert detokenizer.find_stop() == "b" and detokenizer.text == "xa"


def test_characters_that_may_start_a_stop_string_are_held_back_until_they_do_not(llm):
    tokenizer = llm.tokenizer
    detokenizer = IncrementalDetokenizer(tokenizer, ["END"])
    for piece, shown in [("ab", "ab"), ("E", "ab"), ("N", "ab"), ("o", "abENo")]:
        detokenizer.add(tokenizer.encode(piece))
        assert detokenizer.find_stop() is None and detokenizer.text == shown
    detokenizer.add(tokenizer.encode("E"))
    assert detokenizer.finish() == "E" and detokenizer.text == "abENoE"  # the end shows what was held back


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(stop=""), "non-empty"),
        (dict(stop=["a", ""]), "non-empty"),
        (dict(stop=["a", 1]), "list of strings"),
        (dict(stop=3), "list of strings"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
        (dict(n=0), "n "),
        (dict(n=2.0), "n "),
        (dict(seed=2**64 - 1, n=2), "seed \\+ n - 1"),
    ],
)
def test_bad_stop_strings_and_n_are_refused_with_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_stop_strings_need_a_tokenizer(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        (folder / name).unlink(missing_ok=True)
    llm = LLM(folder, device="cpu", num_kvcache_blocks=16)
    with pytest.raises(ValueError, match="stop strings needs one"):
        llm.generate([[1, 2, 3]], SamplingParams(stop="x"), use_tqdm=False)
    assert llm.is_finished()
