"""Which proposed tokens the target keeps: the acceptance rule, for greedy and for sampled requests.

A verify step scores sequence b's last token and its k proposals d_1..d_k in one forward: row i of its logits is
the target's distribution p_i for the token after d_i (row 0: after the last token), so there are k + 1 rows.

Greedy: keep d_1..d_j while each equals the target's argmax at its row, then add the target's own argmax at the
first row that disagrees (or at row k, the bonus row, when all k agree): j + 1 tokens, exactly the tokens plain
greedy decoding would have made, one step at a time.

Sampled (Leviathan et al. 2023; Chen et al. 2023): the proposer drew d_i from its distribution q_i (one-hot at d_i
for a deterministic proposer such as n-gram lookup). Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
the first rejection, draw the replacement from the residual max(0, p_i - q_i), normalised, and stop. Why the
kept token is distributed as p_i: it is x = d_i accepted, with probability q(x) min(1, p(x)/q(x)) = min(q(x), p(x)),
or a rejection followed by x from the residual, with probability (1 - sum_y min(q(y), p(y))) (p(x) - min(q(x),
p(x))) / (1 - sum_y min(q(y), p(y))) = p(x) - min(q(x), p(x)); the two add up to p(x). The rows after a rejection
are never used, and when all k are accepted the bonus row's token is drawn from p_k itself.

Both rules sit behind seams (`accept_greedy`, `rejection_sample`): a learner's version runs in the real engine.
"""

from __future__ import annotations

import torch


def accept_greedy(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """draft_ids: a sequence's k proposals; target_ids: the target's argmax at its k + 1 verify rows -> the tokens
    it gains: the proposals up to the first that differs from the target's, then the target's token there."""
    for index, (draft, target) in enumerate(zip(draft_ids, target_ids)):
        if draft != target:
            return [*draft_ids[:index], target]
    return [*draft_ids, target_ids[len(draft_ids)]]


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule on every verify row of the step at once (the flat layout: sequences' rows one after
    the other).

    p: (T, V) the target's probabilities at each row (temperature, top-k, top-p applied); q: (T, V) the draft's
    probabilities its proposal was drawn from, or None for a deterministic proposer (one-hot at draft_ids);
    draft_ids: (T,) int64 the proposal each row checks, -1 on a sequence's bonus row (after its last proposal);
    uniforms: (T,) U[0, 1) draws; noise: (T, V) Exp(1) draws.
    -> (accepted (T,) bool: the row's proposal is kept; recovered (T,) int64: the token the row emits when its
    proposal is rejected, drawn from the residual max(0, p - q) normalised, or from p on a bonus row).

    The draws come from the caller, so a seeded request draws from its own generator. The residual is sampled with
    the exponential race (argmax of weights / Exp(1) noise: no normalisation needed).
    """
    has_draft = draft_ids >= 0  # (T,)
    ids = draft_ids.clamp(min=0)[:, None]  # (T, 1)
    p_draft = p.gather(1, ids)[:, 0]  # (T,)
    if q is None:  # one-hot q: accept with probability p(d); the residual is p without d
        q_draft = torch.ones_like(p_draft)
        residual = p.scatter(1, ids, 0.0)
    else:
        q_draft = q.gather(1, ids)[:, 0]
        residual = (p - q).clamp(min=0)
    accepted = has_draft & (uniforms * q_draft < p_draft)  # u < p / q, without dividing by a q of 0
    residual = torch.where(has_draft[:, None], residual, p)  # (T, V): a bonus row samples p itself
    # where q >= p everywhere (q == p, in floats) a rejection is (nearly) impossible; its empty residual falls back
    # to p rather than to an argmax over zeros
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    recovered = (residual / noise).argmax(dim=-1)  # (T,)
    return accepted, recovered


def emitted_tokens(draft_ids: list[int], accepted: list[bool], recovered: list[int]) -> list[int]:
    """One sequence's k proposals and its k + 1 rows' (accepted, recovered) -> the tokens it gains: its proposals
    while accepted, then the recovered token of the first row that was not (the bonus row's when none was)."""
    for index in range(len(draft_ids)):
        if not accepted[index]:
            return [*draft_ids[:index], recovered[index]]
    return [*draft_ids, recovered[len(draft_ids)]]
