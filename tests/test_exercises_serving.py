"""Notebook 11's exercise checks: nanoref's stop-string functions pass; plausible wrong ones fail, each with its hint;
the engine and the server run the learner's function (an AsyncLLM started inside `seams.use` carries it)."""

from __future__ import annotations

import pytest

# the server's packages (the `serve` extra) and OpenAI's client: without one, the file skips and says which
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.engine.detokenizer import find_stop_string, stop_hold_back  # noqa: E402
from nanoref.exercises import ExerciseFailure, check_find_stop_string, check_stop_hold_back  # noqa: E402
from nanoref.exercises.serving import check_served  # noqa: E402
from nanoref.serving.api_server import serve_in_background  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402
from nanoref.utils import seams  # noqa: E402

from .helpers import Counting  # noqa: E402

ZEN_STOP = SamplingParams(temperature=0, max_tokens=16, stop=[" is", "ugly"])


def test_nanorefs_own_functions_pass_alone_in_the_engine_and_in_the_server():
    check_find_stop_string(find_stop_string)
    check_stop_hold_back(stop_hold_back)


# -- find_stop_string: typical mistakes ------------------------------------------------------------------------------
def first_in_list(text, stops, start):  # the first of `stops` that occurs, not the one that ends first
    for stop in stops:
        index = text.find(stop, max(start - len(stop) + 1, 0))
        if index >= 0:
            return index, stop
    return None


def from_start_only(text, stops, start):  # misses a stop string that straddles start
    found = [(text.find(s, start) + len(s), text.find(s, start), s) for s in stops if text.find(s, start) >= 0]
    return min(found)[1:] if found else None


def whole_text(text, stops, start):  # ignores start: finds stop strings an earlier call already found
    return find_stop_string(text, stops, 0)


def end_index(text, stops, start):  # returns where the stop string ends
    found = find_stop_string(text, stops, start)
    return None if found is None else (found[0] + len(found[1]), found[1])


def shorter_on_ties(text, stops, start):  # of two that end at the same place, the one that begins last
    found = [(i + len(s), -i, s) for s in stops if (i := text.find(s, max(start - len(s) + 1, 0))) >= 0]
    return (-min(found)[1], min(found)[2]) if found else None


def begins_first(text, stops, start):  # the stop string that begins first, not the one that ends first
    found = [(i, s) for s in stops if (i := text.find(s, max(start - len(s) + 1, 0))) >= 0]
    return min(found, key=lambda pair: pair[0]) if found else None


def test_a_find_stop_string_that_returns_the_one_beginning_first_is_caught_on_every_seed_with_its_hint():
    """A short stop string that ends inside a longer one that begins earlier is a worked case: no seed lets the
    begins-first mistake through, and the hint names it (not the list's order)."""
    for seed in range(40):
        with pytest.raises(ExerciseFailure) as failure:
            check_find_stop_string(begins_first, seed=seed, engine=False)
        message = str(failure.value).replace("\n", " ")
        assert "the stop string that begins first" in message, (seed, message)
        assert "first of `stops`" not in message, (seed, message)


def test_a_find_stop_string_that_takes_the_first_of_the_list_is_told_so_on_every_seed():
    for seed in range(40):
        with pytest.raises(ExerciseFailure) as failure:
            check_find_stop_string(first_in_list, seed=seed, engine=False)
        message = str(failure.value).replace("\n", " ")
        assert "the first of `stops` that occurs" in message and "begins first" not in message, (seed, message)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (begins_first, "return the one that ends first"),
        (first_in_list, "return the stop string that ends first, whatever its place in the list"),
        (from_start_only, "a stop string can straddle start, so search from start - len(stop) + 1"),
        (whole_text, "find only stop strings that end after it"),
        (end_index, "return the index where the stop string begins"),
        (shorter_on_ties, "return the one that begins first (the longer)"),
        (lambda text, stops, start: [0, stops[0]] if stops else None, "return the index where the stop string"),
        (lambda text, stops, start: "STOP", "return None or a pair (index, stop string)"),
    ],
    ids=[
        "begins_first",
        "first_in_list",
        "from_start",
        "whole_text",
        "end_index",
        "ties",
        "always_first",
        "not_a_pair",
    ],
)
def test_a_wrong_find_stop_string_fails_with_its_hint(wrong, hint):
    with pytest.raises(ExerciseFailure, match=None) as failure:
        check_find_stop_string(wrong, engine=False)
    assert hint in str(failure.value).replace("\n", " ")


def shortest_stop_first(text, stops, start):  # straddles start rightly, but takes the shortest stop that occurs
    for stop in sorted(stops, key=len):
        index = text.find(stop, max(start - len(stop) + 1, 0))
        if index >= 0:
            return index, stop
    return None


def negative_window(text, stops, start):  # text[start - len(stop) + 1:] without max(..., 0): slices from the end
    found = []
    for stop in stops:
        low = start - len(stop) + 1
        index = text[low:].find(stop)
        if index >= 0:
            found.append((index + low + len(stop), index + low, stop))
    return min(found)[1:] if found else None


@pytest.mark.parametrize("seed", range(5))
def test_a_find_stop_string_that_straddles_start_is_not_told_to_straddle_it(seed):
    """It finds the straddling stop string alone (the check asks it so), so its mistake is the choice among stops."""
    with pytest.raises(ExerciseFailure) as failure:
        check_find_stop_string(shortest_stop_first, seed=seed, engine=False)
    message = str(failure.value).replace("\n", " ")
    assert "straddle" not in message, message
    assert "return the first stop string to end in the text" in message, message


@pytest.mark.parametrize("seed", range(5))
def test_a_search_window_below_zero_is_told_to_clamp_it(seed):
    with pytest.raises(ExerciseFailure) as failure:
        check_find_stop_string(negative_window, seed=seed, engine=False)
    message = str(failure.value).replace("\n", " ")
    assert "start - len(stop) + 1 = -2 is below 0 here, and text[-2:] slices from the end; clamp it" in message


# -- stop_hold_back: typical mistakes --------------------------------------------------------------------------------
def proper_prefixes_only(text, stops):  # off by one: at most longest - 1 characters
    for length in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def shortest_first(text, stops):  # the shortest end that begins a stop string, not the longest
    for length in range(1, min(max(map(len, stops)), len(text)) + 1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def substring(text, stops):  # `end in stop`: holds back an end that no stop string begins with
    for length in range(min(max(map(len, stops)), len(text)), 0, -1):
        if any(text[-length:] in stop for stop in stops):
            return length
    return 0


def longer_than_the_text(text, stops):  # lengths not bounded by len(text): text[-n:] is then the whole text
    for length in range(max(map(len, stops)), 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def shortest_window(text, stops):  # min where max belongs: ends no longer than the shortest stop string
    for length in range(min(min(map(len, stops)), len(text)), 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def test_a_hold_back_that_tries_ends_only_as_long_as_the_shortest_stop_string_fails_on_every_seed():
    """Random texts show this mistake only on some seeds; a worked case shows it on every one, with its hint."""
    for seed in range(40):
        with pytest.raises(ExerciseFailure) as failure:
            check_stop_hold_back(shortest_window, seed=seed, engine=False)
        message = str(failure.value).replace("\n", " ")
        assert "try ends as long as the longest stop string, max(map(len, stops)), not min" in message, (seed, message)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (proper_prefixes_only, "off by one"),
        (shortest_first, "return the longest end that begins a stop string"),
        (substring, "hold back only an end that a stop string begins with"),
        (lambda text, stops: min(len(text), 1 + stop_hold_back(text, stops)), "begins no stop string"),
        (lambda text, stops: -1, "return a number of characters"),
        (longer_than_the_text, "try lengths up to min(longest stop string, len(text))"),
    ],
    ids=["proper_prefixes", "shortest_first", "substring", "one_too_many", "negative", "longer_than_the_text"],
)
def test_a_wrong_stop_hold_back_fails_with_its_hint(wrong, hint):
    with pytest.raises(ExerciseFailure) as failure:
        check_stop_hold_back(wrong, engine=False)
    assert hint in str(failure.value).replace("\n", " ")


def test_a_hold_back_that_shows_a_stop_strings_beginning_fails_in_the_engine():
    """Alone it would fail first; here straight to the engine, which streams pieces that the stop string takes back."""
    with pytest.raises(ExerciseFailure, match="a piece showed the beginning of the stop string"):
        check_served({"stop_hold_back": lambda text, stops: 0})


@pytest.mark.parametrize("wrong", [begins_first, first_in_list])
def test_the_engine_run_catches_a_find_stop_string_that_returns_another_than_the_first_to_end(wrong):
    """The engine's requests hold a short stop string and a longer one that begins before it, both completed by one
    token: the engine run alone (as the capstone runs it) cuts the text elsewhere with either mistake."""
    with pytest.raises(ExerciseFailure, match="the stop string cut the text elsewhere"):
        check_served({"find_stop_string": wrong})


# -- the engine and the server run the learner's function --------------------------------------------------------
def test_the_engine_calls_each_stop_seam_only_inside_use():
    llm = LLM(device="cpu", num_kvcache_blocks=64)
    prompts = ["Beautiful is better than", "Errors should never pass"]
    reference = llm.generate(prompts, ZEN_STOP, use_tqdm=False)
    assert any(out["stop_reason"] for out in reference), "no stop string matched: this test proves nothing"
    for name, default in {"find_stop_string": find_stop_string, "stop_hold_back": stop_hold_back}.items():
        counting = Counting(default)
        with seams.use(**{name: counting}):
            assert llm.generate(prompts, ZEN_STOP, use_tqdm=False) == reference
        assert counting.calls, f"the engine never called {name}"
        calls = counting.calls
        assert llm.generate(prompts, ZEN_STOP, use_tqdm=False) == reference
        assert counting.calls == calls and not seams.active(), f"{name} was used outside the block"


def test_an_async_llm_started_inside_use_runs_the_learners_function_in_its_server():
    """The engine thread runs in a copy of its creator's context: the `use` block around the start reaches the
    server's steps, though the requests come after the block, from the server's own threads."""
    counting = Counting(find_stop_string)
    with seams.use(find_stop_string=counting):
        engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=64), owns_llm=True)
    try:
        with serve_in_background(engine) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30, max_retries=0)
            done = client.completions.create(
                model="nanoref", prompt="Beautiful is better than", temperature=0, max_tokens=16, stop=[" is", "ugly"]
            )
    finally:
        engine.close()
    assert done.choices[0].finish_reason == "stop"
    assert counting.calls > 0, "the server's engine never called the function installed around its start"
    assert not seams.active()
