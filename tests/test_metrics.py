"""Step records and request metrics, checked against schedules worked out by hand."""

from __future__ import annotations

import pytest

from nanoref import LLM, RequestMetrics, SamplingParams, StepRecord

from .helpers import random_prompts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def step_view(record: StepRecord, ids: list[int]) -> tuple:
    """A record without its timing, with seq_ids renumbered 0, 1, ... in request order."""
    local = {seq_id: i for i, seq_id in enumerate(ids)}
    return (
        record.kind,
        [(local[seq_id], n) for seq_id, n in record.seqs],
        record.num_blocks_used,
        record.num_hit_tokens,
        [local[seq_id] for seq_id in record.preempted],
        record.num_waiting,
    )


def test_continuous_batching_steps_and_request_metrics(tiny_model):
    """Prompts of 5, 3 and 7 tokens asking for 2, 4 and 1 tokens: one prefill, then decode steps that
    shrink as requests finish (each finished request frees its block at once)."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=10)
    prompts = random_prompts(seed=20, lengths=[5, 3, 7])
    out = llm.generate(prompts, [greedy(2), greedy(4), greedy(1)], use_tqdm=False, return_metrics=True)
    ids = [o["metrics"].seq_id for o in out]
    assert [step_view(r, ids) for r in llm.metrics.steps] == [
        ("prefill", [(0, 5), (1, 3), (2, 7)], 3, 0, [], 0),  # one block each; request 2 is done after it
        ("decode", [(0, 1), (1, 1)], 2, 0, [], 0),  # request 0 gets its 2nd token and finishes
        ("decode", [(1, 1)], 1, 0, [], 0),
        ("decode", [(1, 1)], 1, 0, [], 0),
    ]
    assert [r.index for r in llm.metrics.steps] == [0, 1, 2, 3]
    assert all(r.num_blocks_used + r.num_blocks_free == 10 and r.elapsed > 0 for r in llm.metrics.steps)
    metrics = [o["metrics"] for o in out]
    assert all(isinstance(m, RequestMetrics) for m in metrics)
    assert [(m.num_prompt_tokens, m.num_output_tokens, m.num_cached_tokens, m.num_preemptions) for m in metrics] == [
        (5, 2, 0, 0),
        (3, 4, 0, 0),
        (7, 1, 0, 0),
    ]
    for m in metrics:
        assert 0 < m.ttft <= m.latency
    assert metrics[2].tpot is None  # one output token: no time between tokens
    assert metrics[1].tpot == pytest.approx((metrics[1].latency - metrics[1].ttft) / 3)
    assert llm.metrics.requests == {m.seq_id: m for m in metrics}


def test_outputs_carry_metrics_only_when_asked(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=10)
    prompt = random_prompts(seed=21, lengths=[6])
    plain = llm.generate(prompt, greedy(3), use_tqdm=False)
    assert set(plain[0]) == {"text", "token_ids", "finish_reason"}
    with_metrics = llm.generate(prompt, greedy(3), use_tqdm=False, return_metrics=True)
    assert with_metrics[0]["token_ids"] == plain[0]["token_ids"]
    assert len(llm.metrics.steps) == 3 and len(llm.metrics.requests) == 1  # only the latest call


def test_chunked_prefill_records_each_chunk(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16, max_num_batched_tokens=13)
    prompts = random_prompts(seed=22, lengths=[30, 4])
    out = llm.generate(prompts, greedy(2), use_tqdm=False, return_metrics=True)
    ids = [o["metrics"].seq_id for o in out]
    kinds_and_seqs = [(r.kind, step_view(r, ids)[1], r.num_waiting) for r in llm.metrics.steps]
    assert kinds_and_seqs == [
        ("prefill", [(0, 13)], 2),  # the long prompt takes the whole budget; it and request 1 wait
        ("prefill", [(0, 13)], 2),
        ("prefill", [(0, 4), (1, 4)], 0),  # its last 4 tokens, and request 1 fits in what is left
        ("decode", [(0, 1), (1, 1)], 0),
    ]


def test_prefix_cache_hits_are_counted(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    first = random_prompts(seed=23, lengths=[40])[0]
    llm.generate([first], greedy(2), use_tqdm=False)
    second = first[:32] + random_prompts(seed=24, lengths=[5])[0]  # shares exactly two full blocks
    out = llm.generate([second], greedy(2), use_tqdm=False, return_metrics=True)
    prefill = llm.metrics.steps[0]
    assert (prefill.kind, prefill.num_tokens, prefill.num_hit_blocks, prefill.num_hit_tokens) == ("prefill", 5, 2, 32)
    assert out[0]["metrics"].num_cached_tokens == 32
    assert [r.num_hit_blocks for r in llm.metrics.steps[1:]] == [0]


def test_manual_steps_return_their_records(tiny_model):
    """Driving the engine by hand: step() returns (finished, record); records pile up until clear()."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)
    seq = llm.add_request(random_prompts(seed=25, lengths=[9])[0], greedy(2))
    finished, record = llm.step()
    assert finished == [] and (record.kind, record.seqs) == ("prefill", [(seq.seq_id, 9)])
    finished, record = llm.step()
    assert finished == [seq] and (record.kind, record.seqs) == ("decode", [(seq.seq_id, 1)])
    assert len(llm.metrics.steps) == 2 and llm.metrics.requests[seq.seq_id].num_output_tokens == 2
    llm.metrics.clear()
    assert llm.metrics.steps == [] and llm.metrics.requests == {}


def test_a_preempted_requests_num_cached_tokens_is_its_first_admissions(tiny_model, monkeypatch):
    """vLLM's num_cached_tokens counts the prompt tokens the prefix cache served when the request was first
    scheduled. A preempted request is admitted again later, where the cache may hold the blocks it computed itself
    (its prompt's and its generated tokens'): those are not prompt tokens served from the cache."""
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=12, kvcache_block_size=16, max_num_seqs=4)
    system = random_prompts(seed=30, lengths=[32])[0]
    llm.generate([system], greedy(1), use_tqdm=False)  # its two blocks now in the prefix cache
    prompts = [system + tail for tail in random_prompts(seed=31, lengths=[8, 8, 8, 8])]
    manager, readmitted_hits = llm.scheduler.block_manager, []
    allocate = manager.allocate

    def spy(seq):
        allocate(seq)
        if seq.num_preemptions:
            readmitted_hits.append(seq.num_computed_tokens)

    monkeypatch.setattr(manager, "allocate", spy)
    outs = llm.generate(prompts, greedy(56), use_tqdm=False, return_metrics=True)
    # (the case this checks: a preempted request admitted again found more than the system prompt in the cache)
    assert max(readmitted_hits, default=0) > 32, readmitted_hits
    for i, out in enumerate(outs):
        assert out.num_cached_tokens == 32, f"request {i}: {out.num_cached_tokens} cached of a 40-token prompt"
        assert out["metrics"].num_cached_tokens == 32, f"request {i}"
