"""Token embedding and the LM head.

In prefill only each sequence's last token needs logits (it is the one whose next token gets
sampled), so the head keeps the rows at `cu_seqlens_q[1:] - 1` before the big vocab matmul:
(N, hidden) -> (num_seqs, hidden) -> (num_seqs, vocab). In decode N already equals num_seqs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoref.utils.context import get_context
from nanoref.utils.tracing import trace


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.weight)  # (N,) -> (N, hidden)
        trace("embed_tokens", input_ids=input_ids, hidden=hidden)
        return hidden


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if context.is_prefill and context.cu_seqlens_q is not None:
            last_rows = context.cu_seqlens_q[1:].long() - 1  # (num_seqs,): each sequence's last token
            hidden = hidden[last_rows]  # (N, hidden) -> (num_seqs, hidden)
        logits = F.linear(hidden, self.weight)  # (num_seqs, vocab)
        trace("lm_head", hidden=hidden, logits=logits)
        return logits
