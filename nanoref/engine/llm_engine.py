"""The engine loop: schedule, run, postprocess, until every request has finished."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from itertools import count
from typing import Protocol

import torch

from nanoref.config import EngineConfig
from nanoref.engine.hooks import NO_ENGINE_HOOKS, EngineHooks
from nanoref.engine.metrics import EngineMetrics, StepRecord
from nanoref.engine.model_runner import ModelRunner
from nanoref.engine.output_processor import GenerateOutput, OutputProcessor
from nanoref.engine.requests import params_list, prompt_list, prompt_text, request_tokens, tokenize
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence, SequenceStatus
from nanoref.engine.streaming import RequestStream
from nanoref.sampling_params import SamplingParams
from nanoref.utils import seams
from nanoref.utils.interrupts import held_interrupts, interruptibly
from nanoref.utils.progress import tqdm


class StepLoop(Protocol):
    """How the engine runs a step (`PlainLoop`, unless nanoref/llm.py gives another)."""

    def step(self) -> tuple[list[Sequence], StepRecord]:
        """One step -> (the sequences finished in it, its record)."""

    def in_step(self) -> list[Sequence]:
        """The sequences the step being run has scheduled so far: those a step that raises aborts."""


class PlainLoop:
    """Nano-vLLM's step: schedule, run the forward, postprocess."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def step(self) -> tuple[list[Sequence], StepRecord]:
        scheduler, metrics = self.engine.scheduler, self.engine.metrics
        seqs, is_prefill = scheduler.schedule()
        record = metrics.begin_step(scheduler, seqs, is_prefill)
        token_ids = interruptibly(self.engine.model_runner.run, seqs, is_prefill)
        return scheduler.postprocess(seqs, token_ids), metrics.end_step(record, seqs)

    def in_step(self) -> list[Sequence]:
        return self.engine.scheduler.scheduled


class LLMEngine:
    """The engine. One `generate` (or `step`) runs at a time: calls from several threads are serialized.

    A step that raises, an error or Ctrl-C, aborts the requests it scheduled (finish_reason "abort"; their blocks
    go back; `failed` lists them) and raises; the other requests run on at the next step. Ctrl-C is held back while
    the engine's bookkeeping runs (scheduling, postprocessing, metrics, queuing requests) and raised when it is done
    (utils/interrupts.py); it acts at once in the forward pass and in a learner's exercise function.
    """

    def __init__(
        self,
        config: EngineConfig,
        make_runner: Callable[[EngineConfig], ModelRunner] = ModelRunner,
        hooks: EngineHooks = NO_ENGINE_HOOKS,
    ) -> None:
        """config: resolved (`EngineConfig.resolved()`); make_runner builds the model runner; hooks: what features
        add (engine/hooks.py; nanoref/llm.py gives them)."""
        self._lock = threading.RLock()  # held by generate, step, add_request and the aborts
        # before the model runner, which may start worker processes: a folder that fails fails before them
        self.tokenizer = config.load_tokenizer()
        self.model_runner = make_runner(config)
        self.config = config = self.model_runner.config  # (with the KV block count the runner measured)
        self.output_processor = OutputProcessor(self.tokenizer, config)
        try:
            self.scheduler = Scheduler(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                num_kvcache_blocks=config.num_kvcache_blocks,
                kvcache_block_size=config.kvcache_block_size,
                eos_token_ids=self.output_processor.eos_token_ids,
                num_lookahead_tokens=hooks.num_lookahead_tokens,
                on_token=self.output_processor.on_token,
                can_admit=hooks.can_admit,
            )
        except BaseException:
            self.model_runner.close()  # (stop its workers, if any, now: not when the exception is dropped)
            raise
        # the block manager writes each sequence's table into this array's rows; the model runner reads them
        self.model_runner.block_tables = self.scheduler.block_manager.tables
        # the ids the sampler masks while a request is short of its min_tokens: EOS and the generation config's EOS ids
        # (as vLLM masks every stop id it knows, ignore_eos or not)
        self.model_runner.eos_token_ids = self.scheduler.eos_token_ids | set(config.generation_defaults.eos_token_ids)
        self.metrics = EngineMetrics()  # step records and per-request metrics (see engine/metrics.py)
        self._seq_ids = count()  # this engine's sequence ids: its first request is 0, whatever ran before
        self.failed: list[Sequence] = []  # the sequences the latest step that raised aborted
        # the loop refers back to its engine weakly: `del llm` then frees the engine (its KV cache, its workers) at
        # once, not at the next cyclic garbage collection, which a new engine sizing its cache would race
        self.step_loop = (hooks.make_step_loop or PlainLoop)(weakref.proxy(self))

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(prompt, self.tokenizer, self.config)

    def make_samples(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None,
        request_id: str | None = None,
        stream: bool = False,
    ) -> list[Sequence]:
        """A checked request's `params.n` samples, not yet queued: everything that can fail about a request fails
        here. Sample i has `index` i and, when the request is seeded, the seed params.seed + i. stream: keep its text
        up to date after every step (`OutputProcessor.attach`). A prompt dict's "cache_salt" (vLLM's) becomes each
        sample's `cache_salt`: the prefix cache shares their blocks only with requests of the same salt. params None:
        the model's defaults (`EngineConfig.generation_defaults`)."""
        token_ids, salt, params = request_tokens(prompt, params, self.tokenizer, self.config)
        samples = []
        for index in range(params.n):
            seq = Sequence(token_ids, params, self.config.kvcache_block_size, seq_id=next(self._seq_ids))
            seq.cache_salt = salt  # (`attach` and the hooks keep it inside salts of their own)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.config.device).manual_seed(params.seed + index)
            samples.append(seq)
        self.output_processor.attach(samples, request_id, stream)
        return samples

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, stream: bool = False,
        **options,
    ) -> Sequence:  # fmt: skip
        """Check one request and queue it; a bad request raises and queues nothing. request_id: the caller's name
        for it (kept as `seq.output.request_id`); stream: see make_samples; options: more of a subclass's
        make_samples. For n > 1, add_samples."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"one sequence is one sample, but n is {params.n}: use make_samples or add_samples")
        return self.add_samples(prompt, params, request_id, stream, **options)[0]

    def add_samples(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, stream: bool = False,
        **options,
    ) -> list[Sequence]:  # fmt: skip
        """add_request for all `params.n` samples of a request -> the n sequences (see enqueue_samples)."""
        samples = self.make_samples(prompt, params, request_id, stream, **options)
        self.enqueue_samples(samples)
        return samples

    def abort_request(self, seq: Sequence) -> None:
        """End one request now, between steps: its blocks go back and its finish_reason is "abort" (a finished
        request is left as it is). The other requests run on. A sample not queued yet (see enqueue_samples) is
        dropped from the held ones."""
        with self._lock, held_interrupts():
            if seq.is_finished:
                return
            if self.output_processor.drop_held([seq]):
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                return
            self.metrics.forget([seq])
            self.scheduler.finish(seq, "abort")
            self.queue_held_samples()  # (if it was a sample 0: its other samples wait for nothing now)

    def enqueue(self, seq: Sequence) -> None:
        with self._lock, held_interrupts():  # both or neither: a request the metrics know of is queued
            self.metrics.add_request(seq)
            self.scheduler.add(seq)

    def enqueue_samples(self, samples: list[Sequence]) -> None:
        """Queue a request's samples: sample 0 now, the others once its prompt is computed (after the step that
        samples its first token, `queue_held_samples`), so that they find its full prompt blocks in the prefix
        cache. Queued together they would all prefill the prompt: blocks are published when their step ends. (A
        sample of another cache salt could never read those blocks: it is queued now.)"""
        with self._lock, held_interrupts():
            for seq in [samples[0], *self.output_processor.hold(samples)]:  # (and those that wait for nothing)
                self.enqueue(seq)

    def queue_held_samples(self) -> None:
        """Queue the held samples whose sample 0 has computed its prompt (or finished: then there is nothing to
        wait for), once the streams closed in the middle of a step (`OutputProcessor.abandoned`) are aborted."""
        while self.output_processor.abandoned:
            self.abort_request(self.output_processor.abandoned.pop(0))
        for seq in self.output_processor.ready_samples():
            self.enqueue(seq)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], StepRecord]:
        """One forward pass. Returns (sequences finished in it, the step's record). When it raises, the requests it
        scheduled are aborted (see the class docstring); step() again serves the others."""
        with self._lock, held_interrupts():
            if self.scheduler.is_finished():
                raise RuntimeError("step() found no request waiting or running: add one with add_request() first")
            # this step runs the forward of the caller's `seams.use` block (if any): the prefix cache keeps it apart
            self.scheduler.block_manager.use_forward(seams.forward_key())
            try:
                finished, record = self.step_loop.step()
            except BaseException:
                self.abort_step()
                raise
            self.queue_held_samples()
            return finished, record

    def abort_step(self) -> None:
        """The step being run raised: abort the requests it scheduled (kept in `failed`)."""
        self.failed = [seq for seq in dict.fromkeys(self.step_loop.in_step()) if not seq.is_finished]
        for seq in self.failed:
            self.abort_request(seq)

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (after an error or an interrupt)."""
        with self._lock, held_interrupts():
            self.metrics.forget([*self.scheduler.running, *self.scheduler.waiting])
            self.scheduler.abort_all()
            for seq in self.output_processor.drop_held():
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"

    def close(self) -> None:
        """Stop the model runner's worker processes (if any): an engine with workers refuses every call after this;
        with one device there is nothing to stop, and the engine still serves. Also runs at interpreter exit
        and when the engine is garbage-collected."""
        with self._lock:
            self.abort_all()
            self.model_runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self.output_processor.held_samples

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        return_metrics: bool = False,
        request_options: list[dict] | None = None,
    ) -> list[GenerateOutput]:
        """Generate for every prompt; returns, in input order, dicts with "text", "token_ids" and "finish_reason"
        ("stop": EOS or a stop string; "length": max_tokens or max_model_len); with stop strings also
        "stop_reason" (the stop string that matched, or None). With n > 1 these are sample 0's, and "outputs"
        lists every sample's ("index", "text", "token_ids", "finish_reason"[, "stop_reason"]). Each dict also reads
        as vLLM's RequestOutput (`GenerateOutput`: `out.outputs[0].text`, `out.prompt`, `out.prompt_token_ids`).

        use_tqdm: show a progress bar; a callable (vLLM's: `functools.partial(tqdm, leave=False)`) makes the bar.
        return_metrics: each dict also gets "metrics", the request's `RequestMetrics`. Either way
        `self.metrics.steps` holds a `StepRecord` per step of this call. request_options: per prompt, more keyword
        arguments of a subclass's make_samples.
        """
        prompts = prompt_list(prompts)
        options = request_options or [{}] * len(prompts)
        requests = []  # every request checked before any is queued, so one bad prompt leaves nothing queued
        for index, (prompt, params) in enumerate(zip(prompts, params_list(sampling_params, prompts, self.config))):
            try:
                requests.append(self.make_samples(prompt, params, **options[index]))
            except (ValueError, TypeError) as error:
                raise type(error)(f"prompt {index}: {error}") from None
        # One generate at a time: concurrent callers wait. Ctrl-C is held for the whole call (one handler swap, not
        # one per step): raised in the next forward or learner function, where every request is aborted, or when
        # the call ends; never half-way through queuing or a step's bookkeeping.
        with self._lock, held_interrupts():
            make_bar = use_tqdm if callable(use_tqdm) else partial(tqdm, disable=not use_tqdm)
            bar = make_bar(total=sum(map(len, requests)), desc="Generating", dynamic_ncols=True)  # (may raise: first)
            self.metrics.clear()
            for samples in requests:
                self.enqueue_samples(samples)
            rates = {}  # the latest prefill and decode step's tokens per second
            try:
                while not self.is_finished():
                    finished, record = self.step()
                    rates[record.kind] = f"{record.num_tokens / max(record.elapsed, 1e-9):.0f} tok/s"
                    bar.set_postfix(rates, refresh=False)
                    bar.update(len(finished))
            except BaseException:
                self.abort_all()  # leave a clean engine behind: later calls must not inherit half a batch
                raise
            finally:
                bar.close()
        metrics = self.metrics.requests if return_metrics else None
        outputs = self.output_processor.request_output
        return [outputs(samples, metrics, prompt_text(prompt)) for samples, prompt in zip(requests, prompts)]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """One request's text as it grows, for a notebook: `for piece in llm.stream("Hello", params): print(
        piece.text, end="")`. The iterator drives `step()` itself (other queued requests advance too) and yields a
        `StreamPiece` per sample and step that added tokens or text; a sample's last piece has finished=True. The
        pieces' text concatenates to `generate`'s. The request is checked here (a bad one raises now) and queued at
        the first piece. Closing the stream early aborts the request and frees its blocks: `with llm.stream(...) as
        pieces:` closes it whatever leaves the block (engine/streaming.py's `RequestStream`)."""
        samples = self.make_samples(prompt, params, request_id, stream=True)
        return self._stream(samples)

    def _stream(self, samples: list[Sequence]) -> RequestStream:
        return RequestStream(self, samples)
