"""Speculative decoding's settings, as vLLM reads them: a bound given alone, None for a default, keys that do not
apply, and a draft model whose folder or tokenizer does not fit the target, each found before anything is built."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from nanoref import LLM, ModelFolderError
from nanoref.config import SpeculativeConfig
from nanoref.llm import DEFAULT_MODEL
from nanoref.testing import EVERY_STEP, make_tiny_qwen3


@pytest.mark.parametrize(
    ("settings", "bounds"),
    [
        ({"prompt_lookup_min": 4}, (4, 4)),  # vLLM: a min given alone is the max too (not "exceeds 3")
        ({"prompt_lookup_min": 2}, (2, 3)),
        ({"prompt_lookup_max": 5}, (1, 5)),
        ({"prompt_lookup_max": None, "prompt_lookup_min": None}, (1, 3)),  # None: vLLM's "not given"
    ],
)
def test_a_lookup_bound_given_alone_or_as_none_is_resolved_not_refused(settings, bounds):
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, **settings})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == bounds


def test_lookup_bounds_with_a_draft_model_are_refused_not_dropped(tiny_model):
    with pytest.raises(ValueError, match='prompt_lookup_max is for method "ngram", not "draft_model"'):
        SpeculativeConfig.from_dict({"model": tiny_model, "num_speculative_tokens": 2, "prompt_lookup_max": 4})


def test_a_draft_folder_without_weights_names_the_key_before_anything_is_built(tiny_model, tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    shutil.copy(tiny_model / "config.json", folder / "config.json")
    threads = threading.active_count()
    with pytest.raises(ModelFolderError, match=r'speculative_config "model": .* holds no \*\.safetensors weights'):
        LLM(tiny_model, device="cpu", speculative_config={"model": folder, "num_speculative_tokens": 2, **EVERY_STEP})
    assert threading.active_count() == threads


def test_a_draft_with_another_tokenizer_of_the_same_size_is_a_clear_error(tmp_path):
    """Two token ids swapped: the vocabulary size is the target's, its proposals would all be wrong guesses."""
    target = shutil.copytree(DEFAULT_MODEL, tmp_path / "target")
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    draft = make_tiny_qwen3(tmp_path / "draft", vocab_size=vocab_size, num_hidden_layers=1)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, id_a), (b, id_b) = list(vocab.items())[100], list(vocab.items())[200]
    vocab[a], vocab[b] = id_b, id_a
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(target / "tokenizer_config.json", draft / "tokenizer_config.json")
    spec = {"model": draft, "num_speculative_tokens": 2, **EVERY_STEP}
    with pytest.raises(ValueError, match=r'speculative_config "model": .* has another tokenizer .* \(2 tokens differ'):
        LLM(target, device="cpu", speculative_config=spec)
    shutil.copy(target / "tokenizer.json", draft / "tokenizer.json")  # the same tokenizer: served
    LLM(target, device="cpu", speculative_config=spec).close()


@pytest.mark.parametrize(
    "settings",
    [
        {"model": "ngram"},  # vLLM infers the method from these spellings of its model
        {"model": "[ngram]"},
        {"method": "[ngram]"},
        {"method": "ngram", "model": "ngram"},
        {"method": "ngram", "draft_tensor_parallel_size": 1},
    ],
)
def test_vllms_spellings_of_the_ngram_method_are_taken(tiny_model, settings):
    llm = LLM(tiny_model, device="cpu", speculative_config={"num_speculative_tokens": 2, **EVERY_STEP, **settings})
    spec = llm.config.speculative_config
    assert (spec.method, spec.model) == ("ngram", None)
    llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]], use_tqdm=False)
    assert sum(step.num_draft_tokens for step in llm.metrics.steps) > 0


def test_a_draft_tensor_parallel_size_of_one_is_taken(tiny_model, tmp_path):
    draft = make_tiny_qwen3(tmp_path / "draft", seed=3, num_hidden_layers=1)
    spec = {"model": draft, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1, **EVERY_STEP}
    llm = LLM(tiny_model, device="cpu", speculative_config=spec)
    assert llm.config.speculative_config.method == "draft_model"
    llm.generate([[1, 2, 3]], use_tqdm=False)
    assert sum(step.num_draft_tokens for step in llm.metrics.steps) > 0


@pytest.mark.parametrize("size", [2, 0, True, 1.0, "1"])
def test_a_draft_tensor_parallel_size_other_than_one_is_refused_naming_the_key(tiny_model, size):
    spec = {"model": tiny_model, "num_speculative_tokens": 2, "draft_tensor_parallel_size": size}
    with pytest.raises(ValueError, match=r"speculative_config: draft_tensor_parallel_size must be 1 .*got"):
        LLM(tiny_model, device="cpu", speculative_config=spec)


@pytest.mark.parametrize("damage", ["garbage", "missing tensor"])
def test_a_draft_checkpoint_that_does_not_load_names_the_key(tiny_model, tmp_path, damage):
    draft = make_tiny_qwen3(tmp_path / "draft", seed=3, num_hidden_layers=1)
    weights = draft / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"not a checkpoint")
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        del tensors["model.norm.weight"]
        save_file(tensors, weights)
    threads = threading.active_count()
    spec = {"model": draft, "num_speculative_tokens": 2, **EVERY_STEP}
    with pytest.raises(ModelFolderError, match=rf'^speculative_config "model": .*{draft}'):
        LLM(tiny_model, device="cpu", speculative_config=spec)
    assert threading.active_count() == threads
