"""`LLMEngine.stream`: a synchronous iterator of pieces for notebooks, driving the engine itself."""

from __future__ import annotations

import gc
import signal

import pytest

from nanoref import LLM, SamplingParams

from .helpers import assert_no_block_leaked

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kvcache_blocks=64)


def test_pieces_concatenate_to_the_offline_text_and_the_last_says_why(llm):
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=5)
    pieces = list(llm.stream(PROMPT, params))
    offline = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert "".join(piece.text for piece in pieces) == offline["text"]
    assert [t for piece in pieces for t in piece.token_ids] == offline["token_ids"]
    assert [piece.finished for piece in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].finish_reason == offline["finish_reason"]
    assert_no_block_leaked(llm)


def test_each_piece_names_its_sample_and_every_sample_concatenates_to_generate(llm):
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=5, n=3)
    pieces = list(llm.stream(PROMPT, params))
    offline = llm.generate([PROMPT], params, use_tqdm=False)[0]["outputs"]
    for sample in offline:
        mine = [piece for piece in pieces if piece.index == sample["index"]]
        assert "".join(piece.text for piece in mine) == sample["text"]
        assert mine[-1].finished and sum(piece.finished for piece in mine) == 1
    assert_no_block_leaked(llm)


def test_breaking_out_aborts_the_request_frees_its_blocks_and_others_run_on(llm):
    other = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, n=2)
    stream = llm.stream(PROMPT, params)
    for count, _piece in enumerate(stream):
        if count == 4:
            break
    stream.close()  # (what leaving the loop does once the iterator is dropped; explicit here)
    assert other.num_completion_tokens >= 2, "the other request advanced with the stream's steps"
    while not llm.is_finished():
        llm.step()
    assert other.finish_reason == "length"
    assert_no_block_leaked(llm)


def test_a_bad_request_raises_at_the_call_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.stream("", SamplingParams())
    assert llm.is_finished()


def test_a_stream_whose_request_another_call_ran_to_its_end_yields_the_rest(llm):
    """generate (here, or in another thread) runs every queued request, the stream's too: the stream then yields what
    it has not given yet and ends, instead of stepping an engine with nothing queued."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate([PROMPT], params, use_tqdm=False)[0]
    stream = llm.stream(PROMPT, params)
    first = next(stream)
    llm.generate(["Explicit is"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # (runs the stream's)
    rest = list(stream)
    assert first.text + "".join(piece.text for piece in rest) == expected["text"]
    assert rest[-1].finished and rest[-1].finish_reason == "length"
    assert_no_block_leaked(llm)


def assert_nothing_queued(llm) -> None:
    assert (len(llm.scheduler.waiting), len(llm.scheduler.running)) == (0, 0)
    assert not llm.output_processor.held_samples
    assert_no_block_leaked(llm)


def test_an_exception_in_the_loops_body_inside_a_with_block_ends_the_request_at_once(llm):
    """A `for` loop left by an exception does not close the stream: the traceback keeps the loop's frame, and with it
    a stream bound to a name, so its request stayed queued (holding its blocks) until the exception was dropped."""
    params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, n=2)

    def show():
        with llm.stream(PROMPT, params) as pieces:
            for count, _piece in enumerate(pieces):
                if count == 3:
                    raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        show()
    assert caught.value.__traceback__ is not None  # (the frames, and the stream in show's, are still referenced)
    assert_nothing_queued(llm)
    after = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(after["token_ids"]) == 3
    assert_nothing_queued(llm)


def test_breaking_out_of_a_with_block_ends_the_request_though_a_name_still_holds_the_stream(llm):
    with llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) as pieces:
        for _piece in pieces:
            break
        assert len(llm.scheduler.running) == 1  # (inside the block: still served)
    assert_nothing_queued(llm)
    assert list(pieces) == []  # a closed stream yields nothing more


def test_a_stream_the_garbage_collector_closes_in_the_middle_of_a_step_fails_no_request(llm, monkeypatch):
    """A stream that only a reference cycle holds is closed by the cyclic garbage collector, wherever it runs: here,
    between a step's scheduling and its forward. Its abort there took its sequence's blocks from the scheduled batch,
    and the step failed ("block_table[0, 0] is -1 ..."), aborting every request in it."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.generate(["Hello there"], params, use_tqdm=False)[0]["token_ids"]

    def abandon_in_a_cycle():
        pieces = llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        next(pieces)
        cycle = {"pieces": pieces}
        cycle["self"] = cycle

    run, calls = llm.model_runner.run, []

    def collect_then_run(seqs, is_prefill):
        calls.append(len(seqs))
        if not is_prefill and len(seqs) == 2:  # (a decode step of both: the stream's sequence is in it)
            gc.collect()
        return run(seqs, is_prefill)

    gc.disable()  # (only the collection above)
    try:
        abandon_in_a_cycle()
        monkeypatch.setattr(llm.model_runner, "run", collect_then_run)
        got = llm.generate(["Hello there"], params, use_tqdm=False)[0]["token_ids"]
    finally:
        gc.enable()
    assert 2 in calls and got == expected
    assert_nothing_queued(llm)


def test_ctrl_c_while_the_request_is_queued_ends_the_request(llm, monkeypatch):
    """Ctrl-C while the stream queues its request is held until the queuing is done, then raised: that used to be
    before the stream's cleanup began, so the request stayed queued (the generator had ended: nothing would ever
    abort it)."""
    enqueue = llm.enqueue

    def enqueue_then_ctrl_c(seq):
        enqueue(seq)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(llm, "enqueue", enqueue_then_ctrl_c)
    pieces = llm.stream(PROMPT, SamplingParams(max_tokens=20, n=2))
    with pytest.raises(KeyboardInterrupt):
        next(pieces)
    assert_nothing_queued(llm)
