"""The OpenAI-compatible server, started for real on 127.0.0.1 and spoken to with OpenAI's own client."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import Server, assert_no_block_leaked, needs_xgrammar, running_server  # noqa: E402

MODEL = "nanoref-test"
SETTINGS = dict(device="cpu", num_kvcache_blocks=256)  # the built-in model, in both the server and offline
MESSAGES = [{"role": "system", "content": "Answer in Zen."}, {"role": "user", "content": "What is better?"}]


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(LLM(**SETTINGS), owns_llm=True), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(**SETTINGS)


def offline_text(server: Server, llm: LLM, prompt: str, **params) -> str:
    # the server idle first: each thread has its own step Context, so two engines may step at once, but the server's
    # tests then time nothing but the server
    server.wait_until_idle()
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]["text"]


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    for method in ("GET", "POST"):  # vLLM's /ping (SageMaker's health check)
        assert httpx.request(method, f"{server.url}/ping", timeout=TIMEOUT).json() == {"status": "ok"}
    wrong = httpx.put(f"{server.url}/ping", timeout=TIMEOUT)
    assert wrong.status_code == 405 and set(wrong.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_offline_generate_greedy_and_seeded(server, offline, stream):
    client = server.client()
    for params in (dict(temperature=0, max_tokens=20), dict(temperature=0.9, top_p=0.95, max_tokens=20, seed=11)):
        prompt = "Beautiful is better than"
        expected = offline_text(server, offline, prompt, ignore_eos=True, **params)
        args = dict(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **params)
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert [c.choices[0].finish_reason for c in chunks[-2:-1]] == ["length"]
            usage = chunks[-1].usage
            assert chunks[-1].choices == []
        else:
            response = client.completions.create(**args)
            text, usage = response.choices[0].text, response.usage
            assert response.choices[0].finish_reason == "length"
        assert text == expected
        prompt_tokens = len(offline.tokenizer.encode(prompt))
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            prompt_tokens,
            20,
            prompt_tokens + 20,
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_offline_chat(server, offline, stream):
    server.wait_until_idle()
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    args = dict(
        model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=16, extra_body={"ignore_eos": True}
    )
    client = server.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        response = client.chat.completions.create(**args)
        text = response.choices[0].message.content
        assert response.choices[0].message.role == "assistant" and response.usage.completion_tokens == 16
    assert text == expected[0]["text"]


def scrape(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_parse_and_the_counters_move(server):
    before = scrape(server)
    server.client().completions.create(
        model=MODEL, prompt="Simple is", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(server)
    assert after["nanoref_kv_cache_blocks_total"] == SETTINGS["num_kvcache_blocks"]
    assert after["nanoref_generation_tokens_total"] - before.get("nanoref_generation_tokens_total", 0) == 7
    key = "nanoref_requests_total{finish_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    assert (
        after["nanoref_time_to_first_token_seconds_count"] - before.get("nanoref_time_to_first_token_seconds_count", 0)
        == 1
    )
    assert after["nanoref_prefix_cache_queries_total"] > before.get("nanoref_prefix_cache_queries_total", 0)
    for name in ("nanoref_num_requests_running", "nanoref_num_requests_waiting", "nanoref_prefix_cache_hit_rate"):
        assert name in after


TOO_LONG = list(range(1, 600))  # the built-in model's max_model_len is 512
BAD = [
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "x", "min_p": -0.5}, "min_p"),
    ("completions", {"prompt": "x", "seed": "s"}, "seed"),
    ("completions", {"prompt": "x", "stream": "maybe"}, "stream"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": TOO_LONG}, "prompt"),
    ("completions", {"prompt": [3, 5000]}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD, ids=[f"{p}-{param}-{i}" for i, (p, _, param) in enumerate(BAD)]
)
def test_bad_input_is_a_400_that_names_the_field(server, path, body, param):
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["code"] == 400
    assert param in error["message"] or param in ("prompt", "messages")
    assert server.blocks_used() == 0 and server.engine.llm.is_finished()


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_an_unknown_model_is_a_404_not_found_error(server, path):
    body = {"model": "gpt-4", "prompt": "x", "messages": MESSAGES}
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
    assert "gpt-4" in error["message"]
    with pytest.raises(openai.NotFoundError):  # as OpenAI's client reports it
        server.client().completions.create(model="gpt-4", prompt="x")


def test_malformed_json_is_a_400_and_the_server_serves_on(server):
    for content in (b'{"prompt": ', b"[1, 2]", b"\xff"):
        response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=TIMEOUT)
        assert response.status_code == 400 and "error" in response.json()
    with pytest.raises(openai.BadRequestError) as caught:  # as OpenAI's client reports it
        server.client().completions.create(model=MODEL, prompt="x", temperature=-0.5)
    assert caught.value.param == "temperature"
    answer = server.client().completions.create(model=MODEL, prompt="Flat is", max_tokens=3)
    assert answer.usage.completion_tokens >= 1


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are no JSON (a browser's JSON.parse refuses them)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_logits_that_overflowed_are_null_not_a_500_or_nan(server, monkeypatch):
    """A model whose logits overflow (NaN, as fp16 ones can) makes NaN logprobs: the response says null for each,
    as vLLM's do (pydantic writes NaN as null), streamed or not; it was a 500 ("Out of range float values are not
    JSON compliant") or, streamed, a NaN that is no JSON."""
    model = server.engine.llm.model_runner.model
    compute_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: torch.full_like(compute_logits(hidden), float("nan")))
    requests = [
        ("completions", {"prompt": "Flat is", "logprobs": 2, "echo": True}),
        ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
    ]
    for route, fields in requests:
        for stream in (False, True):
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": stream, **fields}
            reply = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=TIMEOUT)
            assert reply.status_code == 200, reply.text
            if stream:
                events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: {")]
                choices = [choice for event in events for choice in strict_json(event)["choices"]]
            else:
                choices = strict_json(reply.text)["choices"]
            scored = [choice["logprobs"] for choice in choices if choice.get("logprobs")]
            assert scored, (route, stream, reply.text)
            for logprobs in scored:
                values = logprobs.get("token_logprobs") or [entry["logprob"] for entry in logprobs["content"]]
                assert None in values and not any(isinstance(value, float) for value in values), values
    server.wait_until_idle()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, monkeypatch):
    runner = server.engine.llm.model_runner
    real_run = runner.run

    def slow_run(*args, **kwargs):  # 400 tokens now take over 8 s: freed within 5 s means aborted
        time.sleep(0.02)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(runner, "run", slow_run)
    key = "nanoref_requests_total{finish_reason=abort}"
    aborted = scrape(server).get(key, 0)
    body = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break  # leave after the first piece of text
    server.wait_until_idle(seconds=5)
    monkeypatch.undo()
    assert scrape(server)[key] == aborted + 1
    assert server.client().completions.create(model=MODEL, prompt="Now is", max_tokens=2).usage.completion_tokens


ZEN = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is", "Sparse is", "Readability", "Errors"]


def test_64_concurrent_streams_a_quarter_leaving_early(server, offline):
    prompts = [f"{ZEN[i % len(ZEN)]} {' better' * (i // len(ZEN))}".strip() for i in range(64)]
    max_tokens = 6
    server.wait_until_idle()
    expected = offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    leaving = set(random.Random(0).sample(range(64), 16))

    async def one(client, i: int) -> str | None:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompts[i],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if i in leaving:
                await stream.close()
                return None
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), TIMEOUT)

    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        if i not in leaving:
            assert text == expected[i]["text"], (i, prompts[i])
    server.wait_until_idle()
    assert_no_block_leaked(server.engine.llm)
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200


def test_the_serve_command_refuses_a_missing_model_folder(tmp_path, capsys):
    from nanoref.serve import main

    assert main([str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


# -- the engine in a process of its own (AsyncLLM.from_model(engine_process=True); --engine-process on) --------


@pytest.fixture(scope="module")
def process_server():
    with running_server(AsyncLLM.from_model(engine_process=True, **SETTINGS), MODEL) as running:
        yield running


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_server_on_an_engine_process_equals_offline_generate(process_server, offline, stream):
    client = process_server.client()
    prompt, params = "Beautiful is better than", dict(temperature=0, max_tokens=12)
    expected = offline_text(process_server, offline, prompt, ignore_eos=True, **params)
    args = dict(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **params)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
    else:
        text = client.completions.create(**args).choices[0].text
    assert text == expected
    process_server.wait_until_idle()
    metrics = scrape(process_server)  # the engine's numbers come with its step messages
    assert metrics["nanoref_kv_cache_blocks_total"] == SETTINGS["num_kvcache_blocks"]
    assert metrics["nanoref_kv_cache_blocks_used"] == 0 and metrics["nanoref_prefix_cache_queries_total"] > 0
    assert httpx.get(f"{process_server.url}/health", timeout=TIMEOUT).json() == {"status": "ok"}


@needs_xgrammar
def test_structured_outputs_on_an_engine_process_are_served_and_a_bad_one_is_a_400(process_server):
    # (the default of `python -m nanoref.serve`: this side has no LLM, yet checks the grammar before queueing)
    body = {"model": MODEL, "prompt": "Is it?", "max_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}}
    response = httpx.post(f"{process_server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in ("yes", "no")
    bad = {**body, "structured_outputs": {"regex": "("}}
    response = httpx.post(f"{process_server.url}/v1/completions", json=bad, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_outputs"
    process_server.wait_until_idle()
    assert scrape(process_server)["nanoref_kv_cache_blocks_used"] == 0


def children_of(pid: int) -> set[int]:
    from pathlib import Path

    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (a process that ended while we looked)
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


@dataclass
class ServeCommand:
    process: subprocess.Popen  # `python -m nanoref.serve ...`, its stdout and stderr piped
    url: str  # http://127.0.0.1:PORT/v1
    engine: set[int]  # the pids of its children but multiprocessing's resource tracker: the engine process, if any

    def assert_the_engine_is_gone(self) -> None:  # stopped and reaped by the server before it ended
        for pid in self.engine:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@contextmanager
def serve_command(*flags: str, env: dict | None = None, new_session: bool = False) -> Iterator[ServeCommand]:
    """`python -m nanoref.serve --device cpu --port 0 *flags` in a process of its own, once it serves; killed (its
    whole session with new_session) if it still runs when the block ends."""
    command = [sys.executable, "-m", "nanoref.serve", "--device", "cpu", "--port", "0", *flags]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ if env is None else env,
        start_new_session=new_session,
    )
    try:
        line = process.stdout.readline()  # "nanoref serves ... on http://127.0.0.1:PORT/v1 (Ctrl-C stops it)"
        assert " on http://" in line, line + process.stderr.read()
        url = line.split(" on ", 1)[1].split()[0]
        children = children_of(process.pid) if Path("/proc").is_dir() else set()  # (and the resource tracker)
        engine = {pid for pid in children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()}
        yield ServeCommand(process, url, engine)
    finally:
        if process.poll() is None:
            if new_session:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
            process.wait()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_the_serve_command_with_engine_process_on_serves_and_stops_on_ctrl_c():
    with serve_command("--engine-process", "on") as server:
        assert len(server.engine) == 1
        body = {"prompt": "Beautiful is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/completions", json=body, timeout=TIMEOUT).json()
        assert answer["usage"]["completion_tokens"] == 4
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(TIMEOUT) == 0, server.process.stderr.read()
        assert "Traceback" not in server.process.stderr.read()
        server.assert_the_engine_is_gone()  # the engine process went with the server
