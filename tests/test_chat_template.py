"""A chat template of the caller's (vLLM's `LLM.chat(chat_template=...)` and `--chat-template`): it renders the
messages in place of the folder's, a base model without one can chat, and a template that does not parse is named
before anything is rendered. The built-in model; the rendered text is written out by hand as the oracle."""

from __future__ import annotations

import json
import shutil

import pytest

from nanoref import LLM, SamplingParams
from nanoref.llm import DEFAULT_MODEL

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Beautiful is better than"}]
RENDERED = "<user>Beautiful is better than\n<assistant>"  # TEMPLATE's text for MESSAGES
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def test_a_chat_template_renders_the_messages_in_place_of_the_folders(llm):
    ours = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=TEMPLATE)[0]
    expected = llm.generate([RENDERED], GREEDY, use_tqdm=False)[0]
    assert ours["token_ids"] == expected["token_ids"]
    folders = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]  # the control: Qwen3's ChatML, another prompt
    assert folders["token_ids"] != ours["token_ids"]


def test_a_folder_without_a_chat_template_chats_with_one_given(tmp_path):
    folder = tmp_path / "base"
    shutil.copytree(DEFAULT_MODEL, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    base = LLM(str(folder), device="cpu")
    with pytest.raises(ValueError, match="has no chat template"):
        base.chat(MESSAGES, GREEDY, use_tqdm=False)
    out = base.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=TEMPLATE)[0]
    assert out["token_ids"] == base.generate([RENDERED], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize(
    "template, error, message",
    [
        ("{% for m in messages %}{{ m['content'] }}", ValueError, r"does not parse as a Jinja template: line 1"),
        ("{{ messages[0]['content'] }\n", ValueError, r"does not parse as a Jinja template"),
        ("  ", ValueError, r"chat_template is empty"),
        (b"{{ x }}", TypeError, r"chat_template must be a Jinja template's text, got bytes"),
    ],
    ids=["unclosed-for", "unclosed-braces", "blank", "bytes"],
)
def test_a_chat_template_that_is_no_template_is_named(llm, template, error, message):
    with pytest.raises(error, match=message):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=template)
    assert llm.is_finished()  # (nothing was queued)


def test_chat_template_content_format_takes_vllms_names(llm):
    string = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template_content_format="string")[0]
    assert string["token_ids"] == llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]["token_ids"]
    with pytest.raises(ValueError, match="chat_template_content_format='openai'.*use 'auto' or 'string'"):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="chat_template_content_format must be 'auto' or 'string', got 'json'"):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template_content_format="json")


# -- the server ------------------------------------------------------------------------------------------------------
def test_the_server_renders_chat_and_tokenize_with_its_chat_template(llm):
    pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from nanoref.serving.async_llm import AsyncLLM

    from .helpers import running_server

    expected = llm.generate([RENDERED], GREEDY, use_tqdm=False)[0]
    with running_server(AsyncLLM(LLM(device="cpu"), owns_llm=True), "m", chat_template=TEMPLATE) as server:
        reply = server.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0.0)
        assert reply.choices[0].message.content == expected["text"]
        tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
        assert tokens == llm.get_tokenizer().encode(RENDERED, add_special_tokens=False)


STRICT = (  # (the kind of check Gemma's and Mistral's templates make)
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}"
    "{% endif %}" + TEMPLATE
)


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_them():
    pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from nanoref.serving.async_llm import AsyncLLM

    from .helpers import running_server

    system_first = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    with running_server(AsyncLLM(LLM(device="cpu"), owns_llm=True), "m", chat_template=STRICT) as server:
        for route, body in (("/v1/chat/completions", {"model": "m", "max_tokens": 2}), ("/tokenize", {})):
            reply = httpx.post(f"{server.url}{route}", json={**body, "messages": system_first}, timeout=30)
            assert reply.status_code == 400, (route, reply.text)
            error = reply.json()["error"]
            assert "the first message must be the user's" in error["message"] and error["param"] == "messages"
        ok = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30)  # (the control)
        assert ok.status_code == 200


def test_serve_reads_chat_template_as_vllm_does(tmp_path, capsys):
    from nanoref.serve import load_chat_template, main

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE  # a file's text
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"  # (escapes)
    assert main(["--device", "cpu", "--port", "0", "--chat-template", str(tmp_path / "nowhere.jinja")]) == 2
    assert "looks like a file path, but it cannot be read" in capsys.readouterr().err
    assert main(["--device", "cpu", "--port", "0", "--chat-template", "{% for m in messages %}"]) == 2
    assert "error: --chat-template: chat_template does not parse as a Jinja template" in capsys.readouterr().err
    assert main(["--device", "cpu", "--port", "0", "--chat-template-content-format", "openai"]) == 2
    assert "chat_template_content_format='openai'" in capsys.readouterr().err


def test_a_chat_template_given_is_the_one_its_errors_name(llm):
    """The folder's template renders tools and tool_calls: an error about a template given in its place names that
    one, not the folder's."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calling = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for kwargs, conversation, what in [
        (dict(tools=tools), MESSAGES, "never renders tools"),
        ({}, calling, "never renders tool_calls"),
    ]:
        llm.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)  # (the control: the folder's)
        with pytest.raises(ValueError, match=f"the chat_template given {what}") as raised:
            llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=TEMPLATE, **kwargs)
        assert str(DEFAULT_MODEL) not in str(raised.value)
    with pytest.raises(ValueError, match="'enable_thinking' is not a variable of the chat_template given"):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": 0})
    assert llm.is_finished()
