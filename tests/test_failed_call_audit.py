"""What a failed call leaves behind, and what a call changes of the caller's process (docs/tests.md: the audits)."""

from __future__ import annotations

import multiprocessing

import pytest

from nanoref.serving.async_llm import AsyncLLM


def alive_workers() -> list:
    return [proc for proc in multiprocessing.active_children() if proc.name.startswith("nanoref-tp-rank")]


def test_an_async_llm_that_fails_to_start_stops_the_workers_of_the_llm_it_made(tiny_model):
    """The folder has no tokenizer, which the thread form needs: from_model made the LLM (and its tensor-parallel
    worker) first. The worker stops before the error reaches the caller, who may keep it (a notebook does)."""
    with pytest.raises(ValueError, match="has no tokenizer") as caught:
        AsyncLLM.from_model(tiny_model, engine_process=False, device="cpu", tensor_parallel_size=2)
    assert caught.value is not None
    assert alive_workers() == []
