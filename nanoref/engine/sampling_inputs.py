"""A step's sampling inputs, built in one place from its sequences' SamplingParams: temperatures, top-k / top-p,
the seeded rows' generators, logit biases, penalties, min_tokens masks and which rows want logprobs.

The model runner asks for them (`sampling_batch`) while the forward runs; a step loop that samples several rows per
sequence (a verify step) builds each row's penalties and masks with `row_processing`. Logprobs come from the model's
raw logits (`step_logprobs`), before penalties, masks and temperature (vLLM's default "raw_logprobs"), but after a
grammar's mask (structured output), as in vLLM.

A prefill step can also score the tokens the model was given: where a sequence asks for every position's logits
(`asks_all_logits`: its request asks for prompt logprobs), the step makes logits at every position, and
`split_logits` takes each prompt token's logprob out of them before the sampler sees each sequence's last row.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs
from nanoref.layers.logits_processors import (
    LogitsProcessing,
    StepLogprobs,
    apply_token_bitmask,
    pack_token_ids,
    raw_logprobs,
    scored_logprobs,
    to_device,
    token_logprobs,
)
from nanoref.layers.sampler import SamplingBatch


def sampling_batch(
    seqs: list[Sequence],
    is_prefill: bool,
    num_unknown: int,
    device: torch.device,
    generator: torch.Generator,
    vocab: int,
    eos_token_ids: set[int] | frozenset[int],
) -> SamplingBatch:
    """Each row's settings, plus the host facts (all greedy? any top-k/top-p? which rows seeded?) that let the
    sampler choose its path without reading the device. generator: what unseeded rows draw from.

    A prefill row that ends mid-prompt emits no token (Scheduler.postprocess drops it): it is sampled greedily, so
    it draws nothing from its request's generator, and a seeded request's draws are the same however its prompt
    was chunked (and when every row is greedy or mid-prompt, nothing is drawn from the engine's either). It gets no
    penalties, masks or logprobs either. num_unknown: tokens each sequence has that only the device holds yet (1
    where a step was launched before the previous one's tokens came back; see row_processing).
    """
    params = [seq.sampling_params for seq in seqs]
    temperatures = [p.temperature for p in params]
    generators = [seq.generator for seq in seqs]
    emits = [True] * len(seqs)
    if is_prefill:
        for row, seq in enumerate(seqs):
            if seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                temperatures[row], generators[row], emits[row] = 0.0, None, False
    top_k, top_p, min_p = [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]
    batch = SamplingBatch.from_host(temperatures, top_k, top_p, generators, device, generator, min_p)
    if not any(p.processes_logits for p in params):  # the one check a batch that asks for none of it pays
        return batch
    penalised, masked = [], []
    for row, seq in enumerate(seqs):
        if emits[row]:
            assert not (num_unknown and seq.sampling_params.has_penalties), "penalties need every token's value"
            row_processing(row, seq, [], num_unknown, penalised, masked, vocab, eos_token_ids)
            if seq.sampling_params.logprobs is not None:
                batch.logprob_rows.append((row, seq.sampling_params.logprobs))
    batch.processing = LogitsProcessing.build(penalised, masked, vocab, device)
    return batch


def row_processing(
    row: int,
    seq: Sequence,
    more: list[int],
    num_unknown: int,
    penalised: list,
    masked: list,
    vocab: int,
    eos_token_ids: set[int] | frozenset[int],
) -> None:
    """Row `row`'s logit_bias, penalties, min_tokens mask, allowed_token_ids and its sample's constraint, appended to
    `penalised` and `masked` (LogitsProcessing.build's inputs: a bias rides in `masked` as (row, ids, biases), a
    constraint as (row, constraint): build fills every row's allowed tokens at once; allowed_token_ids as (row, its
    packed bitmask), or beside a constraint (row, its packed bitmask, its stop ids packed): the tokens it takes
    where the two have no token in common), for the token after seq's tokens plus `more` (known
    ids: proposed tokens before this row) plus `num_unknown` more tokens whose values only the device holds."""
    p = seq.sampling_params
    if seq.output is not None and seq.output.constraint is not None:
        assert not more and not num_unknown, "a constraint's matcher follows the sample's known tokens only"
        masked.append((row, seq.output.constraint))  # its allowed tokens filled with the others' in build()
    if p.allowed_token_ids is not None:  # (W,): as a constraint's allowed tokens
        entry = (row, pack_token_ids(p.allowed_token_ids, vocab))
        if seq.output is not None and seq.output.constraint is not None:  # + its stop ids, for when the two part
            stops = [t for t in (*p.stop_token_ids, *eos_token_ids) if t < vocab]
            entry += (pack_token_ids(stops, vocab),) if stops else ()
        masked.append(entry)
    if p.bad_words and seq.output is not None:
        banned = banned_next(seq.output.bad_words_ids, seq.completion_token_ids + more, num_unknown)
        if banned:
            masked.append((row, banned))
    if p.logit_bias:
        masked.append((row, list(p.logit_bias), list(p.logit_bias.values())))
    if p.has_penalties:
        prompt, completion = seq.token_ids[: seq.num_prompt_tokens], seq.completion_token_ids + more
        penalised.append((row, prompt, completion, p.presence_penalty, p.frequency_penalty, p.repetition_penalty))
    if seq.num_completion_tokens + len(more) + num_unknown < p.min_tokens:
        # EOS too under ignore_eos, as vLLM masks every stop id before min_tokens (a tokenizer's id may be past vocab)
        eos = sorted(t for t in eos_token_ids if t < vocab)
        stop_ids = list(p.stop_token_ids) + eos
        if stop_ids:
            masked.append((row, stop_ids))


def banned_next(bad_words_ids: list[list[int]], completion: list[int], num_unknown: int) -> list[int]:
    """The tokens a sample may not take next: each bad word's last token where the completion ends with the rest
    of the word (vLLM's rule: a word of one token always; the completion's own tokens only, not the prompt's)."""
    banned = []
    for word in bad_words_ids:
        rest = word[:-1]
        if rest:
            assert not num_unknown, "a bad word of several tokens needs the completion's last tokens' values"
            if len(rest) > len(completion) or completion[len(completion) - len(rest) :] != rest:
                continue
        banned.append(word[-1])
    return banned


def step_logprobs(seqs: list[Sequence], batch: SamplingBatch, logits: torch.Tensor) -> torch.Tensor | None:
    """The raw log-probabilities (R, V) of the rows that asked, from the model's logits (None: no row asked). A row
    whose sample follows a grammar has them over the tokens its grammar allows (the others -inf), as vLLM's: its
    grammar masks the logits before its sampler takes the raw logprobs."""
    if not batch.logprob_rows:
        return None
    processing = batch.processing
    if processing is not None and processing.grammar_rows is not None:  # (a copy: the sampler's logits stay)
        logits = apply_token_bitmask(logits, processing.grammar_rows, processing.grammar_bitmask)
    if len(batch.logprob_rows) == len(seqs):
        return raw_logprobs(logits)
    index = np.asarray([row for row, _ in batch.logprob_rows], dtype=np.int64)
    return raw_logprobs(logits[to_device(index, logits.device)])  # (R, V)


def attach_logprobs(seqs: list[Sequence], batch: SamplingBatch, logprobs: torch.Tensor, sampled: torch.Tensor) -> None:
    """logprobs: step_logprobs' (R, V); sampled: (num_seqs,) the step's ids. Each asking row's sequence gets its
    entry to take when its token is appended (still on the device until then)."""
    rows = [row for row, _ in batch.logprob_rows]
    chosen = sampled if len(rows) == len(seqs) else sampled[to_device(np.asarray(rows, dtype=np.int64), sampled.device)]
    num_top = max(n for _, n in batch.logprob_rows)
    step = StepLogprobs(chosen, token_logprobs(logprobs, chosen, num_top))
    for index, (row, n) in enumerate(batch.logprob_rows):
        seqs[row].output.pending_logprobs = (step, index, n)  # (read by the output stage's on_token)


def asks_all_logits(seq: Sequence) -> bool:
    """Whether seq's prefill chunk needs the logits of every position it computes, not only of its last: its request
    asks for prompt logprobs, it is the sample that takes them (sample 0: the others share its prompt's blocks)
    and part of its prompt is not scored yet (a preempted sequence recomputes its prompt without scoring it again)."""
    out = seq.output
    return (
        out is not None
        and seq.sampling_params.prompt_logprobs is not None
        and out.index == 0
        and out.num_prompt_scored < seq.num_prompt_tokens
    )


def split_logits(seqs: list[Sequence], step: StepInputs, logits: torch.Tensor) -> torch.Tensor:
    """A prefill step's logits at every position (N, V) -> each sequence's last row (num_seqs, V), for the sampler.
    On the way, each sequence that asked (`asks_all_logits`) keeps the scores of the prompt tokens of its chunk.

    Where a sequence's chunk starts at position `start`, its row r holds the logits after token start + r: they
    score token start + r + 1. So the chunk scores prompt tokens start + 1 ... min(end, P - 1) (end: its last
    position; P: its prompt's length), and its last row (position end) is the one sampled. Its scores stay on the
    device (one `StepLogprobs` for the step) until the output stage reads them."""
    cu_seqlens = step.arrays["cu_seqlens_q"]  # (num_seqs + 1,): where each sequence's rows start
    rows: list[int] = []  # (R,): the flat rows that score a prompt token
    targets: list[int] = []  # (R,): the token each of them scores
    asked: list[tuple[Sequence, int, int]] = []  # (seq, its first entry among the R, how many)
    for b, seq in enumerate(seqs):
        if not asks_all_logits(seq):
            continue
        out, start, end = seq.output, seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        first, last = out.num_prompt_scored, min(end, seq.num_prompt_tokens - 1)  # the tokens to score, inclusive
        # (its earlier positions were scored when first computed: the prefix cache serves it only its own blocks)
        assert start < first, f"prompt positions {first}..{start} were never computed: they cannot be scored"
        if first > last:
            continue
        asked.append((seq, len(rows), last + 1 - first))
        rows.extend(range(cu_seqlens[b] + first - 1 - start, cu_seqlens[b] + last - start))
        targets.extend(seq.token_ids[first : last + 1])
        out.num_prompt_scored = last + 1
    if asked:
        device = logits.device
        index = to_device(np.asarray(rows, dtype=np.int64), device)  # (R,)
        token_ids = to_device(np.asarray(targets, dtype=np.int64), device)  # (R,)
        num_top = max(seq.sampling_params.prompt_logprobs for seq, _, _ in asked)
        scores = StepLogprobs(token_ids, scored_logprobs(logits[index], token_ids, num_top))
        for seq, first_entry, count in asked:
            seq.output.prompt_scores.append((scores, first_entry, count))
    last_rows = to_device(np.asarray(cu_seqlens[1:] - 1, dtype=np.int64), logits.device)  # (num_seqs,)
    return logits[last_rows]
