"""Property tests (hypothesis): random request streams, block sizes and KV budgets.

Two levels:
- the scheduler and block manager driven by a fake model, with a shadow KV cache that records, for
  every slot, which token prefix produced its K/V. Every step checks that each sequence reads only
  its own prefix's K/V (so a prefix-cache hit is only ever for an identical token prefix) and never
  writes into a block another sequence holds; every request's output must equal a one-request-at-a-
  time oracle of the same fake model.
- the real engine on a tiny random Qwen3: greedy outputs under a tight KV budget (preemptions)
  equal the outputs under an ample one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoref import LLM, SamplingParams
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence, SequenceStatus

VOCAB = 3  # a tiny alphabet: random prompts share prefixes, so the prefix cache gets real work
EOS = 2


def fake_next_token(token_ids: list[int]) -> int:
    """A deterministic "model": the next token depends on every token before it, like greedy decoding."""
    return sum((i + 1) * t for i, t in enumerate(token_ids)) % VOCAB


def oracle_completion(prompt: list[int], max_tokens: int, max_model_len: int, use_eos: bool) -> list[int]:
    """The fake model run on one request alone, with no cache and no scheduler."""
    tokens = list(prompt)
    while True:
        token = fake_next_token(tokens)
        tokens.append(token)
        if (use_eos and token == EOS) or len(tokens) - len(prompt) >= max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt) :]


@dataclass
class Request:
    arrival: int  # the step before which it is added
    prompt: list[int]
    max_tokens: int


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(4, 64))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_model_len - 1))
        requests.append(Request(draw(st.integers(0, 12)), prompt, draw(st.integers(1, 24))))
    w = dict(block_size=block_size, max_model_len=max_model_len, requests=requests)
    # the KV budget: from "the largest request just fits" (the engine's admission rule) to plenty
    return dict(
        w,
        num_blocks=min_blocks(w) + draw(st.integers(0, 12)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        use_eos=draw(st.booleans()),
    )


def min_blocks(w: dict) -> int:
    """The smallest KV budget the engine accepts for this workload: its largest request's blocks."""
    longest = max(min(len(r.prompt) + r.max_tokens, w["max_model_len"]) for r in w["requests"])
    return -(-longest // w["block_size"])


def run_fake_engine(w: dict) -> tuple[list[Sequence], Scheduler, int]:
    """Serve the workload step by step, checking the KV bookkeeping at every step.

    Returns (the sequences in request order, the scheduler, prefix-cache hit tokens seen)."""
    bs = w["block_size"]
    scheduler = Scheduler(
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        max_model_len=w["max_model_len"],
        num_kvcache_blocks=w["num_blocks"],
        kvcache_block_size=bs,
        eos_token_ids={EOS} if w["use_eos"] else set(),
    )
    manager = scheduler.block_manager
    seqs = [
        Sequence(r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=False), bs)
        for r in w["requests"]
    ]
    shadow: dict[int, tuple[int, ...]] = {}  # cache slot -> the token prefix whose last token's K/V it holds
    finished: list[Sequence] = []
    step = 0
    while step <= max(r.arrival for r in w["requests"]) or not scheduler.is_finished():
        for seq, request in zip(seqs, w["requests"]):
            if request.arrival == step:
                scheduler.add(seq)
        step += 1
        assert step < 5_000, "the scheduler stopped making progress"
        if scheduler.is_finished():
            continue  # idle until the next arrival
        batch, is_prefill = scheduler.schedule()
        assert batch and len(batch) <= w["max_num_seqs"]
        assert all(s.num_scheduled_tokens >= 1 for s in batch), "an empty query: no token to take logits from"
        assert len(scheduler.running) <= w["max_num_seqs"]
        if is_prefill:
            budget_left = w["max_num_batched_tokens"] - sum(s.num_scheduled_tokens for s in batch)
            assert budget_left >= 0
            head = scheduler.waiting[0] if scheduler.waiting else None
            if head is not None and not head.block_table and budget_left > 0 and manager.can_allocate(head):
                assert len(scheduler.running) == w["max_num_seqs"], "a request that fits was left waiting"
        else:
            assert all(s.num_scheduled_tokens == 1 for s in batch)
        live = [s for s in seqs if s.block_table]
        manager.check_invariants(live)  # ref counts = holders, no block both free and used, none leaked
        assert all(block.ref_count >= 0 for block in manager.blocks)
        for seq in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            assert end <= seq.num_tokens and len(seq.block_table) * bs >= end
            slot = lambda t: seq.block_table[t // bs] * bs + t % bs  # noqa: B023
            for t in range(start):  # history the step reads: this sequence's own K/V, nobody else's
                assert shadow.get(slot(t)) == tuple(seq.token_ids[: t + 1]), f"seq {seq.seq_id} reads wrong K/V at {t}"
            for t in range(start, end):
                assert manager.blocks[seq.block_table[t // bs]].ref_count == 1, "a write into a shared block"
                shadow[slot(t)] = tuple(seq.token_ids[: t + 1])
        finished += scheduler.postprocess(batch, [fake_next_token(s.token_ids) for s in batch])
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs), "a request lost or finished twice"
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks
    return seqs, scheduler, manager.num_hit_blocks * bs


_PROPERTY = settings(max_examples=300, deadline=None, derandomize=True)


def test_every_request_finishes_once_with_its_own_tokens():
    seen = {"preemptions": 0, "hit_tokens": 0}

    @_PROPERTY
    @given(workloads())
    def check(w):
        seqs, scheduler, hit_tokens = run_fake_engine(w)
        for seq, request in zip(seqs, w["requests"]):
            assert seq.status == SequenceStatus.FINISHED and not seq.block_table
            expected = oracle_completion(request.prompt, request.max_tokens, w["max_model_len"], w["use_eos"])
            assert seq.completion_token_ids == expected
        seen["preemptions"] += scheduler.num_preemptions
        seen["hit_tokens"] += hit_tokens

    check()
    # the property must have been exercised where it matters, not only on easy workloads
    assert seen["preemptions"] > 20 and seen["hit_tokens"] > 100, seen


def test_tight_budget_gives_the_same_schedule_outcome_as_ample():
    """Same workload, KV budget at the admission minimum vs plenty: same outputs, token for token."""

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(workloads())
    def check(w):
        tight, _, _ = run_fake_engine({**w, "num_blocks": min_blocks(w)})
        ample, _, _ = run_fake_engine({**w, "num_blocks": 1_000})
        assert [s.completion_token_ids for s in tight] == [s.completion_token_ids for s in ample]

    check()


# -- the real engine ------------------------------------------------------------------------------
@st.composite
def engine_workloads(draw):
    prefix = draw(st.lists(st.integers(0, 255), min_size=0, max_size=40))
    prompts = [
        (prefix if draw(st.booleans()) else []) + draw(st.lists(st.integers(0, 255), min_size=1, max_size=24))
        for _ in range(draw(st.integers(3, 6)))
    ]
    return dict(
        prompts=prompts,
        max_tokens=[draw(st.integers(1, 32)) for _ in prompts],
        block_size=draw(st.sampled_from([16, 32])),
        max_num_seqs=draw(st.integers(3, 8)),
        max_num_batched_tokens=draw(st.sampled_from([16, 40, 4096])),
        extra_blocks=draw(st.integers(0, 1)),
    )


@pytest.mark.slow  # the real engine, twenty times over
def test_greedy_outputs_under_tight_budget_equal_ample(tiny_model):
    seen = {"examples": 0, "preempted": 0}

    @settings(max_examples=20, deadline=None, derandomize=True)
    @given(engine_workloads())
    def check(w):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w["max_tokens"]]
        bs = w["block_size"]
        needed = max(-(-(len(p) + n) // bs) for p, n in zip(w["prompts"], w["max_tokens"]))
        tight_llm, ample_llm = (
            LLM(
                tiny_model,
                device="cpu",
                kvcache_block_size=bs,
                num_kvcache_blocks=budget,
                max_num_seqs=w["max_num_seqs"],
                max_num_batched_tokens=w["max_num_batched_tokens"],
                max_model_len=128,
            )
            for budget in (needed + w["extra_blocks"], 64)
        )
        tight = tight_llm.generate(w["prompts"], params, use_tqdm=False)
        ample = ample_llm.generate(w["prompts"], params, use_tqdm=False)
        assert tight == ample
        for llm in (tight_llm, ample_llm):
            manager = llm.scheduler.block_manager
            manager.check_invariants([])
            assert manager.num_free_blocks == manager.num_blocks
        assert ample_llm.scheduler.num_preemptions == 0
        seen["examples"] += 1
        seen["preempted"] += tight_llm.scheduler.num_preemptions > 0

    check()
    assert seen["preempted"] >= 5, seen  # the tight budgets really did preempt
