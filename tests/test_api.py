"""The user-facing API: arguments, errors that name the problem, loader failures, sampling."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import shutil
import subprocess

import pytest
import torch

from nanoref import LLM, ModelFolderError, SamplingParams
from nanoref.config import EngineConfig
from nanoref.layers.sampler import Sampler

from .helpers import CPU_DEFAULT_BACKEND, assert_matches_hf, copy_with_config, random_prompts


def test_unknown_keyword_raises_type_error(tiny_model):
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq'.*'max_num_seqs'"):
        LLM(tiny_model, max_num_seq=4)  # typo of max_num_seqs
    with pytest.raises(TypeError, match="positional arguments but 3 were given"):
        LLM(tiny_model, "cpu")  # every setting is a keyword


def test_llm_shows_every_setting_of_the_one_config():
    """LLM(model, **settings) builds EngineConfig: its signature (what help(LLM) prints) is the config's, its fields
    and vLLM's other names for three of them (init-only)."""
    shown = inspect.signature(LLM).parameters
    config = inspect.signature(EngineConfig).parameters
    settings = {name: p.default for name, p in config.items() if name != "model"}
    assert list(shown) == ["model", *settings]
    assert {"block_size", "num_gpu_blocks_override", "async_scheduling"} < set(settings)
    assert all(shown[name].default == default for name, default in settings.items())
    assert all(shown[name].kind is inspect.Parameter.KEYWORD_ONLY for name in settings)


def test_the_config_is_frozen_and_resolved_before_the_engine_is_built(tiny_model):
    """One config for every part: the backend, block size and KV block count concrete in it, nothing restated."""
    import dataclasses

    llm = LLM(tiny_model, device="cpu")
    config = llm.config
    assert (config.attention_backend, config.kvcache_block_size) == (CPU_DEFAULT_BACKEND, 16)
    assert config.num_kvcache_blocks == llm.scheduler.block_manager.num_blocks == llm.model_runner.kv_cache.shape[2]
    assert llm.model_runner.config is config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 1
    unresolved = EngineConfig(tiny_model, device="cpu")
    assert (unresolved.attention_backend, unresolved.kvcache_block_size, unresolved.num_kvcache_blocks) == (
        "auto",
        None,
        None,
    )
    assert unresolved.resolved().attention_backend == CPU_DEFAULT_BACKEND and unresolved.attention_backend == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the defaults of a machine without a GPU")
def test_defaults_on_cpu(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)
    assert llm.config.device.type == "cpu" and llm.config.dtype == torch.float32
    assert llm.model_runner.backend.name == CPU_DEFAULT_BACKEND  # cpp where its kernels build, else torch
    assert llm.model_runner.kv_cache.shape == (2, 2, 8, 16, 2, 16)  # (2, layers, blocks, block, Hk, D)


def test_batch_defaults_on_a_cpu_are_a_laptops_and_explicit_values_win(tiny_model):
    laptop = EngineConfig(tiny_model, device="cpu")
    assert (laptop.max_num_seqs, laptop.max_num_batched_tokens) == (64, 4096)
    chosen = EngineConfig(tiny_model, device="cpu", max_num_seqs=3, max_num_batched_tokens=100)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (3, 100)


def test_nanoref_device_sets_the_default_device_and_a_bad_one_is_named(tiny_model, monkeypatch):
    monkeypatch.setenv("NANOREF_DEVICE", "cpu")
    assert EngineConfig(tiny_model).device == torch.device("cpu")
    monkeypatch.setenv("NANOREF_DEVICE", "tpu")
    with pytest.raises(
        ValueError, match="NANOREF_DEVICE='tpu' in the environment: device must be 'cpu', 'cuda' or 'auto'"
    ):
        EngineConfig(tiny_model)
    assert EngineConfig(tiny_model, device="cpu").device == torch.device("cpu")  # an explicit device wins
    monkeypatch.delenv("NANOREF_DEVICE")
    assert EngineConfig(tiny_model).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kvcache_block_size=24), "power of two"),
        (dict(kvcache_block_size=8), "power of two"),
        (dict(max_model_len=10_000), "max_model_len"),
        (dict(attention_backend="cuda-magic"), "attention_backend"),
        (dict(dtype="float8"), "dtype"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    ],
)
def test_bad_engine_arguments(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_k=-2), "top_k"),  # (-1 is vLLM's "off": test_api_bad_input_audit.py)
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_named_and_engine_keeps_serving(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=3, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    good = random_prompts(seed=0, lengths=[5])[0]
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate([good, []], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: token id 256 is outside the vocabulary"):
        llm.generate([[1, 256]], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([list(range(64))], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([good], SamplingParams(max_tokens=100), use_tqdm=False)  # 64 tokens = 4 blocks > 3
    with pytest.raises(ValueError, match="prompt 0: the prompt has 48 tokens.* 4 KV blocks .* shorten the prompt"):
        llm.generate([list(range(1, 49))], greedy, use_tqdm=False)  # (49 tokens, a generated one too: 4 blocks > 3)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([good], [greedy, greedy], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 0: a prompt must be a string or a list of integer token ids"):
        llm.generate([[1.5, 2]], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], greedy, use_tqdm=False)
    assert llm.is_finished()  # nothing half-queued
    out = llm.generate([good], greedy, use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4 and out[0]["text"] is None
    assert llm.generate([torch.tensor(good)], greedy, use_tqdm=False) == out  # tensors of ids work too


def reassigned(**fields) -> SamplingParams:
    """Valid SamplingParams whose fields were changed afterwards (a dataclass does not stop that)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "bad_prompt,bad_params,error,match",
    [
        (list(range(64)), None, ValueError, "prompt 1: the prompt has 64 tokens but max_model_len is 64"),
        ([], None, ValueError, "prompt 1: the prompt is empty"),
        ([5, 256], None, ValueError, "prompt 1: token id 256 is outside the vocabulary"),
        ([5, -1], None, ValueError, "prompt 1: token id -1 is outside the vocabulary"),
        ([5] * 10, SamplingParams(max_tokens=60), ValueError, "prompt 1: the request needs up to 4 KV blocks"),
        ([5], reassigned(max_tokens=0), ValueError, "prompt 1: max_tokens must be a positive integer"),
        ([5], reassigned(temperature=-1.0), ValueError, r"prompt 1: temperature must be in \[0, 2\]"),
        ([5], reassigned(top_p=0.0), ValueError, r"prompt 1: top_p must be in \(0, 1\]"),
        ([5], reassigned(top_k=-2), ValueError, r"prompt 1: top_k must be an integer in \[0, 2\*\*63\)"),
        ([5], "greedy", TypeError, "prompt 1: sampling params must be SamplingParams"),
    ],
)
def test_each_bad_request_is_named_before_any_work_and_engine_keeps_serving(
    tiny_model, bad_prompt, bad_params, error, match
):
    """One bad request behind a good one: the error names it, no step runs, and later calls are served."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=3, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    good = random_prompts(seed=11, lengths=[7])[0]
    expected = llm.generate([good], greedy, use_tqdm=False)
    steps_before = list(llm.metrics.steps)
    with pytest.raises(error, match=match):
        llm.generate([good, bad_prompt], [greedy, bad_params or greedy], use_tqdm=False)
    assert llm.metrics.steps == steps_before  # no step ran, not even for the good prompt
    manager = llm.scheduler.block_manager
    assert llm.is_finished() and manager.num_free_blocks == manager.num_blocks
    assert llm.generate([good, good], greedy, use_tqdm=False) == expected * 2


def test_outputs_in_input_order_and_max_tokens(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    prompts = random_prompts(seed=9, lengths=[30, 2, 11])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1)]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [3, 9, 1]
    single = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert out == single


def test_generation_stops_at_max_model_len(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16, max_model_len=20)
    out = llm.generate(
        [list(range(1, 16))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0]["token_ids"]) == 5  # 15 prompt + 5 generated = max_model_len


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    prompts = random_prompts(seed=10, lengths=[8, 13])
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    batched = llm.generate(prompts, params, use_tqdm=False)[0]
    assert alone == batched
    other = llm.generate(
        [prompts[0]], SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True), use_tqdm=False
    )
    assert other != alone


def test_sampler_respects_top_k_and_greedy():
    logits = torch.tensor([[0.0, 5.0, 4.0, -3.0], [1.0, 0.0, 3.0, 2.0]])
    sampler = Sampler()
    draws = set()
    for _ in range(50):
        ids = sampler(logits, torch.tensor([2.0, 0.0]), torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
        assert ids[1].item() == 2  # greedy row
        draws.add(ids[0].item())
    assert draws <= {1, 2} and len(draws) == 2  # top-2 only, both reachable at temperature 2
    ids = sampler(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1e-6, 1e-6]))
    assert ids.tolist() == [1, 2]  # a tiny top_p keeps only the most likely token


# -- the loader: every way a model folder can be wrong ---------------------------------------------
def test_model_id_says_how_to_download():
    with pytest.raises(ModelFolderError, match="hf download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B") as error:
        LLM("Qwen/Qwen3-0.6B")
    # the command it names is one the installed huggingface_hub provides (1.0 removed `huggingface-cli`)
    command = str(error.value).splitlines()[-1].split()[0]
    scripts = [e.name for e in importlib.metadata.distribution("huggingface_hub").entry_points]
    assert command in scripts, f"{command!r} is not a command of huggingface_hub (it has {scripts})"


def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        LLM(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelFolderError, match="no config.json"):
        LLM(tmp_path)


def test_malformed_config(tmp_path, tiny_model):
    shutil.copytree(tiny_model, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="not valid JSON"):
        LLM(tmp_path / "m")


def test_config_missing_fields(tmp_path, tiny_model):
    folder = copy_with_config(tmp_path, tiny_model, lambda c: c.pop("hidden_size"))
    with pytest.raises(ModelFolderError, match="hidden_size"):
        LLM(folder)


def test_folder_without_weights(tmp_path, tiny_model):
    (tmp_path / "m").mkdir()
    shutil.copy(tiny_model / "config.json", tmp_path / "m")
    with pytest.raises(ModelFolderError, match="no \\*.safetensors"):
        LLM(tmp_path / "m")


def test_a_folder_named_safetensors_is_a_model_folder_error(tmp_path, tiny_model):
    shutil.copytree(tiny_model, tmp_path / "m")
    (tmp_path / "m" / "extra.safetensors").mkdir()
    with pytest.raises(ModelFolderError, match="extra.safetensors is a folder"):
        LLM(tmp_path / "m", device="cpu")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
def test_a_fifo_named_safetensors_is_refused_without_opening_it(tmp_path, tiny_model):
    shutil.copytree(tiny_model, tmp_path / "m")
    fifo = tmp_path / "m" / "extra.safetensors"
    os.mkfifo(fifo)

    # a loader that opens the FIFO waits for a writer forever (holding the GIL, inside safetensors): a writer
    # process that opens and closes it in a loop turns that hang into a failure of this test
    writer = subprocess.Popen(["sh", "-c", 'while :; do : > "$0"; done', str(fifo)])
    try:
        with pytest.raises(ModelFolderError, match="extra.safetensors is not a regular file"):
            LLM(tmp_path / "m", device="cpu")
    finally:
        writer.kill()
        writer.wait()


def test_unsupported_architecture(tmp_path, tiny_model):
    folder = copy_with_config(tmp_path, tiny_model, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ModelFolderError, match="LlamaForCausalLM is not supported"):
        LLM(folder)


def test_checkpoint_shape_mismatch(tmp_path, tiny_model):
    folder = copy_with_config(tmp_path, tiny_model, lambda c: c.update(intermediate_size=96))
    with pytest.raises(ModelFolderError, match="mlp"):
        LLM(folder)


def test_transformers4_rope_theta_is_read(tmp_path, tiny_model):
    def to_transformers4(config):
        config.pop("rope_parameters")
        config["rope_theta"] = 12345.0

    llm = LLM(copy_with_config(tmp_path, tiny_model, to_transformers4), num_kvcache_blocks=4)
    assert llm.config.hf_config.rope_theta == 12345.0


def test_checkpoint_missing_one_shard_of_a_fused_weight(tmp_path, tiny_model):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]  # q and v stay: qkv_proj would be a third garbage
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match="lacks 1 tensors: model.layers.1.self_attn.k_proj.weight"):
        LLM(tmp_path / "m")


def test_a_sharded_checkpoint_missing_shard_files_names_them(tmp_path, tiny_model):
    # a download cut short: the index lists every shard, the folder lacks some of them
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(tmp_path / "m", max_shard_size="100KB")
    shards = sorted((tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "m" / "model.safetensors.index.json").is_file()
    shards[1].unlink()
    with pytest.raises(
        ModelFolderError, match=rf"lacks .* lists 1 shard files that are not in the folder: {shards[1].name};"
    ):
        LLM(tmp_path / "m")
    for shard in shards:
        shard.unlink(missing_ok=True)
    with pytest.raises(ModelFolderError, match=rf"holds no \*.safetensors weights .* lists {len(shards)} shard files"):
        LLM(tmp_path / "m")


def test_a_sharded_checkpoint_is_the_files_its_index_lists(tmp_path, tiny_model):
    """A whole model.safetensors left beside the shards of a later save (or any other *.safetensors there): the
    index names the checkpoint's files, as vLLM reads it; the stray file was loaded too, and failed
    the model with 'tensor ... is also in ...'."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) >= 3
    shutil.copy(tiny_model / "model.safetensors", tmp_path / "m" / "model.safetensors")  # (an earlier save's)
    (tmp_path / "m" / "optimizer.safetensors").write_bytes(b"not a weights file")
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = LLM(tmp_path / "m", device="cpu", num_kvcache_blocks=16).generate(prompts, params, use_tqdm=False)
    assert_matches_hf(tiny_model, prompts, outputs, 6)
    index = tmp_path / "m" / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": ["model-00001-of-00003.safetensors"]}))
    with pytest.raises(ModelFolderError, match="index.json: weight_map must map tensor names to shard file names"):
        LLM(tmp_path / "m", device="cpu", num_kvcache_blocks=16)


def test_triton_on_the_cpu_of_a_gpu_machine_is_refused_with_the_reason(monkeypatch):
    """There Triton compiles for the GPU and cannot read CPU tensors: a clear error, not Triton's 'cpu tensor?'."""
    from nanoref.ops import backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="device='cpu' on a machine with a GPU.*use device='cuda'"):
        backends.choose_backend("triton", torch.device("cpu"), torch.float32, 16, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter reads CPU tensors: allowed
    assert backends.choose_backend("triton", torch.device("cpu"), torch.float32, 16, 16) == "triton"


def test_each_engine_numbers_its_requests_from_0(tiny_model):
    first = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)
    first.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert first.add_request([6, 7], SamplingParams(max_tokens=1)).seq_id == 2  # one engine counts on
    fresh = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)
    seqs = [fresh.add_request(prompt, SamplingParams(max_tokens=1)) for prompt in ([1, 2], [3], [4])]
    assert [seq.seq_id for seq in seqs] == [0, 1, 2]  # whatever other engines made before


def test_a_finished_sequence_shows_its_finish_reason_and_token_counts(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)
    seq = llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while not llm.is_finished():
        llm.step()
    assert repr(seq) == "Sequence(id=0, FINISHED (length), tokens=7: 3 prompt + 4 completion)"


def test_text_holding_a_lone_surrogate_is_named_before_the_tokenizer_sees_it():
    """Python (and JSON) can spell half of a UTF-16 pair, "\\udc00", which no text holds: the tokenizer's own error
    ("TextEncodeInput must be Union[...]") does not say so."""
    llm = LLM(device="cpu", num_kvcache_blocks=16)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 1: the prompt holds a lone UTF-16 surrogate \(\\udc00\)"):
        llm.generate(["Flat is", "Flat \udc00 is"], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="a stop string holds a lone UTF-16 surrogate"):
        SamplingParams(stop=["ok", "\ud800"])
    with pytest.raises(ValueError, match="a bad word holds a lone UTF-16 surrogate"):
        SamplingParams(bad_words=["\ud800 x"])
    assert llm.is_finished() and llm.generate(["Flat is"], greedy, use_tqdm=False)[0]["token_ids"]


def test_generates_switches_are_checked(tiny_model):
    """use_tqdm takes True, False or vLLM's callable; a string would read as true (and "no" show a bar)."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(TypeError, match="use_tqdm must be True, False or a callable that makes a progress bar"):
        llm.generate([[1, 2]], greedy, use_tqdm="no")
    with pytest.raises(TypeError, match="return_metrics must be True or False, got 'yes'"):
        llm.generate([[1, 2]], greedy, use_tqdm=False, return_metrics="yes")
    assert llm.is_finished()
    assert llm.generate([[1, 2]], greedy, use_tqdm=False, return_metrics=True)[0]["metrics"] is not None
