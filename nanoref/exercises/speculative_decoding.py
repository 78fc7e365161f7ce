"""Checks for notebook 12's exercises: the acceptance rule of speculative decoding, greedy and sampled.

`accept_greedy(draft_ids, target_ids)` keeps the proposals up to the first one the target's argmax disagrees with,
then the target's own token; `rejection_sample(p, q, draft_ids, uniforms, noise)` keeps a proposal with probability
min(1, p/q) and draws a rejected row's token from the residual max(0, p - q) (a bonus row's from p). Each check runs
the learner's function on fresh random cases against nanoref's own (the draws come from the caller, so a sampled
row's outcome is exact too, and the emitted tokens are counted against p with a chi-square test), then runs the
speculative engine with it in place: greedy must generate HF transformers' tokens, sampled the target's distribution
and exactly the tokens nanoref's own rule draws from the same seeds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    check_generation,
    describe,
    generate_with,
    hf_model,
    input_generator,
    random_prompts,
    tiny_model,
)
from nanoref.speculative.acceptance import accept_greedy, rejection_sample
from nanoref.testing import EVERY_STEP

ALPHA = 1e-4  # each distribution check's false-alarm rate for a correct rule (its draws are seeded: fixed verdicts)


def _rng(seed: int | None) -> random.Random:
    return random.Random(int(input_generator(seed).initial_seed()))


# -- accept_greedy ------------------------------------------------------------------------------------------------
def _greedy_cases(rng: random.Random) -> Iterator[tuple[str, list[int], list[int]]]:
    """(description, draft_ids, target_ids): the situations that trip answers up, then random ones."""
    yield "the target agrees with every proposal", [4, 5, 6], [4, 5, 6, 1]
    yield "the first proposal already disagrees", [4, 5, 6], [3, 5, 6, 1]
    yield "the second proposal disagrees and the third agrees again", [4, 5, 6], [4, 9, 6, 1]
    yield "no proposal (an n-gram lookup found none: a plain decode row)", [], [7]
    yield "each proposal equals the target's token one row later", [5, 6, 7], [4, 5, 6, 7]
    yield "one proposal, kept", [3], [3, 8]
    yield "one proposal, rejected", [3], [2, 8]
    yield "the last proposal disagrees", [1, 2, 3, 4], [1, 2, 3, 0, 9]
    for _ in range(300):
        k = rng.randint(0, 6)
        target = [rng.randrange(5) for _ in range(k + 1)]  # a small vocabulary: agreements are common
        draft = list(target[:k])
        if k and rng.random() < 0.7:  # most runs end at a disagreement; a few are all kept
            at = rng.randrange(k)
            draft[at] = (draft[at] + rng.randint(1, 4)) % 5
            for index in range(at + 1, k):  # what follows a disagreement is anything
                draft[index] = rng.randrange(5)
        yield "random proposals", draft, target


def _shifted_row(draft: list[int], target: list[int]) -> list[int]:
    """The answer of a rule that compares proposal i with the target's token one row later."""
    for index, token in enumerate(draft):
        if token != target[index + 1]:
            return [*draft[:index], target[index + 1]]
    return [*draft, target[-1]]


def _greedy_hint(draft: list[int], target: list[int], got: list[int], want: list[int]) -> str:
    """What to fix, from how `got` differs from `want`."""
    k, kept = len(draft), len(want) - 1  # kept: the proposals the target agrees with, before the first that differs
    if not draft:
        return (
            "with no proposal the verify step is a plain decode step: the sequence gains the target's token at row 0, "
            "[target_ids[0]]"
        )
    if kept == k and got == draft:
        return (
            f"the target agrees with all {k} proposals: also add its token at row {k}, the bonus row (target_ids[k], "
            "scored after the last proposal), so a fully accepted step gains k + 1 tokens"
        )
    if got == draft[:kept]:
        return (
            f"proposal {kept} ({draft[kept]}) differs from the target's token {target[kept]} at row {kept}: the "
            "sequence still gains that token of the target's, after the kept proposals"
        )
    if kept < k and got == draft[: kept + 1]:
        return (
            f"proposal {kept} ({draft[kept]}) differs from the target's token {target[kept]} at row {kept}: emit the "
            "target's token there, not the rejected proposal"
        )
    if kept == k and len(got) == k + 1 and got[:k] == draft:
        return (
            f"the target agrees with all {k} proposals: the token after them is the target's at row {k}, the bonus "
            f"row (target_ids[k] = {target[k]}, the last of the k + 1 rows), not {got[k]}"
        )
    if got == _shifted_row(draft, target) or (kept < k and got == [*draft[:kept], target[kept + 1]]):
        return (
            "compared with the wrong row: row i of target_ids is the target's token after the last token and "
            "d_1..d_i, so proposal i (draft_ids[i], 0-based) must equal target_ids[i]"
        )
    if len(got) > len(want) and got[: len(want) - 1] == want[:-1]:
        return (
            f"stop at the first proposal that differs (proposal {kept}): the rows after it were scored after a token "
            "the sequence does not have, so nothing after it counts, even where it agrees again"
        )
    return (
        f"keep the proposals while each equals the target's token at its row (here the first {kept}), then add the "
        f"target's token at the row that first differs (or the bonus row, row {k}, when none does)"
    )


def check_accept_greedy(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(draft_ids, target_ids) -> the tokens gained` against nanoref's on fresh random proposals, then greedy
    speculative decoding with it in place, token-exact with HF transformers (`engine=False`: the first part only)."""
    for description, draft, target in _greedy_cases(_rng(seed)):
        case = f"draft_ids={draft}, target_ids={target}"
        want = accept_greedy(draft, target)
        given_draft, given_target = list(draft), list(target)
        got = call_learner(fn, "accept_greedy", given_draft, given_target, case=f"{description}: {case}")
        if given_draft != draft or given_target != target:
            raise ExerciseFailure(f"your accept_greedy changed draft_ids or target_ids; only read them\n({case})")
        if not isinstance(got, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise ExerciseFailure(f"return a list of token ids (ints), got {got!r}\n({case})")
        got = list(got)
        if got != want:
            raise ExerciseFailure(
                f"{description}: {_greedy_hint(draft, target, got, want)}\n{case}: you returned {got}, expected {want}"
            )
    if engine:
        check_speculative_greedy({"accept_greedy": fn})


def check_speculative_greedy(functions: dict[str, Callable]) -> None:
    """Greedy speculative decoding with the learner's `functions` in place, token for token against HF: a draft
    identical to the target (every proposal kept, every step ends on the bonus row), then a draft of other weights
    (rejections), each with 3 proposals a step. Each run must have called accept_greedy where it was meant to."""
    target = tiny_model()
    other = tiny_model(seed=11, num_hidden_layers=1)
    names = describe(functions)
    for draft, what, kept in ((target, "a draft identical to the target", True), (other, "a draft of other weights",
                                                                                 False)):  # fmt: skip
        engines: list[Any] = []
        calls = {"n": 0}
        counted = {name: _counted(f, calls) if name == "accept_greedy" else f for name, f in functions.items()}
        check_generation(
            counted,
            prompts=random_prompts(seed=77, lengths=[5, 19, 11], vocab=256),
            max_tokens=10,
            speculative_config={"model": draft, "num_speculative_tokens": 3, **EVERY_STEP},
            prepare=engines.append,
        )
        steps = [step for step in engines[0].metrics.steps if step.num_draft_tokens]
        if not calls["n"] or not steps:
            raise AssertionError(f"the engine with {what} never called accept_greedy: the check's setup is wrong")
        drafted = sum(step.num_draft_tokens for step in steps)
        accepted = sum(step.num_accepted_tokens for step in steps)
        if kept and accepted != drafted:
            raise ExerciseFailure(
                f"with {names} in the engine and {what}, {accepted} of {drafted} proposals were kept: a draft that is "
                "the target must have every proposal kept (the tokens matched HF only by the target's own tokens)"
            )


def _counted(function: Callable, calls: dict[str, int]) -> Callable:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return function(*args, **kwargs)

    return counted


# -- rejection_sample ---------------------------------------------------------------------------------------------
class _Case:
    """One call's inputs: p (T, V), q (T, V) or None, draft_ids (T,), uniforms (T,), noise (T, V)."""

    def __init__(self, description: str, p, q, draft_ids, uniforms, noise) -> None:
        self.description = description
        self.p = torch.as_tensor(p, dtype=torch.float32)
        self.q = None if q is None else torch.as_tensor(q, dtype=torch.float32)
        self.draft_ids = torch.as_tensor(draft_ids, dtype=torch.int64)
        self.uniforms = torch.as_tensor(uniforms, dtype=torch.float32)
        self.noise = torch.as_tensor(noise, dtype=torch.float32)

    def inputs(self) -> tuple:
        return self.p, self.q, self.draft_ids, self.uniforms, self.noise

    def text(self, row: int) -> str:
        """Row `row`'s inputs in words."""
        d = int(self.draft_ids[row])
        p, noise = self.p[row].tolist(), self.noise[row].tolist()
        q = "None (a deterministic proposer: one-hot at the draft id)" if self.q is None else _floats(self.q[row])
        return (
            f"row {row}: draft id {d}{' (a bonus row)' if d < 0 else ''}, u = {float(self.uniforms[row]):.4g}, "
            f"p = {_floats(p)}, q = {q}, noise = {_floats(noise)}"
        )


def _floats(values) -> str:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    shown = ", ".join(f"{v:.3g}" for v in values[:8])
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"


def _normalised(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True)


def _random_case(g: torch.Generator, rows: int, vocab: int, deterministic: bool, bonus_q: str) -> _Case:
    """Random p and q (some entries exactly 0, as top-k leaves them), proposals drawn from q, some bonus rows;
    bonus_q: what q holds on bonus rows, "zero" (as the engine passes it) or "noise" (anything: it is not read)."""
    p = torch.rand(rows, vocab, generator=g) ** 3
    p = _normalised(p * (torch.rand(rows, vocab, generator=g) > 0.2))
    p[p.sum(dim=-1).isnan()] = 1.0 / vocab  # a row whose every entry was masked
    q = torch.rand(rows, vocab, generator=g) ** 3
    q = _normalised(q * (torch.rand(rows, vocab, generator=g) > 0.2) + 1e-9)
    draft_ids = torch.multinomial(q, 1, generator=g)[:, 0]  # (T,)
    bonus = torch.rand(rows, generator=g) < 0.25
    draft_ids[bonus] = -1
    if bonus_q == "zero":
        q[bonus] = 0.0
    uniforms = torch.rand(rows, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    kind = "a deterministic proposer (q None)" if deterministic else f"a draft model's q (bonus rows' q: {bonus_q})"
    return _Case(f"random rows, {kind}", p, None if deterministic else q, draft_ids, uniforms, noise)


def _rejection_cases(g: torch.Generator) -> Iterator[_Case]:
    # first, the draws decide: 32 copies of a proposal with p(d) / q(d) = 0.5 and u spread over [0, 1) (kept
    # exactly where u < 0.5) beside 32 of one with p(d) / q(d) = 4 (always kept), then 32 rejected copies (p(d) = 0)
    # with noise that crowns a different token in turn: a rule that draws uniforms or noise of its own cannot match
    # them on any seed
    rows = 32
    u = [(row + 0.5) / rows for row in range(rows)]
    yield _Case("the given uniforms decide: proposals with p(d) / q(d) = 0.5 (and 4) 32 times each, u from 0.016 to "
                "0.98", [[0.35, 0.15, 0.25, 0.25]] * 2 * rows, [[0.0875, 0.3, 0.3, 0.3125]] * 2 * rows,
                [1] * rows + [0] * rows, u * 2, [[1.0] * 4] * 2 * rows)  # fmt: skip
    race = [[1.0 if token == row % 3 else 4.0 for token in range(4)] for row in range(rows)]  # row's winner: row % 3
    yield _Case("the given noise decides: one rejected proposal (p(d) = 0) 32 times, the noise varies",
                [[0.3, 0.3, 0.4, 0.0]] * rows, None, [3] * rows, u, race)  # fmt: skip
    ones = [[1.0] * 4] * 2
    yield _Case("a bonus row (draft id -1) with u = 0, after a kept proposal", [[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1,
                0.1]], None, [1, -1], [0.0, 0.0], ones)  # fmt: skip
    yield _Case("a bonus row whose q holds a distribution (the engine never reads it there)",
                [[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]], [[0.1, 0.7, 0.1, 0.1], [0.6, 0.1, 0.2, 0.1]], [1, -1],
                [0.5, 0.5], ones)  # fmt: skip
    yield _Case("p(d) > q(d): kept whatever u", [[0.1, 0.6, 0.2, 0.1]] * 2, [[0.2, 0.3, 0.3, 0.2]] * 2, [1, 1],
                [0.0, 0.999], ones[:1] * 2)  # fmt: skip
    yield _Case("p(d) = 0: rejected even for u = 0", [[0.5, 0.0, 0.5, 0.0]] * 2, [[0.2, 0.5, 0.2, 0.1]] * 2, [1, 3],
                [0.0, 0.5], ones)  # fmt: skip
    yield _Case("p(d) / q(d) = 0.5: kept for u = 0.3, rejected for u = 0.7", [[0.1, 0.3, 0.3, 0.3]] * 2,
                [[0.1, 0.6, 0.2, 0.1]] * 2, [1, 1], [0.3, 0.7], ones)  # fmt: skip
    yield _Case("a deterministic proposer (q None): kept for u < p(d), else rejected", [[0.1, 0.4, 0.3, 0.2]] * 2,
                None, [1, 1], [0.3, 0.5], ones)  # fmt: skip
    # a rejection where p's and the residual's winners differ, and one where the residual's has p - q < 0 nearby
    yield _Case("a rejection whose residual max(0, p - q) is not p", [[0.5, 0.2, 0.2, 0.1]], [[0.1, 0.8, 0.05, 0.05]],
                [1], [0.9], [[0.2, 1.0, 1.0, 0.02]])  # fmt: skip
    yield _Case("a rejection of a deterministic proposal: its residual is p without d", [[0.2, 0.6, 0.1, 0.1]], None,
                [1], [0.9], [[3.0, 1.0, 2.0, 4.0]])  # fmt: skip
    yield _Case("a rejection where q > p on most tokens (p - q < 0 there)", [[0.3, 0.1, 0.3, 0.3]],
                [[0.05, 0.05, 0.45, 0.45]], [2], [0.95], [[5.0, 0.01, 0.01, 0.02]])  # fmt: skip
    for index in range(12):
        rows, vocab = (64, [5, 8, 32][index % 3])
        yield _random_case(g, rows, vocab, deterministic=index % 2 == 0, bonus_q="noise" if index % 4 == 1 else "zero")


def _residual(case: _Case) -> torch.Tensor:
    """(T, V): what a row's token is drawn from when it emits no proposal: max(0, p - q) on rejected rows (p without
    d for a deterministic proposer), p on bonus rows."""
    p, has_draft = case.p, case.draft_ids >= 0
    ids = case.draft_ids.clamp(min=0)[:, None]
    residual = p.scatter(1, ids, 0.0) if case.q is None else (p - case.q).clamp(min=0)
    residual = torch.where(has_draft[:, None], residual, p)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _expect(got: Any, case: _Case) -> tuple[torch.Tensor, torch.Tensor]:
    rows = case.p.shape[0]
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise ExerciseFailure(f"return a pair of tensors (accepted, recovered), got {type(got).__name__}")
    accepted, recovered = got
    if tuple(accepted.shape) != (rows,) or accepted.dtype != torch.bool:
        raise ExerciseFailure(
            f"accepted should be a ({rows},) bool tensor, one per row, got {tuple(accepted.shape)} {accepted.dtype} "
            "(a comparison such as u * q_d < p_d gives bool)"
        )
    if tuple(recovered.shape) != (rows,) or recovered.dtype != torch.int64:
        raise ExerciseFailure(
            f"recovered should be a ({rows},) int64 tensor of token ids, got {tuple(recovered.shape)} {recovered.dtype}"
            " (argmax over the vocabulary axis gives it)"
        )
    vocab = case.p.shape[1]
    if ((recovered < 0) | (recovered >= vocab)).any():
        row = int(((recovered < 0) | (recovered >= vocab)).nonzero()[0])
        raise ExerciseFailure(f"recovered[{row}] = {int(recovered[row])} is not a token id in [0, {vocab})")
    return accepted, recovered


def _acceptance_hint(case: _Case, row: int, got: bool, accepted: torch.Tensor) -> str:
    d = int(case.draft_ids[row])
    if d < 0:
        return (
            "a bonus row (draft id -1) has no proposal: never accept it (draft_ids >= 0 is part of the rule); "
            "its token is drawn from p itself"
        )
    p_d = float(case.p[row, d])
    q_d = 1.0 if case.q is None else float(case.q[row, d])
    u = float(case.uniforms[row])
    has = case.draft_ids >= 0
    ids = case.draft_ids.clamp(min=0)[:, None]
    p_all = case.p.gather(1, ids)[:, 0]
    q_all = torch.ones_like(p_all) if case.q is None else case.q.gather(1, ids)[:, 0]
    reversed_rule = has & (case.uniforms * p_all < q_all)  # u < q/p
    if torch.equal(accepted & has, reversed_rule):
        return "the ratio is reversed: keep the proposal when u < p(d) / q(d) (u * q(d) < p(d)), not u < q(d) / p(d)"
    if torch.equal(accepted & has, has & (case.uniforms > p_all / q_all)):
        return "the comparison is reversed: keep the proposal when u < p(d) / q(d), i.e. with probability min(1, p/q)"
    row_0 = _reads_row_0(case, accepted)
    if row_0 is not None:
        return (
            f"you read row 0's {row_0}(d) for every row ({row_0}[0, draft_ids]): each row has its own distribution, "
            f"so row i's is {row_0}[i, draft_ids[i]]: gather per row, "
            f"{row_0}.gather(1, draft_ids.clamp(min=0)[:, None]) (here row {row}: p(d) = {p_d:.4g}, q(d) = {q_d:.4g}, "
            f"u = {u:.4g})"
        )
    if torch.equal(accepted & has, has):
        return (
            "you kept every proposal: keep one only when u < p(d) / q(d) (u * q(d) < p(d)), so that a proposal the "
            f"target finds less likely than the draft did is sometimes rejected (here row {row}: p(d) = {p_d:.4g}, "
            f"q(d) = {q_d:.4g}, u = {u:.4g})"
        )
    unordered = _not_decided_by_u(case, accepted)
    if unordered is not None:
        low, high = unordered
        return (
            f"you ignored the given uniform draws: rows {low} and {high} hold the same proposal, p and q, yet you "
            f"kept the one with u = {float(case.uniforms[high]):.4g} and rejected the one with u = "
            f"{float(case.uniforms[low]):.4g}; keep row i when uniforms[i] * q(d) < p(d), with the uniforms given "
            "(a draw of your own, torch.rand or a Generator, would not follow the request's seed)"
        )
    if p_d == 0.0:
        return f"p(d) = 0: the target never makes token {d}, so it is never kept, whatever u (u * q(d) < p(d) is False)"
    verdict = "keep" if p_d > u * q_d else "reject"
    return (
        f"p(d) = {p_d:.4g}, q(d) = {q_d:.4g}{' (q None: one-hot at d)' if case.q is None else ''}, u = {u:.4g}: "
        f"{verdict} it (keep when u < p(d) / q(d), i.e. u * q(d) < p(d)); you {'kept' if got else 'rejected'} it"
    )


def _reads_row_0(case: _Case, accepted: torch.Tensor) -> str | None:
    """'p' or 'q' where the learner's kept rows are those of the rule with row 0's p(d) (or q(d)) read for every row
    (p[0, draft_ids], one row's distribution indexed by every row's draft id), else None; rows within rounding of
    that rule's threshold are not compared."""
    has = case.draft_ids >= 0
    ids = case.draft_ids.clamp(min=0)
    p_d = case.p.gather(1, ids[:, None])[:, 0]
    q_d = torch.ones_like(p_d) if case.q is None else case.q.gather(1, ids[:, None])[:, 0]
    suspects = {"p": (case.p[0, ids], q_d)}
    if case.q is not None:
        suspects["q"] = (p_d, case.q[0, ids])
    for name, (p_rule, q_rule) in suspects.items():
        if torch.equal(p_rule, p_d) and torch.equal(q_rule, q_d):
            continue  # every row holds row 0's distribution: the two rules agree
        clear = (case.uniforms * q_rule - p_rule).abs() > 1e-6
        if torch.equal((accepted & has)[clear], (has & (case.uniforms * q_rule < p_rule))[clear]):
            return name
    return None


def _not_decided_by_u(case: _Case, accepted: torch.Tensor) -> tuple[int, int] | None:
    """Two rows with the same proposal, p and q where the learner kept the one with the larger u and rejected the
    one with the smaller (a rule that reads u keeps a prefix of them in u's order), else None."""
    rows: dict[tuple, list[int]] = {}
    for row in range(len(case.draft_ids)):
        d = int(case.draft_ids[row])
        if d >= 0:
            q_row = None if case.q is None else tuple(case.q[row].tolist())
            rows.setdefault((d, tuple(case.p[row].tolist()), q_row), []).append(row)
    for same in rows.values():
        ordered = sorted(same, key=lambda row: float(case.uniforms[row]))
        kept = [bool(accepted[row]) for row in ordered]
        # a threshold in u either way: kept rows first (u < p/q), or last (a reversed comparison, hinted above)
        if kept != sorted(kept, reverse=True) and kept != sorted(kept):
            low = next(row for row in ordered if not accepted[row])
            high = next(row for row in ordered if accepted[row] and case.uniforms[row] > case.uniforms[low])
            return low, high
    return None


def _recovered_hint(case: _Case, row: int, token: int, want: int) -> str:
    d = int(case.draft_ids[row])
    p = case.p[row]
    noise = case.noise[row]
    residual = _residual(case)[row]
    if d < 0:
        q_row = torch.zeros_like(p) if case.q is None else case.q[row]
        residuals = ((p - q_row).clamp(min=0), p.scatter(0, torch.tensor([0]), 0.0))  # as if d were a proposal
        if token in {int((r / noise).argmax()) for r in residuals}:
            return (
                "a bonus row (draft id -1) draws from p itself, argmax(p / noise): no proposal was rejected there, "
                "so nothing is taken out of p (with q None, zeroing draft id -1 clamped to 0 takes out token 0)"
            )
    elif token == int((p / noise).argmax()) and float(residual[token]) == 0.0:
        return (
            "after a rejection draw from the residual max(0, p - q), not from p: p alone makes the tokens the "
            "proposal already had its chance at too likely (the rejected draft id has residual 0 when q is one-hot)"
        )
    elif case.q is not None and float(p[token] - case.q[row, token]) < 0:
        return (
            f"token {token} has p - q = {float(p[token] - case.q[row, token]):.3g} < 0: the residual is "
            "max(0, p - q), clamped at 0 before anything else (unclamped, p - q sums to 0, and a normalisation or a "
            "log of it breaks)"
        )
    elif token == d:
        return f"you emitted the rejected proposal {d} itself: its residual is 0, so the recovered token is never it"
    elif token == int((p / noise).argmax()):
        return "after a rejection draw from the residual max(0, p - q), not from p"
    return (
        f"draw the token with the given noise: argmax(residual / noise) (the exponential race), here token {want}; "
        "a draw of your own (torch.multinomial, a Generator) would not follow the request's seed"
    )


def _check_rejection_case(fn: Callable, case: _Case) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the learner's rule against nanoref's; returns the learner's (accepted, recovered)."""
    originals = [None if t is None else t.clone() for t in case.inputs()]
    got = call_learner(fn, "rejection_sample", *case.inputs(), case=case.description, hint=_index_hint)
    for name, before, after in zip(("p", "q", "draft_ids", "uniforms", "noise"), originals, case.inputs()):
        if before is not None and not torch.equal(before, after):
            raise ExerciseFailure(
                f"{case.description}: your rejection_sample changed {name} in place; only read it (p is the "
                "target's distribution, the engine reads it again: compute the residual as a new tensor, "
                "(p - q).clamp(min=0), not with p -= q, p[...] = 0 or clamp_)"
            )
    accepted, recovered = _expect(got, case)
    want_accepted, _ = rejection_sample(*case.inputs())
    ids = case.draft_ids.clamp(min=0)[:, None]
    p_d = case.p.gather(1, ids)[:, 0]
    q_d = torch.ones_like(p_d) if case.q is None else case.q.gather(1, ids)[:, 0]
    # rows within rounding of u * q(d) == p(d) may go either way (u < p / q rounds differently); p(d) = 0 may not
    decided = (case.draft_ids < 0) | (p_d == 0) | ((case.uniforms * q_d - p_d).abs() > 1e-6)
    wrong = (accepted != want_accepted) & decided
    if wrong.any():
        row = int(wrong.nonzero()[0])
        raise ExerciseFailure(
            f"{case.description}: row {row} should be {'kept' if want_accepted[row] else 'rejected'}: "
            f"{_acceptance_hint(case, row, bool(accepted[row]), accepted)}\n{case.text(row)}"
        )
    scores = _residual(case) / case.noise  # (T, V): the exponential race; the winner is the row's token
    best = scores.max(dim=-1).values  # (T,)
    mine = scores.gather(1, recovered[:, None])[:, 0]
    emits = ~want_accepted  # rows whose recovered token is used: rejected and bonus rows
    bad = emits & ~((mine >= best * (1 - 1e-5)) & (mine > 0))
    if bad.any():
        # the most telling row first: one whose token has p - q < 0 (an unclamped residual), else the first
        negative = bad & (case.p - case.q < 0).gather(1, recovered[:, None])[:, 0] if case.q is not None else bad
        row = int((negative if negative.any() else bad).nonzero()[0])
        want = int(scores[row].argmax())
        token = int(recovered[row])
        kind = "bonus row" if case.draft_ids[row] < 0 else "rejected row"
        raise ExerciseFailure(
            f"{case.description}: {kind} {row} emits token {token}, expected {want}: "
            f"{_recovered_hint(case, row, token, want)}\n{case.text(row)}"
        )
    return accepted, recovered


def _index_hint(error: Exception) -> str | None:
    text = str(error)
    if "out of bounds" in text or "index -1" in text or "negative" in text:
        return "draft_ids is -1 on bonus rows: clamp it (draft_ids.clamp(min=0)) before gathering, and mask those rows"
    return None


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of counts (V,) to probs (V,) -> its p-value; cells expected below 5 are pooled."""
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    observed = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    if len(expected) < 2:
        return 1.0
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))  # the chi-square survival function


def _check_distribution(fn: Callable) -> None:
    """The tokens the rule emits follow p: 20,000 rows of one p and q (seeded), counted with a chi-square test
    whose false-alarm rate is ALPHA; for a draft model's q, a deterministic proposer, and bonus rows."""
    g = torch.Generator().manual_seed(12)
    rows, vocab = 20_000, 6
    p = _normalised(torch.rand(vocab, generator=g) ** 2)[None].expand(rows, vocab).contiguous()
    q = _normalised(torch.rand(vocab, generator=g) ** 3)[None].expand(rows, vocab).contiguous()
    drafts = torch.multinomial(q, 1, replacement=True, generator=g)[:, 0]  # (T,) drawn from q
    uniforms = torch.rand(rows, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    for description, q_given, draft_ids in (
        ("proposals drawn from a draft model's q", q, drafts),
        ("a deterministic proposer's proposals (q None)", None, drafts),
        ("bonus rows only (draft id -1)", q * 0, torch.full((rows,), -1)),
    ):
        case = _Case(f"the distribution of the emitted token, {description}", p, q_given, draft_ids, uniforms, noise)
        accepted, recovered = _expect(
            call_learner(fn, "rejection_sample", *case.inputs(), case=case.description, hint=_index_hint), case
        )
        emitted = torch.where(accepted, case.draft_ids, recovered)
        counts = torch.bincount(emitted, minlength=vocab)
        p_value = chi_square_p_value(counts, p[0])
        if p_value < ALPHA:
            kept = float(accepted.float().mean())
            raise ExerciseFailure(
                f"{case.description}: the emitted tokens do not follow p (chi-square p-value {p_value:.2g} < "
                f"{ALPHA:g}, the test's false-alarm rate for a correct rule); you kept {kept:.0%} of the proposals\n"
                f"emitted frequencies {_floats(counts / rows)}, p {_floats(p[0])}, q {_floats(q[0])}"
            )


def check_rejection_sample(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(p, q, draft_ids, uniforms, noise) -> (accepted, recovered)` against nanoref's on fresh random rows (exact:
    the draws are given), the emitted tokens' distribution against p, then sampled speculative decoding with it in
    place: the target's distribution, and nanoref's own tokens from the same seeds (`engine=False`: no engine)."""
    for case in _rejection_cases(input_generator(seed)):
        _check_rejection_case(fn, case)
    _check_distribution(fn)
    if engine:
        check_speculative_sampling({"rejection_sample": fn})


# -- sampled speculative decoding in the engine -------------------------------------------------------------------
_SMALL_VOCAB = 12
_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats itself: the n-gram lookup proposes too


def _small_vocab_models() -> tuple[Any, Any]:
    """A target and a draft over 12 tokens, with logits spread enough that every token is likely somewhere."""
    target = tiny_model(seed=5, vocab_size=_SMALL_VOCAB, initializer_range=0.05)
    draft = tiny_model(seed=6, vocab_size=_SMALL_VOCAB, initializer_range=0.05, num_hidden_layers=1)
    return target, draft


def exact_marginals(folder: Any, prompt: list[int], positions: int) -> list[torch.Tensor]:
    """The target's exact distribution of completion token 1..positions at temperature 1 (over every earlier path),
    from HF transformers."""
    model = hf_model(folder)
    paths, weights, marginals = [prompt], torch.ones(1, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(positions):
            logits = model(torch.tensor(paths)).logits[:, -1].double()  # (paths, V)
            joint = weights[:, None] * logits.softmax(-1)  # (paths, V)
            marginals.append(joint.sum(0))
            paths = [path + [token] for path in paths for token in range(model.config.vocab_size)]
            weights = joint.reshape(-1)
    return marginals


def check_speculative_sampling(functions: dict[str, Callable], *, num_samples: int = 240) -> None:
    """Seeded sampled requests (temperature 1) with speculation, the learner's `functions` in place: with a draft
    model (q a distribution) and with n-gram lookup (q one-hot). The tokens at positions 2 and 3 (made by verify
    steps) must follow the target's exact marginals (chi-square, ALPHA each), and be exactly the ones nanoref's own
    rule draws from the same seeds."""
    from nanoref import LLM, SamplingParams

    target, draft = _small_vocab_models()
    exact = exact_marginals(target, _PROMPT, 3)
    names = describe(functions)
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(num_samples)]
    prompts = [_PROMPT] * num_samples
    for spec, what in (
        ({"model": draft, "num_speculative_tokens": 2, **EVERY_STEP}, "a draft model"),
        ({"method": "ngram", "num_speculative_tokens": 2, **EVERY_STEP, "prompt_lookup_max": 3}, "n-gram lookup"),
    ):
        llm = LLM(target, speculative_config=spec, max_num_seqs=num_samples, num_kvcache_blocks=2 * num_samples)
        reference = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        calls = {"n": 0}
        counted = {name: _counted(f, calls) if name == "rejection_sample" else f for name, f in functions.items()}
        got = generate_with(llm, counted, prompts, params)
        if not calls["n"]:
            raise AssertionError(f"the engine with {what} never called rejection_sample: the check's setup is wrong")
        tokens = torch.tensor(got)  # (samples, 3)
        for position in (1, 2):
            counts = torch.bincount(tokens[:, position], minlength=_SMALL_VOCAB)
            p_value = chi_square_p_value(counts, exact[position])
            if p_value < ALPHA:
                raise ExerciseFailure(
                    f"with {names} in the engine and {what}, the sampled tokens at output position {position} do not "
                    f"follow the target's distribution (chi-square p-value {p_value:.2g} < {ALPHA:g})\n"
                    f"frequencies {_floats(counts / num_samples)}, the target's {_floats(exact[position])}"
                )
        for index, (mine, theirs) in enumerate(zip(got, reference)):
            if mine != theirs:
                position = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                raise ExerciseFailure(
                    f"with {names} in the engine and {what}, seeded request {index} samples {mine[position]} at output "
                    f"position {position} where nanoref's own rule samples {theirs[position]} from the same draws"
                )
