"""Sampling one next token per sequence from the last-token logits.

temperature 0 is greedy (argmax). Otherwise: scale by 1/temperature, keep the top_k largest logits
and the smallest set whose probability reaches top_p, then draw. The draw uses the exponential-race
trick (argmax of p / E with E ~ Exp(1) is a sample from p), which needs no sort and lets a seeded
request draw its noise from its own generator, so its output does not depend on its batch.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoref.utils.seams import seam


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) float32; top_k: (B,) int (0 = off); top_p: (B,) float (1.0 = off) -> masked (B, V)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]  # (B, 1)
    drop = ranks >= k  # (B, V): beyond the top k
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V): probability of the better-ranked tokens
    # the nucleus already reached top_p without this token; top_p 1.0 is "off", not a threshold: float32
    # sums can reach 1.0 before the tail, which would drop it from rows that never asked for top_p
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generators: list[torch.Generator | None] | None = None,
        default_generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """logits: (B, V); temperatures, top_k, top_p: (B,) -> next token ids (B,).

        generators: a seeded request's own generator per row (None: unseeded). Unseeded rows draw from
        `default_generator` (the engine's own, so the caller's global RNG is never touched).
        """
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)  # (B,)
        sampled = temperatures > 0
        if not bool(sampled.any()):
            return greedy_ids
        scaled = logits / temperatures.clamp(min=1e-5)[:, None]  # (B, V)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            scaled = seam("apply_top_k_top_p", apply_top_k_top_p)(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)  # (B, V)
        noise = torch.empty_like(probs)  # (B, V)
        seeded = [(row, g) for row, g in enumerate(generators or []) if g is not None]
        if len(seeded) < probs.shape[0]:
            noise.exponential_(generator=default_generator)
        for row, generator in seeded:
            noise[row] = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generator)
        sampled_ids = (probs / noise).argmax(dim=-1)  # (B,)
        return torch.where(sampled, sampled_ids, greedy_ids)
