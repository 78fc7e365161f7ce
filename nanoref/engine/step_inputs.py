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


@dataclass
class StepInputs:
    """One step's flat inputs on the host, every one an int array: all a rank needs to run the forward."""

    is_prefill: bool
    # prefill: input_ids, positions, cu_seqlens_q, cu_seqlens_k, slot_mapping (+ block_tables with cached history)
    # decode: input_ids, positions, slot_mapping, context_lens, block_tables
    arrays: dict[str, np.ndarray]
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    all_logits: bool = False  # logits for every token, not only each sequence's last (a step that checks them all)
    decode_query_len: int = 1  # decode: query tokens per sequence (more where a step checks proposed tokens)
