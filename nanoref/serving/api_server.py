"""An OpenAI-compatible HTTP server on an `AsyncLLM`: what `python -m nanoref.serve` runs.

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", ..., "stream"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}, ...], ...}
    GET  /v1/models, /health, /metrics (Prometheus text)

A request's life here: its JSON is checked field by field into `SamplingParams` (a bad field is a 400 that names
it, in OpenAI's error body, before anything reaches the engine), the prompt is checked by the engine
(`AsyncLLM.generate` raises at once for an empty, too long or out-of-vocabulary prompt: a 400 too), then the
outputs are either collected into one response or sent as server-sent events (`data: {...}\\n\\n` per piece, then
`data: [DONE]`), as OpenAI's API and vLLM's server do. A client that goes away mid-stream cancels the response;
closing its output stream aborts the request, so its KV blocks go back at the next step boundary.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoref.engine.chat import chat_prompt
from nanoref.sampling_params import SamplingParams
from nanoref.serving.async_llm import AsyncLLM, RequestOutput

# request field -> SamplingParams field, as vLLM maps them. Fields SamplingParams lacks in this build are
# refused with a 400 naming them (rather than silently ignored: the client asked for something)
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",  # (a vLLM extension, as the ones below)
    "seed": "seed",
    "stop": "stop",
    "n": "n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "logprobs": "logprobs"}  # completions: logprobs is the top-k count
CHAT_FIELDS = {**SAMPLING_FIELDS, "max_completion_tokens": "max_tokens"}  # (+ logprobs/top_logprobs, below)


class BadRequest(Exception):
    """A request the server refuses: answered with HTTP 400 and OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def error_body(message: str, param: str | None, status: int) -> dict:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sampling_params(body: dict, mapping: dict[str, str]) -> SamplingParams:
    """The request's sampling fields as SamplingParams; a missing or null field keeps SamplingParams' default."""
    known = {f.name for f in fields(SamplingParams)}
    values: dict[str, Any] = {}
    for name, target in mapping.items():
        if body.get(name) is None:
            continue
        if target not in known:
            raise BadRequest(f"{name!r} is not supported by this server's SamplingParams", name)
        try:  # each field alone first, so that the error names the request's own field
            SamplingParams(**{target: body[name]})
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error) if name == target else f"{name}: {error}", name) from None
        values[target] = body[name]
    try:  # then together: checks across fields (e.g. min_tokens above max_tokens)
        return SamplingParams(**values)
    except (ValueError, TypeError) as error:
        raise BadRequest(str(error)) from None


def chat_sampling_params(body: dict) -> SamplingParams:
    """Chat's logprobs is a switch and top_logprobs the count (vLLM: logprobs=top_logprobs if logprobs)."""
    body = dict(body)
    logprobs, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    if top is not None and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if logprobs:
        body["logprobs"] = 0 if top is None else top
        return sampling_params(body, {**CHAT_FIELDS, "logprobs": "logprobs"})
    return sampling_params(body, CHAT_FIELDS)


def usage(out: RequestOutput) -> dict:
    completion = len(out.cumulative_token_ids)
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": out.num_prompt_tokens + completion,
    }


class EngineCollector:
    """Gauges and counters read from the engine at scrape time (a prometheus_client custom collector)."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        gauges = {
            "nanoref_num_requests_running": ("Requests in the running batch", stats.num_running),
            "nanoref_num_requests_waiting": ("Requests queued for prefill", stats.num_waiting),
            "nanoref_kv_cache_blocks_used": ("KV blocks held by requests", stats.num_kv_blocks_used),
            "nanoref_kv_cache_blocks_total": ("KV blocks in the cache", stats.num_kv_blocks),
            "nanoref_prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache",
                stats.prefix_cache_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "nanoref_prefix_cache_queries",
            "Prompt tokens of finished requests",
            value=stats.prefix_cache_queried_tokens,
        )
        yield CounterMetricFamily(
            "nanoref_prefix_cache_hits",
            "Of them, tokens found in the prefix cache",
            value=stats.prefix_cache_hit_tokens,
        )


class ServerMetrics:
    """The server's own registry (never prometheus_client's global one: two servers in a process stay apart)."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.ttft = Histogram(
            "nanoref_time_to_first_token_seconds", "Time to first token", buckets=buckets, registry=self.registry
        )
        self.tpot = Histogram(
            "nanoref_time_per_output_token_seconds", "Time per output token", buckets=buckets, registry=self.registry
        )
        self.requests = Counter("nanoref_requests", "Finished requests", ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("nanoref_prompt_tokens", "Prompt tokens received", registry=self.registry)
        self.generation_tokens = Counter("nanoref_generation_tokens", "Tokens generated", registry=self.registry)

    def observe(self, out: RequestOutput, first: bool) -> None:
        """Count one output as it passes to a client (an aborted request's tokens count too)."""
        if first:
            self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(len(out.token_ids))
        if out.finished:
            self.requests.labels(finish_reason=out.finish_reason).inc()
        if out.metrics is not None:
            self.ttft.observe(out.metrics.ttft)
            if out.metrics.tpot is not None:
                self.tpot.observe(out.metrics.tpot)


class ClosingStreamingResponse(StreamingResponse):
    """A stream that closes its body iterator however the response ends. When the client disconnects, Starlette
    cancels the task that sends the response: mostly that lands inside the generator (awaiting the next token) and
    its cleanup, the request's abort, runs at once; when it lands in `send`, the generator is left suspended at a
    `yield` until the garbage collector finalizes it. Closing it here makes the abort immediate either way."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(engine: AsyncLLM, served_model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` as the model `served_model_name` (the app does not close the engine)."""
    app = FastAPI(title="nanoref")
    app.state.engine = engine
    app.state.metrics = metrics = ServerMetrics(engine)
    tokenizer, folder = engine.llm.tokenizer, engine.llm.config.model_folder

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, error: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(error.message, error.param, 400), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{type(error).__name__}: {error}", None, 500), status_code=500)

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRequest(f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != served_model_name:
            raise BadRequest(f"the model {model!r} does not exist; this server serves {served_model_name!r}", "model")
        for name in ("stream", "stream_options"):
            expected = bool if name == "stream" else dict
            if body.get(name) is not None and not isinstance(body[name], expected):
                raise BadRequest(f"{name} must be {'true or false' if expected is bool else 'an object'}", name)
        return body

    def start(prompt: str | list[int], params: SamplingParams, param: str) -> AsyncIterator[RequestOutput]:
        try:  # the engine's checks of the prompt (empty, too long, outside the vocabulary) and of the KV budget
            return engine.generate(prompt, params)
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error), "max_tokens" if "max_tokens" in str(error) else param) from None

    async def respond(body: dict, outputs: AsyncIterator[RequestOutput], chat: bool) -> Response:
        """Collect the outputs into one response, or stream them as server-sent events."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": served_model_name,
        }

        def choice(out: RequestOutput, text: str) -> dict:
            reason = out.finish_reason if out.finished else None
            if chat:
                delta = {"content": text} if text else {}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if not body.get("stream"):
            async with aclosing(outputs):
                first = True
                async for out in outputs:
                    metrics.observe(out, first)
                    first = False
            if chat:
                message = {"role": "assistant", "content": out.cumulative_text}
                choices = [{"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason}]
            else:
                choices = [choice(out, out.cumulative_text)]
            return JSONResponse(
                {
                    **head,
                    "object": "chat.completion" if chat else "text_completion",
                    "choices": choices,
                    "usage": usage(out),
                }
            )

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def events() -> AsyncIterator[str]:
            async with aclosing(outputs):
                if chat:  # OpenAI's first chat chunk opens the assistant's message
                    yield event(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                first, finished = True, False
                try:
                    async for out in outputs:
                        metrics.observe(out, first)
                        first, finished = False, out.finished
                        if out.text or out.finished:  # (no empty pieces while a character is half made)
                            yield event({**head, "choices": [choice(out, out.text)]})
                except Exception as error:  # the step serving it failed: the stream says so, then ends
                    yield event(error_body(f"{type(error).__name__}: {error}", None, 500))
                    finished = True
                else:
                    if include_usage:
                        yield event({**head, "choices": [], "usage": usage(out)})
                finally:
                    if not finished:  # the client went away: closing `outputs` aborts the request
                        metrics.requests.labels(finish_reason="abort").inc()
            yield "data: [DONE]\n\n"

        return ClosingStreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            raise BadRequest(
                "prompt must be a string or a list of integer token ids (one prompt per request)", "prompt"
            )
        params = sampling_params(body, COMPLETION_FIELDS)
        return await respond(body, start(prompt, params, "prompt"), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        try:
            prompt = chat_prompt(tokenizer, body.get("messages"), folder)
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error), "messages") from None
        params = chat_sampling_params(body)
        return await respond(body, start(prompt, params, "messages"), chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "nanoref"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body("the engine thread has stopped", None, 503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
