"""CUDA: the engine on a GPU, eager and with decode CUDA graphs. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams

from .helpers import hf_greedy, random_prompts, shared_prefix_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("max_num_seqs", [20, 64])  # 20: not a multiple of the 16-wide graph buckets
def test_cuda_graphs_match_eager_and_hf(tiny_model, max_num_seqs):
    prompts = random_prompts(
        seed=11, lengths=[3, 9, 17, 25, 33, 1, 40, 12, 5, 30, 18, 22, 7, 2, 16, 31, 8, 19, 27, 14, 6]
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=256, max_num_seqs=max_num_seqs)
    eager = LLM(tiny_model, enforce_eager=True, **kwargs)
    graphed = LLM(tiny_model, **kwargs)
    assert eager.model_runner.decode_graphs is None
    assert max(graphed.model_runner.decode_graphs.graphs) == max_num_seqs
    out_eager = eager.generate(prompts, params, use_tqdm=False)
    out_graph = graphed.generate(prompts, params, use_tqdm=False)
    assert out_graph == out_eager
    for prompt, output in zip(prompts, out_graph):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)


def test_cuda_preemption_and_prefix_cache_match_hf(tiny_model):
    prompts = shared_prefix_prompts(seed=12, prefix_len=32, suffix_lens=[5, 12, 20, 3, 9, 27])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(tiny_model, device="cuda", dtype="float32", num_kvcache_blocks=12, max_num_seqs=8)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)


def test_cuda_bfloat16_default_and_memory_derived_cache(tiny_model):
    # 5% of the GPU beyond what is in use already (other test processes may share the GPU)
    free, total = torch.cuda.mem_get_info()
    llm = LLM(tiny_model, gpu_memory_utilization=min(1.0, (total - free) / total + 0.05))
    assert llm.config.device.type == "cuda" and llm.config.dtype == torch.bfloat16
    assert llm.model_runner.num_kvcache_blocks > 1000
    # a GPU's batch sizes, not a laptop's: Nano-vLLM's and vLLM's defaults
    assert (llm.config.max_num_seqs, llm.config.max_num_batched_tokens) == (512, 16384)
    assert max(llm.model_runner.decode_graphs.graphs) == 512  # decode graphs captured up to the full batch
    out = llm.generate(
        random_prompts(seed=13, lengths=[4, 50]), SamplingParams(temperature=0.7, max_tokens=16), use_tqdm=False
    )
    assert all(0 < len(o["token_ids"]) <= 16 and all(0 <= t < 256 for t in o["token_ids"]) for o in out)


def test_memory_the_allocator_only_caches_goes_to_the_kv_cache(tiny_model):
    """Memory this process freed that torch's allocator still holds (as loading a large model leaves) is free for the
    KV cache: 3 GiB of it must not shrink a cache given 5% of the GPU to 2% or less."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free) / total + 0.05)
    cached = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
    del cached  # (freed, still reserved by the allocator)
    assert torch.cuda.memory_reserved() >= 3 << 30
    llm = LLM(tiny_model, gpu_memory_utilization=utilization, enforce_eager=True)
    runner = llm.model_runner
    cache_bytes = runner.num_kvcache_blocks * runner.kv_bytes_per_token * llm.config.kvcache_block_size
    assert cache_bytes > 0.035 * total, f"{cache_bytes / 2**30:.2f} GiB of a {utilization:.3f} share"


def test_auto_backend_on_cuda_is_compiled(tiny_model):
    """auto on a GPU: flash-attn where it serves, else the compiled Triton kernels, never the torch loop."""
    llm = LLM(tiny_model, num_kvcache_blocks=64)
    assert llm.model_runner.backend.name in ("flash_attn+triton", "flash_attn", "triton")
    assert llm.config.overlap_scheduling is True  # the overlapped loop is CUDA's default


@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_backend_with_cuda_graphs_matches_hf(tiny_model, block_size):
    """Compiled Triton kernels in the decode CUDA graphs, chunked prefill and prefix-cache hits."""
    prompts = shared_prefix_prompts(seed=14, prefix_len=block_size + 24, suffix_lens=[5, 12, 20, 3, 9, 27])
    prompts += random_prompts(seed=15, lengths=[1, 17, 33])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(
        tiny_model, device="cuda", dtype="float32", attention_backend="triton", kvcache_block_size=block_size,
        num_kvcache_blocks=64, max_num_seqs=12, max_num_batched_tokens=48,
    )  # fmt: skip
    assert llm.model_runner.decode_graphs.graphs and llm.model_runner.backend.name == "triton"
    llm.generate(prompts[:1], params, use_tqdm=False)  # its prefix then serves the others from the cache
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.block_manager.num_hit_blocks > 0
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)


def test_an_engine_dropped_in_a_reference_cycle_never_breaks_the_next_capture(tiny_model, monkeypatch):
    """A notebook drops an engine and builds another: the old one's CUDA graphs, kept alive by a reference cycle
    until the garbage collector finds it, must not be freed while the new engine captures (a graph freed during
    a capture invalidates it). Here the collector runs right after each capture begins, as an automatic
    collection might, whenever it is switched on."""
    import gc

    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin_then_collect(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        if gc.isenabled():
            gc.collect()

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(seed=3, lengths=[5, 12])
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=64, max_num_seqs=8)
    old = LLM(tiny_model, **kwargs)
    expected = old.generate(prompts, params, use_tqdm=False)
    cycle: list = [old]
    cycle.append(cycle)
    del old, cycle  # garbage now, freed only by a collection
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin_then_collect)
    new = LLM(tiny_model, **kwargs)
    assert gc.isenabled(), "the collector must be the caller's again after the capture"
    assert new.generate(prompts, params, use_tqdm=False) == expected


def test_a_dropped_engine_in_a_reference_cycle_leaves_its_memory_to_the_next(tiny_model):
    """`del llm`, then a new engine sized from memory: the dropped engine may still wait in a reference cycle (one the
    caller made, as here; on an H100 the engine's own, before its step hooks held their runner weakly: the next LLM()
    found no memory for its cache), so sizing collects it first. Its cache took a share of the GPU; the next engine
    gets about the same share, not what the old one left."""
    import gc

    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free) / total + 0.1)
    old = LLM(tiny_model, gpu_memory_utilization=utilization)
    old.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    blocks = old.model_runner.num_kvcache_blocks
    cycle: list = [old]
    cycle.append(cycle)
    enabled = gc.isenabled()
    gc.disable()  # (no automatic collection may free it first: only the engine's own)
    try:
        del old, cycle  # garbage now, freed only by a collection (the caller's own cycle holds it)
        new = LLM(tiny_model, gpu_memory_utilization=utilization)
    finally:
        if enabled:
            gc.enable()
    assert new.model_runner.num_kvcache_blocks > 0.9 * blocks


def test_decode_graphs_replay_one_schedule_a_step(tiny_model):
    """The Triton decode's schedule (the sequences longest context first) is made by a step's first attention layer
    and recorded in the decode graphs: each replay sorts that step's context lengths once, never once per layer,
    and the tokens are HF's."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(
        tiny_model, device="cuda", dtype="float32", attention_backend="triton", num_kvcache_blocks=64, max_num_seqs=8
    )
    assert llm.model_runner.decode_graphs.graphs
    prompts = random_prompts(seed=21, lengths=[3, 30, 12, 7])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # every kernel compiled before the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    sorts = [name for name in kernels if "sort" in name.lower()]
    decode_steps = params.max_tokens - 1  # the first token of each comes from its prefill
    assert len(sorts) == decode_steps, f"{len(sorts)} sort kernels in {decode_steps} decode steps: {set(sorts)}"
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)
