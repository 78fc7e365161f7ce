"""A step's flat inputs, as pure functions of the scheduled sequences: what the model runner uploads.

Prefill: every scheduled sequence contributes the tokens it has not computed yet (its chunk), all concatenated into
`input_ids (N,)` and `positions (N,)`; `cu_seqlens_q` marks where each one starts. Decode: every sequence
contributes its last token (and, where a step checks tokens proposed after it, those too: `query_len` per
sequence), and `context_lens` + `block_tables` tell attention where each history lies in the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class PrefillMetadata(NamedTuple):
    """A prefill step's flat inputs, as Python lists (the model runner makes them arrays)."""

    input_ids: list[int]  # (N,): every sequence's new tokens, one after the other
    positions: list[int]  # (N,): each token's position inside its own sequence
    cu_seqlens_q: list[int]  # (num_seqs + 1,): where each sequence's new tokens start in the flat stream
    cu_seqlens_k: list[int]  # (num_seqs + 1,): the same for its keys, cached history included
    slot_mapping: list[int]  # (N,): the cache slot each new token's K/V goes to


def prefill_metadata(
    token_ids: list[list[int]],
    num_cached: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> PrefillMetadata:
    """The flat inputs of a prefill step over sequences b = 0, 1, ...

    Sequence b has token_ids[b]; its first num_cached[b] tokens already have K/V in the cache (prefix-cache
    hits, earlier chunks), and this step computes the next num_new[b]. Token t of sequence b lives in cache
    slot block_tables[b][t // block_size] * block_size + t % block_size.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    for tokens, start, count, table in zip(token_ids, num_cached, num_new, block_tables):
        end = start + count
        input_ids.extend(tokens[start:end])
        positions.extend(range(start, end))
        slot_mapping.extend(table[t // block_size] * block_size + t % block_size for t in range(start, end))
        cu_seqlens_q.append(cu_seqlens_q[-1] + count)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)  # keys: the history plus this chunk
    return PrefillMetadata(input_ids, positions, cu_seqlens_q, cu_seqlens_k, slot_mapping)


def prefill_arrays(flat: PrefillMetadata | tuple) -> dict[str, np.ndarray]:
    """prefill_metadata's lists as int64 arrays, by name (a learner's function may return a plain tuple)."""
    return {name: np.asarray(values, dtype=np.int64) for name, values in zip(PrefillMetadata._fields, flat)}


def decode_arrays(
    input_ids: np.ndarray, first_positions: np.ndarray, tables: np.ndarray, block_size: int
) -> dict[str, np.ndarray]:
    """A decode step's flat inputs, vectorised over the batch (in the plain loop this runs every decode step
    while the GPU waits).

    input_ids (B, Lq): each sequence's Lq query tokens (Lq = 1: its last token); first_positions (B,): the first
    one's position; tables (B, width): the block tables, -1 padded. The Lq queries of a sequence are causal among
    themselves, and its context ends after its last query.
    """
    num_seqs, query_len = input_ids.shape
    positions = (first_positions[:, None] + np.arange(query_len)).ravel()  # (B * Lq,)
    rows = np.repeat(np.arange(num_seqs), query_len)  # (B * Lq,): each token's sequence
    slots = tables[rows, positions // block_size] * block_size + positions % block_size  # (B * Lq,)
    return dict(input_ids=input_ids.ravel(), positions=positions, slot_mapping=slots,
                context_lens=first_positions + query_len, block_tables=tables)  # fmt: skip


# When cascade attention pays. 256 shared tokens is vLLM's threshold. Sequences: on an H100 (kernel_bench.py
# --cascade, benchmarks/results/kernels_cascade_h100.md; a 1,024-token prefix) it was 12-21% faster than plain decode
# at 64-256 sequences and 13-21% slower at 8 and 16, where its prefix pass and merge cost more than the prefix reads
# they save (the L2 cache serves most of those once the first sequence has read them). vLLM starts at 8
CASCADE_MIN_PREFIX = 256  # shared tokens
CASCADE_MIN_SEQS = 64  # sequences sharing them


def shared_prefix_lens(
    tables: np.ndarray,
    first_positions: np.ndarray,
    block_size: int,
    min_tokens: int = CASCADE_MIN_PREFIX,
    min_seqs: int = CASCADE_MIN_SEQS,
) -> np.ndarray | None:
    """(B,): P for each sequence of a decode step that starts with the prefix most of them read from the same cache
    blocks (a system prompt the prefix cache shares), 0 for the others; for cascade attention to read those P
    tokens once. None where fewer than min_seqs sequences share a prefix of min_tokens tokens.

    tables (B, width): the block tables, -1 padded; first_positions (B,): each sequence's first query position. The
    sharing sequences are those whose first block is the most common first block (a block id names the same tokens
    in every table that holds it); their prefix runs while all their tables agree, and stops at the first query of
    any of them (every query must see all of it).
    """
    first = tables[:, 0]
    ids, counts = np.unique(first[first >= 0], return_counts=True)
    if not len(ids) or counts.max() < min_seqs:
        return None
    rows = first == ids[counts.argmax()]  # (B,) the sequences with the most common first block
    first_query = int(first_positions[rows].min())
    limit = -(-first_query // block_size)  # the blocks before the earliest first query: no later one can count
    group = tables[rows, :limit]  # (G, limit)
    same = (group == group[0]).all(axis=0) & (group[0] >= 0)  # (limit,) the block is all of theirs
    blocks = limit if same.all() else int(same.argmin())  # the leading run of shared blocks
    tokens = min(blocks * block_size, first_query)
    return np.where(rows, tokens, 0) if tokens >= min_tokens else None


@dataclass
class StepInputs:
    """One step's flat inputs on the host, every one an int array: all a rank needs to run the forward."""

    is_prefill: bool
    # prefill: input_ids, positions, cu_seqlens_q, cu_seqlens_k, slot_mapping (+ block_tables with cached history)
    # decode: input_ids, positions, slot_mapping, context_lens, block_tables (+ shared_prefix_lens where many
    # sequences share a prefix: cascade attention)
    arrays: dict[str, np.ndarray]
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    all_logits: bool = False  # logits for every token, not only each sequence's last (a step that checks them all)
    decode_query_len: int = 1  # decode: query tokens per sequence (more where a step checks proposed tokens)
