"""Every request field of OpenAI's and vLLM's completion and chat APIs is honoured or refused by name; chat as
clients send it; logit_bias, skip_special_tokens; vLLM's extra endpoints (/version, /tokenize, /detokenize, the
model card, vLLM's metric names). A real server on 127.0.0.1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

import nanoref  # noqa: E402
from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.serving.api_server import (  # noqa: E402
    ACCEPTED_UNUSED,
    CHAT_HONOURED,
    COMPLETION_HONOURED,
    NOT_SUPPORTED_CHAT,
    NOT_SUPPORTED_COMPLETION,
    ServerMetrics,
)
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import running_server  # noqa: E402

MODEL = "nanoref-fields"
SETTINGS = dict(device="cpu", num_kvcache_blocks=256)
MESSAGES = [{"role": "system", "content": "Answer in Zen."}, {"role": "user", "content": "What is better?"}]
EOS = 0  # the built-in model's <|endoftext|>, its one special token
QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
PLAIN_CHATML = (  # a ChatML template that knows no tools
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(**SETTINGS), owns_llm=True), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(**SETTINGS)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=TIMEOUT)


def refused(server, path: str, body: dict, param: str, status: int = 400) -> str:
    """The request is refused with `status`, naming `param` -> the error's message."""
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    server.wait_until_idle()
    return error["message"]


def choice_text(response: httpx.Response, chat: bool) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


# -- every field: honoured or refused ------------------------------------------------------------------------------
# vLLM's own request fields (its CompletionRequest and ChatCompletionRequest, beyond OpenAI's)
VLLM_SAMPLING = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids",
    "bad_words",
}  # fmt: skip
VLLM_EXTRA = {
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "return_token_offsets", "return_mm_kwargs", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget",
    "stream_interval", "routed_experts_prompt_start", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag", "logits_processors",
}  # fmt: skip
VLLM_COMPLETION = VLLM_SAMPLING | VLLM_EXTRA | {"echo", "prompt_embeds", "stream"}
VLLM_CHAT = VLLM_SAMPLING | VLLM_EXTRA | {"stream"}
VLLM_CHAT |= {
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "include_reasoning", "return_prompt_text",
}  # fmt: skip
COMPLETION_REQUEST = set(completion_create_params.CompletionCreateParamsBase.__annotations__) | VLLM_COMPLETION
CHAT_REQUEST = set(chat_create_params.CompletionCreateParamsBase.__annotations__) | VLLM_CHAT


@pytest.mark.parametrize(
    ("fields", "honoured", "not_supported"),
    [
        (COMPLETION_REQUEST, COMPLETION_HONOURED, NOT_SUPPORTED_COMPLETION),
        (CHAT_REQUEST, CHAT_HONOURED, NOT_SUPPORTED_CHAT),
    ],
    ids=["completions", "chat"],
)
def test_every_request_field_is_honoured_accepted_or_refused(fields, honoured, not_supported):
    unhandled = sorted(fields - honoured - ACCEPTED_UNUSED - set(not_supported))
    assert not unhandled, f"request fields neither honoured nor refused: {unhandled}"
    assert not honoured & set(not_supported)


@pytest.mark.parametrize(
    ("path", "fields", "not_supported"),
    [
        ("/v1/completions", COMPLETION_REQUEST, NOT_SUPPORTED_COMPLETION),
        ("/v1/chat/completions", CHAT_REQUEST, NOT_SUPPORTED_CHAT),
    ],
    ids=["completions", "chat"],
)
def test_each_unsupported_field_with_a_value_is_a_400_naming_it(server, path, fields, not_supported):
    base = {"prompt": "x", "max_tokens": 1} if "chat" not in path else {"messages": MESSAGES, "max_tokens": 1}
    for name in sorted(fields & set(not_supported)):
        refused(server, path, {**base, name: {"something": "asked"}}, name)
        for default in (None, *not_supported[name]):  # null or the default: nothing is asked for
            assert post(server, path, {**base, name: default}).status_code == 200, (name, default)


def test_an_unknown_field_is_a_400_naming_it(server):
    message = refused(server, "/v1/completions", {"prompt": "x", "temprature": 0}, "temprature")
    assert "unknown field 'temprature'" in message


def test_logits_processors_are_refused_as_vllm_refuses_them_not_as_a_typo(server):
    body = {"prompt": "x", "logits_processors": ["my.Processor"]}
    message = refused(server, "/v1/completions", body, "logits_processors")
    assert "not supported" in message and "typo" not in message


def test_suffix_and_the_deprecated_functions_are_refused_by_name(server):
    assert "suffix is not supported" in refused(server, "/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix")
    chat = "/v1/chat/completions"
    function = {"name": "f", "parameters": {"type": "object"}}
    assert "send tools" in refused(server, chat, {"messages": MESSAGES, "functions": [function]}, "functions")
    assert "send tool_choice" in refused(server, chat, {"messages": MESSAGES, "function_call": "auto"}, "function_call")
    for fine in ({"tool_choice": "none"}, {"response_format": {"type": "text"}}, {"tools": None}):
        assert post(server, chat, {"messages": MESSAGES, "max_tokens": 2, **fine}).status_code == 200, fine


def test_user_is_accepted_and_changes_nothing(server):
    body = {"prompt": "Beautiful is", "max_tokens": 6, "temperature": 0}
    plain = choice_text(post(server, "/v1/completions", body), chat=False)
    assert choice_text(post(server, "/v1/completions", {**body, "user": "ada"}), chat=False) == plain
    answer = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, user="ada")
    assert answer.choices[0].finish_reason in ("length", "stop")
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # (accepted unused, but typed: a string)
        assert f"{name} must be a string, got 5" in refused(server, "/v1/completions", {**body, name: 5}, name)


def test_the_completions_default_max_tokens_is_16(server):
    response = post(server, "/v1/completions", {"prompt": "Beautiful is", "ignore_eos": True})
    assert response.json()["usage"]["completion_tokens"] == 16


def test_chat_top_logprobs_0_asks_for_nothing_and_a_count_needs_logprobs_true_as_in_vllm(server):
    """vLLM refuses a top_logprobs that would return alternatives without `logprobs: true` (its words), and takes 0
    (as a client that always sends it does) with logprobs off: no logprobs."""
    for off in ({}, {"logprobs": False}):
        body = {"messages": MESSAGES, "max_completion_tokens": 2, "top_logprobs": 0, **off}
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 200 and response.json()["choices"][0]["logprobs"] is None, response.text
        message = refused(server, "/v1/chat/completions", {**body, "top_logprobs": 2}, "top_logprobs")
        assert message == "when using `top_logprobs`, `logprobs` must be set to true"
    reply = post(server, "/v1/chat/completions", {**body, "logprobs": True}).json()["choices"][0]
    assert [entry["top_logprobs"] for entry in reply["logprobs"]["content"]] == [[], []]


def test_chat_prompt_logprobs_are_vllms_field_beside_the_choices(server):
    """vLLM's chat takes prompt_logprobs and returns them beside the choices, scored as completions score the same
    prompt (the rendered messages' tokens); with stream: true a 400, as in vLLM."""
    body = {"messages": MESSAGES, "max_completion_tokens": 2, "prompt_logprobs": 2, "return_token_ids": True}
    chat = post(server, "/v1/chat/completions", body).json()
    prompt = chat["prompt_token_ids"]
    completion = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()
    assert chat["prompt_logprobs"] == completion["choices"][0]["prompt_logprobs"]
    assert len(chat["prompt_logprobs"]) == len(prompt) and chat["prompt_logprobs"][0] is None
    assert all(str(token) in entry for token, entry in zip(prompt[1:], chat["prompt_logprobs"][1:]))
    assert "prompt_logprobs" not in post(server, "/v1/chat/completions", {**body, "prompt_logprobs": None}).json()
    message = refused(server, "/v1/chat/completions", {**body, "stream": True}, "prompt_logprobs")
    assert "not available with stream: true" in message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_prompt_logprobs_0_in_a_stream_is_taken_as_in_vllm(server, path):
    """vLLM refuses prompt_logprobs in a stream only where they ask for something (above 0, or -1); 0, which a
    client may send always, streams as without it (it was a 400 here)."""
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": "Hello"}
    body |= {"max_tokens": 2, "prompt_logprobs": 0, "stream": True}
    response = post(server, path, body)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]"), response.text
    assert "prompt_logprobs" in refused(server, path, {**body, "prompt_logprobs": 1}, "prompt_logprobs")


def test_the_chat_default_max_tokens_is_the_room_the_context_leaves(server, offline):
    """vLLM's chat default: with no max_tokens / max_completion_tokens the reply may fill the context."""
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert response.status_code == 200, response.text
    usage, choice = response.json()["usage"], response.json()["choices"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == offline.config.max_model_len
    assert choice["finish_reason"] == "length"


def test_the_chat_default_fits_a_kv_cache_smaller_than_the_context():
    """A cache that holds fewer tokens than max_model_len (vLLM would not start; nanoref serves it): the default
    reply fills the cache instead of being refused for a max_tokens the client never set."""
    llm = LLM(device="cpu", num_kvcache_blocks=8)
    capacity = llm.config.num_kvcache_blocks * llm.config.kvcache_block_size
    assert capacity < llm.config.max_model_len
    with running_server(AsyncLLM(llm, owns_llm=True), MODEL) as small:
        response = post(small, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == capacity


# -- min_p ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_min_p_1_samples_only_the_most_likely_token(server, chat):
    """min_p 1.0 keeps the tokens as likely as the most likely one: sampling at temperature 1 gives greedy's tokens
    (sent through the openai client's extra_body, as vLLM's users send it)."""
    client = server.client()
    if chat:
        args = dict(model=MODEL, messages=MESSAGES, max_tokens=12)
        call = client.chat.completions.create
    else:
        args = dict(model=MODEL, prompt="The block manager", max_tokens=12)
        call = client.completions.create

    def text(**more) -> str:
        choice = call(**args, **more).choices[0]
        return choice.message.content if chat else choice.text

    greedy = text(temperature=0)
    assert [text(temperature=1.0, seed=seed, extra_body={"min_p": 1.0}) for seed in (1, 2, 3)] == [greedy] * 3
    free = [text(temperature=1.0, seed=seed) for seed in (1, 2, 3)]
    assert free != [greedy] * 3, "temperature 1 gave greedy's text anyway: the check is too weak"
    refused(server, "/v1/chat/completions" if chat else "/v1/completions",
            {**({"messages": MESSAGES} if chat else {"prompt": "x"}), "min_p": 1.5}, "min_p")  # fmt: skip


def test_allowed_token_ids_keep_sampling_among_them(server, offline):
    allowed = [offline.tokenizer.encode(word)[0] for word in (" yes", " no")]
    response = server.client().completions.create(
        model=MODEL, prompt="The block manager", max_tokens=6, temperature=1.0, extra_body={
            "allowed_token_ids": allowed, "ignore_eos": True})  # fmt: skip
    tokens = offline.tokenizer.encode(response.choices[0].text)
    assert tokens and set(tokens) <= set(allowed), response.choices[0].text
    message = refused(server, "/v1/completions", {"prompt": "x", "allowed_token_ids": [5, 10**6]}, "allowed_token_ids")
    assert "1000000" in message and "vocabulary" in message
    refused(server, "/v1/chat/completions", {"messages": MESSAGES, "allowed_token_ids": []}, "allowed_token_ids")


def test_bad_words_keep_a_word_out_of_the_completion(server, offline):
    """The word's tokens (as the tokenizer writes " is", one token) never appear in the completion's token ids (the
    model may still spell a word with other tokens: vLLM bans the tokenizer's spellings only)."""
    word = offline.tokenizer.encode(" is", add_special_tokens=False)
    client = server.client()  # (the openai client, as a user sends vLLM's extras: extra_body)

    def token_ids(**more) -> list[int]:
        args = dict(model=MODEL, prompt="Beautiful is better than", max_tokens=24, temperature=0)
        return client.completions.create(**args, extra_body={"return_token_ids": True, **more}).choices[0].token_ids

    def holds(tokens: list[int]) -> bool:
        return any(tokens[i : i + len(word)] == word for i in range(len(tokens)))

    assert holds(token_ids()), "the free completion never says it: the check is too weak"
    assert not holds(token_ids(bad_words=["is"]))
    refused(server, "/v1/completions", {"prompt": "x", "bad_words": "better"}, "bad_words")


def test_truncate_prompt_tokens_keeps_the_prompts_end(server):
    client = server.client()
    long_ids = [5 + i % 900 for i in range(700)]  # past the built-in model's max_model_len (512)
    # (ignore_eos: 3 tokens on any draw of the model's sampling defaults)
    out = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=3, extra_body={
        "truncate_prompt_tokens": 20, "truncation_side": "left", "ignore_eos": True})  # fmt: skip
    assert out.usage.prompt_tokens == 20 and out.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 4})  # fmt: skip
    assert chat.usage.prompt_tokens == 4
    refused(server, "/v1/completions", {"prompt": long_ids, "max_tokens": 3}, "prompt")
    refused(server, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")
    message = refused(
        server, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"
    )
    assert "max_model_len" in message
    refused(server, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 3, "truncation_side": "right"},
            "truncation_side")  # fmt: skip


# -- logit_bias, skip_special_tokens, spaces_between_special_tokens -------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_logit_bias_of_plus_100_makes_greedy_pick_that_token(server, offline, chat, stream):
    greedy = offline.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    favourite = 500
    assert favourite not in greedy[0]["token_ids"]  # (so the bias is what picks it)
    args = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=True if chat else 1)
    extra = {"logit_bias": {str(favourite): 100}, "ignore_eos": True}
    if chat:
        call = server.client().chat.completions.create
        args.update(messages=MESSAGES, stream=stream, logit_bias=extra.pop("logit_bias"))
    else:
        call = server.client().completions.create
        args.update(prompt="Beautiful is", stream=stream, logit_bias=extra.pop("logit_bias"))
    response = call(**args, extra_body=extra)
    chunks = list(response) if stream else [response]
    if chat:
        tokens = [t.token for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.content]
    else:
        tokens = [t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.tokens]
    assert tokens == [offline.tokenizer.decode([favourite])] * 4


def test_a_logit_bias_past_100_is_clamped_to_100_as_vllms_server_does(server, offline):
    """The two likeliest first tokens, B ahead of A: A +1000 and B +150 reach the engine as +100 each (OpenAI's
    bound), so greedy still takes B; offline, SamplingParams takes the biases as given, and A wins."""
    first = offline.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=1, logprobs=2), False)[0]
    b, a = list(first["logprobs"][0].top)
    bias = {a: 1000, b: 150}
    body = {
        "prompt": "Beautiful is",
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {str(k): v for k, v in bias.items()},
    }
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert offline.tokenizer.encode(response.json()["choices"][0]["text"]) == [b]
    as_given = offline.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=1, logit_bias=bias), False)
    assert as_given[0]["token_ids"] == [a]


def test_logit_bias_offline_steers_sampling_and_greedy(offline):
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        out = offline.generate(
            ["Beautiful is"], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={7: 100}, **params), False
        )
        assert out[0]["token_ids"] == [7] * 5
    banned = offline.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = banned[0]["token_ids"][0]
    out = offline.generate(
        ["Beautiful is"], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}), use_tqdm=False
    )
    assert out[0]["token_ids"] != [first]


def test_a_logit_bias_outside_the_vocabulary_is_refused_naming_it(server, offline):
    message = refused(server, "/v1/completions", {"prompt": "x", "logit_bias": {"5000": 5}}, "logit_bias")
    assert "5000" in message and "vocabulary" in message
    refused(server, "/v1/completions", {"prompt": "x", "logit_bias": {"five": 5}}, "logit_bias")
    refused(server, "/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"5": "high"}}, "logit_bias")
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[5000\] are outside the vocabulary"):
        offline.generate(["x"], SamplingParams(logit_bias={5000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_skip_special_tokens_false_shows_them_but_not_the_eos_that_ends(server, offline, stream):
    """EOS biased to be every token: with ignore_eos it is generated 4 times and shown when asked; without, the
    first one ends the completion and is never text (as in vLLM)."""
    client = server.client()
    base = dict(model=MODEL, prompt="Beautiful is", max_tokens=4, temperature=0, logit_bias={str(EOS): 100})

    def text(**extra) -> str:
        response = client.completions.create(**base, stream=stream, extra_body=extra)
        return "".join(c.choices[0].text for c in response if c.choices) if stream else response.choices[0].text

    assert text(ignore_eos=True) == ""
    assert text(ignore_eos=True, skip_special_tokens=False) == "<|endoftext|>" * 4
    assert text(skip_special_tokens=False) == ""
    assert text(skip_special_tokens=False, include_stop_str_in_output=True) == "<|endoftext|>"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={EOS: 100})
    params.skip_special_tokens = False
    assert offline.generate(["Beautiful is"], params, use_tqdm=False)[0]["text"] == "<|endoftext|>" * 4
    assert "".join(piece.text for piece in offline.stream("Beautiful is", params)) == "<|endoftext|>" * 4
    refused(server, "/v1/completions", {"prompt": "x", "skip_special_tokens": "maybe"}, "skip_special_tokens")
    refused(
        server, "/v1/completions", {"prompt": "x", "spaces_between_special_tokens": 2}, "spaces_between_special_tokens"
    )


# -- chat as clients send it ---------------------------------------------------------------------------------------
def test_content_parts_answer_as_the_same_text_would(server):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "better?"}]
    as_parts = [MESSAGES[0], {"role": "user", "content": parts, "name": "ada"}]
    as_text = [MESSAGES[0], {"role": "user", "content": "What is\nbetter?"}]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = "/v1/chat/completions"
    assert choice_text(post(server, chat, {**body, "messages": as_parts}), True) == choice_text(
        post(server, chat, {**body, "messages": as_text}), True
    )


def test_an_image_part_is_a_400_that_names_it(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    message = refused(server, "/v1/chat/completions", {"messages": messages}, "messages")
    assert "'image_url' part" in message and "text only" in message
    with pytest.raises(openai.BadRequestError, match="image_url"):
        server.client().chat.completions.create(model=MODEL, messages=messages)


def test_continue_final_message_continues_the_assistants_text(server, offline):
    started = [*MESSAGES, {"role": "assistant", "content": "Beautiful is"}]
    body = {"messages": started, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    message = refused(
        server, "/v1/chat/completions", {**body, "continue_final_message": True}, "continue_final_message"
    )
    assert "cannot set both continue_final_message and add_generation_prompt" in message
    body.update(continue_final_message=True, add_generation_prompt=False)
    served = choice_text(post(server, "/v1/chat/completions", body), chat=True)
    server.wait_until_idle()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = offline.chat(started, params, False, add_generation_prompt=False, continue_final_message=True)
    assert served == expected[0]["text"]


def test_chat_template_kwargs_the_template_does_not_read_are_a_400(server):
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert "not a variable of this model's chat template" in refused(
        server, "/v1/chat/completions", body, "chat_template_kwargs"
    )


def test_tool_calls_the_template_cannot_render_are_a_400_naming_messages(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [MESSAGES[1], {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "42"})
    tokenizer = server.engine.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = PLAIN_CHATML  # (the built-in model's template renders them)
    try:
        message = refused(server, "/v1/chat/completions", {"messages": messages}, "messages")
    finally:
        tokenizer.chat_template = original
    assert "never renders tool_calls" in message


def test_tool_calls_render_through_qwen3s_template_on_the_server(server):
    tokenizer = server.engine.tokenizer
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [MESSAGES[1], {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "42"})
    original = tokenizer.chat_template
    tokenizer.chat_template = QWEN3_TEMPLATE
    try:
        tokens = post(server, "/tokenize", {"messages": messages})
        chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        thinking_off = post(
            server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
        )
    finally:
        tokenizer.chat_template = original
    text = tokenizer.decode(tokens.json()["tokens"])
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<tool_response>\n42\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    assert tokenizer.decode(thinking_off.json()["tokens"]) == text + "<think>\n\n</think>\n\n"


# -- vLLM's endpoints ----------------------------------------------------------------------------------------------
def test_version_and_the_model_card(server):
    assert httpx.get(f"{server.url}/version", timeout=TIMEOUT).json() == {"version": nanoref.__version__}
    card = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert card["max_model_len"] == server.engine.config.max_model_len == 512
    assert card["id"] == MODEL and card["root"] == str(server.engine.config.model_folder)
    assert card["permission"][0]["object"] == "model_permission"


def test_tokenize_and_detokenize_in_vllms_shapes(server, offline):
    ids = offline.tokenizer.encode("Beautiful is better")
    assert post(server, "/tokenize", {"prompt": "Beautiful is better"}).json() == {
        "count": len(ids),
        "max_model_len": 512,
        "tokens": ids,
        "token_strs": None,
    }
    strs = post(server, "/tokenize", {"prompt": "Beautiful", "return_token_strs": True}).json()["token_strs"]
    assert strs == offline.tokenizer.convert_ids_to_tokens(offline.tokenizer.encode("Beautiful"))
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    rendered = offline.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == offline.tokenizer.encode(rendered) and chat["count"] == len(chat["tokens"])
    closed = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert offline.tokenizer.decode(closed["tokens"]) + "<|im_start|>assistant\n" == rendered
    assert post(server, "/detokenize", {"tokens": ids + [EOS]}).json() == {"prompt": "Beautiful is better<|endoftext|>"}
    assert "5000" in refused(server, "/detokenize", {"tokens": [1, 5000]}, "tokens")
    refused(server, "/detokenize", {"tokens": "1 2"}, "tokens")
    refused(server, "/tokenize", {"prompt": 5}, "prompt")
    refused(server, "/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt")


def test_add_special_tokens_is_honoured(server):
    """A tokenizer that writes a BOS (<|endoftext|>) before each text: completions add it by default, chat does
    not (vLLM's defaults: the chat template writes what it needs), and each field turns that around."""
    from tokenizers.processors import TemplateProcessing

    rust = server.engine.tokenizer._tokenizer
    original = rust.post_processor
    rust.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", EOS)])
    try:
        ids = post(server, "/tokenize", {"prompt": "Flat is"}).json()["tokens"]
        plain = post(server, "/tokenize", {"prompt": "Flat is", "add_special_tokens": False}).json()["tokens"]
        chat = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
        chat_bos = post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()["tokens"]

        def prompt_tokens(path: str, body: dict) -> int:
            return post(server, path, {**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]

        with_bos = prompt_tokens("/v1/completions", {"prompt": "Flat is"})
        without = prompt_tokens("/v1/completions", {"prompt": "Flat is", "add_special_tokens": False})
        chat_plain = prompt_tokens("/v1/chat/completions", {"messages": MESSAGES})
        chat_with = prompt_tokens("/v1/chat/completions", {"messages": MESSAGES, "add_special_tokens": True})
    finally:
        rust.post_processor = original
    assert ids == [EOS, *plain] and chat_bos == [EOS, *chat]
    assert (with_bos, chat_with) == (without + 1, chat_plain + 1)


def test_metrics_under_vllms_names(server):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
        values = {}
        for family in parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model_name", MODEL) == MODEL and "le" not in sample.labels:
                    key = sample.name + "".join(f"{{{v}}}" for k, v in sample.labels.items() if k != "model_name")
                    values[key] = sample.value
        return values

    server.wait_until_idle()
    before = scrape()
    response = post(server, "/v1/completions", {"prompt": "Beautiful is", "max_tokens": 5, "ignore_eos": True})
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    server.wait_until_idle()
    after = scrape()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:prompt_tokens_total") == prompt_tokens == grew("nanoref_prompt_tokens_total")
    assert grew("vllm:generation_tokens_total") == 5 == grew("nanoref_generation_tokens_total")
    assert grew("vllm:request_success_total{length}") == 1
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert grew(f"{name}_count") == 1 and after[f"{name}_sum"] > before.get(f"{name}_sum", 0.0)
    assert grew("vllm:request_generation_tokens_sum") == 5
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[name] == 0.0
    assert grew("vllm:prefix_cache_queries_total") == prompt_tokens


def test_vllms_histograms_have_vllms_buckets(server):
    """A dashboard made for vLLM reads quantiles from the bucket bounds: a 2-minute request must not land beyond the
    last one (30 s here once, which a p99 then reads as 30 s). The bounds are vLLM's (vllm/v1/metrics/loggers.py); the
    token counts' run 1, 2, 5, 10, ... up to max_model_len (512 here)."""
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    bounds = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                bounds.setdefault(family.name, []).append(float(sample.labels["le"]))
    assert server.engine.config.max_model_len == 512
    assert bounds["vllm:time_to_first_token_seconds"] == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0,
    ]  # fmt: skip
    assert bounds["vllm:e2e_request_latency_seconds"] == [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
        1920.0, 7680.0,
    ]  # fmt: skip
    assert bounds["vllm:request_time_per_output_token_seconds"] == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ]  # fmt: skip
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert bounds[name] == [1, 2, 5, 10, 20, 50, 100, 200, 500], name


def test_finished_request_counters_start_at_zero_for_every_finish_reason(server):
    """Prometheus' rate() and increase() take a series' first sample as its start: a counter whose series first
    appears at 1 loses that request (the first abort of a day counted 0). vLLM makes every finished_reason's series
    at 0 when it starts; so does a server's fresh registry here, before any request."""
    from prometheus_client import generate_latest

    metrics = ServerMetrics(server.engine, "fresh")
    families = {f.name: f for f in parser.text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    for name, label in (("vllm:request_success", "finished_reason"), ("nanoref_requests", "finish_reason")):
        samples = {s.labels[label]: s.value for s in families[name].samples if s.name.endswith("_total")}
        assert samples == {"stop": 0.0, "length": 0.0, "abort": 0.0}, name


def test_a_queued_request_of_n_samples_counts_n_waiting_as_vllms_n_child_requests():
    """vLLM queues a request with n > 1 as n child requests at once, and vllm:num_requests_waiting counts each; the
    samples 1..n-1 this engine holds until sample 0's prompt is in count as waiting too."""
    from nanoref.serving.engine_loop import EngineLoop

    loop = EngineLoop(LLM(**SETTINGS), receive=lambda wait: [], send=lambda message: None)
    loop.take([("add", 0, "a", "Beautiful is", SamplingParams(n=3, max_tokens=2), None)])
    loop.take([("add", 1, "b", "Flat is", SamplingParams(n=2, max_tokens=2), None)])
    assert (loop.stats().num_waiting, loop.stats().num_running) == (5, 0)
    while loop.requests:
        loop.step()
        loop.deliver()
        stats = loop.stats()
        assert stats.num_waiting + stats.num_running <= 5
    assert (loop.stats().num_waiting, loop.stats().num_running) == (0, 0)


# -- vLLM's cache_salt, return_token_ids, return_tokens_as_token_ids ----------------------------------------------
GREEDY = {"max_tokens": 4, "temperature": 0}


def cached_tokens(server, call) -> int:
    """Prompt tokens the prefix cache served to the request `call()` makes."""
    server.wait_until_idle()
    before = server.engine.stats().prefix_cache_hit_tokens
    call()
    server.wait_until_idle()
    return server.engine.stats().prefix_cache_hit_tokens - before


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_cache_salt_shares_prefix_cache_blocks_only_between_requests_of_the_same_salt(server, chat):
    client = server.client()
    prompt = list(range(400 + 100 * chat, 440 + 100 * chat))  # two full blocks and more, in no other test

    def ask(salt: str | None):
        extra = {} if salt is None else {"cache_salt": salt}
        if chat:
            messages = [{"role": "user", "content": client.base_url.host + " salt " * 20}]
            return lambda: client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, extra_body=extra
            )
        return lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)

    first = [cached_tokens(server, ask(salt)) for salt in ("tenant-a", "tenant-b", None)]
    assert first == [0, 0, 0], "a request read K/V that a request of another salt (or of none) computed"
    again = [cached_tokens(server, ask(salt)) for salt in ("tenant-a", "tenant-b", None)]
    assert all(hit >= 32 for hit in again), f"the same salt again should find its full blocks: {again}"


@pytest.mark.parametrize("salt", ["", "x" * 129, "user@example.com", "a/b", "a\\b", "a\x00b", 7, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it_and_queues_nothing(server, salt):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        message = refused(server, path, {**base, "cache_salt": salt, "max_tokens": 1}, "cache_salt")
        assert message.startswith("cache_salt must"), message
        stats = server.engine.stats()
        assert stats.num_running == stats.num_waiting == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        server.client().completions.create(model=MODEL, prompt="x", extra_body={"cache_salt": salt})


@pytest.mark.parametrize("name", ["cache_salt", "return_token_ids", "return_tokens_as_token_ids"])
def test_the_fields_are_honoured_and_their_flags_checked(server, name):
    assert name in COMPLETION_HONOURED and name in CHAT_HONOURED
    if name != "cache_salt":
        for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            assert "true or false" in refused(server, path, {**base, name: "maybe"}, name)
            assert post(server, path, {**base, name: None, "max_tokens": 1}).status_code == 200


def extras(item) -> dict:
    """The fields of an openai response object beyond OpenAI's own (vLLM's), but stop_reason, which is always there."""
    return {key: value for key, value in (item.model_extra or {}).items() if key != "stop_reason"}


def test_return_token_ids_in_completions_where_vllm_puts_them(server, offline):
    """Each choice: "prompt_token_ids" (its prompt's) and "token_ids" (its tokens); in a stream, each choice's first
    chunk has its prompt's ids (later ones null) and every chunk the ids of its new tokens."""
    client = server.client()
    prompts = [list(range(600, 606)), list(range(610, 613))]
    expected = offline.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    plain = client.completions.create(model=MODEL, prompt=prompts, **GREEDY)
    assert all(not extras(choice) for choice in plain.choices)  # (asked for nothing: nothing more)
    out = client.completions.create(model=MODEL, prompt=prompts, **GREEDY, extra_body={"return_token_ids": True})
    for choice, prompt, want in zip(out.choices, prompts, expected):
        assert extras(choice) == {"prompt_token_ids": prompt, "token_ids": want["token_ids"]}
        assert choice.text == want["text"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, stream=True, **GREEDY,
                                            extra_body={"return_token_ids": True}))  # fmt: skip
    for index, (prompt, want) in enumerate(zip(prompts, expected)):
        mine = [extras(chunk.choices[0]) for chunk in chunks if chunk.choices[0].index == index]
        assert [piece["prompt_token_ids"] for piece in mine] == [prompt] + [None] * (len(mine) - 1)
        assert [token for piece in mine for token in piece["token_ids"]] == want["token_ids"]


def test_echo_with_return_token_ids_leaves_the_prompts_text_out_as_vllm_does(server, offline):
    """vLLM's echo with return_token_ids: the client has the prompt's ids, so the text holds only what was generated;
    the logprobs still list the prompt's tokens (each at offset 0: none of their text is in the choice's)."""
    prompt = list(range(620, 625))
    want = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    body = {"prompt": prompt, "echo": True, "logprobs": 0, **GREEDY}
    echoed = post(server, "/v1/completions", body).json()["choices"][0]
    choice = post(server, "/v1/completions", {**body, "return_token_ids": True}).json()["choices"][0]
    assert echoed["text"] != want["text"] and echoed["text"].endswith(want["text"])
    assert choice["text"] == want["text"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt, want["token_ids"])
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == echoed["logprobs"]["tokens"]
    assert logprobs["text_offset"][: len(prompt)] == [0] * len(prompt)
    generated = echoed["logprobs"]["text_offset"][len(prompt) :]
    assert logprobs["text_offset"][len(prompt) :] == [offset - generated[0] for offset in generated]


def test_return_token_ids_in_chat_where_vllm_puts_them(server, offline):
    """The response's "prompt_token_ids" (the rendered messages' ids) and each choice's "token_ids"; in a stream, the
    opening chunks carry the prompt's ids and every chunk its new tokens' ids."""
    client = server.client()
    prompt = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    sampled = dict(max_tokens=4, temperature=1.0, seed=7, n=2)  # (greedy takes only n=1, as in vLLM)
    want = offline.chat(MESSAGES, SamplingParams(**sampled), use_tqdm=False)[0]["outputs"]
    ask = dict(model=MODEL, messages=MESSAGES, **sampled, extra_body={"return_token_ids": True})
    out = client.chat.completions.create(**ask)
    assert extras(out)["prompt_token_ids"] == prompt and out.usage.prompt_tokens == len(prompt)
    assert [extras(choice) for choice in out.choices] == [{"token_ids": sample["token_ids"]} for sample in want]
    assert not extras(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1))
    chunks = list(client.chat.completions.create(**ask, stream=True))
    openings = [chunk for chunk in chunks if chunk.choices[0].delta.role == "assistant"]
    assert [extras(chunk)["prompt_token_ids"] for chunk in openings] == [prompt, prompt]
    for index in range(2):
        mine = [chunk.choices[0] for chunk in chunks[2:] if chunk.choices[0].index == index]
        assert [token for choice in mine for token in extras(choice)["token_ids"]] == want[index]["token_ids"]
        assert "".join(choice.delta.content or "" for choice in mine) == want[index]["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_return_tokens_as_token_ids_spells_logprobs_tokens_token_id_n(server, stream):
    """Completions' tokens and top_logprobs' keys, chat's tokens and their alternatives: "token_id:N" (an echoed
    prompt's tokens too); everything else (logprobs, offsets, bytes) as without it."""
    client = server.client()
    prompt = list(range(630, 634))
    ask = dict(model=MODEL, prompt=prompt, logprobs=2, echo=True, stream=stream, **GREEDY)
    ids = {"return_token_ids": True}

    def completion(extra: dict) -> tuple[dict, list[int]]:
        got = client.completions.create(**ask, extra_body=extra)
        pieces = list(got) if stream else [got]
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece in pieces:
            for key in merged:
                merged[key] += getattr(piece.choices[0].logprobs, key)
        return merged, [token for piece in pieces for token in extras(piece.choices[0])["token_ids"]]

    plain, token_ids = completion(ids)
    named, _ = completion({**ids, "return_tokens_as_token_ids": True})
    assert named["tokens"] == [f"token_id:{token}" for token in prompt + token_ids]
    assert named["token_logprobs"] == plain["token_logprobs"] and named["text_offset"] == plain["text_offset"]
    assert named["top_logprobs"][0] is None
    for top, mine in zip(named["top_logprobs"][1:], plain["top_logprobs"][1:]):
        assert all(re.fullmatch(r"token_id:\d+", key) for key in top) and sorted(top.values()) == sorted(mine.values())
    for top, token in zip(named["top_logprobs"][len(prompt) :], token_ids):  # (greedy: each token is its top 1)
        assert next(iter(top)) == f"token_id:{token}"

    chat = dict(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, stream=stream, **GREEDY)

    def chat_logprobs(extra: dict) -> tuple[list, list[int]]:
        got = client.chat.completions.create(**chat, extra_body=extra)
        pieces = [piece.choices[0] for piece in (list(got) if stream else [got])]
        entries = [entry for piece in pieces if piece.logprobs for entry in piece.logprobs.content]
        return entries, [token for piece in pieces for token in extras(piece).get("token_ids", [])]

    plain, token_ids = chat_logprobs(ids)
    named, _ = chat_logprobs({**ids, "return_tokens_as_token_ids": True})
    assert [entry.token for entry in named] == [f"token_id:{token}" for token in token_ids]
    assert [(entry.logprob, entry.bytes) for entry in named] == [(entry.logprob, entry.bytes) for entry in plain]
    for entry, mine in zip(named, plain):
        assert all(re.fullmatch(r"token_id:\d+", top.token) for top in entry.top_logprobs)
        assert [(top.logprob, top.bytes) for top in entry.top_logprobs] == [
            (t.logprob, t.bytes) for t in mine.top_logprobs
        ]


# -- typed fields read as vLLM's pydantic request models read them (lax mode) --------------------------------------
LAX_INPUTS = [
    1.0, -0.0, 2.5, float("inf"), float("nan"), 1e20, True, False, 0, 1, 2,
    "5", " 5 ", "+5", "-5.0", "5.00", "5.", "1_000", "1__0", "_1", "1e2", "0x10", "\u0665", "", "abc", "0.5", ".5",
    "inf", "NaN", "true", "False", "YES", "no", "on", "off", "t", "f", "y", "n", "1", "0", " true", "2", 0.5, None, [1],
    "9" * 5000,
]  # fmt: skip


@pytest.mark.parametrize("kind", [int, float, bool])
def test_lax_readers_convert_what_pydantic_lax_mode_converts_and_leave_the_rest(kind):
    """pydantic (vLLM's request models, lax mode) is the oracle: what it converts, the reader converts to the same
    value and type; what it refuses, the reader leaves as it was (for the endpoint's check to refuse)."""
    import math

    from pydantic import TypeAdapter, ValidationError

    from nanoref.serving.lax_fields import lax_bool, lax_float, lax_int

    reader = {int: lax_int, float: lax_float, bool: lax_bool}[kind]
    adapter = TypeAdapter(kind)
    for value in LAX_INPUTS:
        try:
            expected = adapter.validate_python(value)
        except ValidationError:
            assert reader(value) is value, value
            continue
        got = reader(value)
        if kind is float and type(value) is int:  # (an integer stays one: SamplingParams takes it as the number)
            assert got is value
        elif isinstance(expected, float) and math.isnan(expected):
            assert math.isnan(got), value
        else:
            assert (type(got), got) == (type(expected), expected), value


def test_whole_number_floats_and_numeric_strings_are_taken_as_vllm_takes_them(server, offline):
    """`"max_tokens": 3.0`, `"n": "2"`, `"stream": "true"`: vLLM's pydantic request models (lax mode) read them as
    the numbers and switches they spell; a fraction where an integer belongs stays a 400 naming the field."""
    prompt = {"prompt": "Beautiful is", "temperature": 0.7, "ignore_eos": True}
    exact = {**prompt, "max_tokens": 3, "n": 2, "seed": 3, "logprobs": 2, "top_k": 5, "top_p": 1}
    lax = {**prompt, "max_tokens": 3.0, "n": "2", "seed": 3.0, "logprobs": 2.0, "top_k": "5", "top_p": "1"}
    want = post(server, "/v1/completions", exact).json()["choices"]
    got = post(server, "/v1/completions", {**lax, "ignore_eos": "true", "echo": 0}).json()["choices"]
    assert [c["text"] for c in got] == [c["text"] for c in want] and len(got) == 2
    assert [len(c["logprobs"]["top_logprobs"][0]) for c in got] == [2, 2]
    streamed = post(server, "/v1/completions", {**lax, "n": 1.0, "stream": "true"})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    chat = {"messages": MESSAGES, "max_completion_tokens": "2", "logprobs": "yes", "top_logprobs": 2.0}
    reply = post(server, "/v1/chat/completions", {**chat, "temperature": "0"}).json()["choices"][0]
    assert len(reply["logprobs"]["content"]) == 2 and len(reply["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert post(server, "/detokenize", {"tokens": [1.0, "2"]}).json() == {"prompt": offline.tokenizer.decode([1, 2])}
    for name, value in (("max_tokens", 1.5), ("n", "2.5"), ("seed", "three"), ("top_k", 5.5), ("logprobs", 1e300)):
        assert name in refused(server, "/v1/completions", {"prompt": "x", name: value}, name)
    refused(
        server, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2.5}, "max_completion_tokens"
    )


@pytest.mark.parametrize(
    "path, name, value",
    [
        ("/v1/completions", "max_tokens", "9" * 5000),
        ("/v1/completions", "seed", "1" * 4301 + ".0"),
        ("/v1/completions", "stop_token_ids", ["7" * 4400]),
        ("/detokenize", "tokens", [1, "2" * 4400]),
    ],
)
def test_a_numeric_string_too_long_for_an_integer_is_a_400_naming_its_field(server, path, name, value):
    """pydantic (vLLM's request models) refuses an integer string past its size limit as it refuses any other
    string that is no integer: a 400 naming the field, never a 500 (Python's int() stops at 4,300 digits)."""
    body = {"tokens": value} if path == "/detokenize" else {"prompt": "x", name: value}
    refused(server, path, body, name)
