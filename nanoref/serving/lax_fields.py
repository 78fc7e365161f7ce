"""A request's typed fields read as vLLM's server reads them: its request models are pydantic's, in lax mode, so an
integer field takes a whole-number float (`"max_tokens": 8.0`), a numeric string (`"5"`, `" 5 "`, `"5.0"`) or a
boolean (true: 1); a number field takes an integer, a numeric string or a boolean; a boolean field takes
true/false, 0/1 (0.0/1.0) and the strings "true"/"false", "1"/"0", "yes"/"no", "on"/"off", "t"/"f", "y"/"n" (any
case). `lax_body` converts those, and leaves every other value as it is, for the endpoint's own checks to refuse
with a 400 naming the field (`"max_tokens": 1.5`, `"n": "two"`, `"stream": 2`), as pydantic refuses them.
"""

from __future__ import annotations

import math
import re
from typing import Any

INT, FLOAT, BOOL, INTS = "int", "float", "bool", "ints"  # (INTS: a list of integers, each read as INT)
FLOATS_BY_KEY = "floats by key"  # an object whose values are numbers (logit_bias)

_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")  # (pydantic's: "5", "+5", "1_000", "5.00"; not "5.")
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_INT64 = 2**63  # a float is read as an integer below it (pydantic's i64)

_SAMPLING = {
    "max_tokens": INT,
    "n": INT,
    "seed": INT,
    "top_k": INT,
    "min_tokens": INT,
    "truncate_prompt_tokens": INT,
    "temperature": FLOAT,
    "top_p": FLOAT,
    "min_p": FLOAT,
    "presence_penalty": FLOAT,
    "frequency_penalty": FLOAT,
    "repetition_penalty": FLOAT,
    "length_penalty": FLOAT,
    "stop_token_ids": INTS,
    "allowed_token_ids": INTS,
    "logit_bias": FLOATS_BY_KEY,
    "ignore_eos": BOOL,
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "stream": BOOL,
    "stream_options": {"include_usage": BOOL, "continuous_usage_stats": BOOL},
    "response_format": {"json_schema": {"strict": BOOL}},
    "structured_outputs": {"json_object": BOOL, "disable_any_whitespace": BOOL},
    "add_special_tokens": BOOL,
    "echo": BOOL,
    "return_token_ids": BOOL,
    "return_tokens_as_token_ids": BOOL,
    "priority": INT,
    "use_beam_search": BOOL,
    "early_stopping": BOOL,
    "return_token_offsets": BOOL,
    "stream_interval": INT,
}
COMPLETION_TYPES = {**_SAMPLING, "logprobs": INT, "prompt_logprobs": INT, "best_of": INT}
CHAT_TYPES = {
    **_SAMPLING,
    "logprobs": BOOL,  # (chat's logprobs is a switch, top_logprobs the count)
    "top_logprobs": INT,
    "prompt_logprobs": INT,
    "max_completion_tokens": INT,
    "add_generation_prompt": BOOL,
    "continue_final_message": BOOL,
    "parallel_tool_calls": BOOL,
    "include_reasoning": BOOL,
    "store": BOOL,
}
TOKENIZE_TYPES = {
    "add_special_tokens": BOOL,
    "return_token_strs": BOOL,
    "add_generation_prompt": BOOL,
    "continue_final_message": BOOL,
}
DETOKENIZE_TYPES = {"tokens": INTS}


def lax_int(value: Any) -> Any:
    """value as an integer where pydantic's lax mode reads it as one, else value unchanged."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < _INT64:
        return int(value)
    if isinstance(value, str) and _INT_TEXT.fullmatch(text := value.strip()):
        try:
            return int(text.split(".")[0])
        except ValueError:  # (past Python's 4,300 digits: pydantic refuses such a string too, past its own limit)
            return value
    return value


def lax_float(value: Any) -> Any:
    """value as a number where pydantic's lax mode reads it as one (a string: as float() reads it, ASCII only),
    else value unchanged (an integer stays one)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value.isascii():
        try:
            return float(value)
        except ValueError:
            return value
    return value


def lax_bool(value: Any) -> Any:
    """value as True or False where pydantic's lax mode reads it as one, else value unchanged."""
    if isinstance(value, str):
        word = value.lower()
        return True if word in _TRUE else False if word in _FALSE else value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return value


_READ = {INT: lax_int, FLOAT: lax_float, BOOL: lax_bool}


def lax_body(body: dict, types: dict[str, Any]) -> dict:
    """body with each field of `types` (a kind above, or a table of an object's fields) read as pydantic's lax mode
    reads it (a copy)."""
    body = dict(body)
    for name, kind in types.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(kind, dict):
            body[name] = lax_body(value, kind) if isinstance(value, dict) else value
        elif kind == INTS:
            if isinstance(value, list) and not all(type(item) is int for item in value):
                body[name] = [lax_int(item) for item in value]
        elif kind == FLOATS_BY_KEY:
            body[name] = {key: lax_float(item) for key, item in value.items()} if isinstance(value, dict) else value
        else:
            body[name] = _READ[kind](value)
    return body
