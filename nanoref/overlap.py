"""The overlapped loop: the engine's `step` with the host one step ahead of its bookkeeping.

In the plain `step` the device idles while the host schedules and prepares a step, and the host idles while the
device runs it. Here, while the device runs step n, the host already schedules and launches step n+1, and only then
waits for step n's tokens and postprocesses them. Why each piece can run ahead:
- step n+1's input tokens are step n's sampled ids: they stay on the device (`launch(input_ids=...)`), so nothing
  has to come back to the host before step n+1 can be queued behind step n;
- its positions, slots and context lengths only need token counts, and every row gains exactly one token per
  decode step, so the host knows them without the values (`schedule_ahead`);
- the host's token bookkeeping (append, EOS and max_tokens checks, prefix-cache hashes) follows one step behind:
  step n's postprocess runs while step n+1 is on the device;
- a sequence that samples EOS at step n has a row in step n+1 already; that row's token is dropped
  (`commit_ahead`), and its K/V write lands in a block just freed, before any later step can reuse it
  (device work runs in queue order).
When step n+1 cannot be decided without step n's tokens (prefills, preemption), the loop waits for step n and
schedules as usual: those steps run exactly as in the plain loop. On a CPU the "launch" computes right away, so
nothing overlaps, but every decision is the same: that is how the tests check it. Measured on one H200: the host's
~1-2 ms per decode step leaves the critical path (benchmarks/results/).

When a step raises (see `LLMEngine`), the requests of both steps in flight are aborted (`in_step`).

Given to the engine by `nanoref/llm.py` as its step loop (`OverlappedLoop`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoref.engine.metrics import StepRecord
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence
from nanoref.utils.interrupts import interruptibly


@dataclass
class InFlight:
    """A step queued on the device whose sampled tokens the host has not read yet."""

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
        rows = list(range(len(seqs)))
        if not sampled.is_cuda:
            return cls(seqs, rows, sampled, sampled, None, record)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, rows, sampled, host, ready, record)

    def token_ids(self) -> list[int]:
        """Wait for the step (and only for it) and read its tokens: the step's one host sync."""
        if self.ready is not None:
            self.ready.synchronize()
        sampled = self.host.tolist()
        return [sampled[row] for row in self.rows]

    def input_ids_for(self, ahead: list[Sequence]) -> torch.Tensor:
        """The next step's input ids, (len(ahead),) on the device: this step's sampled ids of those rows."""
        row_of = {seq.seq_id: row for seq, row in zip(self.seqs, self.rows)}
        rows = [row_of[seq.seq_id] for seq in ahead]
        if rows == list(range(len(self.sampled))):
            return self.sampled
        index = torch.tensor(rows)
        if self.sampled.is_cuda:  # a pageable copy would wait for the device, i.e. for step n: no overlap left
            index = index.pin_memory().to(self.sampled.device, non_blocking=True)
        return self.sampled[index]


def schedule_ahead(scheduler: Scheduler, in_flight: list[Sequence]) -> list[Sequence]:
    """The decode step after the one in flight, chosen before that step's sampled tokens are known.

    Every sequence in flight gets one more token, but its value is still on the device, so the host's view of each
    sequence is one token behind: a row's new token will sit at position seq.num_tokens (not num_tokens - 1).
    Returns [] when the next step cannot be decided without those tokens; the loop then waits for them and calls
    schedule() as usual. That is the case when:
    - a sequence is waiting: the next step is a prefill (new, chunked or preempted requests);
    - a running sequence is not in flight, or one in flight is mid-prompt;
    - the blocks for every row do not fit: schedule() may have to preempt, which needs finished sequences
      gone first (this keeps preemption decisions the same as the plain loop's);
    - a sequence in flight asks for penalties, bad words of several tokens, logprobs or structured output:
      penalties, a bad word's earlier tokens and a grammar's matcher read the token values, and logprobs are read
      back per step (min_tokens needs only the count, which the host knows: it overlaps; so does a one-token bad
      word, a mask that reads no token).
    A sequence whose token count alone ends it (max_tokens, max_model_len) gets no row. One that will sample
    EOS cannot be known here: it gets a row, and the loop drops that row's token (`commit_ahead`).
    """
    if scheduler.waiting or len(scheduler.running) != len(in_flight):
        return []
    if any(seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens for seq in in_flight):
        return []  # a prompt chunk samples no token: there is nothing to feed forward
    if any(
        seq.sampling_params.has_penalties
        or (seq.sampling_params.bad_words and any(len(word) > 1 for word in seq.output.bad_words_ids))
        or seq.sampling_params.logprobs is not None
        or seq.sampling_params.structured_outputs is not None
        for seq in in_flight
    ):
        return []
    ahead = [seq for seq in in_flight if not ends_by_count(scheduler, seq)]
    manager = scheduler.block_manager
    needed = sum(manager.blocks_to_append(seq, seq.num_tokens + 1) for seq in ahead)
    if not ahead or needed > manager.num_free_blocks:
        return []
    for seq in ahead:  # room for the K/V of the token in flight, at position seq.num_tokens
        manager.may_append(seq, seq.num_tokens + 1)
    scheduler.preempted = []
    return ahead


def ends_by_count(scheduler: Scheduler, seq: Sequence) -> bool:
    """Whether seq reaches its length limit (max_tokens or max_model_len) with the token in flight."""
    return (
        seq.num_completion_tokens + 1 >= seq.sampling_params.max_tokens or seq.num_tokens + 1 >= scheduler.max_model_len
    )


def commit_ahead(ahead: list[Sequence]) -> list[Sequence]:
    """After the step before it has been postprocessed: the rows of a step scheduled ahead that still count.

    A sequence that finished in that step (EOS) already left `running` with its blocks; its row was computed
    anyway and its token must never be emitted. The others now hold their one scheduled token.
    """
    live = [seq for seq in ahead if not seq.is_finished]
    for seq in live:
        seq.num_scheduled_tokens = 1
    return live


class OverlappedLoop:
    """The step loop of an engine whose overlap_scheduling is on: completes step n, leaves step n+1 running."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._in_flight: InFlight | None = None
        self.ahead: list[Sequence] = []  # step n+1's rows while step n is postprocessed

    @property
    def in_flight(self) -> InFlight | None:
        """The step on the device, not yet postprocessed. Its sequences finish in its own postprocess, or between
        steps when aborted (`abort_request`, `abort_all`): their rows' tokens are never read, and a step left with
        no row is dropped."""
        step = self._in_flight
        if step is not None and any(seq.is_finished for seq in step.seqs):
            kept = [(seq, row) for seq, row in zip(step.seqs, step.rows) if not seq.is_finished]
            step.seqs, step.rows = [seq for seq, _ in kept], [row for _, row in kept]
            if not kept:
                self._in_flight = None
        return self._in_flight

    @in_flight.setter
    def in_flight(self, step: InFlight | None) -> None:
        self._in_flight = step

    def schedule_ahead(self, in_flight: list[Sequence]) -> list[Sequence]:
        return schedule_ahead(self.engine.scheduler, in_flight)

    def commit_ahead(self, ahead: list[Sequence]) -> list[Sequence]:
        return commit_ahead(ahead)

    def in_step(self) -> list[Sequence]:
        """What a failing step aborts: the rows of both steps in flight, and of the one being scheduled."""
        current = self._in_flight
        return [*self.engine.scheduler.scheduled, *(current.seqs if current else []), *self.ahead]

    def step(self, launch_ahead: bool = True) -> tuple[list[Sequence], StepRecord]:
        """launch_ahead=False: complete the step in flight (or one step) and leave none on the device (a step loop
        that runs the next step its own way)."""
        engine = self.engine
        scheduler, metrics, runner = engine.scheduler, engine.metrics, engine.model_runner
        self.ahead = []
        if self.in_flight is None:  # nothing queued: schedule and launch step n the usual way
            seqs, is_prefill = scheduler.schedule()
            record = metrics.begin_step(scheduler, seqs, is_prefill)
            self.in_flight = InFlight.start(seqs, interruptibly(runner.launch, seqs, is_prefill), record)
        scheduler.scheduled = []
        current = self.in_flight
        # 1. step n+1, scheduled and queued behind step n, its input ids gathered from step n's on the device
        ahead = self.ahead = self.schedule_ahead(current.seqs) if launch_ahead else []
        if ahead:
            next_ids = current.input_ids_for(ahead)
            next_step = InFlight.start(ahead, interruptibly(runner.launch, ahead, False, next_ids))
        # 2. step n: wait for its tokens (the step's one host sync) and postprocess them
        finished = scheduler.postprocess(current.seqs, interruptibly(current.token_ids))
        record = metrics.end_step(current.record, current.seqs)
        # 3. step n+1 stays in flight with the rows that still count
        self.in_flight = None
        live = self.commit_ahead(ahead) if ahead else []
        if live:  # (when every row finished at step n, step n+1's result is simply never read)
            live_ids = {seq.seq_id for seq in live}
            next_step.rows = [row for row, seq in enumerate(ahead) if seq.seq_id in live_ids]
            next_step.seqs = live
            next_step.record = metrics.begin_step(scheduler, live, False)
            self.in_flight = next_step
        self.ahead = []
        return finished, record
