"""The speculative loop: the engine's `step`, with decode steps that verify k proposed tokens per sequence.

A prefill step runs as in the plain loop (the draft model, if any, computes its K/V alongside, unless the batch is
above the policy's limit: then its decode steps will run plain, and the draft catches up later if it must). A decode
step becomes a verify step:

1. each running sequence b gets k proposals d_1..d_k (`proposers.py`; those a proposer cannot make, an n-gram
   lookup that finds nothing, are filled with its last proposal or the last token: a guess like any other);
2. one target forward over the flat batch of every sequence's last token and its proposals, k + 1 tokens at
   positions num_tokens - 1 .. num_tokens - 1 + k: a decode step with k + 1 queries per sequence
   (`Context.decode_query_len`; the paged decode kernels take a block of queries, causal among themselves),
   with logits for every token. One shape for every sequence, so CUDA graphs record it like decode
   (`verify_graphs`). Only where k tokens no longer fit before max_model_len does a step go through the varlen
   prefill path instead (proposals of different lengths, `Context.all_logits`), eagerly;
3. the acceptance rule (`acceptance.py`) keeps j of the proposals and adds one token of the target's;
4. postprocess appends those j + 1 tokens one at a time, each checked as in the plain loop (EOS, stop ids and
   strings, min_tokens, max_tokens, max_model_len), so a sequence never emits past its end.

KV rollback costs nothing to do, only to get right. The forward wrote K/V for all kb + 1 positions; a sequence now
counts as computed only up to its accepted tokens (num_computed_tokens = num_tokens - 1, as after any decode step),
so the K/V of rejected positions is never read (attention reads up to the context length) and is overwritten when
the sequence really reaches those positions. The prefix cache hashes only blocks full of computed tokens, so it
never sees a rejected one. The blocks the scheduler reserved for proposals (the engine's `num_lookahead_tokens`)
beyond what the kept tokens need go back to the free list (`trim`).

A sequence near its max_tokens also checks k tokens (it could keep fewer): the step keeps one shape, and what lies
past the sequence's end is never appended. A draft model's own decode steps replay its graphs.

Given to the engine by `nanoref/llm.py` as its step loop (`SpeculativeLoop`), with k as its lookahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoref.engine.block_manager import BlockManager
from nanoref.engine.llm_engine import PlainLoop
from nanoref.engine.metrics import StepRecord
from nanoref.engine.sampling_inputs import row_processing
from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs, prefill_arrays, prefill_metadata
from nanoref.layers.logits_processors import LogitsProcessing, TokenLogprobs, raw_logprobs, to_device, token_logprobs
from nanoref.layers.sampler import sampling_probs
from nanoref.speculative.acceptance import accept_greedy, emitted_tokens, rejection_sample
from nanoref.speculative.policy import DEFAULT_BATCH_LIMIT, SpeculationPolicy
from nanoref.speculative.proposers import DraftProposer, NgramProposer, token_filters
from nanoref.speculative.runner import acceptance_bar
from nanoref.utils import seams
from nanoref.utils.interrupts import interruptibly
from nanoref.utils.seams import seam


@dataclass
class Verified:
    """A verify step's outcome for one sequence."""

    draft_ids: list[int]  # what was proposed (and could be kept: no more than the sequence's limit)
    token_ids: list[int]  # what it gains: the accepted proposals, then the target's own token
    num_checked: int  # the tokens its rows checked in the forward (k where the step has one shape)
    logprobs: list[TokenLogprobs] | None = None  # one per gained token, where the request asked


def varlen_verify_inputs(seqs: list[Sequence], drafts: list[list[int]], block_tables, block_size: int) -> StepInputs:
    """The same as a varlen step (the prefill path over the history, logits for every token), for proposals of
    different lengths: where a sequence near max_model_len has no room for k."""
    flat = seam("prefill_metadata", prefill_metadata)(
        [seq.token_ids + draft for seq, draft in zip(seqs, drafts)],
        [seq.num_tokens - 1 for seq in seqs],  # everything before the last token has K/V
        [1 + len(draft) for draft in drafts],
        [seq.block_table for seq in seqs],
        block_size,
    )
    arrays = prefill_arrays(flat)
    arrays["block_tables"] = block_tables.padded(seqs)  # (num_seqs, width)
    max_q = 1 + max(map(len, drafts))
    max_k = max(seq.num_tokens + len(draft) for seq, draft in zip(seqs, drafts))
    return StepInputs(True, arrays, max_q, max_k, all_logits=True)


class SpeculativeLoop:
    """`step` for an engine with a speculative_config."""

    def __init__(self, engine, make_verify_graphs=None, make_plain_loop=PlainLoop) -> None:
        """make_verify_graphs(runner, query_len): builds CUDA graphs of the verify step (nanoref/llm.py gives
        nanoref/cuda_graphs.py's DecodeGraphs), used where the model runner replays its decode steps.
        make_plain_loop(engine): the step loop of the decode steps that run plain, where speculation would not pay
        (nanoref/llm.py gives the overlapped loop on CUDA: those steps run as fast as an engine without speculation).
        """
        self.engine = engine
        self.plain_loop = make_plain_loop(engine)
        spec = engine.config.speculative_config
        self.k = spec.num_speculative_tokens
        runner = engine.model_runner
        self.verify_graphs = None  # (None: eager)
        if make_verify_graphs is not None and runner.decode_graphs is not None:
            self.verify_graphs = make_verify_graphs(runner, query_len=self.k + 1)
        limit = spec.disable_by_batch_size
        if limit is None:
            limit = DEFAULT_BATCH_LIMIT.get(engine.config.device.type, DEFAULT_BATCH_LIMIT["cuda"])
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            runner.draft.block_tables = runner.block_tables  # the draft's K/V lives in the target's blocks
            self.proposer = DraftProposer(runner.draft, engine.scheduler.block_manager.blocks)
        # (a draft that could never pay is not loaded at all: nanoref/llm.py builds a plain engine instead)
        self.policy = SpeculationPolicy(limit, acceptance_bar(engine.config))
        # totals over the engine's life (the server's /metrics)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def step(self) -> tuple[list[Sequence], StepRecord]:
        engine = self.engine
        scheduler, metrics, runner = engine.scheduler, engine.metrics, engine.model_runner
        # decode steps that would not pay as verify steps (policy.py) run in the plain loop, one after another
        plain, in_flight = self.plain_loop, getattr(self.plain_loop, "in_flight", None) is not None
        if (in_flight or not scheduler.waiting) and not self.speculates(scheduler.running):
            self.policy.ran_plain()
            return plain.step()
        if in_flight:  # a verify step next: first complete the plain step on the device, launching none after it
            return plain.step(launch_ahead=False)
        seqs, is_prefill = self.schedule()
        record = metrics.begin_step(scheduler, seqs, is_prefill)
        if is_prefill:
            # a draft model computes its K/V beside the target's only where decode steps will verify: with more
            # sequences than the batch limit they run plain, and the draft catches up if the batch comes back within it
            num_seqs = len(scheduler.running) + len(scheduler.waiting)
            interruptibly(self.proposer.prefill, seqs, self.policy.within_batch_limit(num_seqs))
            finished = scheduler.postprocess(seqs, interruptibly(runner.run, seqs, True))
            self.proposer.after_prefill(seqs)
        elif self.speculates(seqs):
            finished = self.postprocess(seqs, interruptibly(self.verify, seqs), record)
        else:  # a plain decode step: speculation would not pay now (policy.py)
            finished = scheduler.postprocess(seqs, interruptibly(runner.run, seqs, False))
            for seq in seqs:
                if not seq.is_finished:
                    trim(scheduler.block_manager, seq)  # (the blocks reserved for proposals)
            self.policy.ran_plain()
        return finished, metrics.end_step(record, seqs)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The scheduler's next step, with a preempted sequence's recompute stopping short of its last token: that
        token goes into its next verify step, which then checks the proposals it would have checked without the
        preemption, with the same draws from a seeded request's generator (a prefill would sample the next token
        the plain way, and every later step of the request would draw otherwise than had it run alone). A sequence
        with only that token left sits the prefill step out: it is where a decode step leaves one."""
        scheduler = self.engine.scheduler
        while True:
            seqs, is_prefill = scheduler.schedule()
            if not is_prefill:
                return seqs, False
            for seq in seqs:
                if seq.num_completion_tokens and seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                    seq.num_scheduled_tokens -= 1
            if seqs := [seq for seq in seqs if seq.num_scheduled_tokens]:
                scheduler.scheduled = seqs  # (one that sat the step out is not the step's: its failure aborts it not)
                return seqs, True

    def in_step(self) -> list[Sequence]:
        return [*self.engine.scheduler.scheduled, *self.plain_loop.in_step()]

    def speculates(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of seqs verifies proposals: where the policy says it pays, and no sample in it
        follows a constraint (structured output: its matcher takes each token as it is sampled and cannot follow
        proposals that may be rejected, so those steps run plain, proposals and all)."""
        if any(seq.output is not None and seq.output.constraint is not None for seq in seqs):
            return False
        return self.policy.speculate(len(seqs))

    # -- the verify step ------------------------------------------------------------------------
    def limit(self, seq: Sequence) -> int:
        """How many tokens to propose for seq: k, fewer where its max_tokens or max_model_len comes first (it
        gains at most limit + 1 tokens, and its last proposal's position must fit in max_model_len)."""
        config = self.engine.config
        left = seq.sampling_params.max_tokens - seq.num_completion_tokens - 1
        return max(0, min(self.k, left, config.max_model_len - seq.num_tokens))

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence]) -> list[Verified]:
        runner = self.engine.model_runner
        limits = [self.limit(seq) for seq in seqs]
        proposals = self.proposer.propose(seqs, limits, self.sample_draft)
        # Every sequence checks k tokens where it has room for them (a sequence that may keep fewer, near its
        # max_tokens, still checks k: it stops at its end), so the step has one shape. The proposals a proposer
        # could not make are filled with its last one (or the last token), a guess like any other.
        # A sequence near its own end has blocks only up to it (the scheduler reserves no more): it takes blocks for
        # the rest of the k rows where some are free (given back after the step), else the step takes the varlen path
        manager = self.engine.scheduler.block_manager
        for seq in seqs:
            if manager.blocks_to_append(seq, seq.num_tokens + self.k) <= manager.num_free_blocks:
                manager.may_append(seq, min(seq.num_tokens + self.k, self.engine.config.max_model_len))
        room = [min(self.engine.config.max_model_len, len(seq.block_table) * runner.block_size) for seq in seqs]
        fits = all(seq.num_tokens + self.k <= end for seq, end in zip(seqs, room))
        # a learner's decode attention (notebook 04) answers one query per sequence, what its exercise asks for:
        # with one in place, verify steps take the varlen path; a learner's graph padding sees one token per row
        replaced = seams.active().keys()
        fits = fits and not replaced & {"paged_decode_attention", "merge_splits"}
        width = self.k if fits else None
        drafts = [pad(draft, seq, width or limit) for draft, seq, limit in zip(proposals.draft_ids, seqs, limits)]
        if fits:  # a decode step with k + 1 queries per sequence: its last token and its k proposals
            step = runner.prepare_decode(seqs, extra=drafts)
        else:
            step = varlen_verify_inputs(seqs, drafts, runner.block_tables, runner.block_size)
        graphs = None if "pad_decode_batch" in replaced else self.verify_graphs
        logits = runner.run_forward(seqs, step, graphs=graphs)  # (T, V): T = B * (k + 1), or the sum of 1 + kb
        counted = [draft[:limit] for draft, limit in zip(drafts, limits)]  # the proposals that could be kept
        return self.accept(seqs, drafts, counted, proposals.probs, logits)

    def accept(
        self,
        seqs: list[Sequence],
        drafts: list[list[int]],
        counted: list[list[int]],
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
    ) -> list[Verified]:
        """The acceptance rule over the verify rows -> each sequence's outcome (one host sync for all of them).

        drafts: each sequence's checked tokens; counted: the first of them that it may keep (its limit: it gains at
        most one more token); draft_probs: the draft model's q for each counted proposal, in order (None: n-gram)."""
        runner = self.engine.model_runner
        device = logits.device
        starts = np.cumsum([0] + [1 + len(d) for d in drafts])  # sequence b's rows: starts[b] .. starts[b + 1] - 1
        rows_of = [range(starts[b], starts[b + 1]) for b in range(len(seqs))]
        # penalties and min_tokens masks, per row: row i of sequence b follows its tokens plus d_1..d_i
        penalised, masked, vocab = [], [], runner.config.hf_config.vocab_size
        for seq, draft, rows in zip(seqs, drafts, rows_of):
            if seq.sampling_params.processes_logits:
                for i, row in enumerate(rows):
                    row_processing(row, seq, draft[:i], 0, penalised, masked, vocab, runner.eos_token_ids)
        processing = LogitsProcessing.build(penalised, masked, vocab, device)
        scores = logits.float() if processing is None else processing.apply(logits)  # (T, V)
        argmax = scores.argmax(dim=-1)  # (T,)
        sampled = [seq.sampling_params.temperature > 0 for seq in seqs]
        to_host = [argmax]
        if any(sampled):
            to_host += self.sample_rows(seqs, drafts, counted, rows_of, draft_probs, scores)
        host = torch.stack(to_host).tolist()  # the step's one host sync
        out = []
        for b, (draft, rows) in enumerate(zip(drafts, rows_of)):
            first, last = rows.start, rows.stop
            if sampled[b]:
                tokens = emitted_tokens(counted[b], host[1][first:last], host[2][first:last])
            else:
                tokens = seam("accept_greedy", accept_greedy)(draft, host[0][first:last])
            # (what lies past the sequence's end is never used)
            out.append(Verified(counted[b], tokens[: len(counted[b]) + 1], len(draft)))
        if any(seq.sampling_params.logprobs is not None for seq in seqs):
            self.attach_logprobs(seqs, rows_of, out, logits)
        return out

    def sample_rows(self, seqs, drafts, counted, rows_of, draft_probs, scores: torch.Tensor) -> list[torch.Tensor]:
        """The rejection rule on every row of the step -> [accepted (T,), recovered (T,)] as int64."""
        runner = self.engine.model_runner
        num_rows, vocab = scores.shape
        device = scores.device
        # (T,): greedy rows too (their result is not used)
        # (from pinned memory: a pageable copy would make the host wait for the verify forward here)
        row_params = [seq.sampling_params for seq, rows in zip(seqs, rows_of) for _ in rows]  # (T,)
        temperatures = to_device(np.asarray([p.temperature for p in row_params], np.float32), device)
        p = sampling_probs(scores, temperatures, *token_filters(row_params, device))  # (T, V)
        # the rows past a sequence's counted proposals are bonus rows (-1), so its tokens are the same whether its
        # step had k rows per sequence or only as many as it could keep (the varlen path)
        draft_rows = [row for draft, rows in zip(counted, rows_of) for row in rows[: len(draft)]]
        draft_ids = np.full(num_rows, -1, dtype=np.int64)
        draft_ids[draft_rows] = [t for draft in counted for t in draft]
        draft_ids = to_device(draft_ids, device)
        q = None
        if draft_probs is not None:  # the draft model's distributions at its proposals' rows; a filled-in
            # proposal's row gets a q one-hot at it, as a deterministic proposer's
            q = torch.zeros_like(p).scatter_(1, draft_ids.clamp(min=0)[:, None], 1.0)
            q_rows = [row for draft, rows in zip(counted, rows_of) for row in rows[: len(draft)]]
            q[to_device(np.asarray(q_rows, dtype=np.int64), device)] = draft_probs
        # the draws: a seeded request's from its own generator, the others' from the engine's
        uniforms = torch.rand(num_rows, device=device, generator=runner.generator)
        noise = torch.empty(num_rows, vocab, device=device).exponential_(generator=runner.generator)
        for seq, rows in zip(seqs, rows_of):
            if seq.generator is not None and seq.sampling_params.temperature > 0:  # k + 1 rows' draws, always
                n, g = len(rows), seq.generator
                uniforms[rows.start : rows.stop] = torch.rand(self.k + 1, device=device, generator=g)[:n]
                draws = torch.empty(self.k + 1, vocab, device=device).exponential_(generator=g)
                noise[rows.start : rows.stop] = draws[:n]
        accepted, recovered = seam("rejection_sample", rejection_sample)(p, q, draft_ids, uniforms, noise)
        return [accepted.long(), recovered]

    def sample_draft(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """probs: (B, V), each sequence's draft distribution -> (B,) a draw from each (exponential race), from its
        request's generator if it has one. A greedy row is one-hot: its draw is its argmax."""
        runner = self.engine.model_runner
        if all(seq.sampling_params.temperature == 0 for seq in seqs):
            return probs.argmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=runner.generator)  # (B, V)
        for row, seq in enumerate(seqs):
            if seq.generator is not None and seq.sampling_params.temperature > 0:
                noise[row].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)

    def attach_logprobs(self, seqs, rows_of, out: list[Verified], logits: torch.Tensor) -> None:
        """The raw logprobs of every gained token of the sequences that asked (a second sync, only for them)."""
        asking = [b for b, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        rows = [rows_of[b].start + i for b in asking for i in range(len(out[b].token_ids))]
        chosen = [t for b in asking for t in out[b].token_ids]
        device = logits.device
        index = to_device(np.asarray(rows, dtype=np.int64), device)
        num_top = max(seqs[b].sampling_params.logprobs for b in asking)
        values = token_logprobs(raw_logprobs(logits[index]), to_device(np.asarray(chosen), device), num_top)
        logprob, rank, top_values, top_ids = (t.tolist() for t in values)
        at = 0
        for b in asking:
            n = seqs[b].sampling_params.logprobs
            entries = []
            for token in out[b].token_ids:
                top = dict(zip(top_ids[at][:n], top_values[at][:n]))
                entries.append(TokenLogprobs(token, logprob[at], rank[at], top))
                at += 1
            out[b].logprobs = entries

    # -- after the forward --------------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], verified: list[Verified], record: StepRecord) -> list[Sequence]:
        """Append each sequence's gained tokens one at a time, as the plain postprocess would one per step."""
        scheduler = self.engine.scheduler
        manager = scheduler.block_manager
        finished = []
        record.seqs = [(seq.seq_id, 1 + v.num_checked) for seq, v in zip(seqs, verified)]
        for seq, v in zip(seqs, verified):
            seq.num_scheduled_tokens = 0
            first_position = seq.num_tokens - 1
            accepted = len(v.token_ids) - 1
            self.engine.metrics.count_verified(seq, len(v.draft_ids), accepted)
            record.num_draft_tokens += len(v.draft_ids)
            record.num_accepted_tokens += accepted
            for index, token_id in enumerate(v.token_ids):
                seq.num_computed_tokens += 1  # the token before this one (the last token, then each kept proposal)
                manager.commit(seq)
                if v.logprobs is not None:
                    seq.output.logprobs.append(v.logprobs[index])
                if scheduler.append(seq, token_id):
                    finished.append(seq)
                    break
            else:
                trim(manager, seq)  # the blocks only rejected proposals used
                if isinstance(self.proposer, DraftProposer):
                    self.proposer.after_verify(seq, first_position, len(v.draft_ids))
        self.num_draft_tokens += record.num_draft_tokens
        self.num_accepted_tokens += record.num_accepted_tokens
        self.policy.verified(len(seqs), len(seqs) + record.num_accepted_tokens)
        return finished


def pad(draft: list[int], seq: Sequence, width: int) -> list[int]:
    """draft cut or filled to `width` tokens: with its last proposal repeated (the sequence's last token if none)."""
    filler = draft[-1] if draft else seq.last_token
    return (draft + [filler] * width)[:width]


def trim(manager: BlockManager, seq: Sequence) -> None:
    """Give back the blocks past the ones seq's tokens need: those a speculative step took for proposed tokens
    that were rejected. They are seq's alone and carry no hash (nothing past its last token is committed)."""
    keep = seq.num_blocks
    if len(seq.block_table) <= keep:
        return
    for block_id in seq.block_table[keep:]:
        block = manager.blocks[block_id]
        assert block.ref_count == 1 and block.hash == -1, f"{block} past the end of {seq} is shared or hashed"
        block.ref_count = 0
        manager.used_block_ids.remove(block_id)
        manager.free_block_ids[block_id] = None
    manager.tables.array[seq.table_row, keep : len(seq.block_table)] = -1
    del seq.block_table[keep:]
    manager.tables.num_blocks[seq.table_row] = keep
