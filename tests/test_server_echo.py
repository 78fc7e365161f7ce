"""Completions' echo, max_tokens 0 and prompt_logprobs through OpenAI's own client, as an evaluation harness sends
them (lm-eval's loglikelihood requests: echo with logprobs, to read the prompt's scores back): the prompt's scores
against log_softmax of HF transformers' logits, the completion's against offline `generate`."""

from __future__ import annotations

import json

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.llm import DEFAULT_MODEL  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import hf_model, running_server  # noqa: E402

MODEL = "nanoref-test"
SETTINGS = dict(device="cpu", num_kvcache_blocks=256)
PROMPT = "Beautiful is better than ugly. Explicit is"


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(**SETTINGS), owns_llm=True), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(**SETTINGS)


def hf_scores(prompt_ids: list[int]) -> torch.Tensor:
    """(P - 1, V): log_softmax of HF's logits at positions 0..P-2, which score prompt tokens 1..P-1."""
    with torch.no_grad():
        return hf_model(DEFAULT_MODEL)(torch.tensor([prompt_ids])).logits[0, :-1].float().log_softmax(-1)


def assert_prompt_part(logprobs: dict, prompt_ids: list[int], tokenizer, num_top: int) -> None:
    """The first len(prompt_ids) tokens of a completions logprobs object are the prompt's: the first unscored
    (null), each later one its HF log-probability, with top_logprobs holding that token first, then HF's top
    num_top at its position (OpenAI's and vLLM's up to num_top + 1), and text offsets that add up the tokens'
    texts."""
    size = len(prompt_ids)
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs["tokens"][:size] == tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = hf_scores(prompt_ids)
    want = [row[t].item() for row, t in zip(expected, prompt_ids[1:])]
    assert logprobs["token_logprobs"][1:size] == pytest.approx(want, abs=1e-4)
    for top, row, token_id in zip(logprobs["top_logprobs"][1:size], expected, prompt_ids[1:]):
        best = row.topk(num_top)
        chosen_and_best = dict.fromkeys([token_id, *best.indices.tolist()])  # (the token once, where it is first)
        assert list(top) == [tokenizer.decode([t]) for t in chosen_and_best]
        assert list(top.values()) == pytest.approx([row[t].item() for t in chosen_and_best], abs=1e-4)
    assert logprobs["text_offset"][:size] == [sum(map(len, tokens[:i])) for i in range(size)]


def test_echo_with_logprobs_and_max_tokens_0_returns_the_prompt_scored_as_hf_scores_it(server, offline):
    """What lm-eval's loglikelihood requests send: the prompt back, each token's log-probability, nothing more."""
    response = server.client().completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (choice,) = response.choices
    prompt_ids = offline.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    logprobs = choice.logprobs.model_dump()
    assert len(logprobs["tokens"]) == len(prompt_ids), "the prompt's tokens, and no generated one"
    assert_prompt_part(logprobs, prompt_ids, offline.tokenizer, 2)
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == 0
    # vLLM's own field, implied by echo with logprobs: the prompt token itself, then the top 2
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt_ids)
    for position, token_id, score in zip(vllm[1:], prompt_ids[1:], logprobs["token_logprobs"][1:]):
        assert next(iter(position)) == str(token_id) and position[str(token_id)]["logprob"] == score
        ranks = [entry["rank"] for key, entry in position.items() if key != str(token_id)]
        assert ranks == sorted(ranks) and set(ranks) <= {1, 2}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_then_the_completion_equals_hf_then_offline_generate(server, offline, stream):
    params = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    server.wait_until_idle()
    expected = offline.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    args = dict(model=MODEL, prompt=PROMPT, echo=True, temperature=0, max_tokens=6, logprobs=3)
    args["extra_body"] = {"ignore_eos": True}
    client = server.client()
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert texts[0].startswith(PROMPT), "the prompt comes first"
        text, logprobs = "".join(texts), {}
        for c in chunks:
            for key, values in (
                c.choices[0].logprobs.model_dump() if c.choices and c.choices[0].logprobs else {}
            ).items():
                logprobs.setdefault(key, []).extend(values)
    else:
        (choice,) = client.completions.create(**args).choices
        text, logprobs = choice.text, choice.logprobs.model_dump()
    assert text == PROMPT + expected["text"]
    prompt_ids = offline.tokenizer.encode(PROMPT)
    assert_prompt_part(logprobs, prompt_ids, offline.tokenizer, 3)
    generated = logprobs["token_logprobs"][len(prompt_ids) :]
    # (to float32's rounding, not bit for bit: echo scores every prompt row, so the last row's logits come from a
    # matrix product of another shape than offline generate's one row, and on a many-core CPU its sums split
    # differently: 1e-7 apart on a 16-core machine)
    assert generated == pytest.approx([entry.logprob for entry in expected["logprobs"]], rel=1e-5, abs=1e-6)
    assert "".join(logprobs["tokens"]) == text  # (ASCII: each token is whole characters)
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]


def test_echo_without_logprobs_and_of_token_ids_and_n_samples(server, offline):
    client = server.client()
    prompt_ids = offline.tokenizer.encode(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
    assert plain.choices[0].text != PROMPT
    ids = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, max_tokens=0, temperature=0)
    assert ids.choices[0].text == offline.tokenizer.decode(prompt_ids)
    several = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Simple is"], echo=True, logprobs=1, max_tokens=2, n=2, temperature=2.0, seed=3
    )
    for choice in several.choices:
        prompt = [PROMPT, "Simple is"][choice.index // 2]
        assert choice.text.startswith(prompt)
        assert_prompt_part(choice.logprobs.model_dump(), offline.tokenizer.encode(prompt), offline.tokenizer, 1)


def test_prompt_logprobs_as_vllm_returns_them_without_echo(server, offline):
    response = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    (choice,) = response.choices
    prompt_ids = offline.tokenizer.encode(PROMPT)
    scores = choice.model_extra["prompt_logprobs"]
    expected = hf_scores(prompt_ids)
    assert scores[0] is None and [list(position) for position in scores[1:]] == [[str(t)] for t in prompt_ids[1:]]
    assert [position[str(t)]["logprob"] for position, t in zip(scores[1:], prompt_ids[1:])] == pytest.approx(
        [row[t].item() for row, t in zip(expected, prompt_ids[1:])], abs=1e-4
    )
    assert all(position[str(t)]["decoded_token"] == offline.tokenizer.decode([t]) for position, t in
               zip(scores[1:], prompt_ids[1:]))  # fmt: skip
    assert choice.logprobs is None and not choice.text.startswith(PROMPT)


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(max_tokens=0), "max_tokens"),  # only with echo
        (dict(echo="maybe"), "echo"),
        (dict(prompt_logprobs=1, stream=True), "prompt_logprobs"),  # vLLM's rule
        (dict(prompt_logprobs=-1), "prompt_logprobs"),  # the whole vocabulary: more than the 20 this engine gives
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(echo=True, logprobs=21, max_tokens=0), "logprobs"),
    ],
)
def test_a_bad_echo_request_is_a_400_naming_its_field(server, body, param):
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=TIMEOUT
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_echo_starts_each_message_with_the_assistants_last_message_as_vllm(server, stream):
    """vLLM's chat echo: continuing the assistant's message, each choice's message starts with it (a stream sends it
    in a chunk of its own once every choice's opening chunk is out); usage counts the generated tokens only. A last
    message that is the user's is not echoed (the reply is the assistant's)."""
    client = server.client()
    start, ask = "Beautiful is", {"role": "user", "content": "Recite it."}
    continuing = {"continue_final_message": True, "add_generation_prompt": False}
    for messages, flags, said in [([ask, {"role": "assistant", "content": start}], continuing, start), ([ask], {}, "")]:
        args = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=5, n=2)  # (sample i: seed + i)
        plain = client.chat.completions.create(**args, extra_body={"ignore_eos": True, **flags})
        echoed = dict(**args, extra_body={"ignore_eos": True, "echo": True, **flags})
        if stream:
            texts, order = ["", ""], []
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **echoed))
            for chunk in chunks:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                    order.append((choice.index, choice.delta.role, choice.delta.content))
            if said:
                assert order[:4] == [(0, "assistant", ""), (1, "assistant", ""), (0, None, said), (1, None, said)]
            usage = chunks[-1].usage
        else:
            response = client.chat.completions.create(**echoed)
            texts, usage = [choice.message.content for choice in response.choices], response.usage
        assert texts == [said + choice.message.content for choice in plain.choices]
        assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 12)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_without_a_generation_prompt_the_reply_takes_the_last_messages_role_as_vllm(server, stream):
    """vLLM's get_chat_request_role: with add_generation_prompt false the reply's role is the last message's (here
    the user's), in the message and in a stream's first delta; echo then repeats that message, whose role is the
    reply's."""
    ask = "Recite it."
    for echo in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": ask}], "max_tokens": 3, "temperature": 0}
        body.update(add_generation_prompt=False, ignore_eos=True, echo=echo, stream=stream)
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
            assert deltas[0] == {"role": "user", "content": ""}
            assert all("role" not in delta for delta in deltas[1:])
            text = "".join(delta.get("content") or "" for delta in deltas)
        else:
            message = response.json()["choices"][0]["message"]
            assert message["role"] == "user"
            text = message["content"]
        assert text.startswith(ask) == echo
