"""AsyncLLM with its engine in a process of its own: the same outputs as offline `generate`, and a child process
that is started, stopped, killed and refused cleanly."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal

import pytest

from nanoref import LLM, ModelFolderError, SamplingParams
from nanoref.serving.async_llm import AsyncLLM, EngineDeadError, EngineThread
from nanoref.serving.engine_process import EngineProcess
from nanoref.utils import seams

from .test_async_llm import (
    GREEDY,
    LONG,
    PROMPTS,
    SAMPLED,
    cannot_decode,
    collect,
    run,
    serve_beside_an_undecodable_request,
    until,
)

SETTINGS = dict(device="cpu", num_kvcache_blocks=128)  # the built-in model: a real tokenizer, fast on a CPU
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=11)


@pytest.fixture(scope="module")
def llm():
    return LLM(**SETTINGS)


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM.from_model(engine_process=True, **SETTINGS)
    yield engine
    engine.close()


def assert_idle(engine: AsyncLLM) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0), stats


def assert_equal_offline(outputs, expected) -> None:
    last = outputs[-1]
    assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
    assert "".join(out.text for out in outputs) == last.cumulative_text == expected["text"]
    assert [t for out in outputs for t in out.token_ids] == last.cumulative_token_ids == expected["token_ids"]


def test_the_process_form_streams_the_offline_greedy_and_seeded_texts(engine, llm):
    assert engine.llm is None and engine.config.num_kvcache_blocks == SETTINGS["num_kvcache_blocks"]
    greedy = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    seeded = llm.generate(PROMPTS[:1], SEEDED, use_tqdm=False)

    async def main():
        streams = [engine.generate(p, GREEDY) for p in PROMPTS[:4]] + [engine.generate(PROMPTS[0], SEEDED)]
        return await asyncio.gather(*(collect(stream) for stream in streams))

    outputs = run(main())
    for mine, expected in zip(outputs, greedy + seeded):
        assert_equal_offline(mine, expected)
        assert mine[-1].finish_reason == "length" and mine[-1].metrics.num_output_tokens == GREEDY.max_tokens
    # pieces: 12 tokens can all be made before the client reads once (outputs waiting together arrive merged, and
    # the built-in model makes a token in well under a millisecond); 200 take long enough to arrive in several
    pieces = run(collect(engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))))
    assert len(pieces) > 2, f"200 tokens arrived in {len(pieces)} pieces: the stream should follow the steps"
    assert_idle(engine)
    assert engine.stats().prefix_cache_queried_tokens > 0


def test_n_samples_with_logprobs_equal_offline_generate(engine, llm):
    expected = llm.generate([PROMPTS[0]], SAMPLED, use_tqdm=False)[0]["outputs"]
    outputs = run(collect(engine.generate(PROMPTS[0], SAMPLED, request_id="n3")))
    assert sum(out.finished for out in outputs) == 3 and outputs[-1].finished
    for index, offline in enumerate(expected):
        mine = [out for out in outputs if out.index == index]
        assert_equal_offline(mine, offline)
        got = [e for out in mine for e in out.logprobs]
        # the same tokens and ranks; the values to float rounding (the engine process may use other CPU threads)
        assert [(e.token_id, e.rank, list(e.top)) for e in got] == [
            (e.token_id, e.rank, list(e.top)) for e in offline["logprobs"]
        ]
        for a, b in zip(got, offline["logprobs"]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-4)
    assert len({tuple(out["token_ids"]) for out in expected}) > 1, "the samples differ (seed + i each)"
    assert_idle(engine)


def test_a_stop_string_ends_the_sequence_in_the_engine_as_offline(engine, llm):
    text = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, stop=[stop])
    expected = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    outputs = run(collect(engine.generate(PROMPTS[0], params)))
    assert "".join(out.text for out in outputs) == expected["text"] and stop not in expected["text"]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop)
    assert len(outputs[-1].cumulative_token_ids) < GREEDY.max_tokens
    assert_idle(engine)


def test_abort_ends_the_stream_with_abort_and_frees_its_blocks(engine):
    async def main():
        stream = engine.generate("Beautiful is better than", LONG, request_id="long")
        await stream.__anext__()
        await engine.abort("long")
        rest = await collect(stream)
        await until(lambda: engine.stats().num_kv_blocks_used == 0, "blocks freed", seconds=5)
        return rest

    rest = run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and rest[-1].metrics is None
    assert len(rest[-1].cumulative_token_ids) < LONG.max_tokens
    assert_idle(engine)


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_consumer_that_leaves_early_frees_its_blocks(engine, how):
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
        assert engine.stats().num_kv_blocks_used > 0, "it was running when it left"
        await until(lambda: engine.stats().num_kv_blocks_used == 0, "blocks freed", seconds=5)

    run(main())
    assert_idle(engine) and not engine._requests


def test_a_bad_request_raises_at_generate_and_queues_nothing(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([5, 100_000], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(list(range(1, 600)), GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate("Hello", {"max_tokens": 3})
    assert not engine._requests
    assert_idle(engine)

    async def duplicate():
        first = engine.generate("Hello", LONG, request_id="same")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate("Hello", GREEDY, request_id="same").__anext__()
        await first.aclose()
        await until(lambda: engine.stats().num_kv_blocks_used == 0, "the first request aborted")

    run(duplicate())
    assert_idle(engine)


def test_killing_the_engine_process_fails_its_requests_and_every_later_one():
    engine = AsyncLLM.from_model(engine_process=True, **SETTINGS)
    process = engine._engine.process
    try:

        async def main():
            stream = engine.generate("Beautiful is better than", LONG)
            await stream.__anext__()
            os.kill(process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="ended unexpectedly.*killed by signal 9"):  # (vLLM's)
                await collect(stream)
            with pytest.raises(EngineDeadError, match="ended unexpectedly.*start a new one"):
                await engine.check_health()

        run(main())
        assert not engine.is_running and engine.errored
        assert (
            str(engine.dead_error) == f"the engine process (pid {process.pid}) ended unexpectedly (killed by signal 9)"
        )
        with pytest.raises(EngineDeadError, match="ended unexpectedly.*start a new one"):
            engine.generate("Hello", GREEDY)
        assert process.exitcode == -signal.SIGKILL and process not in multiprocessing.active_children()
    finally:
        engine.close()


def test_close_stops_the_engine_process_and_leaves_none_behind():
    engine = AsyncLLM.from_model(engine_process=True, **SETTINGS)
    process = engine._engine.process
    assert process in multiprocessing.active_children() and engine.is_running
    out = run(collect(engine.generate("Hello", GREEDY)))
    assert out[-1].finished
    engine.close()
    assert process not in multiprocessing.active_children() and process.exitcode == 0
    with pytest.raises(ProcessLookupError):  # reaped: not even a zombie
        os.kill(process.pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("Hello", GREEDY)
    assert str(engine.dead_error) == "this AsyncLLM is closed"


def test_a_failing_start_raises_the_engine_process_reason_and_leaves_no_process(tmp_path):
    from nanoref.llm import DEFAULT_MODEL

    folder = shutil.copytree(DEFAULT_MODEL, tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")  # config and tokenizer fine: the weights
    before = set(multiprocessing.active_children())
    with pytest.raises(ModelFolderError, match="model.safetensors: not a readable safetensors file") as caught:
        AsyncLLM.from_model(folder, engine_process=True, device="cpu")
    assert "raised in the engine process" in "".join(getattr(caught.value, "__notes__", []))
    assert set(multiprocessing.active_children()) == before


def test_a_missing_model_folder_raises_before_any_process_starts(tmp_path):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="missing"):
        AsyncLLM.from_model(tmp_path / "missing", engine_process=True, device="cpu")
    assert set(multiprocessing.active_children()) == before


def test_learner_seams_refuse_the_process_form_and_auto_keeps_the_thread():
    def my_rms_norm(x, weight, eps):
        return x  # (the engine is never stepped here)

    with seams.use(rms_norm=my_rms_norm):
        with pytest.raises(ValueError, match="rms_norm.*live in this process"):
            AsyncLLM.from_model(engine_process=True, **SETTINGS)
        engine = AsyncLLM.from_model(**SETTINGS)  # auto with seams active: the thread, where seams reach the steps
    try:
        assert isinstance(engine._engine, EngineThread) and engine.llm is not None
    finally:
        engine.close()
    engine = AsyncLLM.from_model(**SETTINGS)  # auto otherwise: a process of its own, on a CPU too
    try:
        assert isinstance(engine._engine, EngineProcess) and engine.llm is None
    finally:
        engine.close()


def test_freeze_heap_collects_start_up_garbage_and_takes_the_rest_out_of_collections():
    """freeze_heap, which the engine process, the server's and tensor-parallel workers run once started, in a fresh
    interpreter (this one's collector is left alone): garbage left by start-up is collected first, not frozen for
    good, and what is alive afterwards is in no generation that a collection walks. The automatic collector is off,
    so only freeze_heap can free the cycle."""
    import subprocess
    import sys

    script = """
import gc, weakref
gc.disable()
from nanoref.utils.heap import freeze_heap
class Node: pass
garbage = Node(); garbage.me = garbage; dead = weakref.ref(garbage); del garbage
live = Node(); live.me = live
frozen = freeze_heap()
assert dead() is None, "garbage made before freeze_heap was frozen, not collected"
walked = [obj for g in range(3) for obj in gc.get_objects(generation=g)]
assert not any(obj is live for obj in walked), "an object alive at freeze_heap is still walked by collections"
assert frozen == gc.get_freeze_count() > 1000, frozen
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_an_engine_process_that_reads_nothing_never_blocks_the_event_loop():
    """The child stops reading (SIGSTOP, as when its reader thread waits long for the child's GIL) while 150 long
    requests arrive: their commands fill the pipe (64 KiB) several times over. Each request's queuing returns at
    once all the same (the writer thread waits, not the event loop: a timer on the loop keeps its time), and once
    the child runs again every request is served."""
    import threading
    import time

    engine = AsyncLLM.from_model(engine_process=True, **SETTINGS)
    pid = engine._engine.process.pid
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(150)] for i in range(150)]  # ~120 KiB of "add" commands
    watchdog = threading.Timer(20.0, os.kill, (pid, signal.SIGCONT))  # (a blocked loop would wait for it)
    try:

        async def main():
            os.kill(pid, signal.SIGSTOP)
            watchdog.start()
            tasks = [asyncio.ensure_future(collect(engine.generate(p, params))) for p in prompts]
            start = time.monotonic()
            await asyncio.sleep(0.5)  # every task runs to its first wait: its "add" queued
            late = time.monotonic() - start - 0.5
            os.kill(pid, signal.SIGCONT)
            outs = await asyncio.gather(*tasks)
            return late, outs

        late, outs = run(main())
        assert late < 5.0, f"the event loop was blocked {late:.1f} s while the engine process read nothing"
        assert all(out[-1].finished and len(out[-1].cumulative_token_ids) == 2 for out in outs)
    finally:
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
        engine.close()


def test_a_step_message_that_fails_on_the_server_side_fails_the_requests_instead_of_hanging(monkeypatch):
    """Turning a step message into outputs runs in the server's reader thread: when that fails as a whole (not one
    request's decode, which fails that request alone), the requests in flight get that error and later ones are
    refused, as when an engine thread dies; the engine process is stopped, not left behind."""
    from nanoref.serving import async_llm

    engine = AsyncLLM.from_model(engine_process=True, **SETTINGS)
    process = engine._engine.process
    try:

        def broken(live):
            if live:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that cannot decode")
            return []

        monkeypatch.setattr(async_llm, "delta_texts", broken)
        with pytest.raises(RuntimeError, match="server's side failed on a step message.*UnicodeDecodeError"):
            run(collect(engine.generate("Beautiful is better than", GREEDY)))
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="start a new one"):
            engine.generate("Hello", GREEDY)
        engine._engine._reader.join(30)  # it stops the process (one thread reaps it: two joins would race)
        assert process.exitcode is not None and process not in multiprocessing.active_children()
    finally:
        engine.close()


def test_a_request_whose_tokens_cannot_be_decoded_fails_alone_on_the_server_side(engine, llm, monkeypatch):
    """The server's reader thread decodes every request's tokens: one request's decode that raises used to fail
    every request in flight and stop the engine process."""
    expected = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], GREEDY, use_tqdm=False)
    cannot_decode(engine.tokenizer, monkeypatch)
    serve_beside_an_undecodable_request(engine, expected)
    assert engine.stats().num_kv_blocks_used == 0
