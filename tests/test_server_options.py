"""The server's sampling options, n choices, logprobs and aborts, through OpenAI's own client, against offline
`generate` with the same SamplingParams (the built-in model on a CPU; small max_tokens, every call bounded)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import running_server  # noqa: E402

MODEL = "nanoref-test"
SETTINGS = dict(device="cpu", num_kvcache_blocks=256)
PROMPT = "Beautiful is better than"  # greedy: " ugly.\nExplicit is better than implicit.\nSimple is better than ..."
MESSAGES = [{"role": "user", "content": "What is better?"}]
HOT = dict(temperature=2.0)  # the built-in model is sure of its Zen: only a hot sampler makes samples differ
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(**SETTINGS), owns_llm=True), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(**SETTINGS)


def generate(server, llm: LLM, prompts: list, **params) -> list[dict]:
    server.wait_until_idle()  # (one engine steps at a time in this process: the server's is idle first)
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def extra(choice, name: str):
    """A vLLM field OpenAI's types lack (stop_reason): present, maybe null."""
    assert name in choice.model_extra, f"the choice has no {name!r}"
    return choice.model_extra[name]


VLLM_EXTENSIONS = {"ignore_eos", "include_stop_str_in_output", "stop_token_ids", "min_tokens", "repetition_penalty"}


def complete(server, stream: bool, chat: bool = False, **args) -> tuple[dict[int, dict], object]:
    """One request through OpenAI's client -> ({choice index: text, finish_reason, stop_reason, logprobs,
    chunks}, usage), whole or streamed (then a choice's logprobs are its chunks' concatenated)."""
    client = server.client()
    endpoint = client.chat.completions if chat else client.completions
    extensions = {name: args.pop(name) for name in VLLM_EXTENSIONS & set(args)}
    if extensions:  # (OpenAI's client sends what its API lacks in extra_body)
        args["extra_body"] = {**args.get("extra_body", {}), **extensions}
    args = dict(model=MODEL, **({"messages": MESSAGES} if chat else {}), **args)
    choices: dict[int, dict] = {}
    if not stream:
        response = endpoint.create(**args)
        for c in response.choices:
            text = c.message.content if chat else c.text
            logprobs = c.logprobs and (c.logprobs.content if chat else c.logprobs.model_dump())
            choices[c.index] = dict(text=text, finish_reason=c.finish_reason, stop_reason=extra(c, "stop_reason"))
            choices[c.index]["logprobs"] = logprobs
        return choices, response.usage
    usage = None
    for chunk in endpoint.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            state = choices.setdefault(c.index, dict(text="", finish_reason=None, stop_reason=None, chunks=[]))
            assert state["finish_reason"] is None, "nothing after a choice's finish"
            text = (c.delta.content or "") if chat else c.text
            state["text"] += text
            state["chunks"].append((text, c.logprobs))
            if c.logprobs is not None:
                if chat:
                    state.setdefault("logprobs", []).extend(c.logprobs.content)
                else:
                    merged = state.setdefault("logprobs", {})
                    for key, values in c.logprobs.model_dump().items():
                        merged.setdefault(key, []).extend(values)
            if c.finish_reason is not None:
                state["finish_reason"], state["stop_reason"] = c.finish_reason, extra(c, "stop_reason")
    return choices, usage


STOPS = [
    dict(stop="implicit"),
    dict(stop=["complex", "implicit"]),
    dict(stop="implicit", include_stop_str_in_output=True),
    dict(stop=["\nSimple", "better than implicit"]),  # (one that spans tokens, and one later)
]


@STREAM
@pytest.mark.parametrize("stop", STOPS, ids=["string", "list", "included", "spanning"])
def test_stop_strings_cut_the_text_as_offline_generate_does(server, offline, stream, stop):
    params = dict(temperature=0, max_tokens=24, **stop)
    expected = generate(server, offline, [PROMPT], **params)[0]
    choices, _ = complete(server, stream, prompt=PROMPT, **params)
    (choice,) = choices.values()
    assert choice["text"] == expected["text"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", expected["stop_reason"])
    matched = expected["stop_reason"]
    assert matched in (stop["stop"] if isinstance(stop["stop"], list) else [stop["stop"]])
    if stop.get("include_stop_str_in_output"):
        assert choice["text"].endswith(matched) and choice["text"].count(matched) == 1
    else:  # cut just before the stop string
        assert matched not in choice["text"] and unstopped(server, offline).startswith(choice["text"] + matched)


def unstopped(server, offline) -> str:
    return generate(server, offline, [PROMPT], temperature=0, max_tokens=24)[0]["text"]


NEWLINE = 199  # the built-in tokenizer's "\n"


@STREAM
@pytest.mark.parametrize(
    "params",
    [
        dict(stop_token_ids=[NEWLINE]),
        dict(stop_token_ids=[NEWLINE], min_tokens=9),
        dict(min_tokens=4, max_tokens=6),
        dict(min_tokens=70, max_tokens=72),  # (past SamplingParams' default max_tokens)
    ],
    ids=["stop_token_ids", "min_tokens", "min_tokens-alone", "min_tokens-past-64"],
)
def test_stop_token_ids_and_min_tokens_equal_offline_generate(server, offline, stream, params):
    params = dict(temperature=0, **{"max_tokens": 24, **params})
    expected = generate(server, offline, [PROMPT], **params)[0]
    choices, usage = complete(server, stream, prompt=PROMPT, **params)
    (choice,) = choices.values()
    assert choice["text"] == expected["text"] and usage.completion_tokens == len(expected["token_ids"])
    assert choice["finish_reason"] == expected["finish_reason"]
    if "stop_token_ids" in params:
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", NEWLINE)
        assert expected["token_ids"][-1] == NEWLINE and NEWLINE not in expected["token_ids"][:-1]
        assert usage.completion_tokens >= params.get("min_tokens", 1)
    else:
        assert choice["stop_reason"] is None


def is_sorted_descending(values: list[float]) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


@STREAM
def test_completion_logprobs_equal_offline_generate(server, offline, stream):
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    expected = generate(server, offline, [PROMPT], **params)[0]
    choices, _ = complete(server, stream, prompt=PROMPT, **params)
    (choice,) = choices.values()
    logprobs, entries, tokenizer = choice["logprobs"], expected["logprobs"], offline.tokenizer
    assert len(entries) == 12
    assert logprobs["token_logprobs"] == [entry.logprob for entry in entries]
    assert logprobs["tokens"] == [tokenizer.decode([entry.token_id]) for entry in entries]
    assert "".join(logprobs["tokens"]) == choice["text"] == expected["text"]  # (ASCII: a token is whole characters)
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(12)]
    for top, entry in zip(logprobs["top_logprobs"], entries):
        assert top == {tokenizer.decode([token_id]): value for token_id, value in entry.top.items()}
        assert len(top) == 3 and is_sorted_descending(list(top.values()))
    if stream:  # each chunk carries the logprobs of its own tokens
        for text, chunk_logprobs in choice["chunks"]:
            assert "".join(chunk_logprobs.tokens) == text


@pytest.mark.parametrize("num_top", [0, 2])
def test_completion_top_logprobs_hold_the_chosen_token_then_the_top_n(server, offline, num_top):
    """OpenAI's completions (and vLLM's): up to logprobs + 1 entries, the chosen token's first; sampled at temperature
    2 (seeded), so that chosen tokens outside the top N come (checked: one does), and logprobs 0 is the chosen alone."""
    params = dict(temperature=2.0, seed=11, max_tokens=16, ignore_eos=True, logprobs=num_top)
    expected = generate(server, offline, [PROMPT], **params)[0]
    choices, _ = complete(server, False, prompt=PROMPT, **params)
    tops, tokenizer = choices[0]["logprobs"]["top_logprobs"], offline.tokenizer
    outside = 0
    for top, entry in zip(tops, expected["logprobs"], strict=True):
        chosen_and_top = dict.fromkeys([entry.token_id, *entry.top])
        assert top == {tokenizer.decode([t]): ({**entry.top, entry.token_id: entry.logprob})[t] for t in chosen_and_top}
        assert next(iter(top)) == tokenizer.decode([entry.token_id])
        outside += entry.token_id not in entry.top
    assert outside > 0, "every chosen token was among the top N: the test shows nothing"


def test_streamed_logprobs_behind_held_back_text_all_arrive(server, offline):
    # " implicit" is held back token by token while it could still be the stop string: its logprobs wait too
    params = dict(temperature=0, max_tokens=24, logprobs=1, stop=" implicit.\nSimple")
    expected = generate(server, offline, [PROMPT], **params)[0]
    choices, usage = complete(server, True, prompt=PROMPT, **params)
    logprobs = choices[0]["logprobs"]
    assert choices[0]["text"] == expected["text"] and expected["finish_reason"] == "stop"
    assert logprobs["token_logprobs"] == [entry.logprob for entry in expected["logprobs"]]
    assert len(logprobs["tokens"]) == usage.completion_tokens
    assert any(chunk_logprobs and len(chunk_logprobs.tokens) > 1 for _, chunk_logprobs in choices[0]["chunks"])


@STREAM
def test_chat_logprobs_equal_offline_chat(server, offline, stream):
    server.wait_until_idle()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    expected = offline.chat(MESSAGES, params, use_tqdm=False)[0]
    args = dict(temperature=0, max_completion_tokens=10, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    choices, _ = complete(server, stream, chat=True, **args)
    (choice,) = choices.values()
    content, tokenizer = choice["logprobs"], offline.tokenizer
    assert choice["text"] == expected["text"] and len(content) == 10
    for token, entry in zip(content, expected["logprobs"]):
        assert (token.token, token.logprob) == (tokenizer.decode([entry.token_id]), entry.logprob)
        assert token.bytes == list(token.token.encode())
        assert [(t.token, t.logprob) for t in token.top_logprobs] == [
            (tokenizer.decode([token_id]), value) for token_id, value in entry.top.items()
        ]
        assert len(token.top_logprobs) == 2 and is_sorted_descending([t.logprob for t in token.top_logprobs])


def test_chat_without_logprobs_has_null_logprobs(server):
    choices, _ = complete(server, False, chat=True, temperature=0, max_completion_tokens=3)
    assert choices[0]["logprobs"] is None


def test_a_token_that_is_half_a_character_is_written_as_its_bytes(offline):
    from nanoref.serving.api_server import TokenTexts

    texts = TokenTexts(offline.tokenizer)
    first, second = offline.tokenizer.encode("é")  # the built-in vocabulary splits it into its two bytes
    assert texts(first) == ("bytes:\\xc3", [0xC3]) and texts(second) == ("bytes:\\xa9", [0xA9])
    assert bytes(texts(first)[1] + texts(second)[1]).decode() == "é"
    (ugly,) = offline.tokenizer.encode(" ugly")
    assert texts(ugly) == (" ugly", list(b" ugly"))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@STREAM
def test_n_above_1_with_greedy_sampling_is_a_400_naming_n_as_vllm(server, chat, stream):
    """vLLM's SamplingParams takes only n=1 with temperature 0 (its samples would all be the same): its words, a 400
    that names n, and nothing queued. Without a temperature a request samples (1.0, the server's default where the
    model's generation config names none, as vLLM's), so n=2 is served."""
    path, asked = ("chat/completions", {"messages": MESSAGES}) if chat else ("completions", {"prompt": PROMPT})
    body = {"model": MODEL, **asked, "max_tokens": 3, "n": 2, "stream": stream}
    response = httpx.post(f"{server.url}/v1/{path}", json={**body, "temperature": 0}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"]) == ("n must be 1 when using greedy sampling, got 2.", "n")
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()
    served = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT)
    assert served.status_code == 200, served.text
    server.wait_until_idle()
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()


@STREAM
def test_n_seeded_choices_equal_offline_generate_with_seed_plus_index(server, offline, stream):
    params = dict(max_tokens=8, ignore_eos=True, **HOT)
    expected = [generate(server, offline, [PROMPT], seed=40 + i, **params)[0]["text"] for i in range(3)]
    assert len(set(expected)) > 1, "the samples differ"
    choices, usage = complete(server, stream, prompt=PROMPT, n=3, seed=40, **params)
    assert sorted(choices) == [0, 1, 2]
    assert [choices[i]["text"] for i in range(3)] == expected
    assert [c["finish_reason"] for c in choices.values()] == ["length"] * 3
    assert usage.completion_tokens == 3 * 8 and usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))


@STREAM
def test_n_chat_choices_each_have_their_index_and_finish_reason(server, offline, stream):
    server.wait_until_idle()
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=5, n=2, **HOT)
    expected = offline.chat(MESSAGES, params, use_tqdm=False)[0]["outputs"]
    args = dict(max_completion_tokens=6, seed=5, n=2, extra_body={"ignore_eos": True}, **HOT)
    choices, usage = complete(server, stream, chat=True, **args)
    assert {i: (c["text"], c["finish_reason"]) for i, c in choices.items()} == {
        i: (out["text"], "length") for i, out in enumerate(expected)
    }
    assert usage.completion_tokens == 12


@STREAM
def test_penalties_equal_offline_generate(server, offline, stream):
    params = dict(temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=2.0)
    expected = generate(server, offline, [PROMPT], **params)[0]
    assert expected["text"] != unstopped(server, offline)[: len(expected["text"])], "the penalties change it"
    choices, _ = complete(server, stream, prompt=PROMPT, **params)
    assert choices[0]["text"] == expected["text"]


@STREAM
def test_a_seed_reproduces_its_sample(server, offline, stream):
    params = dict(max_tokens=10, ignore_eos=True, seed=1234, **HOT)
    first, _ = complete(server, stream, prompt=PROMPT, **params)
    second, _ = complete(server, stream, prompt=PROMPT, **params)
    other, _ = complete(server, stream, prompt=PROMPT, **{**params, "seed": 99})
    expected = generate(server, offline, [PROMPT], **params)[0]["text"]
    assert first[0]["text"] == second[0]["text"] == expected != other[0]["text"]


@STREAM
def test_a_batch_of_prompts_gets_one_choice_per_prompt_and_sample(server, offline, stream):
    prompts = [PROMPT, "Explicit is"]
    params = dict(max_tokens=5, ignore_eos=True, **HOT)  # (greedy takes only n=1, as in vLLM)
    # choice k: prompt k // 2, its sample k % 2 (seed + k % 2: each prompt's request has the request's seed)
    expected = [generate(server, offline, prompts, seed=30 + i, **params) for i in range(2)]
    choices, usage = complete(server, stream, prompt=prompts, n=2, seed=30, **params)
    assert {i: c["text"] for i, c in choices.items()} == {k: expected[k % 2][k // 2]["text"] for k in range(4)}
    assert usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in prompts)
    assert usage.completion_tokens == 4 * 5


@pytest.mark.parametrize("prompt", [[], ["x", 5], [[1, 2], [3, "a"]], ["ok", ""]])
def test_a_bad_batch_is_a_400_and_queues_nothing(server, prompt):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()


def slow_steps(server, monkeypatch) -> None:
    """20 ms more per step: 400 tokens take over 8 s, so blocks freed within 5 s were aborted."""
    runner = server.engine.llm.model_runner
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda *args, **kwargs: time.sleep(0.02) or real_run(*args, **kwargs))


LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}


def request_in_flight(server, seconds: float = TIMEOUT) -> str:
    deadline = time.monotonic() + seconds
    while not server.engine._requests:
        assert time.monotonic() < deadline, "no request reached the engine"
        time.sleep(0.01)
    (request_id,) = server.engine._requests
    return request_id


def test_an_aborted_request_is_an_error_not_a_finished_choice(server, monkeypatch):
    slow_steps(server, monkeypatch)
    caught = []

    def call():
        try:
            openai_fields = {k: v for k, v in LONG.items() if k != "ignore_eos"}
            server.client().completions.create(**openai_fields, extra_body={"ignore_eos": True})
        except openai.APIStatusError as error:
            caught.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    asyncio.run(server.engine.abort(request_in_flight(server)))
    thread.join(TIMEOUT)
    assert not thread.is_alive() and len(caught) == 1, "the client got a response as if it had finished"
    assert caught[0].status_code == 503 and "aborted" in caught[0].message
    server.wait_until_idle(seconds=5)


def test_an_aborted_stream_ends_with_an_error_event_not_a_finish(server, monkeypatch):
    slow_steps(server, monkeypatch)
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    asyncio.run(server.engine.abort(request_in_flight(server)))
    assert events[-1] == "[DONE]"
    payloads = [json.loads(event) for event in events[:-1]]
    assert payloads[-1]["error"]["code"] == 503
    assert all(choice["finish_reason"] is None for p in payloads[:-1] for choice in p["choices"])
    server.wait_until_idle(seconds=5)


def test_a_whole_response_whose_client_leaves_is_aborted(server, monkeypatch):
    slow_steps(server, monkeypatch)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=1.0)  # gives up, closes its connection
    server.wait_until_idle(seconds=5)
    monkeypatch.undo()
    assert server.client().completions.create(model=MODEL, prompt="Now is", max_tokens=2).usage.completion_tokens
