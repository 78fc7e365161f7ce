"""The sampling a model's authors recommend, read from its folder's generation_config.json as vLLM reads it.

A Hugging Face model folder carries a generation_config.json beside config.json. Qwen3-0.6B's says temperature 0.6,
top_p 0.95, top_k 20, and that a completion ends at <|im_end|> or <|endoftext|> (config.json names only the first).
vLLM reads it by default (`generation_config="auto"`), and so does nanoref:

- Its sampling settings (repetition_penalty, temperature, top_k, top_p, min_p, and max_new_tokens as max_tokens) are
  the defaults of a request that names none: `LLM.generate(prompts)` with no SamplingParams,
  `LLM.get_default_sampling_params()`, and the fields a server request leaves out. A SamplingParams the caller made is
  used as it is.
- Its eos_token_id ids that are not already the model's EOS join each request's stop_token_ids (unless ignore_eos),
  so a completion that ends at one names it as its `stop_reason` (vLLM's `update_from_generation_config`). The list
  replaces config.json's eos_token_id, as in HF's `generate` and vLLM: an id config.json names and the file does not
  ends nothing (the tokenizer's EOS still does, as in vLLM: `nanoref.engine.requests.eos_token_ids`).

Its other keys (do_sample, max_length, ...) change nothing, as in vLLM. `generation_config="vllm"` keeps SamplingParams'
own defaults (the file's EOS ids still stop a completion); a folder's path reads that folder's file instead of the
model's. `override_generation_config`, a dict of the sampling keys, is laid over either. A folder without the file
reads the same keys from config.json (as transformers' `GenerationConfig.from_model_config` does for vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoref.sampling_params import SamplingParams
from nanoref.utils.loader import ModelFolderError, read_config, read_json_object, resolve_model_folder

FILE_NAME = "generation_config.json"
# the keys vLLM takes as sampling defaults (`ModelConfig.get_diff_sampling_param`); Hugging Face's max_new_tokens is
# SamplingParams' max_tokens
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a generation config gives the engine.

    sampling: SamplingParams' field -> value, the defaults of a request that names none (empty: SamplingParams').
    eos_token_ids: the ids that end a completion, besides the model's EOS (a request's stop ids, unless ignore_eos).
    max_tokens_cap: the most tokens a server request may generate, whatever it asks for (vLLM's
        `override_max_tokens`: the max_new_tokens of a generation config given as a folder, or of the override).
    """

    sampling: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    max_tokens_cap: int | None

    def sampling_params(self) -> SamplingParams:
        """A new SamplingParams with these defaults (vLLM's `LLM.get_default_sampling_params`)."""
        return SamplingParams(**self.sampling)


def read_generation_defaults(
    setting: str | Path, overrides: dict | None, model_folder: Path, vocab_size: int
) -> GenerationDefaults:
    """The engine's `generation_config` ("auto", "vllm" or a folder) and `override_generation_config` -> its
    defaults, checked: a value SamplingParams refuses, or an EOS id outside the vocabulary, is a ModelFolderError
    (a ValueError) naming the file and the key, before anything is built. Defaults already read are taken as they
    are (a speculative draft's engine takes its target's: the draft folder's own file is never read)."""
    if isinstance(setting, GenerationDefaults):
        if overrides:
            raise ValueError(
                "override_generation_config with generation_config given as defaults already read: lay the overrides "
                "over them where they were read"
            )
        return setting
    if setting in ("auto", "vllm"):
        folder = model_folder
    elif isinstance(setting, (str, Path)):
        try:
            folder = resolve_model_folder(setting)
        except ModelFolderError as error:
            raise ModelFolderError(f"generation_config: {error}") from None
        if not (folder / FILE_NAME).is_file():
            raise ModelFolderError(f"generation_config: {folder} has no {FILE_NAME}")
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder's path, got {setting!r}")
    path = folder / FILE_NAME
    raw = read_json_object(path, "a generation config") if path.is_file() else read_config(folder)
    where = path if path.is_file() else folder / "config.json"
    eos = _eos_ids(raw.get("eos_token_id"), where, vocab_size)
    chosen = {} if setting == "vllm" else {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
    _check_sampling(chosen, f"{where}", " (generation_config='vllm' leaves the file's sampling settings out)")
    override = _override(overrides)
    sampling = {"max_tokens" if k == "max_new_tokens" else k: v for k, v in {**chosen, **override}.items()}
    _check_sampling(sampling, "override_generation_config", "")  # (laid over the file's: checked together)
    cap = override.get("max_new_tokens") if setting in ("auto", "vllm") else sampling.get("max_tokens")
    return GenerationDefaults(sampling, eos, cap)


def _eos_ids(value: object, where: Path, vocab_size: int) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ModelFolderError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ModelFolderError(f"{where}: eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return tuple(dict.fromkeys(ids))


def _override(overrides: object) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be a dict of {list(SAMPLING_KEYS)}, got {overrides!r}")
    unknown = sorted(map(str, set(overrides) - set(SAMPLING_KEYS)))
    if unknown:  # (vLLM drops the others without a word: here they are named)
        raise ValueError(
            f"override_generation_config: {unknown[0]!r} is not a sampling default; its keys: {list(SAMPLING_KEYS)}"
        )
    return {key: value for key, value in overrides.items() if value is not None}


def _check_sampling(sampling: dict[str, Any], where: str, hint: str) -> None:
    """SamplingParams' checks of these defaults, the error named as the file names the key."""
    try:
        SamplingParams(**{"max_tokens" if k == "max_new_tokens" else k: v for k, v in sampling.items()})
    except (ValueError, TypeError) as error:
        renamed = "max_new_tokens: " if "max_new_tokens" in sampling and str(error).startswith("max_tokens") else ""
        raise ModelFolderError(f"{where}: {renamed}{error}{hint}") from None
