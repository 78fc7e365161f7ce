"""Third-party clients that users point at vLLM, pointed at a real nanoref server on 127.0.0.1: LangChain's
ChatOpenAI (a message with content blocks; invoke, stream, batch) and OpenAI (completions). Every call is bounded by
the client's timeout, with no retries."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import running_server  # noqa: E402

MODEL = "nanoref-langchain"
SETTINGS = dict(device="cpu", num_kvcache_blocks=256)
GREEDY = dict(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(**SETTINGS), owns_llm=True), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(**SETTINGS)


def chat_model(server, **options):
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0, **options
    )


def offline_chat(server, offline, conversation: list[dict]) -> str:
    server.wait_until_idle()
    return offline.chat(conversation, SamplingParams(**GREEDY), use_tqdm=False)[0]["text"]


def test_chat_openai_invoke_with_content_blocks_equals_offline_chat(server, offline):
    blocks = [{"type": "text", "text": "What is"}, {"type": "text", "text": "better?"}]
    conversation = [messages.SystemMessage("Answer in Zen."), messages.HumanMessage(content=blocks)]
    reply = chat_model(server, **GREEDY).invoke(conversation)
    expected = offline_chat(
        server,
        offline,
        [{"role": "system", "content": "Answer in Zen."}, {"role": "user", "content": "What is\nbetter?"}],
    )
    assert reply.content == expected
    assert reply.usage_metadata["output_tokens"] >= 1


def test_chat_openai_stream_concatenates_to_invoke(server):
    model = chat_model(server, **GREEDY)
    question = [messages.HumanMessage("Beautiful is better than")]
    whole = model.invoke(question).content
    pieces = [chunk.content for chunk in model.stream(question)]
    assert len(pieces) > 1 and "".join(pieces) == whole


def test_chat_openai_batch_answers_each_conversation(server, offline):
    questions = ["Beautiful is", "Flat is better than", "Errors should never"]
    replies = chat_model(server, **GREEDY).batch([[messages.HumanMessage(q)] for q in questions])
    expected = [offline_chat(server, offline, [{"role": "user", "content": q}]) for q in questions]
    assert [reply.content for reply in replies] == expected


def test_langchain_openai_completions_invoke_equals_offline_generate(server, offline):
    llm = langchain_openai.OpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0, **GREEDY
    )
    text = llm.invoke("Beautiful is better than")
    server.wait_until_idle()
    expected = offline.generate(["Beautiful is better than"], SamplingParams(**GREEDY), use_tqdm=False)[0]["text"]
    assert text == expected
