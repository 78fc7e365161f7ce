"""The engine loop: schedule, run, postprocess, until every request has finished."""

from __future__ import annotations

import threading
from collections.abc import Callable
from itertools import count

import torch

from nanoref.config import EngineConfig
from nanoref.engine.detokenizer import IncrementalDetokenizer, decode
from nanoref.engine.metrics import EngineMetrics, StepRecord
from nanoref.engine.model_runner import ModelRunner
from nanoref.engine.requests import check_request, params_list, prompt_list, tokenize
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence
from nanoref.sampling_params import SamplingParams
from nanoref.utils import seams
from nanoref.utils.interrupts import held_interrupts, interruptibly
from nanoref.utils.loader import load_tokenizer
from nanoref.utils.progress import tqdm


class LLMEngine:
    """The engine. One `generate` (or `step`) runs at a time: calls from several threads are serialized.

    A step is all or nothing. When it raises, an error or Ctrl-C, the engine is left as if it had not run
    (`Scheduler.unschedule` says exactly what that means for a decode step that preempted), and the next step or
    generate serves on. Ctrl-C is held back while the engine's bookkeeping runs (scheduling, postprocessing,
    metrics, queuing requests) and raised when it is done (utils/interrupts.py); it acts at once in the forward
    pass and in a learner's exercise function, whose step is then undone.
    """

    def __init__(self, config: EngineConfig, make_runner: Callable[[EngineConfig], ModelRunner] = ModelRunner) -> None:
        """config: resolved (`EngineConfig.resolved()`); make_runner builds the model runner (nanoref/llm.py's
        attaches CUDA graphs or tensor parallelism)."""
        self._lock = threading.RLock()  # held by generate, step, add_request and the aborts
        # before the model runner, which may start tensor-parallel workers: a folder that fails fails before them
        self.tokenizer = load_tokenizer(config.model_folder)
        self.model_runner = make_runner(config)
        self.config = config = self.model_runner.config  # (with the KV block count the runner measured)
        try:
            eos = set(config.hf_config.eos_token_id)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                eos.add(int(self.tokenizer.eos_token_id))
            self.scheduler = Scheduler(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                num_kvcache_blocks=config.num_kvcache_blocks,
                kvcache_block_size=config.kvcache_block_size,
                eos_token_ids=eos,
            )
        except BaseException:
            self.model_runner.close()  # tensor parallel: stop the workers now, not when the exception is dropped
            raise
        # the block manager writes each sequence's table into this array's rows; the model runner reads them
        self.model_runner.block_tables = self.scheduler.block_manager.tables
        self.metrics = EngineMetrics()  # step records and per-request metrics (see engine/metrics.py)
        self._seq_ids = count()  # this engine's sequence ids: its first request is 0, whatever ran before

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(prompt, self.tokenizer, self.config)

    def make_sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, stream: bool = False
    ) -> Sequence:
        """A checked request, not yet queued: everything that can fail about a request fails here.

        stream: keep `seq.detokenizer.text` up to date after every step (for a caller that shows it as it grows)."""
        token_ids = self.tokenize(prompt)
        check_request(token_ids, params, self.config, self.scheduler.block_manager)
        if stream and self.tokenizer is None:
            raise ValueError(f"{self.config.model_folder} has no tokenizer: a stream of text needs one")
        seq = Sequence(token_ids, params, self.config.kvcache_block_size, seq_id=next(self._seq_ids))
        seq.request_id = request_id
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        if stream:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        return seq

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, stream: bool = False
    ) -> Sequence:
        """Check one request and queue it; a bad request raises and queues nothing. request_id: the caller's name
        for it (kept as `seq.request_id`); stream: see make_sequence."""
        seq = self.make_sequence(prompt, params, request_id, stream)
        self.enqueue(seq)
        return seq

    def abort_request(self, seq: Sequence) -> None:
        """End one request now, between steps: its blocks go back and its finish_reason is "abort" (a finished
        request is left as it is). The other requests run on."""
        with self._lock, held_interrupts():
            if seq.is_finished:
                return
            self.metrics.forget([seq])
            self.scheduler.finish(seq, "abort")

    def enqueue(self, seq: Sequence) -> None:
        with self._lock, held_interrupts():  # both or neither: a request the metrics know of is queued
            self.metrics.add_request(seq)
            self.scheduler.add(seq)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], StepRecord]:
        """One forward pass. Returns (sequences finished in it, the step's record). When it raises, the step did
        not happen (see the class docstring): call step() again to retry it, or abort_all()."""
        with self._lock, held_interrupts():
            if self.scheduler.is_finished():
                raise RuntimeError("step() found no request waiting or running: add one with add_request() first")
            # this step runs the forward of the caller's `seams.use` block (if any): the prefix cache keeps it apart
            self.scheduler.block_manager.use_forward(seams.forward_key())
            return self.run_step()

    def run_step(self) -> tuple[list[Sequence], StepRecord]:
        """The plain loop's step (nanoref/fast/overlap.py's overlapped loop takes its place where it is on)."""
        seqs, is_prefill = self.scheduler.schedule()
        record = self.metrics.begin_step(self.scheduler, seqs, is_prefill)
        try:
            token_ids = interruptibly(self.model_runner.run, seqs, is_prefill)
        except BaseException:
            self.undo_step(seqs, is_prefill, record)
            raise
        finished = self.scheduler.postprocess(seqs, token_ids)
        return finished, self.metrics.end_step(record, seqs)

    def undo_step(self, seqs: list[Sequence], is_prefill: bool, record: StepRecord) -> None:
        """The step just scheduled failed before its postprocess: take back its schedule and its record."""
        self.scheduler.unschedule(seqs, is_prefill)
        self.metrics.drop_step(record)

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (after an error or an interrupt)."""
        with self._lock, held_interrupts():
            self.metrics.forget([*self.scheduler.running, *self.scheduler.waiting])
            self.scheduler.abort_all()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (if any). The engine cannot run after this; with one device
        there is nothing to stop. Also runs at interpreter exit and when the engine is garbage-collected."""
        with self._lock:
            self.abort_all()
            self.model_runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        return_metrics: bool = False,
    ) -> list[dict]:
        """Generate for every prompt; returns, in input order, dicts with "text", "token_ids" and "finish_reason"
        ("stop": EOS; "length": max_tokens or max_model_len).

        return_metrics: each dict also gets "metrics", the request's `RequestMetrics`. Either way
        `self.metrics.steps` holds a `StepRecord` per step of this call.
        """
        prompts = prompt_list(prompts)
        seqs = []  # every request checked before any is queued, so one bad prompt leaves nothing queued
        for index, (prompt, params) in enumerate(zip(prompts, params_list(sampling_params, len(prompts)))):
            try:
                seqs.append(self.make_sequence(prompt, params))
            except (ValueError, TypeError) as error:
                raise type(error)(f"prompt {index}: {error}") from None
        # One generate at a time: concurrent callers wait. Ctrl-C is held for the whole call (one handler swap, not
        # one per step): raised in the next forward or learner function, where that step is undone and every
        # request aborted, or when the call ends; never half-way through queuing or a step's bookkeeping.
        with self._lock, held_interrupts():
            self.metrics.clear()
            for seq in seqs:
                self.enqueue(seq)
            bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
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
        return [self.output(seq, return_metrics) for seq in seqs]

    def output(self, seq: Sequence, with_metrics: bool = False) -> dict:
        """A finished request as `generate` returns it."""
        token_ids = seq.completion_token_ids
        text = None if self.tokenizer is None else decode(self.tokenizer, token_ids)
        output = {"text": text, "token_ids": token_ids, "finish_reason": seq.finish_reason}
        if with_metrics:
            output["metrics"] = self.metrics.requests[seq.seq_id]
        return output
