"""The built-in model and `python -m nanoref`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nanoref import DEFAULT_MODEL, LLM, SamplingParams
from nanoref.__main__ import EXIT_BROKEN_PIPE, main
from nanoref.parallel.tensor_parallel import TensorParallelError

from .helpers import hf_greedy

pytestmark = pytest.mark.slow  # subprocesses that each start Python, torch and the model


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanoref", *args], capture_output=True, text=True, timeout=300, env=None
    )


def test_default_model_is_small_and_complete():
    files = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) < 6 * 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU float32 is compared with HF float32")
def test_default_model_greedy_matches_hf_on_text_prompts():
    llm = LLM()
    prompts = ["Beautiful is better than", "Return the", "Errors should never"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(DEFAULT_MODEL, llm.tokenizer.encode(prompt), 20)
        assert output["token_ids"] == expected
        assert output["text"] == llm.tokenizer.decode(expected, skip_special_tokens=True)


def test_cli_generates_recognisable_text():
    result = run_cli("Beautiful is better than", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Beautiful is better than ugly.")  # the model learned the Zen of Python


def test_cli_trace_and_sampling_options():
    result = run_cli(
        "Simple is", "--trace", "--max-tokens", "3", "--temperature", "0.8", "--seed", "1", "--device", "cpu"
    )
    assert result.returncode == 0, result.stderr
    assert "step 0 [prefill]" in result.stdout and "step 1 [decode]" in result.stdout


def test_prompts_may_come_between_and_after_the_options(capsys):
    # `python -m nanoref "a" --max-tokens 4 "b"` was "unrecognized arguments: b"
    assert main(["Beautiful is", "--max-tokens", "2", "Flat is", "--device", "cpu", "Simple is"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" is")[0] for line in lines] == ["Beautiful", "Flat", "Simple"], lines


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/folder"], "does not exist"),
        (["--model", "Qwen/Qwen3-0.6B"], "hf download Qwen/Qwen3-0.6B"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--kv-cache-dtype", "fp16"], "kv_cache_dtype must be one of"),
    ],
)
def test_cli_errors_are_one_clear_line(args, message):
    result = run_cli("hi", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_closed_stdout_ends_the_cli_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` that has already exited: every write to stdout is EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "nanoref", "Beautiful is", "Simple is", "--max-tokens", "4", "--device", "cpu"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == EXIT_BROKEN_PIPE


def fail_generate_with(monkeypatch, error: BaseException) -> None:
    def generate(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(LLM, "generate", generate)


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    fail_generate_with(monkeypatch, KeyboardInterrupt())
    try:
        status = main(["hi", "--device", "cpu"])
    except KeyboardInterrupt:  # escaping, it would stop this test run too
        pytest.fail("Ctrl-C escaped main: Python prints its traceback")
    assert status == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_runtime_failure_is_one_error_line_and_exit_1(monkeypatch, capsys):
    fail_generate_with(monkeypatch, TensorParallelError("rank 1 exited with status 9"))
    assert main(["hi", "--device", "cpu"]) == 1
    assert capsys.readouterr().err == "error: rank 1 exited with status 9\n"


def test_a_folder_without_a_tokenizer_says_so_on_the_command_line(tiny_model, capsys):
    assert main(["hi", "--model", str(tiny_model), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "has no tokenizer" in err and "tokenizer.json" in err
    assert "token ids" not in err  # the command line cannot pass them


def test_a_prompt_that_is_not_utf8_is_named():
    # bytes, as a shell passes them: Python decodes argv with surrogateescape
    result = subprocess.run(
        [sys.executable, "-m", "nanoref", "fine", b"caf\xe9", "--device", "cpu"], capture_output=True, timeout=300
    )
    assert result.returncode == 2
    assert (
        result.stderr.decode()
        == "error: prompt 1 is not valid UTF-8 (byte 0xe9 at byte 3): pass prompts as UTF-8 text\n"
    )


@pytest.mark.parametrize(
    "argv0, prog", [("/venv/bin/nanoref", "nanoref"), ("/repo/nanoref/__main__.py", "python -m nanoref")]
)
def test_the_usage_line_names_the_command_as_it_was_run(monkeypatch, argv0, prog):
    from nanoref.__main__ import build_parser

    monkeypatch.setattr(sys, "argv", [argv0])
    assert build_parser().format_usage().startswith(f"usage: {prog} ")


def test_the_engine_sizing_flags_reach_the_engine(monkeypatch, capsys):
    # the command line had no way to bound the engine's memory: no --max-model-len, --max-num-seqs, ...
    configs = []

    def generate(self, prompts, *args, **kwargs):
        configs.append(self.config)
        return [{"text": ""} for _ in prompts]

    monkeypatch.setattr(LLM, "generate", generate)
    argv = ["hi", "--device", "cpu", "--max-model-len", "300", "--max-num-seqs", "3", "--num-kvcache-blocks", "40"]
    argv += ["--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
    assert main(argv) == 0, capsys.readouterr().err
    (config,) = configs
    assert (config.max_model_len, config.max_num_seqs, config.num_kvcache_blocks) == (300, 3, 40)
    assert (config.max_num_batched_tokens, config.gpu_memory_utilization, config.enforce_eager) == (256, 0.5, True)


@pytest.mark.parametrize(
    "args,line",
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: gpu_memory_utilization must be in (0, 1]"),
        (["--max-num-seqs", "0"], "--max-num-seqs: max_num_seqs must be"),
        (["--max-model-len", "1"], "--max-model-len: max_model_len must be an integer in [2, "),
        (["--num-kvcache-blocks", "-1"], "--num-kvcache-blocks: num_kvcache_blocks must be a positive integer"),
    ],
)
def test_a_bad_engine_size_is_one_line_naming_its_flag(args, line, capsys):
    assert main(["hi", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {line}") and err.count("\n") == 1, err


class RecordedLLM:
    """LLM's stand-in: records the settings and sampling parameters the command line passes, loads nothing."""

    def __init__(self, model, **settings):
        self.settings, self.params, self.tokenizer = settings, [], object()
        RECORDED.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def generate(self, prompts, params, use_tqdm=False):
        self.params.append(params)
        return [{"text": ""} for _ in prompts]


RECORDED: list[RecordedLLM] = []


def recorded_run(monkeypatch, capsys, argv: list[str]) -> RecordedLLM:
    import nanoref

    RECORDED.clear()
    monkeypatch.setattr(nanoref, "LLM", RecordedLLM)
    assert main(["hi", *argv]) == 0, capsys.readouterr().err
    (llm,) = RECORDED
    return llm


def test_seed_seeds_the_engine_as_the_servers_and_vllms_do(monkeypatch, capsys):
    # the command line's --seed seeded each request (SamplingParams.seed), the server's the engine: one name, two
    # meanings. vLLM's --seed is the engine's; a negative one is taken (it was refused: "in [0, 2**64)")
    llm = recorded_run(monkeypatch, capsys, ["--seed", "7", "--temperature", "1"])
    assert llm.settings["seed"] == 7 and llm.params[0].seed is None
    assert recorded_run(monkeypatch, capsys, ["--seed", "-5"]).settings["seed"] == -5
    assert "seed" not in recorded_run(monkeypatch, capsys, []).settings  # (the engine's default: fresh entropy)


def test_the_same_seed_prints_the_same_samples(capsys):
    argv = ["Simple is", "Simple is", "--device", "cpu", "--temperature", "1.5", "--max-tokens", "8"]
    runs = []
    for seed in ("1", "1", "2"):
        assert main([*argv, "--seed", seed]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_device_auto_is_vllms(monkeypatch, capsys):
    # vLLM's --device default, auto, was refused: "device must be 'cpu' or 'cuda', got 'auto'"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NANOREF_DEVICE", "cuda")  # (auto is the platform's choice, whatever the default is set to)
    assert main(["Beautiful is better than", "--device", "auto", "--max-tokens", "2"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("Beautiful is better than ugly")


def test_vllms_short_and_underscore_spellings_are_taken(monkeypatch, capsys):
    # the server took `-tp 2` and `--max_model_len 64` (vLLM's spellings), the command line refused both
    argv = ["-tp", "2", "--max_model_len", "64", "--max_num_seqs=3", "--kv_cache_dtype", "fp8", "--enforce_eager"]
    settings = recorded_run(monkeypatch, capsys, [*argv, "--num-gpu-blocks-override", "40"]).settings
    assert settings["tensor_parallel_size"] == 2 and settings["max_model_len"] == 64
    assert settings["num_gpu_blocks_override"] == 40  # (vLLM's name for --num-kvcache-blocks)
    assert (settings["max_num_seqs"], settings["kv_cache_dtype"], settings["enforce_eager"]) == (3, "fp8", True)
    capsys.readouterr()
    assert main(["hi", "--", "--max_tokens"]) == 0  # (a prompt after `--` keeps its underscores)
    assert capsys.readouterr().out == "hi\n--max_tokens\n"


def test_the_engine_flags_of_both_commands_are_one_definition():
    from nanoref.__main__ import build_parser
    from nanoref.serve import build_parser as build_server_parser

    def flags(parser):
        return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "model")}

    def same(one, other) -> bool:  # (a command may add to a help text)
        return (one.option_strings, one.default, one.type) == (other.option_strings, other.default, other.type) and (
            one.help.startswith(other.help) or other.help.startswith(one.help)
        )

    cli, server = flags(build_parser()), flags(build_server_parser())
    assert [dest for dest in cli.keys() & server.keys() if not same(cli[dest], server[dest])] == []
    engine = {"device", "dtype", "seed", "tensor_parallel_size", "attention_backend", "kv_cache_dtype"}
    assert engine <= cli.keys() & server.keys()
