"""Checks for notebook 11's exercises: the detokenizer's stop strings, alone, in the engine and in the server.

`find_stop_string(text, stops, start)` finds the stop string a new token completed; `stop_hold_back(text, stops)`
says how much of the text's end must wait because a stop string could begin there. Each check first runs the
learner's function on fresh random texts against nanoref's own, then streams completions with stop strings from
the built-in model, offline (`LLM.stream`) and through the OpenAI-compatible server started inside the learner's
`seams.use(...)` block, and compares every text with nanoref's own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from nanoref.engine.detokenizer import find_stop_string, stop_hold_back
from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    describe,
    describe_error,
    input_generator,
    limited_steps,
    step_budget,
)
from nanoref.utils.seams import use

SERVER_TIMEOUT = 30.0  # seconds: every wait on the server is bounded, a bug fails the check, never hangs it
ALPHABET = "ab. \n"  # few characters: random texts hold stop strings, and stop strings share beginnings


def _rng(seed: int | None) -> random.Random:
    return random.Random(int(input_generator(seed).initial_seed()))


def _text(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(low, high)))


def _stops(rng: random.Random) -> list[str]:
    return list(dict.fromkeys(_text(rng, 1, 4) for _ in range(rng.randint(1, 3))))  # distinct, non-empty


# -- find_stop_string ---------------------------------------------------------------------------------------------
def _find_cases(rng: random.Random) -> Iterator[tuple[str, str, list[str], int]]:
    """(description, text, stops, start): the situations that trip answers up, then random ones."""
    yield "the second stop string of the list ends first in the text", "say hello, then END. STOP", ["STOP", "END"], 0
    # a short stop string inside a longer one that begins earlier: the short one ends first (either list order)
    yield "a short stop string ends inside a longer one that begins before it", "one two three", ["tw", "e two"], 0
    yield "a short stop string, second in the list, ends inside a longer one", "a big cat", ["a big", "b"], 0
    yield "a stop string that begins before start and ends after it", "one two thr|ee END", ["thr|ee", "END"], 13
    yield "a stop string that ended before start (an earlier call found it), and a later one", "x END y END", ["END"], 6
    yield "no stop string in the text", "nothing to see here", ["STOP", "END"], 0
    yield "two stop strings that end at the same place", "the end of it", ["end", "the end"], 0
    yield "a stop string that occurs twice after start", "ab ab ab", ["ab"], 2
    yield "a text that ends with a stop string", "all done", ["done"], 7
    yield "start at the end of the text", "abc", ["c"], 3
    for _ in range(200):
        text = _text(rng, 0, 14)
        yield "random text", text, _stops(rng), rng.randint(0, len(text))


def _ends_by(found: tuple[int, str]) -> int:
    return found[0] + len(found[1])


def _occurrences(text: str, stops: list[str], start: int) -> list[tuple[int, str]]:
    """Each stop string's first occurrence that ends after `start`, in the order of `stops` (those that occur)."""
    found = [(text.find(stop, max(start - len(stop) + 1, 0)), stop) for stop in stops]
    return [(index, stop) for index, stop in found if index >= 0]


def _probe(fn: Callable, text: str, stops: list[str], start: int) -> Any:
    """The learner's answer to another question, to tell two mistakes apart; None where it raises."""
    try:
        found = fn(text, list(stops), start)
    except Exception:
        return None
    return tuple(found) if isinstance(found, list) else found


def _find_hint(fn: Callable, text: str, stops: list[str], start: int, got: Any, want: tuple[int, str] | None) -> str:
    """What to fix, from how `got` differs from `want` (both valid shapes); `fn` is asked again where only its
    answer to a changed question tells two mistakes apart."""
    if (
        want is not None
        and want[0] < start
        and (got is None or _ends_by(got) > _ends_by(want))
        and _probe(fn, text, [want[1]], start) != want  # alone, it is missed too: not a choice among stops
    ):
        return (
            f"you missed {want[1]!r}, which begins at {want[0]}, before start={start}, and ends after it: a stop "
            "string can straddle start, so search from start - len(stop) + 1"
        )
    if got is None:
        missed = f"you found none, but {want[1]!r} begins at {want[0]} and ends after start={start}"
        below = len(want[1]) - 1 - start  # how far start - len(stop) + 1 lies below 0
        pad = next((c for c in "#@~_" if all(c not in stop for stop in stops)), None)  # matches no stop string
        if below > 0 and pad and _probe(fn, pad * below + text, stops, start + below) == (want[0] + below, want[1]):
            return (
                f"{missed}; with {below} more characters before the text you find it: start - len(stop) + 1 = "
                f"{-below} is below 0 here, and text[{-below}:] slices from the end; clamp it: max(..., 0)"
            )
        return missed
    index, stop = got
    if text[index : index + len(stop)] != stop:
        return (
            f"you returned ({index}, {stop!r}) but text[{index}:{index + len(stop)}] is "
            f"{text[index : index + len(stop)]!r}: return the index where the stop string begins"
        )
    if _ends_by(got) <= start:
        return (
            f"your {stop!r} at {index} ends at {_ends_by(got)}, not after start={start}: the text up to start was "
            "searched in an earlier call; find only stop strings that end after it"
        )
    if want is None:
        return "no stop string ends after start"  # (unreachable: got is a valid later match)
    if _ends_by(got) > _ends_by(want):
        found = _occurrences(text, stops, start)
        begins_first = got in found and index == min(begin for begin, _ in found)
        first_listed = got == found[0]
        ends = f"{want[1]!r} at {want[0]} ends first in the text (at {_ends_by(want)}, yours at {_ends_by(got)})"
        if begins_first and first_listed:
            return (
                f"you returned {stop!r}, the first of `stops` and the one that begins first, but {ends}: return the "
                "stop string that ends first, whatever its place in the list or where it begins"
            )
        if begins_first:
            return (
                f"you returned {stop!r}, the stop string that begins first, but {ends}: return the one that ends "
                "first (the text is cut where the first stop string is complete), not the one that begins first"
            )
        if first_listed:
            return (
                f"you returned {stop!r}, the first of `stops` that occurs, but {ends}: return the stop string that "
                "ends first, whatever its place in the list"
            )
        return (
            f"{want[1]!r} at {want[0]} ends at {_ends_by(want)}, before your {stop!r} at {index}: return the first "
            "stop string to end in the text"
        )
    return (
        f"{want[1]!r} at {want[0]} and your {stop!r} at {index} both end at {_ends_by(want)}: of two that end at the "
        "same place, return the one that begins first (the longer)"
    )


def check_find_stop_string(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(text, stops, start) -> (index, stop) | None` against nanoref's on fresh random texts, then streaming with
    stop strings in the engine and in the server (`engine=False`: the first part only)."""
    for description, text, stops, start in _find_cases(_rng(seed)):
        case = f"text={text!r}, stops={stops!r}, start={start}"
        want = find_stop_string(text, stops, start)
        given = list(stops)
        got = call_learner(fn, "find_stop_string", text, given, start, case=f"{description}: {case}")
        if given != stops:
            raise ExerciseFailure(f"your find_stop_string changed `stops`; only read it\n({case})")
        if isinstance(got, list):
            got = tuple(got)
        if got is not None and not (
            isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], int) and isinstance(got[1], str)
        ):
            raise ExerciseFailure(f"return None or a pair (index, stop string), got {got!r}\n({case})")
        if got != want:
            raise ExerciseFailure(
                f"{description}: {_find_hint(fn, text, stops, start, got, want)}\n{case}: you returned {got!r}, "
                f"expected {want!r}"
            )
    if engine:
        check_served({"find_stop_string": fn})


# -- stop_hold_back -----------------------------------------------------------------------------------------------
def _hold_cases(rng: random.Random) -> Iterator[tuple[str, str, list[str]]]:
    yield "the text ends with a whole stop string", "we are done", ["done"]
    yield "two ends of the text begin the stop string, a short one and a longer one", "xaa", ["aab"]
    yield "the text's last character is in the stop string, but not at its beginning", "buzz", ["xyz"]
    yield "nothing at the end begins a stop string", "hello", ["STOP", "END"]
    yield "a text shorter than the stop string, all of it its beginning", "ST", ["STOP"]
    yield "the longest match comes from the second stop string", "the EN", ["N!", "END"]
    yield "an empty text", "", ["STOP"]
    # the end that matches is longer than the shortest stop string: an answer that tries ends only as long as the
    # shortest (min where max belongs) fails here on every run, not only on the random texts that happen to show it
    yield "the end begins the longer of two stop strings, and is longer than the shorter one", "we STO", ["a", "STOP"]
    for _ in range(200):
        yield "random text", _text(rng, 0, 10), _stops(rng)


def _hold_hint(text: str, stops: list[str], got: int, want: int) -> str:
    if want == 0:
        return (
            f"no stop string begins with any end of the text, yet you held back {got}: hold back only an end that a "
            "stop string begins with (stop.startswith(end), not `end in stop`), else return 0"
        )
    tail = text[-want:]
    begins = next(stop for stop in stops if stop.startswith(tail))
    if got > want:
        return (
            f"text[-{got}:] = {text[-got:]!r} begins no stop string: the longest end that does is {tail!r} "
            f"({want} characters)"
        )
    if tail in stops and all(len(stop) <= want for stop in stops if stop.startswith(tail)):
        return (
            f"off by one: the end {tail!r} is a whole stop string, and {want} characters must wait: try ends as "
            "long as the longest stop string, len(stop) included (find_stop_string then cuts it)"
        )
    shortest = min(map(len, stops))
    if shortest < want and got == stop_hold_back(text[-shortest:], stops):  # the ends tried stopped at the shortest
        return (
            f"the end {tail!r} ({want} characters) begins {begins!r}, and is longer than the shortest stop string "
            f"({shortest} characters): try ends as long as the longest stop string, max(map(len, stops)), not min"
        )
    if got == want - 1 and not (got and any(stop.startswith(text[-got:]) for stop in stops)):
        return (
            f"off by one: the end {tail!r} ({want} characters) begins {begins!r}; count every one of its characters "
            "(the end may be as long as the longest stop string: a whole stop string counts too)"
        )
    return (
        f"the end {tail!r} ({want} characters) begins {begins!r}: return the longest end that begins a stop string "
        "(try the longest ends first), not a shorter one"
    )


def check_stop_hold_back(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(text, stops) -> int` against nanoref's on fresh random texts, then streaming with stop strings in the
    engine and in the server (`engine=False`: the first part only)."""
    for description, text, stops in _hold_cases(_rng(seed)):
        case = f"text={text!r}, stops={stops!r}"
        want = stop_hold_back(text, stops)
        given = list(stops)
        got = call_learner(fn, "stop_hold_back", text, given, case=f"{description}: {case}")
        if given != stops:
            raise ExerciseFailure(f"your stop_hold_back changed `stops`; only read it\n({case})")
        if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got <= len(text):
            longer = (
                ": an end of the text has at most len(text) characters (text[-n:] for n > len(text) is the whole "
                "text), so try lengths up to min(longest stop string, len(text))"
                if isinstance(got, int) and not isinstance(got, bool) and got > len(text)
                else ""
            )
            raise ExerciseFailure(
                f"return a number of characters, 0 to len(text) = {len(text)}, got {got!r}{longer}\n({case})"
            )
        if got != want:
            raise ExerciseFailure(
                f"{description}: {_hold_hint(text, stops, got, want)}\n{case}: you returned {got}, expected {want}"
            )
    if engine:
        check_served({"stop_hold_back": fn})


# -- in the engine and in the server ------------------------------------------------------------------------------
ZEN = ["Beautiful is better than", "Errors should never pass", "Namespaces are one"]


def stop_requests(llm: Any) -> list[tuple[str, dict]]:
    """(prompt, sampling settings) with stop strings cut from nanoref's own greedy texts, where its tokens end, so
    that each one matches where it is meant to: one that straddles two tokens; a short one and a longer one that
    begins before it, both completed by one token (the short one ends first: it cuts the text); one kept in the
    output."""
    from nanoref import SamplingParams

    outputs = llm.generate(ZEN, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    requests = []
    for number, (prompt, out) in enumerate(zip(ZEN, outputs)):
        text, ids = out["text"], out["token_ids"]
        ends = [len(llm.tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]  # where each token's text ends
        starts = [0, *ends[:-1]]
        if number == 0:  # across the boundary after a token: its last character and the next token's first two
            stops = next([text[a - 1 : a + 2]] for a in starts[2:] if text.find(text[a - 1 : a + 2]) == a - 1)
        elif number == 1:  # one token of 2+ characters completes both; the longer begins before the short one
            stops = next(
                [text[a - 2 : b], text[a - 1 : a + 1]]
                for a, b in zip(starts[2:], ends[2:])
                if b - a >= 2 and text.find(text[a - 1 : a + 1]) == a - 1 and text.find(text[a - 2 : b]) == a - 2
            )
        else:
            stops = [text[len(text) // 4 : len(text) // 4 + 4]]
        requests.append((prompt, {"temperature": 0, "max_tokens": 16, "stop": stops,
                                  "include_stop_str_in_output": number == 2}))  # fmt: skip
    return requests


def _counted(functions: dict[str, Callable], calls: dict[str, int]) -> dict[str, Callable]:
    def wrap(name: str, function: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    return {name: wrap(name, function) for name, function in functions.items()}


def _compare(where: str, names: str, prompt: str, stops: list[str], pieces: list[str], want: str) -> None:
    got = "".join(pieces)
    if got == want:
        return
    if got.startswith(want):  # a piece showed characters that the stop string then took back
        detail = "a piece showed the beginning of the stop string before it matched: hold that much back"
    else:
        detail = "the stop string cut the text elsewhere"
    raise ExerciseFailure(
        f"with {names} {where}, {prompt!r} with stop={stops!r} streamed {got!r}, nanoref's own streams {want!r}: "
        f"{detail}\npieces: {pieces!r}"
    )


# the built-in model's engine, its requests and nanoref's own streamed texts, made once per process (a list: no
# module name is rebound after import, see nanoref.exercises.integrity)
_BUILT_IN: list[tuple[Any, list[tuple[str, dict]], list[str]]] = []


def _built_in() -> tuple[Any, list[tuple[str, dict]], list[str]]:
    from nanoref import LLM, SamplingParams

    if not _BUILT_IN:
        llm = LLM(num_kvcache_blocks=64)
        requests = stop_requests(llm)
        reference = ["".join(piece.text for piece in llm.stream(prompt, SamplingParams(**settings)))
                     for prompt, settings in requests]  # fmt: skip
        _BUILT_IN.append((llm, requests, reference))
    return _BUILT_IN[0]


def check_served(functions: dict[str, Callable]) -> None:
    """Stream completions with stop strings from the built-in model with the learner's `functions` in place:
    offline through `LLM.stream`, then through the OpenAI-compatible server, whose engine thread is started inside
    `use(...)` so that its steps run them too. Every text must equal nanoref's own; each function must have run."""
    from nanoref import SamplingParams

    llm, requests, reference = _built_in()
    names = describe(functions)
    calls = dict.fromkeys(functions, 0)
    try:
        with use(**_counted(functions, calls)):
            for (prompt, settings), want in zip(requests, reference):
                params = SamplingParams(**settings)
                with limited_steps(llm, step_budget([prompt], params), names):
                    pieces = [piece.text for piece in llm.stream(prompt, params)]
                _compare("in the engine", names, prompt, settings["stop"], pieces, want)
    except ExerciseFailure:
        raise
    except Exception as error:
        summary, details = describe_error(error).split("\n", 1)
        raise ExerciseFailure(f"the engine failed while running {names}: {summary}\n{details}") from error
    missing = [name for name, count in calls.items() if not count]
    if missing:
        raise AssertionError(f"the engine never called {', '.join(missing)}: the check's setup is wrong, not yours")
    try:
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("the server's part of this check needs openai and uvicorn: pip install 'nanoref[serve]' openai")
        return
    _check_server(functions, llm, requests, reference, names)


def _check_server(functions: dict[str, Callable], llm: Any, requests: list, reference: list[str], names: str) -> None:
    import openai

    from nanoref.serving.api_server import serve_in_background
    from nanoref.serving.async_llm import AsyncLLM

    calls = dict.fromkeys(functions, 0)
    with use(**_counted(functions, calls)):  # the engine thread starts in a copy of this context: it runs them
        engine = AsyncLLM(llm)  # the LLM is the engine thread's until close() (which leaves it open)
    try:
        with serve_in_background(engine, timeout=SERVER_TIMEOUT) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=SERVER_TIMEOUT, max_retries=0)
            for (prompt, settings), want in zip(requests, reference):
                extra = {"include_stop_str_in_output": True} if settings["include_stop_str_in_output"] else {}
                try:
                    stream = client.completions.create(
                        model="nanoref", prompt=prompt, temperature=0, max_tokens=settings["max_tokens"],
                        stop=settings["stop"], stream=True, extra_body=extra,
                    )  # fmt: skip
                    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
                except openai.APIError as error:
                    raise ExerciseFailure(f"the server failed while running {names}: {error}") from error
                _compare("in the server", names, prompt, settings["stop"], pieces, want)
    finally:
        engine.close()
    missing = [name for name, count in calls.items() if not count]
    if missing:
        raise AssertionError(f"the server never called {', '.join(missing)}: the check's setup is wrong, not yours")
