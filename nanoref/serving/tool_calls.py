"""Tool calls in the chat API, as vLLM's server makes them: a request's `tools` and `tool_choice` checked, the grammar
that makes the model call a tool, and the model's text read back into OpenAI's `message.tool_calls`.

The tools reach the model through its chat template (`apply_chat_template(..., tools=...)`: Qwen3's and the built-in
model's write them into the system turn). Then, by `tool_choice` ("auto" when tools are given without one, as in
OpenAI's API and vLLM):

- "none": the model answers in text; nothing is read out of it. The tools are still rendered into the prompt, as vLLM
  does by default (`--exclude-tools-when-tool-choice-none` leaves them out).
- "required": the output must be a JSON array of one or more `{"name": ..., "parameters": {...}}` objects, each item
  any one tool's name with an instance of that tool's parameters schema (vLLM's schema, built by `required_schema`);
  each item is one call, its `arguments` the parameters as JSON text.
- a named function, `{"type": "function", "function": {"name": ...}}`: the output must be an instance of that tool's
  parameters schema, and is that one call's `arguments` as generated.
- "auto": the model writes freely; Qwen3's (hermes) blocks `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>` are read out of its text (`HermesReader`). As in vLLM, the server needs `--enable-auto-tool-choice
  --tool-call-parser hermes` for this; "required" and named functions need no flag (vLLM's documentation: "enabled by
  default"), since the grammar, not a parser, makes the call.

A function's `strict: true` is kept by "required" and a named function (their grammar always follows the schema) and
refused under "auto", whose text nothing constrains.

finish_reason (vLLM's, which is OpenAI's): "tool_calls" when "auto" read a call, and for "required" when the array was
completed ("stop") with a call in it (a stop string may end the text before any: then "stop"); a named function keeps
the engine's ("stop"), since OpenAI's API says "tool_calls" only when the model chose to call.

Each mode's reader takes the text piece by piece (`feed`, then `finish` at the end) and returns what each piece adds to
the message (`Delta`: content and OpenAI's tool call deltas). A stream's chunks come from the pieces, and a whole
response from the same reader fed the whole text at once: the two agree because a reader's result does not depend on
where its text is split (unit-tested on random splits).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from nanoref.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)  # --tool-call-parser's choices (vLLM has one per model family; Qwen3's is hermes)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a tool without parameters is called with {} (as vLLM)
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}  # OpenAI's FunctionDefinition
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
DATA_KEYWORDS = ("enum", "const", "default", "examples")  # a JSON schema's values that are data, not schemas
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'  # vLLM's
NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'  # vLLM's hint


class ToolRequestError(ValueError):
    """A request's tools or tool_choice the server refuses (a 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    """A tool call's id, as vLLM makes them: chatcmpl-tool-<32 hex digits>."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# -- the request: tools and tool_choice, checked ----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools and tool_choice, checked.

    mode: "none", "auto", "required" or "function" (a named function: `function` names it).
    tools: what the chat template gets, [{"type": "function", "function": {...}}, ...] (None: nothing to render).
    parallel: the request's parallel_tool_calls (False: at most one call per choice).
    """

    mode: str
    tools: list[dict] | None
    function: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes the model call a tool: "required"'s array, a named function's parameters; None for
        the modes that let it write freely."""
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools or [], self.parallel))
        if self.mode == "function":
            return StructuredOutputsParams(json=function_parameters(self.tools or [], self.function))
        return None

    def reader(self) -> ToolCallReader | None:
        """A fresh reader of one choice's text (None: "none", whose text is the answer)."""
        if self.mode == "required":
            return RequiredReader(self.parallel)
        if self.mode == "function":
            return NamedReader(self.function, self.parallel)
        if self.mode == "auto":
            return HermesReader(self.parallel)
        return None

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """The choice's finish_reason: vLLM's rule (see the module's docstring)."""
        if called and (self.mode == "auto" or (self.mode == "required" and engine_reason == "stop")):
            return "tool_calls"
        return engine_reason

    def content(self, text: str, called: bool) -> str | None:
        """The message's content from the text its reader gave out as content: with calls, "auto"'s is null when
        that is empty (vLLM's hermes parser); "required" and a named function's is "" (vLLM's)."""
        return (text or None) if self.mode == "auto" and called else text

    def refused(self, message: str) -> str:
        """The engine's refusal of the grammar's schema (the grammar library's words), as the tools' fault."""
        why = message.removeprefix("structured_outputs.json: ")
        if why.startswith("structured_outputs needs the xgrammar package"):  # (refused nothing: it is not installed)
            made = f"function {self.function!r:.60}'s call" if self.mode == "function" else "tool_choice 'required'"
            return f"tools: {made} is made with a grammar, and {why}"
        if self.mode == "function":
            return f"tools: the grammar library refuses function {self.function!r:.60}'s parameters schema: {why}"
        return f"tools: the grammar library refuses the schema tool_choice 'required' makes of the tools: {why}"


def check_tool_settings(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The server's tool settings, as vLLM checks them at start-up (its words); ValueError naming a bad one."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"invalid tool call parser: {tool_call_parser} (choose from {{ {', '.join(TOOL_CALL_PARSERS)} }}: "
            "the format of Qwen3's tool calls)"
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


def tool_choice(
    body: dict, auto_tool_choice: bool, exclude_tools_when_tool_choice_none: bool = False
) -> ToolChoice | None:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked as vLLM checks them (its messages
    where it has one) -> a ToolChoice, or None when the request has no tools (and no tool_choice but "none").
    auto_tool_choice: the server runs with --enable-auto-tool-choice. ToolRequestError naming the field at fault."""
    given, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError(
            f"parallel_tool_calls must be true or false, got {parallel!r:.40}", "parallel_tool_calls"
        )
    if body.get("tools") is None:
        if given is None or given == "none":
            return None
        raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    tools = check_tools(body["tools"])
    mode = "auto" if given is None else given  # (OpenAI's default with tools; null is no choice, as absent)
    function = None
    if isinstance(given, dict):
        mode, function = "function", named_function(given, tools)
    elif mode not in ("none", "auto", "required"):
        raise ToolRequestError(
            f'Invalid value for `tool_choice`: {given!r:.60}! Only named tools, "none", "auto" or "required" are '
            "supported.",
            "tool_choice",
        )
    if not tools:  # (no tools: "auto" and "required" have nothing to call; vLLM turns "required" into "none")
        return ToolChoice("none", None, parallel=parallel is not False)
    if mode == "auto" and not auto_tool_choice:
        raise ToolRequestError(AUTO_NEEDS_FLAGS, "tool_choice")
    strict = [tool["function"]["name"] for tool in tools if tool["function"].get("strict")]
    if mode == "auto" and strict:  # ("required" and named functions always follow the schema: strict or not)
        raise ToolRequestError(
            f"tools: function {strict[0]!r:.60} asks for strict: true, which tool_choice 'auto' cannot keep (the "
            "model writes freely): send tool_choice 'required' or the function's name, or strict: false",
            "tools",
        )
    rendered = None if mode == "none" and exclude_tools_when_tool_choice_none else tools
    return ToolChoice(mode, rendered, function, parallel is not False)


def check_tools(tools: object) -> list[dict]:
    """The request's tools as the chat template gets them; ToolRequestError naming the first bad one."""
    shape = "[{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}, ...]"
    if not isinstance(tools, list):
        raise ToolRequestError(f"tools must be a list of tools, {shape}, got {type(tools).__name__}", "tools")
    checked, names = [], set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ToolRequestError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        unknown = sorted(set(tool) - {"type", "function"}, key=str)
        if unknown:
            raise ToolRequestError(f"{where} has {unknown[0]!r:.40}, which a tool does not take", "tools")
        if tool.get("type", "function") != "function":
            raise ToolRequestError(f"{where}['type'] must be 'function', got {tool['type']!r:.40}", "tools")
        function = tool["function"]
        unknown = sorted(set(function) - FUNCTION_KEYS, key=str)
        if unknown:
            message = (
                f"{where}['function'] has {unknown[0]!r:.40}, which a function does not take ({sorted(FUNCTION_KEYS)})"
            )
            raise ToolRequestError(message, "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"{where}['function'] needs a 'name': a non-empty string, got {name!r:.40}", "tools")
        if name in names:  # (a named tool_choice and "required"'s name enum could not tell them apart)
            raise ToolRequestError(
                f"{where}: a second function named {name!r:.60}; each tool needs its own name", "tools"
            )
        names.add(name)
        for key, kind, expected in (("description", str, "a string"), ("parameters", dict, "a JSON schema object")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise ToolRequestError(
                    f"{where}['function']['{key}'] must be {expected}, got {function[key]!r:.60}", "tools"
                )
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ToolRequestError(f"{where}['function']['strict'] must be true or false", "tools")
        checked.append({"type": "function", "function": function})
    return checked


def named_function(given: dict, tools: list[dict]) -> str:
    """The function a named tool_choice names, which must be one of the tools (vLLM's checks and messages)."""
    function = given.get("function")
    if given.get("type", "function") != "function" or set(given) - {"type", "function"}:
        raise ToolRequestError(f"Invalid value for `tool_choice`: {given!r:.80}! {NAMED_USAGE}", "tool_choice")
    if not isinstance(function, dict):
        raise ToolRequestError(
            f"Invalid value for `function`: `{function!r:.60}` in `tool_choice`! {NAMED_USAGE}", "tool_choice"
        )
    if "name" not in function:
        raise ToolRequestError(f"Expected field `name` in `function` in `tool_choice`! {NAMED_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ToolRequestError(
            f"Invalid `name` in `function`: `{name!r:.60}` in `tool_choice`! {NAMED_USAGE}", "tool_choice"
        )
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ToolRequestError(
            f"The tool specified in `tool_choice` does not match any of the specified `tools` (no function named "
            f"{name!r:.60})",
            "tool_choice",
        )
    return name


# -- the grammar: "required" and a named function ---------------------------------------------------------------------
def function_parameters(tools: list[dict], name: str | None) -> dict:
    """A named function's parameters schema: what its call's arguments must be."""
    function = next(tool["function"] for tool in tools if tool["function"]["name"] == name)
    return function.get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's schema for tool_choice "required": an array of at least one item, each item any one tool's
    {"name": its name, "parameters": an instance of its parameters schema}. A schema's `$defs` (pydantic writes nested
    models there, referred to as "#/$defs/...") and draft 7's `definitions` move to the array's top level, where those
    references resolve; any other reference within a tool's schema ("#" itself, "#/properties/a") is rewritten to
    where that schema now sits in the array's (as it was, "#" would mean the array of calls).
    parallel False: at most one item (vLLM generates them all and keeps the first; here the grammar stops at one)."""
    items, moved = [], {"$defs": {}, "definitions": {}}  # (draft 7's name too: "#/definitions/...")
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = dict(function.get("parameters") or EMPTY_PARAMETERS)  # (a copy: the request's stays as sent)
        for keyword, definitions in moved.items():
            given = parameters.pop(keyword, None) or {}
            if not isinstance(given, dict):
                raise ToolRequestError(
                    f"tools[{index}]['function']['parameters']['{keyword}'] must be an object of named schemas, got "
                    f"{given!r:.60}",
                    "tools",
                )
            for name, schema in given.items():
                if definitions.setdefault(name, schema) != schema:
                    raise ToolRequestError(
                        f"tools: two functions' parameters define {keyword} {name!r:.60} differently; one schema "
                        "cannot hold both",
                        "tools",
                    )
        name_schema = {"type": "string", "enum": [function["name"]]}
        parameters = rooted_refs(parameters, f"#/items/anyOf/{index}/properties/parameters")
        items.append(
            {"properties": {"name": name_schema, "parameters": parameters}, "required": ["name", "parameters"]}
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({keyword: definitions for keyword, definitions in moved.items() if definitions})
    return schema


def rooted_refs(schema, root: str):
    """A copy of a JSON schema whose local references ("#", "#/...") point under `root` instead, except those to its
    `$defs` and `definitions` (required_schema moves those to the top). Values that are data, not schemas
    (enum, const, default, examples), are left as they are; so are the names of a properties map."""
    if isinstance(schema, list):
        return [rooted_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved = value.startswith(("#/$defs/", "#/definitions/"))
            copy[key] = value if moved else root + value[1:]
        elif key in SCHEMA_MAPS and isinstance(value, dict):  # (names -> schemas)
            copy[key] = {name: rooted_refs(child, root) for name, child in value.items()}
        elif key in DATA_KEYWORDS:
            copy[key] = value
        else:
            copy[key] = rooted_refs(value, root)
    return copy


# -- reading the text back ---------------------------------------------------------------------------------------------
@dataclass
class Delta:
    """What a piece of the model's text adds to the assistant's message: content text, and tool call deltas in
    OpenAI's stream format ({"index", "id", "type", "function": {"name", "arguments"}} to open a call, then
    {"index", "function": {"arguments": a piece}})."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.tool_calls + other.tool_calls)


def assemble(delta: Delta) -> list[dict]:
    """The deltas' tool calls as a whole message's: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    calls: dict[int, dict] = {}
    for item in delta.tool_calls:
        if "id" in item:
            calls[item["index"]] = {"id": item["id"], "type": "function", "function": dict(item["function"])}
        else:
            calls[item["index"]]["function"]["arguments"] += item["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]


class ToolCallReader:
    """Reads one choice's text, piece by piece, into a Delta per piece. Subclasses read a mode's format."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.num_calls = 0  # calls opened so far (kept or not)

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        """What the end of the text adds (text held back in case more was coming)."""
        return Delta()

    def open_call(self, delta: Delta, name: str, arguments: str = "") -> int:
        """A new call: its opening delta (the name first, as OpenAI's stream sends it), then its arguments, if any
        -> its index. parallel_tool_calls false keeps the first call only (vLLM's filter: index 0)."""
        index = self.num_calls
        self.num_calls += 1
        if self.parallel or index == 0:
            opening = {"name": name, "arguments": ""}
            delta.tool_calls.append({"index": index, "id": new_call_id(), "type": "function", "function": opening})
            self.add_arguments(delta, index, arguments)
        return index

    def add_arguments(self, delta: Delta, index: int, piece: str) -> None:
        if piece and (self.parallel or index == 0):
            delta.tool_calls.append({"index": index, "function": {"arguments": piece}})


class NamedReader(ToolCallReader):
    """A named function's call: the whole text is its arguments, streamed as it comes (vLLM's)."""

    def __init__(self, name: str | None, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.name = name or ""

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if not self.called:
            self.open_call(delta, self.name)
        self.add_arguments(delta, 0, text)
        return delta

    def finish(self) -> Delta:
        return self.feed("") if not self.called else Delta()


class RequiredReader(ToolCallReader):
    """tool_choice "required"'s array, read item by item: an item is one call once its closing brace arrives (a scan
    of JSON's strings and brackets finds it); its arguments are its parameters as JSON text, as vLLM writes them
    (`json.dumps(parameters, ensure_ascii=False)`). Text the scan could not read as items, an array cut short by
    max_tokens, is the message's content (nothing the model wrote is dropped)."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.text = ""
        self.read_to = 0  # the text before this is read: items made into calls, or the array's opening
        self.depth = 0
        self.in_string = self.escaped = self.closed = self.broken = False
        self.item_start: int | None = None

    def feed(self, text: str) -> Delta:
        delta, start = Delta(), len(self.text)
        self.text += text
        for position in range(start, len(self.text)):
            if self.broken or self.closed:
                break
            self.scan(self.text[position], position, delta)
        return delta

    def scan(self, char: str, position: int, delta: Delta) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "[{":
            self.depth += 1
            if self.depth == 2 and char == "{":
                self.item_start = position
        elif char in "]}":
            self.depth -= 1
            if self.depth == 1 and char == "}" and self.item_start is not None:
                self.read_item(self.text[self.item_start : position + 1], position + 1, delta)
            elif self.depth == 0:
                self.closed, self.read_to = True, position + 1

    def read_item(self, item_text: str, end: int, delta: Delta) -> None:
        try:
            item = json.loads(item_text)
            name, parameters = item["name"], item["parameters"]
        except (ValueError, KeyError, TypeError):  # (not the grammar's: its tokens were masked otherwise)
            self.broken = True
            return
        self.open_call(delta, str(name), json.dumps(parameters, ensure_ascii=False))
        self.item_start, self.read_to = None, end

    def finish(self) -> Delta:
        rest = self.text[self.read_to :]
        return Delta(content=rest) if rest.strip() else Delta()


class HermesReader(ToolCallReader):
    """Qwen3's (hermes) tool calls in free text, for tool_choice "auto": each `<tool_call>...</tool_call>` block (the
    last may end with the text, unclosed) holding JSON {"name": a string, "arguments": an object} is one call, its
    arguments re-written as vLLM writes them (`json.dumps(arguments, ensure_ascii=False)`).

    content: the text before the first `<tool_call>` (streamed as it comes, holding back what could begin the tag).
    Text between and after the calls is dropped, as vLLM drops it. A block whose JSON is not such an object is not a
    call: it, and all the text after the last good call, is content (vLLM's whole-text parser would drop the good
    calls before it too, and its streaming parser keeps them: here both agree, keeping them). `parse_hermes` is the
    same rule on a whole text, written plainly: the reference the tests hold this reader to."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.pending = ""  # text not yet given out: a possible tag's start, or the text after the last call
        self.phase = "content"  # "content" (no tag yet), "calls" (after the first tag), "text" (after a bad block)

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if self.phase == "text":
            delta.content = text
            return delta
        self.pending += text
        if self.phase == "content":
            start = self.pending.find(TOOL_CALL_START)
            if start < 0:
                keep = partial_tag(self.pending, TOOL_CALL_START)
                delta.content, self.pending = (
                    self.pending[: len(self.pending) - keep],
                    self.pending[len(self.pending) - keep :],
                )
                return delta
            delta.content, self.pending, self.phase = self.pending[:start], self.pending[start:], "calls"
        self.read_blocks(delta)
        return delta

    def read_blocks(self, delta: Delta) -> None:
        """Each closed block in `pending` (which starts after the last good call): a call, or the end of calls."""
        while self.phase == "calls":
            start = self.pending.find(TOOL_CALL_START)
            end = self.pending.find(TOOL_CALL_END, start + len(TOOL_CALL_START)) if start >= 0 else -1
            if end < 0:
                return  # (wait for the block to close, or for the end of the text)
            if not self.read_block(self.pending[start + len(TOOL_CALL_START) : end], delta):
                return
            self.pending = self.pending[end + len(TOOL_CALL_END) :]

    def read_block(self, body: str, delta: Delta) -> bool:
        """One block's JSON -> a call (True), or, when it is no call, the rest of the text as content (False)."""
        call = hermes_call(body)
        if call is None:
            delta.content += self.pending
            self.pending, self.phase = "", "text"
            return False
        self.open_call(delta, *call)
        return True

    def finish(self) -> Delta:
        delta = Delta()
        if self.phase == "content":
            delta.content, self.pending = self.pending, ""
        elif self.phase == "calls":
            start = self.pending.find(TOOL_CALL_START)
            if start >= 0 and self.read_block(self.pending[start + len(TOOL_CALL_START) :], delta):  # (unclosed)
                self.pending = ""
        return delta


def hermes_call(body: str) -> tuple[str, str] | None:
    """A block's text -> (name, arguments as JSON text), or None when it is not {"name": str, "arguments": object}."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if (
        not isinstance(call, dict)
        or not isinstance(call.get("name"), str)
        or not isinstance(call.get("arguments"), dict)
    ):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """HermesReader's rule on a whole text -> (content, or None when the calls leave none; [(name, arguments)])."""
    first = text.find(TOOL_CALL_START)
    if first < 0:
        return text, []
    content, calls, after_last_call = text[:first], [], first
    while True:
        start = text.find(TOOL_CALL_START, after_last_call)
        if start < 0:
            break
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        call = hermes_call(text[start + len(TOOL_CALL_START) : end if end >= 0 else len(text)])
        if call is None:
            content += text[after_last_call:]
            break
        calls.append(call)
        if end < 0:
            break
        after_last_call = end + len(TOOL_CALL_END)
    return (content or None) if calls else content, calls
