"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is either a prefill step or a decode step (never both), as in Nano-vLLM:
- prefill: admit waiting sequences while the token budget (`max_num_batched_tokens`), the sequence
  budget (`max_num_seqs`) and the free KV blocks allow. A prompt larger than what is left of the
  token budget is cut into chunks (chunked prefill): it stays at the head of the queue, holding its
  blocks, and the next step continues it.
- decode: every running sequence gets one token. When the KV blocks run out, the newest running
  sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
  recomputed later (often largely from the prefix cache).

A step that fails (an error, or Ctrl-C in the forward or in a learner's exercise function) is not undone: the
engine aborts the sequences it scheduled (`scheduled`, which holds the one being decided too), and serves the
others on. Scheduling keeps the queues whole while it runs, so that abort finds every sequence where it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from nanoref.engine.block_manager import BlockManager
from nanoref.engine.sequence import Sequence, SequenceStatus
from nanoref.utils.interrupts import interruptibly
from nanoref.utils.seams import seam


def choose_preemption_victim(running: list[Sequence], seq: Sequence) -> Sequence:
    """The sequence to preempt when `seq` needs a new block for its next token and none is free.

    running: the running sequences still waiting for their token in this decode step, oldest first (seq and those
    already scheduled are not in it). The newest gives its blocks back: it has the least work to lose, and the
    oldest requests finish first. When none is left, seq itself steps back.
    """
    return running[-1] if running else seq


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kvcache_blocks: int,
        kvcache_block_size: int,
        eos_token_ids: set[int],
        num_lookahead_tokens: int = 0,
        on_token: Callable[[Sequence], bool] = lambda seq: False,
        can_admit: Callable[..., bool] = lambda seq, running, scheduled: True,
    ) -> None:
        """num_lookahead_tokens: decode reserves K/V slots for this many tokens past each sequence's last one (a
        step loop that computes several tokens per sequence; 0: the plain loop). on_token(seq): called after each
        appended token (the output stage's), -> whether that token ends seq (a stop string). can_admit(seq, running,
        scheduled): whether a waiting seq may start beside them (see EngineHooks)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.preempted: list[int] = []  # seq_ids preempted by the latest schedule() (for step records)
        self.scheduled: list[Sequence] = []  # the latest schedule()'s sequences (while it runs: so far, and the next)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.on_token = on_token
        self.can_admit = can_admit

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences to run, is_prefill). Each gets `num_scheduled_tokens` set."""
        self.preempted = []
        self.scheduled = []
        if scheduled := self._schedule_prefill():
            return scheduled, True
        scheduled = self._schedule_decode()
        assert scheduled, "nothing could be scheduled"
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled = self.scheduled
        budget = self.max_num_batched_tokens
        for seq in self.waiting:  # only read here: the queue changes once the batch is decided
            if budget <= 0:
                break
            scheduled.append(seq)  # (before the lookup: a failing lookup's sequence is aborted with the batch)
            if not seq.block_table:  # not started yet: needs a slot in the batch, its blocks, and leave to join
                fits = len(self.running) + len(scheduled) <= self.max_num_seqs
                if not fits or not interruptibly(self.block_manager.can_allocate, seq):  # (a learner's lookup, maybe)
                    scheduled.pop()
                    break
                if not self.can_admit(seq, self.running, scheduled):  # (as vLLM: it keeps its place, the next may go)
                    scheduled.pop()
                    continue
                self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= chunk
            if seq.num_computed_tokens + chunk < seq.num_tokens:
                break  # a chunk of a longer prompt: it stays first in line for the next step
        for seq in scheduled:  # the whole prompts leave the queue; a partial chunk stays in line
            self.waiting.remove(seq)  # (the first, unless a sequence not admitted stays before it)
            if seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                # first in line, ahead of any not admitted: it holds its blocks, and must not wait behind one that
                # waits for blocks, nor have another admitted beside it without counting it (can_admit)
                self.waiting.appendleft(seq)
                break
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        """One token for every running sequence (up to max_num_seqs), oldest first, preempting the newest where the
        blocks run out. The victim function (a learner's, in the exercises) must return seq or one of the running
        sequences it was given; anything else raises ValueError."""
        scheduled, queue = self.scheduled, self.running
        try:
            while queue and len(scheduled) < self.max_num_seqs:
                seq = queue.popleft()
                scheduled.append(seq)
                end = self._lookahead_end(seq)
                while not self.block_manager.can_append(seq, end):
                    victim = interruptibly(seam("choose_preemption_victim", choose_preemption_victim), list(queue), seq)
                    if victim is not seq and victim not in queue:
                        raise ValueError(f"the preemption victim {victim!r} is neither running nor {seq!r}")
                    if victim is seq:  # seq steps back itself: the sequences after it may use its blocks
                        scheduled.pop()
                        self.preempt(seq)
                        break
                    queue.remove(victim)
                    self.preempt(victim)
                else:
                    self.block_manager.may_append(seq, end)
                    seq.num_scheduled_tokens = 1
        finally:  # (also when a victim choice raised: the queue stays whole for the abort)
            queue.extendleft(reversed(scheduled))
        return scheduled

    def _lookahead_end(self, seq: Sequence) -> int:
        """The tokens seq's blocks must hold for its decode step: its own, plus the lookahead (never past its own
        end, prompt + max_tokens, nor max_model_len: no sequence reaches either)."""
        end = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        return min(seq.num_tokens + self.num_lookahead_tokens, self.max_model_len, end)

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the K/V, requeue first; generated tokens are kept."""
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq.seq_id)
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def abort_all(self) -> None:
        for seq in [*self.running, *self.waiting]:
            self.finish(seq, "abort")

    # -- after the forward --------------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Advance each sequence by what the step computed; append sampled tokens; finish sequences.

        Returns the sequences that finished in this step.
        """
        finished: list[Sequence] = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.commit(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # mid-prompt chunk: its logits predict nothing anyone asked for
            if self.append(seq, token_id):
                finished.append(seq)
        return finished

    def append(self, seq: Sequence, token_id: int) -> bool:
        """Append a sampled token to seq -> whether it finished seq (then it is finished: its blocks are back)."""
        seq.append_token(token_id)
        reason = self.finish_reason(seq, token_id, stopped=self.on_token(seq))
        if reason is not None:
            self.finish(seq, reason)
        return reason is not None

    def finish_reason(self, seq: Sequence, token_id: int, stopped: bool = False) -> str | None:
        """Why seq ends with the token it just appended: "stop" or "length"; None: it goes on. The stop_token_ids
        entry that ended it is kept as `seq.stop_reason`. While seq is short of its min_tokens, no token stops it
        (the sampler also masks EOS and the stop ids). stopped: the output stage found a stop string (which then stays
        `seq.stop_reason` where the token is also a stop id, as in vLLM) or the request's grammar is complete."""
        params = seq.sampling_params
        if seq.num_completion_tokens > params.min_tokens:  # (this token is number num_completion_tokens)
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in params.stop_token_ids:
                seq.stop_reason = seq.stop_reason if stopped and seq.stop_reason is not None else token_id
                return "stop"
        if stopped:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """seq is done (a running sequence, or any unfinished one for "abort"): its blocks go back now."""
        if seq.block_table:  # (a waiting sequence holds none unless a chunk of its prompt has run)
            self.block_manager.deallocate(seq)
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
