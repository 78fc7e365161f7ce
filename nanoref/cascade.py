"""Cascade attention, attached from outside: a prefix that many sequences of a decode step share, read once for them.

When requests start with the same system prompt, the prefix cache gives them the same blocks for it, and plain
decode still reads those blocks once per sequence. Before each decode step the hook made by `attach` finds the
sequences that share the most common prefix (`shared_prefix_lens`) and publishes their prefix lengths as
`Context.shared_prefix_lens`; the attention layer hands them to a backend whose decode reads such a prefix once
(`AttentionBackend.decode_shared_prefix`: Triton's `paged_decode_attention`, ops/attention_triton.py), and the decode
graphs replay a graph recorded for such steps (cuda_graphs.py). The tokens are the same either way.
`LLM(disable_cascade_attn=True)` (vLLM's name) leaves it off. Wired in nanoref/llm.py.
"""

from __future__ import annotations

import numpy as np

from nanoref.engine.hooks import StepHook
from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs
from nanoref.utils.context import get_context, upload_arrays

# When cascade attention pays. 256 shared tokens is vLLM's threshold. Sequences: on an H100 (kernel_bench.py
# --cascade, benchmarks/results/kernels_cascade_h100.md and kernels_cascade_32_h100.md; a 1,024-token prefix) it
# was 11-21% faster than plain decode at 48-256 sequences and 10-21% slower at 8-32, where its prefix pass and merge
# cost more than the prefix reads they save (the L2 cache serves most of those once the first sequence has read
# them). vLLM starts at 8
CASCADE_MIN_PREFIX = 256  # shared tokens
CASCADE_MIN_SEQS = 48  # sequences sharing them


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


def reads_shared_prefixes(runner) -> bool:
    """Whether the runner's decode steps use cascade attention: its backend's decode reads a shared prefix once, and
    the config does not turn it off."""
    return runner.backend.decode_shared_prefix and not runner.config.disable_cascade_attn


def attach(runner) -> StepHook | None:
    """RunnerHooks.attach: before each decode step, the sequences' shared prefix lengths into the step's Context."""
    if not reads_shared_prefixes(runner):
        return None
    # (what the hook needs, not the runner: the runner holds the hook, and a hook holding the runner back would keep
    # a dropped engine's KV cache alive until a cyclic collection)
    block_size, device = runner.block_size, runner.device

    def set_shared_prefix_lens(seqs: list[Sequence], step: StepInputs) -> None:
        if step.is_prefill:
            return
        arrays = step.arrays
        first_positions = arrays["context_lens"] - step.decode_query_len  # (B,) each sequence's first query
        lens = shared_prefix_lens(arrays["block_tables"], first_positions, block_size)
        if lens is not None:
            get_context().shared_prefix_lens = upload_arrays({"lens": lens}, device)["lens"]  # (B,) int32

    return set_shared_prefix_lens
