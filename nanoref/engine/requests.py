"""A request's checks: prompts as token ids, and everything about a request the engine could never serve."""

from __future__ import annotations

import numbers
import operator
from dataclasses import replace
from typing import Any

from nanoref.config import EngineConfig
from nanoref.engine.block_manager import blocks_needed
from nanoref.sampling_params import SamplingParams
from nanoref.utils.text import check_text


def tokenize(prompt: str | list[int] | dict, tokenizer: Any | None, config: EngineConfig) -> list[int]:
    """A prompt as token ids: a string (through the tokenizer), a sequence of integer ids, or vLLM's prompt dicts
    ({"prompt": text}, {"prompt_token_ids": ids}, either with a "cache_salt": see `prompt_cache_salt`)."""
    if isinstance(prompt, dict):
        prompt = _unpack_prompt_dict(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{config.no_tokenizer}: pass prompts as lists of token ids")
        check_text(prompt, "the prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray, dict, set, frozenset)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"a prompt must be a string or a list of integer token ids, got {type(prompt).__name__}")
    if hasattr(prompt, "tolist"):  # a torch tensor or numpy array of ids
        prompt = prompt.tolist()
    try:  # ints of any integer type; 3.0, "3", True or a nested list are errors
        return [_token_id(t) for t in prompt]
    except TypeError:
        raise TypeError("a prompt must be a string or a list of integer token ids") from None


def _unpack_prompt_dict(prompt: dict) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt -> the text or the ids (a "cache_salt" beside them is `prompt_cache_salt`'s).
    Their other keys (multi-modal data, embeddings) ask for what this engine does not do: refused, not dropped."""
    keys = sorted(map(str, prompt))
    if "cache_salt" in keys:
        keys.remove("cache_salt")
    if keys == ["prompt"]:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"a prompt dict's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    if keys == ["prompt_token_ids"]:
        return prompt["prompt_token_ids"]
    raise ValueError(
        "a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (ids), and maybe 'cache_salt', and nothing else, "
        f"got {sorted(map(str, prompt))}"
    )


# vLLM's limits on a cache salt: a non-empty string of at most 128 characters, none of them '@', '/', '\\' or NUL
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = "@/\\\x00"


def check_cache_salt(salt: object) -> str | None:
    """A request's cache salt as vLLM takes it (None: none) -> the salt; TypeError for a value that is not a string,
    ValueError for an empty one, a longer one than MAX_CACHE_SALT_CHARS, or one that holds a forbidden character."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a non-empty string, got {type(salt).__name__}")
    if not salt:
        raise ValueError("cache_salt must be a non-empty string, got ''")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    bad = next((char for char in salt if char in CACHE_SALT_FORBIDDEN), None)
    if bad is not None:
        raise ValueError(f"cache_salt must not contain '@', '/', '\\' or NUL, got one with {bad!r}")
    return salt


def prompt_cache_salt(prompt: object) -> str | None:
    """The cache salt of a prompt (vLLM's prompt dicts' "cache_salt"; None: none, and for a prompt that is no dict),
    checked (`check_cache_salt`). The prefix cache shares K/V only between requests of the same salt: a client
    cannot learn, from how fast its prompt is served, whether a client of another salt (or of none) sent it."""
    if not isinstance(prompt, dict):
        return None
    return check_cache_salt(prompt.get("cache_salt"))


def truncate_prompt(token_ids: list[int], params: SamplingParams, config: EngineConfig) -> list[int]:
    """The prompt's ids as the request asks for them: its last `truncate_prompt_tokens` (vLLM's left truncation; -1:
    max_model_len - 1, so that one generated token fits), or all of them (ValueError for a truncation past
    max_model_len, as vLLM refuses it)."""
    k = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None  # (check_request names it)
    if k is None:
        return token_ids
    params.validate()  # (a field reassigned since it was made: named before it is used)
    limit = config.max_model_len
    if k > limit:
        raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({limit}): choose a smaller one")
    return token_ids[-(limit - 1 if k == -1 else k) :]


Prompt = str | list[int] | dict  # text, token ids, or one of vLLM's prompt dicts


def request_tokens(
    prompt: Prompt, params: SamplingParams | None, tokenizer: Any | None, config: EngineConfig
) -> tuple[list[int], str | None, SamplingParams]:
    """A request as the engine serves it -> (its prompt's token ids, truncated as `params` ask; its cache salt; its
    params with the generation config's EOS ids among its stop ids: `with_generation_stops`), checked
    (`check_request`): ValueError or TypeError naming the problem. params None: the model's defaults."""
    params = config.generation_defaults.sampling_params() if params is None else params
    salt = prompt_cache_salt(prompt)
    token_ids = truncate_prompt(tokenize(prompt, tokenizer, config), params, config)
    check_request(token_ids, params, config)
    return token_ids, salt, with_generation_stops(whole_vocabulary_logprobs(params, config), config, tokenizer)


def whole_vocabulary_logprobs(params: SamplingParams, config: EngineConfig) -> SamplingParams:
    """params, or a copy whose logprobs / prompt_logprobs of -1 (vLLM's: every token of the vocabulary, which
    `check_request` let through only where the engine's max_logprobs covers it) are the vocabulary's size."""
    names = [name for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1]
    return replace(params, **dict.fromkeys(names, config.hf_config.vocab_size)) if names else params


def with_generation_stops(params: SamplingParams, config: EngineConfig, tokenizer: Any | None) -> SamplingParams:
    """params, or a copy whose stop_token_ids also hold the generation config's EOS ids that are not the model's EOS
    already (vLLM's `update_from_generation_config`: Qwen3's <|endoftext|> beside config.json's <|im_end|>). A
    completion ended by one of them names it as its stop_reason; ignore_eos ignores them too. The caller's params
    are never changed."""
    if params.ignore_eos:
        return params
    known = eos_token_ids(config, tokenizer) | set(params.stop_token_ids)
    extra = [t for t in config.generation_defaults.eos_token_ids if t not in known]
    return replace(params, stop_token_ids=[*params.stop_token_ids, *extra]) if extra else params


def prompt_text(prompt: Prompt) -> str | None:
    """A prompt's text (a prompt dict's "prompt"; vLLM's `RequestOutput.prompt`); None for token ids."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def check_request(token_ids: list[int], params: SamplingParams, config: EngineConfig) -> None:
    """Raise ValueError, naming the problem, for a request the engine could never serve. config: the engine's, with
    its KV block count (what a process without the engine, a server's front, can check a request against too)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    if not token_ids:
        raise ValueError("the prompt is empty")
    vocab_size = config.hf_config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if not t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad = sorted(t for t in params.logit_bias or {} if not t < vocab_size)
    if bad:
        raise ValueError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = sorted(t for t in params.allowed_token_ids or () if not t < vocab_size)
    if bad:
        raise ValueError(f"allowed_token_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    for kind, asked in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
        whole = asked == -1  # (vLLM's: every token of the vocabulary)
        asked = vocab_size if whole else asked
        if asked and asked > config.max_logprobs:  # (vLLM's check, and its words: 0 asks for the chosen token only)
            raise ValueError(
                f"Requested {kind} logprobs of {int(asked)}, which is greater than max allowed: {config.max_logprobs} "
                f"(the engine's max_logprobs{'; -1 asks for every token of the vocabulary' if whole else ''})"
            )
    limit = config.max_model_len
    if len(token_ids) >= limit:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens but max_model_len is {limit}: "
            f"at most {limit - 1} prompt tokens leave room for a generated one"
        )
    num_blocks, block_size = config.num_kvcache_blocks, config.kvcache_block_size
    if blocks_needed(len(token_ids) + 1, block_size) > num_blocks:  # (no max_tokens could make it fit)
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, and with one generated token it needs "
            f"{blocks_needed(len(token_ids) + 1, block_size)} KV blocks but the cache has only {num_blocks} "
            f"(of {block_size} tokens): raise num_kvcache_blocks or shorten the prompt"
        )
    longest = min(len(token_ids) + int(params.max_tokens), limit)  # (a NumPy integer could overflow here)
    needed = blocks_needed(longest, block_size)
    if needed > num_blocks:
        raise ValueError(
            f"the request needs up to {needed} KV blocks ({longest} tokens) but the "
            f"cache has only {num_blocks}: raise num_kvcache_blocks or lower max_tokens"
        )


def check_request_id(request_id: object) -> None:
    """A request's id is the caller's string (vLLM's), or None (one is made up): TypeError for anything else."""
    if request_id is not None and not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string or None, got {request_id!r:.60}")


def check_generate_options(use_tqdm: object, return_metrics: object) -> None:
    """generate's switches: use_tqdm True, False or the callable that makes the bar (vLLM's), return_metrics a bool
    (TypeError naming one: "no" would otherwise read as true)."""
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise TypeError(f"use_tqdm must be True, False or a callable that makes a progress bar, got {use_tqdm!r:.40}")
    if not isinstance(return_metrics, bool):
        raise TypeError(f"return_metrics must be True or False, got {return_metrics!r:.40}")


def check_priority(priority: object, num_prompts: int) -> None:
    """generate's priority (vLLM's): None, or one integer per prompt. nanoref schedules first come, first served
    (vLLM's default policy, "fcfs"), so every priority must be 0, as vLLM requires without its "priority" policy (a
    ValueError in vLLM's words names the first that is not)."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or not all(
        isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in priority
    ):
        raise TypeError(f"priority must be None or a list of integers, one per prompt, got {priority!r:.60}")
    if len(priority) != num_prompts:
        raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
    ranked = next((p for p in priority if p != 0), None)
    if ranked is not None:
        raise ValueError(
            f"Got priority {ranked} but Priority scheduling is not enabled. (nanoref schedules first come, first "
            "served: every priority must be 0)"
        )


def check_request_priority(priority: object) -> None:
    """AsyncLLM.generate's priority (vLLM's): one integer for its one request, which must be 0 (`check_priority`)."""
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise TypeError(f"priority must be an integer (one request's), got {priority!r:.60}")
    check_priority([priority], 1)


def prompt_list(prompts: object) -> list:
    """`generate`'s prompts as a list: one string or prompt dict, or a list, tuple, generator, or a 2-D tensor/array
    of ids."""
    if isinstance(prompts, (str, dict)):  # one prompt, as vLLM's generate("Hello") or generate({"prompt": ...})
        return [prompts]
    if isinstance(prompts, bytes):
        raise TypeError("prompts must be a list: list[str] or list[list[int]] (wrap a single prompt in [])")
    if isinstance(prompts, (set, frozenset)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else list(prompts)
    if prompts and isinstance(prompts[0], numbers.Integral):
        raise TypeError("prompts must be a list: list[str] or list[list[int]] (wrap a single prompt in [])")
    return prompts


def params_list(
    sampling_params: SamplingParams | list[SamplingParams] | None, prompts: list, config: EngineConfig
) -> list[SamplingParams]:
    """`generate`'s sampling params, one per prompt: None (the model's defaults: `GenerationDefaults`) or one for
    all, or a list of one per prompt."""
    count = len(prompts)
    if sampling_params is None:
        sampling_params = config.generation_defaults.sampling_params()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, (str, bytes, dict)) or not hasattr(sampling_params, "__iter__"):
        raise TypeError(
            "sampling_params must be None, a SamplingParams or a list of them (one per prompt), got "
            f"{type(sampling_params).__name__}"
        )
    sampling_params = list(sampling_params)
    if len(sampling_params) != count:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} prompts")
    return sampling_params


def _token_id(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


def eos_token_ids(config: EngineConfig, tokenizer: Any | None) -> set[int]:
    """The model's EOS ids: its tokenizer's, and config.json's where the generation config names them too. A
    generation_config.json's eos_token_id replaces config.json's, as in HF's `generate` and vLLM (which stops at the
    tokenizer's EOS and the file's ids); a folder without one reads config.json's (models/generation_config.py)."""
    eos = set(config.hf_config.eos_token_id) & set(config.generation_defaults.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos
