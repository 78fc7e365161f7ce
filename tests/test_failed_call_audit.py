"""What a failed call leaves behind, and what a call changes of the caller's process (docs/tests.md: the audits)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest

from nanoref import LLM, LoRARequest, SamplingParams
from nanoref.serving import async_llm
from nanoref.serving.async_llm import AsyncLLM
from nanoref.testing import make_random_lora

GREEDY = SamplingParams(temperature=0, max_tokens=2)


def alive_workers() -> list:
    return [proc for proc in multiprocessing.active_children() if proc.name.startswith("nanoref-tp-rank")]


def test_an_async_llm_that_fails_to_start_stops_the_workers_of_the_llm_it_made(tiny_model, monkeypatch):
    """The engine thread cannot start (a process at its thread limit): from_model made the LLM (and its
    tensor-parallel worker) first. The worker stops before the error reaches the caller, who may keep it (a notebook
    does)."""

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(async_llm, "EngineThread", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread") as caught:
        AsyncLLM.from_model(tiny_model, engine_process=False, device="cpu", tensor_parallel_size=2)
    assert caught.value is not None
    assert alive_workers() == []


# what a process that only makes an engine and generates must still have as it had: run in a process of its own, since
# this one's start method and threads depend on the tests before
UNTOUCHED_PROCESS = """
import multiprocessing, sys, threading
from nanoref import LLM, SamplingParams

llm = LLM(sys.argv[1], num_kvcache_blocks=16)
params = SamplingParams(temperature=0, max_tokens=3)
llm.generate([[1, 2, 3]], params, use_tqdm=False)
llm.generate([[1, 2, 3]], params, use_tqdm=True)
try:
    llm.generate([[1, 2, 3], [10**9]], params)
except ValueError:
    pass
assert multiprocessing.get_start_method(allow_none=True) is None, multiprocessing.get_start_method()
multiprocessing.set_start_method("spawn")  # what a caller may still do (it raises once the method is fixed)
assert threading.enumerate() == [threading.main_thread()], threading.enumerate()
"""


def test_generate_leaves_the_start_method_unfixed_and_no_thread_running(tiny_model):
    """tqdm's defaults would do both: fix multiprocessing's start method (its lock) and start a monitor thread."""
    result = subprocess.run(
        [sys.executable, "-c", UNTOUCHED_PROCESS, str(tiny_model)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


# -- LoRA: what a refused request leaves of the adapters ---------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("failed_call_loras")
    return {
        name: LoRARequest(name, i + 1, str(make_random_lora(root / name, tiny_model, rank=2, seed=30 + i)))
        for i, name in enumerate("ABC")
    }


def test_a_request_refused_for_its_prompt_takes_no_adapters_place_in_the_host_cache(tiny_model, adapters):
    """Two host places: A waits there, C is in the one slot. B's request is refused (its prompt is too long), so B
    never needs a place, and A, which a later request wants, is still read."""
    llm = LLM(tiny_model, enable_lora=True, max_loras=1, max_cpu_loras=2, num_kvcache_blocks=16)
    a, b, c = adapters["A"], adapters["B"], adapters["C"]
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=a)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=c)
    assert set(llm.lora.manager.host) == {a.lora_int_id, c.lora_int_id}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 200)) * 3], GREEDY, use_tqdm=False, lora_request=b)
    assert set(llm.lora.manager.host) == {a.lora_int_id, c.lora_int_id}


def test_a_call_whose_later_prompt_is_refused_takes_no_adapters_place_in_the_host_cache(tiny_model, adapters):
    """Two host places: A waits there, C is in the one slot. Prompt 0 under B is fine, prompt 1 is refused: nothing
    is queued, so B must not have taken A's place (B used to be read into the host at prompt 0, evicting A, and
    unloaded after prompt 1)."""
    llm = LLM(tiny_model, enable_lora=True, max_loras=1, max_cpu_loras=2, num_kvcache_blocks=16)
    a, b, c = adapters["A"], adapters["B"], adapters["C"]
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=a)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=c)
    with pytest.raises(ValueError, match="prompt 1: token id"):
        llm.generate([[1, 2, 3], [10**9]], GREEDY, use_tqdm=False, lora_request=b)
    assert set(llm.lora.manager.host) == {a.lora_int_id, c.lora_int_id} and llm.is_finished()


def test_one_id_naming_two_adapters_in_one_call_is_refused_before_anything_is_queued(tiny_model, adapters):
    llm = LLM(tiny_model, enable_lora=True, num_kvcache_blocks=16)
    a, b = adapters["A"], adapters["B"]
    twin = LoRARequest("B", a.lora_int_id, b.lora_path)
    with pytest.raises(ValueError, match=f"prompt 1: lora_int_id {a.lora_int_id} names 'B'"):
        llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False, lora_request=[a, twin])
    assert llm.is_finished() and not llm.lora.manager.host


def test_a_failed_call_unloads_only_the_adapters_it_loaded(tiny_model, adapters, monkeypatch):
    """While a call under A runs, another caller's request loads B; the call then fails. A (its own) leaves the host
    cache; B (the other caller's) stays (the failed call used to unload every adapter new since it began)."""
    llm = LLM(tiny_model, enable_lora=True, num_kvcache_blocks=16)
    a, b = adapters["A"], adapters["B"]
    step = llm.step

    def failing_step():
        llm.add_request([7, 8, 9], GREEDY, lora_request=b)  # (another thread's, in a server)
        raise RuntimeError("injected: the device failed")

    monkeypatch.setattr(llm, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=a)
    assert list(llm.lora.manager.host) == [b.lora_int_id]
    monkeypatch.setattr(llm, "step", step)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=b)[0]
    assert len(out["token_ids"]) == GREEDY.max_tokens


def test_only_queued_requests_count_under_their_adapter(tiny_model, adapters):
    llm = LLM(tiny_model, enable_lora=True, num_kvcache_blocks=16)
    a = adapters["A"]
    with pytest.raises(ValueError, match="prompt 1: token id"):
        llm.generate([[1, 2, 3], [10**9]], GREEDY, use_tqdm=False, lora_request=a)
    llm.make_samples([1, 2, 3], GREEDY, lora_request=a)  # made (as a stream's before its first piece), never queued
    assert llm.lora.num_requests == {}
    llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False, lora_request=[a, None])
    assert llm.lora.num_requests == {"A": 1}


def test_prompt_logprobs_under_an_adapter_score_every_position_again_on_a_second_call(tiny_model, adapters):
    """A request with prompt_logprobs keeps its prompt's K/V apart (a position the prefix cache served could not be
    scored); under an adapter too: the second call used to find the first one's blocks and fail its step."""
    llm = LLM(tiny_model, enable_lora=True, num_kvcache_blocks=32)
    a, prompt = adapters["A"], list(range(1, 60))
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate([prompt], scored, use_tqdm=False, lora_request=a)[0]
    second = llm.generate([prompt], scored, use_tqdm=False, lora_request=a)[0]
    assert len(second["prompt_logprobs"]) == len(prompt) and second["prompt_logprobs"] == first["prompt_logprobs"]
    base = llm.generate([prompt], scored, use_tqdm=False)[0]
    assert base["prompt_logprobs"] != first["prompt_logprobs"], "the adapter was not applied"
    plain = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0]
    assert plain["token_ids"] == first["token_ids"]
