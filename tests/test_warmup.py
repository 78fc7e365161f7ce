"""The prefill warm-up (nanoref/warmup.py): both prefill variants run once, nothing is written, and on CUDA a run
after it compiles no prefill kernel and no compiled layer."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams, trace_shapes
from nanoref.llm import warm_up_draft
from nanoref.warmup import warm_up_prefill

from .helpers import assert_matches_hf, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def varlen_calls(runner, warm_up=warm_up_prefill) -> list[bool]:
    """Run the warm-up under the shape tracer -> one entry per varlen attention call (True: paged, its keys read
    from the cache's (num_blocks, block_size, Hk, D) tensor through a block table)."""
    with trace_shapes(layers=None, echo=False) as tracer:
        warm_up(runner)
    return [
        len(shapes["k"]) == 4 for step in tracer.steps for stage, shapes in step.stages if stage.endswith("attn.varlen")
    ]


def test_warm_up_runs_both_prefill_variants_and_writes_nothing(tiny_model):
    llm = LLM(tiny_model, dtype="float32", num_kvcache_blocks=16, kvcache_block_size=16)
    runner = llm.model_runner
    before = runner.kv_cache.clone()
    calls = varlen_calls(runner)
    num_layers = len(runner.attention_layers)
    assert calls == [False] * num_layers + [True] * num_layers  # unpaged, then paged, in every layer
    assert torch.equal(runner.kv_cache, before), "the warm-up wrote into the KV cache"
    prompts = random_prompts(seed=3, lengths=[5, 30, 17])
    assert_matches_hf(tiny_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), GREEDY.max_tokens)


def test_a_draft_models_warm_up_runs_on_the_draft_and_writes_into_neither_cache(tiny_model):
    """On CUDA an engine with a draft model warms both up (nanoref/llm.py): the draft's own shapes compile kernels of
    their own. Here on a CPU, called directly: both variants in each of the draft's layers, nothing written."""
    spec = {"model": tiny_model, "num_speculative_tokens": 2, "min_tokens_per_step": 0}
    llm = LLM(tiny_model, dtype="float32", num_kvcache_blocks=16, kvcache_block_size=16, speculative_config=spec)
    runner = llm.model_runner
    target_before, draft_before = runner.kv_cache.clone(), runner.draft.kv_cache.clone()
    calls = varlen_calls(runner, warm_up_draft)
    num_layers = len(runner.draft.attention_layers)
    assert calls == [False] * num_layers + [True] * num_layers
    assert torch.equal(runner.kv_cache, target_before) and torch.equal(runner.draft.kv_cache, draft_before)
    prompts = random_prompts(seed=4, lengths=[6, 21])
    assert_matches_hf(tiny_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), GREEDY.max_tokens)


def test_warm_up_skips_a_cache_too_small_for_its_dummy_sequence(tiny_model):
    llm = LLM(tiny_model, dtype="float32", num_kvcache_blocks=4, kvcache_block_size=16, max_model_len=24)
    assert varlen_calls(llm.model_runner) == []


def triton_variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
def test_on_cuda_a_run_after_construction_compiles_no_prefill_kernel(tiny_model):
    """Chunked prefills (paged), fresh prompts (unpaged) and new block-table widths after the engine is built and
    has served two warm-up batches: no new Triton varlen variant and no dynamo compile."""
    from torch._dynamo.utils import counters

    from nanoref.ops.attention_triton import varlen_attention_kernel

    llm = LLM(tiny_model, device="cuda", dtype="float32", num_kvcache_blocks=256, max_num_batched_tokens=64)
    built = triton_variants(varlen_attention_kernel)
    assert built >= 2, "the engine was built without compiling both prefill variants"
    for lengths in ([3, 9], [5, 7, 11, 13, 2]):  # the sampler compiles for its first two batch sizes
        llm.generate(random_prompts(seed=len(lengths), lengths=lengths), GREEDY, use_tqdm=False)
    frames = counters["frames"]["ok"]
    prompts = random_prompts(seed=7, lengths=[150, 40, 90, 7, 200, 33])  # chunks of 64: paged continuations
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert triton_variants(varlen_attention_kernel) == built, "a prefill compiled a new Triton variant mid-run"
    assert counters["frames"]["ok"] == frames, "a compiled layer recompiled mid-run"
    assert_matches_hf(tiny_model, prompts, outputs, GREEDY.max_tokens)
