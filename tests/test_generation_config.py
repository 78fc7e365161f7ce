"""A model folder's generation_config.json, read as vLLM reads it: its sampling settings are the defaults of a request
that names none (offline, streamed, AsyncLLM and the server), and its EOS ids end a completion as HF's `generate`
ends it, named as the stop_reason. The built-in model in folder copies whose generation_config.json each test
writes; HF transformers reads the same folders as the oracle of where a completion ends."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

import nanoref.llm
from nanoref import LLM, SamplingParams
from nanoref.config import EngineConfig
from nanoref.llm import DEFAULT_MODEL
from nanoref.serving.async_llm import AsyncLLM

from .helpers import SERVER_TIMEOUT, hf_greedy, serve_settings

PROMPTS = ["Beautiful is better than", "Flat is better than", "Errors should never", "Now is better than"]
HOT = dict(temperature=2.0, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.3)  # (max_new_tokens: 6)


def model_with(tmp_path, generation: dict | str | None, name: str = "model") -> str:
    """A copy of the built-in model whose generation_config.json holds `generation` (a dict laid over the original,
    a string written as it is, None: no file)."""
    folder = tmp_path / name
    shutil.copytree(DEFAULT_MODEL, folder)
    path = folder / "generation_config.json"
    if generation is None:
        path.unlink()
    elif isinstance(generation, str):
        path.write_text(generation)
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    return str(folder)


def newline_id() -> int:
    ids = LLM(device="cpu").get_tokenizer().encode("\n")
    assert len(ids) == 1
    return ids[0]


# -- EOS ids ---------------------------------------------------------------------------------------------------------
def test_an_eos_id_of_the_generation_config_ends_a_completion_where_hf_generate_ends_it(tmp_path):
    newline = newline_id()
    folder = model_with(tmp_path, {"eos_token_id": [0, newline]})  # (config.json's EOS is 0 alone)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    llm = LLM(folder, device="cpu")
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(folder, prompt_ids, 12)  # HF reads the same file's eos_token_id list
    assert out["token_ids"][-1] == newline and len(out["token_ids"]) < 12
    assert out["finish_reason"] == "stop" and out.outputs[0].stop_reason == newline  # (vLLM's: a stop id)
    assert out["text"] == " ugly." and greedy.stop_token_ids == []  # the token's text left out; params untouched
    plain = LLM(device="cpu").generate(PROMPTS[:1], greedy, use_tqdm=False)[0]  # the control: the original folder
    assert len(plain["token_ids"]) == 12 and newline in plain["token_ids"]


def with_config_eos(folder: str, eos: int) -> str:
    path = Path(folder) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    return folder


def test_config_jsons_eos_id_stops_only_where_generation_config_json_names_it_as_in_hf_generate(tmp_path):
    """HF's `generate` and vLLM take generation_config.json's eos_token_id over config.json's (vLLM: and the
    tokenizer's, here 0 in both); a folder without the file reads config.json's."""
    newline = newline_id()
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    replaced = with_config_eos(model_with(tmp_path, {"eos_token_id": [0]}), newline)  # (the file: 0 alone)
    llm = LLM(replaced, device="cpu")
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(replaced, prompt_ids, 12)
    assert len(out["token_ids"]) == 12 and newline in out["token_ids"] and out["finish_reason"] == "length"
    no_file = with_config_eos(model_with(tmp_path, None, name="no_file"), newline)  # (the control)
    out = LLM(no_file, device="cpu").generate(PROMPTS[:1], greedy, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(no_file, prompt_ids, 12)
    assert out["token_ids"][-1] == newline and len(out["token_ids"]) < 12 and out["finish_reason"] == "stop"


def test_ignore_eos_ignores_the_generation_configs_eos_ids_and_generation_config_vllm_keeps_them(tmp_path):
    newline = newline_id()
    folder = model_with(tmp_path, {"eos_token_id": [0, newline]})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = LLM(folder, device="cpu").generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    # "vllm" leaves the file's sampling settings out, not its EOS ids (as vLLM reads them in either mode)
    llm = LLM(folder, device="cpu", generation_config="vllm")
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out["token_ids"][-1] == newline and out.outputs[0].stop_reason == newline


def test_min_tokens_masks_the_generation_configs_eos_ids_under_ignore_eos_too(tmp_path):
    # vLLM masks every stop id it knows before min_tokens, the file's EOS ids among them, whatever ignore_eos says
    newline = newline_id()
    folder = model_with(tmp_path, {"eos_token_id": [0, newline]})
    pushed = dict(temperature=0.0, max_tokens=6, logit_bias={newline: 100.0})
    llm = LLM(folder, device="cpu")
    for ignore_eos in (True, False):
        params = SamplingParams(**pushed, min_tokens=3, ignore_eos=ignore_eos)
        ids = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]["token_ids"]
        assert newline not in ids[:3], (ignore_eos, ids)
        assert ids[3:] == ([newline] * 3 if ignore_eos else [newline]), (ignore_eos, ids)


def test_a_draft_models_generation_config_is_never_read(tmp_path):
    # requests take the target's defaults and EOS ids: a draft folder's file (here one that is not JSON) stops nothing
    draft = model_with(tmp_path, "{not json", name="draft")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2, "min_tokens_per_step": 0}
    llm = LLM(device="cpu", speculative_config=spec)
    assert llm.model_runner.draft is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    expected = LLM(device="cpu").generate(PROMPTS, greedy, use_tqdm=False)
    assert [o["token_ids"] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == [o["token_ids"] for o in expected]
    with pytest.raises(ValueError, match="generation_config.json"):  # (the control: as a target, the file is read)
        LLM(draft, device="cpu")
    with pytest.raises(ValueError, match="override_generation_config with generation_config given as defaults"):
        defaults = llm.config.generation_defaults
        LLM(draft, device="cpu", generation_config=defaults, override_generation_config={"top_k": 2})


# -- sampling defaults -----------------------------------------------------------------------------------------------
def test_the_generation_configs_sampling_is_what_a_call_without_params_samples_with(tmp_path):
    folder = model_with(tmp_path, {**HOT, "max_new_tokens": 6, "do_sample": True})
    llm = LLM(folder, device="cpu", seed=0)
    assert llm.get_default_sampling_params() == SamplingParams(**HOT, max_tokens=6)
    defaults = [out["token_ids"] for out in llm.generate(PROMPTS, use_tqdm=False)]
    spelled = LLM(device="cpu", seed=0).generate(PROMPTS, SamplingParams(**HOT, max_tokens=6), use_tqdm=False)
    assert defaults == [out["token_ids"] for out in spelled]
    plain = LLM(device="cpu", seed=0).generate(PROMPTS, use_tqdm=False)  # the control: SamplingParams' defaults
    assert [out["token_ids"][:6] for out in plain] != defaults and len(plain[0]["token_ids"]) > 6
    # stream() and AsyncLLM take the same defaults
    assert sum(len(piece.token_ids) for piece in llm.stream(PROMPTS[0])) == 6

    engine = AsyncLLM(llm)
    try:

        async def served() -> list:
            return [out async for out in engine.generate(PROMPTS[0])]

        outs = asyncio.run(asyncio.wait_for(served(), SERVER_TIMEOUT))
    finally:
        engine.close()
    assert len(outs[-1].cumulative_token_ids) == 6


def test_generation_config_vllm_a_folder_and_the_override_choose_the_defaults(tmp_path):
    folder = model_with(tmp_path, {**HOT, "max_new_tokens": 6})
    assert LLM(folder, device="cpu", generation_config="vllm").get_default_sampling_params() == SamplingParams()
    # do_sample is not read (vLLM reads none of the file's other keys): the built-in model's file says false
    assert json.loads((DEFAULT_MODEL / "generation_config.json").read_text())["do_sample"] is False
    assert LLM(device="cpu").get_default_sampling_params() == SamplingParams()
    # a folder's file serves in place of the model's; the override is laid over either
    llm = LLM(device="cpu", generation_config=folder, override_generation_config={"temperature": 0.0})
    assert llm.get_default_sampling_params() == SamplingParams(**{**HOT, "temperature": 0.0}, max_tokens=6)
    llm = LLM(device="cpu", generation_config="vllm", override_generation_config={"max_new_tokens": 3})
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=3)
    # no generation_config.json: config.json's keys of the same names (transformers' from_model_config, as vLLM)
    bare = model_with(tmp_path, None, "bare")
    config = json.loads((tmp_path / "bare" / "config.json").read_text())
    (tmp_path / "bare" / "config.json").write_text(json.dumps({**config, "temperature": 0.5}))
    assert LLM(bare, device="cpu").get_default_sampling_params() == SamplingParams(temperature=0.5)


@pytest.mark.parametrize(
    "generation, message",
    [
        ("{temperature: 0.6", r"generation_config.json is not valid JSON"),
        ("[0.6]", r"generation_config.json must hold a JSON object"),
        ({"temperature": "hot"}, r"generation_config.json: temperature must be in \[0, 2\]"),
        ({"top_p": 0}, r"generation_config.json: top_p must be in \(0, 1\].*generation_config='vllm'"),
        ({"max_new_tokens": 0}, r"generation_config.json: max_new_tokens: max_tokens must be a positive integer"),
        ({"eos_token_id": 5000}, r"generation_config.json: eos_token_id 5000 is outside the vocabulary \[0, 1024\)"),
        ({"eos_token_id": ["0"]}, r"eos_token_id must be a token id or a list of them"),
    ],
    ids=["not-json", "not-object", "temperature", "top_p", "max_new_tokens", "eos-outside", "eos-type"],
)
def test_a_broken_generation_config_is_named_before_anything_is_built(tmp_path, monkeypatch, generation, message):
    folder = model_with(tmp_path, generation)
    monkeypatch.setattr(nanoref.llm, "build_runner", lambda *a, **k: pytest.fail("the model runner was built"))
    with pytest.raises(ValueError, match=message):
        LLM(folder, device="cpu")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(generation_config=5), r"generation_config must be 'auto', 'vllm' or a folder's path, got 5"),
        (
            dict(generation_config="/nowhere/at/all"),
            r"generation_config: model folder '/nowhere/at/all' does not exist",
        ),
        (dict(override_generation_config={"tempurature": 0.5}), r"'tempurature' is not a sampling default"),
        (dict(override_generation_config=[("temperature", 0.5)]), r"override_generation_config must be a dict"),
        (dict(override_generation_config={"top_k": 2.5}), r"override_generation_config: top_k must be an integer"),
    ],
    ids=["type", "missing-folder", "unknown-key", "not-a-dict", "bad-value"],
)
def test_bad_generation_config_settings_are_named(monkeypatch, settings, message):
    monkeypatch.setattr(nanoref.llm, "build_runner", lambda *a, **k: pytest.fail("the model runner was built"))
    with pytest.raises(ValueError, match=message):
        LLM(device="cpu", **settings)


def test_a_generation_config_folder_without_the_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config: .* has no generation_config.json"):
        EngineConfig(DEFAULT_MODEL, device="cpu", generation_config=str(tmp_path))


# -- the server ------------------------------------------------------------------------------------------------------
def test_serve_passes_the_generation_config_flags_and_names_bad_json(monkeypatch, capsys):
    override = '{"temperature": 0.5, "max_new_tokens": 8}'
    settings = serve_settings(monkeypatch, ["--generation-config", "vllm", "--override-generation-config", override])
    assert settings["generation_config"] == "vllm"
    assert settings["override_generation_config"] == {"temperature": 0.5, "max_new_tokens": 8}
    from nanoref.serve import main

    assert main(["--device", "cpu", "--port", "0", "--override-generation-config", "{temperature: 1}"]) == 2
    assert "error: --override-generation-config is not valid JSON" in capsys.readouterr().err
    assert main(["--device", "cpu", "--port", "0", "--override-generation-config", "[1]"]) == 2
    assert "error: --override-generation-config must be a JSON object" in capsys.readouterr().err


def served_server(settings: dict):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from .helpers import running_server

    return running_server(AsyncLLM(LLM(device="cpu", **settings), owns_llm=True), "m")


MESSAGES = [{"role": "user", "content": "What is better?"}]


def test_the_server_samples_with_the_models_defaults_where_a_request_leaves_them_out(tmp_path):
    openai = pytest.importorskip("openai")
    folder = model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 5})
    greedy = LLM(device="cpu").generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    with served_server({"model": folder}) as server:
        client = server.client()
        # no temperature: the file's 0, greedy; no max_tokens: completions' own 16 (the file's 5 is chat's default)
        completion = client.completions.create(model="m", prompt=PROMPTS[0])
        assert completion.choices[0].text == greedy[0]["text"] and completion.usage.completion_tokens == 16
        chat = client.chat.completions.create(model="m", messages=MESSAGES)
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7)  # the request's own wins
        assert chat.usage.completion_tokens == 7
        # the file's temperature 0 is greedy: n=2 is vLLM's 400 naming n, unless the request samples
        with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling, got 2") as refused:
            client.completions.create(model="m", prompt=PROMPTS[0], n=2)
        assert refused.value.body["param"] == "n" and server.blocks_used() == 0 and server.engine.llm.is_finished()
        sampled = client.completions.create(model="m", prompt=PROMPTS[0], n=2, temperature=1.0, max_tokens=3)
        assert [choice.index for choice in sampled.choices] == [0, 1]


def test_a_generation_config_folders_max_new_tokens_caps_every_request_on_the_server(tmp_path):
    folder = model_with(tmp_path, {"max_new_tokens": 5})
    with served_server({"generation_config": folder}) as server:  # (vLLM's override_max_tokens)
        client = server.client()
        completion = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=10, temperature=0.0)
        assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(  # (sampled at temperature 1: ignore_eos, so 5 tokens on any draw)
            model="m", messages=MESSAGES, max_completion_tokens=10, extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == 5
        import openai

        with pytest.raises(openai.BadRequestError, match=r"min_tokens.*max_tokens cap is 5") as raised:
            client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=10, extra_body={"min_tokens": 8})
        assert raised.value.body["param"] == "min_tokens"


def test_the_server_checks_the_max_tokens_a_client_asked_for_against_the_room_before_its_cap(tmp_path):
    # vLLM's server refuses a max_tokens the context cannot hold beside the prompt, whatever its override cap would
    # cut it to (the cap applies to requests that fit)
    import openai

    folder = model_with(tmp_path, {"max_new_tokens": 5})
    with served_server({"generation_config": folder, "max_model_len": 64}) as server:
        client = server.client()
        with pytest.raises(openai.BadRequestError, match="'max_tokens' or 'max_completion_tokens' is too large: 64"):
            client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=64)
        with pytest.raises(openai.BadRequestError, match="is too large: 64") as raised:
            client.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=64)
        assert raised.value.body["param"] == "max_completion_tokens"
        fits = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=40, temperature=0.0)
        assert fits.usage.completion_tokens == 5  # (capped)
        # a min_tokens above the cap too: the room is still what is named (vLLM checks it first), on both endpoints
        with pytest.raises(openai.BadRequestError, match="is too large: 64") as raised:
            client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=64, extra_body={"min_tokens": 8})
        assert raised.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError, match="is too large: 64") as raised:
            client.chat.completions.create(
                model="m", messages=MESSAGES, max_completion_tokens=64, extra_body={"min_tokens": 8}
            )
        assert raised.value.body["param"] == "max_completion_tokens"
        with pytest.raises(openai.BadRequestError, match=r"min_tokens.*max_tokens cap is 5") as raised:  # (it fits)
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, extra_body={"min_tokens": 8})
        assert raised.value.body["param"] == "min_tokens"
        # no max_tokens (chat's default, the room left): the cap's error, not one about a max_tokens never sent
        with pytest.raises(openai.BadRequestError, match=r"min_tokens.*max_tokens cap is 5") as raised:
            client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"min_tokens": 8})
        assert raised.value.body["param"] == "min_tokens"
        # several prompts: every prompt's room is checked before the cap's error (the second one's does not fit)
        long_prompt = " ".join(PROMPTS * 3)
        with pytest.raises(openai.BadRequestError, match="prompt 1: 'max_tokens' or 'max_completion_tokens' is too"):
            client.completions.create(
                model="m", prompt=[PROMPTS[0], long_prompt], max_tokens=30, extra_body={"min_tokens": 8}
            )
        with pytest.raises(openai.BadRequestError, match=r"min_tokens.*max_tokens cap is 5"):  # (both fit)
            client.completions.create(model="m", prompt=[PROMPTS[0]] * 2, max_tokens=30, extra_body={"min_tokens": 8})


def test_a_completion_that_sends_max_tokens_null_gets_the_room_left_or_the_models_max_new_tokens(tmp_path):
    """vLLM's completions default to 16 only where max_tokens is left out: a null one is no limit of the request's
    (vLLM's get_max_tokens: the generation config's max_new_tokens, or the room the context leaves)."""
    folder = model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 20})
    with served_server({"model": folder, "max_model_len": 64}) as server:
        client = server.client()
        for prompt in (PROMPTS[0], " ".join(PROMPTS * 3)):  # room 59 (the file's 20 is less), then room < 20
            completion = client.completions.create(
                model="m", prompt=prompt, max_tokens=None, extra_body={"ignore_eos": True}
            )
            room = 64 - completion.usage.prompt_tokens
            assert completion.usage.completion_tokens == min(20, room)
            assert completion.choices[0].finish_reason == "length"
        assert room < 20  # (the second prompt's)
        left_out = client.completions.create(model="m", prompt=PROMPTS[0], extra_body={"ignore_eos": True})
        assert left_out.usage.completion_tokens == 16  # (the control: completions' own default)
