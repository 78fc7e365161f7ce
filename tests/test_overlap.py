"""The overlapped loop (`overlap_scheduling=True`): step n+1 is scheduled and launched before step n's tokens
are read back. On a CPU nothing runs concurrently, but every decision is the overlapped loop's, so these tests
check its bookkeeping: token-exact with HF transformers, and the same tokens as the plain loop."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.cuda_graphs import pad_decode_batch
from nanoref.exercises import use

from .helpers import (
    Counting,
    assert_called_every_decode_step,
    assert_matches_hf,
    assert_no_block_leaked,
    decode_launches_never_wait,
    enable_bucketed_decode,
    hf_greedy,
    random_prompts,
    shared_prefix_prompts,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def overlapped(folder, **kwargs) -> LLM:
    """An engine on the overlapped loop that counts the steps it scheduled ahead and the rows it dropped."""
    llm = LLM(folder, device="cpu", overlap_scheduling=True, **kwargs)
    llm.num_ahead_steps = llm.num_dropped_rows = 0
    loop = llm.overlapped_loop
    schedule_ahead, commit_ahead = loop.schedule_ahead, loop.commit_ahead

    def counting_schedule_ahead(in_flight):
        ahead = schedule_ahead(in_flight)
        llm.num_ahead_steps += bool(ahead)
        return ahead

    def counting_commit_ahead(ahead):
        live = commit_ahead(ahead)
        llm.num_dropped_rows += len(ahead) - len(live)
        return live

    loop.schedule_ahead, loop.commit_ahead = counting_schedule_ahead, counting_commit_ahead
    return llm


def plain(folder, **kwargs) -> LLM:
    return LLM(folder, device="cpu", overlap_scheduling=False, **kwargs)


def hf_until_eos(folder, prompt, max_tokens, eos) -> list[int]:
    tokens = hf_greedy(folder, prompt, max_tokens)
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_config_defaults_and_validation(tiny_model):
    assert LLM(tiny_model, device="cpu", num_kvcache_blocks=8).config.overlap_scheduling is False  # CPU: plain loop
    with pytest.raises(ValueError, match="overlap_scheduling must be True, False or None"):
        LLM(tiny_model, device="cpu", overlap_scheduling="yes")


@pytest.mark.parametrize("name", ["gqa2-untied", pytest.param("gqa4-bias", marks=pytest.mark.slow)])
def test_overlapped_greedy_matches_hf_and_plain_loop(tiny_models, name):
    folder = tiny_models[name]
    prompts = random_prompts(seed=11, lengths=[1, 7, 16, 17, 33, 50])
    llm = overlapped(folder, num_kvcache_blocks=256)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.num_ahead_steps >= GREEDY.max_tokens - 3, "decode steps were meant to be scheduled ahead"
    assert_matches_hf(folder, prompts, outputs, GREEDY.max_tokens)
    assert outputs == plain(folder, num_kvcache_blocks=256).generate(prompts, GREEDY, use_tqdm=False)
    assert_no_block_leaked(llm)
    # one record per step, each with its tokens: 6 prompts in one prefill, then 23 decode steps of 6 rows
    kinds = [record.kind for record in llm.metrics.steps]
    assert kinds == ["prefill"] + ["decode"] * (GREEDY.max_tokens - 1)
    assert all(record.num_tokens == 6 for record in llm.metrics.steps[1:])


def test_eos_inside_a_batch_emits_nothing_after_it(tiny_model):
    """A sequence that samples EOS at step n already has a row in step n+1: that row's token is dropped."""
    prompts = random_prompts(seed=12, lengths=[5, 12, 20, 8, 30])
    free_run = plain(tiny_model, num_kvcache_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    eos = free_run[1]["token_ids"][6]  # a token the model really generates, mid-way through prompt 1's output
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens)
    llm = overlapped(tiny_model, num_kvcache_blocks=64)
    llm.scheduler.eos_token_ids = {eos}
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert output["token_ids"] == hf_until_eos(tiny_model, prompt, params.max_tokens, eos), f"prompt {i}"
    lengths = [len(output["token_ids"]) for output in outputs]
    assert min(lengths) < params.max_tokens < max(lengths) + 1, "EOS was meant to end some sequences early"
    assert llm.num_dropped_rows > 0, "a row scheduled ahead for a finished sequence was meant to be dropped"
    reference = plain(tiny_model, num_kvcache_blocks=64)
    reference.scheduler.eos_token_ids = {eos}
    assert outputs == reference.generate(prompts, params, use_tqdm=False)
    assert_no_block_leaked(llm)


def test_max_tokens_one_and_mixed_limits(tiny_model):
    """max_tokens is known on the host: a sequence that ends by count gets no row ahead, one token more never."""
    prompts = random_prompts(seed=13, lengths=[4, 9, 15, 22])
    limits = [1, 2, 5, 1]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in limits]
    llm = overlapped(tiny_model, num_kvcache_blocks=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, n in zip(prompts, outputs, limits):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, n)
    only_one = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in only_one] == [hf_greedy(tiny_model, p, 1) for p in prompts]
    assert_no_block_leaked(llm)


def test_max_model_len_ends_sequences_on_the_overlapped_loop(tiny_model):
    prompts = random_prompts(seed=14, lengths=[10, 25, 3])
    llm = overlapped(tiny_model, num_kvcache_blocks=64, max_model_len=32)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, min(GREEDY.max_tokens, 32 - len(prompt)))
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("name", [pytest.param("gqa2-untied", marks=pytest.mark.slow), "gqa1-tied"])
def test_overlapped_greedy_under_preemption(tiny_models, name):
    """Few KV blocks: the loop must fall back to waiting for step n whenever the next step may preempt."""
    folder = tiny_models[name]
    prompts = shared_prefix_prompts(seed=15, prefix_len=32, suffix_lens=[5, 12, 20, 3, 9, 27])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(num_kvcache_blocks=12, kvcache_block_size=16, max_num_seqs=8)
    llm = overlapped(folder, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert llm.scheduler.block_manager.num_hit_blocks > 0, "shared prefixes were meant to hit the cache"
    assert llm.num_ahead_steps > 0
    assert_matches_hf(folder, prompts, outputs, params.max_tokens)
    assert outputs == plain(folder, **kwargs).generate(prompts, params, use_tqdm=False)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("block_size", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_overlapped_chunked_prefill_and_prefix_cache_across_calls(tiny_model, block_size):
    prompts = shared_prefix_prompts(seed=16, prefix_len=40, suffix_lens=[5, 30, 11])
    kwargs = dict(num_kvcache_blocks=96, max_num_batched_tokens=13, kvcache_block_size=block_size)
    llm = overlapped(tiny_model, **kwargs)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits_before = llm.scheduler.block_manager.num_hit_blocks
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.block_manager.num_hit_blocks > hits_before, "the second call was meant to hit the cache"
    assert max(record.num_tokens for record in llm.metrics.steps) <= 13
    assert first == second
    assert_matches_hf(tiny_model, prompts, second, GREEDY.max_tokens)
    assert first == plain(tiny_model, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    assert_no_block_leaked(llm)


def test_seeded_sampling_same_as_plain_loop(tiny_model):
    """Seeded rows draw from their own generator once per step on both loops: the same tokens."""
    prompts = random_prompts(seed=17, lengths=[6, 14, 3, 21])
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=100 + i) for i in range(len(prompts))]
    outputs = overlapped(tiny_model, num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)
    assert outputs == plain(tiny_model, num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)


def test_step_by_step_and_abort_with_a_step_in_flight(tiny_model):
    prompts = random_prompts(seed=18, lengths=[8, 13])
    llm = overlapped(tiny_model, num_kvcache_blocks=64)
    seqs = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
    finished = []
    while not llm.is_finished():
        done, _ = llm.step()
        finished += done
    assert sorted(seq.seq_id for seq in finished) == sorted(seq.seq_id for seq in seqs)
    assert [seq.completion_token_ids for seq in seqs] == [hf_greedy(tiny_model, p, 6) for p in prompts]
    for p in prompts:
        llm.add_request(p, GREEDY)
    llm.step()  # prefill
    llm.step()  # the first decode, with the second one launched ahead
    assert llm.overlapped_loop.in_flight is not None
    llm.abort_all()
    assert llm.is_finished()
    assert_no_block_leaked(llm)


def test_overlapped_loop_through_the_graph_buckets(tiny_model):
    """Decode the way CUDA graphs do (static buffers, padded buckets), the input ids copied device to device."""
    prompts = random_prompts(seed=19, lengths=[3, 11, 26])
    llm = overlapped(tiny_model, num_kvcache_blocks=64, max_num_seqs=4)
    enable_bucketed_decode(llm)
    padding = Counting(pad_decode_batch)
    with use(pad_decode_batch=padding):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_called_every_decode_step(llm, padding)
    assert llm.num_ahead_steps > 0
    assert_matches_hf(tiny_model, prompts, outputs, GREEDY.max_tokens)
    assert_no_block_leaked(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_overlapped_loop_matches_plain_loop_with_eos(tiny_model, enforce_eager):
    """On a GPU the steps really overlap: the same tokens as the plain loop, with EOS ending rows mid-batch."""
    prompts = random_prompts(seed=20, lengths=[3, 9, 17, 25, 33, 1, 40, 12])
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=128, enforce_eager=enforce_eager)
    free_run = LLM(tiny_model, overlap_scheduling=False, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    assert [out["token_ids"] for out in free_run] == [hf_greedy(tiny_model, p, GREEDY.max_tokens) for p in prompts]
    eos = free_run[2]["token_ids"][5]
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens)
    engines = [LLM(tiny_model, overlap_scheduling=overlap, **kwargs) for overlap in (False, True)]
    for engine in engines:
        engine.scheduler.eos_token_ids = {eos}
    plain_out, overlapped_out = (engine.generate(prompts, params, use_tqdm=False) for engine in engines)
    assert overlapped_out == plain_out
    assert [o["token_ids"] for o in overlapped_out] == [
        hf_until_eos(tiny_model, p, params.max_tokens, eos) for p in prompts
    ]
    assert_no_block_leaked(engines[1])


@pytest.mark.gpu
def test_cuda_overlapped_loop_under_preemption_and_prefix_hits(tiny_model):
    """CUDA's default loop is the overlapped one: with few blocks it must fall back to waiting whenever the next
    step may preempt, and reuse cached prefixes, token-exact with HF."""
    prompts = shared_prefix_prompts(seed=21, prefix_len=32, suffix_lens=[5, 12, 20, 3, 9, 27])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(tiny_model, device="cuda", dtype="float32", num_kvcache_blocks=12, kvcache_block_size=16, max_num_seqs=8)
    assert llm.config.overlap_scheduling is True
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert llm.scheduler.block_manager.num_hit_blocks > 0, "shared prefixes were meant to hit the cache"
    assert_matches_hf(tiny_model, prompts, outputs, params.max_tokens)
    assert_no_block_leaked(llm)


@pytest.mark.gpu
def test_cuda_decode_launches_of_sampled_seeded_and_filtered_rows_never_wait(tiny_model):
    """Every kind of row the overlapped loop runs ahead (greedy, temperature, a seeded request's own draws, top-k and
    top-p) is launched without the host waiting for the device: a pageable upload of a row's settings would make it
    wait for the step in flight and lose the overlap, every step."""
    llm = LLM(tiny_model, device="cuda", num_kvcache_blocks=64, max_num_seqs=16)
    prompts = random_prompts(seed=22, lengths=[4, 9, 15, 6, 11])
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.6, seed=7, max_tokens=12, ignore_eos=True),
    ]
    llm.generate(prompts, params, use_tqdm=False)  # (first calls may compile)
    with decode_launches_never_wait(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [12] * 5
    assert_no_block_leaked(llm)
