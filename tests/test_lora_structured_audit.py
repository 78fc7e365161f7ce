"""Found by an audit of LoRA adapters and structured output: an accepted request keeps the adapter it was checked
with, adapter settings that change the forward are refused (and peft's defaults and target names honoured), a
choice outside the BMP can be written, and JSON schema keywords the grammar library would skip are refused."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from nanoref import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from nanoref.lora import LoRAAdapterError
from nanoref.lora.adapters import load_adapter

from .helpers import assert_no_block_leaked

peft = pytest.importorskip("peft", reason="peft is not installed (the LoRA oracle; pip install peft)")

from nanoref.testing import make_random_lora  # noqa: E402

from .test_lora_engine import MAX_TOKENS, expected  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_audit")
    return {
        "all-r4": make_random_lora(root / "all-r4", tiny_model, rank=4, seed=21),
        "attn-r2": make_random_lora(root / "attn-r2", tiny_model, rank=2, targets=("q_proj", "v_proj"), seed=22),
    }


def copy(folder, tmp_path, name: str, **settings):
    """A copy of an adapter folder with these adapter_config.json settings changed (None: removed)."""
    target = tmp_path / name
    shutil.copytree(folder, target)
    path = target / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in settings.items():
        config.pop(key) if value is None else config.update({key: value})
    path.write_text(json.dumps(config))
    return target


# -- an accepted request keeps its checked adapter ---------------------------------------------------------------
@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_queued_requests_adapter_is_not_read_again_after_another_one_takes_the_host_place(
    tiny_model, folders, tmp_path, change
):
    """vLLM's defaults (one slot, one host place): A's request is queued, then B's request takes the host place.
    A's adapter was read and checked when its request was made; it was evicted and read again from disk at A's
    step, so a folder deleted since aborted the accepted request, and one rewritten since served other weights."""
    a_folder = tmp_path / "a"
    shutil.copytree(folders["all-r4"], a_folder)
    a, b = LoRARequest("a", 1, str(a_folder)), LoRARequest("b", 2, str(folders["attn-r2"]))
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    seq_a = llm.add_request([1, 2, 3], GREEDY, lora_request=a)
    seq_b = llm.add_request([4, 5, 6], GREEDY, lora_request=b)
    shutil.rmtree(a_folder)
    if change == "replaced":
        shutil.copytree(folders["attn-r2"], a_folder)
    while not llm.is_finished():
        llm.step()
    assert seq_a.finish_reason == "length", "the accepted request was aborted"
    assert seq_a.completion_token_ids == expected(tiny_model, LoRARequest("a", 1, str(folders["all-r4"])), [1, 2, 3])
    assert seq_b.completion_token_ids == expected(tiny_model, b, [4, 5, 6])
    assert_no_block_leaked(llm)
    # done, A no longer needs its host place: the next adapter takes it as before
    llm.generate([[7, 8]], GREEDY, use_tqdm=False, lora_request=b)
    assert list(llm.lora.manager.host) == [2]


# -- adapter settings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(alora_invocation_tokens=[1, 2]), "alora_invocation_tokens=[1, 2] is not supported"),
        (dict(use_qalora=True), "use_qalora=True is not supported"),
        (dict(arrow_config={"top_k": 3}), "arrow_config={'top_k': 3} is not supported"),
        (dict(kasa_config={"r": 4}), "kasa_config"),
        (dict(a_later_peft_variant={"on": True}), "a_later_peft_variant={'on': True} is not a setting nanoref knows"),
        (dict(use_rslora="false"), "use_rslora must be true or false, got 'false'"),
        (dict(target_modules=5), "target_modules must be a list of module names or a regex, got 5"),
    ],
)
def test_adapter_settings_that_change_the_forward_are_refused_not_ignored(
    tiny_model, folders, tmp_path, settings, message
):
    folder = copy(folders["all-r4"], tmp_path, "bad", **settings)
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    with pytest.raises(LoRAAdapterError, match=re.escape(f"LoRA adapter 'bad' ({folder}): {message}")):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 1, str(folder)))
    assert llm.is_finished() and not llm.lora.manager.host


def test_a_config_without_lora_alpha_scales_as_peft_does(tiny_model, folders, tmp_path):
    """peft's LoraConfig has lora_alpha=8 by default (it was taken as r: scaling 1 for a rank-4 adapter, peft's 2)."""
    folder = copy(folders["all-r4"], tmp_path, "no-alpha", lora_alpha=None)
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    adapter = load_adapter(folder, "no-alpha", 1, llm.config.hf_config, max_lora_rank=16)
    assert adapter.scaling == peft.LoraConfig().lora_alpha / 4
    lora = LoRARequest("no-alpha", 1, str(folder))
    engine = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    prompt = [5, 17, 33, 2, 99]
    assert engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]["token_ids"] == expected(
        tiny_model, lora, prompt
    )


def test_a_config_without_r_is_read_with_pefts_default_rank(tiny_model, tmp_path):
    """peft's LoraConfig has r=8 by default: a rank-8 adapter whose adapter_config.json names no r is peft's to serve
    (it was 'r must be a positive integer, got None')."""
    source = make_random_lora(tmp_path / "r8", tiny_model, rank=8, seed=23)
    folder = copy(source, tmp_path, "no-r", r=None)
    lora = LoRARequest("no-r", 1, str(folder))
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    prompt = [2, 7, 1, 8, 2]
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]["token_ids"] == expected(
        tiny_model, lora, prompt
    )
    assert peft.LoraConfig().r == 8


def test_fan_in_fan_out_is_served_as_peft_serves_it_on_a_linear_layer(tiny_model, folders, tmp_path):
    """fan_in_fan_out is for GPT-2's transposed Conv1D; on an nn.Linear (every Qwen3 projection) peft warns and sets
    it to False, serving the adapter as it is, as vLLM does: it was refused as a setting nanoref does not serve."""
    folder = copy(folders["all-r4"], tmp_path, "fan-in-fan-out", fan_in_fan_out=True)
    lora = LoRARequest("fan-in-fan-out", 1, str(folder))
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    prompt = [7, 1, 8, 2, 8]
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to True but the target module is `torch.nn.Linear`"):
        tokens = expected(tiny_model, lora, prompt)
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]["token_ids"] == tokens


def test_target_modules_named_by_a_dotted_path_are_read_by_their_last_part(tiny_model, folders, tmp_path):
    """peft matches a target by the end of a module's name, and vLLM checks a target's last part: a valid adapter
    listing "model.layers.0.self_attn.q_proj" is served (the weights still say which projections it adapts)."""
    folder = copy(
        folders["attn-r2"], tmp_path, "dotted", target_modules=["self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    )
    lora = LoRARequest("dotted", 1, str(folder))
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    prompt = [3, 1, 4, 1, 5]
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]["token_ids"] == expected(
        tiny_model, LoRARequest("attn-r2", 1, str(folders["attn-r2"])), prompt
    )
    bad = copy(folders["attn-r2"], tmp_path, "dotted-bad", target_modules=["model.embed_tokens"])
    with pytest.raises(LoRAAdapterError, match="target module 'model.embed_tokens' is not one nanoref adapts"):
        load_adapter(bad, "dotted-bad", 1, llm.config.hf_config, max_lora_rank=16)


def test_a_tensor_name_without_a_layer_number_is_a_lora_adapter_error(tiny_model, folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(folders["attn-r2"], tmp_path, "odd-name")
    weights = load_file(folder / "adapter_model.safetensors")
    key = next(iter(weights))
    weights[re.sub(r"layers\.\d+", "layers.x", key)] = weights.pop(key)
    save_file(weights, folder / "adapter_model.safetensors")
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    with pytest.raises(LoRAAdapterError, match="names no layer number after 'layers'"):
        load_adapter(folder, "odd-name", 1, llm.config.hf_config, max_lora_rank=16)


# -- structured output -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'nanoref[structured]')")
    return LLM(device="cpu", seed=0)


def test_a_choice_outside_the_bmp_can_be_written(llm):
    """A choice was written into the grammar with JSON's ASCII escapes: an emoji became a UTF-16 surrogate pair,
    two code points the grammar library reads as lone surrogates, so that choice could never come out."""
    choices = ["😀 yes", "naïve"]
    llm.constrain(SamplingParams(structured_outputs=StructuredOutputsParams(choice=choices)))
    for choice in choices:
        matcher = llm.grammars.constraint(llm.grammars.compile(StructuredOutputsParams(choice=choices))).matcher
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=20)
    params.structured_outputs = StructuredOutputsParams(choice=["😀"])
    for sample in llm.generate(["Hi"], params, use_tqdm=False)[0]["outputs"]:
        assert (sample["text"], sample["finish_reason"]) == ("😀", "stop"), sample


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"not": {"type": "integer"}}, "# uses 'not'"),
        ({"type": "object", "properties": {"n": {"if": {"minimum": 0}, "then": {"maximum": 9}}}}, "#/properties/n"),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "# uses allOf with more than one schema"),
        ({"type": "number", "multipleOf": 0.5}, "# uses multipleOf on a non-integer"),
        ({"$ref": "https://example.com/schema.json"}, "# uses $ref to another document"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "# uses 'uniqueItems'"),
        ({"type": "array", "items": {"type": "array", "contains": {"const": 5}}}, "#/items uses 'contains'"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "# uses 'dependentRequired'"),
        ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "# uses 'dependentSchemas'"),
        ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "# uses minLength/maxLength with a pattern"),
        ({"anyOf": [{"type": "string", "format": "email", "minLength": 9}]}, "#/anyOf/0 uses minLength/maxLength"),
        ({"type": "object", "required": ["a"]}, "# uses required 'a' without it among its properties"),
        ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, "# uses a lookahead or lookbehind in its pattern"),
        (
            {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}], "required": ["a"]},
            "# uses required 'a' without it among its properties",
        ),
    ],
)
def test_json_schema_keywords_the_library_would_skip_are_refused(llm, schema, named):
    """xgrammar compiles these schemas without a word (or a log line) and does not enforce the keyword (a `not
    integer` schema lets 3 through, a `uniqueItems` one [1, 1], a `maxLength: 3` beside a pattern "abcdef", one
    that requires "a" outside its own properties {}): the
    request is refused, naming where, and queues nothing (vLLM refuses most of them for its xgrammar backend too)."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.json: {named}")):
        llm.add_request("Hello", params)
    assert llm.is_finished() and not llm.scheduler.waiting


def test_json_schemas_the_library_enforces_still_compile(llm):
    """A property named like a keyword is a name, not the keyword; one allOf, integer multipleOf, local $ref,
    uniqueItems false, maxLength without a pattern."""
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer", "multipleOf": 3},
            "if": {"allOf": [{"$ref": "#/$defs/s"}]},
            "contains": {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 1},
        },
        "$defs": {"s": {"type": "string", "maxLength": 4}},
        "required": ["not", "if"],
    }
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    output = llm.generate(["Hello"], params, use_tqdm=False)[0]
    if output["finish_reason"] == "stop":
        value = json.loads(output["text"])
        assert value["not"] % 3 == 0 and len(value["if"]) <= 4
