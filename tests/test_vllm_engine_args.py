"""vLLM's engine arguments, in `LLM(...)` and as the server's flags: each is honoured with vLLM's meaning, accepted
where it truly changes nothing in nanoref, or refused with a ValueError that names it, before anything is built."""

from __future__ import annotations

import shutil

import pytest

import nanoref.llm
from nanoref import LLM, SamplingParams
from nanoref.config import DEVICE_DEFAULTS, EngineConfig
from nanoref.llm import DEFAULT_MODEL
from nanoref.testing import EVERY_STEP

from .helpers import serve_settings

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
# 42 tokens of the built-in model's tokenizer: two full 16-token blocks the prefix cache can share
PROMPT = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. " * 2


def cpu_llm(**settings) -> LLM:
    return LLM(device="cpu", attention_backend="torch", **settings)


def nothing_is_built(monkeypatch) -> None:
    monkeypatch.setattr(nanoref.llm, "build_runner", lambda *a, **k: pytest.fail("the model runner was built"))


# -- vLLM's names for nanoref's settings ------------------------------------------------------------------------------
def test_vllms_names_set_nanorefs_settings():
    llm = cpu_llm(block_size=32, num_gpu_blocks_override=40, async_scheduling=False)
    assert llm.config.kvcache_block_size == 32
    assert llm.config.num_kvcache_blocks == 40
    assert llm.config.overlap_scheduling is False
    assert llm.scheduler.block_manager.block_size == 32 and llm.scheduler.block_manager.num_blocks == 40
    # both names with the same value are one setting given twice, which is no conflict
    assert EngineConfig(DEFAULT_MODEL, device="cpu", block_size=64, kvcache_block_size=64).kvcache_block_size == 64


@pytest.mark.parametrize(
    "settings",
    [
        dict(block_size=32, kvcache_block_size=64),
        dict(num_gpu_blocks_override=40, num_kvcache_blocks=50),
        dict(async_scheduling=True, overlap_scheduling=False),
    ],
)
def test_both_names_with_two_values_are_a_value_error(settings, monkeypatch):
    nothing_is_built(monkeypatch)
    alias = next(iter(settings))
    with pytest.raises(ValueError, match=f"{alias}=.* are one setting"):
        cpu_llm(**settings)


def test_a_bad_value_under_vllms_name_is_refused_like_nanorefs(monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match="kvcache_block_size must be a power of two"):
        cpu_llm(block_size=24)


def test_an_unknown_name_is_a_type_error_listing_vllms_names_too():
    with pytest.raises(TypeError, match="unexpected keyword argument 'swap_spce'") as error:
        cpu_llm(swap_spce=4)
    for name in ("block_size", "num_gpu_blocks_override", "enable_prefix_caching", "max_logprobs"):
        assert repr(name) in str(error.value)


# -- enable_prefix_caching ------------------------------------------------------------------------------------------
def test_prefix_caching_off_means_no_request_reads_anothers_blocks():
    cached = cpu_llm()
    cached.generate([PROMPT], GREEDY, use_tqdm=False)
    cached.generate([PROMPT], GREEDY, use_tqdm=False)
    assert cached.metrics.steps[0].num_hit_blocks == 2  # the control: the same prompt again hits its two blocks

    uncached = cpu_llm(enable_prefix_caching=False)
    first = uncached.generate([PROMPT], GREEDY, use_tqdm=False)
    again = uncached.generate([PROMPT], GREEDY, use_tqdm=False)
    assert [step.num_hit_blocks for step in uncached.metrics.steps] == [0, 0, 0]
    assert uncached.metrics.steps[0].num_tokens == 42  # the whole prompt computed again
    assert again[0]["token_ids"] == first[0]["token_ids"]


def test_prefix_caching_off_gives_each_of_n_samples_its_own_prompt_as_vllm():
    llm = cpu_llm(enable_prefix_caching=False)
    llm.generate([PROMPT], SamplingParams(n=3, max_tokens=2), use_tqdm=False)
    first = llm.metrics.steps[0]
    # queued together, each computing all 42 prompt tokens (with the cache on, samples 1..2 wait for sample 0's
    # prompt and reuse its blocks: tests/test_api.py)
    assert first.kind == "prefill" and [n for _, n in first.seqs] == [42, 42, 42]
    assert all(step.num_hit_blocks == 0 for step in llm.metrics.steps)


def test_prefix_caching_must_be_a_bool(monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        cpu_llm(enable_prefix_caching="no")


# -- enable_chunked_prefill -----------------------------------------------------------------------------------------
def test_chunked_prefill_off_prefills_every_prompt_whole():
    prompts = [[1] * 40, [2] * 40]
    chunked = cpu_llm(max_num_batched_tokens=64, max_model_len=64)
    chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert chunked.metrics.steps[0].seqs[1][1] == 24  # the control: the second prompt's first chunk fills the step

    whole = cpu_llm(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    outputs = whole.generate(prompts, GREEDY, use_tqdm=False)
    steps = whole.metrics.steps
    assert [(step.kind, [n for _, n in step.seqs]) for step in steps[:2]] == [("prefill", [40]), ("prefill", [40])]
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in chunked.generate(prompts, GREEDY, False)]


def test_chunked_prefill_off_needs_a_step_to_hold_the_longest_prompt(monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than max_model_len \(64\)"):
        cpu_llm(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)
    # left out, the budget grows to max_model_len, as vLLM's does
    monkeypatch.setitem(DEVICE_DEFAULTS["cpu"], "max_num_batched_tokens", 128)
    assert EngineConfig(DEFAULT_MODEL, device="cpu", max_model_len=512).max_num_batched_tokens == 128  # the control
    config = EngineConfig(DEFAULT_MODEL, device="cpu", max_model_len=512, enable_chunked_prefill=False)
    assert config.max_num_batched_tokens == 512


# -- max_logprobs ---------------------------------------------------------------------------------------------------
def test_max_logprobs_caps_what_a_request_may_ask_for():
    llm = cpu_llm(max_logprobs=2)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 2
    with pytest.raises(ValueError, match="Requested sample logprobs of 3, which is greater than max allowed: 2"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 5, which is greater than max allowed: 2"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    assert llm.scheduler.is_finished()  # nothing queued


@pytest.mark.parametrize("value", [-1, 21, 2.0, None])
def test_max_logprobs_beyond_nanorefs_twenty_is_refused(value, monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match=r"max_logprobs must be an integer in \[0, 20\]"):
        cpu_llm(max_logprobs=value)


# -- tokenizer, tokenizer_mode --------------------------------------------------------------------------------------
def test_tokenizer_folder_serves_a_model_folder_that_has_none(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL / name, model / name)
    with pytest.raises(ValueError, match="has no tokenizer"):  # the control: text needs a tokenizer
        LLM(model, device="cpu").generate([PROMPT], GREEDY, use_tqdm=False)
    llm = LLM(model, device="cpu", tokenizer=str(DEFAULT_MODEL))
    assert llm.config.tokenizer_folder == DEFAULT_MODEL and llm.get_tokenizer() is not None
    reference = LLM(device="cpu").generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["text"] == reference["text"]


# -- skip_tokenizer_init --------------------------------------------------------------------------------------------
TOKEN_IDS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)


def test_skip_tokenizer_init_loads_none_and_serves_token_ids_as_the_engine_with_one(monkeypatch):
    import asyncio

    from nanoref.serving.async_llm import AsyncLLM

    loaded = []
    monkeypatch.setattr(nanoref.config, "load_tokenizer", lambda *a, **k: loaded.append(a) or None)
    skipped = LLM(device="cpu", skip_tokenizer_init=True, num_kvcache_blocks=32)
    assert skipped.tokenizer is None and loaded == [], "skip_tokenizer_init=True still loaded the tokenizer"
    with pytest.raises(ValueError, match="skip_tokenizer_init"):  # (vLLM's)
        skipped.get_tokenizer()
    monkeypatch.undo()
    reference = LLM(device="cpu", num_kvcache_blocks=32)
    prompt = reference.get_tokenizer().encode(PROMPT)
    expected = reference.generate([prompt], TOKEN_IDS, use_tqdm=False)[0]["token_ids"]
    assert skipped.generate([prompt], TOKEN_IDS, use_tqdm=False)[0]["token_ids"] == expected
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert skipped.generate([prompt], greedy, use_tqdm=False)[0]["text"] is None  # (as from a folder without one)
    # what needs a tokenizer says that it was skipped (the folder has one)
    for call, needs in (
        (lambda: skipped.generate([PROMPT], TOKEN_IDS, use_tqdm=False), "pass prompts as lists of token ids"),
        (lambda: list(skipped.stream(prompt, greedy)), "a stream of text needs one"),
        (lambda: skipped.generate([prompt], SamplingParams(detokenize=False, bad_words=["x"])), "bad_words needs"),
        (lambda: skipped.chat([{"role": "user", "content": "hi"}]), "chat needs one"),
    ):
        with pytest.raises(ValueError, match=f"skip_tokenizer_init=True loads no tokenizer: {needs}"):
            call()
    assert skipped.scheduler.is_finished()  # (nothing queued)
    engine = AsyncLLM(skipped)  # the thread form: token ids in and out

    async def stream() -> list[int]:
        with pytest.raises(ValueError, match="skip_tokenizer_init=True loads no tokenizer: a stream of text needs"):
            engine.generate(prompt, greedy)
        outputs = [out async for out in engine.generate(prompt, TOKEN_IDS)]
        assert all(out.text == "" for out in outputs) and outputs[-1].finished
        return outputs[-1].cumulative_token_ids

    try:
        assert asyncio.run(asyncio.wait_for(stream(), 60)) == expected
    finally:
        engine.close()


def test_an_engine_process_with_skip_tokenizer_init_streams_token_ids():
    import asyncio

    from nanoref.serving.async_llm import AsyncLLM

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = LLM(device="cpu", num_kvcache_blocks=32).generate([prompt], TOKEN_IDS, use_tqdm=False)[0]["token_ids"]
    engine = AsyncLLM.from_model(engine_process=True, device="cpu", skip_tokenizer_init=True, num_kvcache_blocks=32)
    assert engine.tokenizer is None

    async def stream() -> list[int]:
        outputs = [out async for out in engine.generate(prompt, TOKEN_IDS)]
        return outputs[-1].cumulative_token_ids

    try:
        assert asyncio.run(asyncio.wait_for(stream(), 60)) == expected
    finally:
        engine.close()


def test_skip_tokenizer_init_with_a_draft_model_loads_no_tokenizer_to_compare(monkeypatch):
    """A draft's tokenizer is checked against the target's by loading both: with skip_tokenizer_init, neither."""
    monkeypatch.setattr(nanoref.llm, "check_draft_tokenizer", lambda *a: pytest.fail("tokenizers were loaded"))
    spec = {"method": "draft_model", "model": str(DEFAULT_MODEL), "num_speculative_tokens": 2, **EVERY_STEP}
    llm = LLM(device="cpu", skip_tokenizer_init=True, speculative_config=spec, num_kvcache_blocks=32)
    assert llm.tokenizer is None
    assert len(llm.generate([[3, 1, 4, 1, 5]], TOKEN_IDS, use_tqdm=False)[0]["token_ids"]) == 4
    assert sum(record.num_draft_tokens for record in llm.metrics.steps) > 0, "the draft never proposed"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_skip_tokenizer_init_must_be_a_bool(value, monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match=f"skip_tokenizer_init must be True or False, got {value!r}"):
        cpu_llm(skip_tokenizer_init=value)


def test_a_tokenizer_folder_that_is_missing_or_holds_none_is_refused(tmp_path, monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match="tokenizer: model folder .* does not exist"):
        cpu_llm(tokenizer=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="tokenizer: .* holds no tokenizer"):
        cpu_llm(tokenizer=str(tmp_path))


@pytest.mark.parametrize("mode", ["mistral", "custom", "fast"])
def test_a_tokenizer_mode_nanoref_lacks_is_refused(mode, monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match=f"tokenizer_mode.*{mode!r}"):
        cpu_llm(tokenizer_mode=mode)


def test_tokenizer_mode_hf_is_the_fast_tokenizer_and_slow_is_never_a_fast_one(monkeypatch):
    assert cpu_llm(tokenizer_mode="hf").tokenizer.is_fast
    nothing_is_built(monkeypatch)  # (the tokenizer loads before the model runner)
    try:
        llm = cpu_llm(tokenizer_mode="slow")
    except ValueError:
        return  # this transformers loads no slow tokenizer for the folder: refused, not served by a fast one
    assert not llm.tokenizer.is_fast


# -- accepted: they change nothing in nanoref -----------------------------------------------------------------------
def test_arguments_that_change_nothing_here_are_accepted():
    settings = dict(
        trust_remote_code=True,
        download_dir="/nonexistent/cache",
        disable_log_stats=True,
        swap_space=4,
        max_seq_len_to_capture=8192,
        load_format="safetensors",
        served_model_name=["qwen", "tiny"],
    )
    llm = cpu_llm(**settings)
    assert {name: getattr(llm.config, name) for name in settings} == settings
    assert (
        llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]
        == (cpu_llm().generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"])
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("trust_remote_code", "yes"),
        ("disable_log_stats", 1),
        ("swap_space", -1),
        ("max_seq_len_to_capture", 0),
        ("download_dir", 3),
        ("served_model_name", []),
    ],
)
def test_a_bad_value_of_an_accepted_argument_is_a_value_error(name, value, monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match=f"^{name} must"):
        cpu_llm(**{name: value})


# -- refused: what they ask for nanoref does not have ---------------------------------------------------------------
@pytest.mark.parametrize(
    "name, value, why",
    [
        ("revision", "main", "Hugging Face Hub"),
        ("tokenizer_revision", "v1", "Hugging Face Hub"),
        ("quantization", "awq", "unquantized weights only"),
        ("compilation_config", 3, "no compilation settings"),
        ("compilation_config", {"level": 0}, "no compilation settings"),
        ("load_format", "pt", r"\*.safetensors weights only"),
    ],
)
def test_what_nanoref_lacks_is_refused_naming_the_argument(name, value, why, monkeypatch):
    nothing_is_built(monkeypatch)
    with pytest.raises(ValueError, match=f"^{name}=.* is not available in nanoref: .*{why}"):
        cpu_llm(**{name: value})


# -- the server's flags ---------------------------------------------------------------------------------------------
def test_vllms_flags_reach_the_engine(monkeypatch):
    pytest.importorskip("uvicorn")
    settings = serve_settings(
        monkeypatch,
        [
            "--block-size", "32",
            "--num-gpu-blocks-override", "64",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--async-scheduling",
            "--max-logprobs", "5",
            "--tokenizer", "/tok",
            "--tokenizer-mode", "hf",
            "--trust-remote-code",
            "--download-dir", "/cache",
            "--load-format", "safetensors",
            "--swap-space", "8",
            "--max-seq-len-to-capture", "4096",
            "--disable-log-stats",
        ],
    )  # fmt: skip
    assert settings["kvcache_block_size"] == 32
    assert settings["num_gpu_blocks_override"] == 64
    assert settings["enable_prefix_caching"] is False and settings["enable_chunked_prefill"] is False
    assert settings["async_scheduling"] is True
    assert settings["max_logprobs"] == 5
    assert (settings["tokenizer"], settings["tokenizer_mode"]) == ("/tok", "hf")
    assert settings["trust_remote_code"] is True
    assert (settings["download_dir"], settings["load_format"]) == ("/cache", "safetensors")
    assert (settings["swap_space"], settings["max_seq_len_to_capture"]) == (8.0, 4096)
    assert serve_settings(monkeypatch, ["--enable-prefix-caching"])["enable_prefix_caching"] is True
    # left out, the engine's defaults apply
    plain = serve_settings(monkeypatch, [])
    assert not {"kvcache_block_size", "enable_prefix_caching", "max_logprobs", "tokenizer", "quantization"} & set(plain)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--quantization", "awq"], "--quantization: quantization='awq' is not available"),
        (["-q", "gptq"], "--quantization: quantization='gptq' is not available"),
        (["--revision", "main"], "--revision: revision='main' is not available"),
        (["--block-size", "24"], "--block-size: kvcache_block_size must be a power of two"),
        (["--max-logprobs", "50"], "--max-logprobs: max_logprobs must be an integer in [0, 20]"),
        (["--compilation-config", "3"], "--compilation-config: compilation_config='3' is not available"),
        (["--num-gpu-blocks-override", "8", "--num-kvcache-blocks", "9"], "--num-gpu-blocks-override: "),
    ],
)
def test_a_flag_nanoref_refuses_is_one_line_naming_it(args, flag, monkeypatch, capsys):
    pytest.importorskip("uvicorn")
    from nanoref.serve import main

    nothing_is_built(monkeypatch)
    assert main(["--device", "cpu", "--port", "0", "--engine-process", "off", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}") and err.count("\n") == 1
