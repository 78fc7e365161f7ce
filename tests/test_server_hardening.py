"""The server under hostile or careless clients: huge and malformed bodies, wrong paths, slow bodies, disconnects,
a dead engine, SIGTERM. Every server runs on 127.0.0.1; every call and loop is bounded."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from nanoref import LLM  # noqa: E402
from nanoref.layers.logits_processors import TokenLogprobs  # noqa: E402
from nanoref.serving.api_server import (  # noqa: E402
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    Choice,
    TokenTexts,
    completion_logprobs,
    serve_in_background,
)
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import running_server  # noqa: E402
from .test_server import scrape, serve_command  # noqa: E402

MODEL = "nanoref-test"
SETTINGS = dict(device="cpu", num_kvcache_blocks=256)
PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(**SETTINGS), owns_llm=True), MODEL) as running:
        yield running


class Records(logging.Handler):
    """What uvicorn logs while a test runs (its loggers do not reach pytest's caplog: they do not propagate). A
    server started later configures uvicorn's logging again, which removes this handler: `attach` it again."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]

    def attach(self) -> None:
        logging.getLogger("uvicorn.error").addHandler(self)


@pytest.fixture
def uvicorn_log():
    records = Records()
    records.attach()
    try:
        yield records
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["param"] == param, body
    return body["error"]


def serves_on(server) -> None:
    answer = server.client().completions.create(model=MODEL, prompt="Flat is", max_tokens=2)
    assert answer.usage.completion_tokens >= 1


@contextmanager
def server_with(server, **options) -> Iterator[str]:
    """A second server on the module server's engine, with build_app's `options` -> its URL."""
    with serve_in_background(server.engine, MODEL, **options) as url:
        yield url


def serves_on_url(url: str) -> None:
    body = {"prompt": "Flat is", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200


# -- 1. a huge prompt is tokenized off the event loop --------------------------------------------------------------


def test_health_stays_responsive_while_a_huge_prompt_is_tokenized(server):
    prompt = "Beautiful is better than ugly. " * 130_000  # 4 MB: ~3 s of tokenizing on this CPU
    answer = {}

    def huge() -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        answer["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)

    thread = threading.Thread(target=huge)
    thread.start()
    waits = []
    with httpx.Client(timeout=TIMEOUT) as client:
        while thread.is_alive():
            start = time.monotonic()
            assert client.get(f"{server.url}/health").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join(TIMEOUT)
    error = assert_openai_error(answer["response"], 400, "prompt")
    assert "max_model_len" in error["message"]
    assert max(waits) < 1.0, f"/health waited {max(waits):.2f} s behind the tokenizer"
    assert len(waits) >= 5, "the huge request was answered before /health was asked: nothing was tested"


def test_a_body_over_the_size_limit_is_a_413_before_it_is_read(server):
    with server_with(server, max_body_bytes=1000) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 1}, timeout=TIMEOUT)
        assert_openai_error(response, 413)
        small = httpx.post(f"{url}/v1/completions", json={"prompt": "Flat is", "max_tokens": 1}, timeout=TIMEOUT)
        assert small.status_code == 200, small.text


# -- 2. malformed JSON is a 400 --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError in the JSON decoder
        b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",  # int() refuses over 4,300 digits
    ],
    ids=["nested-100k-deep", "integer-of-5001-digits"],
)
def test_json_too_deep_or_with_a_huge_integer_is_a_400_not_a_500(server, content, uvicorn_log):
    response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=TIMEOUT)
    assert "not valid JSON" in assert_openai_error(response, 400)["message"]
    assert uvicorn_log.errors() == []
    serves_on(server)


@pytest.mark.parametrize(
    "content_type,served",
    [(None, True), ("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON", True),
     ("application/vnd.api+json", True), ("application/x-www-form-urlencoded", False), ("text/plain", False),
     ("multipart/form-data; boundary=x", False)],
)  # fmt: skip
def test_a_body_sent_as_something_other_than_json_is_a_400_as_in_vllm(server, content_type, served):
    """FastAPI's rule for a JSON body (vLLM's routes): curl -d's form encoding is refused, not read as JSON."""
    headers = {"Content-Type": content_type} if content_type else {}
    content = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=content, headers=headers, timeout=TIMEOUT)
    if served:
        assert response.status_code == 200, response.text
    else:
        assert "Content-Type: application/json" in assert_openai_error(response, 400)["message"]
    serves_on(server)


# -- 3 and 6. errors name their field; the server's limits -----------------------------------------------------

MESSAGES = [{"role": "user", "content": "What is better?"}]
BLAMED = [
    ("completions", {"prompt": PROMPT, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"messages": MESSAGES, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": PROMPT, "n": MAX_N + 1}, "n"),
    ("completions", {"prompt": PROMPT, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ("completions", {"prompt": PROMPT, "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ("chat/completions", {"messages": MESSAGES, "n": MAX_N + 1}, "n"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BLAMED, ids=[f"{p}-{param}-{i}" for i, (p, _, param) in enumerate(BLAMED)]
)
def test_an_error_names_the_field_it_is_about(server, path, body, param):
    response = httpx.post(f"{server.url}/v1/{path}", json={"max_tokens": 2, **body}, timeout=TIMEOUT)
    assert_openai_error(response, 400, param)
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()


def test_a_min_tokens_past_the_room_chats_default_leaves_names_min_tokens(server):
    """No max_tokens: chat's default is the room the context leaves, and a min_tokens past it names min_tokens (its
    message names max_tokens too, which the client never sent)."""
    body = {"model": MODEL, "messages": MESSAGES, "min_tokens": 10**6}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert (
        "min_tokens must be an integer in [0, max_tokens = "
        in assert_openai_error(response, 400, "min_tokens")["message"]
    )
    serves_on(server)


def test_the_engines_limits_name_the_field_that_asked_past_them():
    """max_logprobs (vLLM's words) names logprobs / prompt_logprobs / chat's top_logprobs; a prompt the KV cache
    cannot hold even with max_tokens 1 names the prompt (messages), not max_tokens, which lowering cannot help."""
    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=4, kvcache_block_size=16, max_logprobs=5), owns_llm=True)
    long_text = "Beautiful is better than ugly. " * 20  # (over 64 tokens: 4 blocks of 16)
    cases = [
        ("completions", {"prompt": PROMPT, "logprobs": 10}, "logprobs", "greater than max allowed: 5"),
        ("completions", {"prompt": PROMPT, "prompt_logprobs": 10}, "prompt_logprobs", "greater than max allowed"),
        ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 10}, "top_logprobs", "max"),
        ("chat/completions", {"messages": [{"role": "user", "content": long_text}]}, "messages", "shorten the prompt"),
        ("completions", {"prompt": long_text}, "prompt", "shorten the prompt"),
    ]
    with running_server(engine, MODEL) as running:
        for path, body, param, words in cases:
            response = httpx.post(f"{running.url}/v1/{path}", json={"max_tokens": 1, **body}, timeout=TIMEOUT)
            assert words in assert_openai_error(response, 400, param)["message"]
        assert running.blocks_used() == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "Flat \ud800 is"}, "prompt"),
        ("completions", {"prompt": ["Flat is", "\udfff"]}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}, "messages"),
        ("completions", {"prompt": PROMPT, "bad_words": ["ok\udfff"]}, "bad_words"),
        ("completions", {"prompt": PROMPT, "request_id": "\ud800"}, "request_id"),
        ("chat/completions", {"messages": MESSAGES, "request_id": "\ud800"}, "request_id"),
        ("completions", {"prompt": PROMPT, "stop": ["\ud800"]}, "stop"),
        ("completions", {"prompt": PROMPT, "cache_salt": "\ud800"}, "cache_salt"),
        ("completions", {"prompt": PROMPT, "te\udc00mp": 1}, "te\\udc00mp"),  # (a key: named escaped)
        ("tokenize", {"prompt": "a", "\udc00": 1}, "\\udc00"),
        ("completions", {"prompt": PROMPT, "stop": ["a\ud800" + "\U0001f600" * 100]}, "stop"),  # (a long one)
        ("completions", {"prompt": PROMPT, "\ud800" + "\U0001f600" * 100: 1}, ("\\ud800" + "\\U0001f600" * 8)[:80]),
    ],
    ids=[
        "prompt",
        "batch",
        "chat",
        "bad_words",
        "request_id",
        "chat-request_id",
        "stop",
        "cache_salt",
        "key",
        "tok",
        "long-text",
        "long-key",
    ],  # fmt: skip
)
def test_a_lone_surrogate_is_a_400_that_says_so(server, path, body, param):
    """Anywhere in the body (a key too): a tokenizer cannot read it, nor can a reply that repeats it be encoded."""
    content = json.dumps({"max_tokens": 2, **body}).encode()  # ("\\ud800": JSON's escape, as a client sends it)
    url = f"{server.url}/{path}" if path == "tokenize" else f"{server.url}/v1/{path}"
    response = httpx.post(url, content=content, timeout=TIMEOUT)
    assert "lone UTF-16 surrogate" in assert_openai_error(response, 400, param)["message"]
    message = response.json()["error"]["message"]
    assert message.isascii() and len(message) < 160, "the path is cut short, as every name a message repeats"
    serves_on(server)


def test_include_usage_that_is_no_bool_is_a_400(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": "maybe"}}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert "include_usage" in assert_openai_error(response, 400, "stream_options")["message"]


IGNORED_STREAM_OPTIONS = [
    # (vLLM's 400: "Stream options can only be defined when `stream=True`.")
    ("completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream"),
    ("chat/completions", {"messages": MESSAGES, "stream": False, "stream_options": {"include_usage": False}}, "stream"),
    # vLLM's usage in every chunk without usage, which vLLM ignores
    (
        "completions",
        {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
        "continuous_usage_stats needs include_usage",
    ),
    (
        "chat/completions",
        {"messages": MESSAGES, "stream": True, "stream_options": {"include_usgae": True}},
        "include_usgae",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "word"),
    IGNORED_STREAM_OPTIONS,
    ids=["no-stream", "stream-false", "continuous_usage_stats", "typo"],
)
def test_stream_options_that_would_be_ignored_are_a_400(server, path, body, word):
    response = httpx.post(f"{server.url}/v1/{path}", json={"max_tokens": 2, **body}, timeout=TIMEOUT)
    assert word in assert_openai_error(response, 400, "stream_options")["message"]
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk_as_vllm(server, path):
    chat = path.startswith("chat")
    prompt = {"messages": MESSAGES, "logprobs": True} if chat else {"prompt": PROMPT, "logprobs": 0}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**prompt, "max_tokens": 6, "n": 2, "ignore_eos": True, "stream": True, "stream_options": options}
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    prompt_tokens = final["usage"]["prompt_tokens"]
    received = {0: 0, 1: 0}  # each choice's tokens so far, counted from its logprobs
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        if choice["logprobs"] is not None:
            entries = choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
            received[choice["index"]] += len(entries)
        expected = {"prompt_tokens": prompt_tokens, "completion_tokens": received[choice["index"]]}
        assert chunk["usage"] == expected | {"total_tokens": prompt_tokens + received[choice["index"]]}, chunk
    assert received == {0: 6, 1: 6}
    response = httpx.post(
        f"{server.url}/v1/{path}",
        json={**body, "stream_options": {"continuous_usage_stats": 2}},
        timeout=TIMEOUT,
    )
    assert "must be true or false" in assert_openai_error(response, 400, "stream_options")["message"]


def test_a_max_tokens_the_context_cannot_hold_is_a_400_as_in_vllm(server):
    limit = server.engine.config.max_model_len
    room = limit - len(server.engine.tokenizer.encode(PROMPT))
    for path, body, field in [
        ("completions", {"prompt": PROMPT, "max_tokens": room + 1}, "max_tokens"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": limit}, "max_tokens"),
        ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": limit}, "max_completion_tokens"),
    ]:
        response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT)
        message = assert_openai_error(response, 400, field)["message"]
        assert "is too large" in message and f"maximum context length is {limit} tokens" in message, message
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()
    # what the context holds is served, and so is a request that leaves max_tokens to the server
    body = {"prompt": PROMPT, "max_tokens": room, "stop": ["."]}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
    body = {"prompt": "x " * (room - 2), "max_tokens": None}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200


def test_stream_options_at_their_defaults_are_served(server):
    for body in (
        {"prompt": PROMPT, "stream_options": {}},  # (an empty object, as null: no option, as in vLLM)
        {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
    ):
        response = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 2, **body}, timeout=TIMEOUT)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "options,usage",
    [({}, True), ({"include_usage": True}, True), ({"include_usage": None}, False), ({"include_usage": False}, False),
     (None, False)],
)  # fmt: skip
def test_an_empty_stream_options_object_includes_usage_as_vllms(server, options, usage):
    """vLLM's StreamOptions defaults include_usage to true: any stream_options object asks for the usage chunk unless
    it sets include_usage to false or null."""
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_options": options}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert any(chunk.get("usage") for chunk in chunks) is usage, chunks


def test_the_limits_themselves_are_served(server):
    stop = ["x" * MAX_STOP_STRING_CHARS] + [f"zz{i}" for i in range(MAX_STOP_STRINGS - 1)]
    body = {"prompt": PROMPT, "max_tokens": 2, "n": 4, "stop": stop}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200 and len(response.json()["choices"]) == 4, response.text


# -- 4. wrong paths and methods ----------------------------------------------------------------------------------


def test_a_wrong_method_or_path_gets_openai_error_body(server):
    response = httpx.get(f"{server.url}/v1/completions", timeout=TIMEOUT)
    assert "POST" in assert_openai_error(response, 405)["message"]
    assert response.headers["allow"] == "POST"
    assert_openai_error(httpx.post(f"{server.url}/v1/nothing", json={}, timeout=TIMEOUT), 404)
    assert_openai_error(httpx.get(f"{server.url}/v2/models", timeout=TIMEOUT), 404)
    with pytest.raises(openai.NotFoundError):  # as OpenAI's client reports it
        server.client().embeddings.create(model=MODEL, input="x")


# -- 10. a body that never arrives ---------------------------------------------------------------------------------


def test_a_body_shorter_than_its_content_length_is_a_408_within_the_timeout(server):
    with server_with(server, body_timeout=0.5) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b'Content-Length: 1000\r\n\r\n{"prompt": "x"')  # 986 bytes short
            start = time.monotonic()
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
            waited = time.monotonic() - start
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert b"connection: close" in reply.lower()
            body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == 408 and "0.5 s" in body["error"]["message"]
            assert 0.4 < waited < 5
        serves_on_url(url)


# -- 11. text_offset -------------------------------------------------------------------------------------------


def offsets(tokenizer, ids: list[int], pieces: list[int]) -> list[int]:
    """completion_logprobs' text_offset for `ids`, sent in chunks of `pieces` tokens (as a stream sends them)."""
    choice, found, start = Choice(0), [], 0
    texts = TokenTexts(tokenizer)
    for size in pieces:
        entries = [TokenLogprobs(token_id, 0.0, 1, {}) for token_id in ids[start : start + size]]
        found += completion_logprobs(texts, entries, choice)["text_offset"]
        start += size
    return found


def test_text_offset_indexes_the_final_text_around_broken_characters(server):
    tokenizer = server.engine.tokenizer
    e_first, e_second = tokenizer.encode("é")  # (the built-in vocabulary splits it in its two bytes)
    (ugly,) = tokenizer.encode(" ugly")
    cases = [
        [e_first, ugly, ugly],  # half a character, never finished: U+FFFD in the text, the first token's
        [ugly, e_first, e_first, e_second, ugly],  # one broken by the start of the next
        [e_first, e_second, ugly, e_first],  # whole, then a half at the end
    ]
    for ids in cases:
        text = tokenizer.decode(ids)
        # where each token's text starts in the final text: what the tokens before it decode to, up to where
        # it stops agreeing with the final text (a half character decodes to U+FFFD alone, and is no character
        # of the text until its other half comes)
        expected = [len(os.path.commonprefix([tokenizer.decode(ids[:i]), text])) for i in range(len(ids))]
        assert "\ufffd" in text or ids[-1] == e_first
        for pieces in ([len(ids)], [1] * len(ids)):
            assert offsets(tokenizer, ids, pieces) == expected, (ids, text, pieces)


# -- 12. the "abort" counter counts samples, streamed or not -----------------------------------------------------


def slow_steps(server, monkeypatch) -> None:
    runner = server.engine.llm.model_runner
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda *args, **kwargs: time.sleep(0.02) or real_run(*args, **kwargs))


ABORTS = "nanoref_requests_total{finish_reason=abort}"
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_counts_one_abort_per_sample(server, monkeypatch, stream):
    slow_steps(server, monkeypatch)
    before = scrape(server).get(ABORTS, 0)
    body = {**LONG, "n": 3, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # leave after the first piece of text
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    server.wait_until_idle(seconds=5)
    deadline = time.monotonic() + 5  # (the count is booked when the response's cleanup runs)
    while scrape(server).get(ABORTS, 0) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(server).get(ABORTS, 0) == before + 3


def test_an_aborted_n_request_counts_each_sample_once(server, monkeypatch):
    import asyncio

    slow_steps(server, monkeypatch)
    before = scrape(server).get(ABORTS, 0)
    caught = []

    def call():
        try:
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "n": 3}, timeout=TIMEOUT).raise_for_status()
        except httpx.HTTPStatusError as error:
            caught.append(error.response.status_code)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.engine._requests:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (request_id,) = server.engine._requests
    asyncio.run(server.engine.abort(request_id))
    thread.join(TIMEOUT)
    assert caught == [503]
    server.wait_until_idle(seconds=5)
    assert scrape(server).get(ABORTS, 0) == before + 3


# -- 9. a client that resets its connection mid-stream ---------------------------------------------------------


def test_clients_that_reset_mid_request_or_mid_stream_log_nothing(server, monkeypatch, uvicorn_log):
    slow_steps(server, monkeypatch)
    port = int(server.url.rsplit(":", 1)[1])
    for i in range(12):  # whole and streamed, one prompt and several, n 1 and 2, reset at various points
        prompt = [PROMPT, "Simple is"][: 1 + i % 2]
        body = json.dumps({**LONG, "prompt": prompt, "n": 1 + (i // 2) % 2, "stream": i % 3 != 2}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            if i % 4:
                sock.recv(1 + 300 * (i % 4))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    for _ in range(3):  # and while the body is on its way (the server waits for the rest of it)
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b'Content-Length: 100\r\n\r\n{"prompt": ')
            time.sleep(0.1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    server.wait_until_idle(seconds=10)
    time.sleep(0.3)  # (a response's cleanup runs after its abort)
    assert uvicorn_log.errors() == []
    serves_on(server)


# -- 7. a dead engine ----------------------------------------------------------------------------------------------


def test_requests_after_the_engine_process_died_are_503s_without_tracebacks(uvicorn_log):
    with running_server(AsyncLLM.from_model(engine_process=True, **SETTINGS), MODEL) as server:
        uvicorn_log.attach()
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        os.kill(server.engine._engine.process.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == 503 and "engine" in last["error"]["message"], last
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for stream in (False, True):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": stream}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
            assert "engine has stopped" in assert_openai_error(response, 503)["message"]
        chat = {"messages": MESSAGES, "max_completion_tokens": 2}
        assert_openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=TIMEOUT), 503)
    assert uvicorn_log.errors() == []


# -- 5 and 8. the serve command ------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["70000", "-1", "65536"])
def test_the_serve_command_refuses_a_port_out_of_range_before_loading_the_model(port, capsys, monkeypatch):
    from nanoref.serve import main

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(AsyncLLM, "from_model", never)
    assert main(["--device", "cpu", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --port") and err.count("\n") == 1, err


def test_the_serve_command_refuses_an_address_in_use_before_loading_the_model(capsys, monkeypatch):
    from nanoref.serve import main

    monkeypatch.setattr(AsyncLLM, "from_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert main(["--device", "cpu", "--port", str(taken.getsockname()[1])]) == 2
    assert capsys.readouterr().err.startswith("error: cannot listen on 127.0.0.1:")


def ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_the_serve_command_listens_on_an_ipv6_address_and_says_where_in_a_url():
    # `--host ::1` (or `::`, every interface) was an error: "Address family for hostname not supported"
    with serve_command("--host", "::1") as server:
        assert server.url.startswith("http://[::1]:"), server.url
        assert httpx.get(f"{server.url}/models", timeout=TIMEOUT).status_code == 200
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(TIMEOUT) == 0


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_the_serve_command_stops_when_its_engine_process_dies_as_vllms():
    # vLLM's server stops once its engine is dead, so that a supervisor sees it end (and may start it again)
    env = {key: value for key, value in os.environ.items() if key != "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"}
    with serve_command("--engine-process", "on", env=env) as server:
        (engine,) = server.engine
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=TIMEOUT) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        os.kill(engine, signal.SIGKILL)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503, events[-2:]
        assert server.process.wait(TIMEOUT) == 1
        err = server.process.stderr.read()
        assert "Traceback" not in err
        assert f"error: the engine process (pid {engine}) ended unexpectedly (killed by signal 9); the server" in err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_the_serve_command_stops_on_sigterm_while_a_client_has_stopped_reading_its_stream():
    # uvicorn alone waits for every response to end: a client that stops reading its stream held the stop for ever
    with serve_command() as server:
        host, port = server.url.split("http://", 1)[1].split("/", 1)[0].split(":")
        # ~20 MB of events, far more than the sockets' buffers hold: the server's writes stall
        body = json.dumps(
            {"prompt": PROMPT, "max_tokens": 480, "n": 64, "logprobs": 5, "ignore_eos": True, "stream": True}
        )
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.settimeout(TIMEOUT)
            client.connect((host, int(port)))
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
            assert client.recv(12) == b"HTTP/1.1 200"  # streaming has begun; nothing more is read
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(TIMEOUT) == -signal.SIGTERM
        err = server.process.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err
        server.assert_the_engine_is_gone()


@pytest.mark.parametrize("grace", [0.0, TIMEOUT], ids=["at-once", "drained"])
def test_a_stop_lets_streams_finish_for_shutdown_timeout_seconds_then_aborts_them(server, grace, monkeypatch):
    if not grace:  # (the cut comes ~0.2 s after the first event: a fast machine must not end the stream before it)
        slow_steps(server, monkeypatch)
    import uvicorn

    from nanoref.serve import bounded_shutdown
    from nanoref.serving.api_server import build_app

    app = build_app(server.engine, MODEL)
    bounded = bounded_shutdown(uvicorn.Server, grace, server.engine.abort_all)(uvicorn.Config(app, log_level="warning"))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=bounded.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while not bounded.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        events = []
        body = {**LONG, "n": 8, "stream": True}  # (long enough to be running still when the stop's abort comes)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        bounded.should_exit = True  # as Ctrl-C or SIGTERM does
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        assert events[-1] == "[DONE]"
        if grace:  # the stream ran to its end
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:  # aborted, as vLLM's stop does: the stream ends with its error, then [DONE]
            error = json.loads(events[-2])["error"]
            assert error["code"] == 503 and "was aborted before it finished" in error["message"], error
        server.wait_until_idle()
    finally:
        bounded.should_exit = True
        thread.join(TIMEOUT)
        sock.close()


class WatchedEngine:
    """An AsyncLLM's face to the engine watchdog: `errored` (True once dead or closed) and `dead_error`; `on_read`
    runs at each read of `errored`, before it answers (what the server does meanwhile)."""

    def __init__(self, on_read=lambda: None) -> None:
        self.closed, self.on_read, self.reads = False, on_read, threading.Semaphore(0)
        self.dead_error = "the engine process (pid 1) ended unexpectedly (killed by signal 15)"

    @property
    def errored(self) -> bool:
        self.on_read()
        self.reads.release()
        return self.closed


def watch_engine(engine: WatchedEngine, stopped: threading.Event, server, capsys) -> tuple[bool, str]:
    """The watchdog on `engine` until it has read `errored` twice (or acted, or the server ended), then the server's
    end -> (whether it said the engine died, what it wrote on stderr)."""
    from nanoref.serve import stop_when_the_engine_dies

    died, watchdog = stop_when_the_engine_dies(engine, server, stopped, poll=0.001)
    for _ in range(2):
        assert engine.reads.acquire(timeout=TIMEOUT)
        if died.is_set() or stopped.is_set():
            break
    stopped.set()
    watchdog.join(TIMEOUT)
    assert not watchdog.is_alive()
    return died.is_set(), capsys.readouterr().err


def test_the_engine_watchdog_stops_the_server_once_the_engine_died(capsys):
    server, stopped, engine = type("Server", (), {"should_exit": False})(), threading.Event(), WatchedEngine()
    engine.closed = True  # (died: errored, and the server is not stopping)
    died, err = watch_engine(engine, stopped, server, capsys)
    assert died and server.should_exit
    assert err == f"error: {engine.dead_error}; the server stops\n"


def test_the_engine_watchdog_is_quiet_when_a_clean_stop_closes_the_engine_as_it_looks(capsys):
    # the server's end comes between the watchdog's wake-up and its look at the engine: main sets `stopped`, then
    # closes the engine, which is errored from then on (here uvicorn's run ended without should_exit, as when its
    # startup fails); that end is no engine death
    server, stopped = type("Server", (), {"should_exit": False})(), threading.Event()
    engine = WatchedEngine()

    def stop_now() -> None:
        stopped.set()
        engine.closed = True

    engine.on_read = stop_now
    died, err = watch_engine(engine, stopped, server, capsys)
    assert not died and err == ""


def test_an_engine_that_ends_while_the_server_stops_is_no_death(capsys):
    # systemd (and `kill -TERM -PGID`) sends SIGTERM to the whole process group: uvicorn starts its shutdown and the
    # engine process dies of the same signal; the server must end by SIGTERM, not exit 1 saying the engine died
    server, stopped, engine = type("Server", (), {"should_exit": True})(), threading.Event(), WatchedEngine()
    engine.closed = True
    died, err = watch_engine(engine, stopped, server, capsys)
    assert not died and err == ""


def test_the_serve_command_ends_by_a_sigterm_sent_to_its_whole_process_group():
    # systemd's stop (KillMode=control-group, its default) and `kill -TERM -PGID` signal every process of the server,
    # the engine process too: the server must end by SIGTERM, as for its own, not exit 1 saying its engine died
    env = {key: value for key, value in os.environ.items() if key != "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"}
    with serve_command("--engine-process", "on", env=env, new_session=True) as server:
        body = {"prompt": PROMPT, "max_tokens": 2}  # (answered: uvicorn runs, its signal handlers are in place)
        assert httpx.post(f"{server.url}/completions", json=body, timeout=TIMEOUT).status_code == 200
        os.killpg(server.process.pid, signal.SIGTERM)
        assert server.process.wait(TIMEOUT) == -signal.SIGTERM
        err = server.process.stderr.read()
        assert "Traceback" not in err and "ended unexpectedly" not in err, err
        assert "leaked semaphore" not in err, err  # (the engine process, killed by it, left its semaphore)


@pytest.mark.parametrize("value, keep", [(None, False), ("0", False), ("1", True), ("", False)])
def test_vllms_keep_alive_on_engine_death_variable_is_read_as_vllm_reads_it(value, keep, monkeypatch):
    from nanoref.serve import keep_alive_on_engine_death

    monkeypatch.delenv("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", raising=False)
    if value is not None:
        monkeypatch.setenv("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", value)
    assert keep_alive_on_engine_death() is keep


@pytest.mark.parametrize("value", ["true", "yes", "on"])
def test_a_keep_alive_on_engine_death_that_is_no_integer_is_an_error_before_the_model_loads(value, monkeypatch, capsys):
    # vLLM reads the variable with int(); read as 0 instead, "true" would silently stop the server on engine death
    from nanoref.serve import main

    monkeypatch.setenv("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", value)
    assert main(["--device", "cpu", "--port", "70000"]) == 2  # (a bad port too: a check that misses it never serves)
    message = f"error: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH must be an integer (1: keep the server up), got {value!r}\n"
    assert capsys.readouterr().err == message


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_the_serve_command_stops_the_engine_on_sigterm_and_ends_by_it():
    with serve_command("--engine-process", "on") as server:
        assert len(server.engine) == 1
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(f"{server.url}/completions", json=body, timeout=TIMEOUT).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(TIMEOUT) == -signal.SIGTERM  # as uvicorn ends on SIGTERM, after its shutdown
        assert "Traceback" not in server.process.stderr.read()
        server.assert_the_engine_is_gone()  # engine.close() ran


@contextmanager
def serve_command_loading_its_model() -> Iterator[tuple]:
    """`python -m nanoref.serve` with an engine process, in a session of its own, caught while that process loads the
    model -> (the server's Popen, the engine process's pids); on the way out the session is killed (an engine
    process left loading included)."""
    import subprocess
    import sys

    from .test_server import children_of

    command = [sys.executable, "-m", "nanoref.serve", "--device", "cpu", "--port", "0", "--engine-process", "on"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline, engine = time.monotonic() + TIMEOUT, set()
        while not engine:  # the engine process started: the server waits for its model
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
            engine = {
                pid for pid in children_of(process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
            }
        yield process, engine
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_ctrl_c_while_the_engine_process_loads_the_model_stops_at_once_without_a_traceback():
    # Ctrl-C reaches the whole process group: the engine process, still importing, printed a traceback of its own;
    # the server's KeyboardInterrupt left the engine process waiting for commands, and the exit waited for it: a hang
    with serve_command_loading_its_model() as (process, engine):
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(TIMEOUT) == 0
        out, err = process.communicate()
        assert out == "" and err == "", (out, err)  # (stopped before it served: it never said where it listens)
        for pid in engine:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_sigterm_while_the_engine_process_loads_the_model_ends_it_with_the_server():
    # the server died of the signal at once, and its engine process went on loading the model on its own
    with serve_command_loading_its_model() as (process, engine):
        process.send_signal(signal.SIGTERM)  # (the server alone, as `kill PID` sends it)
        assert process.wait(TIMEOUT) == -signal.SIGTERM
        for pid in engine:  # ended and reaped by the server before it ended
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert "Traceback" not in process.stderr.read()


def test_ctrl_c_while_the_model_loads_ends_the_serve_command_as_a_stop(monkeypatch, capsys):
    from nanoref.serve import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncLLM, "from_model", interrupted)
    try:
        code = main(["--device", "cpu", "--port", "0"])
    except KeyboardInterrupt:  # (would end the whole test session)
        pytest.fail("Ctrl-C escaped the serve command as a KeyboardInterrupt: a traceback")
    assert code == 0
    assert capsys.readouterr().err == ""
