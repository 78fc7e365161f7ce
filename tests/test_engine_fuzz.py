"""Seeded random workloads through the real engine (a tiny Qwen3 on the CPU), checked after every step.

One workload mixes what real use mixes at once: prompts sharing a prefix (prefix-cache hits; a prompt of whole
blocks sent again once its blocks are cached, so that all but its last block is a hit), chunked prefill under a small
max_num_batched_tokens, a KV cache small enough to preempt, n > 1 samples, aborts at random points (right after
add_request, between steps, one sample of several, a finished one), a forward that raises, reset_prefix_cache calls,
min_tokens (right at a stop id, too), max_tokens, max_model_len, stop ids, logprobs and prompt logprobs; on the torch
and the default CPU attention backend, with and without the prefix cache and chunked prefill; in the plain loop, the
overlapped loop, n-gram speculation, n-gram speculation whose plain steps run in the overlapped loop (as on CUDA),
and a draft model (the target itself, so that a greedy request's every proposal is accepted: a rejected one means
the draft read K/V it does not have).

After every step and abort: every block's ref count is the number of live sequences holding it, free + used = total,
no sequence holds a block twice, a finished or aborted sequence holds none, the queues hold each unfinished sequence
once. At the end: the engine is empty (blocks, queues, held samples, tracked requests, steps in flight), and every
sample not aborted gave what its request gives alone (tokens, finish and stop reasons, logprobs).
"""

from __future__ import annotations

import random
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.engine.sequence import Sequence, SequenceStatus
from nanoref.overlap import OverlappedLoop
from nanoref.speculative.loop import SpeculativeLoop

BLOCK = 16
LOOPS = ("plain", "overlapped", "ngram", "ngram+overlapped")


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    arrival: int  # the step before which it is added
    abort_at: int | None = None  # the step before which it is aborted (or some of its samples); None: never
    abort_all_samples: bool = True
    samples: list[Sequence] = field(default_factory=list)
    aborted: set[int] = field(default_factory=set)  # seq_ids


def make_requests(rng: random.Random, free_run, seeded_ok: bool) -> list[Request]:
    """free_run(prompt, max_tokens) -> the prompt's greedy continuation alone (where stop ids are picked from)."""
    vocab = 256
    prefix = [rng.randrange(vocab) for _ in range(rng.choice([BLOCK, 2 * BLOCK, 20, 40]))]
    aligned = [rng.randrange(vocab) for _ in range(2 * BLOCK)]  # whole blocks: sent more than once
    phrase = [rng.randrange(vocab) for _ in range(4)]
    requests = []
    for index in range(rng.randrange(4, 12)):
        kind = 0 if index < 2 else rng.random()  # the first two: the prompt of whole blocks, once it is cached
        if kind < 0.25:
            prompt = list(aligned)
        elif kind < 0.6:
            prompt = prefix + [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        elif kind < 0.75:
            prompt = (phrase * 12)[: rng.randrange(6, 40)]  # repeats: n-gram proposals that get accepted
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        max_tokens = rng.randrange(1, 24)
        stop, min_tokens = [], rng.choice([0, 0, rng.randrange(max_tokens + 1)])
        if rng.random() < 0.4:  # a stop id the request really produces (or one it never does)
            tokens = free_run(prompt, max_tokens)
            at = rng.randrange(len(tokens))
            stop = [tokens[at]] if rng.random() < 0.8 else [rng.randrange(vocab)]
            if rng.random() < 0.5:  # min_tokens right at it: the first position it may stop at, or the last masked
                min_tokens = tokens.index(tokens[at]) + rng.choice([0, 1])
        n = rng.choice([1, 1, 1, 2, 3])
        seeded = seeded_ok and rng.random() < 0.3  # (a verify step draws otherwise than a plain one)
        params = SamplingParams(
            # n > 1 unseeded: top_k=1 samples are the argmax's tokens, the same as a greedy request's
            temperature=0 if n == 1 and not seeded else 0.8,
            top_k=1 if n > 1 and not seeded else 0,
            seed=rng.randrange(1000) if seeded else None,
            n=n,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=stop,
            logprobs=rng.choice([None] * 5 + [2]),  # (the overlapped loop runs no step ahead of one that asks)
            prompt_logprobs=rng.choice([None] * 5 + [1]),
        )
        arrival = [0, rng.randrange(2, 8)][index] if index < 2 else rng.choice([0, 0, rng.randrange(12)])
        abort_at = None
        if rng.random() < 0.25:
            abort_at = arrival + rng.choice([0, 0, 1, rng.randrange(12)])  # 0: before its first step
        requests.append(Request(prompt, params, arrival, abort_at, rng.random() < 0.5))
    return requests


def make_engine(model, loop: str, rng: random.Random, block: int, num_blocks: int, max_model_len: int,
                backend: str) -> LLM:  # fmt: skip
    settings = dict(
        device="cpu",
        attention_backend=backend,
        kvcache_block_size=block,
        num_kvcache_blocks=num_blocks,
        max_num_seqs=rng.choice([2, 3, 4]),
        max_num_batched_tokens=rng.choice([16, 24, 40, 512]),
        max_model_len=max_model_len,
    )
    if rng.random() < 0.15:
        settings["enable_prefix_caching"] = False
    elif rng.random() < 0.15:
        settings.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 64))
    if loop == "overlapped":
        settings["overlap_scheduling"] = True
    if loop.startswith("ngram"):
        limit = 0 if loop == "ngram" else 2  # ngram+overlapped: batches above 2 run plain, overlapped
        settings["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": rng.choice([2, 3, 5]),
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "disable_by_batch_size": limit,
            "min_tokens_per_step": rng.choice([0, 0, 1.5]),  # 1.5: plain steps between verify steps too
        }
    if loop == "draft":  # the target as its own draft: a greedy request's every proposal is the target's token
        settings["speculative_config"] = {
            "model": str(model),
            "num_speculative_tokens": rng.choice([2, 3, 5]),
            "disable_by_batch_size": rng.choice([0, 2]),  # 2: some prefills leave the draft out; it catches up
            "min_tokens_per_step": 0,
        }
    llm = LLM(model, **settings)
    if loop == "ngram+overlapped":  # the speculative loop as CUDA builds it: its plain decode steps overlap
        llm.step_loop = SpeculativeLoop(weakref.proxy(llm), make_plain_loop=OverlappedLoop)
    return llm


class InjectedFault(RuntimeError):
    pass


def fail_next_forward(llm: LLM) -> None:
    """The model runner's next forward raises (once)."""
    runner = llm.model_runner
    forward = runner.run_forward

    def failing(*args, **kwargs):
        runner.run_forward = forward
        raise InjectedFault("a forward that fails")

    runner.run_forward = failing


def check_step(llm: LLM, seqs: list[Sequence]) -> None:
    """The bookkeeping between two steps."""
    manager = llm.scheduler.block_manager
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
        if seq.is_finished:
            assert not seq.block_table and seq.table_row == -1, f"finished {seq} still holds blocks"
        assert seq.num_computed_tokens <= seq.num_tokens
    live = [seq for seq in seqs if seq.block_table]
    manager.check_invariants(live)  # ref counts = holders, free + used = total, the tables' array
    queued = [*llm.scheduler.waiting, *llm.scheduler.running]
    assert len({seq.seq_id for seq in queued}) == len(queued), "a sequence queued twice"
    assert all(not seq.is_finished for seq in queued), "a finished sequence is still queued"
    for seq in llm.scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
    for seq in llm.scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING


def check_empty(llm: LLM) -> None:
    manager = llm.scheduler.block_manager
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks
    assert llm.is_finished() and not llm.output_processor.held_samples
    assert not llm.metrics._pending, f"requests still tracked: {sorted(llm.metrics._pending)}"
    loop = llm.step_loop
    loop = getattr(loop, "plain_loop", loop)
    assert getattr(loop, "in_flight", None) is None, "a step left in flight"


def run_workload(model, seed: int, loop: str, alone) -> dict:
    """One seeded workload in one loop (LOOPS, or "draft"), checked against `alone` (an `Alone`) -> what it did."""
    rng = random.Random(seed)
    free_run = lambda p, m: alone(p, SamplingParams(temperature=0, max_tokens=m), 256, "torch")[0][0][0]  # noqa: E731
    requests = make_requests(rng, free_run, seeded_ok=loop in ("plain", "overlapped"))
    max_model_len = rng.choice([256, 256, 48, 64])  # (short: some requests end at it, verify steps near it)
    requests = [r for r in requests if len(r.prompt) < max_model_len]
    longest = max(min(len(r.prompt) + r.params.max_tokens, max_model_len) for r in requests)
    block = rng.choice([BLOCK, BLOCK, 2 * BLOCK])
    num_blocks = -(-longest // block) + rng.choice([0, 0, 1, 2, 16])  # (16: no preemption, decode steps run ahead)
    backend = rng.choice(["torch", "auto"])  # auto: the C++ kernels where they build
    llm = make_engine(model, loop, rng, block, num_blocks, max_model_len, backend)
    seqs: list[Sequence] = []
    failed: set[int] = set()  # the seq_ids a failing step aborted
    fault_at = rng.randrange(20) if rng.random() < 0.3 else None  # a step whose forward raises
    step = 0
    while step <= max(r.arrival for r in requests) or not llm.is_finished():
        for r in requests:
            if r.arrival == step:
                r.samples = llm.add_samples(r.prompt, r.params)
                seqs += r.samples
                check_step(llm, seqs)
            if r.abort_at == step and r.samples:
                chosen = r.samples if r.abort_all_samples else [rng.choice(r.samples)]
                for seq in chosen:
                    if not seq.is_finished:
                        r.aborted.add(seq.seq_id)
                    llm.abort_request(seq)
                    assert seq.is_finished and not seq.block_table
                check_step(llm, seqs)
        if rng.random() < 0.1:  # refused (and changes nothing) while a request holds blocks
            held = bool(llm.scheduler.block_manager.used_block_ids)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                assert llm.reset_prefix_cache() is not held
            check_step(llm, seqs)
        if not llm.is_finished():
            if step == fault_at:
                fail_next_forward(llm)  # (an overlapped step that only completes the one in flight runs none)
            try:
                llm.step()
            except InjectedFault:
                assert llm.failed and all(seq.finish_reason == "abort" for seq in llm.failed)
                failed |= {seq.seq_id for seq in llm.failed}
            check_step(llm, seqs)
        step += 1
        assert step < 2_000, "no progress"
    check_empty(llm)
    for i, r in enumerate(requests):
        wants, want_prompt = alone(r.prompt, r.params, max_model_len, backend)
        out = llm.output_processor.request_output(r.samples)
        where = f"seed {seed} {loop}: request {i}"
        for index, (seq, got) in enumerate(zip(r.samples, out.outputs)):
            want = wants[index if r.params.seed is not None else 0]
            if seq.seq_id in r.aborted | failed:
                assert seq.finish_reason == "abort"
                continue
            assert (got.token_ids, got.finish_reason, got.stop_reason) == want[:3], f"{where} sample {index}: {got}"
            assert_logprobs_close(got.logprobs, want[3], f"{where} sample {index}")
        if r.samples[0].seq_id not in r.aborted | failed:
            assert_logprobs_close(out.prompt_logprobs, want_prompt, f"{where} prompt")
        if loop == "draft" and not r.params.min_tokens:  # (short of min_tokens the target masks what the draft not)
            for seq in r.samples:
                if seq.seq_id not in r.aborted | failed:
                    m = llm.metrics.requests[seq.seq_id]
                    assert m.num_accepted_tokens == m.num_draft_tokens, f"{where}: the draft's K/V is not the target's"
    cached = {seq_id: m.num_cached_tokens for seq_id, m in llm.metrics.requests.items()}
    aligned = [  # samples of the prompt of whole blocks served from the cache but for its last block (recomputed)
        seq for r in requests if len(r.prompt) % block == 0 and len(r.prompt) > block
        for seq in r.samples if cached.get(seq.seq_id) == len(r.prompt) - block
    ]  # fmt: skip
    return {
        "aligned_hits": len(aligned),
        "samples_of_several": sum(len(r.samples) for r in requests if r.params.n > 1),
        "preemptions": llm.scheduler.num_preemptions,
        "hits": llm.scheduler.block_manager.num_hit_blocks,
        "aborted": sum(len(r.aborted) for r in requests),
        "failed": len(failed),
        "steps": step,
    }


def assert_logprobs_close(got, want, where: str) -> None:
    """Two lists of logprobs (vLLM's form: {token id: Logprob} or None per position; None: not asked) agree: the
    same tokens at every position, each logprob within float32 noise of a batch of another shape."""
    assert (got is None) == (want is None), where
    if got is None:
        return
    assert len(got) == len(want), where
    for position, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"{where} position {position}"
        if a is None:
            continue
        assert a.keys() & b.keys(), f"{where} position {position}: {a} != {b}"  # (a top N may differ in a near-tie)
        for token in a.keys() & b.keys():
            assert abs(a[token].logprob - b[token].logprob) < 1e-3, f"{where} position {position}: {a} != {b}"


class Alone:
    """The oracle: each request alone in a plain engine of the same attention backend and max_model_len that shares
    nothing (no prefix cache) and has ample KV blocks -> ([(tokens, finish reason, stop reason, logprobs)] per
    sample, prompt logprobs). A request of n top_k=1 samples runs as one greedy request."""

    def __init__(self, model) -> None:
        self.model = model
        self.engines: dict[tuple[int, str], LLM] = {}
        self.cache: dict = {}

    def __call__(self, prompt: list[int], params: SamplingParams, max_model_len: int, backend: str):
        if (max_model_len, backend) not in self.engines:
            self.engines[max_model_len, backend] = LLM(self.model, device="cpu", attention_backend=backend,
                num_kvcache_blocks=64, max_model_len=max_model_len, enable_prefix_caching=False)  # fmt: skip
        p = params
        if p.seed is None:  # (n argmax samples: one greedy request's)
            p = replace(p, temperature=0, top_k=0, n=1)
        key = (tuple(prompt), repr(p), max_model_len, backend)
        if key not in self.cache:
            out = self.engines[max_model_len, backend].generate([prompt], p, use_tqdm=False)[0]
            self.cache[key] = (
                [(o["token_ids"], o["finish_reason"], o.stop_reason, o.logprobs) for o in out.outputs],
                out.prompt_logprobs,
            )
        return self.cache[key]


# a fixed set, the same workloads every run, chosen for doing in every loop all of what the assertion below asks
# (python -m tests.test_engine_fuzz FIRST LAST sweeps a range on the three tiny models)
SEEDS = (0, 2, 4, 8, 11, 12, 13)


@pytest.fixture(scope="module")
def alone(tiny_model):
    return Alone(tiny_model)


@pytest.fixture
def one_thread():
    """A model this small runs fastest on one thread, and on a busy machine two threads wait on each other (a
    workload then takes several times as long)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("loop", [*LOOPS, "draft"])
def test_random_workloads_keep_every_block_counted_and_give_each_request_its_output_alone(
    tiny_model, alone, one_thread, loop
):
    seen = Counter()
    for seed in SEEDS:
        seen.update(run_workload(tiny_model, seed, loop, alone))
    # the workloads did what they are for, in every loop
    wanted = ("preemptions", "hits", "aligned_hits", "aborted", "failed", "samples_of_several")
    assert all(seen[what] for what in wanted), seen


def sweep(first: int, last: int) -> None:
    """Every loop on seeds first..last - 1, on the tiny models of tests/helpers.py, printing each failure."""
    import tempfile
    from pathlib import Path

    from nanoref.testing import make_tiny_qwen3

    from .helpers import TINY_CONFIGS

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        configs = TINY_CONFIGS.items()
        models = [make_tiny_qwen3(Path(root) / name, seed=i, **cfg) for i, (name, cfg) in enumerate(configs)]
        oracles = [Alone(model) for model in models]
        seen = Counter()
        for seed in range(first, last):
            for loop in [*LOOPS, "draft"]:
                try:
                    seen.update(run_workload(models[seed % 3], seed, loop, oracles[seed % 3]))
                except AssertionError as error:
                    print(f"seed {seed}, {loop}, model {seed % 3}: {error}", flush=True)
        print(dict(seen))


if __name__ == "__main__":  # python -m tests.test_engine_fuzz FIRST LAST
    import sys

    sweep(int(sys.argv[1]), int(sys.argv[2]))
