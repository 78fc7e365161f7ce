"""Who guesses the next k tokens: n-gram prompt lookup in the sequence's own tokens, or a small draft model.

Every proposal is only a guess: the target checks it (`acceptance.py`), so a bad proposer costs speed, never
correctness. What a proposer must get right is the bookkeeping: its proposals for sequence b are token ids of the
target's vocabulary, at most `limits[b]` of them (a sequence near its max_tokens or max_model_len gets fewer).
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

import numpy as np
import torch

from nanoref.engine.block_manager import Block
from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs, decode_arrays, prefill_arrays, prefill_metadata
from nanoref.layers.logits_processors import to_device
from nanoref.layers.sampler import sampling_probs
from nanoref.utils.seams import seam


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: find the sequence's last n tokens earlier in the sequence and propose the (up to) k tokens
    that followed them there, for the longest n in [min_n, max_n] that occurs (its latest occurrence); [] when
    none does. Text that repeats itself (code, a document being quoted, a list) is guessed right for free."""
    # One vectorised comparison finds where the last token occurred before; each such place is then extended
    # backwards while the tokens before it agree with the tail (rarely more than a few steps). Latest place first,
    # so the first that reaches max_n is the answer, and otherwise the first with the longest match.
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = len(tokens)
    max_n = min(max_n, num - 1)
    best_n, best_end = 0, -1
    for end in np.flatnonzero(tokens[: num - 1] == tokens[-1])[::-1].tolist():  # where an earlier n-gram ends
        n = 1
        while n < max_n and end - n >= 0 and token_ids[end - n] == token_ids[num - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return token_ids[best_end + 1 : best_end + 1 + k]  # the tokens after that occurrence


@dataclass
class Proposals:
    """One step's guesses: per sequence its proposed ids; with a draft model also the distributions they were
    drawn from."""

    draft_ids: list[list[int]]
    # (sum of len(draft_ids[b]), V) float32: row i of sequence b is q for its i-th proposal (None: deterministic)
    probs: torch.Tensor | None = None


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int], sample) -> Proposals:
        return Proposals(
            [propose_ngram(seq.token_ids, self.min_n, self.max_n, k) if k else [] for seq, k in zip(seqs, limits)]
        )

    def prefill(self, seqs: list[Sequence], run_draft: bool = True) -> None:
        """Nothing to compute alongside a prefill step: the lookup reads the tokens themselves."""

    def after_prefill(self, seqs: list[Sequence]) -> None:
        pass


def token_filters(params: list, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """sampling_probs' (top_k, top_p, min_p) for rows of these SamplingParams: (R,) each, None where no row uses
    them (from pinned memory: a pageable copy would wait for the forward in flight)."""
    top_k = top_p = min_p = None
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = to_device(np.asarray([p.top_k for p in params], dtype=np.int64), device)
        top_p = to_device(np.asarray([p.top_p for p in params], dtype=np.float32), device)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device(np.asarray([p.min_p for p in params], dtype=np.float32), device)
    return top_k, top_p, min_p


def draft_probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: (B, V), the draft's for one token of each sequence -> (B, V) float32: the distribution each
    sequence's proposal is drawn from, with its request's temperature, top-k, top-p and min-p (as the target's p).
    Rows of greedy requests are one-hot at the argmax. Nothing here waits for the device (the settings go up from pinned
    memory: a pageable copy would wait for the draft's forward), so the k draft steps queue one after another."""
    params = [seq.sampling_params for seq in seqs]
    device = logits.device
    temperatures = to_device(np.asarray([p.temperature for p in params], dtype=np.float32), device)  # (B,)
    probs = sampling_probs(logits, temperatures, *token_filters(params, device))  # (B, V)
    greedy = [p.temperature == 0 for p in params]
    if any(greedy):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(to_device(np.asarray(greedy), device)[:, None], one_hot, probs)
    return probs


@dataclass
class DraftProgress:
    """How far the draft's K/V reaches in one sequence."""

    computed: int  # leading tokens whose draft K/V is in the draft's cache
    preemptions: int  # the sequence's num_preemptions then (a preemption gives its blocks back, draft K/V and all)
    recorded: int = 0  # leading blocks already entered in DraftProposer.valid


class DraftProposer:
    """A small model with the target's vocabulary proposes by decoding k tokens itself.

    Its KV cache has the target's block count and block size and is indexed by the same block tables
    (`SpeculativeRunner`), so sequence b's draft K/V sits in the same slots as its target K/V, and prefix-cache hits
    and preemption apply to both. Its K/V may lag the target's: `progress[seq].computed` counts the tokens with draft
    K/V. A prefill step feeds the draft the step's tokens (and any it missed before them), unless the step loop leaves
    it out (a batch too large to verify: policy.py); a verify step's first draft forward feeds the ones missing
    (usually 1; 2 after a step that accepted all k, whose last proposal the draft never fed itself; a whole context
    after plain steps or a prefill without the draft), then k - 1 decode steps of one token.

    The prefix cache shares blocks by their tokens and the target's K/V: a block a prompt hits may hold no draft K/V
    (filled by a prefill without the draft, or by plain decode steps). So the draft trusts a hit block only if it
    recorded the block after computing all of it (`valid`: block id -> the token list the block held then; a block
    gets a new list whenever it is handed out again or committed, so an entry of an older occupant never matches).
    """

    def __init__(self, runner, blocks: list[Block]) -> None:
        self.runner = runner  # the draft's ModelRunner (its own model and KV cache; the target's block tables)
        self.blocks = blocks  # the block manager's Blocks
        self.progress: WeakKeyDictionary[Sequence, DraftProgress] = WeakKeyDictionary()  # (a finished one just goes)
        self.valid: dict[int, list[int]] = {}  # block id -> block.token_ids when its draft K/V was complete

    def cached_draft_tokens(self, seq: Sequence) -> int:
        """The leading tokens of seq's prefix-cache hit whose blocks hold the draft's K/V."""
        tokens, block_size = 0, self.runner.block_size
        for block_id in seq.block_table[: seq.num_computed_tokens // block_size]:
            if self.valid.get(block_id) is not self.blocks[block_id].token_ids:
                break
            tokens += block_size
        return tokens

    def progress_of(self, seq: Sequence) -> DraftProgress:
        """seq's draft progress; new where the draft has not seen seq since it got its blocks (its first prefill
        chunk, or the first after a preemption): its prefix-cache hit's blocks that hold draft K/V."""
        progress = self.progress.get(seq)
        if progress is None or progress.preemptions != seq.num_preemptions:
            start = self.cached_draft_tokens(seq)
            progress = self.progress[seq] = DraftProgress(start, seq.num_preemptions, start // self.runner.block_size)
        return progress

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], run_draft: bool = True) -> None:
        """The draft's forward over a prefill step's tokens, from wherever each sequence's draft K/V ends (its logits
        are not needed: only its K/V). run_draft=False: the draft sits this step out and catches up later."""
        progress = [self.progress_of(seq) for seq in seqs]
        if run_draft:
            ends = [seq.num_computed_tokens + seq.num_scheduled_tokens for seq in seqs]
            self._feed(seqs, [p.computed for p in progress], ends)
            for p, end in zip(progress, ends):
                p.computed = end

    def after_prefill(self, seqs: list[Sequence]) -> None:
        """A prefill step's blocks are committed: record those the draft computed."""
        for seq in seqs:
            if not seq.is_finished:
                self._record(seq)

    def propose(self, seqs: list[Sequence], limits: list[int], sample) -> Proposals:
        """sample(probs (B, V), seqs) -> ids (B,): draws each row's token from its request's generator.

        The draft's steps queue on the device one after another: step i + 1 reads the ids step i sampled where
        they are, and the proposals come to the host once, at the end (a host round trip per step cost about a
        whole plain decode step each at batch 1 on an H100). The sequences run longest limit first, so those still
        proposing at step i are the batch's first rows."""
        active = sorted(((seq, k) for seq, k in zip(seqs, limits) if k > 0), key=lambda item: -item[1])  # (stable)
        draft_ids: dict[Sequence, list[int]] = {seq: [] for seq in seqs}
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in seqs}
        if active:
            batch = [seq for seq, _ in active]
            depth = active[0][1]  # (the longest limit)
            rows = [sum(k > i for _, k in active) for i in range(depth)]  # sequences still proposing at step i
            logits = self._catch_up(batch)  # (B, V): the draft's guess for each sequence's first proposal
            sampled: list[torch.Tensor] = []  # step i's ids (rows[i],), on the device
            for i, num in enumerate(rows):
                if i:  # feed step i - 1's proposals: position num_tokens - 1 + i, the ids still on the device
                    positions = [seq.num_tokens - 1 + i for seq in batch[:num]]
                    logits = self._decode(batch[:num], sampled[-1][:num], positions)
                q = draft_probabilities(logits, batch[:num])  # (rows[i], V)
                sampled.append(sample(q, batch[:num]))
                for row, seq in enumerate(batch[:num]):
                    probs[seq].append(q[row])
            ids = torch.cat(sampled).tolist()  # the proposals' one host sync
            at = 0
            for num in rows:
                for seq, token in zip(batch[:num], ids[at : at + num]):
                    draft_ids[seq].append(token)
                at += num
        q_rows = [q for seq in seqs for q in probs[seq]]
        return Proposals([draft_ids[seq] for seq in seqs], torch.stack(q_rows) if q_rows else None)

    def after_verify(self, seq: Sequence, first_position: int, num_draft_fed: int) -> None:
        """seq's verify step is done: the draft holds K/V up to position first_position + num_draft_fed - 1 (its
        catch-up ended at the last token; each later draft step fed one proposal), but never past seq's tokens."""
        if num_draft_fed == 0:  # no draft forward ran for it: its lag stays
            return
        self.progress_of(seq).computed = min(first_position + num_draft_fed, seq.num_tokens - 1)
        self._record(seq)

    def _record(self, seq: Sequence) -> None:
        """Enter seq's committed blocks that hold its draft K/V in full in `valid` (once each)."""
        progress, block_size = self.progress_of(seq), self.runner.block_size
        full = min(progress.computed, seq.num_computed_tokens) // block_size
        for block_id in seq.block_table[progress.recorded : full]:
            block = self.blocks[block_id]
            if block.hash != -1:  # (only a committed block can be hit; the others need no entry)
                self.valid[block_id] = block.token_ids
        progress.recorded = max(progress.recorded, full)

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed the draft each sequence's tokens without draft K/V -> (B, V) logits at its last token.

        Usually 1 or 2 tokens each: then as that many decode steps (a sequence with fewer joins the later ones,
        so every sequence's last token is in the last step), which replay the draft's CUDA graphs; a longer lag
        (after plain steps, or a prefill without the draft) as varlen steps."""
        starts = [self.progress_of(seq).computed for seq in seqs]
        lags = [seq.num_tokens - start for seq, start in zip(seqs, starts)]
        depth = max(lags)
        if depth > 2:
            return self._feed(seqs, starts, [seq.num_tokens for seq in seqs])
        for step in range(depth):
            part = [seq for seq, lag in zip(seqs, lags) if lag >= depth - step]
            positions = [seq.num_tokens - depth + step for seq in part]
            logits = self._decode(part, [seq.token_ids[pos] for seq, pos in zip(part, positions)], positions)
        return logits

    def _feed(self, seqs: list[Sequence], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Draft forwards over each sequence's tokens [start, end) on the varlen path, at most the engine's
        max_num_batched_tokens per forward (a long catch-up runs in chunks, as a long prompt does: the memory
        measured for the step's activations holds) -> (B, V) logits at each sequence's token end - 1."""
        runner = self.runner
        budget = runner.config.max_num_batched_tokens
        at, last = list(starts), [None] * len(seqs)
        while True:
            rows, lengths, room = [], [], budget
            for b in range(len(seqs)):
                n = min(ends[b] - at[b], room)
                if n > 0:
                    rows.append(b)
                    lengths.append(n)
                    room -= n
            if not rows:
                break
            batch = [seqs[b] for b in rows]
            flat = seam("prefill_metadata", prefill_metadata)(
                [seq.token_ids for seq in batch],
                [at[b] for b in rows],
                lengths,
                [seq.block_table for seq in batch],
                runner.block_size,
            )
            arrays = prefill_arrays(flat)
            if any(at[b] for b in rows):  # history: attention reads its keys through the tables (as prepare_prefill)
                arrays["block_tables"] = runner.block_tables.padded(batch)
            step = StepInputs(True, arrays, max(lengths), max(at[b] + n for b, n in zip(rows, lengths)))
            logits = runner.run_forward(batch, step)  # (len(rows), V)
            for row, (b, n) in enumerate(zip(rows, lengths)):
                at[b] += n
                last[b] = logits[row]
        return torch.stack(last)  # (B, V)

    def _decode(self, seqs: list[Sequence], token_ids: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One decode step of the draft: sequence b's input token_ids[b] at positions[b] -> (B, V) logits.
        token_ids: host ids, or a (B,) int64 tensor the device already holds (the previous draft step's samples)."""
        runner = self.runner
        on_device = isinstance(token_ids, torch.Tensor)
        host_ids = np.zeros(len(seqs), dtype=np.int64) if on_device else np.asarray(token_ids, dtype=np.int64)
        step = StepInputs(False, decode_arrays(
            host_ids[:, None],  # (B, 1) (on_device: placeholders, the forward reads token_ids)
            np.asarray(positions, dtype=np.int64),  # (B,)
            runner.block_tables.padded(seqs),  # (B, width)
            runner.block_size,
        ))  # fmt: skip
        input_ids = token_ids if on_device else None
        # (B, V), through its CUDA graphs if any
        return runner.run_forward(seqs, step, input_ids, graphs=runner.decode_graphs)
