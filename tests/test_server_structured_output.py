"""Structured output through the server: OpenAI's `response_format` and vLLM's `structured_outputs` extra field, on
completions and chat, through the openai client; a schema the grammar library refuses is a 400 naming the field,
and the server serves on. A real server on 127.0.0.1 with the built-in model."""

from __future__ import annotations

import json
import math
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

from nanoref import LLM  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import needs_xgrammar, running_server  # noqa: E402

MODEL = "nanoref-structured"
MESSAGES = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(device="cpu", seed=0), owns_llm=True), MODEL) as running:
        yield running


@needs_xgrammar
def test_chat_response_format_json_schema_and_json_object(server):
    client = server.client()
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0, response_format=schema_format
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0.8, seed=3, n=2, stream=True,
        response_format={"type": "json_object"},
    )  # fmt: skip
    texts, reasons = ["", ""], [None, None]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop", "stop"], texts
    assert all(isinstance(json.loads(text), dict) for text in texts)


@needs_xgrammar
def test_completions_structured_outputs_extra_field(server):
    client = server.client()
    constraint = {"json": SCHEMA, "disable_any_whitespace": True}
    answer = client.completions.create(
        model=MODEL, prompt="A person:", max_tokens=80, temperature=1.0, seed=5, n=3,
        extra_body={"structured_outputs": constraint},
    )  # fmt: skip
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    chosen = client.completions.create(
        model=MODEL, prompt="Yes or no?", max_tokens=20, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert chosen.choices[0].text in ("yes", "no")
    by_regex = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, extra_body={"structured_outputs": {"regex": r"\d{3}-[a-z]{2}"}}
    )
    assert re.fullmatch(r"\d{3}-[a-z]{2}", by_regex.choices[0].message.content)


@needs_xgrammar
def test_vllms_whole_structured_outputs_params_are_taken_at_their_defaults(server):
    """vLLM's StructuredOutputsParams as a client serializes one whole (`dataclasses.asdict`): its other options at
    their defaults change nothing and are taken, as vLLM takes them; set, they are refused by name."""
    whole = {"json": None, "regex": None, "choice": ["yes", "no"], "grammar": None, "json_object": None}
    whole |= {"disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None}
    whole |= {"structural_tag": None}
    body = {"model": MODEL, "prompt": "Yes or no?", "max_tokens": 8, "structured_outputs": whole}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("yes", "no"), response.text
    for name, value in (("whitespace_pattern", r"\s*"), ("disable_additional_properties", True)):
        bad = {"prompt": "Yes or no?", "structured_outputs": {**whole, name: value}}
        message = refused(server, "/v1/completions", bad, "structured_outputs")
        assert f"structured_outputs: unknown field {name!r}" in message


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_of_a_constrained_sample_are_over_the_tokens_its_grammar_allows(server, stream):
    """vLLM masks the logits with the grammar before its sampler takes the raw logprobs: each token's top entries are
    tokens the grammar allows (their probabilities sum to 1) and the rest are -inf (-9999.0 in JSON). A choice of
    "yes" or "no" allows fewer tokens than the 20 asked for (its prefixes, then EOS), so all of them are listed."""
    client = server.client()
    args = dict(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=2, n=2, logprobs=True, top_logprobs=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    entries: dict[int, list] = {0: [], 1: []}
    if stream:
        for chunk in client.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                entries[choice.index] += choice.logprobs.content if choice.logprobs else []
    else:
        for choice in client.chat.completions.create(**args).choices:
            assert choice.message.content in ("yes", "no")
            entries[choice.index] = choice.logprobs.content
    for tokens in entries.values():
        assert tokens
        for entry in tokens:
            allowed = [top for top in entry.top_logprobs if top.logprob > -9999.0]
            assert 0 < len(allowed) < 20 and all(top.logprob == -9999.0 for top in entry.top_logprobs[len(allowed) :])
            assert sum(math.exp(top.logprob) for top in allowed) == pytest.approx(1.0, abs=1e-4)
            assert entry.token in [top.token for top in allowed]


def refused(server, path: str, body: dict, param: str) -> str:
    response = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 4, **body}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        pytest.param({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs",
                     "structured_outputs.json: Type should", marks=needs_xgrammar),  # (the library's own message)
        pytest.param({"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
                     "structured_outputs.regex: Regex parsing", marks=needs_xgrammar),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "structured_outputs.choice must be a list"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "structured_outputs: unknown field 'jsn'"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one of"),
        pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
                     "response_format", "structured_outputs.json: Type should", marks=needs_xgrammar),
        ({"response_format": {"type": "json_schema"}}, "response_format", 'needs "json_schema"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
         "json_schema.name must be a non-empty string, got None"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "bogus": 1}}},
         "response_format", "unknown field 'bogus'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 2}}},
         "response_format", "json_schema.strict must be a boolean or null"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format's type must be"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "not both"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field_and_the_server_serves_on(server, body, param, named):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        assert named in refused(server, path, {**base, **body}, param)
    server.wait_until_idle()
    fine = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=TIMEOUT
    )
    assert fine.status_code == 200
