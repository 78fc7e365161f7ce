"""vLLM's request ids on the server: a request's `X-Request-Id` header, else its body's `request_id`, names its response
(`cmpl-<id>`, `chatcmpl-<id>`), streamed chunks too; two requests may share one; `--enable-request-id-headers` puts
`X-Request-Id` on every response; `--enable-prompt-tokens-details` counts the prompt tokens the prefix cache served;
`--enable-force-include-usage` puts usage in every chunk of every stream.
Real HTTP on 127.0.0.1 (OpenAI's client and httpx), the built-in model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from nanoref import LLM  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import running_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is better?"}]
ASK = dict(model="m", max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=128), owns_llm=True)
    with running_server(engine, "m", enable_request_id_headers=True) as running:
        yield running


def test_the_body_request_id_names_the_response(server):
    client = server.client()
    completion = client.completions.create(prompt="Beautiful is", extra_body={"request_id": "abc"}, **ASK)
    assert completion.id == "cmpl-abc"
    chat = client.chat.completions.create(messages=MESSAGES, extra_body={"request_id": "abc"}, **ASK)
    assert chat.id == "chatcmpl-abc"
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, extra_body={"request_id": "s"}, **ASK))
    assert chunks and {chunk.id for chunk in chunks} == {"chatcmpl-s"}
    assert client.completions.create(prompt="Beautiful is", **ASK).id.startswith("cmpl-")  # (none given: a fresh one)


def test_the_x_request_id_header_wins_and_comes_back(server):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, "request_id": "from-body"}
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-1"}, timeout=TIMEOUT
    )
    assert response.status_code == 200 and response.json()["id"] == "chatcmpl-trace-1"
    assert response.headers["x-request-id"] == "trace-1"
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3, "stream": True},
        headers={"X-Request-Id": "trace-2"}, timeout=TIMEOUT,
    ) as streamed:  # fmt: skip
        assert streamed.headers["x-request-id"] == "trace-2" and '"id": "cmpl-trace-2"' in streamed.read().decode()
    fresh = httpx.get(f"{server.url}/health", timeout=TIMEOUT).headers["x-request-id"]  # (none sent: a fresh one)
    assert fresh and fresh != httpx.get(f"{server.url}/health", timeout=TIMEOUT).headers["x-request-id"]


def test_two_requests_may_share_a_request_id(server):
    client = server.client()

    def ask(_) -> str:
        return client.completions.create(prompt="Beautiful is", extra_body={"request_id": "same"}, **ASK).id

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == ["cmpl-same"] * 4
    server.wait_until_idle()


def test_a_request_id_that_is_not_a_string_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().completions.create(prompt="Hi", extra_body={"request_id": 5}, **ASK)
    assert raised.value.body["param"] == "request_id" and "request_id must be a string" in raised.value.message


def test_without_the_flag_no_response_carries_the_header():
    with running_server(AsyncLLM(LLM(device="cpu", num_kvcache_blocks=64), owns_llm=True), "m") as plain:
        response = httpx.post(
            f"{plain.url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2},
            headers={"X-Request-Id": "t"}, timeout=TIMEOUT,
        )  # fmt: skip
        assert response.json()["id"] == "cmpl-t" and "x-request-id" not in response.headers


def test_prompt_tokens_details_count_the_prompt_tokens_the_prefix_cache_served(server):
    """--enable-prompt-tokens-details: a prompt of 40 ids sent again finds its 2 full blocks of 16 in the cache."""
    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=64, kvcache_block_size=16), owns_llm=True)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks and 8 more
    with running_server(engine, "m", enable_prompt_tokens_details=True) as detailed:
        client = detailed.client()
        first = client.completions.create(model="m", prompt=prompt, max_tokens=2)
        assert first.usage.prompt_tokens == 40 and first.usage.prompt_tokens_details is None  # (nothing cached yet)
        again = client.completions.create(model="m", prompt=prompt, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == 32
        chunks = list(
            client.completions.create(
                model="m", prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    plain = server.client().completions.create(model="m", prompt=prompt, max_tokens=2)  # the control: no flag
    plain = server.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    assert plain.usage.prompt_tokens_details is None


def test_force_include_usage_ends_every_stream_with_its_usage(server):
    """--enable-force-include-usage: a stream that did not ask (no stream_options, or include_usage false) ends with
    the usage chunk too, in both APIs, and every chunk before it carries its usage so far, as vLLM's
    should_include_usage forces both (include_usage and continuous_usage_stats); the server without the flag (the
    module's) sends none."""
    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=64), owns_llm=True)
    with running_server(engine, "m", enable_force_include_usage=True) as forced:
        client = forced.client()
        for options in (None, {"include_usage": False}, {"continuous_usage_stats": False}):
            extra = {} if options is None else {"stream_options": options}
            chunks = list(client.completions.create(prompt="Beautiful is", stream=True, **extra, **ASK))
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
            counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]  # (every chunk has its usage so far)
            assert counts == sorted(counts) and counts[-1] == 4 and chunks[0].usage.prompt_tokens > 0
            chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **extra, **ASK))
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
            counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]
            assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4
        assert client.completions.create(prompt="Beautiful is", **ASK).usage.completion_tokens == 4
        # vLLM's: the forced usage is usage enough for continuous_usage_stats, which include_usage false then keeps
        options = {"include_usage": False, "continuous_usage_stats": True}
        chunks = list(client.completions.create(prompt="Beautiful is", stream=True, stream_options=options, **ASK))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]  # (every chunk has its usage so far)
        assert counts == sorted(counts) and counts[-1] == 4 and chunks[0].usage.prompt_tokens > 0
    plain = list(server.client().completions.create(prompt="Beautiful is", stream=True, **ASK))
    assert plain and all(chunk.usage is None for chunk in plain)
