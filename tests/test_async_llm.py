"""AsyncLLM: requests that stream, leave early and fail, on one engine driven by one background thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from nanoref import LLM, SamplingParams
from nanoref.serving.async_llm import AsyncLLM, EngineDeadError

from .helpers import assert_no_block_leaked

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # runs far longer than any test waits
PROMPTS = ["Beautiful is better than", "Explicit is", "Return the", "Flat is better", "Errors should", "If the"]
TIMEOUT = 30  # seconds: a bug must fail a test, not hang it


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kvcache_blocks=128)  # the built-in model: a real tokenizer, fast on a CPU


@pytest.fixture
def engine(llm):
    engine = AsyncLLM(llm)
    yield engine
    engine.close()
    assert_no_block_leaked(llm)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def collect(stream) -> list:
    return [out async for out in stream]


async def until(condition, what: str, seconds: float = TIMEOUT) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


def test_concurrent_streams_equal_offline_greedy_generate(llm):
    offline = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # (before the AsyncLLM: it owns the LLM while it runs)
    engine = AsyncLLM(llm)
    try:

        async def main():
            return await asyncio.gather(
                *(collect(engine.generate(p, GREEDY, request_id=f"r{i}")) for i, p in enumerate(PROMPTS))
            )

        streams = run(main())
    finally:
        engine.close()
    for outputs, expected in zip(streams, offline):
        last = outputs[-1]
        assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
        assert "".join(out.text for out in outputs) == last.cumulative_text == expected["text"]
        assert [t for out in outputs for t in out.token_ids] == last.cumulative_token_ids == expected["token_ids"]
        assert last.finish_reason == "length" and last.metrics.num_output_tokens == GREEDY.max_tokens
        assert len(outputs) > 2, "the text arrived in pieces, step by step"
    assert_no_block_leaked(llm)


def test_streams_with_and_without_stop_strings_in_one_batch_equal_offline(llm):
    """Per step the engine sends token ids, and the receiving thread decodes every stream's at once, except for a
    request with stop strings, whose text the engine makes (it matches them there): both kinds in the same steps."""
    text = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]["text"]
    stopping = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text[len(text) // 2 :][:3]])
    params = [stopping if i % 2 == 0 else GREEDY for i in range(len(PROMPTS))]
    offline = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = AsyncLLM(llm)
    try:

        async def main():
            return await asyncio.gather(*(collect(engine.generate(p, q)) for p, q in zip(PROMPTS, params)))

        streams = run(main())
    finally:
        engine.close()
    assert offline[0]["finish_reason"] == "stop", "the stop string ends the first request early"
    for outputs, expected in zip(streams, offline):
        assert "".join(out.text for out in outputs) == outputs[-1].cumulative_text == expected["text"]
        assert outputs[-1].finish_reason == expected["finish_reason"]
    assert_no_block_leaked(llm)


def slow_steps(llm, monkeypatch) -> None:
    """20 ms more per step: LONG takes over 8 s to finish by itself, so blocks freed within 5 s were aborted."""
    real_run = llm.model_runner.run
    monkeypatch.setattr(llm.model_runner, "run", lambda *args: time.sleep(0.02) or real_run(*args))


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_consumer_that_leaves_early_frees_its_blocks(engine, llm, how, monkeypatch):
    slow_steps(llm, monkeypatch)

    async def main():
        stream = engine.generate("Beautiful is better than", LONG)
        if how == "aclose":
            await stream.__anext__()
            await stream.aclose()
        else:
            started = asyncio.Event()

            async def consume():
                async for _ in stream:
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
        await until(lambda: engine.stats().num_kv_blocks_used == 0 and llm.is_finished(), "blocks freed", seconds=5)

    run(main())
    assert_no_block_leaked(llm)


def test_abort_by_id_ends_that_stream_with_abort_and_the_others_run_on(engine, llm):
    # (the aborted stream ends with fewer than LONG.max_tokens tokens: it did not run to its end)
    async def main():
        long = engine.generate("Beautiful is better than", LONG, request_id="long")
        first = await long.__anext__()
        short = asyncio.create_task(collect(engine.generate(PROMPTS[1], GREEDY, request_id="short")))
        await engine.abort("long")
        rest = await collect(long)
        return first, rest, await short

    first, rest, short = run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and rest[-1].metrics is None
    assert len(rest[-1].cumulative_token_ids) < LONG.max_tokens
    assert short[-1].finish_reason == "length" and len(short[-1].cumulative_token_ids) == GREEDY.max_tokens


def test_abort_takes_several_ids_as_vllms_and_check_health_and_get_tokenizer_answer(engine, llm):
    async def main():
        streams = [engine.generate(prompt, LONG, request_id=f"r{i}") for i, prompt in enumerate(PROMPTS[:3])]
        firsts = [await stream.__anext__() for stream in streams]
        await engine.check_health()  # (running: returns)
        assert await engine.get_tokenizer() is llm.tokenizer and not engine.errored
        for bad in (["r0", 7], 7, None):
            with pytest.raises(TypeError, match="request_id must be a string or an iterable of strings"):
                await engine.abort(bad)
        await engine.abort(["r0", "r2", "never-sent"])  # (an unknown id is ignored, as one alone is)
        ends = [(await collect(stream))[-1] for stream in (streams[0], streams[2])]
        await engine.abort("r1")
        await collect(streams[1])
        return firsts, ends

    firsts, ends = run(main())
    assert all(end.finish_reason == "abort" and len(end.cumulative_token_ids) < LONG.max_tokens for end in ends)
    engine.close()
    assert engine.errored
    with pytest.raises(EngineDeadError, match="this AsyncLLM is closed"):
        run(engine.check_health())


def test_vllms_plain_shutdown_call_stops_the_engine(llm):
    """vLLM's AsyncLLM.shutdown() is a plain call (not awaited), from sync code or on an event loop: either stops the
    engine thread; `await engine.shutdown()` (nanoref's form) still waits for it."""
    engine = AsyncLLM(llm)
    engine.shutdown()  # (no event loop: stopped once it returns)
    assert not engine.is_running and not engine._engine._thread.is_alive()

    async def plain_then_awaited():
        first = AsyncLLM(llm)
        first.shutdown()  # vLLM's form, on the event loop
        await until(lambda: not first._engine._thread.is_alive(), "the engine thread stopped", seconds=10)
        second = AsyncLLM(llm)
        await second.shutdown()
        assert not second._engine._thread.is_alive()
        return first

    assert not run(plain_then_awaited()).is_running
    assert_no_block_leaked(llm)


def test_vllms_plain_shutdown_on_an_event_loop_refuses_requests_at_once(llm):
    """vLLM's shutdown() marks the engine dead before it returns: the next generate raises EngineDeadError and
    is_running is False, though on an event loop the engine thread is joined later, in a worker thread."""

    async def shut_then_ask():
        engine = AsyncLLM(llm)
        stopping = engine.shutdown()  # (not awaited yet: nothing ran on the loop since)
        running = engine.is_running
        with pytest.raises(EngineDeadError, match="this AsyncLLM is closed"):
            engine.generate("Hello", GREEDY, request_id="after-shutdown")
        await stopping
        return running, engine

    running, engine = run(shut_then_ask())
    assert not running and not engine._engine._thread.is_alive()
    assert_no_block_leaked(llm)


def test_get_tokenizer_of_an_engine_without_one_says_why():
    engine = AsyncLLM(LLM(device="cpu", num_kvcache_blocks=16, skip_tokenizer_init=True), owns_llm=True)
    try:
        with pytest.raises(ValueError, match="skip_tokenizer_init=True loads no tokenizer: there is no tokenizer"):
            run(engine.get_tokenizer())
    finally:
        engine.close()


def test_a_bad_request_raises_at_once_and_queues_nothing(engine, llm):
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([5, 100_000], GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate("Hello", {"max_tokens": 3})
    for bad_id in (5, b"id", ["a"]):  # (vLLM's ids are strings: abort(5) could never reach it)
        with pytest.raises(TypeError, match="request_id must be a string or None, got"):
            engine.generate("Hello", GREEDY, request_id=bad_id)
        with pytest.raises(TypeError, match="request_id must be a string or None"):
            llm.add_request("Hello", GREEDY, request_id=bad_id)
    assert engine._engine._inbox.empty() and llm.is_finished()

    async def duplicate():
        first = engine.generate("Hello", LONG, request_id="same")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate("Hello", GREEDY, request_id="same").__anext__()
        await first.aclose()
        await until(llm.is_finished, "the first request aborted")

    run(duplicate())


def test_generate_takes_vllms_keyword_names(engine, llm):
    """vLLM's AsyncLLM.generate(prompt, sampling_params, request_id, ...): its keyword runs here unchanged."""
    outputs = run(collect(engine.generate("Explicit is", sampling_params=GREEDY, request_id="by-keyword")))
    last = outputs[-1]
    assert last.request_id == "by-keyword" and last.finish_reason == "length"
    assert len(last.cumulative_token_ids) == GREEDY.max_tokens


def test_vllms_encode_says_the_model_cannot_pool_and_queues_nothing(engine, llm):
    """vLLM's AsyncLLM.encode is for pooling models; on a generative one it is vLLM's ValueError, not an
    AttributeError; once the engine is gone, EngineDeadError first, as vLLM checks that before the request."""

    async def pooled():
        assert await engine.get_supported_tasks() == ("generate",)  # (vLLM's way to ask before calling encode)
        return [out async for out in engine.encode("Hello", None, "pool-1")]

    with pytest.raises(ValueError, match=r"^This model does not support pooling \(AsyncLLM\.encode\(\) is for"):
        run(pooled())
    assert engine._engine._inbox.empty() and llm.is_finished()
    assert not engine.is_stopped
    engine.close()
    assert engine.is_stopped  # (vLLM's name for errored)
    with pytest.raises(EngineDeadError, match="this AsyncLLM is closed"):
        engine.encode("Hello", None, "pool-2")


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_next_is_served(engine, llm, monkeypatch):
    real_run = llm.model_runner.run
    failed = []

    def run_failing_once(seqs, *args, **kwargs):
        if len(seqs) == 2 and not failed:  # the first step with both requests in the batch
            failed.append(True)
            raise RuntimeError("injected step failure")
        return real_run(seqs, *args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "run", run_failing_once)

    async def main():
        streams = [engine.generate(p, GREEDY) for p in PROMPTS[:2]]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        after = await collect(engine.generate(PROMPTS[2], GREEDY))
        return results, after

    results, after = run(main())
    assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results), results
    monkeypatch.undo()
    engine.close()
    expected = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    assert after[-1].cumulative_text == expected["text"] and after[-1].finish_reason == "length"


def test_a_step_that_raises_fails_only_the_requests_it_scheduled(engine, llm, monkeypatch):
    """A prefill that raises aborts the request it admitted; the request decoding beside it streams on to the end."""
    real_run = llm.model_runner.run
    prefills = []

    def fail_the_second_prefill(seqs, is_prefill):
        prefills.append(is_prefill)
        if is_prefill and prefills.count(True) == 2:
            raise RuntimeError("injected step failure")
        return real_run(seqs, is_prefill)

    monkeypatch.setattr(llm.model_runner, "run", fail_the_second_prefill)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main():
        first = engine.generate(PROMPTS[0], params)
        outputs = [await anext(first)]  # it runs: the next request's prefill is a step of its own
        with pytest.raises(RuntimeError, match="injected"):
            await collect(engine.generate(PROMPTS[1], GREEDY))
        return outputs + await collect(first)

    outputs = run(main())
    monkeypatch.undo()
    engine.close()
    expected = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert outputs[-1].cumulative_text == expected["text"] and outputs[-1].finish_reason == "length"


SAMPLED = SamplingParams(temperature=2.0, max_tokens=8, ignore_eos=True, seed=7, n=3, logprobs=2)


def test_n_samples_stream_interleaved_with_their_index_and_equal_offline_generate(llm):
    expected = llm.generate([PROMPTS[0]], SAMPLED, use_tqdm=False)[0]["outputs"]
    engine = AsyncLLM(llm)
    try:
        outputs = run(collect(engine.generate(PROMPTS[0], SAMPLED, request_id="n3")))
    finally:
        engine.close()
    assert sorted({out.index for out in outputs}) == [0, 1, 2]
    assert sum(out.finished for out in outputs) == 3 and outputs[-1].finished, "ends after every sample's last"
    for index, offline in enumerate(expected):
        mine = [out for out in outputs if out.index == index]
        assert [out.finished for out in mine] == [False] * (len(mine) - 1) + [True]
        assert "".join(out.text for out in mine) == offline["text"]
        assert [t for out in mine for t in out.token_ids] == offline["token_ids"]
        assert [e for out in mine for e in out.logprobs] == offline["logprobs"]
        assert mine[-1].finish_reason == "length" and mine[-1].metrics is not None
    assert len({tuple(out["token_ids"]) for out in expected}) > 1, "the samples differ (seed + i each)"
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("how", ["abort", "aclose"])
def test_ending_an_n_request_aborts_every_sample(engine, llm, how, monkeypatch):
    slow_steps(llm, monkeypatch)
    params = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, n=3)

    async def main():
        stream = engine.generate("Beautiful is better than", params, request_id="n3")
        seen = [await stream.__anext__()]
        while len({out.index for out in seen}) < 3:  # every sample queued and running
            seen.append(await stream.__anext__())
        if how == "aclose":
            await stream.aclose()
            rest = []
        else:
            await engine.abort("n3")
            rest = await collect(stream)
        await until(lambda: engine.stats().num_kv_blocks_used == 0 and llm.is_finished(), "blocks freed", seconds=5)
        return rest

    rest = run(main())
    if how == "abort":
        last = {out.index: out for out in rest if out.finished}
        assert sorted(last) == [0, 1, 2] and {out.finish_reason for out in last.values()} == {"abort"}
    assert_no_block_leaked(llm)


def test_a_consumer_that_falls_behind_gets_merged_outputs_that_still_equal_offline(llm):
    """A slow consumer reads what queued up meanwhile as one output (fewer, larger pieces), and nothing is lost."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    offline = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    engine = AsyncLLM(llm)
    try:

        async def slow():
            outputs = []
            async for out in engine.generate(PROMPTS[0], params, request_id="slow"):
                outputs.append(out)
                await asyncio.sleep(0.05)  # meanwhile the engine thread steps on
            return outputs

        outputs = run(slow())
    finally:
        engine.close()
    assert len(outputs) < params.max_tokens, "the consumer was meant to fall behind"
    assert "".join(out.text for out in outputs) == offline["text"]
    assert [t for out in outputs for t in out.token_ids] == offline["token_ids"]
    assert outputs[-1].finished and outputs[-1].cumulative_token_ids == offline["token_ids"]


def test_coalesce_merges_each_samples_outputs_in_order_and_never_across_an_error():
    from nanoref.serving.async_llm import RequestOutput, coalesce

    def out(index, text, tokens, finished=False):
        return RequestOutput("r", text, tokens, "", [], 3, finished=finished, index=index)

    error = RuntimeError("step failed")
    merged = coalesce([out(0, "a", [1]), out(1, "x", [7]), out(0, "b", [2], finished=True), error, out(1, "y", [8])])
    assert [(m.index, m.text, m.token_ids, m.finished) for m in merged[:2]] == [
        (0, "ab", [1, 2], True),
        (1, "x", [7], False),
    ]
    assert merged[2] is error
    assert (merged[3].index, merged[3].text) == (1, "y")


def test_close_fails_the_requests_of_an_engine_that_does_not_stop_in_time(llm, monkeypatch):
    import threading

    release, stuck = threading.Event(), threading.Event()
    real_run = llm.model_runner.run

    def run_until_released(seqs, *args, **kwargs):
        if llm.model_runner.num_steps_seen:  # the second step never ends (until the test lets it)
            stuck.set()
            release.wait(TIMEOUT)
        llm.model_runner.num_steps_seen += 1
        return real_run(seqs, *args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "num_steps_seen", 0, raising=False)
    monkeypatch.setattr(llm.model_runner, "run", run_until_released)
    engine = AsyncLLM(llm)
    try:

        async def main():
            stream = engine.generate(PROMPTS[0], LONG)
            await stream.__anext__()
            await asyncio.to_thread(stuck.wait, TIMEOUT)
            engine.close(timeout=0.05)
            with pytest.raises(RuntimeError, match="closed before the engine stopped"):
                await asyncio.wait_for(collect(stream), 5)  # not a hang

        run(main())
    finally:
        release.set()
        engine._engine._thread.join(TIMEOUT)
    assert_no_block_leaked(llm)


# a token id the tokenizer below cannot decode (as a slow tokenizer's "piece id is out of range" for an id past its
# vocabulary, which the model's larger vocabulary can sample); a request allowed only that token makes nothing else
UNDECODABLE = 1000
UNDECODABLE_ONLY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[UNDECODABLE])


def cannot_decode(tokenizer, monkeypatch) -> None:
    """Make `tokenizer` raise on decoding UNDECODABLE (its own Python decode: the batched Rust one is then not used)."""

    class Raising(type(tokenizer)):
        def _decode(self, token_ids, *args, **kwargs):
            if UNDECODABLE in ([token_ids] if isinstance(token_ids, int) else token_ids):
                raise IndexError(f"piece id {UNDECODABLE} is out of range")
            return super()._decode(token_ids, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "__class__", Raising)


def serve_beside_an_undecodable_request(engine, expected: list[dict], params: SamplingParams = UNDECODABLE_ONLY):
    """Two streams beside one whose tokens the tokenizer cannot decode (params): that one fails, naming the error;
    the two stream to their offline text, and the engine serves the next request."""

    async def main():
        streams = [
            collect(engine.generate(PROMPTS[0], GREEDY)),
            collect(engine.generate(PROMPTS[1], params, request_id="undecodable")),
            collect(engine.generate(PROMPTS[2], GREEDY)),
        ]
        results = await asyncio.gather(*streams, return_exceptions=True)
        return results, await collect(engine.generate(PROMPTS[3], GREEDY))

    (first, failed, third), after = run(main())
    assert isinstance(failed, RuntimeError), failed
    assert "request 'undecodable': making its output failed (IndexError: piece id 1000" in str(failed)
    for outputs, offline in zip([first, third, after], expected):
        assert outputs[-1].cumulative_text == offline["text"] and outputs[-1].finish_reason == "length"
    assert engine.is_running


def test_a_request_whose_tokens_cannot_be_decoded_fails_alone(engine, llm, monkeypatch):
    """The engine thread makes the outputs of every request (one batched decode per step): one request's decode
    that raises used to end the thread, failing every request with "the engine thread ended unexpectedly"."""
    expected = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], GREEDY, use_tqdm=False)
    assert not any(UNDECODABLE in out["token_ids"] for out in expected)
    cannot_decode(llm.tokenizer, monkeypatch)
    serve_beside_an_undecodable_request(engine, expected)
    engine.close()  # (and the fixture checks that every block is back)


def test_a_request_with_stop_strings_whose_tokens_cannot_be_decoded_fails_alone(engine, llm, monkeypatch):
    """A request with stop strings is decoded in the engine's step (its stop strings are matched there), not on the
    receiving side: a decode that raises there used to fail the whole step, every request in it ending with the
    error. It fails alone now, as a request without stop strings does (and the fixture checks its blocks are back)."""
    expected = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], GREEDY, use_tqdm=False)
    records = set(llm.metrics.requests)  # (generate's)
    cannot_decode(llm.tokenizer, monkeypatch)
    stopping = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[UNDECODABLE], stop=["never in the text"]
    )
    serve_beside_an_undecodable_request(engine, expected, stopping)
    assert set(llm.metrics.requests) == records  # (none kept for a request whose last delta never goes)
