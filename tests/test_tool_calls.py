"""Tool calls' pieces without a server (nanoref/serving/tool_calls.py): the hermes reader against its whole-text
reference on hand-written texts and on random splits of them (every split inside the tags included), the "required"
array and named-function readers, the JSON schema "required" constrains to, the request checks with vLLM's messages,
and the built-in model's chat template rendering tools and tool calls as Qwen3's does."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from nanoref import DEFAULT_MODEL
from nanoref.engine.chat import chat_prompt
from nanoref.serving.tool_calls import (
    AUTO_NEEDS_FLAGS,
    Delta,
    HermesReader,
    NamedReader,
    RequiredReader,
    ToolChoice,
    ToolRequestError,
    assemble,
    check_tool_settings,
    parse_hermes,
    required_schema,
    tool_choice,
)
from nanoref.utils.loader import load_tokenizer

jsonschema = pytest.importorskip("jsonschema")

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PARIS, ROME = call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome", "note": 'a {b} [c] "d"'})
PARIS_CALL = ("get_weather", '{"city": "Paris"}')
ROME_CALL = ("get_weather", '{"city": "Rome", "note": "a {b} [c] \\"d\\""}')
BAD = "<tool_call>\n{not json}\n</tool_call>"
# (text, content, calls): the reference's answers, written by hand
HERMES_CASES = [
    ("Just text.", "Just text.", []),
    (PARIS, None, [PARIS_CALL]),
    (f"Let me look. {PARIS}", "Let me look. ", [PARIS_CALL]),
    (f"{PARIS}\n{ROME}", None, [PARIS_CALL, ROME_CALL]),
    (f"A {PARIS} between {ROME} after", "A ", [PARIS_CALL, ROME_CALL]),  # (text between and after: dropped)
    (f"{BAD} tail", f"{BAD} tail", []),  # (malformed JSON: kept as content)
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),  # (no arguments)
    (NOT_AN_OBJECT := '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', NOT_AN_OBJECT, []),
    (f"Hi {PARIS} and {BAD} {ROME}", f"Hi  and {BAD} {ROME}", [PARIS_CALL]),  # (a good call, then a bad block)
    ('Unclosed <tool_call>\n{"name": "f", "arguments": {"é": 1}}', "Unclosed ", [("f", '{"é": 1}')]),
    ('Cut <tool_call>\n{"name": "f", "argu', 'Cut <tool_call>\n{"name": "f", "argu', []),
    ("Almost a tag: <tool_ca and <tool", "Almost a tag: <tool_ca and <tool", []),
    (f"{PARIS}</tool_call> trailing", None, [PARIS_CALL]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_parse_hermes_on_hand_written_texts(text, content, calls):
    assert parse_hermes(text) == (content, calls)


def read(reader, pieces: list[str]) -> Delta:
    delta = Delta()
    for piece in pieces:
        delta = delta + reader.feed(piece)
    return delta + reader.finish()


def calls_of(delta: Delta) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in assemble(delta)]


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("seed", range(8))
def test_hermes_reader_on_random_splits_equals_the_whole_text_reference(seed):
    rng = random.Random(seed)
    for text, _, _ in HERMES_CASES:
        expected_content, expected_calls = parse_hermes(text)
        for pieces in (random_split(text, rng), list(text)):  # (one character at a time: every split in a tag)
            reader = HermesReader()
            delta = read(reader, pieces)
            assert calls_of(delta) == expected_calls, (text, pieces)
            assert ((delta.content or None) if expected_calls else delta.content) == expected_content, (text, pieces)
            assert reader.called == bool(expected_calls)


def test_hermes_reader_streams_content_before_the_tag_and_opens_each_call_with_its_name():
    reader = HermesReader()
    assert reader.feed("Let me <tool").content == "Let me "  # (what could begin the tag waits)
    assert reader.feed("_c").content == ""
    opened = reader.feed('all>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert opened.content == "" and [item["index"] for item in opened.tool_calls] == [0, 0]
    first, arguments = opened.tool_calls
    assert first["id"].startswith("chatcmpl-tool-") and len(first["id"]) == len("chatcmpl-tool-") + 32
    assert first["type"] == "function" and first["function"] == {"name": "f", "arguments": ""}
    assert arguments == {"index": 0, "function": {"arguments": '{"x": 1}'}}
    assert reader.feed(" then text").content == "" and not reader.finish()  # (after the calls: dropped, as vLLM)


def test_hermes_reader_without_parallel_calls_keeps_the_first():
    delta = read(HermesReader(parallel=False), [f"{PARIS}\n{ROME}"])
    assert calls_of(delta) == [("get_weather", '{"city": "Paris"}')]


ARRAY = (
    '[\n  {"name": "get_weather", "parameters": {"city": "Pa}ris\\"]", "tags": [1, {"a": []}]}},\n'
    '  {"name":"get_time","parameters":{}}\n]'
)


@pytest.mark.parametrize("seed", range(6))
def test_required_reader_on_random_splits_gives_one_call_per_array_item(seed):
    items = json.loads(ARRAY)
    expected = [(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    for pieces in (random_split(ARRAY, random.Random(seed)), list(ARRAY)):
        reader = RequiredReader()
        delta = read(reader, pieces)
        assert calls_of(delta) == expected and delta.content == "" and reader.called


def test_required_reader_gives_an_array_cut_short_as_content_and_parallel_false_one_call():
    cut = ARRAY[: ARRAY.index('{"name":"get_time"') + 12]
    delta = read(RequiredReader(), [cut])
    assert calls_of(delta) == [("get_weather", '{"city": "Pa}ris\\"]", "tags": [1, {"a": []}]}')]
    assert delta.content == cut[cut.index("},\n") + 1 :]  # (the text after the last whole item)
    assert read(RequiredReader(), ['[{"name": "f", "par']).content == '[{"name": "f", "par'
    assert len(calls_of(read(RequiredReader(parallel=False), [ARRAY]))) == 1


def test_named_reader_streams_the_text_as_the_arguments_name_first():
    reader = NamedReader("get_weather")
    first = reader.feed('{"ci')
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" in first.tool_calls[0]
    delta = first + reader.feed("") + reader.feed('ty": "Oslo"}') + reader.finish()
    assert calls_of(delta) == [("get_weather", '{"city": "Oslo"}')] and delta.content == ""
    assert calls_of(read(NamedReader("f"), [])) == [("f", "")]  # (an empty text still makes the call)


def test_required_schema_is_vllms_array_of_name_and_parameters():
    schema = required_schema([WEATHER, TIME])
    valid = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(valid, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "get_wind", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in schema and required_schema([WEATHER], parallel=False)["maxItems"] == 1
    assert WEATHER["function"]["parameters"] == {  # (the request's own schema is left as sent)
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }


def test_required_schema_moves_defs_to_the_top_where_refs_resolve():
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str

    class Trip(pydantic.BaseModel):
        to: City

    trip = {"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}}
    schema = required_schema([trip])
    assert "$defs" in schema and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "plan", "parameters": {"to": {"name": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "plan", "parameters": {"to": {"name": 5}}}], schema)
    other = {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"City": {"type": "integer"}}}}}
    with pytest.raises(ToolRequestError, match=r"\$defs 'City' differently"):
        required_schema([trip, other])


def test_required_schema_moves_draft_7_definitions_to_the_top_where_refs_resolve():
    parameters = {
        "type": "object",
        "properties": {"to": {"$ref": "#/definitions/City"}},
        "required": ["to"],
        "definitions": {"City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    }
    trip = {"type": "function", "function": {"name": "plan", "parameters": parameters}}
    schema = required_schema([trip])
    assert "definitions" in schema and "definitions" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "plan", "parameters": {"to": {"name": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "plan", "parameters": {"to": {"name": 5}}}], schema)
    assert trip["function"]["parameters"] == parameters and "definitions" in parameters  # (the request's, as sent)


@pytest.mark.parametrize("keyword", ["$defs", "definitions"])
def test_required_schema_refuses_definitions_that_are_no_object_naming_them(keyword):
    """(they were read with .items(): an AttributeError, the server's 500)"""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", keyword: ["City"]}}}
    where = re.escape(f"tools[1]['function']['parameters']['{keyword}'] must be an object of named schemas")
    with pytest.raises(ToolRequestError, match=where):
        required_schema([WEATHER, tool])


def test_tool_choice_defaults_and_modes_as_vllm():
    assert tool_choice({}, auto_tool_choice=False) is None
    assert tool_choice({"tool_choice": "none"}, auto_tool_choice=False) is None  # (no tools: nothing to do)
    auto = tool_choice({"tools": [WEATHER]}, auto_tool_choice=True)
    assert auto.mode == "auto" and auto.tools == [WEATHER] and auto.parallel
    assert tool_choice({"tools": [WEATHER], "tool_choice": None}, auto_tool_choice=True).mode == "auto"
    none = tool_choice({"tools": [WEATHER], "tool_choice": "none"}, auto_tool_choice=False)
    assert none.mode == "none" and none.tools == [WEATHER] and none.reader() is None  # (rendered, not parsed)
    assert tool_choice({"tools": [WEATHER], "tool_choice": "none"}, False, True).tools is None  # (excluded)
    named = tool_choice(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, False
    )
    assert (named.mode, named.function) == ("function", "get_time")
    assert named.constraint().json == {"type": "object", "properties": {}}  # (no parameters: called with {})
    required = tool_choice({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, False)
    assert required.constraint().json == required_schema([WEATHER], parallel=False) and not required.parallel
    assert tool_choice({"tools": [], "tool_choice": "required"}, False).mode == "none"  # (vLLM's: as "none")
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    assert tool_choice({"tools": [strict], "tool_choice": "required"}, False).mode == "required"  # (kept)


def test_finish_reasons_and_content_follow_vllm():
    auto, required, named = ToolChoice("auto", []), ToolChoice("required", []), ToolChoice("function", [], "f")
    assert auto.finish_reason("stop", called=True) == "tool_calls" == auto.finish_reason("length", called=True)
    assert auto.finish_reason("stop", called=False) == "stop"
    assert required.finish_reason("stop", called=True) == "tool_calls"
    assert required.finish_reason("length", called=True) == "length"
    assert required.finish_reason("stop", called=False) == "stop"  # (a stop string ended it before any call)
    assert named.finish_reason("stop", called=True) == "stop"  # (OpenAI's: the caller chose the call)
    assert auto.content("", called=True) is None and auto.content("", called=False) == ""
    assert required.content("", called=True) == "" == named.content("", called=True)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "Invalid value for `tool_choice`: 'always'!"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wind"}}},
         "tool_choice", "does not match any of the specified `tools`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "Invalid value for `function`"),
        ({"tools": [WEATHER], "tool_choice": {"function": {}}}, "tool_choice", "Expected field `name`"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": ""}}}, "tool_choice", "Invalid `name`"),
        ({"tools": [WEATHER]}, "tool_choice", AUTO_NEEDS_FLAGS),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", AUTO_NEEDS_FLAGS),
        ({"tools": {"name": "f"}}, "tools", "tools must be a list"),
        ({"tools": [{"function": {"parameters": {}}}]}, "tools", "tools[0]['function'] needs a 'name'"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "needs a 'name'"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "tools[0]['type'] must be 'function'"),
        ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools", "['parameters'] must be a JSON schema"),
        ({"tools": [{"function": {"name": "f", "params": {}}}]}, "tools", "has 'params', which a function does not"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "tools[1]: a second function named 'get_weather'"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be true or false"),
        ({"tools": [{"function": {"name": "f", "strict": True}}], "tool_choice": "auto"}, "tools", "strict: true"),
    ],
)  # fmt: skip
def test_bad_tools_and_tool_choices_name_their_field(body, param, message):
    with pytest.raises(ToolRequestError) as refused:
        tool_choice(body, auto_tool_choice="strict" in message)  # (strict: past the flags' check)
    assert refused.value.param == param and message in str(refused.value)


def test_the_servers_tool_settings_are_checked_as_vllm_checks_them():
    check_tool_settings(True, "hermes")
    check_tool_settings(False, None)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        check_tool_settings(True, None)
    with pytest.raises(ValueError, match=r"invalid tool call parser: llama3_json \(choose from \{ hermes \}"):
        check_tool_settings(True, "llama3_json")


def test_the_built_in_template_renders_tools_and_calls_as_qwen3s_does():
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]  # fmt: skip
    ours = chat_prompt(tokenizer, turns, DEFAULT_MODEL, tools=[WEATHER, TIME])
    tokenizer.chat_template = QWEN3_TEMPLATE
    qwen3 = chat_prompt(tokenizer, turns, DEFAULT_MODEL, tools=[WEATHER, TIME])
    tools_block = "<tools>\n" + "\n".join(json.dumps(tool) for tool in (WEATHER, TIME)) + "\n</tools>"
    assert tools_block in ours and tools_block in qwen3 and ours.startswith("<|im_start|>system\nBe brief.\n\n")
    # after the system turn, the same text but for Qwen3's empty thinking block
    assert ours[ours.index("<|im_start|>user") :] == qwen3[qwen3.index("<|im_start|>user") :].replace(
        "<think>\n\n</think>\n\n", ""
    )
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>' in ours
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nnoon\n" in ours


def test_tools_a_template_never_renders_are_refused_not_dropped():
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    tokenizer.chat_template = PLAIN_CHATML
    with pytest.raises(ValueError, match="tools are given, but .* never renders tools"):
        chat_prompt(tokenizer, [{"role": "user", "content": "hi"}], DEFAULT_MODEL, tools=[WEATHER])
    with pytest.raises(TypeError, match="tools must be a list of tool dicts"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), [{"role": "user", "content": "hi"}], DEFAULT_MODEL, tools=WEATHER)


def test_required_schema_roots_a_tools_other_references_where_its_schema_now_sits():
    """A tool's "#" (a recursive schema) and "#/properties/..." references meant its own parameters; inside the
    array of calls "#" was the array itself (a child had to be an array of calls) and "#/properties/a" was nowhere
    (the grammar library refused it). Data that looks like a reference (a const) and a property named "$ref" stay."""
    tree = {
        "type": "object",
        "properties": {
            "kids": {"type": "array", "items": {"$ref": "#"}},
            "size": {"type": "integer"},
            "same": {"$ref": "#/properties/size"},
            "$ref": {"const": {"$ref": "#"}},
        },
        "required": ["kids"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "tree", "parameters": tree}}
    schema = required_schema([WEATHER, tool])
    call = {"name": "tree", "parameters": {"kids": [{"kids": [], "size": 2}], "same": 3, "$ref": {"$ref": "#"}}}
    jsonschema.validate([call], schema)
    for bad in ({"kids": [[{"name": "tree", "parameters": {"kids": []}}]]}, {"kids": [], "same": "x"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "tree", "parameters": bad}], schema)
    assert tool["function"]["parameters"] == tree and tree["properties"]["kids"]["items"] == {"$ref": "#"}
