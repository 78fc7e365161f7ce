"""Notebook 12's exercise checks: nanoref's acceptance rules pass alone and in the speculative engine; plausible wrong
ones fail, each with the hint that names its mistake."""

from __future__ import annotations

import pytest
import torch

from nanoref.exercises import ExerciseFailure, check_accept_greedy, check_rejection_sample
from nanoref.speculative.acceptance import accept_greedy, rejection_sample
from nanoref.testing import EVERY_STEP


def test_nanorefs_own_rules_pass_alone_and_in_the_engine():
    check_accept_greedy(accept_greedy)
    check_rejection_sample(rejection_sample)


def test_nanorefs_own_rules_pass_on_other_seeds():
    for seed in (1, 2, 3):
        check_accept_greedy(accept_greedy, seed=seed, engine=False)
        check_rejection_sample(rejection_sample, seed=seed, engine=False)


# -- accept_greedy: typical mistakes ---------------------------------------------------------------------------------
def no_bonus(draft_ids, target_ids):  # forgets the bonus token when every proposal is kept
    return accept_greedy(draft_ids, target_ids)[: len(draft_ids)] if draft_ids else [target_ids[0]]


def no_target_token(draft_ids, target_ids):  # stops at the disagreement without the target's token
    out = accept_greedy(draft_ids, target_ids)
    return out if len(out) == len(draft_ids) + 1 else out[:-1]


def keeps_the_rejected_proposal(draft_ids, target_ids):
    out = accept_greedy(draft_ids, target_ids)
    return out if len(out) == len(draft_ids) + 1 else [*out[:-1], draft_ids[len(out) - 1]]


def wrong_row(draft_ids, target_ids):  # compares proposal i with the target's token one row later
    for i, d in enumerate(draft_ids):
        if d != target_ids[i + 1]:
            return [*draft_ids[:i], target_ids[i + 1]]
    return [*draft_ids, target_ids[-1]]


def keeps_going(draft_ids, target_ids):  # keeps every agreeing proposal, also after a disagreement
    kept = [d for d, t in zip(draft_ids, target_ids) if d == t]
    return [*kept, target_ids[len(draft_ids)]]


def nothing_without_proposals(draft_ids, target_ids):
    return accept_greedy(draft_ids, target_ids) if draft_ids else []


def bonus_from_the_last_proposals_row(draft_ids, target_ids):  # the bonus token read one row too early
    for i, (d, t) in enumerate(zip(draft_ids, target_ids)):
        if d != t:
            return [*draft_ids[:i], t]
    return [*draft_ids, target_ids[len(draft_ids) - 1]] if draft_ids else [target_ids[0]]


def changes_its_input(draft_ids, target_ids):
    out = accept_greedy(draft_ids, target_ids)
    draft_ids.append(0)
    return out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (no_bonus, "the bonus row"),
        (no_target_token, "the sequence still gains that token of the target's"),
        (keeps_the_rejected_proposal, "emit the target's token there, not the rejected proposal"),
        (wrong_row, "compared with the wrong row"),
        (keeps_going, "stop at the first proposal that differs"),
        (nothing_without_proposals, "with no proposal the verify step is a plain decode step"),
        (bonus_from_the_last_proposals_row, r"the bonus row \(target_ids\[k\] = 1, the last of the k \+ 1 rows\)"),
        (changes_its_input, "changed draft_ids or target_ids"),
    ],
)
def test_a_wrong_accept_greedy_fails_with_its_hint(wrong, hint):
    with pytest.raises(ExerciseFailure, match="(?s)" + hint.replace(" ", r"\s+")):
        check_accept_greedy(wrong, engine=False)


def test_a_wrong_accept_greedy_fails_in_the_engine_too():
    """The engine run alone (as the capstone runs it) catches a missing bonus token against HF."""
    from nanoref.exercises.speculative_decoding import check_speculative_greedy

    with pytest.raises(ExerciseFailure, match="HF transformers|proposals were kept"):
        check_speculative_greedy({"accept_greedy": no_bonus})


def without_any_bonus(draft_ids, target_ids):  # the kept proposals and the target's token at a disagreement only
    out = []
    for draft, target in zip(draft_ids, target_ids):
        out.append(target)
        if draft != target:
            break
    return out  # [] without proposals: the sequence gains nothing, and its next step proposes none again


def test_a_speculative_run_that_stops_making_progress_fails_naming_it():
    """Without a bonus token a sequence with one token left gains none in a step: with a learner's decode attention
    in place (as in the capstone) verify steps take the varlen path, where that sequence checks no proposal, and
    the run would never end. The harness's step budget ends it with a message that names the learner's functions,
    so the capstone's later runs still run."""
    from nanoref.exercises.speculative_decoding import check_speculative_greedy
    from nanoref.ops.attention_torch import paged_decode_attention

    yours = {"accept_greedy": without_any_bonus, "paged_decode_attention": paged_decode_attention}
    with pytest.raises(ExerciseFailure, match=r"with your `accept_greedy`, .* in the engine, the run stopped making"):
        check_speculative_greedy(yours)


def test_the_step_budget_leaves_the_engine_as_it_was():
    from nanoref import LLM, SamplingParams
    from nanoref.exercises.common import limited_steps, run_with, step_budget, tiny_model

    llm = LLM(tiny_model(), num_kvcache_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=6)
    assert step_budget([[1, 2, 3]], params) == 4 * (3 + 6) + 64
    with pytest.raises(ExerciseFailure, match="stopped making progress"), limited_steps(llm, 2, "your `f`"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert "step" not in vars(llm) and llm.is_finished()
    assert run_with(llm, {}, [[1, 2, 3]], params)[0]["token_ids"] == llm.generate([[1, 2, 3]], params)[0]["token_ids"]


def test_a_greedy_answer_that_raises_names_the_learners_line():
    def broken(draft_ids, target_ids):
        return [target_ids[len(draft_ids) + 1]]

    with pytest.raises(ExerciseFailure, match=r"your accept_greedy raised IndexError at test_exercises_speculative"):
        check_accept_greedy(broken, engine=False)


# -- rejection_sample: typical mistakes ------------------------------------------------------------------------------
def _pieces(p, q, draft_ids):
    ids = draft_ids.clamp(min=0)[:, None]
    p_d = p.gather(1, ids)[:, 0]
    q_d = torch.ones_like(p_d) if q is None else q.gather(1, ids)[:, 0]
    q_full = torch.zeros_like(p).scatter(1, ids, 1.0) if q is None else q
    return draft_ids >= 0, p_d, q_d, q_full


def accepts_bonus_rows(p, q, draft_ids, uniforms, noise):  # clamps the -1 and treats the bonus row as a proposal
    _, p_d, q_d, _ = _pieces(p, q, draft_ids)
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return uniforms * q_d < p_d, recovered


def residual_on_bonus_rows(p, q, draft_ids, uniforms, noise):  # the bonus row draws from max(0, p - q) too
    has, p_d, q_d, q_full = _pieces(p, q, draft_ids)
    return has & (uniforms * q_d < p_d), ((p - q_full).clamp(min=0) / noise).argmax(dim=-1)


def reversed_ratio(p, q, draft_ids, uniforms, noise):  # accepts with probability q/p
    has, p_d, q_d, _ = _pieces(p, q, draft_ids)
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return has & (uniforms * p_d < q_d), recovered


def reversed_comparison(p, q, draft_ids, uniforms, noise):  # p/q > u read as u > p/q
    has, p_d, q_d, _ = _pieces(p, q, draft_ids)
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return has & (uniforms > p_d / q_d), recovered


def at_most(p, q, draft_ids, uniforms, noise):  # u <= p/q: keeps a proposal the target never makes, when u = 0
    has, p_d, q_d, _ = _pieces(p, q, draft_ids)
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return has & (uniforms * q_d <= p_d), recovered


def samples_p_after_a_rejection(p, q, draft_ids, uniforms, noise):
    accepted, _ = rejection_sample(p, q, draft_ids, uniforms, noise)
    return accepted, (p / noise).argmax(dim=-1)


def unclamped_normalised(p, q, draft_ids, uniforms, noise):  # (p - q) / sum(p - q): the sum is ~0, of either sign
    has, p_d, q_d, q_full = _pieces(p, q, draft_ids)
    residual = p - q_full
    residual = torch.where(has[:, None], residual / residual.sum(dim=-1, keepdim=True), p)
    return has & (uniforms * q_d < p_d), (residual / noise).argmax(dim=-1)


def unclamped_log_space(p, q, draft_ids, uniforms, noise):  # log(p - q): NaN where q > p, and argmax picks NaN
    has, p_d, q_d, q_full = _pieces(p, q, draft_ids)
    residual = torch.where(has[:, None], p - q_full, p)
    return has & (uniforms * q_d < p_d), (residual.log() - noise.log()).argmax(dim=-1)


def own_randomness(p, q, draft_ids, uniforms, noise):  # draws the residual with torch.multinomial, not the noise
    accepted, _ = rejection_sample(p, q, draft_ids, uniforms, noise)
    has, _, _, q_full = _pieces(p, q, draft_ids)
    residual = torch.where(has[:, None], (p - q_full).clamp(min=0), p) + 1e-12
    generator = torch.Generator().manual_seed(0)
    return accepted, torch.multinomial(residual, 1, generator=generator)[:, 0]


def in_place(p, q, draft_ids, uniforms, noise):  # p -= q: the engine's p is changed
    out = rejection_sample(p, q, draft_ids, uniforms, noise)
    if q is not None:
        p.sub_(q).clamp_(min=0)
    else:
        p.scatter_(1, draft_ids.clamp(min=0)[:, None], 0.0)
    return out


def int_accepted(p, q, draft_ids, uniforms, noise):
    accepted, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return accepted.long(), recovered


def keeps_every_proposal(p, q, draft_ids, uniforms, noise):
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return draft_ids >= 0, recovered


def own_draws(p, q, draft_ids, uniforms, noise):  # ignores the given draws: uniforms and noise of its own
    return rejection_sample(p, q, draft_ids, torch.rand(uniforms.shape), torch.empty(noise.shape).exponential_())


def own_seeded_uniforms(p, q, draft_ids, uniforms, noise):  # a Generator of its own for u: repeatable, still wrong
    generator = torch.Generator().manual_seed(0)
    return rejection_sample(p, q, draft_ids, torch.rand(uniforms.shape, generator=generator), noise)


@pytest.mark.parametrize("wrong", [own_draws, own_seeded_uniforms])
def test_a_rejection_sample_that_ignores_the_given_draws_is_told_so_on_every_seed(wrong):
    """A worked case where only the given uniforms decide (one proposal many times, u spread over [0, 1)) comes
    first: whatever the seed (of the check and of the learner's own draws), the hint names the ignored uniforms,
    never the bonus row."""
    for seed in range(30):
        torch.manual_seed(1000 + seed)
        with pytest.raises(ExerciseFailure) as failure:
            check_rejection_sample(wrong, seed=seed, engine=False)
        message = str(failure.value).replace("\n", " ")
        assert "you ignored the given uniform draws" in message, (seed, message)
        assert "bonus" not in message, (seed, message)


def own_noise(p, q, draft_ids, uniforms, noise):  # the given uniforms, but noise of its own
    return rejection_sample(p, q, draft_ids, uniforms, torch.empty(noise.shape).exponential_())


def test_a_rejection_sample_that_ignores_the_given_noise_is_told_so_on_every_seed():
    for seed in range(30):
        torch.manual_seed(2000 + seed)
        with pytest.raises(ExerciseFailure) as failure:
            check_rejection_sample(own_noise, seed=seed, engine=False)
        message = str(failure.value).replace("\n", " ")
        assert "draw the token with the given noise" in message, (seed, message)
        assert "bonus" not in message, (seed, message)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (own_draws, "you ignored the given uniform draws"),
        (accepts_bonus_rows, "a bonus row .* never accept it"),
        (residual_on_bonus_rows, "a bonus row .* draws from p itself"),
        (reversed_ratio, "the ratio is reversed"),
        (reversed_comparison, "the comparison is reversed"),
        (at_most, r"p\(d\) = 0: the target never makes token"),
        (samples_p_after_a_rejection, r"draw from the residual max\(0, p - q\), not from p"),
        (unclamped_normalised, r"p - q = .* < 0: the residual is max\(0, p - q\), clamped at 0"),
        (unclamped_log_space, r"p - q = .* < 0: the residual is max\(0, p - q\), clamped at 0"),
        (own_randomness, r"draw the token with the given noise: argmax\(residual / noise\)"),
        (in_place, "changed p in place"),
        (int_accepted, "accepted should be a .* bool tensor"),
        (keeps_every_proposal, "should be rejected: you kept every proposal"),
    ],
)
def test_a_wrong_rejection_sample_fails_with_its_hint(wrong, hint):
    with pytest.raises(ExerciseFailure, match="(?s)" + hint.replace(" ", r"\s+")):
        check_rejection_sample(wrong, engine=False)


def test_the_distribution_check_alone_tells_a_rule_that_keeps_every_proposal():
    """The chi-square test has power: keeping every proposal emits q, not p (the false-alarm rate is ALPHA)."""
    from nanoref.exercises.speculative_decoding import _check_distribution

    _check_distribution(rejection_sample)
    with pytest.raises(ExerciseFailure, match="the emitted tokens do not follow p"):
        _check_distribution(keeps_every_proposal)


def test_the_engine_part_tells_a_rule_that_keeps_every_proposal():
    from nanoref.exercises.speculative_decoding import check_speculative_sampling

    with pytest.raises(ExerciseFailure, match="do not follow the target's distribution|nanoref's own rule samples"):
        check_speculative_sampling({"rejection_sample": keeps_every_proposal})


def test_a_verify_step_takes_a_learners_prefill_metadata_that_returns_a_plain_tuple():
    """Notebook 01's answer returns a plain tuple (the model runner reads it by position): the verify step, which
    builds its inputs through the same seam, must too, or the capstone's speculative runs fail with every answer."""
    from nanoref.engine.step_inputs import prefill_metadata
    from nanoref.exercises import check_generation

    def as_tuple(*args):
        return tuple(prefill_metadata(*args))

    spec = {"method": "ngram", "num_speculative_tokens": 3, **EVERY_STEP, "prompt_lookup_max": 3}
    check_generation({"prefill_metadata": as_tuple}, prompts=[[7, 8, 9] * 5, [1, 2, 3, 4] * 3], speculative_config=spec)


def row_0s_p(p, q, draft_ids, uniforms, noise):  # p[0, draft_ids]: row 0's distribution read for every row
    has, _, q_d, _ = _pieces(p, q, draft_ids)
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return has & (uniforms * q_d < p[0, draft_ids.clamp(min=0)]), recovered


def row_0s_q(p, q, draft_ids, uniforms, noise):  # q[0, draft_ids]
    has, p_d, q_d, _ = _pieces(p, q, draft_ids)
    q_d = q_d if q is None else q[0, draft_ids.clamp(min=0)]
    _, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
    return has & (uniforms * q_d < p_d), recovered


@pytest.mark.parametrize("wrong, name", [(row_0s_p, "p"), (row_0s_q, "q")])
def test_a_rejection_sample_reading_row_0s_distribution_for_every_row_is_told_so_on_every_seed(wrong, name):
    for seed in range(12):
        with pytest.raises(ExerciseFailure) as failure:
            check_rejection_sample(wrong, seed=seed, engine=False)
        message = str(failure.value).replace("\n", " ")
        assert f"you read row 0's {name}(d) for every row" in message, (seed, message)
        assert f"row i's is {name}[i, draft_ids[i]]" in message, (seed, message)
