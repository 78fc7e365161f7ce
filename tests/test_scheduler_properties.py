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

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoref import LLM, SamplingParams
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence, SequenceStatus
from nanoref.testing import EVERY_STEP

from .helpers import assert_no_block_leaked

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


# -- the real engine, driven step by step with mixed requests -------------------------------------
LOOPS = {
    "plain": {},
    "overlapped": {"overlap_scheduling": True},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, **EVERY_STEP}},
}


def mixed_requests(rng: random.Random, greedy_only: bool) -> list[tuple[list[int], SamplingParams, int, int | None]]:
    """(prompt, params, the step before which it is added, the step before which it is aborted or None): seeded
    requests of n up to 3 samples, greedy ones (n=1, as vLLM takes them: some sent two or three times, as requests of
    their own; greedy_only: also n up to 3 with top_k=1), min_tokens, stop ids, logprobs, prompts that share a prefix
    or repeat a phrase."""
    prefix = [rng.randrange(1, 1024) for _ in range(20)]
    requests = []
    for _ in range(rng.randrange(3, 7)):
        body = [rng.randrange(1, 1024) for _ in range(rng.randrange(1, 30))]
        body = body if rng.random() < 0.6 else (body[:3] * 10)[: len(body)]
        seeded = not greedy_only and rng.random() < 0.5
        max_tokens = rng.randrange(1, 20)
        seed = rng.randrange(100) if seeded else None
        n = rng.choice([1, 1, 2, 3])
        # (greedy_only: the ngram loop, whose n samples sharing their prompt's blocks through verify steps and
        # preemption are top_k=1's: the argmax's tokens, as greedy ones, whatever the generator draws)
        argmax = greedy_only and n > 1 and rng.random() < 0.7
        params = SamplingParams(
            temperature=0.9 if seeded or argmax else 0,
            top_k=1 if argmax else 0,
            seed=seed,
            n=n if seeded or argmax else 1,
            max_tokens=max_tokens,
            min_tokens=rng.choice([0, 0, rng.randrange(max_tokens + 1)]),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.sample(range(1024), 40) if rng.random() < 0.3 else [],
            logprobs=rng.choice([None, 2]),
            prompt_logprobs=rng.choice([None, None, 1]),
        )
        request = (prefix + body if rng.random() < 0.5 else body, params, rng.choice([0, 0, rng.randrange(8)]),
                   rng.randrange(1, 10) if rng.random() < 0.2 else None)  # fmt: skip
        requests += [request] * (1 if seeded or argmax else n)
    return requests


@pytest.mark.slow  # the real engine, a dozen workloads
@pytest.mark.parametrize("loop", LOOPS)
def test_mixed_requests_added_and_aborted_between_steps_each_give_what_they_give_alone(loop):
    """The built-in model under a KV budget its largest request just fits, few sequences and small prefill chunks:
    requests added between steps, some aborted mid-way (some of their samples), in the plain, overlapped and
    speculative loops. Every sample not aborted gives what its request gives alone (tokens, finish and stop
    reasons, logprobs), an aborted one ends "abort", and every block and queue is empty afterwards."""
    seen = {"preempted": 0, "aborted": 0}
    for seed in range(4):
        rng = random.Random(seed)
        requests = mixed_requests(rng, greedy_only=loop == "ngram")  # (a verify step draws otherwise than a plain one)
        reference = LLM(device="cpu", num_kvcache_blocks=64)
        alone = [reference.generate([prompt], params, use_tqdm=False)[0] for prompt, params, _, _ in requests]
        budget = max(-(-(len(prompt) + params.max_tokens + 3) // 16) for prompt, params, _, _ in requests)
        llm = LLM(device="cpu", num_kvcache_blocks=budget, max_num_seqs=rng.choice([2, 3]),
                  max_num_batched_tokens=rng.choice([16, 40]), **LOOPS[loop])  # fmt: skip
        samples, aborted, step = {}, set(), 0
        while len(samples) < len(requests) or not llm.is_finished():
            for i, (prompt, params, arrival, abort_at) in enumerate(requests):
                if arrival == step:
                    samples[i] = llm.add_samples(prompt, params)
                if abort_at == step and i in samples:
                    for seq in samples[i] if rng.random() < 0.5 else samples[i][:1]:
                        aborted |= set() if seq.is_finished else {seq}
                        llm.abort_request(seq)
            if not llm.is_finished():
                llm.step()
            step += 1
        assert_no_block_leaked(llm)
        assert llm.scheduler.is_finished() and not llm.output_processor.held_samples
        for i, expected in enumerate(alone):
            out = llm.output_processor.request_output(samples[i])
            assert len(out.outputs) == requests[i][1].n
            for seq, got, want in zip(samples[i], out.outputs, expected.outputs):
                if seq in aborted:
                    assert got.finish_reason == "abort"
                    continue
                assert (got.token_ids, got.finish_reason, got.stop_reason) == (
                    want.token_ids, want.finish_reason, want.stop_reason), f"seed {seed}, request {i}"  # fmt: skip
                assert [e.token_id for e in got.get("logprobs", [])] == [e.token_id for e in want.get("logprobs", [])]
            if samples[i][0] not in aborted and requests[i][1].prompt_logprobs:
                assert [e and e.token_id for e in out["prompt_logprobs"]] == [None, *requests[i][0][1:]]
        seen["preempted"] += llm.scheduler.num_preemptions > 0
        seen["aborted"] += bool(aborted)
    assert seen["preempted"] >= 2 and seen["aborted"] >= 1, seen  # the workloads did preempt and abort
