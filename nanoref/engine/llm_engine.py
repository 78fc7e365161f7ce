"""The engine loop: schedule, run, postprocess, until every request has finished."""

from __future__ import annotations

import numbers
import operator
import os
import sys
import threading
from dataclasses import dataclass

import torch

from nanoref.config import EngineConfig
from nanoref.engine.metrics import EngineMetrics, StepRecord
from nanoref.engine.model_runner import ModelRunner
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence
from nanoref.sampling_params import SamplingParams
from nanoref.utils import seams
from nanoref.utils.interrupts import held_interrupts, interruptibly
from nanoref.utils.loader import load_tokenizer
from nanoref.utils.progress import tqdm


@dataclass
class InFlight:
    """A step queued on the device whose sampled tokens the host has not read yet (the overlapped loop)."""

    seqs: list[Sequence]  # the rows that still count, in batch order
    rows: list[int]  # each one's row in `sampled` (rows of sequences that finished meanwhile are skipped)
    sampled: torch.Tensor  # (rows launched,) int64 token ids, on the device: the next step's input ids
    host: torch.Tensor  # the same ids on their way to the host (pinned memory on CUDA)
    ready: torch.cuda.Event | None  # recorded right behind the copy to `host` (None on a CPU)
    record: StepRecord | None = None

    @classmethod
    def start(cls, seqs: list[Sequence], sampled: torch.Tensor, record: StepRecord | None = None) -> InFlight:
        """Queue the copy of a step's sampled ids to the host right behind the step itself.

        A plain `sampled.tolist()` later would queue its copy behind whatever was launched meanwhile, i.e.
        behind step n+1: the host would wait for both steps and the overlap would be lost. The event marks the
        end of this step's copy alone."""
        if not sampled.is_cuda:
            return cls(seqs, list(range(len(seqs))), sampled, sampled, None, record)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, list(range(len(seqs))), sampled, host, ready, record)

    def token_ids(self) -> list[int]:
        """Wait for the step (and only for it) and read its tokens: the step's one host sync."""
        if self.ready is not None:
            self.ready.synchronize()
        sampled = self.host.tolist()
        return [sampled[row] for row in self.rows]


class LLMEngine:
    """The engine. One `generate` (or `step`) runs at a time: calls from several threads are serialized.

    A step is all or nothing. When it raises, an error or Ctrl-C, the engine is left as if it had not run
    (`Scheduler.unschedule` says exactly what that means for a decode step that preempted), and the next step or
    generate serves on. Ctrl-C is held back while the engine's bookkeeping runs (scheduling, postprocessing,
    metrics, queuing requests) and raised when it is done (utils/interrupts.py); it acts at once in the forward
    pass and in a learner's exercise function, whose step is then undone.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._lock = threading.RLock()  # held by generate, step, add_request and abort_all
        # before the model runner, which may start tensor-parallel workers: a folder that fails fails before them
        self.tokenizer = load_tokenizer(config.model_folder)
        self.model_runner = ModelRunner(config)
        if self.model_runner.rank > 0:  # torchrun: every rank but 0 follows rank 0's steps, then its process ends
            self.model_runner.serve()
            # End here, without the interpreter's teardown: after a model has run, a torchrun follower that
            # exits normally aborts in C++ static destructors about one time in five (seen on this project's
            # CPU machine, torch 2.13), which torchrun reports as a failed rank.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            self._build(config)
        except BaseException:
            self.model_runner.close()  # tensor parallel: stop the workers now, not when the exception is dropped
            raise

    def _build(self, config: EngineConfig) -> None:
        self.vocab_size = config.hf_config.vocab_size
        eos = set(config.hf_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            num_kvcache_blocks=self.model_runner.num_kvcache_blocks,
            kvcache_block_size=config.kvcache_block_size,
            eos_token_ids=eos,
        )
        # the block manager writes each sequence's table into this array's rows; the model runner reads them
        self.model_runner.block_tables = self.scheduler.block_manager.tables
        self.metrics = EngineMetrics()  # step records and per-request metrics (see engine/metrics.py)
        self.in_flight: InFlight | None = None  # the overlapped loop's step on the device, not yet postprocessed

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A prompt as token ids: a string (through the tokenizer), or a sequence of integer ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model_folder} has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray, dict, set, frozenset)) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"a prompt must be a string or a list of integer token ids, got {type(prompt).__name__}")
        if hasattr(prompt, "tolist"):  # a torch tensor or numpy array of ids
            prompt = prompt.tolist()
        try:  # ints of any integer type; 3.0, "3", True or a nested list are errors
            return [_token_id(t) for t in prompt]
        except TypeError:
            raise TypeError("a prompt must be a string or a list of integer token ids") from None

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the problem, for a request the engine could never serve."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {limit}: "
                f"at most {limit - 1} prompt tokens leave room for a generated one"
            )
        longest = min(len(token_ids) + int(params.max_tokens), limit)  # (a NumPy integer could overflow here)
        manager = self.scheduler.block_manager
        if manager.blocks_needed(longest) > manager.num_blocks:
            raise ValueError(
                f"the request needs up to {manager.blocks_needed(longest)} KV blocks ({longest} tokens) but the "
                f"cache has only {manager.num_blocks}: raise num_kvcache_blocks or lower max_tokens"
            )

    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """A checked request, not yet queued: everything that can fail about a request fails here."""
        token_ids = self.tokenize(prompt)
        self.check_request(token_ids, params)
        seq = Sequence(token_ids, params, self.config.kvcache_block_size)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        with self._lock, held_interrupts():  # both or neither: a request the metrics know of is queued
            self.metrics.add_request(seq)
            self.scheduler.add(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Check one request and queue it; a bad request raises and queues nothing."""
        seq = self.make_sequence(prompt, params)
        self.enqueue(seq)
        return seq

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], StepRecord]:
        """One forward pass. Returns (sequences finished in it, the step's record). When it raises, the step did
        not happen (see the class docstring): call step() again to retry it, or abort_all()."""
        with self._lock, held_interrupts():
            if self.scheduler.is_finished():
                raise RuntimeError("step() found no request waiting or running: add one with add_request() first")
            # this step runs the forward of the caller's `seams.use` block (if any): the prefix cache keeps it apart
            self.scheduler.block_manager.use_forward(seams.forward_key())
            if self.config.overlap_scheduling:
                return self._step_overlapped()
            seqs, is_prefill = self.scheduler.schedule()
            record = self.metrics.begin_step(self.scheduler, seqs, is_prefill)
            try:
                token_ids = interruptibly(self.model_runner.run, seqs, is_prefill)
            except BaseException:
                self._undo_step(seqs, is_prefill, record)
                raise
            finished = self.scheduler.postprocess(seqs, token_ids)
            return finished, self.metrics.end_step(record, seqs)

    def _undo_step(self, seqs: list[Sequence], is_prefill: bool, record: StepRecord) -> None:
        """The step just scheduled failed before its postprocess: take back its schedule and its record."""
        self.scheduler.unschedule(seqs, is_prefill)
        self.metrics.drop_step(record)

    def _step_overlapped(self) -> tuple[list[Sequence], StepRecord]:
        """`step` with the host one step ahead of its bookkeeping: completes step n, leaves step n+1 running.

        In the plain `step` the device idles while the host schedules and prepares a step, and the host idles
        while the device runs it. Here, while the device runs step n, the host already schedules and launches
        step n+1, and only then waits for step n's tokens and postprocesses them. Why each piece can run ahead:
        - step n+1's input tokens are step n's sampled ids: they stay on the device (`launch(next_ids=...)`),
          so nothing has to come back to the host before step n+1 can be queued behind step n;
        - its positions, slots and context lengths only need token counts, and every row gains exactly one
          token per decode step, so the host knows them without the values (`Scheduler.schedule_ahead`);
        - the host's token bookkeeping (append, EOS and max_tokens checks, prefix-cache hashes) follows one
          step behind: step n's postprocess runs while step n+1 is on the device;
        - a sequence that samples EOS at step n has a row in step n+1 already; that row's token is dropped
          (`Scheduler.commit_ahead`), and its K/V write lands in a block just freed, before any later step can
          reuse it (device work runs in queue order).
        When step n+1 cannot be decided without step n's tokens (prefills, preemption), the loop waits for step
        n and schedules as usual: those steps run exactly as in the plain loop. On a CPU the "launch" computes
        right away, so nothing overlaps, but every decision is the same: that is how the tests check it.
        Expected gain on a GPU: the ~2 ms of host work per decode step leaves the critical path (not measured).

        When this raises (see the class docstring): a step n launched here is undone like a plain step; once step
        n is in flight it stays so, and step n+1 is dropped (the blocks schedule_ahead reserved for it stay with
        their sequences, which need them next time), so the next call picks step n up again.
        """
        if self.in_flight is None:  # nothing queued: schedule and launch step n the usual way
            seqs, is_prefill = self.scheduler.schedule()
            record = self.metrics.begin_step(self.scheduler, seqs, is_prefill)
            try:
                self.in_flight = InFlight.start(seqs, interruptibly(self.model_runner.launch, seqs, is_prefill), record)
            except BaseException:
                self._undo_step(seqs, is_prefill, record)
                raise
        current = self.in_flight
        # 1. step n+1, scheduled and queued behind step n, its input ids gathered from step n's on the device
        ahead = self.scheduler.schedule_ahead(current.seqs)
        if ahead:
            row_of = {seq.seq_id: row for seq, row in zip(current.seqs, current.rows)}
            rows = [row_of[seq.seq_id] for seq in ahead]
            next_ids = current.sampled
            if rows != list(range(len(current.sampled))):
                next_ids = current.sampled[self.model_runner._tensor(rows, torch.int64)]  # (len(ahead),)
            launched = interruptibly(self.model_runner.launch, ahead, is_prefill=False, next_ids=next_ids)
            next_step = InFlight.start(ahead, launched)
        # 2. step n: wait for its tokens (the step's one host sync) and postprocess them
        finished = self.scheduler.postprocess(current.seqs, interruptibly(current.token_ids))
        record = self.metrics.end_step(current.record, current.seqs)
        # 3. step n+1 stays in flight with the rows that still count
        self.in_flight = None
        if ahead:
            live = self.scheduler.commit_ahead(ahead)
            if live:  # (when every row finished at step n, step n+1's result is simply never read)
                live_ids = {seq.seq_id for seq in live}
                next_step.rows = [row for row, seq in enumerate(ahead) if seq.seq_id in live_ids]
                next_step.seqs = live
                next_step.record = self.metrics.begin_step(self.scheduler, live, False)
                self.in_flight = next_step
        return finished, record

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (after an error or an interrupt)."""
        with self._lock, held_interrupts():
            self.metrics.forget([*self.scheduler.running, *self.scheduler.waiting])
            self.scheduler.abort_all()
            self.in_flight = None  # its sequences are aborted: its tokens are never read

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

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        return_metrics: bool = False,
    ) -> list[dict]:
        """Generate for every prompt; returns, in input order, dicts with "text" and "token_ids".

        return_metrics: each dict also gets "metrics", the request's `RequestMetrics`. Either way
        `self.metrics.steps` holds a `StepRecord` per step of this call.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        # check every request before queuing any, so one bad prompt leaves nothing queued
        seqs = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                seqs.append(self.make_sequence(prompt, params))
            except (ValueError, TypeError) as error:
                raise type(error)(f"prompt {index}: {error}") from None
        # One generate at a time: concurrent callers wait for the engine. Ctrl-C is held for the whole call (one
        # handler swap, not one per step): it is raised in the next forward or learner function, where that
        # step is undone and every request aborted, or when the call ends; never half-way through queuing the
        # requests or through a step's bookkeeping.
        with self._lock, held_interrupts():
            return self._run_to_completion(seqs, use_tqdm, return_metrics)

    def _run_to_completion(self, seqs: list[Sequence], use_tqdm: bool, return_metrics: bool) -> list[dict]:
        self.metrics.clear()
        for seq in seqs:
            self.enqueue(seq)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while not self.is_finished():
                finished, record = self.step()
                tokens_per_second = record.num_tokens / max(record.elapsed, 1e-9)
                if record.kind == "prefill":
                    prefill_tps = tokens_per_second
                else:
                    decode_tps = tokens_per_second
                bar.set_postfix(prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s", refresh=False)
                bar.update(len(finished))
        except BaseException:
            self.abort_all()  # leave a clean engine behind: later calls must not inherit half a batch
            raise
        finally:
            bar.close()
        outputs = []
        for seq in seqs:
            output = {"text": self.decode(seq.completion_token_ids), "token_ids": seq.completion_token_ids}
            if return_metrics:
                output["metrics"] = self.metrics.requests[seq.seq_id]
            outputs.append(output)
        return outputs


def _token_id(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


def _prompt_list(prompts: object) -> list:
    """`generate`'s prompts as a list: a list, tuple, generator, or a 2-D tensor/array of ids."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list: list[str] or list[list[int]] (wrap a single prompt in [])")
    if isinstance(prompts, (dict, set, frozenset)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else list(prompts)
    if prompts and isinstance(prompts[0], numbers.Integral):
        raise TypeError("prompts must be a list: list[str] or list[list[int]] (wrap a single prompt in [])")
    return prompts
