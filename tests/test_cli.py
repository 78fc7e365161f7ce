"""The built-in model and `python -m nanoref`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanoref import DEFAULT_MODEL, LLM, SamplingParams

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
    assert "step 1 [prefill]" in result.stdout and "step 2 [decode]" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/folder"], "does not exist"),
        (["--model", "Qwen/Qwen3-0.6B"], "huggingface-cli download"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_cli_errors_are_one_clear_line(args, message):
    result = run_cli("hi", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and message in result.stderr
    assert "Traceback" not in result.stderr
