"""`AsyncLLM`: many requests that arrive, stream and leave at any time, on one engine.

Offline, `LLM.generate` takes every prompt at once and returns when the last one is done. A server cannot wait
like that: requests arrive while others run, each caller wants its tokens as they are made, and a caller that
goes away must stop costing KV blocks. The engine already has what this needs (`add_request`, `step`,
`abort_request`, a streamed `seq.detokenizer.text`); this module drives it from asyncio.

A request's life online:

    out = engine.generate(prompt, params, request_id="r1")   # 1. checked here: a bad request raises now
    async for piece in out:                                   # 2. queued in the engine thread's inbox
        print(piece.text, end="")                             # 3. a piece after each engine step that made one
    # 4. the last piece has finished=True, finish_reason and metrics; closing early (break, a cancelled task)
    #    aborts the request: its blocks go back at the next step boundary
    # (with n > 1, the pieces of its n samples come interleaved, each with its sample's `index`, and the
    #  iteration ends after every sample's last piece)

Why one background thread: a step is blocking CPU/GPU work (a forward pass) that would freeze the event loop and
every other client with it. So one thread owns the engine's loop: it takes new requests and aborts from a
thread-safe inbox *between* steps (the only moment the engine's state may change), runs `step()` while any request
is unfinished, sleeps on the inbox when there is nothing to do, and hands each request's new output to that
request's `asyncio.Queue` through `loop.call_soon_threadsafe` (asyncio objects belong to their loop's thread).

What one step costs beyond the forward is what a server adds to offline `generate`, so per token it does little:
- a request gets a new output only once its consumer has taken the previous one; a consumer that falls behind
  (hundreds of streams on one event loop) reads several tokens in one piece, and the engine thread spends nothing
  on it meanwhile (a finished sample's last output is always sent: it carries everything not sent yet);
- text is decoded when an output is made, for all its new tokens at once; only a request with stop strings has its
  text grown token by token in the engine, where the stop strings are matched.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from nanoref.engine.detokenizer import IncrementalDetokenizer
from nanoref.engine.metrics import RequestMetrics
from nanoref.engine.sequence import Sequence
from nanoref.layers.logits_processors import TokenLogprobs
from nanoref.llm import DEFAULT_MODEL, LLM
from nanoref.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """What one sample of a request made since its previous output (the delta), and everything it made so far.

    A request with n > 1 streams its samples' outputs interleaved, each with its `index`; `finished` is that
    sample's, and the request is done when each of its n samples has sent a finished output."""

    request_id: str
    text: str  # new text since the previous output ("" while a character or a possible stop string is held back)
    token_ids: list[int]  # new token ids since the previous output
    cumulative_text: str
    cumulative_token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    metrics: RequestMetrics | None = None  # on the last output of a request that was served (not aborted)
    index: int = 0  # which of the request's n samples
    # the stop string or stop_token_ids entry that ended it ("stop"); None for EOS, length and abort
    stop_reason: int | str | None = None
    # one entry per token of `token_ids` where SamplingParams.logprobs asked for them, else empty
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same sample as one (a consumer that fell behind reads both at once)."""
        # the later one's state (cumulative text, finish, metrics), with both deltas
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs,
        )


@dataclass
class EngineStats:
    """A snapshot for a metrics endpoint."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks: int
    prefix_cache_queried_tokens: int  # prompt tokens of the finished requests
    prefix_cache_hit_tokens: int  # the part of them served from the prefix cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
        )


@dataclass(eq=False)  # compared by identity: two samples are never the same one
class _Sample:
    seq: Sequence
    # its text, decoded when an output is made (the engine's own `seq.detokenizer` where stop strings need one)
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int = 0  # what earlier outputs delivered
    num_sent_chars: int = 0
    done: bool = False  # its finished output is sent


@dataclass(eq=False)  # compared by identity: two requests are never the same one
class _Request:
    request_id: str
    samples: list[_Sample]  # its n samples, sample i at index i
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # an output was handed to the loop and its consumer has not taken it yet: the engine thread makes no new one
    # (read and written under the GIL; the consumer clears it when it empties its queue)
    unread: bool = False


_STOP = object()  # the inbox's last item: the engine thread ends


class AsyncLLM:
    """An asyncio front on an `LLM`; see the module docstring for a request's life. While it runs, the LLM is
    its engine thread's alone (an offline `generate` on the same LLM would step this one's requests too).

        engine = AsyncLLM(LLM(device="cpu"))
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")
        await engine.shutdown()
    """

    def __init__(self, llm: LLM, *, owns_llm: bool = False) -> None:
        """owns_llm: close() also closes the LLM (from_model's)."""
        if llm.tokenizer is None:
            raise ValueError(f"{llm.config.model_folder} has no tokenizer: streamed text needs one")
        self.llm = llm
        self._owns_llm = owns_llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add" | "abort", _Request), or _STOP
        self._requests: dict[str, _Request] = {}  # request_id -> request, from submission until its consumer ends
        self._requests_lock = threading.Lock()  # (consumers may run on several event loops)
        self._queried_tokens = 0  # prefix-cache counters, written by the engine thread only
        self._hit_tokens = 0
        self._closed = False
        # in a copy of the creator's context: a `seams.use(...)` block around the start reaches the thread's steps
        run = contextvars.copy_context().run
        self._thread = threading.Thread(target=run, args=(self._engine_loop,), name="nanoref-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str | Path = DEFAULT_MODEL, **settings) -> AsyncLLM:
        """An AsyncLLM on a new LLM(model, **settings), which its close() closes."""
        return cls(LLM(model, **settings), owns_llm=True)

    # -- the caller's side (the event loop) -------------------------------------------------------
    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it is served, those of its `params.n` samples interleaved (each output names
        its sample's `index`); the iteration ends once every sample has sent its finished output. A bad request
        (ValueError/TypeError) raises here, before anything is queued; the request is queued when the first output
        is awaited, and a duplicate request_id raises ValueError there. Leaving the iteration early (break,
        aclose, cancellation) aborts every sample of the request."""
        if self._closed:
            raise RuntimeError("this AsyncLLM is closed")
        seqs = self.llm.make_samples(prompt, SamplingParams() if params is None else params, request_id)
        if self.llm.tokenizer is None:
            raise ValueError(f"{self.llm.config.model_folder} has no tokenizer: a stream of text needs one")
        return self._stream(seqs, request_id or f"req-{uuid.uuid4().hex}")

    async def _stream(self, seqs: list[Sequence], request_id: str) -> AsyncIterator[RequestOutput]:
        samples = [_Sample(seq, seq.detokenizer or IncrementalDetokenizer(self.llm.tokenizer)) for seq in seqs]
        request = _Request(request_id, samples, asyncio.get_running_loop())
        if self._closed:  # (no engine thread would ever answer)
            raise RuntimeError("this AsyncLLM is closed")
        with self._requests_lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight: give each request its own id")
            self._requests[request_id] = request
        unfinished = len(seqs)  # samples whose finished output has not arrived yet
        finished = False
        try:
            self._inbox.put(("add", request))
            while not finished:
                # the consumer is done with what it read last (sent it, when it is the server): the engine thread
                # may make the next output
                request.unread = False
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
        finally:
            with self._requests_lock:
                self._requests.pop(request_id, None)
            if not finished:  # the consumer left early: free its blocks at the next step boundary
                self._inbox.put(("abort", request))

    async def abort(self, request_id: str) -> None:
        """End a request in flight: each of its unfinished samples ends with a last output whose finish_reason is
        "abort". An unknown or finished id is ignored (it may have just finished)."""
        with self._requests_lock:
            request = self._requests.get(request_id)
        if request is not None:
            self._inbox.put(("abort", request))

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and taking requests."""
        return not self._closed and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """Read without the engine's lock (a step holds it for a whole forward): a snapshot, maybe a step old."""
        scheduler = self.llm.scheduler
        manager = scheduler.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks=manager.num_blocks,
            prefix_cache_queried_tokens=self._queried_tokens,
            prefix_cache_hit_tokens=self._hit_tokens,
        )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (requests in flight end with "abort"); an owned LLM is closed too."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._owns_llm:
            self.llm.close()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)  # joining the thread waits for a step: not on the event loop

    # -- the engine thread ---------------------------------------------------------------------
    def _engine_loop(self) -> None:
        active: list[_Request] = []  # requests queued in the engine whose last output is not delivered yet
        while True:
            # idle: sleep until something arrives; busy: take whatever arrived during the last step
            commands = [self._inbox.get()] if not active else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stopping = _STOP in commands
            try:
                for command in commands:
                    if command is _STOP:
                        continue
                    kind, request = command
                    if kind == "add":
                        self.llm.enqueue_samples([sample.seq for sample in request.samples])
                        active.append(request)
                    elif request in active:  # (an abort of a request that already finished changes nothing)
                        self._abort(request)
                if stopping:  # every request still in flight ends with "abort"
                    for request in active:
                        self._abort(request)
                    self._deliver(active)
                    return
                if not self.llm.is_finished():
                    self.llm.step()
                    # a server runs for days: keep no step history (the last record may be a step in flight)
                    del self.llm.metrics.steps[:-1]
            except Exception as error:  # fail what was in flight, keep serving what comes next
                self.llm.abort_all()
                for request in active:
                    self._send(request, error)
                active.clear()
                continue
            active = self._deliver(active)

    def _abort(self, request: _Request) -> None:
        # the last sample first: samples 1..n-1 may still be held for sample 0's prompt (LLMEngine.enqueue_samples),
        # and aborting sample 0 first would queue them only to abort them next
        for sample in reversed(request.samples):
            self.llm.abort_request(sample.seq)

    def _deliver(self, active: list[_Request]) -> list[_Request]:
        """Send each sample of each request what it made since its last output -> the requests still unfinished.

        One hand-off per event loop and step, not one per request: with hundreds of streams, a wake-up of the loop
        per request and token would keep the event loop (and the GIL) busy for longer than the step itself."""
        unfinished, outbox = [], {}
        for request in active:
            ready = not request.unread  # a consumer still busy with its last output gets nothing new now...
            for sample in request.samples:
                if not sample.done and (ready or sample.seq.is_finished):  # ...unless a sample is done
                    output = self._output(request, sample)
                    if output is not None:
                        request.unread = True
                        outbox.setdefault(request.loop, []).append((request, output))
            if not all(sample.done for sample in request.samples):
                unfinished.append(request)
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_publish, items)
            except RuntimeError:  # the consumers' event loop is closed: nobody is left to read them
                pass
        return unfinished

    def _output(self, request: _Request, sample: _Sample) -> RequestOutput | None:
        """What the sample made since its last output (None: nothing new)."""
        seq = sample.seq
        tokens = seq.completion_token_ids
        if len(tokens) == sample.num_sent_tokens and not seq.is_finished:
            return None
        detokenizer = sample.detokenizer
        if detokenizer is not seq.detokenizer:  # (the engine's own is up to date: it matches the stop strings)
            detokenizer.add(tokens[len(detokenizer.token_ids) :])
            if seq.is_finished:
                detokenizer.finish()
        text = detokenizer.text  # complete characters only (the final text once finished)
        metrics = self.llm.metrics.requests.pop(seq.seq_id, None) if seq.is_finished else None
        if metrics is not None:
            self._queried_tokens += metrics.num_prompt_tokens
            self._hit_tokens += metrics.num_cached_tokens
        output = RequestOutput(
            request_id=request.request_id,
            text=text[sample.num_sent_chars :],
            token_ids=tokens[sample.num_sent_tokens :],
            cumulative_text=text,
            cumulative_token_ids=tokens,
            num_prompt_tokens=seq.num_prompt_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            metrics=metrics,
            index=seq.index,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs[sample.num_sent_tokens : len(tokens)],
        )
        sample.num_sent_tokens, sample.num_sent_chars, sample.done = len(tokens), len(text), seq.is_finished
        return output

    @staticmethod
    def _send(request: _Request, item: RequestOutput | BaseException) -> None:
        try:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is left to read it
            pass


def _publish(items: list[tuple[_Request, RequestOutput]]) -> None:
    """On the consumers' event loop: one step's outputs into their requests' queues."""
    for request, output in items:
        request.queue.put_nowait(output)


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
