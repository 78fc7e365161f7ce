"""Tool calls through a real server on 127.0.0.1 (the built-in model), with the `openai` client and LangChain's
ChatOpenAI: tool_choice "required" and a named function return calls whose arguments validate against the tool's
parameters (whole, streamed, n > 1); "auto" reads Qwen3's <tool_call> blocks out of the model's text (forced with a
regex here: the tiny model never writes one unaided); a stream adds up to the whole response; vLLM's flags and 400s."""

from __future__ import annotations

import json
import re
import sys
from typing import Literal

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

from nanoref import LLM  # noqa: E402
from nanoref.serving.api_server import serve_in_background  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402
from nanoref.serving.tool_calls import AUTO_NEEDS_FLAGS  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import Server, needs_xgrammar, running_server  # noqa: E402

MODEL = "nanoref-tools"
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}  # (no parameters: called with {})
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"function": {"parameters": {"type": "object"}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# the text "auto" must find calls in: Qwen3's (hermes) blocks, forced on the model by a regex
FORCED = (
    r'Sure\. <tool_call>\n\{"name": "ping", "arguments": \{\}\}\n</tool_call>'
    r'\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM(LLM(device="cpu", seed=0, num_kvcache_blocks=256), owns_llm=True)
    with running_server(engine, MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def plain_server(server):
    """A second server on the same engine, started as vLLM is without its tool flags, and with
    --exclude-tools-when-tool-choice-none."""
    with serve_in_background(server.engine, MODEL, exclude_tools_when_tool_choice_none=True) as url:
        yield Server(url, server.engine)


def ask(server, stream: bool = False, **request):
    return server.client().chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **request)


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def check_calls(choice) -> list[tuple[str, dict]]:
    """Each call's arguments validate against its tool's parameters; every call has vLLM's id -> (name, args)."""
    checked = []
    for call in choice.message.tool_calls:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id) and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name]["function"]["parameters"])
        checked.append((call.function.name, arguments))
    return checked


def gather(chunks) -> dict[int, dict]:
    """A stream's chunks put together per choice: content, calls (each opened by its id, type and name before any
    arguments, as OpenAI's stream sends them), finish_reason. A chunk holds one tool call delta at most, as OpenAI's
    stream sends them: a client that reads each chunk's first (`delta.tool_calls[0]`) misses nothing."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            got = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            got["content"] += choice.delta.content or ""
            assert len(choice.delta.tool_calls or []) <= 1, choice.delta.tool_calls
            for item in choice.delta.tool_calls or []:
                if item.index not in got["calls"]:
                    assert item.id and item.type == "function" and item.function.name, item
                    got["calls"][item.index] = [item.function.name, ""]
                got["calls"][item.index][1] += item.function.arguments or ""
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
    return choices


def assert_stream_adds_up(server, whole, **request):
    streamed = gather(ask(server, stream=True, **request))
    assert sorted(streamed) == [choice.index for choice in whole.choices]
    for choice in whole.choices:
        got = streamed[choice.index]
        assert [tuple(got["calls"][i]) for i in sorted(got["calls"])] == calls_of(choice.message)
        assert got["content"] == (choice.message.content or "") and got["finish_reason"] == choice.finish_reason


# -- "required" and a named function: a grammar makes the call ------------------------------------------------------
@needs_xgrammar
def test_required_returns_one_or_more_calls_that_validate_whole_and_streamed(server):
    request = dict(tools=[PING, TIME], tool_choice="required", max_tokens=200, temperature=1.0, seed=0, n=3)
    whole = ask(server, **request)
    counts = []
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # (vLLM's)
        counts.append(len(check_calls(choice)))
    assert min(counts) >= 1 and max(counts) >= 2, counts  # (parallel calls: one array item each)
    assert_stream_adds_up(server, whole, **request)


@needs_xgrammar
def test_required_without_parallel_calls_makes_one_call_per_choice(server):
    # (86: what the 512-token context leaves beside the two tools' 426-token prompt; more is vLLM's 400)
    request = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=86)
    whole = ask(server, temperature=1.0, seed=0, n=3, **request)
    assert [choice.finish_reason for choice in whole.choices] == ["tool_calls"] * 3
    assert [len(check_calls(choice)) for choice in whole.choices] == [1, 1, 1]
    assert_stream_adds_up(server, whole, temperature=1.0, seed=0, n=3, **request)


@needs_xgrammar
def test_a_named_function_is_called_with_arguments_that_validate_and_finish_reason_stop(server):
    request = dict(tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=86, temperature=1.0, seed=1, n=2)  # (above)
    whole = ask(server, **request)
    for choice in whole.choices:
        assert choice.finish_reason == "stop" and choice.message.content == ""  # (OpenAI's and vLLM's "stop")
        assert [name for name, _ in check_calls(choice)] == ["get_weather"]
    assert_stream_adds_up(server, whole, **request)


@needs_xgrammar
def test_required_cut_short_keeps_its_whole_items_and_returns_the_rest_as_content(server):
    whole = ask(server, tools=[WEATHER], tool_choice="required", max_tokens=30, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content  # (the array's unread tail, not dropped)
    check_calls(choice)
    assert_stream_adds_up(server, whole, tools=[WEATHER], tool_choice="required", max_tokens=30, temperature=0)


@needs_xgrammar
def test_required_ended_by_a_stop_string_before_any_call_is_no_tool_calls_finish(server):
    """A stop string can end the array before its first item is whole: no call was made, so finish_reason is the
    engine's "stop" (with the text as content), never "tool_calls" with no tool_calls."""
    request = dict(tools=[PING], tool_choice="required", max_tokens=40, stop=["ping"], temperature=1.0, seed=1, n=2)
    whole = ask(server, **request)
    for choice in whole.choices:
        assert choice.message.tool_calls == [] and choice.message.content.startswith("[")
        assert choice.finish_reason == "stop" and choice.stop_reason == "ping"
    assert_stream_adds_up(server, whole, **request)


@needs_xgrammar
def test_a_call_sent_back_with_its_result_as_the_openai_client_dumps_it_is_the_next_turns_prompt(server):
    """The agent loop: the assistant's message as the client got it (`model_dump()`: null refusal, audio, ...) and a
    `tool` message answering its call, in the next request; both reach the prompt."""
    named = {"type": "function", "function": {"name": "get_time"}}
    first = ask(server, tools=[TIME], tool_choice=named, max_tokens=60, temperature=0).choices[0].message
    (call,) = first.tool_calls
    turn = [*MESSAGES, first.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    tokenized = post(server, {"messages": turn, "tools": [TIME]}, "/tokenize")
    assert tokenized.status_code == 200, tokenized.text
    prompt = server.engine.tokenizer.decode(tokenized.json()["tokens"])
    arguments = json.dumps(json.loads(call.function.arguments))  # (parsed, then the template's tojson)
    assert f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert prompt.endswith("<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    second = server.client().chat.completions.create(model=MODEL, messages=turn, tools=[TIME], tool_choice="none")
    assert second.choices[0].message.content and second.usage.prompt_tokens == tokenized.json()["count"]


# -- "auto": Qwen3's <tool_call> blocks read out of free text -------------------------------------------------------
@needs_xgrammar
def test_auto_reads_the_hermes_blocks_the_model_writes(server):
    # (the regex makes the model spell its text nearly a character per token: the two tools' prompt leaves room)
    request = dict(
        tools=[PING, TIME], max_tokens=200, temperature=0, extra_body={"structured_outputs": {"regex": FORCED}}
    )
    raw = ask(server, **{**request, "tool_choice": "none"}).choices[0]  # the same text, not read
    assert re.fullmatch(FORCED, raw.message.content) and not raw.message.tool_calls and raw.finish_reason == "stop"
    whole = ask(server, **request)  # (tool_choice: "auto", the default with tools)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert [name for name, _ in check_calls(choice)] == ["ping", "get_time"]
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", raw.message.content)
    assert [(c["name"], c["arguments"]) for c in map(json.loads, blocks)] == [
        (name, json.loads(arguments)) for name, arguments in calls_of(choice.message)
    ]
    assert_stream_adds_up(server, whole, **request)
    single = ask(server, **request, parallel_tool_calls=False).choices[0]
    assert calls_of(single.message) == calls_of(choice.message)[:1]  # (vLLM's filter: the first call)


@needs_xgrammar
def test_auto_keeps_a_block_that_is_no_call_as_content(server):
    malformed = r'<tool_call>\n\{"name": "get_weather", "arguments": "[a-z]{3}"\}\n</tool_call>'
    request = dict(
        tools=[WEATHER], max_tokens=60, temperature=0, extra_body={"structured_outputs": {"regex": malformed}}
    )
    whole = ask(server, **request)
    choice = whole.choices[0]
    assert re.fullmatch(malformed, choice.message.content) and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert_stream_adds_up(server, whole, **request)


def test_auto_on_the_tiny_model_answers_in_text_as_with_tool_choice_none(server):
    """What the built-in model does when it may choose: it writes Zen and docstrings, no <tool_call>, so "auto"
    returns its text as content and no calls (the same tokens as "none": the same prompt, the tools in both)."""
    auto = ask(server, tools=[WEATHER], max_tokens=24, temperature=0).choices[0]
    none = ask(server, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0).choices[0]
    assert auto.message.content == none.message.content and "<tool_call>" not in auto.message.content
    assert auto.message.tool_calls == [] and auto.finish_reason == none.finish_reason == "length"


# -- flags, the prompt, and bad requests ------------------------------------------------------------------------------
@needs_xgrammar
def test_auto_without_the_flags_is_vllms_400_and_the_grammar_modes_need_none(plain_server):
    for request in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        response = post(plain_server, {"messages": MESSAGES, "max_tokens": 4, **request})
        assert response.status_code == 400 and response.json()["error"]["message"] == AUTO_NEEDS_FLAGS
        assert response.json()["error"]["param"] == "tool_choice"
    named = ask(plain_server, tools=[WEATHER], tool_choice=NAMED, max_tokens=128, temperature=0)
    assert calls_of(named.choices[0].message)[0][0] == "get_weather"


def test_tools_reach_the_prompt_through_the_template_also_with_tool_choice_none(server, plain_server):
    def prompt_tokens(on, **request) -> int:
        return ask(on, max_tokens=1, **request).usage.prompt_tokens

    tokenized = post(server, {"messages": MESSAGES, "tools": [WEATHER]}, "/tokenize").json()
    assert prompt_tokens(server, tools=[WEATHER], tool_choice="none") == tokenized["count"]
    assert '"name": "get_weather"' in server.engine.tokenizer.decode(tokenized["tokens"])
    without = prompt_tokens(server)
    assert tokenized["count"] > without + 50
    assert prompt_tokens(plain_server, tools=[WEATHER], tool_choice="none") == without  # (--exclude-tools-...)


def post(server, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "needs a 'name'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wind"}}},
         "tool_choice", "does not match any of the specified `tools`"),
        ({"tools": [{"function": {"name": "f", "parameters": {"type": 5}}}], "tool_choice": "required"},
         "tools", "tools: the grammar library refuses the schema tool_choice 'required' makes"),
        ({"tools": [{"function": {"name": "f", "parameters": {"type": 5}}}],
          "tool_choice": {"function": {"name": "f"}}}, "tools", "refuses function 'f''s parameters schema"),
        ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "You can only either use constraints for structured outputs or tools, not both"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "maybe"}, "parallel_tool_calls",
         "must be true or false"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [{"role": "user", "content": "x"}],
          "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools' is an argument of its own"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field_and_queue_nothing(server, body, param, named):
    response = post(server, {"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"], error
    server.wait_until_idle()
    assert server.blocks_used() == 0
    assert post(server, {"messages": MESSAGES, "max_tokens": 2}).status_code == 200


# -- LangChain ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def langchain():
    langchain_openai = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")
    return langchain_openai, pydantic


def chat_model(server, langchain, **options):
    langchain_openai, _ = langchain
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0, **options
    )


def person_model(pydantic):
    class Person(pydantic.BaseModel):
        """A person."""

        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)

    return Person


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@needs_xgrammar
def test_langchain_with_structured_output_returns_a_valid_object(server, langchain, method):
    Person = person_model(langchain[1])
    model = chat_model(server, langchain, max_tokens=200, temperature=0)
    person = model.with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(person, Person) and len(person.name) <= 8 and 0 <= person.age <= 120


@needs_xgrammar
def test_langchain_json_mode_returns_an_object(server, langchain):
    """json_mode asks for a JSON object, not for the schema (which OpenAI's API leaves to the prompt, and the tiny model
    cannot read): a model that takes any object parses what the grammar makes."""
    pydantic = langchain[1]

    class Anything(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="allow")

    model = chat_model(server, langchain, max_tokens=120, temperature=0)
    parsed = model.with_structured_output(Anything, method="json_mode").invoke("Any JSON object.")
    assert isinstance(parsed, Anything) and isinstance(parsed.model_extra, dict)


@needs_xgrammar
def test_langchain_bind_tools_required_returns_valid_calls_streamed_alike(server, langchain):
    GetTime = pydantic_tool(langchain[1])
    model = chat_model(server, langchain, max_tokens=150, temperature=1.0, seed=3).bind_tools(
        [GetTime], tool_choice="required"
    )
    reply = model.invoke("What time is it?")
    assert reply.tool_calls and all(call["name"] == "GetTime" for call in reply.tool_calls)
    for call in reply.tool_calls:
        GetTime.model_validate(call["args"])
        assert call["id"].startswith("chatcmpl-tool-")
    chunks = list(model.stream("What time is it?"))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed = streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]


@needs_xgrammar
def test_langchain_bind_tools_auto_gets_the_tiny_models_text_or_the_calls_it_writes(server, langchain):
    GetTime = pydantic_tool(langchain[1])
    free = chat_model(server, langchain, max_tokens=16, temperature=0).bind_tools([GetTime]).invoke("Time?")
    assert free.tool_calls == [] and free.content  # (no tool_choice sent: "auto"; the tiny model writes text)
    forced = r'<tool_call>\n\{"name": "GetTime", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'
    extra = {"structured_outputs": {"regex": forced}}
    model = chat_model(server, langchain, max_tokens=120, temperature=0, extra_body=extra).bind_tools([GetTime])
    reply = model.invoke("Time?")
    assert [call["name"] for call in reply.tool_calls] == ["GetTime"] and reply.content == ""
    GetTime.model_validate(reply.tool_calls[0]["args"])
    assert reply.response_metadata["finish_reason"] == "tool_calls"


def pydantic_tool(pydantic):
    class GetTime(pydantic.BaseModel):
        """The time in a zone."""

        zone: Literal["utc", "cet"]

    return GetTime


# -- python -m nanoref.serve's flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], "invalid tool call parser: llama3_json"),
        (["--tool-call-parser", "mistral"], "invalid tool call parser: mistral (choose from { hermes }"),
    ],
)
def test_the_serve_command_refuses_bad_tool_flags_before_loading(argv, message, capsys):
    from nanoref.serve import main

    assert main(["/no/such/model", "--device", "cpu", "--port", "0", *argv]) == 2  # (the flags fail first)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


@pytest.mark.slow  # (a server process of its own: ~15 s here)
@needs_xgrammar
def test_the_serve_command_with_auto_tool_choice_reads_calls():
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "nanoref.serve", "--device", "cpu", "--port", "0", "--engine-process", "off"]
    command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        line = server.stdout.readline()  # "nanoref serves ... on http://127.0.0.1:PORT/v1 (Ctrl-C stops it)"
        assert " on http://" in line, line + server.stderr.read()
        url = line.split(" on ", 1)[1].split()[0]
        body = {"messages": MESSAGES, "tools": [PING], "max_tokens": 100, "temperature": 0}
        body["structured_outputs"] = {"regex": r'<tool_call>\n\{"name": "ping", "arguments": \{\}\}\n</tool_call>'}
        answer = httpx.post(f"{url}/chat/completions", json=body, timeout=TIMEOUT).json()
        assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
        assert answer["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}
        server.send_signal(signal.SIGINT)
        assert server.wait(TIMEOUT) == 0, server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_tool_calls_without_the_grammar_library_say_it_is_missing_not_that_it_refused_the_tools(monkeypatch, choice):
    # `pip install -e ".[serve]"` has no xgrammar: the 400 must say to install it, not blame the tools' schema (an
    # engine of its own: none of its grammars compiled before the library went missing)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (import xgrammar raises ImportError)
    with running_server(AsyncLLM(LLM(device="cpu"), owns_llm=True), MODEL) as server:
        with pytest.raises(openai.BadRequestError) as refused:
            ask(server, tools=[WEATHER], tool_choice=choice, max_tokens=8)
    message = refused.value.body["message"]
    assert "pip install 'nanoref[structured]'" in message and "refuses" not in message, message
    assert refused.value.body["param"] == "tools"
