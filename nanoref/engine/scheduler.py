"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is either a prefill step or a decode step (never both), as in Nano-vLLM:
- prefill: admit waiting sequences while the token budget (`max_num_batched_tokens`), the sequence
  budget (`max_num_seqs`) and the free KV blocks allow. A prompt larger than what is left of the
  token budget is cut into chunks (chunked prefill): it stays at the head of the queue, holding its
  blocks, and the next step continues it.
- decode: every running sequence gets one token. When the KV blocks run out, the newest running
  sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
  recomputed later (often largely from the prefix cache).
"""

from __future__ import annotations

from collections import deque

from nanoref.engine.block_manager import BlockManager
from nanoref.engine.sequence import Sequence, SequenceStatus
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
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.preempted: list[int] = []  # seq_ids preempted by the latest schedule() (for step records)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences to run, is_prefill). Each gets `num_scheduled_tokens` set."""
        self.preempted = []
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        scheduled = self._schedule_decode()
        assert scheduled, "nothing could be scheduled"
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:  # not started yet: needs a slot in the batch and its blocks
                if len(self.running) >= self.max_num_seqs:  # (what this step scheduled is in running already)
                    break
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.num_scheduled_tokens = chunk
            budget -= chunk
            scheduled.append(seq)
            if seq.num_computed_tokens + chunk < seq.num_tokens:
                break  # a chunk of a longer prompt: it stays first in line for the next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                victim = seam("choose_preemption_victim", choose_preemption_victim)(list(self.running), seq)
                if victim is seq:
                    self.preempt(seq)
                    break
                if victim not in self.running:
                    raise ValueError(f"the preemption victim {victim!r} is neither running nor {seq!r}")
                self.running.remove(victim)
                self.preempt(victim)
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def schedule_ahead(self, in_flight: list[Sequence]) -> list[Sequence]:
        """The decode step after the one in flight, chosen before that step's sampled tokens are known.

        For the overlapped loop (llm_engine.py). Every sequence in flight gets one more token, but its value is
        still on the device, so the host's view of each sequence is one token behind: a row's new token will sit
        at position seq.num_tokens (not num_tokens - 1). Returns [] when the next step cannot be decided without
        those tokens; the engine then waits for them and calls schedule() as usual. That is the case when:
        - a sequence is waiting: the next step is a prefill (new, chunked or preempted requests);
        - a running sequence is not in flight, or one in flight is mid-prompt;
        - the blocks for every row do not fit: schedule() may have to preempt, which needs finished sequences
          gone first (this keeps preemption decisions the same as the plain loop's).
        A sequence whose token count alone ends it (max_tokens, max_model_len) gets no row. One that will sample
        EOS cannot be known here: it gets a row, and the engine drops that row's token (`commit_ahead`).
        """
        if self.waiting or len(self.running) != len(in_flight):
            return []
        if any(seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens for seq in in_flight):
            return []  # a prompt chunk samples no token: there is nothing to feed forward
        ahead = [seq for seq in in_flight if not self._ends_by_count(seq)]
        manager = self.block_manager
        needed = sum(manager.blocks_needed(seq.num_tokens + 1) - len(seq.block_table) for seq in ahead)
        if not ahead or needed > manager.num_free_blocks:
            return []
        for seq in ahead:  # room for the K/V of the token in flight, at position seq.num_tokens
            manager.may_append(seq, seq.num_tokens + 1)
        self.preempted = []
        return ahead

    def _ends_by_count(self, seq: Sequence, new_tokens: int = 1) -> bool:
        """Whether seq is at its length limit (max_tokens or max_model_len) once `new_tokens` more tokens are
        appended: 0 for the tokens it holds (postprocess), 1 for a token still in flight (schedule_ahead)."""
        return (
            seq.num_completion_tokens + new_tokens >= seq.sampling_params.max_tokens
            or seq.num_tokens + new_tokens >= self.max_model_len
        )

    def commit_ahead(self, ahead: list[Sequence]) -> list[Sequence]:
        """After the step before it has been postprocessed: the rows of a step scheduled ahead that still count.

        A sequence that finished in that step (EOS) already left `running` with its blocks; its row was computed
        anyway and its token must never be emitted. The others now hold their one scheduled token.
        """
        live = [seq for seq in ahead if not seq.is_finished]
        for seq in live:
            seq.num_scheduled_tokens = 1
        return live

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
            if seq.block_table:
                self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()

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
            seq.append_token(token_id)
            eos = not seq.sampling_params.ignore_eos and token_id in self.eos_token_ids
            if eos or self._ends_by_count(seq, new_tokens=0):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
