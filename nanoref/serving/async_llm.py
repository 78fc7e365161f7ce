"""`AsyncLLM`: many requests that arrive, stream and leave at any time, on one engine.

Offline, `LLM.generate` takes every prompt at once and returns when the last one is done. A server cannot wait
like that: requests arrive while others run, each caller wants its tokens as they are made, and a caller that
goes away must stop costing KV blocks. The engine already has what this needs (`add_request`, `step`,
`abort_request`, a sample's text as it grows from its `output_processor`); this module drives it from asyncio.

A request's life online:

    out = engine.generate(prompt, params, request_id="r1")   # 1. checked here: a bad request raises now
    async for piece in out:                                   # 2. sent to the engine's loop (engine_loop.py)
        print(piece.text, end="")                             # 3. a piece after each engine step that made one
    # 4. the last piece has finished=True, finish_reason and metrics; closing early (break, a cancelled task)
    #    aborts the request: its blocks go back at the next step boundary
    # (with n > 1, the pieces of its n samples come interleaved, each with its sample's `index`, and the
    #  iteration ends after every sample's last piece)

Why the engine runs apart from the event loop: a step is blocking CPU/GPU work (a forward pass) that would freeze
the event loop and every other client with it. So the engine's loop (engine_loop.py's `EngineLoop`) runs on its
own: it takes new requests and aborts *between* steps (the only moment the engine's state may change), steps while
any request is unfinished, sleeps when there is nothing to do, and sends ONE message per step with every request's
new tokens. Here, that message becomes each request's outputs, handed to the event loop at once
(`loop.call_soon_threadsafe`: asyncio objects belong to their loop's thread).

Where that loop runs, the two forms of `AsyncLLM`:
- a thread of this process (`AsyncLLM(llm)`, or `from_model` inside a `seams.use(...)` block): simple, and a
  `seams.use(...)` block around the start reaches its steps (notebook 11 serves a learner's function this way);
- a process of its own (engine_process.py; `from_model`'s default): the thread shares this process's GIL with the
  event loop, and with hundreds of streams their Python work together outlasts a GPU step. Requests are checked
  here all the same, against the engine's config and this process's own tokenizer.
Both behave the same to a caller.

What one step costs beyond the forward is what a server adds to offline `generate`, so per token it does little:
a consumer that falls behind (hundreds of streams on one event loop) reads several tokens in one piece, and the
engine spends nothing on it meanwhile; text is decoded here, by the thread that receives the engine's messages
(the process form's reader thread: off the engine's process), every stream's new tokens of a step in one call.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoref.config import EngineConfig
from nanoref.engine.output_processor import RequestOutput, RequestOutputs, delta_texts
from nanoref.engine.prefix_cache import check_reset_options, warn_blocks_held
from nanoref.engine.requests import check_request_id, check_request_priority, eos_token_ids, prompt_text, request_tokens
from nanoref.llm import DEFAULT_MODEL, LLM, SETTINGS, LoRARequest, check_lora_request, grammars_for
from nanoref.sampling_params import SamplingParams
from nanoref.serving.engine_loop import EngineLoop, EngineStats, StepMessage, drain
from nanoref.utils import seams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStats", "RequestOutput", "coalesce"]


class EngineDeadError(RuntimeError):
    """vLLM's name for an engine that is gone (it died, or was closed): `generate`, `check_health` and
    `reset_prefix_cache` raise it from then on."""


@dataclass(eq=False)  # compared by identity: two requests are never the same one
class _Request:
    key: int  # this submission's number in the engine's messages
    loop: asyncio.AbstractEventLoop  # its consumer's
    outputs: RequestOutputs  # what it made so far (written by the thread that receives the step messages)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def request_id(self) -> str:
        return self.outputs.request_id


class EngineThread:
    """An EngineLoop on `llm` in a background thread of this process (see EngineProcess for the other form)."""

    def __init__(
        self, llm: LLM, on_message: Callable[[StepMessage], None], on_exit: Callable[[str], None], owns_llm: bool
    ) -> None:
        self.llm, self.config, self._owns_llm = llm, llm.config, owns_llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # commands (engine_loop.py)
        loop = EngineLoop(llm, functools.partial(drain, self._inbox), on_message)
        self.stats = loop.stats()
        self._stopping = False
        # in a copy of the creator's context: a `seams.use(...)` block around the start reaches the thread's steps
        run = contextvars.copy_context().run
        self._thread = threading.Thread(target=run, args=(self._run, loop, on_exit), name="nanoref-engine", daemon=True)
        self._thread.start()

    def _run(self, loop: EngineLoop, on_exit: Callable[[str], None]) -> None:
        try:
            loop.run()
        finally:
            if not self._stopping:  # (a BaseException out of a step, or an engine that can run no more steps)
                on_exit(loop.dead or "the engine thread ended unexpectedly")

    def send(self, command: tuple) -> None:
        self._inbox.put(command)

    def is_alive(self) -> bool:
        return not self._stopping and self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._inbox.put(("stop",))
        self._thread.join(timeout)
        if self._owns_llm:
            self.llm.close()


class AsyncLLM:
    """An asyncio front on an engine; see the module docstring for a request's life and its two forms.

        engine = AsyncLLM.from_model(device="cpu")      # or AsyncLLM(LLM(...)): the thread form on that LLM
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")
        await engine.shutdown()

    `llm` is the LLM in the thread form (while it runs, it is the engine thread's alone: an offline `generate` on
    it would step this one's requests too) and None in the process form; `tokenizer` and `config` (the engine's,
    with its KV block count) are there in both."""

    def __init__(self, llm: LLM, *, owns_llm: bool = False) -> None:
        """The thread form on `llm`; owns_llm: close() also closes the LLM (from_model's)."""
        self._begin(llm, llm.tokenizer)
        self._engine: Any = EngineThread(llm, self._on_message, self._on_exit, owns_llm)
        self.config: EngineConfig = self._engine.config
        self._stats: EngineStats = self._engine.stats

    def _begin(self, llm: LLM | None, tokenizer: Any) -> None:
        self.llm, self.tokenizer = llm, tokenizer
        self._requests: dict[str, _Request] = {}  # request_id -> request, from submission until its consumer ends
        self._by_key: dict[int, _Request] = {}
        self._keys = itertools.count()
        self._requests_lock = threading.Lock()  # (consumers may run on several event loops)
        self._reads: list[int] = []  # keys whose consumers took their output since the last "read" command
        self._reads_lock = threading.Lock()
        self._closed = False
        self._failure: str | None = None  # why the engine is gone, when it died
        self._grammars = None  # the process form's grammar compiler (llm.grammars_for), to check constraints
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # key -> its awaiter

    @functools.cached_property
    def _eos_token_ids(self) -> set[int]:
        """The model's EOS ids (a stream that shows special tokens still leaves out the one that ends it)."""
        return eos_token_ids(self.config, self.tokenizer)

    @classmethod
    def from_model(cls, model: str | Path = DEFAULT_MODEL, engine_process: bool | None = None, **settings) -> AsyncLLM:
        """An AsyncLLM on a new LLM(model, **settings), which its close() closes.

        engine_process: run the engine in a process of its own (True), in a thread of this one (False), or
        None: a process, on a CPU as on CUDA (the engine's Python and the event loop's then run side by side:
        docs/benchmarks.md measured it on both), except wherever a `seams.use` block is active: a thread (its
        functions live in this process, where a spawned engine cannot call them)."""
        if engine_process not in (None, True, False):
            raise TypeError(f"engine_process must be None, True or False, got {engine_process!r}")
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            raise TypeError(f"unexpected setting {unknown[0]!r}; the settings: {sorted(SETTINGS)}")
        learner = seams.active()
        if engine_process and learner:
            raise ValueError(
                f"engine_process=True with seams.use({', '.join(learner)}) active: those functions live in this "
                "process, and an engine in a process of its own would run nanoref's instead; use "
                "engine_process=False (or None)"
            )
        # the config alone, no weights: a bad folder or setting raises here, before any process starts
        config = EngineConfig(model, **settings)
        if engine_process is None:
            engine_process = not learner
        if not engine_process:
            llm = LLM(model, **settings)
            try:
                return cls(llm, owns_llm=True)
            except BaseException:  # (a thread that cannot start): stop its workers now, not when the error is dropped
                llm.close()
                raise
        return cls._in_process(model, settings, config)

    @classmethod
    def _in_process(cls, model: str | Path, settings: dict, config: EngineConfig) -> AsyncLLM:
        from nanoref.serving.engine_process import EngineProcess

        # this side's own, for the checks and nothing else
        tokenizer = config.load_tokenizer()
        engine = cls.__new__(cls)
        engine._begin(None, tokenizer)
        engine._stats = None
        engine._engine = EngineProcess(model, settings, engine._on_message, engine._on_exit)
        engine.config = engine._engine.config
        if engine._stats is None:  # (else the reader thread has handed on a step message already: newer)
            engine._stats = engine._engine.stats
        return engine

    # -- the caller's side (the event loop) -------------------------------------------------------
    def generate(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it is served, those of its `sampling_params.n` samples interleaved (each output
        names its sample's `index`); the iteration ends once every sample has sent its finished output. A bad request
        (ValueError/TypeError) raises here, before anything is queued; the request is queued when the first output
        is awaited, and a duplicate request_id raises ValueError there. Leaving the iteration early (break,
        aclose, cancellation) aborts every sample of the request. lora_request: the LoRA adapter it runs under
        (LLM.generate's; the engine reads its folder when the request is queued), on each output (`.lora_request`,
        and its `.outputs`' as vLLM's). priority: vLLM's, one integer for this request; requests are served first
        come, first served, so it must be 0 (`check_request_priority`). prompt: as LLM.generate's, vLLM's
        prompt dicts included (with a "cache_salt": the prefix cache shares K/V only among requests of that salt).
        sampling_params (vLLM's name) None: the model's defaults (its generation_config.json:
        `LLM.get_default_sampling_params`)."""
        self._check_running()
        check_request_id(request_id)
        check_request_priority(priority)
        # the engine's own checks; params with the generation config's EOS ids among its stop ids (their text hidden)
        token_ids, salt, params = request_tokens(prompt, sampling_params, self.tokenizer, self.config)
        if self.tokenizer is None:  # (a folder without one, or skip_tokenizer_init): token ids in and out only
            check_needs_no_tokenizer(params, self.config)
        check_lora_request(lora_request, self.config.enable_lora)
        if params.structured_outputs is not None:  # its grammar compiled here (cached): a bad one raises now
            self._check_constraint(params)
        if salt is not None:  # (the engine takes it as LLM.generate does)
            token_ids = {"prompt_token_ids": token_ids, "cache_salt": salt}
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else request_id
        return self._stream(token_ids, params, request_id, lora_request, prompt_text(prompt))

    def encode(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """vLLM's AsyncLLM.encode (prompt, pooling_params, request_id, ...), for pooling models (embeddings, scores,
        rewards): a ValueError in the words vLLM's says for a model that cannot pool (EngineDeadError first, as there,
        once the engine is gone), where a missing method would be an AttributeError that says nothing of why."""
        self._check_running()
        raise ValueError(
            "This model does not support pooling (AsyncLLM.encode() is for pooling models; nanoref runs generative "
            "models only: it has no pooling runner; use generate)"
        )

    def _check_constraint(self, params: SamplingParams) -> None:
        """Compile the request's grammar (ValueError naming what the grammar library refused). The thread form
        compiles it in the LLM, whose cache the engine thread then reads; the process form has no LLM on this side,
        so it compiles it in grammars of its own, on this side's tokenizer, only to check it (the engine's process
        compiles it again for its matchers)."""
        if self.llm is not None:
            self.llm.constrain(params)
            return
        params.structured_outputs.validate()
        if self.tokenizer is None:
            raise ValueError(f"{self.config.no_tokenizer}: structured_outputs needs one")
        if self._grammars is None:
            self._grammars = grammars_for(self.tokenizer, self.config, self._eos_token_ids)
        self._grammars.check_allowed_token_ids(
            self._grammars.compile(params.structured_outputs), params.allowed_token_ids
        )

    def _check_running(self) -> None:
        """EngineDeadError (vLLM's; a RuntimeError) once the engine died or this AsyncLLM was closed."""
        if self._failure is not None:
            raise EngineDeadError(f"{self._failure}: this AsyncLLM serves no more requests; start a new one")
        if self._closed:
            raise EngineDeadError("this AsyncLLM is closed")

    async def _stream(
        self,
        prompt: list[int] | dict,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        text: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """prompt: its checked token ids, or vLLM's {"prompt_token_ids": ids, "cache_salt": salt}; text: the prompt's
        text, where it was given as text (the outputs' `prompt`)."""
        loop = asyncio.get_running_loop()
        token_ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        outputs = RequestOutputs(
            request_id, params.n, self.tokenizer, params, self._eos_token_ids, token_ids, text, lora_request
        )
        request = _Request(next(self._keys), loop, outputs)
        with self._requests_lock:  # (with _on_exit: a request is either failed by it or refused here)
            self._check_running()
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight: give each request its own id")
            self._requests[request_id] = self._by_key[request.key] = request
        unfinished = params.n  # samples whose finished output has not arrived yet
        finished = False
        try:
            self._engine.send(("add", request.key, request_id, prompt, params, lora_request))
            while not finished:
                items = [await request.queue.get()]
                while not request.queue.empty():  # what queued up while the consumer was busy: sent as one
                    items.append(request.queue.get_nowait())
                for item in coalesce(items):
                    if isinstance(item, BaseException):  # the step serving it failed (the engine was cleaned)
                        finished = True
                        raise item
                    unfinished -= item.finished
                    finished = not unfinished
                    yield item
                    if finished:  # (anything after its last output is not this request's: close's errors)
                        break
                # the consumer is done with what it read (sent it, when it is the server): the engine may make
                # the next output
                self._read(request.key)
        finally:
            with self._requests_lock:
                self._requests.pop(request_id, None)
                self._by_key.pop(request.key, None)
            if not finished:  # the consumer left early: free its blocks at the next step boundary
                self._engine.send(("abort", request.key))

    def _read(self, key: int) -> None:
        """Tell the engine that this request's consumer took its output: one "read" command per event loop turn
        for all the requests read in it, not one per request."""
        with self._reads_lock:
            first = not self._reads
            self._reads.append(key)
        if first:
            asyncio.get_running_loop().call_soon(self._send_reads)

    def _send_reads(self) -> None:
        with self._reads_lock:
            keys, self._reads = self._reads, []
        if keys:
            self._engine.send(("read", keys))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End a request in flight (or each of several ids, as vLLM's): each of its unfinished samples ends with a
        last output whose finish_reason is "abort". An unknown or finished id is ignored (it may have just finished)."""
        try:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
        except TypeError:  # (not iterable)
            ids = [request_id]
        if not all(isinstance(one, str) for one in ids):
            raise TypeError(f"request_id must be a string or an iterable of strings, got {request_id!r}")
        with self._requests_lock:
            requests = [self._requests.get(one) for one in ids]
        for request in requests:
            if request is not None:
                self._engine.send(("abort", request.key))

    async def abort_all(self) -> None:
        """abort() every request in flight (a server's stop does, once its --shutdown-timeout has passed)."""
        with self._requests_lock:
            ids = list(self._requests)
        await self.abort(ids)

    async def get_tokenizer(self) -> Any:
        """vLLM's: the engine's tokenizer (ValueError where it has none: skip_tokenizer_init, or none in the folder)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.no_tokenizer}: there is no tokenizer to get")
        return self.tokenizer

    async def check_health(self) -> None:
        """vLLM's: return while the engine runs; raise EngineDeadError (a RuntimeError) saying why once it is gone
        or closed."""
        with self._requests_lock:
            self._check_running()
        if not self._engine.is_alive():
            raise EngineDeadError("the engine has stopped: this AsyncLLM serves no more requests; start a new one")

    @property
    def errored(self) -> bool:
        """vLLM's: the engine is no longer running (it died, or was closed)."""
        return not self.is_running

    @property
    def is_stopped(self) -> bool:
        """vLLM's: errored."""
        return self.errored

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the model serves, ("generate",): nanoref's models generate; none pools (`encode`)."""
        return ("generate",)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: empty the engine's prefix cache between two of its steps, so that no later request reads K/V an
        earlier one computed (LLM.reset_prefix_cache's rule) -> True; False (and a RuntimeWarning), with nothing
        changed, while a request in flight holds KV blocks. vLLM's two options are not taken: nanoref does not
        preempt running requests to reset, and has no KV connector (True raises ValueError naming it)."""
        check_reset_options(reset_running_requests, reset_connector)
        num_blocks_held = await self.clear_prefix_cache()
        if num_blocks_held:
            warn_blocks_held(num_blocks_held)  # (naming the line that awaited this)
        return not num_blocks_held

    async def clear_prefix_cache(self) -> int:
        """reset_prefix_cache without its warning -> 0 once emptied, else the KV blocks that requests in flight hold
        (nothing changed): LLM.clear_prefix_cache, run by the engine's loop between steps (the server's route)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        key = next(self._keys)
        with self._requests_lock:  # (with _on_exit: either failed by it or refused here)
            self._check_running()
            self._replies[key] = (loop, answer)
        try:
            self._engine.send(("reset_prefix_cache", key))
            return await answer
        finally:
            with self._requests_lock:
                self._replies.pop(key, None)

    @property
    def dead_error(self) -> EngineDeadError:
        """vLLM's: the error that says why the engine is gone (why it died, or that this AsyncLLM was closed)."""
        why = self._failure or ("this AsyncLLM is closed" if self._closed else "the engine has stopped")
        return EngineDeadError(why)

    @property
    def is_running(self) -> bool:
        """The engine is alive and taking requests."""
        return not self._closed and self._failure is None and self._engine.is_alive()

    def stats(self) -> EngineStats:
        """The engine's numbers as of its last step message: a snapshot, maybe a step old."""
        return self._stats

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine (requests in flight end with "abort"): its thread, or its process (terminated when it
        does not stop within `timeout`); an owned LLM is closed too."""
        if self._closed:
            return
        self._closed = True
        self._stop_engine(timeout)

    def _stop_engine(self, timeout: float) -> None:
        self._engine.close(timeout)
        # an engine that did not stop in time (a step that never ends) answers nobody: its requests fail now
        self._fail_in_flight("this AsyncLLM was closed before the engine stopped")

    def shutdown(self, timeout: float | None = None) -> asyncio.Task | None:
        """vLLM's AsyncLLM.shutdown, a plain call there: close() (timeout: its, None: 30 s). On an event loop, the join
        (which waits for a step) runs in a worker thread, not on the loop, and the returned task ends with it: `await
        engine.shutdown()` waits for the engine to stop, and vLLM's plain `engine.shutdown()` stops it all the same.
        Without an event loop it returns (None) once the engine stopped. Either way, as vLLM's, the engine is dead
        (is_running False, a new request EngineDeadError) once it returns."""
        timeout = 30.0 if timeout is None else timeout
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.close(timeout)
            return None
        stop = None if self._closed else self._stop_engine
        self._closed = True  # (now: the task runs later)
        return loop.create_task(asyncio.to_thread(stop or (lambda timeout: None), timeout))

    # -- the thread that receives the engine's messages (the engine thread, or the process form's reader) ------
    def _on_message(self, message: StepMessage) -> None:
        """One step's outputs to their requests: one hand-off per event loop, not one per request or token (with
        hundreds of streams, a wake-up of the loop per request would cost more than the step)."""
        self._stats = message.stats
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        by_key = self._by_key
        # (a delta whose request is gone: its consumer left, and the engine's abort is on its way)
        live = [(by_key[delta.key], delta) for delta in message.deltas if delta.key in by_key]
        texts = delta_texts([(request.outputs, delta) for request, delta in live])
        for (request, delta), text in zip(live, texts):
            try:  # (a tokenizer that cannot decode this request's tokens: it fails alone, the others go on)
                if isinstance(text, Exception):
                    raise text
                item = request.outputs.output(delta, text)
            except Exception as error:
                item = self._output_failed(request, error)
            outbox.setdefault(request.loop, []).append((request, item))
        for key, error in message.errors:
            request = by_key.get(key)
            if request is not None:
                outbox.setdefault(request.loop, []).append((request, error))
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_publish, items)
            except RuntimeError:  # the consumers' event loop is closed: nobody is left to read them
                pass
        for key, answer in message.replies:
            self._answer(key, answer)

    def _output_failed(self, request: _Request, error: Exception) -> RuntimeError:
        """Making a request's output failed here (its text): the request ends with an error saying so, the engine
        aborts it (its blocks go back), and its later deltas are dropped."""
        with self._requests_lock:
            self._by_key.pop(request.key, None)
        self._engine.send(("abort", request.key))
        failure = RuntimeError(
            f"request {request.request_id!r}: making its output failed ({type(error).__name__}: {error}); the "
            "request was aborted"
        )
        failure.__cause__ = error
        return failure

    def _answer(self, key: int, answer: int | BaseException) -> None:
        """A command's reply (or why none will come) to its awaiter, on the awaiter's event loop."""
        with self._requests_lock:
            waiting = self._replies.pop(key, None)
        if waiting is not None:
            loop, future = waiting
            try:
                loop.call_soon_threadsafe(_settle, future, answer)
            except RuntimeError:  # its event loop is closed: nobody awaits it
                pass

    def _on_exit(self, reason: str) -> None:
        """The engine ended without being asked to: every request in flight fails, and so does every later one."""
        with self._requests_lock:
            self._failure = reason
        self._fail_in_flight(f"{reason}: the requests in flight were lost")

    def _fail_in_flight(self, why: str) -> None:
        """Every request whose consumer has not ended gets an error after what it already has queued (a request
        whose last output is queued ends with that)."""
        with self._requests_lock:
            pending = list(self._by_key.values())
            awaiting = list(self._replies)
        if pending:
            error = EngineDeadError(why)
            self._on_message(StepMessage([], [(request.key, error) for request in pending], self._stats))
        for key in awaiting:  # a command whose reply will never come (reset_prefix_cache)
            self._answer(key, EngineDeadError(why))


def check_needs_no_tokenizer(params: SamplingParams, config: EngineConfig) -> None:
    """ValueError naming what of a request needs the tokenizer an engine without one lacks (LLM.stream's rule)."""
    if params.detokenize:  # (vLLM streams "" there; nanoref says so, as LLM.stream does)
        raise ValueError(f"{config.no_tokenizer}: a stream of text needs one (token ids only: detokenize=False)")
    if params.bad_words:
        raise ValueError(f"{config.no_tokenizer}: bad_words needs one")


def _settle(future: asyncio.Future, answer: int | BaseException) -> None:
    """On the awaiter's event loop: a command's reply into its future (unless the awaiter was cancelled)."""
    if future.done():
        return
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def _publish(items: list[tuple[_Request, RequestOutput | BaseException]]) -> None:
    """On the consumers' event loop: one step's outputs into their requests' queues."""
    for request, item in items:
        request.queue.put_nowait(item)


def coalesce(items: list) -> list:
    """Queued outputs (and errors) of one request, each sample's consecutive outputs merged into one, in order."""
    merged: list = []
    latest: dict[int, int] = {}  # sample index -> its output's place in `merged`
    for item in items:
        if isinstance(item, BaseException):
            merged.append(item)
            latest.clear()  # nothing merges across an error
        elif item.index in latest:
            place = latest[item.index]
            merged[place] = merged[place].followed_by(item)
        else:
            latest[item.index] = len(merged)
            merged.append(item)
    return merged
