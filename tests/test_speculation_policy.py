"""When speculation runs (nanoref/speculative/policy.py): a verify step only where it pays, by batch size and by the
tokens it has been gaining; plain steps in between give the same greedy output and free the blocks reserved for
proposals."""

from __future__ import annotations

import random

import pytest

from nanoref import LLM, SamplingParams
from nanoref.speculative.policy import DEFAULT_BATCH_LIMIT, SpeculationPolicy
from nanoref.speculative.proposers import propose_ngram
from nanoref.testing import EVERY_STEP

from .helpers import assert_matches_hf, assert_no_block_leaked, random_prompts, shared_prefix_prompts


def test_the_batch_rule_runs_steps_above_the_limit_plain():
    policy = SpeculationPolicy(disable_by_batch_size=8, min_tokens_per_step=0)
    assert [policy.speculate(b) for b in (1, 8, 9, 300)] == [True, True, False, False]
    assert SpeculationPolicy(0, 0).speculate(10_000), "0 never disables by batch size"


def test_the_acceptance_rule_turns_speculation_off_and_probes_less_often_while_probes_fail():
    policy = SpeculationPolicy(disable_by_batch_size=0, min_tokens_per_step=1.5)
    assert policy.speculate(4), "no verify step yet: speculate"
    policy.verified(num_seqs=4, num_gained=4)  # nothing accepted: 1.0 tokens per step
    decisions = []
    for _ in range(8 + 16 + 32 + 64 + 64):
        speculate = policy.speculate(4)
        decisions.append(speculate)
        policy.verified(4, 4) if speculate else policy.ran_plain()
    probes = [i + 1 for i, speculate in enumerate(decisions) if speculate]
    assert probes == [8, 24, 56, 120, 184], "probes after 8, 16, 32, then every 64 plain steps"
    for _ in range(64):  # the text became predictable: 4 of 4 accepted, 5 tokens per step (seen at the next probe)
        if policy.speculate(4):
            policy.verified(4, 20)
        else:
            policy.ran_plain()
    assert policy.tokens_per_step >= 1.5 and all(policy.speculate(4) for _ in range(3)), "back on once it pays"


@pytest.mark.parametrize("setting", [{"disable_by_batch_size": -1}, {"disable_by_batch_size": 2.5},
                                     {"min_tokens_per_step": "1"}, {"min_tokens_per_step": 7}])  # fmt: skip
def test_bad_policy_settings_are_clear_errors(tiny_model, setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        LLM(tiny_model, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 4, **setting})


def test_a_batch_above_the_limit_decodes_plain_and_equals_hf_and_the_small_one_verifies(tiny_model):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2, "min_tokens_per_step": 0}
    llm = LLM(tiny_model, device="cpu", speculative_config=spec, num_kvcache_blocks=64)
    prompts = random_prompts(5, [7, 12, 9, 20])
    lengths = (4, 6, 24, 30)  # four sequences (plain steps), then two (verify steps)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
                           use_tqdm=False)  # fmt: skip
    for prompt, output, length in zip(prompts, outputs, lengths):
        assert_matches_hf(tiny_model, [prompt], [output], length)
    decode = [step for step in llm.metrics.steps if step.kind == "decode"]
    big = [step for step in decode if step.num_seqs > 2]
    small = [step for step in decode if step.num_seqs <= 2]
    # a step's record lists (seq_id, query tokens): 1 in a plain step, 1 + k in a verify step
    assert big and all(n == 1 for step in big for _, n in step.seqs), "batches above the limit run plain"
    assert small and all(n == 4 for step in small for _, n in step.seqs), "batches within it verify"
    assert_no_block_leaked(llm)


def test_low_acceptance_switches_to_plain_steps_with_the_same_greedy_output(tiny_model):
    """The tiny random model's text rarely repeats itself: n-gram proposals are mostly rejected, the policy runs
    plain steps with a probe every 8th, and the output is still HF's."""
    prompts = random_prompts(9, [6, 11])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    llm = LLM(tiny_model, device="cpu", speculative_config=spec)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(tiny_model, prompts, outputs, 40)
    decode = [step for step in llm.metrics.steps if step.kind == "decode"]
    verified = [step.num_draft_tokens > 0 for step in decode]
    gained = sum(s.num_seqs + s.num_accepted_tokens for s in decode if s.num_draft_tokens) / max(
        1, sum(s.num_seqs for s in decode if s.num_draft_tokens)
    )
    assert gained < 1.5, f"this workload was meant to gain little ({gained:.2f} tokens per verify step)"
    assert verified.count(False) > verified.count(True), "mostly plain steps where speculation does not pay"
    assert_no_block_leaked(llm)


def test_the_default_batch_limit_depends_on_the_device(tiny_model):
    llm = LLM(tiny_model, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert llm.speculative_loop.policy.disable_by_batch_size == DEFAULT_BATCH_LIMIT["cpu"]
    assert llm.speculative_loop.policy.min_tokens_per_step == 1.5


def test_the_faster_ngram_lookup_agrees_with_the_sliding_window_definition():
    """propose_ngram extends matches of the last token backwards; the definition compares every window."""
    import random

    import numpy as np

    def by_windows(token_ids, min_n, max_n, k):
        tokens = np.asarray(token_ids)
        num = len(tokens)
        for n in range(min(max_n, num - 1), min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: num - 1], n)
            starts = np.flatnonzero((windows == tokens[num - n :]).all(axis=1))
            if starts.size:
                return tokens[int(starts[-1]) + n :][:k].tolist()
        return []

    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        low = rng.randrange(1, 4)
        high, k = rng.randrange(low, 6), rng.randrange(1, 6)
        assert propose_ngram(tokens, low, high, k) == by_windows(tokens, low, high, k), (tokens, low, high, k)


def weights(llm_model) -> int:
    return sum(p.numel() for p in llm_model.parameters())


def test_a_draft_as_large_as_the_target_is_not_loaded_and_says_so(tiny_model):
    """Its k forwards cost k plain steps' weights: the bar (1.5 + k) passes the k + 1 tokens a verify step can gain.
    The engine warns and decodes as one without speculation: no draft loaded (its weights and K/V would take memory
    for nothing), no lookahead slots reserved, no step verifying, HF's greedy tokens."""
    spec = {"model": tiny_model, "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    with pytest.warns(RuntimeWarning, match=r"gain 4\.50 tokens per sequence to pay, more than the 4 it can"):
        llm = LLM(tiny_model, device="cpu", speculative_config=spec, num_kvcache_blocks=64)
    assert llm.speculative_loop is None and not hasattr(llm.model_runner, "draft")
    assert llm.scheduler.num_lookahead_tokens == 0
    plain = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    assert llm.model_runner.kv_bytes_per_token == plain.model_runner.kv_bytes_per_token
    prompts = random_prompts(8, [9, 14])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert_matches_hf(tiny_model, prompts, outputs, 12)
    assert not any(step.num_draft_tokens for step in llm.metrics.steps), "a step verified"
    assert_no_block_leaked(llm)


def test_a_smaller_draft_raises_the_bar_by_its_share_of_the_weights(tiny_model, tmp_path):
    from nanoref.testing import make_tiny_qwen3

    draft = make_tiny_qwen3(tmp_path / "draft", seed=5, num_hidden_layers=1)
    spec = {"model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    llm = LLM(tiny_model, device="cpu", speculative_config=spec, num_kvcache_blocks=64)
    runner = llm.model_runner
    share = weights(runner.draft.model) / weights(runner.model)
    assert 0.3 < share < 0.9
    assert llm.speculative_loop.policy.min_tokens_per_step == pytest.approx(1.5 + 3 * share)
    assert llm.speculative_loop.policy.speculate(1), "a bar under k + 1: the first step verifies"
    # min_tokens_per_step=0 turns the acceptance rule off, the draft's cost with it: even a draft as large as the
    # target is loaded, and every step verifies
    every = LLM(tiny_model, device="cpu", num_kvcache_blocks=64,
                speculative_config={"model": tiny_model, "num_speculative_tokens": 3, **EVERY_STEP})  # fmt: skip
    assert hasattr(every.model_runner, "draft")
    assert every.speculative_loop.policy.min_tokens_per_step == 0 and every.speculative_loop.policy.speculate(1)


# -- a draft model above the batch limit ---------------------------------------------------------


def identical_draft(model, batch_limit: int) -> dict:
    """A draft that is the target itself, every step within batch_limit verifying: greedy, it must have every
    proposal kept, which it does only if its K/V for the whole context is right (its output cannot show that)."""
    return {"model": model, "num_speculative_tokens": 3, "disable_by_batch_size": batch_limit, "min_tokens_per_step": 0}


def draft_forwards(llm) -> list[tuple[bool, int]]:
    """Record the draft's forwards from now on: (is_prefill, tokens fed) each."""
    runner, calls = llm.model_runner.draft, []
    forward = runner.run_forward

    def recorded(seqs, step, *args, **kwargs):
        calls.append((step.is_prefill, len(step.arrays["positions"])))
        return forward(seqs, step, *args, **kwargs)

    runner.run_forward = recorded
    return calls


def kept_every_proposal(steps) -> bool:
    drafted = sum(step.num_draft_tokens for step in steps)
    return drafted > 0 and sum(step.num_accepted_tokens for step in steps) == drafted


@pytest.mark.parametrize("budget", [None, 16], ids=["one catch-up forward", "catch-up in 16-token chunks"])
def test_a_prefill_above_the_batch_limit_skips_the_draft_which_catches_up_when_the_batch_shrinks(tiny_model, budget):
    """Four prompts against a limit of 2: their decode steps will run plain, so the prefill leaves the draft out
    (its forward over every prompt would buy nothing). When three have finished, the last one's first verify step
    feeds the draft its whole context (in chunks of the engine's token budget, as a long prompt), and from then on
    every proposal is kept."""
    llm = LLM(tiny_model, device="cpu", speculative_config=identical_draft(tiny_model, 2), num_kvcache_blocks=64,
              **({} if budget is None else {"max_num_batched_tokens": budget}))  # fmt: skip
    calls = draft_forwards(llm)
    prompts = random_prompts(41, [18, 25, 9, 30])
    lengths = (30, 5, 5, 5)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
                           use_tqdm=False)  # fmt: skip
    for prompt, output, length in zip(prompts, outputs, lengths):
        assert_matches_hf(tiny_model, [prompt], [output], length)
    # its prompt and the 5 tokens it has when the others finish (the last one's logits make the first proposal)
    context = len(prompts[0]) + 5
    catch_up = [(True, context)] if budget is None else [(True, 16), (True, context - 16)]
    assert calls[: len(catch_up)] == catch_up, f"the draft's first forwards: {calls[:3]}"
    assert not any(is_prefill for is_prefill, _ in calls[len(catch_up) :]), "only one catch-up"
    assert kept_every_proposal(llm.metrics.steps), "the draft's caught-up K/V is not the target's context"
    assert_no_block_leaked(llm)


def test_a_prompt_that_hits_blocks_without_draft_kv_has_the_draft_compute_them(tiny_model):
    """A second turn: the first turn's prompt and reply are in the prefix cache, but its steps ran above the batch
    limit, so the draft never wrote K/V for those blocks (the prompt's prefill left it out; the reply's tokens
    came from plain steps). The second turn runs alone: the draft must not read those blocks as its own, and an
    identical draft keeps every proposal only if it recomputed them."""
    llm = LLM(tiny_model, device="cpu", speculative_config=identical_draft(tiny_model, 2), num_kvcache_blocks=64)
    prompts = random_prompts(42, [20, 26, 23])
    first = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert not any(step.num_draft_tokens for step in llm.metrics.steps), "three sequences: every step plain"
    follow_up = prompts[0] + first[0]["token_ids"]  # 60 tokens: blocks 0-2 cached (16 tokens each)
    output = llm.generate([follow_up], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    steps = llm.metrics.steps  # (this generate's)
    assert steps[0].num_hit_tokens == 48, "the second turn was meant to hit the first turn's blocks"
    assert_matches_hf(tiny_model, [follow_up], output, 16)
    assert kept_every_proposal(steps), "the draft read K/V it never wrote"
    assert_no_block_leaked(llm)


def test_a_prompt_that_hits_blocks_the_draft_computed_reuses_its_kv(tiny_model):
    """The same second turn with every step verifying: the first turn's blocks hold the draft's K/V too, so the
    second turn's prefill feeds the draft only its uncached tokens (the prefix cache serves the draft as the target)."""
    llm = LLM(tiny_model, device="cpu", speculative_config=identical_draft(tiny_model, 0), num_kvcache_blocks=64)
    prompt = random_prompts(43, [20])[0]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    follow_up = prompt + first[0]["token_ids"]
    calls = draft_forwards(llm)
    output = llm.generate([follow_up], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    steps = llm.metrics.steps  # (this generate's)
    assert steps[0].num_hit_tokens == 48
    assert calls[0] == (True, len(follow_up) - 48), f"the draft's prefill fed {calls[0][1]} tokens, not the 12 uncached"
    assert_matches_hf(tiny_model, [follow_up], output, 16)
    assert kept_every_proposal(steps)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_identical_draft_keeps_every_proposal_through_skips_hits_preemption_and_eviction(tiny_model, seed):
    """A random conversation workload on a small cache: batches of 1-4 against a limit of 2 (prefills with and
    without the draft, plain and verify steps), second turns that hit blocks of either kind, preemption, and blocks
    evicted and handed to other prompts. Any block whose draft K/V the draft trusted wrongly would make an identical
    draft propose a token the target rejects."""
    rng = random.Random(seed)
    llm = LLM(tiny_model, device="cpu", speculative_config=identical_draft(tiny_model, 2), num_kvcache_blocks=12,
              max_num_batched_tokens=48)  # fmt: skip
    turns: list[list[int]] = []  # earlier prompts with their replies: the next turns' prefixes
    drafted = accepted = hits = 0
    for round_ in range(6):
        prompts = []
        for i in range(rng.randint(1, 4)):
            if turns and rng.random() < 0.6:
                prompts.append(rng.choice(turns) + random_prompts(100 * seed + 10 * round_ + i, [rng.randint(1, 6)])[0])
            else:
                prompts.append(shared_prefix_prompts(seed, 17, [rng.randint(2, 20)])[0][: rng.randint(5, 37)])
        prompts = [p[-64:] for p in prompts]  # (one request fits the cache: 12 blocks of 16 tokens; four do not)
        lengths = [rng.randint(3, 40) for _ in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output, length in zip(prompts, outputs, lengths):
            assert_matches_hf(tiny_model, [prompt], [output], length)
            turns.append(prompt + output["token_ids"])
        steps = llm.metrics.steps
        drafted += sum(step.num_draft_tokens for step in steps)
        accepted += sum(step.num_accepted_tokens for step in steps)
        hits += sum(step.num_hit_tokens for step in steps)
        assert accepted == drafted, f"round {round_}: the draft read K/V it had not written ({accepted} of {drafted})"
        assert_no_block_leaked(llm)
    preemptions = llm.scheduler.num_preemptions
    assert drafted > 0 and hits > 0 and preemptions > 0, (drafted, hits, preemptions)
