"""Tensor parallelism on two GPUs (NCCL): the same tokens as one GPU, with CUDA graphs on every rank.

Marked `gpu`; skipped unless two CUDA devices are present (the CPU tests of tests/test_tensor_parallel.py
cover the same engine with gloo)."""

from __future__ import annotations

import time

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.engine.tensor_parallel import TensorParallelError
from nanoref.testing import make_tiny_qwen3, make_tiny_qwen3_moe

from .helpers import hf_greedy, random_prompts, shared_prefix_prompts
from .tp_faults import break_forward_on_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


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
    one = LLM(folder, dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    with LLM(folder, dtype="float32", tensor_parallel_size=2) as llm:
        assert llm.model_runner.graphs, "decode CUDA graphs were meant to be captured on every rank"
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
        assert llm.scheduler.num_preemptions > 0 and llm.scheduler.block_manager.num_hit_blocks > 0
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(folder, prompt, params.max_tokens)


def test_a_failing_gpu_worker_makes_the_caller_raise(tmp_path):
    """NCCL does not notice a dead peer by itself: the monitor thread aborts the group."""
    folder = make_tiny_qwen3(tmp_path / "m", seed=9)
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, enforce_eager=True)
    llm.model_runner.run_on_all_ranks(break_forward_on_rank, 1)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="injected fault on rank 1"):
        llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
