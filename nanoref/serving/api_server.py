"""An OpenAI-compatible HTTP server on an `AsyncLLM`: what `python -m nanoref.serve` runs.

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", ..., "stream"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}, ...], ...}
    GET  /v1/models, /health (and /ping), /metrics (Prometheus text, nanoref's names and vLLM's), /version
    POST /tokenize, /detokenize (vLLM's)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (LoRA adapters, where allowed: lora_modules.py)

Every request field is honoured, accepted unused (`user`, as vLLM) or refused with a 400 that names it
(`check_fields`; docs/serving.md lists them all): nothing a client asks for is silently ignored.

A request's life here: its body is read within limits (a size, a time), its JSON is checked field by field into
`SamplingParams` (a bad field is a 400 that names it, in OpenAI's error body, before anything reaches the engine),
the prompt is checked by the engine (`AsyncLLM.generate` raises at once for an empty, too long or out-of-vocabulary
prompt: a 400 too; a long body is decoded and tokenized in a worker thread, never on the event loop), then the
outputs are either collected into one response or sent as server-sent events (`data: {...}\\n\\n` per piece, then
`data: [DONE]`), as OpenAI's API and vLLM's server do. A client that goes away mid-stream cancels the response;
closing its output stream aborts the request, so its KV blocks go back at the next step boundary. A client that
goes away while waiting for a whole response is noticed within a quarter second (`until_done_or_disconnected`),
and its request is aborted the same way.

Tool calls (chat's `tools`, `tool_choice`, `parallel_tool_calls`): tool_calls.py checks them and makes the grammar of
"required" and a named function; each chat choice's text then goes through its mode's reader, piece by piece in a
stream and at once in a whole response, so that both show the same message.

n samples and several prompts: each prompt is one AsyncLLM request of n samples; choice k is sample k % n of
prompt k // n (OpenAI's numbering), every chunk names its choice's index, and usage counts every prompt once and
every sample's tokens.

Chat's reply role and echo (vLLM's): the reply is the assistant's, or with add_generation_prompt false the last
message's role's (a continued message's); echo starts each choice's message with the last message's text, where its
role is the reply's.

Echo (completions): each choice's text starts with its prompt's, and with logprobs its tokens start with the
prompt's, scored as `SamplingParams.prompt_logprobs` scores them (the first one null: nothing before it to score it
on), as vLLM does; with max_tokens 0 the prompt is all there is (how an evaluation harness scores a text: the engine
samples one token, which is not returned). In a stream the prompt comes with each choice's first chunk.

vLLM's extras (docs/serving.md): `cache_salt` keeps a request's K/V apart in the prefix cache (the engine's
`Sequence.cache_salt`, through vLLM's prompt dicts); `return_token_ids` adds the prompt's and each choice's token ids
where vLLM puts them, and `return_tokens_as_token_ids` spells logprobs' tokens "token_id:N" (`respond`).

Logprobs in a stream: a piece of text is held back while it ends in half a character or in a possible start of a
stop string, so a step's tokens and the text it lets out need not line up. Each token's logprobs go out with the
first chunk sent at or after the step that made the token (a step whose text is all held back sends no chunk; its
tokens' logprobs ride with the next one). The chunks' logprobs concatenate to the whole response's.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import math
import os
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field, fields, replace
from itertools import islice
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanoref.config import EngineConfig
from nanoref.engine.chat import chat_prompt, check_chat_template, check_messages
from nanoref.engine.detokenizer import REPLACEMENT_CHAR, decode
from nanoref.engine.requests import check_cache_salt, truncate_prompt
from nanoref.engine.requests import tokenize as prompt_token_ids  # (the /tokenize route takes the name)
from nanoref.layers.logits_processors import TokenLogprobs
from nanoref.models.generation_config import GenerationDefaults
from nanoref.sampling_params import MAX_TOKENS_LIMIT, SamplingParams, StructuredOutputsParams, stop_strings
from nanoref.serving.async_llm import AsyncLLM, RequestOutput
from nanoref.serving.lax_fields import CHAT_TYPES, COMPLETION_TYPES, DETOKENIZE_TYPES, TOKENIZE_TYPES, lax_body
from nanoref.serving.lora_modules import LoRAModules, lora_routes, served_model_names
from nanoref.serving.tool_calls import (
    Delta,
    ToolChoice,
    ToolRequestError,
    assemble,
    check_tool_settings,
    check_tools,
    tool_choice,
)
from nanoref.utils.text import is_utf8, lone_surrogate
from nanoref.utils.version import __version__

# request field -> SamplingParams field, as vLLM maps them. Fields SamplingParams lacks in this build are
# refused with a 400 naming them (rather than silently ignored: the client asked for something)
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",  # (a vLLM extension, as the ones below)
    "min_p": "min_p",
    "allowed_token_ids": "allowed_token_ids",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "bad_words": "bad_words",
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
    "logit_bias": "logit_bias",  # (token ids as JSON's string keys: see token_bias)
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}
# completions: logprobs is the top-k count; prompt_logprobs a vLLM extension (and what echo with logprobs implies)
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}
CHAT_FIELDS = {**SAMPLING_FIELDS, "max_completion_tokens": "max_tokens", "prompt_logprobs": "prompt_logprobs"}
# (+ logprobs/top_logprobs, below)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions
CHAT_DEFAULTS = {"max_tokens": None}  # vLLM's chat default: the room left in the context (the engine stops there)

# Every request field of OpenAI's and vLLM's completion and chat APIs has one of these fates (docs/serving.md lists
# them all); a field in none of them is a 400 that names it, so nothing a client asks for is silently ignored.
# - honoured: read by the endpoint (its FIELDS above, and the ones below)
COMPLETION_HONOURED = {"model", "prompt", "stream", "stream_options", "add_special_tokens", "echo", *COMPLETION_FIELDS}
COMPLETION_HONOURED |= {"response_format", "structured_outputs"}  # (both: `structured_outputs` below)
CHAT_HONOURED = {"model", "messages", "stream", "stream_options", "add_special_tokens", *CHAT_FIELDS}
CHAT_HONOURED |= {"response_format", "structured_outputs"}
CHAT_HONOURED |= {"tools", "tool_choice", "parallel_tool_calls"}  # (tool_calls.py)
CHAT_HONOURED |= {"logprobs", "top_logprobs", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
CHAT_HONOURED |= {"echo"}  # (vLLM's: the reply starts with the last message's text, where its role is the reply's)
# vLLM's: the prefix cache's salt, and the token ids in the response (see `respond`)
OUTPUT_FIELDS = {"cache_salt", "return_token_ids", "return_tokens_as_token_ids"}
COMPLETION_HONOURED |= OUTPUT_FIELDS | {"request_id"}  # (vLLM's: the response's id, unless X-Request-Id names one)
CHAT_HONOURED |= OUTPUT_FIELDS | {"request_id"}
# - accepted and unused, as vLLM takes them: who is asking, and a hint for a cache this server keeps by itself
ACCEPTED_UNUSED = {"user", "safety_identifier", "prompt_cache_key"}
# - not supported: a 400 naming the field unless it is null or one of these values (its default: "off")
NOT_SUPPORTED_COMMON: dict[str, tuple] = {
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "use_beam_search": (False,),
    "watermarking": (False,),
    "length_penalty": (1, 1.0),
    "early_stopping": (False,),
    "truncation_side": ("left",),  # (truncate_prompt_tokens keeps the prompt's end, as vLLM's default side)
    "logprob_token_ids": (),
    "priority": (0,),
    "session_id": (),
    "return_token_offsets": (False,),
    "return_mm_kwargs": (True,),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": (),
    "repetition_detection": (),
    "thinking_token_budget": (),
    "stream_interval": (1,),
    "routed_experts_prompt_start": (0,),
    "logits_processors": (),  # (vLLM too refuses them without --logits-processor-pattern)
}
NOT_SUPPORTED_COMPLETION = {**NOT_SUPPORTED_COMMON, "suffix": (), "best_of": (1,), "prompt_embeds": ()}
NOT_SUPPORTED_CHAT = {
    **NOT_SUPPORTED_COMMON,
    "functions": (),
    "function_call": ("none",),
    "reasoning_effort": (),
    "include_reasoning": (True,),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "verbosity": (),
    "web_search_options": (),
    "metadata": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "prompt_cache_retention": (),
    "prompt_cache_options": (),
    "moderation": (),
    "documents": (),
    "chat_template": (),
    "media_io_kwargs": (),
    "mm_processor_kwargs": (),
    "return_prompt_text": (False,),
}
# why a field is refused, where there is more to say than "not supported"
REFUSALS = {
    "suffix": "suffix is not supported (as in vLLM: no fill-in-the-middle)",
    "chat_template": (
        "a chat template sent with the request is refused (as vLLM refuses one without "
        "--trust-request-chat-template): the model folder's template renders the messages"
    ),
    "functions": "functions (OpenAI's deprecated form) is not supported: send tools",
    "function_call": "function_call (OpenAI's deprecated form) is not supported (only 'none'): send tool_choice",
}


# Limits of one request (vLLM's server has none of these; OpenAI's API caps n at 128 and stop at 4 strings). Each
# refused with a 400 naming its field, or a 413 for the body.
MAX_N = 128  # samples per prompt: each holds KV blocks and a slot of the running batch
# stop strings are matched against every new token's text in the engine's loop, at a cost that grows with their
# number and length, paid in every step of every request batched with them (measured on this CPU, per token of
# the request: 3 us without stop strings, 0.3 ms with 16 of 128 characters, 1.2 ms with 32 of 256, 118 ms with
# 2,000 of 500)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 128
MAX_BODY_BYTES = 16 * 2**20  # a request body (the longest prompt a model takes is a small part of it)
BODY_TIMEOUT = 30.0  # seconds to receive a request's body once its headers are in (then a 408)
# a body at least this long has its JSON parsed and its prompts tokenized in a worker thread, not on the event
# loop: tokenizing takes ~0.75 us per character here, a 4 MB prompt 3 s of every other client's time
OFFLOAD_BYTES = 16 * 1024


class APIError(Exception):
    """A request the server answers with HTTP `status` and OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class BadRequest(APIError):
    """A request the server refuses: HTTP 400, naming the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param, 400)


class ClientGone(Exception):
    """The client went away before its request was read: nobody is left to answer (and nothing to log)."""


class RequestAborted(Exception):
    """The engine ended a request before it finished (AsyncLLM.abort, or the engine shutting down): the client
    gets an error (HTTP 503, or an error event in a stream), never a choice that looks finished."""


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, param: str | None, status: int) -> dict:
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class APIKeyMiddleware:
    """vLLM's --api-key: a request to a /v1 route without the header `Authorization: Bearer <key>` is a 401 in
    OpenAI's error body (which OpenAI's clients raise as AuthenticationError), answered before its body is read.
    Other routes (/health, /ping, /metrics, /version, /tokenize, /detokenize) stay open, as vLLM leaves them."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "a valid API key is required: send the header `Authorization: Bearer <key>`"
                # (the body is left unread: the connection must not be read on as its next request)
                headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
                await JSONResponse(error_body(message, None, 401), 401, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every response carries `X-Request-Id`, the request's own header where it
    sent one, else a fresh id (streamed responses too: the header is added as the response starts)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given if given is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def is_json_content_type(value: str | None) -> bool:
    """FastAPI's rule for a JSON body, which vLLM's routes follow: no Content-Type, application/json or
    application/*+json (a form-encoded body, curl -d's default, is refused, not read as JSON)."""
    if value is None:
        return True
    kind, _, subtype = value.split(";", 1)[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def room_left(prompt_tokens: int, config: EngineConfig) -> int:
    """The most tokens a request may generate after its prompt when it names no max_tokens (chat's default, vLLM's):
    up to max_model_len, or to what the whole KV cache holds where that is less (vLLM refuses to start with such a
    cache; nanoref serves it). A prompt with no room at all gets 1: the engine's error then names the problem."""
    context = min(config.max_model_len, config.num_kvcache_blocks * config.kvcache_block_size)
    return max(context - prompt_tokens, 1)


def check_room(prompt_tokens: int, asked_tokens: int, limit: int, where: str, param: str) -> None:
    """vLLM's server refuses a max_tokens the context cannot hold beside the prompt (its offline generate, like
    nanoref's, stops at max_model_len instead). A prompt with no room at all is the engine's error to name."""
    if 0 < limit - prompt_tokens < asked_tokens:
        raise BadRequest(
            f"{where}'max_tokens' or 'max_completion_tokens' is too large: {asked_tokens}. This model's maximum "
            f"context length is {limit} tokens and your request has {prompt_tokens} input tokens "
            f"({asked_tokens} > {limit} - {prompt_tokens})",
            param,
        )


def prompt_batch(prompt: object) -> list[str | list[int]]:
    """The request's prompt field as a list of prompts: a string, a list of token ids, or a list of those (a batch:
    OpenAI's API takes several prompts in one request)."""

    def one(value: object) -> bool:
        return isinstance(value, str) or (isinstance(value, list) and all(type(t) is int for t in value))

    if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt):
        if all(isinstance(p, (str, list)) and one(p) for p in prompt):
            return prompt
    elif one(prompt):
        return [prompt]
    raise BadRequest(
        "prompt must be a string, a list of integer token ids, or a non-empty list of those (a batch)", "prompt"
    )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen's too): vocabulary character -> the byte it stands for. Printable
    bytes stand for themselves; the others were shifted to code points 256 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, shifted = dict(zip(printable, printable)), 256
    for byte in range(256):
        if byte not in chars:
            chars[byte], shifted = shifted, shifted + 1
    return {chr(char): byte for byte, char in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenTexts:
    """A token id's text and UTF-8 bytes in logprobs: the tokenizer's decode of that one id, as vLLM reports it.

    A byte-level token can hold part of a character (an emoji's first two bytes); decoding it alone gives U+FFFD
    in its place. Such a token is written as OpenAI's API writes it, "bytes:" and its bytes escaped
    ("bytes:\\xf0\\x9f"), with its real bytes in `bytes`: the bytes of a character's tokens then concatenate to the
    character, and two half tokens never look alike (as two U+FFFD would). Cached: a vocabulary is finite."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._cache.get(token_id)
        if known is None:
            known = self._cache[token_id] = self._text(token_id)
        return known

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        raw = self._raw_bytes(token_id) if REPLACEMENT_CHAR in text else None
        if raw is None:
            return text, list(text.encode("utf-8"))
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw), list(raw)

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes a byte-level (or byte-fallback) token stands for; None for any other token."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return None
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if all(char in _BYTE_LEVEL for char in piece):
            return bytes(_BYTE_LEVEL[char] for char in piece)
        return None


def _logprob(value: float) -> float | None:
    """OpenAI's floor for "very unlikely" under -inf, which is no JSON; NaN (logits that overflowed) is null, as
    vLLM's pydantic responses write it."""
    return max(value, -9999.0) if value == value else None


def token_name(token_id: int, text: str, as_id: bool) -> str:
    """A token as logprobs spell it: its text, or (vLLM's return_tokens_as_token_ids) "token_id:N", which names
    every token apart, those whose text is no valid UTF-8 alone too."""
    return f"token_id:{token_id}" if as_id else text


def chat_logprob(token_text: TokenTexts, entry: TokenLogprobs, as_ids: bool = False) -> dict:
    """One token in chat's format: its text, logprob, bytes and the top-N alternatives, most likely first. as_ids:
    each token spelled "token_id:N" (its bytes still the token's own)."""
    text, raw = token_text(entry.token_id)
    top = []
    for token_id, logprob in entry.top.items():
        top_text, top_raw = token_text(token_id)
        top.append({"token": token_name(token_id, top_text, as_ids), "logprob": _logprob(logprob), "bytes": top_raw})
    token = token_name(entry.token_id, text, as_ids)
    return {"token": token, "logprob": _logprob(entry.logprob), "bytes": raw, "top_logprobs": top}


def completion_logprobs(
    token_text: TokenTexts, entries: list[TokenLogprobs | int], choice: Choice, as_ids: bool = False
) -> dict:
    """Tokens in completions' format (top_logprobs: the chosen token first, then the top N, as OpenAI's and vLLM's);
    an entry that is a bare token id is a token without a score (an echoed prompt's first: null logprob and
    top_logprobs). text_offset: where in the choice's text each token starts,
    counted on its bytes: a character belongs to the token that holds its last byte (a token that ends half-way
    through a character has it start with the next one), and the U+FFFD that stands for bytes no later byte
    completes belongs to the token that holds those bytes; a prompt token whose text the choice's text leaves out
    (`Choice.num_hidden`) starts where the text does. as_ids: tokens (and top_logprobs' keys) spelled "token_id:N"."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:
        scored = isinstance(entry, TokenLogprobs)
        token_id = entry.token_id if scored else entry
        text, raw = token_text(token_id)
        tokens.append(token_name(token_id, text, as_ids))
        if scored:
            values.append(_logprob(entry.logprob))
            # OpenAI's completions (and vLLM's): the chosen token first, then the top N: up to N + 1 entries
            chosen_and_top = {token_id: entry.logprob, **entry.top}
            top = {token_name(i, token_text(i)[0], as_ids): _logprob(value) for i, value in chosen_and_top.items()}
            tops.append(top)
        else:
            values.append(None)
            tops.append(None)
        if choice.num_hidden:
            choice.num_hidden -= 1
            offsets.append(choice.num_chars)
            continue
        pending, _ = choice.decoder.getstate()
        piece = choice.decoder.decode(bytes(raw))
        if pending and raw and _breaks(pending, raw[0]):  # the earlier token's U+FFFD comes out now: its own
            choice.num_chars += 1
            piece = piece[1:]
        offsets.append(choice.num_chars)
        choice.num_chars += len(piece)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echoed_prompt(token_ids: list[int], scores: list[TokenLogprobs | None] | None, num_top: int) -> list:
    """An echoed prompt's entries for `completion_logprobs`: each token's score (its top cut to the request's
    logprobs count), or the bare token id where it has none (the first token)."""
    scores = scores or [None] * len(token_ids)  # (none: the request ended before its prompt was computed)
    return [
        token_id if entry is None else entry._replace(top=dict(islice(entry.top.items(), num_top)))
        for token_id, entry in zip(token_ids, scores)
    ]


def vllm_prompt_logprobs(token_text: TokenTexts, scores: list[TokenLogprobs | None]) -> list[dict | None]:
    """A request's prompt logprobs as vLLM's `prompt_logprobs` field gives them: per prompt token None (the first),
    or {token id: {"logprob", "rank", "decoded_token"}} for the token itself, then the top N at its position
    (ranked 1, 2, ...)."""

    def one(token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
        return str(token_id), {"logprob": _logprob(logprob), "rank": rank, "decoded_token": token_text(token_id)[0]}

    result: list[dict | None] = []
    for entry in scores:
        if entry is None:
            result.append(None)
            continue
        position = dict([one(entry.token_id, entry.logprob, entry.rank)])
        for rank, (token_id, logprob) in enumerate(entry.top.items(), start=1):
            position.setdefault(*one(token_id, logprob, rank))
        result.append(position)
    return result


@dataclass(frozen=True)
class Echo:
    """A completions request's echo: each prompt's text (its choices' texts start with it) and whether anything is
    generated after it (max_tokens 0: no). shown: False with return_token_ids, where the texts are "" (vLLM's: the
    client has the prompt's ids), and the logprobs still list the prompt's tokens."""

    texts: list[str]
    generate: bool = True
    shown: bool = True


def refuse_streamed_prompt_logprobs(body: dict, more: str = "") -> None:
    """vLLM's 400 for prompt_logprobs asked for in a stream (0, which asks for none beside the prompt's own tokens,
    is taken, as vLLM takes it)."""
    if body.get("prompt_logprobs") not in (None, 0) and body.get("stream"):
        raise BadRequest(f"prompt_logprobs are not available with stream: true (as in vLLM){more}", "prompt_logprobs")


def echo_fields(body: dict) -> tuple[dict, bool, bool]:
    """Completions' echo, max_tokens 0 and prompt_logprobs, as vLLM takes them -> (the body to read the sampling
    fields from, echo, whether to generate). max_tokens 0 is legal with echo only (the engine then samples one token,
    which is not returned); echo with logprobs scores the prompt with as many alternatives (prompt_logprobs, unless
    the request names its own)."""
    echo, max_tokens = body.get("echo"), body.get("max_tokens")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, got {echo!r}", "echo")
    body, generate = dict(body), True
    if type(max_tokens) is int and max_tokens == 0:
        if not echo:
            raise BadRequest("max_tokens 0 generates nothing: it is allowed only with echo: true", "max_tokens")
        body["max_tokens"], generate = 1, False
    refuse_streamed_prompt_logprobs(body, "; echo with logprobs streams the prompt's tokens with theirs")
    if echo and body.get("logprobs") is not None and body.get("prompt_logprobs") is None:
        body["prompt_logprobs"] = body["logprobs"]
    return body, bool(echo), generate


def _breaks(pending: bytes, byte: int) -> bool:
    """Whether `byte` cannot continue the incomplete UTF-8 character `pending` (then `pending` decodes to U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    decoder.setstate((pending, 0))
    try:
        decoder.decode(bytes([byte]))
    except UnicodeDecodeError:
        return True
    return False


@dataclass
class Choice:
    """One choice of a response as it is built from its sample's outputs."""

    index: int
    text: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of its prompt, served from the prefix cache (known once it finished)
    num_tokens: int = 0
    num_logprobs: int | None = None  # the request's logprobs count (None: none asked for)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # not sent yet
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_chars: int = 0  # text_offset of the next token
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    echo: str | None = None  # completions' echo: the prompt's text, which the choice's text starts with
    generate: bool = True  # False: max_tokens 0 with echo, the prompt is all the choice holds
    echo_shown: bool = True  # False: echo's prompt tokens are in the logprobs but not in the text (Echo.shown)
    num_hidden: int = 0  # logprobs entries still to send whose text the choice's text leaves out
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # its request's, where asked
    prompt_token_ids: list[int] | None = None  # its prompt's (after any truncate_prompt_tokens)
    token_ids: list[int] = field(default_factory=list)  # the tokens its text holds (return_token_ids)
    unsent_token_ids: list[int] = field(default_factory=list)  # those a stream has not sent yet
    prompt_ids_sent: bool = False  # a stream sent its prompt's ids (with its first chunk)

    def take(self, out: RequestOutput, prompt_logprobs: list[TokenLogprobs | None] | None = None) -> str:
        """Book an output of the choice's sample -> the text it adds to the choice (an echo's first output's starts
        with the prompt's). prompt_logprobs: its request's (they come with sample 0's first output)."""
        first = self.num_prompt_tokens == 0
        self.num_prompt_tokens = out.num_prompt_tokens
        if out.metrics is not None:
            self.num_cached_tokens = out.metrics.num_cached_tokens
        self.prompt_token_ids = out.prompt_token_ids
        self.prompt_logprobs = self.prompt_logprobs or prompt_logprobs
        if first and self.echo is not None and self.num_logprobs is not None:
            self.logprobs.extend(echoed_prompt(out.prompt_token_ids, self.prompt_logprobs, self.num_logprobs))
            self.num_hidden = 0 if self.echo_shown else len(out.prompt_token_ids)
        text = out.text if self.generate else ""
        self.text = (self.echo or "") + (out.cumulative_text if self.generate else "")
        self.num_tokens = len(out.cumulative_token_ids) if self.generate else 0
        if self.generate:
            self.logprobs.extend(out.logprobs)
            self.token_ids = out.cumulative_token_ids
            self.unsent_token_ids.extend(out.token_ids)
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return (self.echo or "") + text if first else text


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come -> (which stream, output). Closing this closes every stream
    (each aborts its request); a stream that raises ends the merge with its error."""
    if len(streams) == 1:  # one prompt, the usual request: read it directly (no task and queue per output)
        async with aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as error:
            queue.put_nowait((i, error))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # (a stream that is done ignores it; the others close, which aborts their requests)
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_done_or_disconnected(request: Request, work: Coroutine, poll: float = 0.25) -> bool:
    """Run `work` while checking every `poll` seconds that the client is still connected -> True when it ended;
    False when the client went away first (then `work` is cancelled, which aborts its requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                task.result()  # (raises what it raised)
                return True
            if await request.is_disconnected():
                return False
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task


def check_fields(body: dict, honoured: set[str], not_supported: dict[str, tuple]) -> None:
    """Refuse, with a 400 naming it, a field the endpoint neither honours nor accepts unused, and a field it does
    not support with any value but null or its default."""
    for name, value in body.items():
        if name in honoured:
            continue
        if name in ACCEPTED_UNUSED:  # (unused, but a client that sends a number has a bug to hear of: vLLM's 400)
            if value is not None and not isinstance(value, str):
                raise BadRequest(f"{name} must be a string, got {value!r:.40}", name)
            continue
        if name not in not_supported:
            raise BadRequest(f"unknown field {name!r:.60}: this server does not know it (a typo?)", name[:60])
        if value is None or any(type(value) is type(default) and value == default for default in not_supported[name]):
            continue
        allowed = "".join(f" or {default!r}" for default in not_supported[name])
        message = REFUSALS.get(name, f"{name} is not supported by this server (only null{allowed})")
        raise BadRequest(message, name)


# a lone surrogate reaches json.loads as JSON's escape (\ud800) or as its UTF-8 bytes (decoded with surrogatepass):
# a body with neither (most: emoji come as pairs of escapes, which match, or as 4-byte UTF-8, which does not) is
# not walked
MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse_json(raw: bytes) -> tuple[Any, tuple[str, str] | None]:
    """A request body's JSON -> (its value, where it holds a lone UTF-16 surrogate: `lone_surrogate_at`)."""
    value = json.loads(raw)
    if MAYBE_SURROGATE.search(raw):
        try:  # (in C: a body of valid escaped pairs, emoji say, is not walked in Python)
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return value, lone_surrogate_at(value)
    return value, None


def lone_surrogate_at(body: Any) -> tuple[str, str] | None:
    """Where a JSON value holds a lone UTF-16 surrogate (in a string or a key), which JSON can spell ("\\ud800") and
    no text holds -> (its path, e.g. "messages[0].content", at most 80 characters, the surrogate as \\uXXXX), or
    None. Iterative (a body nested as deep as JSON parses cannot exhaust the stack here); a container's path is
    made only once something in it is found (links to its parent until then)."""
    if not isinstance(body, (dict, list)):
        bad = lone_surrogate(body) if isinstance(body, str) else None
        return None if bad is None else ("", bad)
    links: list[tuple[int, str | int]] = [(-1, "")]  # a walked container's (parent's link, its key there)
    stack: list[tuple[Any, int]] = [(body, 0)]
    while stack:
        value, link = stack.pop()
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and (bad := lone_surrogate(key)) is not None:
                return ascii(json_path(links, link, key))[1:-1][:80], bad
            if isinstance(item, str):
                if (bad := lone_surrogate(item)) is not None:
                    return json_path(links, link, key)[:80], bad
            elif item and isinstance(item, (dict, list)):
                links.append((link, key))
                stack.append((item, len(links) - 1))
    return None


def json_path(links: list[tuple[int, str | int]], link: int, key: str | int) -> str:
    """The path of the item `key` of the container at `link` (`lone_surrogate_at`): `messages[0].content`."""
    keys = [key]
    while link > 0:
        link, parent_key = links[link]
        keys.append(parent_key)
    path = ""
    for step in reversed(keys):
        path = f"{path}[{step}]" if isinstance(step, int) else f"{path}.{step}" if path else step
    return path


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


def token_bias(body: dict) -> dict:
    """logit_bias as SamplingParams takes it: JSON's object keys are strings ("50256"), the ids are integers; each
    bias a number clamped to OpenAI's [-100, 100], as vLLM's server clamps it (SamplingParams itself takes any)."""
    bias = body.get("logit_bias")
    if not isinstance(bias, dict):
        return body
    converted = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias: keys must be token ids (integers), got {key!r:.40}", "logit_bias") from None
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        converted[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value)) if is_number else value
    return {**body, "logit_bias": converted}


def check_json_schema_format(json_schema: dict) -> None:
    """OpenAI's `response_format.json_schema` object: a `name` (a string), the `schema`, and `description` (a string)
    and `strict` (a boolean) or neither; anything else is a 400 naming it rather than ignored."""
    unknown = sorted(set(json_schema) - {"name", "description", "schema", "strict"})
    if unknown:
        taken = "name, description, schema, strict"
        message = f"response_format.json_schema: unknown field {unknown[0]!r:.60} (it takes {taken})"
        raise BadRequest(message, "response_format")
    if not isinstance(json_schema.get("name"), str) or not json_schema["name"]:
        got = json_schema.get("name")
        raise BadRequest(
            f"response_format.json_schema.name must be a non-empty string, got {got!r:.60}", "response_format"
        )
    for name, kind, described in (("description", str, "a string"), ("strict", bool, "a boolean")):
        value = json_schema.get(name)
        if value is not None and not isinstance(value, kind):
            message = f"response_format.json_schema.{name} must be {described} or null, got {value!r:.60}"
            raise BadRequest(message, "response_format")


# vLLM's structured_outputs options that change nothing at these values (what its own StructuredOutputsParams holds
# by default, and sends when a client serializes one whole): taken; another value is refused as an unknown field
VLLM_IDLE_OPTIONS = {"disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """What the request's output must follow: vLLM's `structured_outputs` ({"json": schema} or regex, choice,
    grammar, json_object), or OpenAI's `response_format` ({"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}; {"type": "text"} is free text). Whether the grammar library
    takes the schema is the engine's check, when the request is made."""
    given, response_format = body.get("structured_outputs"), body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        if given is not None:
            raise BadRequest("send response_format or structured_outputs, not both", "structured_outputs")
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        schema = response_format.get("json_schema") if kind == "json_schema" else None
        if kind == "json_object":
            given = {"json_object": True}
        elif isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
            check_json_schema_format(schema)
            given = {"json": schema["schema"]}
        elif kind == "json_schema":
            message = 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}'
            raise BadRequest(message, "response_format")
        else:
            message = (
                f"response_format's type must be 'text', 'json_object' or 'json_schema', got {response_format!r:.80}"
            )
            raise BadRequest(message, "response_format")
    if given is None:
        return None
    if not isinstance(given, dict):
        raise BadRequest(f"structured_outputs must be an object, got {given!r:.80}", "structured_outputs")
    idle = {name: value for name, value in VLLM_IDLE_OPTIONS.items() if name in given and given[name] == value}
    given = {name: value for name, value in given.items() if name not in idle}
    known = {f.name for f in fields(StructuredOutputsParams)}
    unknown = sorted(set(given) - known)
    if unknown:
        message = f"structured_outputs: unknown field {unknown[0]!r:.60} (this server takes {', '.join(sorted(known))})"
        raise BadRequest(message, "structured_outputs")
    try:
        return StructuredOutputsParams(**given)
    except (ValueError, TypeError) as error:
        raise BadRequest(str(error), "response_format" if response_format else "structured_outputs") from None


def sampling_params(body: dict, mapping: dict[str, str], defaults: dict | None = None) -> SamplingParams:
    """The request's sampling fields as SamplingParams (and its `structured_outputs`); a missing or null field keeps
    `defaults`' value, else SamplingParams' default."""
    known = {f.name for f in fields(SamplingParams)}
    values: dict[str, Any] = dict(defaults or {})
    constraint = structured_outputs(body)
    if constraint is not None:
        values["structured_outputs"] = constraint
    body = token_bias(body)
    for name, target in mapping.items():
        if body.get(name) is None:
            continue
        if target not in known:
            raise BadRequest(f"{name!r} is not supported by this server's SamplingParams", name)
        try:  # each field alone first, so that the error names the request's own field (beside no max_tokens
            # limit: min_tokens is checked against the request's max_tokens below, not SamplingParams' default)
            SamplingParams(**{"max_tokens": None, target: body[name]})
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error) if name == target else f"{name}: {error}", name) from None
        values[target] = body[name]
        check_limit(name, target, body[name])
    try:  # then together: checks across fields (e.g. min_tokens above max_tokens): the error names the field
        return SamplingParams(**values)
    except (ValueError, TypeError) as error:
        named = [name for name, target in mapping.items() if str(error).startswith(target) and name in body]
        raise BadRequest(str(error), named[0] if named else None) from None


def check_limit(name: str, target: str, value: Any) -> None:
    """The server's limits on a field SamplingParams accepted (see MAX_N and MAX_STOP_STRINGS)."""
    if target == "n" and value > MAX_N:
        raise BadRequest(f"n must be at most {MAX_N} (completions per prompt), got {value}", name)
    if target == "stop":
        stops = stop_strings(value)
        if len(stops) > MAX_STOP_STRINGS:
            raise BadRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", name)
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise BadRequest(
                f"a stop string has at most {MAX_STOP_STRING_CHARS} characters, got one of {len(longest)}", name
            )


def chat_sampling_params(body: dict, defaults: dict) -> SamplingParams:
    """Chat's logprobs is a switch and top_logprobs the count (vLLM: logprobs=top_logprobs if logprobs); an error
    in the count names top_logprobs. With no max_tokens / max_completion_tokens a reply may fill the room the
    context leaves after the prompt (vLLM's chat default; completions default to 16). defaults: the model's
    (`request_defaults`)."""
    body = dict(body)
    refuse_streamed_prompt_logprobs(body)
    logprobs, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    if top is not None and top != 0 and not logprobs:  # (0 asks for nothing: vLLM takes it without logprobs)
        raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")  # (vLLM's)
    if logprobs:
        body["top_logprobs"] = 0 if top is None else top
        return sampling_params(body, {**CHAT_FIELDS, "top_logprobs": "logprobs"}, {**defaults, **CHAT_DEFAULTS})
    return sampling_params(body, CHAT_FIELDS, {**defaults, **CHAT_DEFAULTS})


def request_defaults(generation: GenerationDefaults) -> dict[str, Any]:
    """The values of the sampling fields a request leaves out, where the model's generation config sets them
    (vLLM's `default_sampling_params`: temperature, top_p, top_k, min_p, repetition_penalty); max_tokens is each
    endpoint's own (completions 16; chat the room left, or the config's max_new_tokens where that is less)."""
    return {name: value for name, value in generation.sampling.items() if name != "max_tokens"}


def capped(params: SamplingParams, cap: int | None) -> tuple[SamplingParams, BadRequest | None]:
    """params with max_tokens cut to the generation config's cap (vLLM's override_max_tokens: the max_new_tokens of
    --override-generation-config, or of a --generation-config folder), whatever the request asked for -> (params,
    None), or (params uncut, the error) where min_tokens is above the cap: raised once the asked max_tokens has been
    checked against the room the prompt leaves (vLLM checks that first)."""
    if cap is None or params.max_tokens <= cap:
        return params, None
    try:
        return replace(params, max_tokens=cap), None
    except ValueError as error:  # (a min_tokens above the cap)
        return params, BadRequest(f"{error} (the server's max_tokens cap is {cap})", "min_tokens")


def tool_constraint(
    body: dict, params: SamplingParams, tools: ToolChoice | None, blamed: dict[str, str]
) -> tuple[SamplingParams, dict[str, str]]:
    """tool_choice "required" or a named function: the grammar that makes the call becomes the request's
    structured_outputs (as in vLLM), and the engine's refusal of its schema is blamed on `tools` -> (the params, the
    blamed fields). A request that constrains its output itself too is refused with vLLM's words."""
    try:
        constraint = tools.constraint() if tools else None
    except ToolRequestError as error:  # (two tools' $defs that disagree)
        raise BadRequest(str(error), error.param) from None
    if constraint is None:
        return params, blamed
    if params.structured_outputs is not None:
        message = (
            "You can only either use constraints for structured outputs or tools, not both: tool_choice "
            f"{body['tool_choice']!r:.60} constrains the output itself (drop response_format / structured_outputs)"
        )
        raise BadRequest(message, "tool_choice")
    return replace(params, structured_outputs=constraint), {**blamed, "structured_outputs": "tools"}


class EngineCollector:
    """Gauges and counters read from the engine at scrape time (a prometheus_client custom collector)."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.stats()
        yield from self.collect_vllm(stats)
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
        # speculative decoding (all 0 without it); rate = accepted / draft, mean accepted length = accepted / rows
        spec = {
            "nanoref_spec_decode_num_draft_tokens": ("Tokens proposed", stats.spec_draft_tokens),
            "nanoref_spec_decode_num_accepted_tokens": ("Of them, accepted by the target", stats.spec_accepted_tokens),
            "nanoref_spec_decode_num_verified_rows": ("Sequences' rows in verify steps", stats.spec_verified_rows),
        }
        for name, (doc, value) in spec.items():
            yield CounterMetricFamily(name, doc, value=value)
        drafted, rows = stats.spec_draft_tokens, stats.spec_verified_rows
        yield GaugeMetricFamily(
            "nanoref_spec_decode_acceptance_rate",
            "Share of proposed tokens accepted",
            value=stats.spec_accepted_tokens / drafted if drafted else 0.0,
        )
        yield GaugeMetricFamily(
            "nanoref_spec_decode_mean_accepted_length",
            "Proposed tokens accepted per sequence and verify step",
            value=stats.spec_accepted_tokens / rows if rows else 0.0,
        )

    def collect_vllm(self, stats):
        """The same numbers under vLLM's names, labelled with the model's name as vLLM's are, so that a dashboard
        made for vLLM reads them (vllm:kv_cache_usage_perc is a fraction in [0, 1], as vLLM's)."""
        label = [self.model_name]

        def family(kind, name: str, doc: str, value: float):
            metric = kind(name, doc, labels=["model_name"])
            metric.add_metric(label, value)
            return metric

        used = stats.num_kv_blocks_used / stats.num_kv_blocks if stats.num_kv_blocks else 0.0
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch", stats.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests queued for prefill", stats.num_waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Share of KV blocks held by requests", used)
        counters = {
            "vllm:prefix_cache_queries": ("Prompt tokens of finished requests", stats.prefix_cache_queried_tokens),
            "vllm:prefix_cache_hits": ("Of them, tokens found in the prefix cache", stats.prefix_cache_hit_tokens),
            "vllm:spec_decode_num_draft_tokens": ("Tokens proposed", stats.spec_draft_tokens),
            "vllm:spec_decode_num_accepted_tokens": ("Of them, accepted", stats.spec_accepted_tokens),
            "vllm:spec_decode_num_drafts": ("Sequences' rows in verify steps", stats.spec_verified_rows),
        }
        for name, (doc, value) in counters.items():
            yield family(CounterMetricFamily, name, doc, value)


FINISH_REASONS = ("stop", "length", "abort")  # a request's, each counted from 0 (Prometheus' advice, vLLM's way)


class ServerMetrics:
    """The server's own registry (never prometheus_client's global one: two servers in a process stay apart).
    Each number is exported under nanoref's name and under vLLM's (`vllm:...`, with a model_name label)."""

    def __init__(self, engine: AsyncLLM, model_name: str = "nanoref") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.ttft = Histogram(
            "nanoref_time_to_first_token_seconds", "Time to first token", buckets=buckets, registry=self.registry
        )
        self.tpot = Histogram(
            "nanoref_time_per_output_token_seconds", "Time per output token", buckets=buckets, registry=self.registry
        )
        self.requests = Counter("nanoref_requests", "Finished requests", ["finish_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self.prompt_tokens = Counter("nanoref_prompt_tokens", "Prompt tokens received", registry=self.registry)
        self.generation_tokens = Counter("nanoref_generation_tokens", "Tokens generated", registry=self.registry)
        self.acceptance = Histogram(
            "nanoref_spec_decode_request_acceptance_rate",
            "Per finished request with speculative decoding: the share of its proposed tokens accepted",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=self.registry,
        )
        self.vllm = VllmMetrics(self.registry, model_name, engine.config.max_model_len)

    def observe(self, out: RequestOutput, first: bool) -> None:
        """Count one output as it passes to a client (an aborted request's tokens count too)."""
        if first:
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.vllm.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(len(out.token_ids))
        self.vllm.generation_tokens.inc(len(out.token_ids))
        if out.finished:
            self.requests.labels(finish_reason=out.finish_reason).inc()
            self.vllm.finished(out.finish_reason)
        if out.metrics is not None:
            self.ttft.observe(out.metrics.ttft)
            if out.metrics.tpot is not None:
                self.tpot.observe(out.metrics.tpot)
            if out.metrics.acceptance_rate is not None:
                self.acceptance.observe(out.metrics.acceptance_rate)
            self.vllm.observe(out.metrics)

    def count_aborted(self, count: int) -> None:
        """Samples that ended without their last output (their client left, the request failed)."""
        self.requests.labels(finish_reason="abort").inc(count)
        self.vllm.finished("abort", count)


# vLLM's histogram buckets for its metrics (vllm/v1/metrics/loggers.py): a dashboard's quantiles and heatmaps made
# for vLLM read the same bounds (a 2-minute request is not one beyond the last bucket, read as its bound)
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for a request's token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(bounds)
            bounds.append(step * scale)
        scale *= 10


class VllmMetrics:
    """The per-request numbers under vLLM's metric names (vllm:prompt_tokens_total, ...), labelled model_name, in
    vLLM's histogram buckets."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        label = ["model_name"]

        def histogram(name: str, doc: str, bucket_list: tuple[float, ...]):
            return Histogram(name, doc, label, buckets=bucket_list, registry=registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, label, registry=registry).labels(model_name)

        token_buckets = token_count_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.preemptions = counter("vllm:num_preemptions", "Times a request's K/V was dropped and recomputed")
        self.success = Counter(
            "vllm:request_success", "Finished requests", ["model_name", "finished_reason"], registry=registry
        )
        for reason in FINISH_REASONS:  # (at 0 from the start, as vLLM's: a rate counts a series' first increment)
            self.success.labels(model_name=model_name, finished_reason=reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", VLLM_TTFT_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from arrival to the last token", VLLM_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Mean time per output token", VLLM_TPOT_BUCKETS
        )
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", token_buckets
        )

    def finished(self, reason: str | None, count: int = 1) -> None:
        self.success.labels(model_name=self.model_name, finished_reason=reason).inc(count)

    def observe(self, metrics) -> None:
        """A served request's RequestMetrics."""
        self.ttft.observe(metrics.ttft)
        self.e2e.observe(metrics.latency)
        if metrics.tpot is not None:
            self.tpot.observe(metrics.tpot)
        self.request_prompt.observe(metrics.num_prompt_tokens)
        self.request_generation.observe(metrics.num_output_tokens)
        self.preemptions.inc(metrics.num_preemptions)


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


def build_app(
    engine: AsyncLLM,
    served_model_name: str | list[str],
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT,
    lora_modules: LoRAModules | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
    api_key: str | None = None,
    chat_template: str | None = None,
    enable_request_id_headers: bool = False,
    enable_prompt_tokens_details: bool = False,
    enable_force_include_usage: bool = False,
    allowed_origins: list[str] = ("*",),
    allow_credentials: bool = False,
    allowed_methods: list[str] = ("*",),
    allowed_headers: list[str] = ("*",),
) -> FastAPI:
    """The FastAPI app serving `engine` as the model `served_model_name` (the app does not close the engine); a
    list of names serves it under each, responses naming the first (vLLM's --served-model-name).
    max_body_bytes: a longer request body is a 413; body_timeout: seconds a request's body may take to arrive
    (then a 408); lora_modules: the LoRA adapters a request's `model` may name (lora_modules.py). Tool calls
    (tool_calls.py), vLLM's settings: enable_auto_tool_choice lets the model choose ("auto") and needs
    tool_call_parser ("hermes"); exclude_tools_when_tool_choice_none leaves the tools out of a "none" request's prompt.
    api_key: the /v1 routes answer 401 to a request without `Authorization: Bearer <api_key>` (APIKeyMiddleware).
    chat_template: a Jinja template's text that renders chat messages in place of the model folder's (vLLM's
    --chat-template); enable_request_id_headers: every response carries X-Request-Id (RequestIdHeaderMiddleware);
    enable_prompt_tokens_details: usage gains vLLM's prompt_tokens_details.cached_tokens (the prompt tokens the
    prefix cache served), where there were any; enable_force_include_usage: every stream's chunks carry their usage
    so far and it ends with a usage chunk, as `stream_options: {"include_usage": true, "continuous_usage_stats": true}`
    asks (vLLM's --enable-force-include-usage).
    allowed_origins, allow_credentials, allowed_methods, allowed_headers: CORS, vLLM's settings and defaults (a page
    of any origin may call the server from a browser, as vLLM's allows). ValueError naming a bad setting."""
    check_tool_settings(enable_auto_tool_choice, tool_call_parser)
    if chat_template is not None:
        check_chat_template(chat_template)
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError(f"api_key must be a non-empty string or None, got {api_key!r}")
    app = FastAPI(title="nanoref")
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    cors = {"allowed_origins": allowed_origins, "allowed_methods": allowed_methods, "allowed_headers": allowed_headers}
    for name, values in cors.items():
        if isinstance(values, str) or not all(isinstance(value, str) for value in values):
            raise ValueError(f"{name} must be a list of strings, got {values!r}")
    if not isinstance(allow_credentials, bool):
        raise ValueError(f"allow_credentials must be True or False, got {allow_credentials!r}")
    # outermost: a browser can read the API key check's 401 too (a preflight, unasked for a key, passes that check)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(allowed_origins),
        allow_credentials=allow_credentials,
        allow_methods=list(allowed_methods),
        allow_headers=list(allowed_headers),
    )
    names = served_model_names(served_model_name)
    if lora_modules is not None and lora_modules.names != names:
        raise ValueError(f"lora_modules serves the base model as {lora_modules.names!r}, the app as {names!r}")
    check_serves_text(engine.config)  # (after the settings' own checks)
    app.state.engine = engine
    app.state.metrics = metrics = ServerMetrics(engine, names[0])
    adapters = lora_modules or LoRAModules(engine.config, names)
    tokenizer, folder = engine.tokenizer, engine.config.model_folder
    generation = engine.config.generation_defaults  # the model's sampling defaults (models/generation_config.py)
    model_defaults, max_tokens_cap = request_defaults(generation), generation.max_tokens_cap

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        # a body left unread (too large, too slow) must not be read as the connection's next request
        headers = {"Connection": "close"} if error.status in (408, 413) else None
        return JSONResponse(error_body(error.message, error.param, error.status), error.status, headers=headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, error: ClientGone) -> Response:
        return Response(status_code=499)  # (nginx's "client closed request": nobody reads it)

    @app.exception_handler(RequestAborted)
    async def aborted(_: Request, error: RequestAborted) -> JSONResponse:
        return JSONResponse(error_body(str(error), None, 503), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (an unknown path, a wrong method) in OpenAI's error body, not {"detail": ...}."""
        where = f"{request.method} {request.url.path}"
        allowed = (error.headers or {}).get("Allow")
        if error.status_code == 404:
            message = f"{where}: no such endpoint"
        elif error.status_code == 405 and allowed:
            message = f"{where}: method not allowed (this endpoint takes {allowed})"
        else:
            message = f"{where}: {error.detail}"
        return JSONResponse(error_body(message, None, error.status_code), error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{type(error).__name__}: {error}", None, 500), status_code=500)

    async def receive_body(request: Request) -> bytes:
        """The request's body, up to max_body_bytes (a longer one is a 413 as soon as that is known)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise APIError(f"the request body of {length} bytes is over the limit of {max_body_bytes}", status=413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise APIError(f"the request body is over the limit of {max_body_bytes} bytes", status=413)
                chunks.append(chunk)
        except ClientDisconnect:  # (a client that resets its connection while sending: an error of nobody's)
            raise ClientGone from None
        return b"".join(chunks)

    async def read_body(request: Request, types: dict | None = None) -> tuple[dict, bool]:
        """The request's JSON object -> (it, whether it is long enough to be worked on off the event loop); types:
        the endpoint's typed fields, read as vLLM's (pydantic's lax mode: `lax_body`)."""
        try:  # a client that announces more than it sends would hold the connection (and its memory) forever
            raw = await asyncio.wait_for(receive_body(request), body_timeout)
        except TimeoutError:
            raise APIError(f"the request body did not arrive within {body_timeout:g} s", status=408) from None
        heavy = len(raw) >= OFFLOAD_BYTES
        content_type = request.headers.get("content-type")
        if not is_json_content_type(content_type):  # (read, as FastAPI does, before it is refused)
            raise BadRequest(
                f"the request body must be JSON, sent with Content-Type: application/json; got {content_type!r:.80}"
            )
        try:
            body, surrogate = await asyncio.to_thread(parse_json, raw) if heavy else parse_json(raw)
        # (a number of over 4,300 digits is a ValueError; an array nested a few thousand deep, a RecursionError)
        except (ValueError, RecursionError) as error:
            raise BadRequest(f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
        if surrogate is not None:  # (refused before any field is read: no tokenizer, and no reply, can encode it)
            path, bad = surrogate
            param = re.match(r"[^.\[]*", path).group()
            raise BadRequest(f"{path} holds a lone UTF-16 surrogate ({bad}): it is not text", param)
        if types is not None:
            body = lax_body(body, types)
        if adapters.resolve(body.get("model")) is False:  # (a 404, as vLLM's)
            known = ", ".join(map(repr, [*names, *adapters.adapters]))
            raise APIError(f"the model {body['model']!r} does not exist; this server serves {known}", "model", 404)
        for name in ("stream", "stream_options"):
            expected = bool if name == "stream" else dict
            if body.get(name) is not None and not isinstance(body[name], expected):
                raise BadRequest(f"{name} must be {'true or false' if expected is bool else 'an object'}", name)
        options = body.get("stream_options") or {}
        include_usage = options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise BadRequest(
                f"stream_options.include_usage must be true or false, got {include_usage!r}", "stream_options"
            )
        # an option the server would not act on is refused, as a body field is (check_fields)
        unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            taken = "include_usage and continuous_usage_stats"
            raise BadRequest(
                f"stream_options: unknown field {unknown[0]!r:.60} (this server takes {taken})", "stream_options"
            )
        every_chunk = options.get("continuous_usage_stats")  # (vLLM's usage in every chunk)
        if every_chunk is not None and not isinstance(every_chunk, bool):
            message = f"stream_options.continuous_usage_stats must be true or false, got {every_chunk!r:.60}"
            raise BadRequest(message, "stream_options")
        if every_chunk and not enable_force_include_usage and options.get("include_usage", True) is not True:
            message = "stream_options.continuous_usage_stats needs include_usage (usage in every chunk is usage too)"
            raise BadRequest(message, "stream_options")  # (vLLM ignores it then; --enable-force-include-usage not)
        if options and not body.get("stream"):  # (vLLM's rule; an empty object is no option)
            raise BadRequest("stream_options can only be defined when stream is true (as in vLLM)", "stream_options")
        return body, heavy

    token_text = TokenTexts(tokenizer)

    def engine_stopped(why: object = None) -> APIError:
        """What a request gets once the engine is gone (as /health says): a 503, not a 500 and a traceback."""
        return APIError("the engine has stopped" + (f" ({why})" if why else "") + "; restart the server", status=503)

    def start(
        prompt: str | list[int],
        params: SamplingParams,
        blamed: dict[str, str],
        request_id: str,
        where: str = "",
        model: str | None = None,
        asked_tokens: int | None = None,
        cache_salt: str | None = None,
        cap_error: BadRequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate, its errors as the request's: `blamed` maps a word of the engine's message to the request
        field it names (its last entry, "": the field of the prompt); model: the request's (an adapter's name, or
        the base model's); asked_tokens: the max_tokens the client set (None: the server's default, which the
        context may cut short); cache_salt: the request's (checked: `request_cache_salt`), which the prefix cache
        keeps its K/V apart by; cap_error: `capped`'s, raised after the room check."""
        if not engine.is_running:
            raise engine_stopped()
        try:  # the engine's checks of the prompt (empty, too long, outside the vocabulary) and of the KV budget
            if asked_tokens is not None or params.max_tokens == MAX_TOKENS_LIMIT:  # (counted here, tokenized once)
                config = engine.config
                prompt = truncate_prompt(prompt_token_ids(prompt, engine.tokenizer, config), params, config)
            if asked_tokens is not None:  # (the ids go on to the engine)
                check_room(len(prompt), asked_tokens, engine.config.max_model_len, where, blamed["max_tokens"])
            if cap_error is not None:  # (a min_tokens above the cap: once the asked max_tokens is known to fit)
                raise cap_error
            if asked_tokens is None and params.max_tokens == MAX_TOKENS_LIMIT:  # chat's default: the room left,
                room = room_left(len(prompt), engine.config)  # in a cache that may be smaller (or the model's
                params = replace(params, max_tokens=min(room, generation.sampling.get("max_tokens", room)))  # cap)
            if cache_salt is not None:  # (vLLM's prompt dicts)
                prompt = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "cache_salt": cache_salt}
            return engine.generate(prompt, params, request_id, adapters.lora_request(model))
        except (ValueError, TypeError) as error:
            param = next(name for word, name in blamed.items() if word in str(error))
            raise BadRequest(where + str(error), param) from None
        except RuntimeError as error:
            if engine.is_running:
                raise
            raise engine_stopped(error) from None

    def blamed_fields(body: dict, prompt_field: str) -> dict[str, str]:
        tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        constraint = "structured_outputs" if body.get("structured_outputs") is not None else "response_format"
        return {
            "min_tokens": "min_tokens",  # (before max_tokens, which its message names too)
            "logit_bias": "logit_bias",
            "stop_token_ids": "stop_token_ids",
            "allowed_token_ids": "allowed_token_ids",
            "truncate_prompt_tokens": "truncate_prompt_tokens",
            "max_tokens": tokens,
            "structured_outputs": constraint,
            "sample logprobs": "top_logprobs" if prompt_field == "messages" else "logprobs",  # (chat's count)
            "prompt logprobs": "prompt_logprobs",
            "": prompt_field,
        }

    def check_flag(body: dict, name: str, default: bool) -> bool:
        value = body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false, got {value!r:.40}", name)
        return value

    def request_cache_salt(body: dict) -> str | None:
        """vLLM's cache_salt: a non-empty string of at most 128 characters without '@', '/', '\\' or NUL (None:
        none); anything else is a 400 naming it."""
        try:
            return check_cache_salt(body.get("cache_salt"))
        except (TypeError, ValueError) as error:
            raise BadRequest(str(error), "cache_salt") from None

    def request_ids(request: Request, body: dict, prefix: str) -> tuple[str, str]:
        """vLLM's request id -> (the response's id: prefix + the X-Request-Id header, else the body's request_id, else
        a fresh id; the engine's id for it, unique whatever a client sends: two requests may share an id)."""
        given = request.headers.get("x-request-id", body.get("request_id"))
        if given is not None and not isinstance(given, str):
            raise BadRequest(f"request_id must be a string, got {type(given).__name__}", "request_id")
        fresh = uuid.uuid4().hex
        if given is None:
            return prefix + fresh, prefix + fresh
        return prefix + given, f"{prefix}{given}-{fresh[:8]}"

    def output_options(body: dict) -> dict[str, bool]:
        """vLLM's return_token_ids and return_tokens_as_token_ids, checked -> `respond`'s keywords."""
        return {
            "return_token_ids": check_flag(body, "return_token_ids", False),
            "as_ids": check_flag(body, "return_tokens_as_token_ids", False),
        }

    def encode(text: str, add_special_tokens: bool) -> list[int] | str:
        """A prompt's text as the engine takes it: the text itself where the engine's tokenizing (with special
        tokens, the tokenizer's default) is what is asked for, else its ids."""
        if add_special_tokens or not text or not (text.isascii() or is_utf8(text)):
            return text  # (an empty or broken text: the engine's and `start`'s checks say what is wrong with it)
        return tokenizer.encode(text, add_special_tokens=False)

    def render_chat(body: dict, tools: list[dict] | None = None) -> str:
        """The request's messages (and tools) through the model's chat template (a 400 naming the field at fault,
        and naming the messages where the template itself refuses them: its raise_exception, as vLLM answers it)."""
        import jinja2

        options = {}
        for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            options[name] = check_flag(body, name, default)
        try:
            return chat_prompt(
                tokenizer,
                body.get("messages"),
                engine.config.tokenizer_folder,
                chat_template_kwargs=body.get("chat_template_kwargs"),
                tools=tools,
                chat_template=chat_template,
                **options,
            )
        except (ValueError, TypeError) as error:
            message = str(error)
            named = [
                name for name in ("continue_final_message", "chat_template_kwargs", "tools") if message.startswith(name)
            ]
            if message.startswith("cannot set both"):
                named = ["continue_final_message"]
            raise BadRequest(message, named[0] if named else "messages") from None
        except jinja2.TemplateError as error:
            raise BadRequest(f"the chat template refused the messages: {error}", "messages") from None

    async def off_the_loop(work: Callable[[], Any], heavy: bool) -> Any:
        """work() in a worker thread when the request is long (tokenizing it would stall every stream), else here."""
        return await asyncio.to_thread(work) if heavy else work()

    async def respond(
        request: Request,
        body: dict,
        params: SamplingParams,
        streams: list[AsyncIterator[RequestOutput]],
        request_id: str,
        chat: bool,
        echo: Echo | None = None,
        tools: ToolChoice | None = None,
        return_token_ids: bool = False,
        as_ids: bool = False,
        said: str = "",
        role: str = "assistant",
    ) -> Response:
        """Collect the outputs of the request's prompts into one response, or stream them as server-sent events.
        Choice k is sample k % n of prompt k // n, as in OpenAI's API. echo: completions' (see Echo); tools: chat's
        tool calls (each choice's text read by its own reader, whole or piece by piece: tool_calls.py).

        return_token_ids (vLLM's): the prompt's token ids and each choice's generated ones, where vLLM puts them:
        completions give each choice "prompt_token_ids" and "token_ids"; chat gives the response "prompt_token_ids"
        and each choice "token_ids". In a stream, a completions choice's first chunk carries its prompt's ids (later
        ones null), chat's opening chunks carry them (then sent once the first output is in, as vLLM does), and
        every chunk carries the ids of the tokens since the previous one (a step whose text is all held back sends
        no chunk: its ids ride with the next one, as logprobs do). as_ids (vLLM's return_tokens_as_token_ids):
        logprobs' tokens spelled "token_id:N". said: chat's echo (vLLM's), the text each choice's message starts with
        (in a stream, a chunk of its own after the opening chunks); usage does not count it, as vLLM's. role: chat's
        reply's (vLLM's get_chat_request_role: the assistant's, or the last message's without add_generation_prompt),
        in each message and each stream's opening chunk."""
        n = params.n
        head = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": adapters.response_name(body.get("model")),
        }
        choices = [Choice(index, num_logprobs=params.logprobs) for index in range(len(streams) * n)]
        for choice in choices if echo is not None else ():
            choice.echo, choice.generate = echo.texts[choice.index // n], echo.generate
            choice.echo_shown = echo.shown
        seen_prompts: set[int] = set()
        prompt_logprobs: dict[int, list] = {}  # by prompt: its request's, from its sample 0's first output
        readers = {choice.index: tools.reader() for choice in choices} if tools else {}

        def take(prompt: int, out: RequestOutput) -> tuple[Choice, str]:
            """Book one output on its choice (and in the metrics) -> that choice, and the text the output adds."""
            metrics.observe(out, prompt not in seen_prompts)
            seen_prompts.add(prompt)
            if out.prompt_token_logprobs is not None:
                prompt_logprobs[prompt] = out.prompt_token_logprobs
            choice = choices[prompt * n + out.index]
            text = choice.take(out, prompt_logprobs.get(prompt))
            if out.finished and out.finish_reason == "abort":  # never shown to a client as if it had finished
                raise RequestAborted(f"request {request_id} was aborted before it finished")
            return choice, text

        def count_unfinished() -> None:
            """Each sample that ended without its last output (its client went away, the request failed) counts
            once as finish_reason "abort", as one that the engine aborted does (in `take`), streamed or not."""
            unfinished = sum(choice.finish_reason is None for choice in choices)
            if unfinished:
                metrics.count_aborted(unfinished)

        def failure(error: Exception) -> Exception:
            """A request's error as the client gets it: a 503 when the engine is gone, else as it is."""
            return error if engine.is_running or isinstance(error, RequestAborted) else engine_stopped(error)

        def logprobs(choice: Choice) -> dict | None:
            """The logprobs of the choice's tokens not yet sent, in the endpoint's format (then they are sent)."""
            if choice.num_logprobs is None:
                return None
            entries, choice.logprobs = choice.logprobs, []
            if chat:
                return {"content": [chat_logprob(token_text, entry, as_ids) for entry in entries]}
            return completion_logprobs(token_text, entries, choice, as_ids)

        def usage() -> dict:
            prompt = sum(choice.num_prompt_tokens for choice in choices[::n])
            completion = sum(choice.num_tokens for choice in choices)
            counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            cached = sum(choice.num_cached_tokens for choice in choices[::n])  # (each prompt's sample 0's)
            if enable_prompt_tokens_details and cached:  # (vLLM's: only where the cache served some)
                counts["prompt_tokens_details"] = {"cached_tokens": cached}
            return counts

        if not body.get("stream"):
            merged = merge(streams)

            async def collect() -> None:
                async with aclosing(merged):
                    async for prompt, out in merged:
                        take(prompt, out)

            try:
                if not await until_done_or_disconnected(request, collect()):
                    return Response(status_code=499)  # nobody reads it; the request is aborted
            except Exception as error:
                raise failure(error) from None
            finally:
                count_unfinished()
            result = []
            for choice in choices:
                ending = {"logprobs": logprobs(choice), "finish_reason": choice.finish_reason}
                ending["stop_reason"] = choice.stop_reason
                if chat:
                    message = {"role": role, "content": choice.text}
                    reader = readers.get(choice.index)
                    if reader is not None:  # the whole text through the reader a stream's pieces go through
                        read = reader.feed(choice.text) + reader.finish()
                        message["content"] = tools.content(read.content, reader.called)
                        message["tool_calls"] = assemble(read)
                        ending["finish_reason"] = tools.finish_reason(choice.finish_reason, reader.called)
                    if said:
                        message["content"] = said + (message["content"] or "")
                    result.append({"index": choice.index, "message": message, **ending})
                    if return_token_ids:  # (vLLM's extra field; the prompt's: the response's)
                        result[-1]["token_ids"] = choice.token_ids
                else:
                    result.append({"index": choice.index, "text": choice.text, **ending})
                    if params.prompt_logprobs is not None:  # (vLLM's extra field)
                        result[-1]["prompt_logprobs"] = vllm_prompt_logprobs(token_text, choice.prompt_logprobs or [])
                    if return_token_ids:  # (vLLM's extra fields)
                        result[-1]["prompt_token_ids"] = choice.prompt_token_ids
                        result[-1]["token_ids"] = choice.token_ids
            response = {
                **head,
                "object": "chat.completion" if chat else "text_completion",
                "choices": result,
                "usage": usage(),
            }
            if chat and params.prompt_logprobs is not None:  # (vLLM's extra field: chat's, beside the choices)
                response["prompt_logprobs"] = vllm_prompt_logprobs(token_text, choices[0].prompt_logprobs or [])
            if chat and return_token_ids:
                response["prompt_token_ids"] = choices[0].prompt_token_ids
            return JSONResponse(response)

        # vLLM's: a stream_options object (an empty one too) includes usage unless include_usage is false or null;
        # --enable-force-include-usage includes it in every stream, and in every chunk (vLLM's should_include_usage)
        options = body.get("stream_options")
        include_usage = enable_force_include_usage or (
            options is not None and options.get("include_usage", True) is True
        )
        every_chunk = enable_force_include_usage or (
            options is not None and options.get("continuous_usage_stats") is True
        )

        def running_usage(num_prompt_tokens: int, num_tokens: int) -> dict:
            """continuous_usage_stats: a chunk's usage, its choice's tokens so far (vLLM's)."""
            if not every_chunk:
                return {}
            total = num_prompt_tokens + num_tokens
            return {
                "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens, "total_tokens": total}
            }

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(choice: Choice, text: str, finished: bool) -> list[dict]:
            """The chunks a piece of a choice's text makes: one, or none when it shows nothing (text held back: half
            a character, a possible stop string, a possible tool call tag), whose tokens' logprobs then wait and go
            with the next chunk that is sent. Tool calls: a chunk per tool call delta (a call's opening, with its
            name, then its arguments), as OpenAI's stream sends them, the last one carrying the logprobs."""
            finish_reason, reader = choice.finish_reason, readers.get(choice.index)
            before: list[dict] = []
            if reader is not None:
                read = reader.feed(text) + (reader.finish() if finished else Delta())
                deltas = [{"content": read.content}] if read.content else []
                deltas += [{"tool_calls": [item]} for item in read.tool_calls]
                before, delta = deltas[:-1], deltas[-1] if deltas else {}
                finish_reason = tools.finish_reason(finish_reason, reader.called) if finished else None
            else:
                delta = {"content": text} if text else {}
            if not (delta if chat else text) and not finished:
                return []
            usage = running_usage(choice.num_prompt_tokens, choice.num_tokens)
            earlier = [
                {**head, "choices": [{"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None}]}
                | usage
                for d in before
            ]
            ending = {"finish_reason": finish_reason, "stop_reason": choice.stop_reason} if finished else {}
            if chat:
                body = {"index": choice.index, "delta": delta, "logprobs": logprobs(choice)}
            else:
                body = {"index": choice.index, "text": text, "logprobs": logprobs(choice)}
            ids = {}
            if return_token_ids:  # (vLLM's extra fields)
                if not chat:
                    ids["prompt_token_ids"] = None if choice.prompt_ids_sent else choice.prompt_token_ids
                    choice.prompt_ids_sent = True
                ids["token_ids"], choice.unsent_token_ids = choice.unsent_token_ids, []
            return [*earlier, {**head, "choices": [{**body, "finish_reason": None, **ending, **ids}]} | usage]

        def openings(out: RequestOutput | None) -> Iterator[str]:
            """OpenAI's first chat chunk of each choice, which opens the assistant's message (with return_token_ids,
            vLLM's top-level prompt_token_ids; with continuous_usage_stats, the usage of the prompt: both from `out`,
            the first output)."""
            ids = {"prompt_token_ids": out.prompt_token_ids} if return_token_ids else {}
            usage = running_usage(out.num_prompt_tokens, 0) if every_chunk else {}
            for choice in choices:
                opening = {"role": role, "content": ""}
                body = {"index": choice.index, "delta": opening, "logprobs": None, "finish_reason": None}
                yield event({**head, "choices": [body], **ids, **usage})
            for choice in choices if said else ():  # (vLLM's chat echo: its own chunk, after every opening)
                body = {"index": choice.index, "delta": {"content": said}, "logprobs": None, "finish_reason": None}
                yield event({**head, "choices": [body], **usage})

        async def events() -> AsyncIterator[str]:
            merged = merge(streams)
            async with aclosing(merged):
                opened = not chat
                if not opened and not (return_token_ids or every_chunk):  # (else they wait for the first output)
                    for opening in openings(None):
                        yield opening
                    opened = True
                try:
                    async for prompt, out in merged:
                        if not opened:
                            for opening in openings(out):
                                yield opening
                            opened = True
                        choice, text = take(prompt, out)
                        for payload in chunk(choice, text, out.finished):
                            yield event(payload)
                except Exception as error:  # the step serving it failed or it was aborted: say so, then end
                    error = failure(error)
                    if isinstance(error, APIError):
                        yield event(error_body(error.message, None, error.status))
                    else:
                        status = 503 if isinstance(error, RequestAborted) else 500
                        yield event(error_body(f"{type(error).__name__}: {error}", None, status))
                else:
                    if include_usage:
                        yield event({**head, "choices": [], "usage": usage()})
                finally:  # (a client that went away: closing `merged` aborts the request)
                    count_unfinished()
            yield "data: [DONE]\n\n"

        return ClosingStreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, heavy = await read_body(request, COMPLETION_TYPES)
        check_fields(body, COMPLETION_HONOURED, NOT_SUPPORTED_COMPLETION)
        prompts = prompt_batch(body.get("prompt"))
        fields_body, echo, generate = echo_fields(body)
        # 16 where max_tokens is left out; a null one is none (vLLM's: the room left, or the model's max_new_tokens)
        null = "max_tokens" in body and body["max_tokens"] is None
        completion_defaults = {**model_defaults, "max_tokens": None if null else DEFAULT_COMPLETION_MAX_TOKENS}
        params = sampling_params(fields_body, COMPLETION_FIELDS, completion_defaults)
        # the client's own max_tokens (0 with echo: the prompt alone), which vLLM checks against the room the prompt
        # leaves before its cap applies
        asked = params.max_tokens if body.get("max_tokens") else None
        params, cap_error = capped(params, max_tokens_cap)
        add_special_tokens = check_flag(body, "add_special_tokens", True)
        salt, options = request_cache_salt(body), output_options(body)
        request_id, engine_id = request_ids(request, body, "cmpl-")
        blamed = blamed_fields(body, "prompt")

        def open_streams() -> list[AsyncIterator[RequestOutput]]:
            streams, refused = [], None
            for i, prompt in enumerate(prompts):  # every prompt checked before any is queued (at the first output)
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                if isinstance(prompt, str):
                    prompt = encode(prompt, add_special_tokens)
                model, prompt_id = body.get("model"), f"{engine_id}-{i}"
                try:
                    streams.append(start(prompt, params, blamed, prompt_id, where, model, asked, salt, cap_error))
                except BadRequest as error:  # the cap's error once every prompt's room is checked (vLLM's order)
                    if error is not cap_error:
                        raise
                    refused = error
            if refused is not None:
                raise refused
            return streams

        def echo_texts() -> list[str]:  # (a prompt of token ids: its decoded text)
            return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]

        streams = await off_the_loop(open_streams, heavy)
        texts = None
        if echo and options["return_token_ids"]:  # (vLLM's: the prompt's text is left out, its ids are there)
            texts = Echo([""] * len(prompts), generate, shown=False)
        elif echo:
            texts = Echo(await off_the_loop(echo_texts, heavy), generate)
        return await respond(request, body, params, streams, request_id, chat=False, echo=texts, **options)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, heavy = await read_body(request, CHAT_TYPES)
        check_fields(body, CHAT_HONOURED, NOT_SUPPORTED_CHAT)
        params = chat_sampling_params(body, model_defaults)
        asked_max_tokens = params.max_tokens  # (the client's, checked against the room before the cap, as vLLM does)
        params, cap_error = capped(params, max_tokens_cap)
        try:
            tools = tool_choice(body, enable_auto_tool_choice, exclude_tools_when_tool_choice_none)
        except ToolRequestError as error:
            raise BadRequest(str(error), error.param) from None
        params, blamed = tool_constraint(body, params, tools, blamed_fields(body, "messages"))
        add_special_tokens = check_flag(body, "add_special_tokens", False)  # (vLLM's: the template writes them)
        echo = check_flag(body, "echo", False)
        salt, options = request_cache_salt(body), output_options(body)
        request_id, engine_id = request_ids(request, body, "chatcmpl-")
        asked = asked_max_tokens if body.get(blamed["max_tokens"]) is not None else None

        def open_stream() -> list[AsyncIterator[RequestOutput]]:
            prompt = encode(render_chat(body, tools.tools if tools else None), add_special_tokens)
            model = body.get("model")
            try:
                return [start(prompt, params, blamed, engine_id, "", model, asked, salt, cap_error)]
            except BadRequest as error:  # (the grammar library refused the schema made of the tools)
                if error.param != "tools" or tools is None:
                    raise
                raise BadRequest(tools.refused(error.message), "tools") from None

        streams = await off_the_loop(open_stream, heavy)
        # the reply's role, as vLLM's: the assistant's, or without a generation prompt the last message's (whose text
        # echo repeats where its role is the reply's); the messages are checked: they rendered
        last = check_messages(body["messages"][-1:])[-1]
        role = "assistant" if check_flag(body, "add_generation_prompt", True) else last["role"]
        said = last["content"] if echo and last["role"] == role else ""
        options.update(tools=tools, said=said, role=role)
        return await respond(request, body, params, streams, request_id, chat=True, **options)

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        permission = {  # (vLLM's card lists one, allowing what the server does)
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": names[0],
            "object": "model",
            "created": created,
            "owned_by": "nanoref",
            "root": str(folder),
            "parent": None,
            "max_model_len": engine.config.max_model_len,
            "permission": [permission],
        }
        return {"object": "list", "data": adapters.cards(card)}

    lora_routes(app, adapters, read_body, APIError, metrics.registry)

    @app.get("/version")
    async def version() -> dict:
        return {"version": package_version()}

    if dev_mode_enabled():
        dev_routes(app, engine, engine_stopped)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        """vLLM's: {"prompt", "add_special_tokens": true} or {"messages", "add_generation_prompt": true,
        "continue_final_message", "chat_template_kwargs", "add_special_tokens": false} (the chat template renders
        them, as /v1/chat/completions does) -> {"count", "max_model_len", "tokens", "token_strs"}."""
        body, heavy = await read_body(request, TOKENIZE_TYPES)
        chat = "messages" in body
        honoured = {"model", "add_special_tokens", "return_token_strs"}
        if chat:
            honoured |= {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"}
            check_fields(body, honoured, {"chat_template": (), "mm_processor_kwargs": ()})
        else:
            check_fields(body, honoured | {"prompt"}, {})
            if not isinstance(body.get("prompt"), str):
                raise BadRequest("prompt must be a string (or send messages, as to chat)", "prompt")
        add_special_tokens = check_flag(body, "add_special_tokens", not chat)
        token_strs = check_flag(body, "return_token_strs", False)
        try:
            tools = check_tools(body["tools"]) if body.get("tools") is not None else None
        except ToolRequestError as error:
            raise BadRequest(str(error), error.param) from None

        def work() -> list[int]:
            text = render_chat(body, tools) if chat else body["prompt"]  # (no lone surrogate: read_body)
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        tokens = await off_the_loop(work, heavy)
        strs = tokenizer.convert_ids_to_tokens(tokens) if token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": engine.config.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        """vLLM's: {"tokens": [ids]} -> {"prompt": their text} (special tokens included, as vLLM decodes them)."""
        body, heavy = await read_body(request, DETOKENIZE_TYPES)
        check_fields(body, {"model", "tokens"}, {})
        tokens, vocab = body.get("tokens"), engine.config.hf_config.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise BadRequest("tokens must be a list of integer token ids", "tokens")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        text = await off_the_loop(lambda: decode(tokenizer, tokens, skip_special_tokens=False), heavy)
        return {"prompt": text}

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # (vLLM's, for SageMaker's health check: the same answer)
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body("the engine has stopped", None, 503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


@contextlib.contextmanager
def serve_in_background(
    engine: AsyncLLM, served_model_name: str = "nanoref", timeout: float = 30.0, **app_options
) -> Iterator[str]:
    """The OpenAI-compatible server on `engine` (an AsyncLLM), in this process: uvicorn in a background thread on a
    free 127.0.0.1 port, up when the block begins (its /health answers) -> its base URL; stopped when the block
    ends. Every wait is bounded by `timeout` seconds (a server that does not come up or stop raises RuntimeError).
    The engine stays the caller's to close. app_options: build_app's limits. A notebook's way to serve;
    `python -m nanoref.serve` is a shell's."""
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))  # a free port, held from now on: no race with another process
    server = uvicorn.Server(uvicorn.Config(build_app(engine, served_model_name, **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="nanoref-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server never answered {url}/health")
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"the server did not stop within {timeout} s")


def check_serves_text(config: EngineConfig) -> None:
    """ValueError where the engine has no tokenizer (its folder holds none, or skip_tokenizer_init): the server reads
    and writes text, chat templates and tool calls."""
    if not config.has_tokenizer:
        raise ValueError(f"{config.no_tokenizer}: the server reads and writes text, so it needs one")


DEV_MODE = ("VLLM_SERVER_DEV_MODE", "NANOREF_SERVER_DEV_MODE")  # vLLM's opt-in to its development routes
QUERY_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def dev_mode_enabled() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in DEV_MODE)


def dev_routes(app: FastAPI, engine: AsyncLLM, engine_stopped: Callable[[object], APIError]) -> None:
    """vLLM's development routes, there only with VLLM_SERVER_DEV_MODE=1 (as vLLM: open like /metrics, so off by
    default): POST /reset_prefix_cache empties the engine's prefix cache (a benchmark calls it between timed runs;
    a trainer after it changed the weights) -> vLLM's {"success": true}, or {"success": false} and nothing changed
    while requests in flight hold KV blocks (a 503 once the engine has stopped, as every route)."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        options = {"reset_running_requests": False, "reset_external": False}
        for name, value in request.query_params.items():
            if name not in options:
                raise BadRequest(f"unknown query parameter {name!r} (reset_prefix_cache takes {list(options)})", name)
            if value.strip().lower() not in QUERY_BOOLS:
                raise BadRequest(f"{name} must be true or false, got {value!r}", name)
            if QUERY_BOOLS[value.strip().lower()]:
                raise BadRequest(f"{name}=true is not supported by nanoref (it resets only an idle cache)", name)
        try:
            num_blocks_held = await engine.clear_prefix_cache()
        except RuntimeError as error:  # the engine is gone (before it was asked, or before it answered)
            raise engine_stopped(error) from None
        # vLLM's answer: 200 and whether it was reset (not while requests in flight hold blocks: a client retries)
        return JSONResponse({"success": not num_blocks_held})


def package_version() -> str:
    """nanoref's version, the same whether the package was installed or runs from a folder on PYTHONPATH."""
    return __version__
