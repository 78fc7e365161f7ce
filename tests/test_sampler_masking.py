"""top-k / top-p masking row by row: a row's settings never leak into another row of the batch."""

from __future__ import annotations

import torch

from nanoref.layers.sampler import apply_top_k_top_p


def test_rows_without_top_p_keep_their_whole_tail():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4096, generator=g) * 4  # peaked rows: float32 sums reach 1.0 before the tail
    top_k = torch.tensor([5, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    assert int(torch.isfinite(masked[0]).sum()) == 5
    assert bool(torch.isfinite(masked[1]).all()), "a row with top_k 0 and top_p 1.0 lost tokens"
    kept = torch.isfinite(masked[2])
    probs = logits[2].softmax(-1)
    assert probs[kept].sum() >= 0.9 and kept.sum() < 4096
