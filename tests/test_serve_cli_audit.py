"""`python -m nanoref.serve` takes `vllm serve`'s flags where nanoref has the feature, honours each one it accepts,
and refuses a bad value with one line naming the flag (exit 2), before the model loads."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from nanoref import serve  # noqa: E402
from nanoref.serve import build_parser, main  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT, serve_settings  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def never_loads(monkeypatch) -> None:
    monkeypatch.setattr(AsyncLLM, "from_model", lambda *a, **k: pytest.fail("the model was loaded"))


def test_vllm_engine_flags_reach_the_engine(monkeypatch):
    settings = serve_settings(
        monkeypatch,
        [
            "--max-model-len", "64",
            "--max-num-batched-tokens", "256",
            "--gpu-memory-utilization", "0.5",
            "--enforce-eager",
            "--seed", "7",
            "--tensor-parallel-size", "2",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        ],
    )  # fmt: skip
    assert settings["max_model_len"] == 64
    assert settings["max_num_batched_tokens"] == 256
    assert settings["gpu_memory_utilization"] == 0.5
    assert settings["enforce_eager"] is True
    assert settings["seed"] == 7
    assert settings["tensor_parallel_size"] == 2
    assert settings["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    # left out, the engine's own defaults (per device) apply
    plain = serve_settings(monkeypatch, [])
    assert not {"max_model_len", "max_num_batched_tokens", "gpu_memory_utilization", "seed"} & set(plain)
    assert plain["enforce_eager"] is False and plain["tensor_parallel_size"] == 1
    assert serve_settings(monkeypatch, ["-tp", "2"])["tensor_parallel_size"] == 2  # vLLM's short form


def test_flags_spelled_with_underscores_are_taken_as_vllm_takes_them(monkeypatch):
    # vLLM's parser reads `--max_model_len 64` as `--max-model-len 64`: a script written that way was refused here
    argv = ["--max_model_len", "64", "--max_num_seqs=3", "--enable_prefix_caching", "--served_model_name", "a_b"]
    settings = serve_settings(monkeypatch, argv)
    assert settings["max_model_len"] == 64 and settings["max_num_seqs"] == 3
    assert settings["enable_prefix_caching"] is True
    from nanoref.utils.flags import dashed_flags

    assert dashed_flags(argv)[-1] == "a_b"  # (a value keeps its underscores)
    assert dashed_flags(["--chat_template=a_b", "--", "--x_y"]) == ["--chat-template=a_b", "--", "--x_y"]


def test_every_switch_takes_vllms_no_form(monkeypatch):
    # vLLM's parser makes --no-X for each of its boolean settings (argparse.BooleanOptionalAction): a script passing
    # `--no-enforce-eager` or `--no-trust-remote-code` was refused here ("unrecognized arguments")
    switches = [a for a in build_parser()._actions if a.nargs == 0 and a.dest != "help"]
    assert len(switches) >= 12
    assert [a.option_strings[0] for a in switches if "--no-" + a.option_strings[0][2:] not in a.option_strings] == []
    settings = serve_settings(monkeypatch, ["--enforce-eager", "--no-enforce-eager", "--no-trust-remote-code"])
    assert settings["enforce_eager"] is False and "trust_remote_code" not in settings


def test_attention_backends_take_vllms_names(monkeypatch):
    # vLLM's --attention-backend reads its enum's names in any case (FLASH_ATTN, TRITON_ATTN, flash_attn): a script
    # passing `--attention-backend FLASH_ATTN` got "attention_backend must be one of ..."
    for value, name in [("FLASH_ATTN", "flash_attn"), ("TRITON_ATTN", "triton"), ("triton_attn", "triton")]:
        assert serve_settings(monkeypatch, ["--attention-backend", value])["attention_backend"] == name
    assert serve_settings(monkeypatch, ["--attention-backend", "Flash_Attn+Triton"])["attention_backend"] == (
        "flash_attn+triton"
    )
    # a name nanoref does not know reaches the engine lower-cased, whose error names it
    assert serve_settings(monkeypatch, ["--attention-backend", "XFORMERS"])["attention_backend"] == "xformers"


def test_token_counts_take_vllms_human_readable_suffixes(monkeypatch, capsys):
    settings = serve_settings(monkeypatch, ["--max-model-len", "2k", "--max-num-batched-tokens", "8K"])
    assert settings["max_model_len"] == 2000 and settings["max_num_batched_tokens"] == 8192
    assert serve_settings(monkeypatch, ["--max-model-len", "1.5k"])["max_model_len"] == 1500
    with pytest.raises(SystemExit):  # (argparse's error, exit code 2)
        serve_settings(monkeypatch, ["--max-model-len", "1.5K"])
    assert "a binary suffix (K) takes a whole number" in capsys.readouterr().err


def test_model_as_an_option_as_vllm_takes_it(monkeypatch, tmp_path, capsys):
    models = []

    def capture(model, **settings):
        models.append(model)
        raise ValueError("stop here")

    monkeypatch.setattr(AsyncLLM, "from_model", capture)
    folder = str(tmp_path)
    assert main(["--device", "cpu", "--port", "0", "--model", folder]) == 2
    assert main([folder, "--device", "cpu", "--port", "0", "--model", folder]) == 2  # the same one twice: fine
    assert models == [folder, folder]
    with pytest.raises(SystemExit) as stopped:  # two different models: argparse's error, exit 2
        main([folder, "--device", "cpu", "--port", "0", "--model", folder + "-other"])
    assert stopped.value.code == 2
    assert "the model is given twice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--speculative-config", "{method: ngram}"], "error: --speculative-config is not valid JSON"),
        (["--speculative-config", '["ngram"]'], "error: --speculative-config must be a JSON object"),
        (["--served-model-name", ""], "error: --served-model-name: served model names must be non-empty strings"),
        (["--served-model-name", "a", "a"], "error: --served-model-name: a served model name is given twice"),
        (["--api-key", ""], "error: --api-key must not be empty"),
    ],
)
def test_bad_values_are_one_line_naming_the_flag_before_the_model_loads(args, message, monkeypatch, capsys):
    never_loads(monkeypatch)
    assert main(["--device", "cpu", "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--seed", str(-(2**63) - 1)], "--seed"),
        (["--dtype", "float8"], "--dtype"),
        (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    ],
)
def test_an_engine_setting_the_engine_refuses_is_named_by_its_flag(args, flag, capsys):
    assert main(["--device", "cpu", "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_the_help_says_where_a_default_is_not_vllms():
    # --max-model-len's 4096 cap (vLLM's: the model's limit, 40,960 for Qwen3) and --seed's fresh entropy (vLLM's 0)
    # were not said to differ: a script from vLLM got a shorter context, and different samples each run
    helps = {action.option_strings[0]: action.help for action in build_parser()._actions if action.option_strings}
    differ = {"--max-model-len": "the model's limit uncapped", "--seed": "0", "--host": "every interface"}
    differ["--uvicorn-log-level"] = "info"
    assert [flag for flag, vllms in differ.items() if f"vLLM's default is {vllms}" not in helps[flag]] == []


def test_every_flag_of_the_serve_command_is_in_the_docs():
    text = DOCS.read_text()
    flags = {s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")}
    if "every switch also in vLLM's `--no-` form" in text:  # (a switch's --no-X is said once for all)
        flags = {flag for flag in flags if not (flag.startswith("--no-") and "--" + flag[5:] in flags)}
    missing = sorted(flag for flag in flags - {"--help"} if not re.search(re.escape(flag) + r"\b(?!-)", text))
    assert missing == [], f"docs/serving.md does not mention {missing}"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux")
@pytest.mark.parametrize("given", ["flag", "VLLM_API_KEY", "NANOREF_API_KEY"])
def test_api_key_is_required_on_v1_routes_and_the_log_level_is_uvicorns(tmp_path, given):
    command = [sys.executable, "-m", "nanoref.serve", "--device", "cpu", "--port", "0", "--engine-process", "off"]
    command += ["--uvicorn-log-level", "info", "--num-kvcache-blocks", "16"]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "NANOREF_API_KEY")}
    if given == "flag":  # (the flag wins over the environment, as vLLM's)
        command += ["--api-key", "sekrit"]
        env["VLLM_API_KEY"] = "other"
    else:  # vLLM's variable (nanoref's name too): the key when no --api-key is given
        env[given] = "sekrit"
    log = (tmp_path / "stderr").open("w+")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = server.stdout.readline()
        assert " on http://" in line, line + Path(log.name).read_text()
        url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
        # no key, a wrong one, a key without "Bearer": 401 in OpenAI's error body, on every /v1 route
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            response = httpx.get(f"{url}/v1/models", headers=headers, timeout=SERVER_TIMEOUT)
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == 401
        body = {"prompt": "Beautiful is", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=SERVER_TIMEOUT).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        # the right key: served; the routes outside /v1 stay open, as vLLM's
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", timeout=SERVER_TIMEOUT, max_retries=0)
        model = client.models.list().data[0].id
        text = client.completions.create(model=model, **body).choices[0].text
        assert (
            text
            and "".join(c.choices[0].text for c in client.completions.create(model=model, stream=True, **body)) == text
        )
        assert httpx.get(f"{url}/health", timeout=SERVER_TIMEOUT).status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(SERVER_TIMEOUT) == -signal.SIGTERM
        stdout = server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    stderr = Path(log.name).read_text()
    assert "Traceback" not in stderr
    # --uvicorn-log-level info: uvicorn's access log (on stdout), which the default (warning) leaves out
    assert '"GET /v1/models HTTP/1.1" 401' in stdout, stdout
    assert "Application startup complete" in stderr, stderr


def test_served_model_names_are_each_accepted_and_responses_name_the_first():
    """vLLM's --served-model-name takes several names: /v1/models has a card for each, a request may give any, and
    the response names the first."""
    from nanoref import LLM

    from .helpers import running_server

    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=16), owns_llm=True)
    with running_server(engine, ["first", "alias"]) as server:
        cards = httpx.get(f"{server.url}/v1/models", timeout=SERVER_TIMEOUT).json()["data"]
        assert [card["id"] for card in cards] == ["first", "alias"]
        for model in ("first", "alias"):
            body = {"model": model, "prompt": "Beautiful is", "max_tokens": 2}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=SERVER_TIMEOUT)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "first"
        body = {"model": "other", "prompt": "Beautiful is", "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=SERVER_TIMEOUT)
        assert response.status_code == 404
        assert "'first', 'alias'" in response.json()["error"]["message"]


def test_a_model_folder_without_a_tokenizer_is_refused_and_its_engine_closed(tiny_model, monkeypatch, capsys):
    """The server reads and writes text: a folder without a tokenizer (the tiny test model's) is one line, exit 2,
    and the engine it started is closed; an app on an engine without one is refused too."""
    from nanoref import LLM
    from nanoref.serving.api_server import build_app

    made = []
    from_model = AsyncLLM.from_model
    monkeypatch.setattr(AsyncLLM, "from_model", lambda *a, **k: made.append(from_model(*a, **k)) or made[-1])
    for engine_process in ("on", "off", "auto"):  # refused before any engine loads the model
        assert main([str(tiny_model), "--device", "cpu", "--port", "0", "--engine-process", engine_process]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
        assert "has no tokenizer: the server reads and writes text" in err, err
    assert made == [], "an engine was made for a folder the server refuses"
    monkeypatch.undo()
    # and where the check before loading passed (a tokenizer removed meanwhile), the engine made is closed
    monkeypatch.setattr(serve, "check_serves_text_before_loading", lambda *a: None)
    monkeypatch.setattr(AsyncLLM, "from_model", lambda *a, **k: made.append(from_model(*a, **k)) or made[-1])
    assert main([str(tiny_model), "--device", "cpu", "--port", "0", "--engine-process", "off"]) == 2
    assert "has no tokenizer: the server reads and writes text" in capsys.readouterr().err
    assert len(made) == 1 and not made[0].is_running, "the engine was left running"
    monkeypatch.undo()
    engine = AsyncLLM(LLM(device="cpu", skip_tokenizer_init=True, num_kvcache_blocks=16), owns_llm=True)
    try:
        with pytest.raises(ValueError, match="skip_tokenizer_init=True loads no tokenizer: the server reads and"):
            build_app(engine, "m")
    finally:
        engine.close()


def test_the_app_flags_reach_the_app(monkeypatch, capsys):
    """Each of the server's own switches (not the engine's) reaches build_app; left out, each is off."""
    seen: list[dict] = []

    def capture(engine, names, **options):
        seen.append(options)
        raise ValueError("stop here")

    monkeypatch.setattr("nanoref.serving.api_server.build_app", capture)
    flags = ["--enable-request-id-headers", "--enable-prompt-tokens-details", "--enable-force-include-usage"]
    for argv in (flags, []):
        assert main(["--device", "cpu", "--port", "0", "--engine-process", "off", *argv]) == 2
        assert "stop here" in capsys.readouterr().err
    switches = [flag[2:].replace("-", "_") for flag in flags]
    assert [seen[0][name] for name in switches] == [True] * 3
    assert [seen[1][name] for name in switches] == [False] * 3
