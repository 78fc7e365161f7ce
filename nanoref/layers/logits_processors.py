"""What happens to the logits between the model and the sampler: penalties and the min_tokens mask; and logprobs.

- presence / frequency penalty (OpenAI's definition, as vLLM applies it), on the counts of each token in the
  completion so far: logit -= frequency * count + presence * (count > 0).
- repetition penalty (HF's, as vLLM applies it), on every token of prompt or completion: a positive logit is
  divided by it, a negative one multiplied, so the token always becomes less likely (for penalties > 1).
- logit_bias: a request's {token id: bias} added to those logits, before the penalties (as vLLM orders them).
- min_tokens: until a request has that many completion tokens, its stop tokens (EOS, stop_token_ids) get -inf;
  except on a row whose grammar allows nothing else (the grammar is complete: it can only end, and does, with a
  warning), which would otherwise leave the row no token at all.
- allowed tokens: a row whose sample follows a grammar (nanoref/structured_output.py) or names allowed_token_ids
  keeps only the tokens its packed bitmask allows (bit t % 32 of word t // 32; both, where it has both); every other
  token of that row gets -inf, after all the above (`apply_token_bitmask`, behind an exercise seam: notebook 13 has
  a learner write it).
- logprobs: log_softmax of the model's raw logits (before any of the above, and before temperature: vLLM's
  default "raw_logprobs"; but after a grammar's mask, which vLLM applies to the logits before its sampler sees
  them: a constrained row's logprobs are over the tokens its grammar allows), the chosen token's value and rank,
  and the top N.
- prompt logprobs: the same for tokens the model was given rather than sampled: the logits of the row of prompt
  token t score prompt token t + 1 (`scored_logprobs`, on many rows at once).

Each is a small pure function over device tensors. Their inputs are built by the model runner from host facts,
only for the rows that ask (`LogitsProcessing.build`): a batch where no row does so runs none of this.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from nanoref.utils.seams import seam


def token_counts(ids: torch.Tensor, rows: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """ids, rows: (T,) int64, token ids and the row each belongs to -> (num_rows, vocab) float32 counts."""
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=ids.device)
    return counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits: (R, V) float32; output_counts: (R, V) float32, each token's count in the completion; seen: (R, V)
    bool, the token is in the prompt or the completion; presence, frequency, repetition: (R,) float32 -> (R, V)."""
    finite = torch.finfo(torch.float32)
    rep = repetition.clamp(min=finite.tiny)[:, None]  # (R, 1): a penalty that float32 rounds to 0 would make 0 / 0
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)
    return logits.clamp(min=finite.min, max=finite.max)  # finite: an extreme penalty must not make inf - inf later


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits: (B, V); rows, ids: (M,) int64 -> (B, V), a copy with -inf at each (rows[m], ids[m])."""
    return logits.index_put((rows, ids), logits.new_full((), float("-inf")))  # (a fill: no copy from the host)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask: (A, W) int32, bit b of word w set where token 32 * w + b is allowed -> (A, vocab) bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    allowed = (bitmask[:, :, None] >> bits) & 1  # (A, W, 32): an arithmetic shift, so bit 31 reads right too
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab] != 0


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: (B, V); rows: (A,) int64; bitmask: (A, W) int32 -> (B, V), a copy where each of these rows keeps only
    the tokens its bitmask allows (the others -inf); the other rows are left as they were."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # (A, V)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def apply_token_bitmask_reference(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_token_bitmask one token at a time, as its definition reads (slow: for checks and for reading)."""
    masked = logits.clone()
    for a, row in enumerate(rows.tolist()):
        for token in range(logits.shape[1]):
            word = int(bitmask[a, token // 32])  # a Python int: >> is arithmetic, so bit 31 of a negative word is 1
            if not (word >> (token % 32)) & 1:
                masked[row, token] = float("-inf")
    return masked


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits: (R, V), the model's, before penalties and temperature -> (R, V) float32 log-probabilities."""
    return logits.float().log_softmax(dim=-1)


def token_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: (R, V); chosen: (R,) int64 sampled ids ->
    (chosen logprob (R,), chosen rank (R,) with 1 = the most likely, top logprobs (R, num_top), their ids (R, num_top)).

    The rank counts the tokens at least as likely as the chosen one (vLLM's: a tie ranks behind)."""
    chosen_logprob = logprobs.gather(1, chosen[:, None])  # (R, 1)
    rank = (logprobs >= chosen_logprob).sum(dim=-1)  # (R,)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # (R, num_top), most likely first
    return chosen_logprob[:, 0], rank, top_logprobs, top_ids


def scored_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, rows_per_pass: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: (R, V), the model's raw logits at R positions; token_ids: (R,) int64, the token that followed each
    -> token_logprobs' four tensors for those tokens. rows_per_pass rows at a time: a prompt's thousands of rows
    at once would need an (R, V) float32 log-softmax (with a 150k vocabulary, 0.6 MB a row)."""
    parts = [
        token_logprobs(raw_logprobs(logits[i : i + rows_per_pass]), token_ids[i : i + rows_per_pass], num_top)
        for i in range(0, len(token_ids), rows_per_pass)
    ]
    return tuple(torch.cat(values) for values in zip(*parts))  # (R,), (R,), (R, num_top), (R, num_top)


class TokenLogprobs(NamedTuple):
    """One token's logprobs: a completion token's (a sample's `logprobs` holds one per token, in order), or a prompt
    token's (`prompt_logprobs`: the tokens the model was given, scored on the tokens before them)."""

    token_id: int
    logprob: float  # log p(token_id | the tokens before it), from the model's raw logits
    rank: int  # 1: the most likely token
    top: dict[int, float]  # the N most likely ids -> logprob, most likely first (N = SamplingParams.logprobs)


class StepLogprobs:
    """One step's logprobs for the rows that asked, on the device until the first row's entry is read (then all
    rows come to the host in one copy, after the step's sampled ids did)."""

    def __init__(self, chosen: torch.Tensor, outputs: tuple[torch.Tensor, ...]) -> None:
        self._device = (chosen, *outputs)  # each (R,) or (R, num_top)
        self._host: tuple[list, ...] | None = None

    def entry(self, index: int, num_top: int) -> TokenLogprobs:
        """The entry of the index-th row that asked, with its own num_top of the step's top ids."""
        if self._host is None:
            self._host = tuple(t.tolist() for t in self._device)
            self._device = ()
        chosen, logprob, rank, top_logprobs, top_ids = (values[index] for values in self._host)
        return TokenLogprobs(chosen, logprob, rank, dict(zip(top_ids[:num_top], top_logprobs[:num_top])))


@dataclass
class LogitsProcessing:
    """One step's penalties and masks on the device, for the rows that need them."""

    rows: torch.Tensor | None = None  # (R,) int64: the penalised rows of the batch
    output_counts: torch.Tensor | None = None  # (R, V) float32
    seen: torch.Tensor | None = None  # (R, V) bool
    presence: torch.Tensor | None = None  # (R,) float32
    frequency: torch.Tensor | None = None  # (R,) float32
    repetition: torch.Tensor | None = None  # (R,) float32
    mask_rows: torch.Tensor | None = None  # (M,) int64: a stop token of a row still short of min_tokens
    mask_ids: torch.Tensor | None = None  # (M,) int64
    bias_rows: torch.Tensor | None = None  # (K,) int64: a token of a row with a logit_bias
    bias_ids: torch.Tensor | None = None  # (K,) int64
    bias_values: torch.Tensor | None = None  # (K,) float32
    allowed_rows: torch.Tensor | None = None  # (A,) int64: a row whose sample follows a grammar or allowed_token_ids
    allowed_bitmask: torch.Tensor | None = None  # (A, W) int32: the tokens each may take, packed
    grammar_rows: torch.Tensor | None = None  # (G,) int64: a row whose sample follows a grammar (logprobs see it)
    grammar_bitmask: torch.Tensor | None = None  # (G, W) int32: the tokens its grammar allows, packed

    @classmethod
    def build(
        cls,
        penalised: list[tuple[int, list[int], list[int], float, float, float]],
        masked: list[tuple[int, list[int]]],
        vocab: int,
        device: torch.device,
    ) -> LogitsProcessing | None:
        """penalised: (row, prompt ids, completion ids, presence, frequency, repetition) per penalised row;
        masked: (row, stop ids to mask) per row short of its min_tokens, and (row, ids, biases) per row with a
        logit_bias (the biases to add to those ids' logits), and (row, constraint) per row that may take only the
        tokens its constraint allows (see packed_allowed; allowed_token_ids beside a grammar as (row, packed ids,
        packed stop ids): see both_allowed). None when there is nothing to do."""
        if not penalised and not masked:
            return None
        processing = cls()
        allowed = [entry for entry in masked if not isinstance(entry[1], list)]
        masked = [entry for entry in masked if isinstance(entry[1], list)]
        biased = [entry for entry in masked if len(entry) == 3]
        masked = [entry for entry in masked if len(entry) == 2]
        if allowed:
            # (A, W) int32 on the host, one entry per row
            packed = packed_allowed([entry[1] for entry in allowed])
            ends = {entry[0]: entry[2] for entry in allowed if len(entry) == 3}
            rows, bitmask = both_allowed([entry[0] for entry in allowed], packed, ends)
            processing.allowed_rows = to_device(np.asarray(rows, dtype=np.int64), device)
            processing.allowed_bitmask = to_device(bitmask.numpy(), device)
            grammars = [a for a, entry in enumerate(allowed) if not isinstance(entry[1], torch.Tensor)]
            if len(grammars) == len(allowed):  # (no allowed_token_ids: the same rows and masks)
                processing.grammar_rows = processing.allowed_rows
                processing.grammar_bitmask = processing.allowed_bitmask
            elif grammars:
                grammar_rows = np.asarray([allowed[a][0] for a in grammars], dtype=np.int64)
                processing.grammar_rows = to_device(grammar_rows, device)
                processing.grammar_bitmask = to_device(packed[grammars].numpy(), device)
            if masked:  # (a row short of its min_tokens: its allowed tokens, looked up only then)
                short = {row for row, _ in masked}
                masked = unmask_grammar_ends(masked, {r: bitmask[a] for a, r in enumerate(rows) if r in short}, vocab)
        if biased:
            ids, rows = _flat([ids for _, ids, _ in biased])
            processing.bias_ids = to_device(ids, device)
            processing.bias_rows = to_device(np.asarray([biased[r][0] for r in rows], dtype=np.int64), device)
            values = np.fromiter((b for _, _, biases in biased for b in biases), dtype=np.float64, count=len(ids))
            # a bias beyond float32 (inf, 1e39) as float32's largest: a logit then never becomes inf, which the
            # sampler's softmax (inf - inf) would turn into NaN; -3.4e38 still gives the token probability 0
            finite = float(np.finfo(np.float32).max)
            values = np.clip(values, -finite, finite).astype(np.float32)
            processing.bias_values = to_device(values, device)
        if penalised:
            rows, prompts, completions, presence, frequency, repetition = zip(*penalised)

            def counts(lists: tuple[list[int], ...]) -> torch.Tensor:  # (R, V)
                ids, index = _flat(lists)
                return token_counts(to_device(ids, device), to_device(index, device), len(rows), vocab)

            processing.output_counts = counts(completions)
            processing.seen = (counts(prompts) > 0) | (processing.output_counts > 0)
            processing.rows = to_device(np.asarray(rows, dtype=np.int64), device)
            processing.presence, processing.frequency, processing.repetition = (
                to_device(np.asarray(values, dtype=np.float32), device) for values in (presence, frequency, repetition)
            )
        if masked:
            ids, rows = _flat([ids for _, ids in masked])
            processing.mask_ids = to_device(ids, device)
            processing.mask_rows = to_device(np.asarray([masked[r][0] for r in rows], dtype=np.int64), device)
        return processing

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (B, V) -> processed (B, V) float32, a new tensor (the model's output is left as it was)."""
        logits = logits.float()
        if self.bias_rows is not None:
            logits = logits.index_put((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        if self.rows is not None:
            penalised = apply_penalties(
                logits[self.rows], self.output_counts, self.seen, self.presence, self.frequency, self.repetition
            )  # (R, V)
            logits = logits.index_put((self.rows,), penalised)
        if self.mask_rows is not None:
            logits = mask_tokens(logits, self.mask_rows, self.mask_ids)
        if self.allowed_rows is not None:
            logits = seam("apply_token_bitmask", apply_token_bitmask)(logits, self.allowed_rows, self.allowed_bitmask)
        return logits


def unmask_grammar_ends(masked: list[tuple[int, list[int]]], allowed: dict[int, torch.Tensor], vocab: int) -> list:
    """masked: (row, stop ids) per row short of its min_tokens; allowed: a constrained row's packed (W,) bitmask ->
    the masks to apply: without those of rows whose grammar allows no token but those stop ids (its grammar is
    complete; masking them would leave the row nothing to sample), with a warning."""
    kept = []
    for row, ids in masked:
        if row in allowed:
            others = unpack_bitmask(allowed[row][None], vocab)[0]  # (V,) bool
            others[ids] = False
            if not others.any():
                warnings.warn(
                    "a constrained sample ends before its min_tokens: its grammar is complete and allows only a stop "
                    "token (or its allowed_token_ids are stop tokens only)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
        kept.append((row, ids))
    return kept


def pack_token_ids(ids: list[int], vocab: int) -> torch.Tensor:
    """Token ids -> (ceil(vocab / 32),) int32 with bit t % 32 of word t // 32 set for each: packed_allowed's form."""
    ids = np.asarray(ids, dtype=np.int64)
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return torch.from_numpy(words.view(np.int32))


def both_allowed(
    rows: list[int], bitmask: torch.Tensor, ends: dict[int, torch.Tensor] | None = None
) -> tuple[list[int], torch.Tensor]:
    """rows (A,) and their packed (A, W) allowed tokens -> one entry per row: a row with two (a grammar and
    allowed_token_ids) may take only the tokens both allow. Where those are none (the grammar wants a token that
    allowed_token_ids leave out: the request's check saw only its first token), the row takes its packed stop ids
    from `ends` instead: the sample ends there, its text short of the grammar, rather than take
    whatever token an all -inf row would give (token 0: "!" in Qwen's vocabulary)."""
    if len(set(rows)) == len(rows):
        return rows, bitmask
    merged: dict[int, torch.Tensor] = {}
    for row, words in zip(rows, bitmask):
        merged[row] = words if row not in merged else merged[row] & words
    for row, stops in (ends or {}).items():
        if not merged[row].any():  # (its grammar then refuses the stop token, and warns: GrammarConstraint.accept)
            merged[row] = stops
    return list(merged), torch.stack(list(merged.values()))


def packed_allowed(constraints: list) -> torch.Tensor:
    """The allowed tokens of each row's constraint (anything with `allowed()` -> a packed (W,) int32 tensor, or a
    packed tensor itself: allowed_token_ids'), stacked: (A, W) int32 on the host. Where every constraint that is not
    a tensor is of one class that can fill many at once (`allowed_batch`), it does: a grammar library fills its
    matchers in parallel."""
    given = [i for i, c in enumerate(constraints) if isinstance(c, torch.Tensor)]
    pending = [i for i, c in enumerate(constraints) if not isinstance(c, torch.Tensor)]
    if not pending:
        return torch.stack(constraints)
    kind = type(constraints[pending[0]])
    if hasattr(kind, "allowed_batch") and all(type(constraints[i]) is kind for i in pending):
        filled = kind.allowed_batch([constraints[i] for i in pending])  # (P, W)
    else:
        filled = torch.stack([constraints[i].allowed() for i in pending])
    if not given:  # (every row a constraint's: the filled rows as they are, not split and stacked again)
        return filled
    packed = filled.new_empty(len(constraints), filled.shape[1])
    packed[pending], packed[given] = filled, torch.stack([constraints[i] for i in given])
    return packed


def _flat(lists: list[list[int]] | tuple[list[int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ids -> (all ids (T,), the index of the list each came from (T,)), int64."""
    lengths = [len(ids) for ids in lists]
    ids = np.fromiter((t for part in lists for t in part), dtype=np.int64, count=sum(lengths))
    return ids, np.repeat(np.arange(len(lists), dtype=np.int64), lengths)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a device tensor, without waiting for the device (a pageable copy would wait for the step)."""
    host = torch.from_numpy(array)
    if device.type == "cuda":  # from pinned memory, so the copy does not block the host
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
