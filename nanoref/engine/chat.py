"""Chat messages as one prompt: the model folder's chat template, rendered by its tokenizer.

A chat model was trained on conversations written in one exact format (Qwen3's ChatML: `<|im_start|>user\\n...
<|im_end|>\\n`). The format is data, not code: the folder's tokenizer_config.json (`chat_template`) or
chat_template.jinja holds it as a Jinja template, and `add_generation_prompt=True` ends the text with the opening
of the assistant's turn, so the model's completion is the assistant's reply.

Messages arrive as OpenAI's clients send them, and reach the template as vLLM passes them on:
- `content` is a string, or a list of parts: the text parts (`{"type": "text", "text": ...}`) are joined with
  newlines into one string (vLLM's "string" content format: Qwen3's template reads a string, not a list). A part
  the model cannot take (an image, audio) is an error that names it: this is a text-only engine.
- `name` is passed on (a template may use it; Qwen3's does not).
- an assistant message sent back as a client got it (`message.model_dump()`) may hold OpenAI's `refusal`, `audio`,
  `function_call` and `annotations`: null (or no annotations) is taken, as by vLLM; any other value is an error.
- an assistant message's `reasoning` (vLLM's name for what a reasoning model thought; `reasoning_content`, the name
  before it, is taken too) reaches the template as both names, as vLLM passes it (Qwen3's template writes it into
  the `<think>` block of the turns after the last user message, and leaves it out before).
- an assistant message may carry `tool_calls` (its `content` then may be null), each call's JSON `arguments`
  parsed into a dict (as vLLM does: Qwen3's template writes them with `tojson`; null, "" or "null" as {}); a `tool`
  message answers one, with its `tool_call_id`. A template that never mentions `tool_calls` would drop them without
  a word: that is an error.
- `tools` (OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}]) reach the template as
  apply_chat_template's `tools`, as vLLM passes them (Qwen3's template lists them in its system turn); a template that
  never mentions `tools` would leave them out of the prompt: an error too.
- `continue_final_message=True` leaves the last message open, so the model continues it (a prefilled answer);
  it cannot be combined with `add_generation_prompt=True` (vLLM's rule, and transformers').
- `chat_template_kwargs` are the template's own variables (Qwen3's `enable_thinking`); one the template never
  reads would change nothing, so it is an error that names it.
- `chat_template` (vLLM's) is a template of the caller's in place of the folder's (a base model has none); its
  callers check it once (`check_chat_template`: a template that does not parse is an error naming its line), before
  any message is rendered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
KEYS = {
    "system": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "reasoning", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id"},
}
# OpenAI's fields of an assistant message that a client sends back with it (`message.model_dump()` of a response):
# taken when they hold nothing (null, or no annotations), as vLLM takes them; a refusal or audio would not be rendered
EMPTY_ASSISTANT_FIELDS = {"refusal", "audio", "function_call", "annotations"}
# apply_chat_template's own arguments, which chat_template_kwargs must not set
RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "tools"}
RESERVED |= {"documents", "chat_template", "return_dict", "return_tensors", "padding", "truncation", "max_length"}


def chat_prompt(
    tokenizer: Any | None,
    messages: object,
    folder: str | Path,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
) -> str:
    """messages ([{"role": ..., "content": ...}, ...]) as the prompt text the model's template makes of them (and the
    tools the model may call, when given); chat_template: a template's text in place of the folder's, checked by the
    caller (`check_chat_template`, once, not per conversation). ValueError/TypeError naming the first bad message or
    argument."""
    conversation = check_messages(messages)
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r:.40}")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "cannot set both continue_final_message and add_generation_prompt to True (continuing the last message "
            "needs add_generation_prompt=False)"
        )
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError(
            f"continue_final_message continues the last message, which must be the assistant's; got a "
            f"{conversation[-1]['role']!r} message"
        )
    if tokenizer is None:
        raise ValueError(f"{folder} has no tokenizer: chat needs one, with a chat template")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            f"{folder}'s tokenizer has no chat template: add a `chat_template` to its tokenizer_config.json, or a "
            "chat_template.jinja file (or send plain prompts to completions instead)"
        )
    source = template if isinstance(template, str) else "\n".join(template.values())  # (named templates: a dict)
    whose = f"{folder}'s chat template" if chat_template is None else "the chat_template given"  # (the one rendering)
    for index, message in enumerate(conversation):
        if "tool_calls" in message and "tool_calls" not in source:
            raise ValueError(
                f"messages[{index}] has tool_calls, but {whose} never renders tool_calls (they would be left out of "
                "the prompt): use a template that does, such as Qwen3's"
            )
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise TypeError(f"tools must be a list of tool dicts, got {tools!r:.80}")
        if "tools" not in source:
            raise ValueError(
                f"tools are given, but {whose} never renders tools (the model would not see them): use a template "
                "that does, such as Qwen3's"
            )
    kwargs = check_template_kwargs(chat_template_kwargs, source, chat_template is not None)
    return tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **({"tools": tools} if tools is not None else {}),
        **({"chat_template": chat_template} if chat_template is not None else {}),
        **kwargs,
    )


def check_content_format(content_format: object) -> None:
    """vLLM's chat_template_content_format: "auto" and "string" are what nanoref does (text parts joined into one
    string); "openai" (the parts as a list) is refused, naming why."""
    if content_format == "openai":
        raise ValueError(
            "chat_template_content_format='openai' (content as a list of parts) is not available: nanoref passes a "
            "message's text parts to the template as one string, which Qwen3's template reads; use 'auto' or 'string'"
        )
    if content_format not in ("auto", "string"):
        raise ValueError(f"chat_template_content_format must be 'auto' or 'string', got {content_format!r}")


def check_chat_template(template: object) -> str:
    """A chat template's text, checked: a non-empty string that parses as Jinja (as transformers renders it: with
    loop controls); TypeError or ValueError naming the problem and its line."""
    import jinja2

    if not isinstance(template, str):
        raise TypeError(f"chat_template must be a Jinja template's text, got {type(template).__name__}")
    if not template.strip():
        raise ValueError("chat_template is empty")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"chat_template does not parse as a Jinja template: line {error.lineno}: {error.message}"
        ) from None
    return template


def check_template_kwargs(chat_template_kwargs: object, source: str, given: bool = False) -> dict:
    """chat_template_kwargs as a dict of the template's own variables; ValueError naming one it never reads.
    given: the template is the caller's chat_template, not the model's."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise TypeError(
            f"chat_template_kwargs must be a dict of the template's variables, got {chat_template_kwargs!r:.80}"
        )
    reserved = sorted(set(chat_template_kwargs) & RESERVED)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is an argument of its own, not a template variable")
    used = template_variables(source)
    unused = sorted(set(chat_template_kwargs) - used) if used is not None else []
    if unused:
        whose = "the chat_template given" if given else "this model's chat template"
        raise ValueError(
            f"chat_template_kwargs: {unused[0]!r} is not a variable of {whose}, so it would change nothing "
            f"(the template reads: {sorted(used - {'messages', 'add_generation_prompt'})})"
        )
    return dict(chat_template_kwargs)


def template_variables(source: str) -> set[str] | None:
    """The variables a Jinja template reads from its context; None when it does not parse here."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return None
    return meta.find_undeclared_variables(parsed)


def check_messages(messages: object) -> list[dict]:
    """The messages as the template gets them (text parts joined, tool calls' arguments parsed); ValueError or
    TypeError naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    conversation = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or "role" not in message:
            raise TypeError(f"{where} must be a dict with a 'role' and a 'content', got {message!r:.80}")
        role = message["role"]
        if role not in ROLES:
            # (OpenAI's "developer" is its newer models' "system"; Qwen3's template renders no such role, and would
            # drop the message without a word, as vLLM's server then does)
            hint = ": send it as 'system'" if role == "developer" else ""
            raise ValueError(f"{where}['role'] must be one of {ROLES}, got {role!r:.40}{hint}")
        if role == "assistant":
            message = {k: v for k, v in message.items() if k not in EMPTY_ASSISTANT_FIELDS or v not in (None, [])}
        unknown = sorted(set(message) - KEYS[role], key=str)
        if unknown:
            article = "an" if role[0] in "aeiou" else "a"
            raise TypeError(
                f"{where} has {unknown[0]!r:.40}, which {article} {role} message does not take ({sorted(KEYS[role])})"
            )
        rendered = {"role": role, "content": message_text(message.get("content"), where, role, message)}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise TypeError(f"{where}['name'] must be a string, got {type(message['name']).__name__}")
            rendered["name"] = message["name"]
        if message.get("tool_calls") is not None:
            rendered["tool_calls"] = tool_calls(message["tool_calls"], where)
        said = "reasoning" if message.get("reasoning") is not None else "reasoning_content"
        if message.get(said) is not None:  # (vLLM's name, and the one before it, which Qwen3's template reads: both)
            if not isinstance(message[said], str):
                raise TypeError(f"{where}[{said!r}] must be a string, got {type(message[said]).__name__}")
            rendered["reasoning"] = rendered["reasoning_content"] = message[said]
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise TypeError(f"{where}['tool_call_id'] must be the string id of the tool call it answers")
            rendered["tool_call_id"] = message["tool_call_id"]
        conversation.append(rendered)
    return conversation


def message_text(content: object, where: str, role: str, message: dict) -> str:
    """A message's content as one string: a string, or a list of text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and message.get("tool_calls"):
        return ""  # (an assistant's turn that only calls tools)
    if not isinstance(content, list):
        raise TypeError(f"{where}['content'] must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise ValueError(
                    f"{where}['content'][{number}] is a {kind!r:.40} part: this model takes text only ('text' parts)"
                )
            raise TypeError(
                f"{where}['content'][{number}] must be a part {{'type': 'text', 'text': ...}}, got {part!r:.80}"
            )
        if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise TypeError(f"{where}['content'][{number}] must be exactly {{'type': 'text', 'text': a string}}")
        texts.append(part["text"])
    return "\n".join(texts)


def tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant's tool calls ([{"id", "type": "function", "function": {"name", "arguments"}}]), each one's
    JSON arguments as a dict."""
    if not isinstance(calls, list):
        raise TypeError(f"{where}['tool_calls'] must be a list of tool calls, got {type(calls).__name__}")
    parsed = []
    for number, call in enumerate(calls):
        at = f"{where}['tool_calls'][{number}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TypeError(f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}['type'] must be 'function', got {call.get('type')!r:.40}")
        arguments = function.get("arguments")
        arguments = {} if arguments is None or arguments == "" else arguments  # (no arguments: {} as vLLM takes them)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as error:
                raise ValueError(f"{at}['function']['arguments'] is not valid JSON: {error}") from None
            arguments = {} if arguments is None else arguments  # ("null", as vLLM)
        if not isinstance(arguments, dict):
            raise TypeError(f"{at}['function']['arguments'] must be a JSON object, got {arguments!r:.80}")
        parsed.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return parsed
