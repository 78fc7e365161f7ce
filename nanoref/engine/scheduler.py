"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step is either a prefill step or a decode step (never both), as in Nano-vLLM:
- prefill: admit waiting sequences while the token budget (`max_num_batched_tokens`), the sequence
  budget (`max_num_seqs`) and the free KV blocks allow. A prompt larger than what is left of the
  token budget is cut into chunks (chunked prefill): it stays at the head of the queue, holding its
  blocks, and the next step continues it.
- decode: every running sequence gets one token. When the KV blocks run out, the newest running
  sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
  recomputed later (often largely from the prefix cache).

A schedule is all or nothing. The decision is made first, reading the queues and counting blocks, and applied
after, so a learner's exercise function that raises (or returns a wrong victim) leaves the scheduler as it was;
the prefill admissions allocated while deciding are given back. `unschedule` takes back an applied schedule whose
step failed. The engine runs all of this with Ctrl-C held (utils/interrupts.py): an interrupt can land only
while a cached-prefix lookup or a victim choice runs (through `interruptibly`: a learner's may never return),
and there it is undone like an error.
"""

from __future__ import annotations

from collections import deque

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
        self.admitted: list[Sequence] = []  # sequences the latest schedule() allocated blocks to (see unschedule)
        # decode: room for this many K/V slots past each sequence's last token (speculative decoding's proposed
        # tokens, nanoref/spec/; 0 in the plain loop)
        self.num_lookahead_tokens = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences to run, is_prefill). Each gets `num_scheduled_tokens` set. Raises changing nothing."""
        self.preempted = []
        self.admitted = []
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        scheduled = self._schedule_decode()
        assert scheduled, "nothing could be scheduled"
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        try:
            for seq in self.waiting:  # only read here: the queue changes once the batch is decided
                if budget <= 0:
                    break
                if not seq.block_table:  # not started yet: needs a slot in the batch and its blocks
                    if len(self.running) + len(scheduled) >= self.max_num_seqs:  # (all scheduled so far join it)
                        break
                    if not interruptibly(self.block_manager.can_allocate, seq):  # (a learner's lookup, maybe)
                        break
                    self.block_manager.allocate(seq)
                    self.admitted.append(seq)
                chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
                seq.num_scheduled_tokens = chunk
                budget -= chunk
                scheduled.append(seq)
                if seq.num_computed_tokens + chunk < seq.num_tokens:
                    break  # a chunk of a longer prompt: it stays first in line for the next step
        except BaseException:  # a learner's find_cached_prefix raised, or Ctrl-C in it: give back what was taken
            self.unschedule(scheduled, is_prefill=True)
            raise
        for seq in scheduled:  # the whole prompts leave the queue; a partial chunk stays first
            if seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        """One token for every running sequence (up to max_num_seqs), preempting where the blocks run out.

        Decided by `_plan_decode`, which changes nothing, then applied in the order it was decided (so the blocks
        each sequence gets are the ones a loop that preempts as it goes would give)."""
        steps, rest = self._plan_decode()
        scheduled: list[Sequence] = []
        for seq, new_blocks in steps:
            if new_blocks is None:
                self.preempt(seq)
                continue
            if new_blocks:
                self.block_manager.may_append(seq, self._lookahead_end(seq))
            seq.num_scheduled_tokens = 1
            scheduled.append(seq)
        self.running.clear()
        self.running.extend(scheduled)
        self.running.extend(rest)
        return scheduled

    def _plan_decode(self) -> tuple[list[tuple[Sequence, int | None]], list[Sequence]]:
        """The decode step's decisions, without acting on them: ([(seq, the new blocks it gets, or None to preempt
        it) in order], the running sequences left for a later step). Blocks are counted instead of freed: a
        preempted sequence frees the blocks no other sequence holds (`released` counts the references the
        planned preemptions drop).

        The victim function (a learner's, in the exercises) is checked: it must return seq or one of the running
        sequences it was given; anything else raises ValueError with nothing changed."""
        manager = self.block_manager
        queue = deque(self.running)
        free = manager.num_free_blocks
        released: dict[int, int] = {}
        steps: list[tuple[Sequence, int | None]] = []
        num_scheduled = 0

        def release(preempted: Sequence) -> int:
            """The blocks that become free when `preempted` gives its table back (after the planned ones)."""
            freed = 0
            for block_id in preempted.block_table:
                released[block_id] = released.get(block_id, 0) + 1
                freed += released[block_id] == manager.blocks[block_id].ref_count  # its last holder lets go
            return freed

        while queue and num_scheduled < self.max_num_seqs:
            seq = queue.popleft()
            needed = manager.blocks_to_append(seq, self._lookahead_end(seq))
            while free < needed:  # can_append, counting the blocks planned so far
                victim = interruptibly(seam("choose_preemption_victim", choose_preemption_victim), list(queue), seq)
                if victim is seq:  # seq steps back itself: the sequences after it may use its blocks
                    free += release(seq)
                    steps.append((seq, None))
                    break
                if victim not in queue:
                    raise ValueError(f"the preemption victim {victim!r} is neither running nor {seq!r}")
                queue.remove(victim)
                free += release(victim)
                steps.append((victim, None))
            else:
                free -= needed
                steps.append((seq, needed))
                num_scheduled += 1
        return steps, list(queue)

    def _lookahead_end(self, seq: Sequence) -> int:
        """The tokens seq's blocks must hold for its decode step: its own, plus the lookahead (never past its own
        end, prompt + max_tokens, nor max_model_len: no sequence reaches either)."""
        end = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        return min(seq.num_tokens + self.num_lookahead_tokens, self.max_model_len, end)

    def schedule_ahead(self, in_flight: list[Sequence]) -> list[Sequence]:
        """The decode step after the one in flight, chosen before that step's sampled tokens are known.

        For the overlapped loop (fast/overlap.py). Every sequence in flight gets one more token, but its value is
        still on the device, so the host's view of each sequence is one token behind: a row's new token will sit
        at position seq.num_tokens (not num_tokens - 1). Returns [] when the next step cannot be decided without
        those tokens; the engine then waits for them and calls schedule() as usual. That is the case when:
        - a sequence is waiting: the next step is a prefill (new, chunked or preempted requests);
        - a running sequence is not in flight, or one in flight is mid-prompt;
        - the blocks for every row do not fit: schedule() may have to preempt, which needs finished sequences
          gone first (this keeps preemption decisions the same as the plain loop's);
        - a sequence in flight asks for penalties or logprobs: penalties read the token values, and logprobs are
          read back per step (min_tokens needs only the count, which the host knows: it overlaps).
        A sequence whose token count alone ends it (max_tokens, max_model_len) gets no row. One that will sample
        EOS cannot be known here: it gets a row, and the engine drops that row's token (`commit_ahead`).
        """
        if self.waiting or len(self.running) != len(in_flight):
            return []
        if any(seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens for seq in in_flight):
            return []  # a prompt chunk samples no token: there is nothing to feed forward
        if any(seq.sampling_params.has_penalties or seq.sampling_params.logprobs is not None for seq in in_flight):
            return []
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

    def unschedule(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Take back the latest schedule() = (seqs, is_prefill): its step failed (an error, or Ctrl-C in the forward)
        before postprocess. Afterwards the next schedule() decides the step again.

        No token stays scheduled. A prefill's admissions are undone: the sequences it moved to `running` go back
        to the head of `waiting` in their order, and the blocks it allocated go back to the free list. A forward
        that ran part way only wrote into blocks taken fresh, which carry no prefix-cache hash (nothing can hit
        what it wrote); the cached blocks it shared were only read. A sequence whose earlier chunks ran keeps
        its blocks and its place at the head of `waiting`. A decode step's decisions stand: its preempted
        sequences wait to be recomputed, as after any preemption (the blocks they gave up may hold this step's
        writes already), and the blocks it appended stay with their sequences, which need them for the same
        token next time.
        """
        for seq in seqs:
            seq.num_scheduled_tokens = 0
        if not is_prefill:
            return
        for seq in reversed(seqs):
            if seq.status is SequenceStatus.RUNNING:  # moved by this step: it is at the end of `running`
                assert self.running[-1] is seq, f"{seq} is not where this step put it"
                self.running.pop()
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
        for seq in reversed(self.admitted):
            self.block_manager.unallocate(seq)
        self.admitted = []

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
            seq.append_token(token_id)
            reason = self.finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """Why seq ends with the token it just appended: "stop" or "length"; None: it goes on. The stop_token_ids
        entry or stop string that ended it is kept as `seq.stop_reason`. While seq is short of its min_tokens, no
        token stops it (the sampler also masks EOS and the stop ids)."""
        params = seq.sampling_params
        if seq.num_completion_tokens > params.min_tokens:  # (this token is number num_completion_tokens)
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        # stop strings count from min_tokens on, as in vLLM (find_stop looks only at the text this token brought)
        if seq.num_completion_tokens >= params.min_tokens and seq.detokenizer is not None:
            if seq.detokenizer.find_stop() is not None:  # its text cut before it
                seq.stop_reason = seq.detokenizer.stop_reason
                return "stop"
        if self._ends_by_count(seq, new_tokens=0):
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """seq is done (a running sequence, or any unfinished one for "abort"): its blocks go back now."""
        if seq.block_table:  # (a waiting sequence holds none unless a chunk of its prompt has run)
            self.block_manager.deallocate(seq)
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
