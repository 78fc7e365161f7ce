"""`LLM.reset_prefix_cache()` (vLLM's): after it no request reads K/V computed before it; while a request still holds
blocks it changes nothing and says so."""

from __future__ import annotations

import asyncio

import pytest

from nanoref import LLM, SamplingParams

from .helpers import assert_matches_hf, assert_no_block_leaked, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def cached_tokens(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY, **kwargs) -> tuple[list[int], int]:
    out = llm.generate([prompt], params, use_tqdm=False, **kwargs)[0]
    return out["token_ids"], out.num_cached_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_after_a_reset_a_replayed_prompt_is_computed_again(tiny_model, overlap):
    prompt = random_prompts(seed=60, lengths=[40])[0]  # 2 full blocks of 16 the cache can serve
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16, overlap_scheduling=overlap)
    first, hits = cached_tokens(llm, prompt)
    assert hits == 0
    again, hits = cached_tokens(llm, prompt)
    assert hits == 32 and again == first  # (the control: the cache serves a replay)
    assert llm.reset_prefix_cache() is True
    assert_no_block_leaked(llm)  # (no block lost: every one free, the counts consistent)
    after, hits = cached_tokens(llm, prompt)
    assert hits == 0, "a prompt replayed after reset_prefix_cache was served from the cache"
    assert_matches_hf(tiny_model, [prompt], [{"token_ids": after}], 6)
    assert cached_tokens(llm, prompt)[1] == 32  # what it computed after the reset is cached again


def test_a_reset_forgets_every_salts_cache(tiny_model):
    prompt = random_prompts(seed=61, lengths=[40])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    for _ in range(2):
        hits = llm.generate([salted], GREEDY, use_tqdm=False)[0].num_cached_tokens
    assert hits == 32
    assert llm.reset_prefix_cache() is True
    assert llm.generate([salted], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_reset_while_a_request_holds_blocks_changes_nothing_and_warns(tiny_model):
    prompt, other = random_prompts(seed=62, lengths=[40, 20])
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    cached_tokens(llm, prompt)  # its blocks now cached
    llm.add_request(other, GREEDY)
    llm.step()  # `other` holds its two blocks (20 prompt tokens and the first one it generates)
    with pytest.warns(RuntimeWarning, match=r"unfinished requests still hold KV blocks \(2\); nothing was reset"):
        assert llm.reset_prefix_cache() is False
    while not llm.is_finished():
        llm.step()
    assert cached_tokens(llm, prompt)[1] == 32, "a refused reset still emptied the cache"
    assert llm.reset_prefix_cache() is True  # (once the request is done)
    assert cached_tokens(llm, prompt)[1] == 0
    cached_tokens(llm, prompt)
    for option in ("reset_running_requests", "reset_connector"):  # vLLM's options: False only (its default)
        assert llm.reset_prefix_cache(**{option: False}) is True
        why = "does not preempt running requests" if option == "reset_running_requests" else "has no KV connector"
        with pytest.raises(ValueError, match=rf"{option} is not supported by nanoref's reset_prefix_cache .*{why}"):
            llm.reset_prefix_cache(**{option: True})


def test_a_draft_model_after_a_reset_still_decodes_hfs_tokens(tiny_model):
    """The draft's K/V sits in the target's blocks, trusted where it recorded a block's tokens: a reset gives every
    block new (empty) tokens, so no record of a block before it matches after."""
    from nanoref.testing import EVERY_STEP

    spec = {"model": tiny_model, "num_speculative_tokens": 3, **EVERY_STEP}
    prompt = random_prompts(seed=63, lengths=[40])[0]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hits = []
    for reset in (False, True, False):  # a cold run, a run after a reset, then a replay the cache serves
        if reset:
            assert llm.reset_prefix_cache() is True
        tokens, hit = cached_tokens(llm, prompt, params)
        assert_matches_hf(tiny_model, [prompt], [{"token_ids": tokens}], 12)
        hits.append(hit)
    assert hits == [0, 0, 32]


def test_a_reset_waits_for_a_step_in_flight_on_another_thread(tiny_model):
    """AsyncLLM's thread form steps the engine on its own thread: a reset must not run between a step's admission
    and its forward (it would clear the hashes of blocks just handed out as hits)."""
    import threading

    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    results = []
    with llm._lock:  # (a step holds it from scheduling to its outputs)
        other = threading.Thread(target=lambda: results.append(llm.reset_prefix_cache()))
        other.start()
        other.join(timeout=0.5)
        assert other.is_alive() and not results, "reset_prefix_cache ran while a step held the engine"
    other.join(timeout=30)
    assert results == [True]


# -- AsyncLLM (vLLM's async reset_prefix_cache), in both forms, and the server's development route ------------------
ASYNC_SETTINGS = dict(device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)  # the built-in model: a tokenizer


async def served(engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """A prompt served to its end -> (its tokens, its prompt tokens the prefix cache served)."""
    from .test_async_llm import collect

    outputs = await collect(engine.generate(prompt, params))
    return outputs[-1].cumulative_token_ids, outputs[-1].num_cached_tokens


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_async_llm_reset_prefix_cache_between_steps_and_refused_while_a_request_holds_blocks(engine_process):
    from nanoref.serving.async_llm import AsyncLLM

    from .test_async_llm import run, until

    prompt, other = random_prompts(seed=63, lengths=[40, 20])
    engine = AsyncLLM.from_model(engine_process=engine_process, **ASYNC_SETTINGS)

    async def scenario() -> None:
        first, hits = await served(engine, prompt)
        assert hits == 0
        again, hits = await served(engine, prompt)
        assert hits == 32 and again == first  # (the control: the cache serves a replay)
        assert await engine.reset_prefix_cache() is True
        after, hits = await served(engine, prompt)
        assert hits == 0 and after == first, "a prompt replayed after reset_prefix_cache was served from the cache"
        # a request in flight holds blocks: the reset changes nothing, says so, and the request goes on
        # (400 tokens: far more steps than the reset's round trip takes)
        stream = engine.generate(other, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        pieces = [await anext(stream)]
        with pytest.warns(RuntimeWarning, match=r"unfinished requests still hold KV blocks \(\d+\); nothing was") as w:
            assert await engine.reset_prefix_cache() is False
        assert w[0].filename == __file__, "the warning names nanoref's line, not the caller's"
        pieces += [out async for out in stream]
        assert pieces[-1].finished and len(pieces[-1].cumulative_token_ids) == 400
        assert (await served(engine, prompt))[1] == 32, "a refused reset still emptied the cache"
        await until(lambda: engine.stats().num_kv_blocks_used == 0, "the finished requests' blocks freed")
        with pytest.raises(ValueError, match="reset_running_requests is not supported by nanoref"):
            await engine.reset_prefix_cache(reset_running_requests=True)
        with pytest.raises(ValueError, match="reset_connector is not supported by nanoref"):
            await engine.reset_prefix_cache(reset_connector=True)

    try:
        run(scenario())
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="this AsyncLLM is closed"):
        run(engine.reset_prefix_cache())


def test_a_reset_awaited_when_the_engine_ends_fails_rather_than_hangs():
    """The engine thread dies between the command and its reply: the awaiting caller gets the reason."""
    from nanoref.serving.async_llm import AsyncLLM, EngineDeadError

    from .test_async_llm import run

    engine = AsyncLLM(LLM(**ASYNC_SETTINGS), owns_llm=True)
    sent = []
    engine._engine.send = sent.append  # (the command never reaches the loop: as if the engine were gone)

    async def scenario() -> None:
        waiting = asyncio.ensure_future(engine.reset_prefix_cache())
        await asyncio.sleep(0.05)
        assert sent == [("reset_prefix_cache", sent[0][1])] and not waiting.done()
        engine._on_exit("the engine thread ended unexpectedly")
        with pytest.raises(EngineDeadError, match="the engine thread ended unexpectedly"):
            await waiting

    try:
        run(scenario())
    finally:
        del engine._engine.send
        engine.close()


def test_a_reset_whose_caller_is_cancelled_leaves_nothing_waiting_and_a_late_reply_is_dropped():
    from nanoref.serving.async_llm import AsyncLLM

    from .test_async_llm import run

    engine = AsyncLLM(LLM(**ASYNC_SETTINGS), owns_llm=True)
    sent = []
    engine._engine.send = sent.append  # (held back: the reply comes after the caller gave up)

    async def scenario() -> None:
        waiting = asyncio.ensure_future(engine.reset_prefix_cache())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert engine._replies == {}, "a cancelled reset left its awaiter registered"
        engine._answer(sent[0][1], 0)  # the engine's late reply: nobody awaits it, nothing breaks

    try:
        run(scenario())
        del engine._engine.send
        assert run(engine.reset_prefix_cache()) is True  # (the engine answers the next one as usual)
    finally:
        engine.close()


def test_the_servers_dev_route_resets_the_cache_only_in_dev_mode(monkeypatch):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from nanoref.serving.api_server import serve_in_background
    from nanoref.serving.async_llm import AsyncLLM

    from .helpers import SERVER_TIMEOUT

    prompt = random_prompts(seed=64, lengths=[40])[0]
    engine = AsyncLLM(LLM(**ASYNC_SETTINGS), owns_llm=True)
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}

    def cached(url: str) -> int:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=SERVER_TIMEOUT).json()
        return (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # (only where some)

    try:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        monkeypatch.delenv("NANOREF_SERVER_DEV_MODE", raising=False)
        with serve_in_background(engine, "m") as url:  # as vLLM: no such route outside dev mode
            assert httpx.post(f"{url}/reset_prefix_cache", timeout=SERVER_TIMEOUT).status_code == 404
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
        with serve_in_background(engine, "m", enable_prompt_tokens_details=True) as url:
            cached(url)
            assert cached(url) == 32  # (the control: a replay is served from the cache)
            reset = httpx.post(f"{url}/reset_prefix_cache", timeout=SERVER_TIMEOUT)
            assert (reset.status_code, reset.json()) == (200, {"success": True}), reset.text  # (vLLM's answer)
            assert cached(url) == 0, "a prompt replayed after POST /reset_prefix_cache was served from the cache"
            for query, named in (("reset_running_requests=true", "reset_running_requests=true is not supported"),
                                 ("reset_external=1", "reset_external=true is not supported"),
                                 ("reset_external=maybe", "reset_external must be true or false, got 'maybe'"),
                                 ("device=gpu", "unknown query parameter 'device'")):  # fmt: skip
                refused = httpx.post(f"{url}/reset_prefix_cache?{query}", timeout=SERVER_TIMEOUT)
                assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
            assert cached(url) == 32, "a refused reset emptied the cache"
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                timeout=SERVER_TIMEOUT,
                json={**body, "max_tokens": 400, "ignore_eos": True, "stream": True},
            ) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # (the request holds blocks now)
                busy = httpx.post(f"{url}/reset_prefix_cache", timeout=SERVER_TIMEOUT)
                assert (busy.status_code, busy.json()) == (200, {"success": False}), busy.text  # (vLLM's: retry)
                assert [line for line in lines if line][-1] == "data: [DONE]"  # (the stream goes on to its end)
            assert cached(url) == 32, "a refused reset emptied the cache"
            engine.close()  # the engine gone: a 503 as every route gives, not a 500
            gone = httpx.post(f"{url}/reset_prefix_cache", timeout=SERVER_TIMEOUT)
            assert gone.status_code == 503 and "the engine has stopped" in gone.json()["error"]["message"], gone.text
    finally:
        engine.close()


def test_a_reset_that_fails_in_the_engine_loop_fails_its_caller_and_the_engine_serves_on():
    from nanoref.serving.async_llm import AsyncLLM

    from .test_async_llm import run

    llm = LLM(**ASYNC_SETTINGS)
    engine = AsyncLLM(llm, owns_llm=True)

    def broken() -> int:
        raise OSError("injected: the block manager failed")

    llm.clear_prefix_cache = broken

    async def scenario() -> None:
        with pytest.raises(OSError, match="injected: the block manager failed"):
            await engine.reset_prefix_cache()
        tokens, _ = await served(engine, random_prompts(seed=65, lengths=[8])[0])
        assert len(tokens) == GREEDY.max_tokens and engine.is_running

    try:
        run(scenario())
    finally:
        engine.close()
