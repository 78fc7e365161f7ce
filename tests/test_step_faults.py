"""A step that raises, an error or a Ctrl-C at any line of the bookkeeping, aborts the requests it scheduled and
leaves the engine consistent and serving the others.

Faults are injected where they really happen: a learner's exercise function (`choose_preemption_victim`,
`find_cached_prefix`) that raises or answers wrongly under KV pressure, and a real SIGINT sent to this process at
the k-th line the engine runs (`CtrlC`, through sys.settrace), swept over the lines of the scheduler, the block
manager, the sequences, the metrics and the engine loop, plain and overlapped, inside `generate` and driven by
add_request / step. After each: the step's requests ended with "abort" and their blocks went back (`llm.failed`),
the block manager's invariants hold for the live sequences, nothing is queued that the caller did not ask for,
SIGINT's handler is Python's default again, and every other request's output is a fresh engine's (which
test_the_workload_preempts_chunks_and_hits_the_cache checks against HF).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections import defaultdict

import pytest
import torch

from nanoref import LLM, SamplingParams, overlap
from nanoref.engine import block_manager, llm_engine, metrics, model_runner, scheduler, sequence
from nanoref.engine.block_manager import find_cached_prefix
from nanoref.engine.sequence import Sequence, SequenceStatus
from nanoref.exercises import use
from nanoref.models import qwen3
from nanoref.utils.interrupts import held_interrupts, interruptibly

from .helpers import (
    assert_matches_hf,
    assert_no_block_leaked,
    assert_preempted_and_recomputed_from_the_cache,
    shared_prefix_prompts,
)

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Three prompts of two 16-token blocks sharing the first: five blocks make decode preempt (and the preempted
# sequence's recompute hit the cache), 32-token batches cut a prompt into chunks.
PROMPTS = shared_prefix_prompts(seed=3, prefix_len=16, suffix_lens=[14, 13, 15])
TIGHT = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=5, max_num_batched_tokens=32)
BOOKKEEPING = {module.__file__ for module in (scheduler, block_manager, sequence, metrics, llm_engine, overlap)}
FORWARD = {model_runner.__file__, qwen3.__file__}
# what checks a request before anything is queued (pure: nothing to leave half done), left out of the sweeps
REQUEST_CHECKS = {"tokenize", "make_samples", "__init__"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tests run a few thousand tiny steps: a 64-wide model's matmuls only lose time to a second thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[dict]:
    return LLM(tiny_model, **TIGHT).generate(PROMPTS, PARAMS, use_tqdm=False)


class CtrlC:
    """A sys.settrace hook counting the lines run in `files`; at line number `at` it sends this process a real
    SIGINT, as a terminal's Ctrl-C does: Python raises KeyboardInterrupt wherever it next checks for signals (or,
    when the engine holds it back, later). With at=0 it only records: the count at which each line first ran
    (`first`, request checks left out), and the count at each call of each function (`calls`)."""

    def __init__(self, files: set[str], at: int = 0) -> None:
        self.files, self.at, self.count = files, at, 0
        self.first: dict[tuple[str, int], int] = {}
        self.calls: dict[str, list[int]] = defaultdict(list)

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in self.files:
            return None
        self.calls[frame.f_code.co_name].append(self.count)
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if not self.at and frame.f_code.co_name not in REQUEST_CHECKS:
                self.first.setdefault((frame.f_code.co_filename, frame.f_lineno), self.count)
            elif self.count == self.at:
                signal.raise_signal(signal.SIGINT)
        return self._line

    def run(self, fn, *args, **kwargs):
        sys.settrace(self)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(None)


def run_steps(llm, states: list | None = None) -> None:
    """Step until every request has finished; each step's index goes to `states` if given."""
    while not llm.is_finished():
        if states is not None:
            states.append(len(llm.metrics.steps))
        llm.step()


def assert_consistent(llm, requests: list[Sequence]) -> None:
    """The engine between two steps: each request finished or in one queue in the matching state, no token
    scheduled but the step in flight's, only the head of `waiting` holding blocks (a prompt part-way prefilled),
    every block counted once, and SIGINT's handler Python's default again."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "SIGINT's handler was left changed"
    sched, manager = llm.scheduler, llm.scheduler.block_manager
    queued = [*sched.running, *sched.waiting]
    assert len({id(seq) for seq in queued}) == len(queued), "a sequence is queued twice"
    for seq in requests:
        assert seq.is_finished != any(seq is other for other in queued), f"{seq} is lost, or queued but finished"
    loop = llm.overlapped_loop
    step_n = loop.in_flight if loop is not None else None  # (the overlapped loop's step in flight)
    in_flight = step_n.seqs if step_n is not None else []
    for seq in in_flight:  # a decode's rows, or a prefill's prompts (its last maybe a chunk, still first in line)
        assert any(seq is other for other in queued) and seq.num_scheduled_tokens > 0, f"{seq} left its step"
        assert seq.num_computed_tokens + seq.num_scheduled_tokens <= seq.num_tokens, seq
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING, seq
        if not any(seq is other for other in in_flight):
            assert seq.num_scheduled_tokens == 0 and seq.num_computed_tokens == seq.num_tokens - 1, seq
    for index, seq in enumerate(sched.waiting):
        assert seq.status is SequenceStatus.WAITING and (index == 0 or not seq.block_table), seq
        assert seq.block_table or seq.num_computed_tokens == 0, seq
        assert seq.num_scheduled_tokens == 0 or (index == 0 and any(seq is other for other in in_flight)), seq
    for seq in queued:
        needed = seq.num_computed_tokens + seq.num_scheduled_tokens
        assert len(seq.block_table) >= manager.blocks_needed(needed), f"{seq} lacks blocks"
    manager.check_invariants([seq for seq in queued if seq.block_table])


def test_the_workload_preempts_chunks_and_hits_the_cache(tiny_model, expected):
    llm = LLM(tiny_model, **TIGHT)
    assert llm.generate(PROMPTS, PARAMS, use_tqdm=False) == expected
    assert_preempted_and_recomputed_from_the_cache(llm)
    steps = llm.metrics.steps
    chunked = [a.seqs[-1][0] == b.seqs[0][0] for a, b in zip(steps, steps[1:]) if a.kind == b.kind == "prefill"]
    assert any(chunked), "no prompt was cut into chunks"
    assert_matches_hf(tiny_model, PROMPTS, expected, PARAMS.max_tokens)


# -- a learner's exercise function that fails ---------------------------------------------------------------------
def learner_bug(*args):
    raise RuntimeError("a learner's bug")


def assert_aborted_and_serving(llm, seqs, expected: list[dict]) -> None:
    """The step that raised aborted the requests it scheduled (and only those), freed their blocks and forgot their
    metrics; the engine is consistent and then finishes every other request as a fresh engine does."""
    failed = llm.failed
    assert failed, "the step that raised aborted nothing"
    assert all(seq.finish_reason == "abort" and not seq.block_table for seq in failed), failed
    assert not {seq.seq_id for seq in failed} & set(llm.metrics._pending), "the metrics still track an aborted one"
    assert_consistent(llm, seqs)
    run_steps(llm)
    for seq, output in zip(seqs, expected):
        if not any(seq is other for other in failed):
            assert seq.completion_token_ids == output["token_ids"], seq
    assert_no_block_leaked(llm)


def steps_until_it_raises(llm, error: type[Exception], match: str) -> None:
    """Step until a step raises `error` with `match` in its message."""
    while not llm.is_finished():
        try:
            llm.step()
        except error as raised:
            assert match in str(raised)
            return
    raise AssertionError("no step raised: the fault was never reached")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_raising_victim_choice_aborts_its_step_and_the_engine_serves_on(tiny_model, expected, overlap):
    llm = LLM(tiny_model, overlap_scheduling=overlap, **TIGHT)
    seqs = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
    with use(choose_preemption_victim=learner_bug):
        steps_until_it_raises(llm, RuntimeError, "a learner's bug")
    assert_aborted_and_serving(llm, seqs, expected)  # nanoref's own functions again


@pytest.mark.parametrize("overlap", [False, True])
def test_a_raising_victim_choice_in_generate_leaves_every_block_free(tiny_model, expected, overlap):
    llm = LLM(tiny_model, overlap_scheduling=overlap, **TIGHT)
    with use(choose_preemption_victim=learner_bug), pytest.raises(RuntimeError, match="a learner's bug"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.is_finished()
    assert_no_block_leaked(llm)
    assert llm.generate(PROMPTS, PARAMS, use_tqdm=False) == expected


@pytest.mark.parametrize(
    "wrong_victim",
    [lambda running, seq: None, lambda running, seq: running[-1:], lambda running, seq: Sequence([1], PARAMS, 16)],
    ids=["nothing", "a list", "a new sequence"],
)
def test_a_victim_that_is_not_running_is_refused_and_its_step_aborted(tiny_model, expected, wrong_victim):
    llm = LLM(tiny_model, **TIGHT)
    seqs = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
    with use(choose_preemption_victim=wrong_victim):
        steps_until_it_raises(llm, ValueError, "is neither running nor")
    assert_aborted_and_serving(llm, seqs, expected)  # nanoref's own functions again


@pytest.mark.parametrize("failing_call", range(1, 9))
def test_a_raising_find_cached_prefix_aborts_its_batch_and_gives_back_its_blocks(tiny_model, expected, failing_call):
    """The lookup fails at its k-th call, in can_allocate or allocate: with nothing else in the batch yet (1, 2),
    after the first prompt's admission (3, 4), after a chunked prompt's continuation (5, 6), in a preempted
    prompt's recompute (7, 8)."""
    llm = LLM(tiny_model, **TIGHT)
    seqs = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
    calls = []

    def flaky(*args):
        calls.append(len(calls))
        if len(calls) == failing_call:
            raise RuntimeError("a learner's bug")
        return find_cached_prefix(*args)

    with use(find_cached_prefix=flaky):
        steps_until_it_raises(llm, RuntimeError, "a learner's bug")
    assert_aborted_and_serving(llm, seqs, expected)  # nanoref's own functions again


# -- Ctrl-C ----------------------------------------------------------------------------------------------------------
def recorded(folder, overlap: bool, files: set[str], drive: str) -> CtrlC:
    """The lines and calls of the workload, served by `generate` or by add_request / step."""
    llm = LLM(folder, overlap_scheduling=overlap, **TIGHT)
    trace = CtrlC(files)
    if drive == "generate":
        trace.run(llm.generate, PROMPTS, PARAMS, use_tqdm=False)
    else:
        for prompt in PROMPTS:
            llm.add_request(prompt, PARAMS)
        trace.run(run_steps, llm)
    return trace


def interrupt_generate(folder, overlap: bool, files: set[str], at: int) -> LLM:
    llm = LLM(folder, overlap_scheduling=overlap, **TIGHT)
    with pytest.raises(KeyboardInterrupt):
        CtrlC(files, at).run(llm.generate, PROMPTS, PARAMS, use_tqdm=False)
    assert_consistent(llm, [])
    assert llm.is_finished(), "a request of the interrupted call stayed queued"
    assert_no_block_leaked(llm)
    return llm


def interrupt_steps(folder, overlap: bool, files: set[str], at: int, expected: list[dict]) -> LLM:
    """Drive the workload with add_request / step, Ctrl-C at line `at`; then step on to the end."""
    llm = LLM(folder, overlap_scheduling=overlap, **TIGHT)
    seqs = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
    with pytest.raises(KeyboardInterrupt):
        CtrlC(files, at).run(run_steps, llm)
    if llm.failed:  # at a line of a lookup or a victim choice, which run interruptibly: their step is aborted
        assert_aborted_and_serving(llm, seqs, expected)
        return llm
    assert_consistent(llm, seqs)  # anywhere else it is held back until the step has ended
    run_steps(llm)
    assert [seq.completion_token_ids for seq in seqs] == [output["token_ids"] for output in expected]
    assert_no_block_leaked(llm)
    return llm


SWEEP_STRIDE = 4  # each sweep takes every fourth line (in order of first run), from its own offset


@pytest.mark.parametrize(
    "overlap, drive, offset",
    [(False, "generate", 0), (False, "steps", 2), (True, "generate", 1), (True, "steps", 3)],
    ids=["plain-generate", "plain-steps", "overlapped-generate", "overlapped-steps"],
)
def test_ctrl_c_at_any_line_of_the_bookkeeping(tiny_model, expected, overlap, drive, offset):
    """A Ctrl-C at the first run of a line of the scheduler, block manager, sequences, metrics or engine loop (every
    fourth line per test, each from another offset, to keep the tests fast; the two ways of driving a loop run
    mostly the same lines, so together they take about every second line of it): the interrupted call raises
    KeyboardInterrupt, the engine is consistent, and then it serves the workload exactly."""
    points = sorted(recorded(tiny_model, overlap, BOOKKEEPING, drive).first.values())[offset::SWEEP_STRIDE]
    assert len(points) > 45
    for index, at in enumerate(points):
        if drive == "steps":
            interrupt_steps(tiny_model, overlap, BOOKKEEPING, at, expected)
            continue
        llm = interrupt_generate(tiny_model, overlap, BOOKKEEPING, at)
        if index % 2 == 0:  # (every second: a generate costs more than the rest of the check)
            assert llm.generate(PROMPTS, PARAMS, use_tqdm=False) == expected, f"after a Ctrl-C at line {at}"


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_ctrl_c_in_the_forward_is_raised_there_and_aborts_the_steps_requests(tiny_model, expected, overlap):
    """A Ctrl-C in each step's forward (the model's first line in it) raises at once, from inside the forward, not
    once the step is done; the requests of the step (both steps in flight, overlapped) end with "abort", and the
    others are then served as a fresh engine serves them."""
    trace = recorded(tiny_model, overlap, FORWARD, "steps")
    launches, forwards = trace.calls["launch"], trace.calls["forward"]
    points = [next(count for count in forwards if count >= launch) + 1 for launch in launches]
    assert len(points) >= 6
    for index, at in enumerate(points):
        llm = LLM(tiny_model, overlap_scheduling=overlap, **TIGHT)
        seqs = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
        states = []
        with pytest.raises(KeyboardInterrupt) as raised:
            CtrlC(FORWARD, at).run(run_steps, llm, states)
        assert any(str(entry.path) == qwen3.__file__ for entry in raised.traceback), "it waited for the forward"
        assert len(states) == index + 1 or overlap, "the interrupt hit another step than the one aimed at"
        if not overlap:  # exactly the interrupted step's sequences
            step = llm.metrics.steps[-1]
            assert sorted(seq.seq_id for seq in llm.failed) == sorted(seq_id for seq_id, _ in step.seqs)
        assert_aborted_and_serving(llm, seqs, expected)


def test_ctrl_c_while_generate_queues_its_requests_leaves_none_queued(tiny_model, expected):
    """Every line run from queuing the first request to the first step: the call raises and queues nothing, the
    metrics track nothing, and the next call runs only its own request."""
    trace = recorded(tiny_model, False, BOOKKEEPING, "generate")
    for at in range(trace.calls["enqueue"][0], trace.calls["schedule"][0] + 1):
        llm = interrupt_generate(tiny_model, False, BOOKKEEPING, at)
        assert not llm.metrics._pending, "the metrics still track a request of the interrupted call"
        assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False) == expected[:1]
        assert len(llm.metrics.requests) == 1, "the next call ran requests of the interrupted one"


def test_a_callers_own_sigint_handler_is_left_to_act(tiny_model, expected):
    """With a handler of the caller's own, the engine holds nothing back: the handler runs when SIGINT comes, and
    is still the handler afterwards."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        llm = LLM(tiny_model, **TIGHT)
        assert CtrlC(BOOKKEEPING, at=40).run(llm.generate, PROMPTS, PARAMS, use_tqdm=False) == expected
        assert calls == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


# -- the holding itself -------------------------------------------------------------------------------------------
def test_a_held_ctrl_c_is_raised_when_the_outermost_block_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt), held_interrupts():
        with held_interrupts():
            signal.raise_signal(signal.SIGINT)
            reached.append("the inner block's end")
        reached.append("the outer block's end")
    assert reached == ["the inner block's end", "the outer block's end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interruptibly_raises_at_once_and_first_raises_one_held_before():
    def wait_for_ctrl_c():
        signal.raise_signal(signal.SIGINT)
        sum(range(1000))  # Python checks for signals here at the latest
        raise AssertionError("the interrupt was held")

    with held_interrupts():
        with pytest.raises(KeyboardInterrupt):
            interruptibly(wait_for_ctrl_c)
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            interruptibly(pytest.fail, "it ran though an interrupt was held")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (and the block ended without one)


def test_only_the_main_thread_holds():
    seen = []

    def worker():
        with held_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
