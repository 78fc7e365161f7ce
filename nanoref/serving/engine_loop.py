"""The engine's side of `AsyncLLM`: the loop that owns an `LLM` while it serves, and the messages it speaks.

The same loop runs in a thread of the server's process or in a process of its own (engine_process.py); it knows
neither. It takes commands from `receive` and hands what each step made to `send`, ONE `StepMessage` per step:

    in:  ("add", key, request_id, prompt, params, lora_request)   # checked by the caller already; prompt: its
                                                                       # ids, or {"prompt_token_ids", "cache_salt"}
         ("abort", key)
         ("read", [key, ...])    # these requests' consumers took their last output: they may get the next one
         ("reset_prefix_cache", key)  # empty the prefix cache between steps: a reply (key, blocks still held
                                      # or the error that stopped it)
         ("stop",)               # every request in flight ends with "abort", then the loop returns
    out: StepMessage(deltas, errors, stats, replies)

`key` is the caller's number for one submission (a request id may come back once its request is done; a key never
does). One message per step, not one per request or token: a hand-off between threads or processes costs a
wake-up, and with hundreds of streams one per request would cost more than the step.

Per token the loop does little (see async_llm.py's docstring for why that matters):
- a request gets a new delta only once its consumer read the previous one ("read"); a consumer that falls behind
  gets several tokens in one delta later, and costs nothing meanwhile (a finished sample's last delta is always
  sent: it carries everything not sent yet);
- a delta carries token ids, not text: the receiving side decodes them (the output stage's `delta_texts`, in
  AsyncLLM's receiving thread: every stream's tokens of a step in one batched decode). In the process form that is
  the server's process, so the engine's process spends nothing on text: on an H200 with 256 streams, decoding every
  delta here took a quarter of the engine process's time, Python that offline `generate` never pays, and the GPU
  waited for it. Only a request with stop strings has its text grown here, token by token, in the engine (its
  `seq.output.detokenizer`), where the stop strings are matched and end the sequence; its deltas carry that text.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from nanoref.engine.output_processor import SampleDelta
from nanoref.engine.sequence import Sequence
from nanoref.llm import LLM


def drain(inbox: queue.SimpleQueue, wait: bool) -> list[tuple]:
    """Every command queued in `inbox` (wait: block until at least one is there): an EngineLoop's `receive`."""
    items = [inbox.get()] if wait else []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for a metrics endpoint."""

    num_running: int
    num_waiting: int  # sequences queued for prefill (a request of n samples: n, as vLLM counts its n child requests)
    num_kv_blocks_used: int
    num_kv_blocks: int
    prefix_cache_queried_tokens: int  # prompt tokens of the finished requests
    prefix_cache_hit_tokens: int  # the part of them served from the prefix cache
    # speculative decoding (0 without): tokens proposed, of them accepted, and sequences' rows in verify steps
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verified_rows: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
        )


class StepMessage(NamedTuple):
    """Everything one step made, for every request at once."""

    deltas: list[SampleDelta]
    errors: list[tuple[int, BaseException]]  # (key, why): a failed step fails the requests in it
    stats: EngineStats  # after the step
    replies: list[tuple[int, int | Exception]] = []  # (key, answer) to the commands that ask for one (a default never
    # mutated)


@dataclass(eq=False)  # compared by identity: two samples are never the same one
class _Sample:
    seq: Sequence
    num_sent_tokens: int = 0  # what earlier deltas delivered
    num_sent_chars: int = 0  # (of the engine's text: a request with stop strings)
    done: bool = False  # its finished delta is sent


@dataclass(eq=False)
class _Active:
    samples: list[_Sample]  # sample i at index i
    unread: bool = False  # a delta was sent and its consumer has not read it yet: no new one meanwhile


class EngineLoop:
    """Serve commands from `receive(wait)` (wait: block until at least one arrives) on `llm`, sending one
    StepMessage per step to `send`, until ("stop",). While it runs, the LLM is this loop's alone."""

    def __init__(self, llm: LLM, receive: Callable[[bool], list[tuple]], send: Callable[[StepMessage], None]) -> None:
        self.llm, self.receive, self.send = llm, receive, send
        self.requests: dict[int, _Active] = {}  # key -> a request queued in the engine, until its last delta
        self.errors: list[tuple[int, BaseException]] = []  # not sent yet
        self.replies: list[tuple[int, int | Exception]] = []  # not sent yet
        self.queried_tokens = self.hit_tokens = 0  # prefix-cache counters
        # speculative decoding: tokens proposed, accepted, and the sequences' rows of the verify steps
        self.draft_tokens = self.accepted_tokens = self.verified_rows = 0
        self.sent_stats: EngineStats | None = None
        self.dead: str | None = None  # why the engine can run no more steps (llm.broken), once a step says so

    def run(self) -> None:
        """Until ("stop",), or until the engine can run no more steps (`dead`: a tensor-parallel rank failed), when
        every request left fails with that error and the loop ends (its owner then reports the engine dead)."""
        self.llm.output_processor.output_errors = {}  # (a request whose text cannot be made fails alone: `step`)
        try:
            self._run()
        finally:  # (the LLM may serve offline again: there such a request fails its step, and the call raises)
            self.llm.output_processor.output_errors = None

    def _run(self) -> None:
        stopping = False
        while not stopping:
            # idle: sleep until something arrives; busy: take whatever arrived during the last step
            stopping = self.take(self.receive(not self.requests))
            if not stopping:
                self.step()
                # the reads that came in during the step: those consumers get this step's tokens now, not next step's
                stopping = self.take(self.receive(False))
            if stopping:  # every request still in flight ends with "abort"
                for active in self.requests.values():
                    self.abort(active)
            elif self.dead is not None:  # every request left fails with why (those of the failed step: its error)
                for key, active in list(self.requests.items()):
                    self.abort(active)
                    self.errors.append((key, RuntimeError(self.dead)))
                    del self.requests[key]
                stopping = True
            self.deliver()

    def take(self, commands: list[tuple]) -> bool:
        """Apply commands between steps (the only moment the engine's state may change) -> whether to stop."""
        stopping = False
        for command in commands:
            kind = command[0]
            if kind == "read":
                for key in command[1]:
                    active = self.requests.get(key)
                    if active is not None:
                        active.unread = False
            elif kind == "add":
                _, key, request_id, prompt, params, lora_request = command
                try:  # (checked by the caller: this raises only if the caller's checks fell behind the engine's, or
                    # an adapter's folder changed since the server checked it)
                    seqs = self.llm.make_samples(prompt, params, request_id, lora_request=lora_request)
                except Exception as error:
                    self.errors.append((key, error))
                    continue
                self.llm.enqueue_samples(seqs)
                self.requests[key] = _Active([_Sample(seq) for seq in seqs])
            elif kind == "abort":  # (an abort of a request that already finished changes nothing)
                active = self.requests.get(command[1])
                if active is not None:
                    self.abort(active)
            elif kind == "reset_prefix_cache":  # (between steps: no step holds the engine now)
                try:
                    self.replies.append((command[1], self.llm.clear_prefix_cache()))
                except Exception as error:  # its caller gets the error; the loop serves on
                    self.replies.append((command[1], error))
            elif kind == "stop":
                stopping = True
        return stopping

    def abort(self, active: _Active) -> None:
        # the last sample first: samples 1..n-1 may still be held for sample 0's prompt (LLMEngine.enqueue_samples),
        # and aborting sample 0 first would queue them only to abort them next
        for sample in reversed(active.samples):
            self.llm.abort_request(sample.seq)

    def step(self) -> None:
        if self.llm.is_finished():
            return
        try:
            _, record = self.llm.step()
            if record.num_draft_tokens:  # speculative decoding: a verify step
                self.draft_tokens += record.num_draft_tokens
                self.accepted_tokens += record.num_accepted_tokens
                self.verified_rows += record.num_seqs
            # a server runs for days: keep no step history (the last record may be a step in flight)
            del self.llm.metrics.steps[:-1]
        except Exception as error:  # fail the requests the step aborted (`failed`), keep serving the others
            failed = set(self.llm.failed)
            for key, active in list(self.requests.items()):
                if any(sample.seq in failed for sample in active.samples):
                    self.abort(active)  # (its other samples too)
                    self.errors.append((key, error))
                    del self.requests[key]
            self.dead = self.llm.broken  # (unless the engine itself can run no more steps)
        finally:
            self.fail_undecodable()

    def fail_undecodable(self) -> None:
        """Fail alone each request whose text a step could not make (a request with stop strings: its text is made
        in the step, `OutputProcessor.on_token`); that sample ended there, the request's others are aborted."""
        failed = self.llm.output_processor.output_errors
        if not failed:
            return
        for key, active in list(self.requests.items()):
            errors = [failed[sample.seq] for sample in active.samples if sample.seq in failed]
            if errors:
                self.abort(active)
                for sample in active.samples:  # (a sample that failed ended in the step: its record, never sent)
                    if sample.seq in failed:
                        sample.seq.finish_reason = "abort"
                    self.llm.metrics.requests.pop(sample.seq.seq_id, None)
                request_id = active.samples[0].seq.output.request_id
                error = RuntimeError(
                    f"request {request_id!r}: making its output failed ({type(errors[0]).__name__}: {errors[0]}); "
                    "the request was aborted"
                )
                error.__cause__ = errors[0]
                self.errors.append((key, error))
                del self.requests[key]
        failed.clear()

    def deliver(self) -> None:
        """Send each sample what it made since its last delta, with the errors and the stats, as one message
        (none when nothing changed)."""
        deltas = []
        for key, active in list(self.requests.items()):
            ready = not active.unread  # a consumer still busy with its last delta gets nothing new now...
            for sample in active.samples:
                if not sample.done and (ready or sample.seq.is_finished):  # ...unless a sample is done
                    delta = self.delta(key, sample)
                    if delta is not None:
                        active.unread = True
                        deltas.append(delta)
            if all(sample.done for sample in active.samples):
                del self.requests[key]
        stats = self.stats()
        if deltas or self.errors or self.replies or stats != self.sent_stats:
            errors, replies, self.errors, self.replies, self.sent_stats = self.errors, self.replies, [], [], stats
            self.send(StepMessage(deltas, errors, stats, replies))

    def delta(self, key: int, sample: _Sample) -> SampleDelta | None:
        """What the sample made since its last delta (None: nothing new)."""
        seq = sample.seq
        tokens = seq.completion_token_ids
        if len(tokens) == sample.num_sent_tokens and not seq.is_finished:
            return None
        streamed = seq.output.detokenizer is not None or not seq.sampling_params.detokenize  # (no text: "")
        text = self.llm.output_processor.text_so_far(seq) if streamed else None  # (the final text once finished)
        metrics = self.llm.metrics.requests.pop(seq.seq_id, None) if seq.is_finished else None
        if metrics is not None:
            self.queried_tokens += metrics.num_prompt_tokens
            self.hit_tokens += metrics.num_cached_tokens
        delta = SampleDelta(
            key=key,
            index=seq.output.index,
            token_ids=tokens[sample.num_sent_tokens :],
            text=None if text is None else text[sample.num_sent_chars :],
            num_prompt_tokens=seq.num_prompt_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.output.logprobs[sample.num_sent_tokens : len(tokens)],
            metrics=metrics,
            prompt_logprobs=self.llm.output_processor.prompt_logprobs(seq) if sample.num_sent_tokens == 0 else None,
            num_cached_tokens=self.requests[key].samples[0].seq.num_prefix_hit_tokens,  # (the request's: sample 0's)
        )
        sample.num_sent_tokens, sample.done = len(tokens), seq.is_finished
        if text is not None:
            sample.num_sent_chars = len(text)
        return delta

    def stats(self) -> EngineStats:
        scheduler = self.llm.scheduler
        manager = scheduler.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            # (with the samples 1..n-1 held until their sample 0's prompt is in: vLLM queues a request's n samples
            # as n requests at once, and counts each)
            num_waiting=len(scheduler.waiting) + sum(map(len, self.llm.output_processor.held_samples.values())),
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks=manager.num_blocks,
            prefix_cache_queried_tokens=self.queried_tokens,
            prefix_cache_hit_tokens=self.hit_tokens,
            spec_draft_tokens=self.draft_tokens,
            spec_accepted_tokens=self.accepted_tokens,
            spec_verified_rows=self.verified_rows,
        )
