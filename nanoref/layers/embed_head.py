"""Token embedding and the LM head.

In prefill only each sequence's last token needs logits (it is the one whose next token gets
sampled), so the head keeps the rows at `cu_seqlens_q[1:] - 1` before the big vocab matmul:
(N, hidden) -> (num_seqs, hidden) -> (num_seqs, vocab). In decode N already equals num_seqs.

Under tensor parallelism both are vocab-parallel: rank r holds rows [r V/N, (r+1) V/N) of the table
(the last rank's share padded with zero rows when N does not divide V). The embedding looks up the ids
that fall in its rows, writes zeros for the others, and an all-reduce fills every row; the head computes
its slice of the logits and rank 0 gathers the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoref.parallel.state import all_reduce, gather_last_dim, get_parallel_state, shard_range
from nanoref.utils.context import get_context
from nanoref.utils.seams import seam
from nanoref.utils.tracing import trace
from nanoref.utils.weak import WeakBoundMethod


def vocab_parallel_embed(
    input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int
) -> torch.Tensor:
    """One rank's share of the embedding lookup: the rows of the ids in [vocab_start, vocab_end), zeros elsewhere.

    input_ids: (N,) int64, any id of the whole vocabulary. weight: (rows, hidden), this rank's rows of the table:
    row j holds id vocab_start + j; rows from vocab_end - vocab_start on are padding. Returns (N, hidden) in
    weight's dtype. Every id lies in exactly one rank's range, so the ranks' outputs add up to the full lookup.
    """
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)  # (N,): ids in this rank's rows
    local_ids = (input_ids - vocab_start) * mine  # others look up row 0, zeroed just below
    return F.embedding(local_ids, weight) * mine.unsqueeze(-1).to(weight.dtype)  # (N, hidden)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, self.parallel.rank, self.parallel.world_size
        self.vocab_start, self.vocab_end = shard_range(vocab_size, self.tp_rank, self.tp_size)
        rows = -(-vocab_size // self.tp_size)  # every rank the same shape: the last ranks' tails are zero padding
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.weight.weight_loader = WeakBoundMethod(self.weight_loader)  # (weakly: no layer <-> parameter cycle)
        self.weight.shard_of = WeakBoundMethod(self.shard)  # the loader's tied-head check compares this rank's rows
        self.weight.full_shape = (vocab_size, hidden_size)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole (vocab, hidden) table."""
        return full[self.vocab_start : self.vocab_end]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {expected}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(self.shard(loaded_weight))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            hidden = F.embedding(input_ids, self.weight)  # (N,) -> (N, hidden)
        else:
            hidden = seam("vocab_parallel_embed", vocab_parallel_embed)(
                input_ids, self.weight, self.vocab_start, self.vocab_end
            )  # (N, hidden): this rank's rows, zeros for the other ranks' ids
            # each token's row came from exactly one rank
            hidden = all_reduce(hidden, self.parallel, "embed_tokens.all_reduce")
        trace("embed_tokens", input_ids=input_ids, hidden=hidden)
        return hidden


class LMHead(VocabEmbedding):
    """The vocab-sized output matmul (a vocab-parallel table, like the embedding: weights may be tied)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if context.is_prefill and context.cu_seqlens_q is not None and not context.all_logits:
            last_rows = context.cu_seqlens_q[1:].long() - 1  # (num_seqs,): each sequence's last token
            hidden = hidden[last_rows]  # (N, hidden) -> (num_seqs, hidden)
        logits = F.linear(hidden, self.weight)  # (num_seqs, ceil(vocab / tp_size)): this rank's rows
        if self.tp_size > 1:
            # rank 0: (num_seqs, tp_size * ceil(vocab / tp_size)); other ranks: None
            logits = gather_last_dim(logits, self.parallel, "lm_head.gather")
            if logits is None:
                return None
            logits = logits[:, : self.vocab_size]  # drop the padding rows' columns
        trace("lm_head", hidden=hidden, logits=logits)
        return logits
