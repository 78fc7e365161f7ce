"""Chat messages through the model folder's chat template: LLM.chat and chat_prompt's errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nanoref import DEFAULT_MODEL, LLM, SamplingParams
from nanoref.engine.chat import chat_prompt
from nanoref.utils.loader import load_tokenizer

# Qwen3's chat template (tools, assistant tool calls, tool responses, the enable_thinking switch)
QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()

# a ChatML template that knows no tools (the built-in model's before it rendered them)
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_the_built_in_model_renders_chatml():
    text = chat_prompt(load_tokenizer(DEFAULT_MODEL), MESSAGES, DEFAULT_MODEL)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_llm_chat_is_generate_on_the_templated_prompt():
    llm = LLM(device="cpu", num_kvcache_blocks=32)
    prompt = chat_prompt(llm.tokenizer, MESSAGES, DEFAULT_MODEL)
    expected = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.chat(MESSAGES, GREEDY, use_tqdm=False) == expected
    assert llm.chat([MESSAGES, MESSAGES[1:]], GREEDY, use_tqdm=False)[0] == expected[0]
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\]\['role'\]"):
        llm.chat([MESSAGES, [{"role": "robot", "content": "x"}]], GREEDY, use_tqdm=False)
    assert llm.is_finished()


def test_a_folder_without_a_template_or_tokenizer_names_what_is_missing(tmp_path, tiny_model):
    folder = tmp_path / "no_template"
    shutil.copytree(DEFAULT_MODEL, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tokenizer_config.json, or a chat_template.jinja"):
        chat_prompt(load_tokenizer(folder), MESSAGES, folder)
    with pytest.raises(ValueError, match="has no tokenizer"):
        chat_prompt(load_tokenizer(tiny_model), MESSAGES, tiny_model)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], TypeError),
        ("hi", TypeError),
        ([{"role": "user"}], TypeError),
        ([{"role": "user", "content": 3}], TypeError),
        ([{"role": "user", "content": "x", "name": 3}], TypeError),
        ([{"role": "user", "content": "x", "tool_call_id": "c"}], TypeError),
        ([{"role": "tool", "content": "x"}], TypeError),  # (no tool_call_id)
        ([{"role": "developer", "content": "x"}], ValueError),
        ([{"role": "user", "content": [{"type": "text"}]}], TypeError),
        ([{"role": "user", "content": None}], TypeError),
    ],
)
def test_bad_messages_are_refused_with_the_message_named(messages, error):
    with pytest.raises(error, match="messages"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), messages, DEFAULT_MODEL)


def tokenizer_with(template: str):
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    tokenizer.chat_template = template
    return tokenizer


def test_text_parts_are_joined_with_newlines_as_vllm_does():
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    as_parts = chat_prompt(tokenizer, [{"role": "system", "content": parts}, MESSAGES[1]], DEFAULT_MODEL)
    assert as_parts == chat_prompt(tokenizer, [{"role": "system", "content": "Be\nbrief."}, MESSAGES[1]], DEFAULT_MODEL)


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_a_part_the_model_cannot_take_is_refused_by_its_type(kind):
    content = [{"type": "text", "text": "What is this?"}, {"type": kind, kind: {"url": "x"}}]
    with pytest.raises(ValueError, match=rf"messages\[0\]\['content'\]\[1\] is a '{kind}' part: this model takes text"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), [{"role": "user", "content": content}], DEFAULT_MODEL)


def test_a_name_reaches_the_template():
    template = (
        "{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}: {{ m.content }};{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]
    assert chat_prompt(tokenizer_with(template), messages, DEFAULT_MODEL) == "user(ada): hi;user: yo;"


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_tool_calls_and_tool_messages_render_through_qwen3s_template():
    text = chat_prompt(tokenizer_with(QWEN3_TEMPLATE), TOOL_TURNS, DEFAULT_MODEL)
    assert text == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_calls_a_template_never_renders_are_refused_not_dropped():
    with pytest.raises(ValueError, match=r"messages\[1\] has tool_calls, but .* never renders tool_calls"):
        chat_prompt(tokenizer_with(PLAIN_CHATML), TOOL_TURNS, DEFAULT_MODEL)


def test_the_built_in_template_renders_tool_calls_and_results_as_qwen3s_does_without_thinking():
    text = chat_prompt(load_tokenizer(DEFAULT_MODEL), TOOL_TURNS, DEFAULT_MODEL)
    assert text == chat_prompt(tokenizer_with(QWEN3_TEMPLATE), TOOL_TURNS, DEFAULT_MODEL).replace(
        "<think>\n\n</think>\n\n", ""
    )


def test_an_assistant_message_sent_back_as_the_openai_client_dumps_it_renders_as_without_its_empty_fields():
    """`response.choices[0].message.model_dump()` holds OpenAI's response fields, null: an agent sends that back."""
    dumped = {**TOOL_TURNS[1], "refusal": None, "audio": None, "function_call": None, "annotations": None}
    expected = chat_prompt(load_tokenizer(DEFAULT_MODEL), TOOL_TURNS, DEFAULT_MODEL)
    assert chat_prompt(load_tokenizer(DEFAULT_MODEL), [TOOL_TURNS[0], dumped, TOOL_TURNS[2]], DEFAULT_MODEL) == expected
    with_annotations = {**TOOL_TURNS[1], "annotations": []}  # (what OpenAI's own responses hold)
    assert chat_prompt(load_tokenizer(DEFAULT_MODEL), [TOOL_TURNS[0], with_annotations, TOOL_TURNS[2]], DEFAULT_MODEL)
    refusal = {"role": "assistant", "content": "", "refusal": "I cannot help."}  # (the template would not show it)
    with pytest.raises(TypeError, match=r"messages\[1\] has 'refusal', which an assistant message does not take"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), [TOOL_TURNS[0], refusal], DEFAULT_MODEL)


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_an_assistant_messages_reasoning_reaches_qwen3s_template_as_vllm_passes_it(key):
    """What a reasoning model thought, sent back with its turn (vLLM's `reasoning`, or `reasoning_content` as vLLM
    named it before): Qwen3's template writes it into that turn's <think> block (a turn after the last user
    message); null is no reasoning."""
    thought = {**TOOL_TURNS[1], key: "Look it up."}
    text = chat_prompt(tokenizer_with(QWEN3_TEMPLATE), [TOOL_TURNS[0], thought, TOOL_TURNS[2]], DEFAULT_MODEL)
    assert "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n<tool_call>" in text
    empty = chat_prompt(tokenizer_with(QWEN3_TEMPLATE), TOOL_TURNS, DEFAULT_MODEL)
    unsaid = {**TOOL_TURNS[1], key: None}
    assert chat_prompt(tokenizer_with(QWEN3_TEMPLATE), [TOOL_TURNS[0], unsaid, TOOL_TURNS[2]], DEFAULT_MODEL) == empty
    with pytest.raises(TypeError, match=rf"messages\[1\]\['{key}'\] must be a string"):
        chat_prompt(tokenizer_with(QWEN3_TEMPLATE), [TOOL_TURNS[0], {**TOOL_TURNS[1], key: ["x"]}], DEFAULT_MODEL)


@pytest.mark.parametrize("empty", [None, "", "null"])
def test_a_call_without_arguments_renders_as_one_with_an_empty_object_as_vllm_takes_it(empty):
    """A client that accumulated a no-argument call's stream may send its arguments as "" (or null)."""

    def turns(arguments):
        call = {"id": "c", "type": "function", "function": {"name": "ping", "arguments": arguments}}
        return [TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_calls": [call]}]

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    text = chat_prompt(tokenizer, turns(empty), DEFAULT_MODEL)
    assert text == chat_prompt(tokenizer, turns("{}"), DEFAULT_MODEL) and '"arguments": {}}' in text


@pytest.mark.parametrize("arguments", [[], 0, False, [1]])
def test_tool_call_arguments_that_are_no_object_nor_empty_are_refused(arguments):
    """null and "" are a call without arguments; an empty list, 0 or false are no JSON object (not read as {})."""
    call = {"id": "c", "type": "function", "function": {"name": "ping", "arguments": arguments}}
    turns = [TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(TypeError, match=r"\['function'\]\['arguments'\] must be a JSON object, got"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), turns, DEFAULT_MODEL)


def test_tool_call_arguments_that_are_not_json_are_refused():
    turns = [TOOL_TURNS[0], {**TOOL_TURNS[1], "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]}]
    with pytest.raises(
        ValueError, match=r"messages\[1\]\['tool_calls'\]\[0\]\['function'\]\['arguments'\] is not valid JSON"
    ):
        chat_prompt(tokenizer_with(QWEN3_TEMPLATE), turns, DEFAULT_MODEL)


def test_add_generation_prompt_and_continue_final_message():
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    closed = chat_prompt(tokenizer, MESSAGES, DEFAULT_MODEL, add_generation_prompt=False)
    assert closed == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    started = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    text = chat_prompt(tokenizer, started, DEFAULT_MODEL, add_generation_prompt=False, continue_final_message=True)
    assert text == closed + "<|im_start|>assistant\nHi, I am"
    with pytest.raises(ValueError, match="cannot set both continue_final_message and add_generation_prompt"):
        chat_prompt(tokenizer, started, DEFAULT_MODEL, continue_final_message=True)
    with pytest.raises(ValueError, match="must be the assistant's"):
        chat_prompt(tokenizer, MESSAGES, DEFAULT_MODEL, add_generation_prompt=False, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template_and_unknown_ones_are_refused():
    qwen3 = tokenizer_with(QWEN3_TEMPLATE)
    thinking = chat_prompt(qwen3, MESSAGES[1:], DEFAULT_MODEL)
    no_thinking = chat_prompt(qwen3, MESSAGES[1:], DEFAULT_MODEL, chat_template_kwargs={"enable_thinking": False})
    assert thinking.endswith("<|im_start|>assistant\n")
    assert no_thinking == thinking + "<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="chat_template_kwargs: 'enable_thinking' is not a variable of this model's"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), MESSAGES, DEFAULT_MODEL, chat_template_kwargs={"enable_thinking": 0})
    with pytest.raises(ValueError, match="chat_template_kwargs: 'tokenize' is an argument of its own"):
        chat_prompt(qwen3, MESSAGES, DEFAULT_MODEL, chat_template_kwargs={"tokenize": True})


def test_llm_chat_takes_vllms_template_arguments():
    llm = LLM(device="cpu", num_kvcache_blocks=32)
    started = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    options = dict(add_generation_prompt=False, continue_final_message=True)
    prompt = chat_prompt(llm.tokenizer, started, DEFAULT_MODEL, **options)
    assert prompt.endswith("Hi, I am")
    expected = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.chat(started, GREEDY, use_tqdm=False, **options) == expected
    with pytest.raises(ValueError, match="conversation 0: chat_template_kwargs: 'enable_thinking'"):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})


def test_llm_chat_lays_out_tools_through_the_template():
    """LLM.chat(tools=) as vLLM's: the tools reach the template (the prompt names them), the reply is generate's on
    that prompt."""
    llm = LLM(device="cpu", num_kvcache_blocks=32)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompt = chat_prompt(llm.tokenizer, MESSAGES, DEFAULT_MODEL, tools=tools)
    assert "get_weather" in prompt and prompt != chat_prompt(llm.tokenizer, MESSAGES, DEFAULT_MODEL)
    expected = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.chat(MESSAGES, GREEDY, use_tqdm=False, tools=tools) == expected


def test_openais_developer_role_is_refused_with_the_role_to_send():
    """Qwen3's template renders no "developer" message (it would vanish from the prompt): the error says to send
    it as "system", the role OpenAI's newer models renamed."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(
        ValueError, match=r"messages\[0\]\['role'\] must be one of .* got 'developer': send it as 'system'"
    ):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), messages, DEFAULT_MODEL)
