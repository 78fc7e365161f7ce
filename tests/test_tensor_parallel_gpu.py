"""Tensor parallelism on two GPUs (NCCL): the same tokens as one GPU, with CUDA graphs on every rank.

Marked `gpu`; skipped unless two CUDA devices are present (the CPU tests of tests/test_tensor_parallel.py
cover the same engine with gloo)."""

from __future__ import annotations

import gc

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.testing import make_tiny_qwen3, make_tiny_qwen3_moe

from .helpers import (
    assert_a_failing_worker_is_reported,
    assert_no_block_leaked,
    assert_preempted_and_recomputed_from_the_cache,
    hf_greedy,
    random_prompts,
    shared_prefix_prompts,
)
from .tp_faults import gpu_index, graph_batch_sizes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# a fixed KV budget: left to the engine, each engine would take most of its GPU's free memory, and an engine
# started after another in this process finds that memory still held by the caching allocator
BLOCKS = dict(num_kvcache_blocks=64)


@pytest.fixture(autouse=True)
def free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    ("name", "build", "overrides"),
    [
        ("gqa2", make_tiny_qwen3, dict()),
        ("mqa", make_tiny_qwen3, dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=251)),
        ("moe", make_tiny_qwen3_moe, dict(mlp_only_layers=[0])),
    ],
)
def test_two_gpus_match_one_gpu_and_hf_with_graphs(tmp_path, name, build, overrides):
    folder = build(tmp_path / name, seed=7, **overrides)
    prompts = random_prompts(seed=3, lengths=[1, 9, 33, 70], vocab=overrides.get("vocab_size", 256))
    one = LLM(folder, dtype="float32", **BLOCKS).generate(prompts, GREEDY, use_tqdm=False)
    with LLM(folder, dtype="float32", tensor_parallel_size=2, **BLOCKS) as llm:
        assert llm.model_runner.run_on_all_ranks(gpu_index) == [0, 1]
        graphs = llm.model_runner.run_on_all_ranks(graph_batch_sizes)
        assert graphs[0] and graphs[0] == graphs[1], f"decode CUDA graphs per rank: {graphs}"
        two = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in two] == [o["token_ids"] for o in one]
    for prompt, output in zip(prompts, two):
        assert output["token_ids"] == hf_greedy(folder, prompt, GREEDY.max_tokens)


def test_two_gpus_chunked_prefill_prefix_hits_preemption(tmp_path):
    folder = make_tiny_qwen3(tmp_path / "m", seed=8, num_attention_heads=8, num_key_value_heads=2)
    prompts = shared_prefix_prompts(seed=3, prefix_len=32, suffix_lens=[5, 12, 20, 3])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    settings = dict(num_kvcache_blocks=9, kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=24)
    with LLM(folder, dtype="float32", tensor_parallel_size=2, **settings) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_preempted_and_recomputed_from_the_cache(llm)
        assert max(step.num_tokens for step in llm.metrics.steps if step.kind == "prefill") <= 24  # chunked
        assert_no_block_leaked(llm)
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(folder, prompt, params.max_tokens)


def test_a_failing_gpu_worker_makes_the_caller_raise(tmp_path):
    """NCCL does not notice a dead peer by itself: the monitor thread aborts the group; a new engine starts after."""
    folder = make_tiny_qwen3(tmp_path / "m", seed=9)
    assert_a_failing_worker_is_reported(folder, within_s=30, dtype="float32", enforce_eager=True, **BLOCKS)
