"""Attacks on the public surface: threads, half-admitted batches, global state, loose types, broken folders."""

from __future__ import annotations

import gc
import json
import math
import shutil
import threading
import weakref

import numpy as np
import pytest
import torch

from nanoref import LLM, ModelFolderError, SamplingParams, trace_shapes

from .helpers import copy_with_config, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# -- threads --------------------------------------------------------------------------------------
def test_generate_from_several_threads_is_serialized_and_correct(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=64)
    batches = [random_prompts(seed=100 + i, lengths=[3 + i, 11, 17 - i]) for i in range(4)]
    expected = [llm.generate(batch, GREEDY, use_tqdm=False) for batch in batches]
    results: dict[int, object] = {}
    start = threading.Barrier(len(batches))

    def worker(index: int) -> None:
        start.wait()  # all threads call generate at once
        try:
            results[index] = llm.generate(batches[index], GREEDY, use_tqdm=False)
        except BaseException as error:  # recorded, so the assertion below shows it
            results[index] = error

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, want in enumerate(expected):
        assert results[index] == want, f"thread {index} got {results[index]!r}"
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == 64


# -- atomic admission -----------------------------------------------------------------------------
def reassigned(**fields) -> SamplingParams:
    params = SamplingParams(temperature=0, max_tokens=4)
    for name, value in fields.items():
        setattr(params, name, value)  # past __post_init__: only the engine's own check can catch it
    return params


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(seed=2**70), r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\)"),
        (dict(seed=-(2**63) - 1), "seed must be"),
        (dict(top_k=2**63), r"top_k must be an integer in \[0, 2\*\*63\)"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False"),
        (dict(temperature=math.inf), r"temperature must be in \[0, 2\]"),
        (dict(max_tokens=True), "max_tokens must be a positive integer"),
    ],
)
def test_a_bad_request_queues_nothing_of_its_batch(tiny_model, fields, match):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    good = random_prompts(seed=1, lengths=[5])[0]
    expected = llm.generate([good], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: " + match):
        llm.generate([good, good], [GREEDY, reassigned(**fields)], use_tqdm=False)
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.scheduler.block_manager.num_free_blocks == 16
    assert llm.generate([good], GREEDY, use_tqdm=False) == expected  # the next call runs only its own request


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed=2**64), "seed must be"),
        (dict(seed=-(2**63) - 1), "seed must be"),  # (below torch's range)
        (dict(top_k=2**63), "top_k must be"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(top_p=True), "top_p must be"),
    ],
)
def test_sampling_params_refuse_values_torch_cannot_hold(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_largest_seed_and_top_k_are_served(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=2**64 - 1, top_k=2**63 - 1)
    first = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert first == llm.generate([[1, 2, 3]], params, use_tqdm=False)


# -- global state ---------------------------------------------------------------------------------
def test_llm_leaves_the_global_rng_alone(tiny_model):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    assert torch.equal(torch.get_rng_state(), before), "LLM() changed the caller's global RNG"
    seeded = SamplingParams(temperature=1.0, max_tokens=5, seed=7)
    llm.generate([[1, 2, 3], [4, 5]], seeded, use_tqdm=False)
    assert torch.equal(torch.get_rng_state(), before), "a generate with only seeded requests used the global RNG"


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"overlap_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {
            "speculative_config": {
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": "tiny",
                "min_tokens_per_step": 0,
            }
        },
        {"attention_backend": "triton"},  # (its decode reads a shared prefix once: the cascade step hook)
        {"enable_lora": True, "max_lora_rank": 8},
    ],
    ids=["plain", "overlapped", "speculative", "draft", "cascade-hook", "lora-hook"],
)
def test_del_frees_the_engine_at_once(tiny_model, settings):
    # nothing the engine holds refers back to it or its runner strongly (the step loop, a step hook, LoRA's slots), nor
    # a parameter to its layer (its weight_loader): no cycle keeps the KV cache, the weights (or tensor-parallel
    # workers) alive until the next cyclic collection, which a new engine sizing its cache from free memory would
    # race (on an H100 the next LLM() found no memory for its cache)
    spec = settings.get("speculative_config")
    if spec is not None and spec.get("model") == "tiny":
        settings = {**settings, "speculative_config": {**spec, "model": tiny_model}}
    if settings.get("attention_backend") == "triton":  # where its kernels run: the GPU, else the CPU's interpreter
        pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")
        from nanoref.ops.triton_setup import import_triton, kernel_device

        import_triton()
        settings = {**settings, "device": str(kernel_device())}
    enabled = gc.isenabled()
    gc.disable()
    try:
        llm = LLM(tiny_model, num_kvcache_blocks=16, **settings)
        llm.generate([[1, 2, 3], [1, 2, 4]], GREEDY, use_tqdm=False)
        runner = llm.model_runner
        held = {
            "the engine": weakref.ref(llm),
            "its model runner": weakref.ref(runner),
            "its model": weakref.ref(runner.model),
            "its KV cache": weakref.ref(runner.kv_cache),
        }
        weights = [weakref.ref(param) for param in runner.model.parameters()]
        del llm, runner
        alive = [name for name, ref in held.items() if ref() is not None]
        alive += [f"{n} of its {len(weights)} weights"] if (n := sum(ref() is not None for ref in weights)) else []
        assert not alive, f"{', '.join(alive)} outlived `del llm`: a reference cycle holds them"
    finally:
        if enabled:
            gc.enable()


def test_a_model_still_pickles_with_its_weak_weight_loaders(tiny_model):
    # a parameter's weight_loader calls its layer weakly (no cycle keeps a dropped engine's weights): pickled, it is
    # the unpickled layer's, as the bound method it stands for would be
    import pickle

    model = LLM(tiny_model, num_kvcache_blocks=16).model_runner.model
    copied = pickle.loads(pickle.dumps(model))
    layer, original = copied.model.layers[0].self_attn.o_proj, model.model.layers[0].self_attn.o_proj
    layer.weight.weight_loader(layer.weight, torch.ones_like(layer.weight))
    assert torch.equal(layer.weight, torch.ones_like(layer.weight))
    assert not torch.equal(original.weight, layer.weight), "the copy's loader wrote into the original's layer"
    assert layer.weight.weight_loader._bound().__self__ is layer


# -- loose types ----------------------------------------------------------------------------------
# (a dict is vLLM's prompt dict: test_api_bad_input_audit.py refuses one without its keys)
@pytest.mark.parametrize("prompt", [b"abc", {1, 2}, [True, False], [1.0, 2.0], 7.5])
def test_prompts_that_are_not_token_ids(tiny_model, prompt):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    with pytest.raises(TypeError, match="prompt 0: a prompt must be a string or a list of integer token ids"):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_prompts_as_an_array_or_a_generator(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    prompts = random_prompts(seed=2, lengths=[6, 6])
    expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.generate(np.array(prompts), GREEDY, use_tqdm=False) == expected
    assert llm.generate(torch.tensor(prompts), GREEDY, use_tqdm=False) == expected
    assert llm.generate((p for p in prompts), GREEDY, use_tqdm=False) == expected
    with pytest.raises(TypeError, match="wrap a single prompt"):
        llm.generate(np.array(prompts[0]), GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a list"):
        llm.generate(b"abc", GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_seqs=True), "max_num_seqs must be a positive integer"),
        (dict(kvcache_block_size=True), "kvcache_block_size must be"),
        (dict(num_kvcache_blocks=False), "num_kvcache_blocks must be"),
        (dict(enforce_eager="yes"), "enforce_eager must be True or False"),
        (dict(device="tpu"), "device must be 'cpu', 'cuda' or 'auto', got 'tpu'"),
        (dict(device=3.5), "device must be 'cpu', 'cuda' or 'auto'"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    ],
)
def test_engine_arguments_of_the_wrong_type(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **kwargs)


def test_step_with_nothing_queued(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    with pytest.raises(RuntimeError, match="no request waiting or running"):
        llm.step()


def test_cli_bad_device_is_one_line(capsys):
    from nanoref.__main__ import main

    assert main(["hello", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device: device must be 'cpu', 'cuda' or 'auto', got 'tpu'\n"  # (led by the flag typed)
    assert main(["hello", "--device", "cpu", "--max-tokens", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --max-tokens: max_tokens must be a positive integer")


def test_trace_names_the_stages_it_has(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    with trace_shapes(max_steps=1) as trace:
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    with pytest.raises(KeyError, match="recorded no stage 'layers.0.attn.decode'; its stages: .*layers.0.attn.varlen"):
        trace.steps[0].stage("layers.0.attn.decode")


def test_long_prompt_gets_only_nanorefs_error(capfd):
    llm = LLM(num_kvcache_blocks=64, max_model_len=256)  # the built-in model: its tokenizer says 512 tokens
    capfd.readouterr()
    with pytest.raises(ValueError, match="prompt 0: the prompt has .* tokens but max_model_len is 256"):
        llm.generate(["Beautiful is better than ugly. " * 200], GREEDY, use_tqdm=False)
    captured = capfd.readouterr()
    assert "Token indices sequence length" not in captured.err + captured.out


# -- RoPE tables ----------------------------------------------------------------------------------
def test_rope_tables_follow_max_model_len_and_are_shared(tmp_path, tiny_model):
    folder = copy_with_config(tmp_path, tiny_model, lambda c: c.update(max_position_embeddings=10_000_000))
    llm = LLM(folder, num_kvcache_blocks=16, max_model_len=128)
    model = llm.model_runner.model
    tables = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(tables) == 1, "each layer built its own RoPE table"
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffer_bytes == 2 * 128 * (16 // 2) * 4  # cos and sin, 128 positions, head_dim / 2, float32
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]


# -- model folders --------------------------------------------------------------------------------
CONFIG_EDITS = [
    (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1, got 0"),
    (lambda c: c.update(vocab_size=-5), "vocab_size must be an integer >= 1, got -5"),
    (lambda c: c.update(hidden_size="64"), "hidden_size must be an integer >= 1, got '64'"),
    (lambda c: c.update(rope_parameters=[1, 2]), r"rope_parameters must be a JSON object, got \[1, 2\]"),
    # (Qwen3's guide adds YaRN as rope_scaling; beside rope_parameters, transformers 5 runs it)
    (
        lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
        "rope_scaling: rope type 'yarn' is not supported",
    ),
    (
        lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        r"quantization_config: the checkpoint is quantized \('fp8'\); nanoref runs unquantized weights only",
    ),
    # (vLLM takes compression_config for quantization_config where that is absent: compressed-tensors' older name)
    (
        lambda c: c.update(compression_config={"quant_method": "compressed-tensors", "format": "int-quantized"}),
        r"compression_config: the checkpoint is quantized \('compressed-tensors'\); nanoref runs unquantized",
    ),
    # (Qwen3-2507's 1M-token config: vLLM changes RoPE and attention for it, transformers ignores it)
    (
        lambda c: c.update(dual_chunk_attention_config={"chunk_size": 262144, "local_size": 8192}),
        "dual_chunk_attention_config: nanoref runs plain RoPE and attention over the whole context",
    ),
    (lambda c: c.update(architectures=7), "architectures must be a list of class names, got 7"),
    (lambda c: c.update(architectures="Qwen3ForCausalLM"), "architectures must be a list of class names"),
    (lambda c: c.update(max_position_embeddings=0), "max_position_embeddings must be an integer >= 2, got 0"),
    (lambda c: c.update(rms_norm_eps=0), "rms_norm_eps must be a positive finite number, got 0"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps must be a positive finite number, got nan"),
    (lambda c: c["rope_parameters"].update(rope_theta=-1.0), "rope_theta must be a positive finite number"),
    (lambda c: c.update(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    (lambda c: c.update(eos_token_id="2"), "eos_token_id must be a token id or a list of them"),
    (lambda c: c.update(eos_token_id=5000), r"eos_token_id 5000 is outside the vocabulary \[0, "),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    # (transformers makes every layer a sliding-window one from these; nanoref would run full attention)
    (
        lambda c: c.pop("layer_types") and c.update(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        "use_sliding_window is on",
    ),
    (lambda c: c.update(layer_types=["sliding_attention"] * c["num_hidden_layers"]), "layer_types holds 'sliding"),
    (lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1), r"layer_types must be a list of num_hidden"),
    (lambda c: c.update(dtype="bogus"), "dtype must name a torch dtype"),
]


@pytest.mark.parametrize("edit, match", CONFIG_EDITS)
def test_bad_config_values_name_file_and_field(tmp_path, tiny_model, edit, match):
    folder = copy_with_config(tmp_path, tiny_model, edit)
    with pytest.raises(ModelFolderError, match=f"config.json: {match}"):
        LLM(folder)


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.update(use_sliding_window=True),  # (its layer_types, all full attention, decide)
        lambda c: c.pop("layer_types") and c.update(use_sliding_window=True, sliding_window=None),
        lambda c: c.pop("layer_types") and c.update(use_sliding_window=True, max_window_layers=c["num_hidden_layers"]),
        lambda c: c.update(use_sliding_window=None, dtype="float16", torch_dtype="bfloat16"),
    ],
    ids=["layer-types-decide", "no-window", "window-past-the-last-layer", "null-switch-and-dtypes"],
)
def test_configs_transformers_runs_as_full_attention_load(tmp_path, tiny_model, edit):
    """The sliding-window rule is transformers' own, not any mention of a window: these configs attend over the
    whole context there too, and load (and generate) here."""
    folder = copy_with_config(tmp_path, tiny_model, edit)
    assert LLM(folder, device="cpu", num_kvcache_blocks=8).generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\xff\xfe{}", "is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"[1, 2]", "must hold a JSON object"),
    ],
)
def test_unreadable_config(tmp_path, tiny_model, content, match):
    shutil.copytree(tiny_model, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_bytes(content)
    with pytest.raises(ModelFolderError, match=match):
        LLM(tmp_path / "m")


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_broken_safetensors_name_the_file(tmp_path, tiny_model, damage):
    shutil.copytree(tiny_model, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x07" * 4096}[damage])
    with pytest.raises(ModelFolderError, match="model.safetensors: not a readable safetensors file"):
        LLM(tmp_path / "m")


def _rewrite_weights(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for name, tensors_of_file in edit(tensors).items():
        save_file(tensors_of_file, str(folder / name), metadata={"format": "pt"})


def test_integer_weights_are_refused(tmp_path, tiny_model):
    shutil.copytree(tiny_model, tmp_path / "m")
    name = "model.norm.weight"
    _rewrite_weights(tmp_path / "m", lambda t: {"model.safetensors": {**t, name: t[name].to(torch.int32)}})
    with pytest.raises(ModelFolderError, match=f"tensor '{name}' has dtype torch.int32, not a float"):
        LLM(tmp_path / "m")


def test_a_tensor_in_two_shards_is_refused(tmp_path, tiny_model):
    shutil.copytree(tiny_model, tmp_path / "m")
    name = "model.norm.weight"
    _rewrite_weights(tmp_path / "m", lambda t: {"model.safetensors": t, "extra.safetensors": {name: t[name] * 2}})
    with pytest.raises(ModelFolderError, match=f"model.safetensors: tensor '{name}' is also in extra.safetensors"):
        LLM(tmp_path / "m")


def test_tied_config_beside_a_different_lm_head_is_refused(tmp_path, tiny_model):
    folder = copy_with_config(tmp_path, tiny_model, lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(ModelFolderError, match="tie_word_embeddings: true, but model.safetensors holds an lm_head"):
        LLM(folder)


def test_tied_checkpoint_that_also_stores_the_same_head_loads(tmp_path, tiny_models):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["gqa1-tied"], folder)
    _rewrite_weights(
        folder, lambda t: {"model.safetensors": {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()}}
    )
    llm = LLM(folder, num_kvcache_blocks=16)
    reference = LLM(tiny_models["gqa1-tied"], num_kvcache_blocks=16)
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False) == reference.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"model": {"type": "BPE"}})])
def test_corrupt_tokenizer_names_it(tmp_path, content):
    from nanoref import DEFAULT_MODEL

    shutil.copytree(DEFAULT_MODEL, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text(content)
    with pytest.raises(ModelFolderError, match=r"the tokenizer \(tokenizer.json.*\) could not be loaded"):
        LLM(tmp_path / "m")


def test_a_step_that_raises_leaves_no_context_behind(tiny_model, monkeypatch):
    from nanoref.utils.context import get_context

    llm = LLM(tiny_model, num_kvcache_blocks=16)

    def broken_forward(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.model_runner.model, "forward", broken_forward)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    context = get_context()
    assert context.slot_mapping is None and context.cu_seqlens_q is None, "the failed step's metadata stayed published"
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == 16


def test_unseeded_sampling_differs_between_engines(tiny_model):
    """Each LLM seeds its own generator from fresh entropy: two runs of a program do not repeat each other."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    first = LLM(tiny_model, num_kvcache_blocks=16).generate([[1, 2, 3]], params, use_tqdm=False)
    second = LLM(tiny_model, num_kvcache_blocks=16).generate([[1, 2, 3]], params, use_tqdm=False)
    assert first[0]["token_ids"] != second[0]["token_ids"]


# -- structure ------------------------------------------------------------------------------------
def test_config_json_is_read_once_per_llm(tiny_model, monkeypatch):
    import nanoref.models as models

    calls = []
    original = models.read_config
    monkeypatch.setattr(models, "read_config", lambda folder: calls.append(folder) or original(folder))
    LLM(tiny_model, num_kvcache_blocks=16)
    assert len(calls) == 1


def test_engine_config_runs_no_kernel(tiny_model, monkeypatch):
    """The flash-attn probe belongs to resolving the config (`resolved()`, once, before the engine is built), not
    to making one."""
    from nanoref.config import EngineConfig
    from nanoref.ops import backends

    def probe(*args):
        raise AssertionError("EngineConfig probed flash-attn")

    monkeypatch.setattr(backends, "flash_attn_serves", probe)
    config = EngineConfig(tiny_model, attention_backend="auto")
    assert config.attention_backend == "auto" and config.kvcache_block_size is None


def _nanoref_imports(path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanoref"):
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("nanoref")}
    return names


def test_layers_of_the_package_import_downwards():
    """utils/ imports nothing above it (only utils), and nanoref.ops does not import its backends module back."""
    from pathlib import Path

    import nanoref

    package = Path(nanoref.__file__).parent
    for path in sorted((package / "utils").glob("*.py")):
        upward = {name for name in _nanoref_imports(path) if not name.startswith("nanoref.utils")}
        assert not upward, f"{path.name} imports {sorted(upward)}"
    assert not {n for n in _nanoref_imports(package / "ops" / "__init__.py") if "backends" in n}


# each file's layer, bottom up: a file imports from its own layer or below, never above
LAYERS = [
    ("utils", "sampling_params", "testing", "parallel.state"),  # no engine knowledge: imported by everything
    # (parallel.state: which rank a process is, and the collectives the layers call)
    ("models.configs",),  # config.json's fields as dataclasses: parsing only, no tensors or modules
    ("ops",),  # kernels and their references
    ("layers",),  # nn.Modules on flat (N, hidden) tokens
    ("models",),
    ("config",),
    ("engine",),  # the core: sequence, block manager, scheduler, model runner, the plain loop
    (
        "cuda_graphs",
        "overlap",
        "parallel",
        "speculative",
        "lora",
        "structured_output",
        "warmup",
        "cascade",
    ),  # features attached to the
    # core from outside: decode graphs, the overlapped loop, tensor parallelism, speculative decoding, LoRA adapters,
    # grammars
    ("llm",),  # the one wiring point
    ("serving", "serve"),  # the online front on an LLM: the async loop, the OpenAI-compatible server
    ("__init__", "__main__"),  # the package's face and its command line
    ("exercises",),  # checks that run the whole engine
    ("classroom", "train_default_model"),
]


def _import_graph() -> dict[str, set[str]]:
    """nanoref module -> the nanoref modules it imports, at the top or inside a function alike."""
    from pathlib import Path

    import nanoref

    package = Path(nanoref.__file__).parent

    def name_of(path: Path) -> str:
        parts = ["nanoref", *path.relative_to(package).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(path): path for path in package.rglob("*.py")}
    return {
        name: {target for target in _nanoref_imports(path) if target in files and target != name}
        for name, path in files.items()
    }


def _layer(module: str) -> int:
    """A module's index in LAYERS: by its own entry there ("models.configs") if it has one, else by its folder."""
    parts = module.split(".")[1:] or ["__init__"]
    for name in (".".join(parts[:2]), parts[0]):
        for index, names in enumerate(LAYERS):
            if name in names:
                return index
    raise AssertionError(f"{module} has no layer in LAYERS")


def test_no_file_imports_a_layer_above_its_own():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in _import_graph().items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert upward == [], "\n".join(upward)


FEATURES = ("cuda_graphs", "overlap", "parallel", "speculative", "lora", "structured_output", "warmup", "cascade")


def test_features_are_attached_only_at_the_wiring_point():
    """The core never reaches a feature module, and each feature stands alone: only nanoref.llm (which attaches
    them) and what teaches them (exercises) import them."""

    def part(module: str) -> str:
        if module == "nanoref.parallel.state":  # (the rank state the layers read: not the feature itself)
            return "parallel.state"
        return module.split(".")[1] if "." in module else "__init__"

    reaching = [
        f"{module} imports {target}"
        for module, targets in _import_graph().items()
        for target in sorted(targets)
        if part(target) in FEATURES and part(module) not in ("llm", "exercises", part(target))
    ]
    assert reaching == [], "\n".join(reaching)


# what a core file must not name: the features attached to it from outside (it offers hooks instead)
FEATURE_WORDS = r"overlap|speculat|draft|cuda.?graph|tensor.?parallel|lora|cascade|nanoref[./](parallel)\b"
CORE_FILES = ["sequence", "block_manager", "scheduler", "model_runner", "llm_engine"]


def test_no_core_file_names_a_feature():
    """The five core files offer hooks (a step loop, decode graphs, a lookahead) and name no feature that uses
    them, not even in a comment: a learner reads the core as Nano-vLLM's, and the features in their own modules."""
    import re
    from pathlib import Path

    import nanoref

    engine = Path(nanoref.__file__).parent / "engine"
    named = [
        f"engine/{name}.py:{number}: {line.strip()}"
        for name in CORE_FILES
        for number, line in enumerate((engine / f"{name}.py").read_text().splitlines(), 1)
        if re.search(FEATURE_WORDS, line, re.IGNORECASE)
    ]
    assert named == [], "\n".join(named)


def test_no_two_files_import_each_other_even_indirectly():
    graph = _import_graph()
    cycles = []
    for start in sorted(graph):  # a path from start back to itself (every file is small: a plain search will do)
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert cycles == [], "\n".join(sorted(set(cycles))[:10])


def test_the_config_classes_live_in_models_configs_and_the_models_name_them():
    from nanoref import models
    from nanoref.models import configs, qwen3, qwen3_moe

    assert (models.Qwen3Config, models.Qwen3MoeConfig) == (configs.Qwen3Config, configs.Qwen3MoeConfig)
    assert qwen3.Qwen3ForCausalLM.config_class is configs.Qwen3Config
    assert qwen3_moe.Qwen3MoeForCausalLM.config_class is configs.Qwen3MoeConfig
