"""What the scheduler decided, step by step, and what each request experienced.

The engine records every step cheaply (a few Python objects per step, next to a forward pass):

    outputs = llm.generate(prompts, params, return_metrics=True)
    outputs[0]["metrics"]        # RequestMetrics: ttft, tpot, tokens served from the prefix cache, ...
    llm.metrics.steps            # list[StepRecord]: prefill or decode, who ran, KV blocks, hits, preemptions

`llm.metrics` holds the latest `generate` call; when you drive `add_request` / `step` yourself it
keeps everything since `llm.metrics.clear()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence
from nanoref.utils.tracing import trace_step_index


@dataclass
class StepRecord:
    """One engine step: a single forward pass over the sequences the scheduler picked."""

    index: int  # 0-based, counted from the last clear()
    kind: str  # "prefill" or "decode"
    seqs: list[tuple[int, int]]  # (seq_id, tokens computed for it in this step), in batch order
    num_blocks_used: int  # KV blocks held by sequences while the step runs
    num_blocks_free: int  # the rest (some may still hold prefix-cache content: lazy eviction)
    num_hit_blocks: int  # blocks that this step's admissions took from the prefix cache
    num_hit_tokens: int  # the tokens in them: K/V this step did not have to compute
    preempted: list[int]  # seq_ids preempted while scheduling this step (their K/V was dropped)
    num_waiting: int  # sequences still queued after scheduling
    elapsed: float = 0.0  # wall seconds for the forward pass, sampling and postprocess
    # speculative decoding (nanoref/speculative/), a verify step: the tokens proposed, and how many the target accepted
    # (each sequence also gains one token of the target's own); 0 in other steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.seqs)

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted)

    @property
    def acceptance_rate(self) -> float | None:
        """The share of proposed tokens the target accepted in this step; None when nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Proposed tokens accepted per sequence in this step (each also gained one of the target's); None when
        nothing was proposed."""
        return self.num_accepted_tokens / self.num_seqs if self.num_draft_tokens else None


@dataclass
class RequestMetrics:
    """One finished request, as its user saw it."""

    seq_id: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache when first admitted
    num_preemptions: int  # times its K/V was dropped to make room, then recomputed
    ttft: float  # time to first token: seconds from add_request to the first generated token
    tpot: float | None  # time per output token after the first (mean seconds); None with one output token
    latency: float  # seconds from add_request to the last token
    # speculative decoding: tokens proposed for it, and how many the target accepted (0 and 0 without)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # the verify steps it took part in

    @property
    def acceptance_rate(self) -> float | None:
        """The share of its proposed tokens the target accepted; None when none was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Proposed tokens accepted per verify step it took part in; None when none was proposed."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_draft_tokens else None


@dataclass
class _Pending:
    """What the recorder knows about a request that has not finished yet."""

    arrival: float
    num_cached_tokens: int | None = None  # set at its first step
    first_token: float | None = None
    num_draft_tokens: int = 0  # (a step loop that verifies proposed tokens counts them: `count_verified`)
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0


@dataclass
class EngineMetrics:
    """Collects a StepRecord per step and a RequestMetrics per finished request."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[int, RequestMetrics] = field(default_factory=dict)  # seq_id -> metrics, once finished
    _pending: dict[int, _Pending] = field(default_factory=dict, repr=False)
    _hits_seen: int = field(default=0, repr=False)  # the block manager's hit counter at the last step
    _step_start: float = field(default=0.0, repr=False)
    _first_steps: list[_Pending] = field(default_factory=list, repr=False)  # requests the latest step admitted

    def clear(self) -> None:
        """Forget the records; requests still in flight keep being tracked."""
        self.steps.clear()
        self.requests.clear()
        trace_step_index(0, scheduled=False)

    def add_request(self, seq: Sequence) -> None:
        self._pending[seq.seq_id] = _Pending(arrival=time.perf_counter())

    def begin_step(self, scheduler: Scheduler, seqs: list[Sequence], is_prefill: bool) -> StepRecord:
        """Called right after scheduling: the batch, the blocks and the cache as the forward sees them."""
        manager = scheduler.block_manager
        hits, self._hits_seen = manager.num_hit_blocks - self._hits_seen, manager.num_hit_blocks
        self._first_steps = []
        for seq in seqs:
            pending = self._pending.get(seq.seq_id)
            if pending is not None and pending.num_cached_tokens is None:  # its first step: just admitted
                pending.num_cached_tokens = seq.num_prefix_hit_tokens
                self._first_steps.append(pending)
        record = StepRecord(
            index=len(self.steps),
            kind="prefill" if is_prefill else "decode",
            seqs=[(seq.seq_id, seq.num_scheduled_tokens) for seq in seqs],
            num_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_blocks_free=manager.num_free_blocks,
            num_hit_blocks=hits,
            num_hit_tokens=hits * manager.block_size,
            preempted=list(scheduler.preempted),
            num_waiting=len(scheduler.waiting),
        )
        self.steps.append(record)
        trace_step_index(record.index)  # a trace shows this step under its record's index
        self._step_start = time.perf_counter()
        return record

    def end_step(self, record: StepRecord, seqs: list[Sequence]) -> StepRecord:
        """Called after postprocess: time the step, stamp first tokens, close finished requests."""
        now = time.perf_counter()
        record.elapsed = now - self._step_start
        for seq in seqs:
            pending = self._pending.get(seq.seq_id)
            if pending is None or seq.num_completion_tokens == 0:
                continue  # not tracked, or a prompt chunk that produced no token yet
            if pending.first_token is None:
                pending.first_token = now
            if seq.is_finished:
                del self._pending[seq.seq_id]
                self.requests[seq.seq_id] = request_metrics(seq, pending, now)
        return record

    def count_verified(self, seq: Sequence, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """seq's step checked num_draft_tokens proposed tokens and kept num_accepted_tokens of them."""
        pending = self._pending.get(seq.seq_id)
        if pending is not None:
            pending.num_draft_tokens += num_draft_tokens
            pending.num_accepted_tokens += num_accepted_tokens
            pending.num_verify_steps += 1

    def forget(self, seqs: list[Sequence]) -> None:
        """Stop tracking requests that were aborted."""
        for seq in seqs:
            self._pending.pop(seq.seq_id, None)


def request_metrics(seq: Sequence, pending: _Pending, now: float) -> RequestMetrics:
    num_output = seq.num_completion_tokens
    return RequestMetrics(
        seq_id=seq.seq_id,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=num_output,
        num_cached_tokens=pending.num_cached_tokens or 0,
        num_preemptions=seq.num_preemptions,
        ttft=pending.first_token - pending.arrival,
        tpot=(now - pending.first_token) / (num_output - 1) if num_output > 1 else None,
        latency=now - pending.arrival,
        num_draft_tokens=pending.num_draft_tokens,
        num_accepted_tokens=pending.num_accepted_tokens,
        num_verify_steps=pending.num_verify_steps,
    )
