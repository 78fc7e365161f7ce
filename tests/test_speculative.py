"""Speculative decoding: proposers, the acceptance rule, the verify step's bookkeeping, and its one promise: the
output is the target's (greedy: the same tokens as HF; sampled: the same distribution)."""

from __future__ import annotations

import random

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.exercises.speculative_decoding import chi_square_p_value, exact_marginals
from nanoref.llm import DEFAULT_MODEL
from nanoref.speculative.acceptance import accept_greedy, emitted_tokens, rejection_sample
from nanoref.speculative.proposers import propose_ngram
from nanoref.testing import EVERY_STEP, make_tiny_qwen3
from nanoref.utils import seams

from .helpers import assert_matches_hf, assert_no_block_leaked, hf_greedy, random_prompts, shared_prefix_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    """A second tiny model with the target's vocabulary (another seed, one layer): it proposes, often wrongly."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("draft") / "draft", seed=11, num_hidden_layers=1)


def ngram(k: int = 3, lookup: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **EVERY_STEP, "prompt_lookup_max": lookup}


def repetitive_prompts(seed: int, count: int, vocab: int = 256) -> list[list[int]]:
    """Prompts that repeat a short phrase a few times (what n-gram lookup guesses from)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(3, 7))]
        prompts.append((phrase * 5)[: rng.randrange(10, 30)])
    return prompts


# -- the pieces, on worked examples -------------------------------------------------------------


def test_ngram_lookup_proposes_what_followed_the_latest_match_of_the_longest_tail():
    tokens = [5, 6, 7, 1, 2, 9, 9, 6, 7, 3, 4, 6, 7]
    # tail (6, 7) occurs at 1 and 7; the latest (7) is followed by 3, 4, 6; (4, 6, 7) never occurred before
    assert propose_ngram(tokens, 1, 3, 3) == [3, 4, 6]
    assert propose_ngram(tokens, 1, 3, 1) == [3]
    assert propose_ngram([1, 2, 3, 1, 2], 1, 3, 4) == [3, 1, 2]  # the match's continuation runs up to the tail
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []  # 4 never occurred before
    assert propose_ngram([8, 1, 2, 8], 2, 3, 2) == []  # only a 1-token tail matches, below min_n
    assert propose_ngram([7], 1, 3, 2) == []


def test_greedy_acceptance_keeps_the_agreeing_run_and_adds_the_targets_token():
    assert accept_greedy([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accept_greedy([4, 5, 6], [3, 5, 6, 1]) == [3]
    assert accept_greedy([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]  # all kept, plus the bonus token
    assert accept_greedy([], [2]) == [2]  # no proposal: a plain decode step
    assert emitted_tokens([4, 5], [True, False, False], [0, 7, 8]) == [4, 7]
    assert emitted_tokens([4, 5], [True, True, False], [0, 7, 8]) == [4, 5, 8]


ALPHA = 1e-4  # each distribution check's false-alarm rate (its inputs are seeded: a run passes or fails for good)


@pytest.mark.parametrize("one_hot", [True, False], ids=["deterministic proposer", "draft distribution"])
def test_the_rejection_rule_emits_the_targets_distribution(one_hot):
    g = torch.Generator().manual_seed(0)
    vocab, rows = 8, 200_000
    p = torch.rand(vocab, generator=g) ** 2
    p = (p / p.sum())[None].expand(rows, vocab)
    q = torch.rand(vocab, generator=g) ** 3
    q = (q / q.sum())[None].expand(rows, vocab)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]  # (T,) drawn from q
    uniforms = torch.rand(rows, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    accepted, recovered = rejection_sample(p, None if one_hot else q, drafts, uniforms, noise)
    first = torch.where(accepted, drafts, recovered)
    counts = torch.bincount(first, minlength=vocab)
    assert chi_square_p_value(counts, p[0]) > ALPHA
    # the check has power: keeping every proposal gives q, not p
    assert chi_square_p_value(torch.bincount(drafts, minlength=vocab), p[0]) < ALPHA
    # a bonus row (no proposal) samples p itself
    accepted, recovered = rejection_sample(p, None, torch.full((rows,), -1), uniforms, noise)
    assert not accepted.any()
    assert chi_square_p_value(torch.bincount(recovered, minlength=vocab), p[0]) > ALPHA


# -- greedy: the target's tokens, exactly --------------------------------------------------------


def test_ngram_greedy_output_equals_hf(tiny_model):
    prompts = repetitive_prompts(0, 6)
    llm = LLM(tiny_model, device="cpu", speculative_config=ngram())
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_model, prompts, outputs, GREEDY.max_tokens)
    assert sum(step.num_draft_tokens for step in llm.metrics.steps) > 0, "the lookup never proposed anything"
    assert_no_block_leaked(llm)


def test_draft_model_greedy_output_equals_hf(tiny_model, draft_folder):
    prompts = random_prompts(1, [5, 17, 33, 9])
    llm = LLM(
        tiny_model, device="cpu", speculative_config={"model": draft_folder, "num_speculative_tokens": 4, **EVERY_STEP}
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_model, prompts, outputs, GREEDY.max_tokens)
    steps = [step for step in llm.metrics.steps if step.num_draft_tokens]
    assert steps and all(step.num_accepted_tokens <= step.num_draft_tokens for step in steps)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_output_equals_hf_through_preemption_chunked_prefill_and_prefix_hits(tiny_model, draft_folder, proposer):
    spec = ngram(4) if proposer == "ngram" else {"model": draft_folder, "num_speculative_tokens": 3, **EVERY_STEP}
    # 12 blocks of 16 tokens for 6 sequences of ~45-70 tokens: decode must preempt; 32-token steps chunk prompts
    llm = LLM(tiny_model, device="cpu", speculative_config=spec, num_kvcache_blocks=12, max_num_batched_tokens=32)
    prompts = shared_prefix_prompts(2, 20, [3, 9, 14, 5, 11, 7])
    prompts = [p + p[-4:] * 2 for p in prompts]  # a repeat at the end, for the lookup
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for _ in range(2):  # the second call finds the prompts in the prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_matches_hf(tiny_model, prompts, outputs, params.max_tokens)
        assert_no_block_leaked(llm)
    assert llm.scheduler.num_preemptions > 0, "the workload was meant to preempt"
    assert any(step.num_hit_tokens for step in llm.metrics.steps), "the second call was meant to hit the cache"
    assert any(step.num_draft_tokens for step in llm.metrics.steps)


def test_a_draft_identical_to_the_target_is_always_accepted_worked_example(tiny_model):
    """k = 3, max_tokens = 10: the prefill makes token 1; each verify step proposes min(3, tokens left - 1) and
    keeps them all plus one: 1 -> 5 -> 9 -> 10. Every verify step checks k tokens per sequence (one shape, for
    CUDA graphs), also the last, which may keep none of them."""
    llm = LLM(
        tiny_model, device="cpu", speculative_config={"model": tiny_model, "num_speculative_tokens": 3, **EVERY_STEP}
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    output = llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False, return_metrics=True)[0]
    steps = llm.metrics.steps
    assert [step.kind for step in steps] == ["prefill", "decode", "decode", "decode"]
    assert [(s.num_draft_tokens, s.num_accepted_tokens) for s in steps] == [(0, 0), (3, 3), (3, 3), (0, 0)]
    assert [s.num_tokens for s in steps] == [5, 4, 4, 4]  # tokens each step computed: the prompt; 1 + k
    assert [s.acceptance_rate for s in steps] == [None, 1.0, 1.0, None]
    assert [s.mean_accepted_length for s in steps] == [None, 3.0, 3.0, None]
    metrics = output["metrics"]
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens, metrics.acceptance_rate) == (6, 6, 1.0)
    assert (metrics.num_verify_steps, metrics.mean_accepted_length) == (3, 2.0)  # 6 kept over 3 verify steps
    assert len(output["token_ids"]) == 10 and output["finish_reason"] == "length"


def test_a_draft_identical_to_the_target_keeps_every_proposal_when_limits_differ_within_a_step(tiny_model):
    """Greedy output is the target's whatever a draft proposes, so only the acceptance shows a draft's bookkeeping:
    with sequences near different max_tokens, one verify step asks for 4, 2 and 0 proposals from its rows (the draft
    decodes fewer rows each step), and an identical draft must still have every proposal kept."""
    spec = {"model": tiny_model, "num_speculative_tokens": 4, **EVERY_STEP}
    llm = LLM(tiny_model, device="cpu", speculative_config=spec, num_kvcache_blocks=64)
    prompts = random_prompts(30, [5, 11, 3, 8, 14])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 9, 20, 13, 11)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, p in zip(prompts, outputs, params):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, p.max_tokens)
    drafted = sum(step.num_draft_tokens for step in llm.metrics.steps)
    accepted = sum(step.num_accepted_tokens for step in llm.metrics.steps)
    assert drafted > 20 and accepted == drafted, (accepted, drafted)


def test_verify_steps_in_graph_buckets_and_the_varlen_path_near_max_model_len_equal_hf(tiny_model):
    """The verify step as CUDA graphs run it (padded to a bucket of B sequences x (k + 1) tokens; run eagerly
    here), and, near max_model_len, where k proposals no longer fit, as one varlen step of shorter proposals."""
    from nanoref.cuda_graphs import DecodeGraphs

    llm = LLM(tiny_model, device="cpu", max_model_len=48, speculative_config=ngram(4))
    llm.speculative_loop.verify_graphs = DecodeGraphs(llm.model_runner, record=False, query_len=5)
    prompts = repetitive_prompts(8, 3)  # 10-29 tokens: every one runs into max_model_len
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert len(prompt) + len(output["token_ids"]) == 48 and output["finish_reason"] == "length"
        assert_matches_hf(tiny_model, [prompt], [output], len(output["token_ids"]))
    widths = {n for step in llm.metrics.steps if step.kind == "decode" for _, n in step.seqs}
    assert 5 in widths and widths - {5}, f"both paths were meant to run: {widths}"
    assert_no_block_leaked(llm)


def test_eos_and_stop_ids_inside_an_accepted_run_end_the_sequence_there(tiny_model):
    plain = LLM(tiny_model, device="cpu").generate([[3, 1, 4, 1, 5]], GREEDY, use_tqdm=False)[0]["token_ids"]
    stop_at = 6  # a token in the middle of a verify step's accepted run
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[plain[stop_at]])
    expected = plain[: plain.index(plain[stop_at]) + 1]
    llm = LLM(
        tiny_model, device="cpu", speculative_config={"model": tiny_model, "num_speculative_tokens": 4, **EVERY_STEP}
    )
    output = llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0]
    assert output["token_ids"] == expected and output["finish_reason"] == "stop"
    assert_no_block_leaked(llm)


def test_penalties_min_tokens_and_logprobs_are_applied_per_verified_position(tiny_model):
    """Each verify row's penalties count the proposals before it; min_tokens masks EOS at the rows short of it;
    logprobs are the target's at each kept token: all as without speculation."""
    eos = LLM(tiny_model, device="cpu").scheduler.eos_token_ids
    prompts = repetitive_prompts(3, 4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, stop_token_ids=[7, 8, 9, *eos]),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True),
    ]
    plain = LLM(tiny_model, device="cpu").generate(prompts, params, use_tqdm=False)
    spec = LLM(
        tiny_model, device="cpu", speculative_config={"model": tiny_model, "num_speculative_tokens": 3, **EVERY_STEP}
    )
    outputs = spec.generate(prompts, params, use_tqdm=False)
    for index, (a, b) in enumerate(zip(plain, outputs)):
        assert a["token_ids"] == b["token_ids"], f"request {index} differs"
    assert len(outputs[2]["token_ids"]) >= 12
    for a, b in zip(plain[3]["logprobs"], outputs[3]["logprobs"]):
        assert (a.token_id, a.rank, list(a.top)) == (b.token_id, b.rank, list(b.top))
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_stop_strings_and_streams_with_speculation_equal_the_plain_engine():
    prompts = ["Once upon a time", "The cat sat on the mat. The cat sat on the"]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "."], include_stop_str_in_output=True)
    plain = LLM(device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(device="cpu", speculative_config=ngram(4, 2))
    assert [o["text"] for o in llm.generate(prompts, params, use_tqdm=False)] == [o["text"] for o in plain]
    pieces = list(llm.stream(prompts[1], params))
    assert "".join(piece.text for piece in pieces) == plain[1]["text"]
    assert_no_block_leaked(llm)


# -- sampled: the target's distribution ----------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    """A target and a draft over 12 tokens, with logits spread enough that every token is likely somewhere."""
    root = tmp_path_factory.mktemp("small_vocab")
    target = make_tiny_qwen3(root / "target", seed=5, vocab_size=12, initializer_range=0.05)
    draft = make_tiny_qwen3(root / "draft", seed=6, vocab_size=12, initializer_range=0.05, num_hidden_layers=1)
    return target, draft


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_tokens_follow_the_targets_distribution_at_every_position(small_vocab_models, proposer):
    """1,500 seeded samples of 3 tokens with speculation; each position's token counts against the target's exact
    marginal (chi-square, false-alarm rate ALPHA per position); and the same counts with the rejection rule broken
    (every proposal kept) fail the check, so it can tell."""
    target, draft = small_vocab_models
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the n-gram lookup proposes
    spec = ngram(2) if proposer == "ngram" else {"model": draft, "num_speculative_tokens": 2, **EVERY_STEP}
    llm = LLM(target, device="cpu", speculative_config=spec, max_num_seqs=256, seed=0)
    exact = exact_marginals(target, prompt, 3)

    def p_values(num_samples: int) -> list[float]:
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(num_samples)]
        outputs = llm.generate([prompt] * num_samples, params, use_tqdm=False)
        tokens = torch.tensor([o["token_ids"] for o in outputs])  # (samples, 3)
        return [chi_square_p_value(torch.bincount(tokens[:, i], minlength=12), exact[i]) for i in range(3)]

    assert min(p_values(1500)) > ALPHA
    steps = llm.metrics.steps
    assert sum(s.num_accepted_tokens for s in steps) > 0.05 * sum(s.num_draft_tokens for s in steps) > 0

    def keep_every_proposal(p, q, draft_ids, uniforms, noise):
        accepted, recovered = rejection_sample(p, q, draft_ids, uniforms, noise)
        return draft_ids >= 0, recovered

    with seams.use(rejection_sample=keep_every_proposal):
        assert min(p_values(600)[1:]) < ALPHA  # position 1 comes from the prefill step, without proposals


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch(tiny_model, draft_folder, proposer):
    """Also when a batch-mate near max_model_len sends the verify steps down the varlen path (fewer rows)."""
    spec = ngram(3, 2) if proposer == "ngram" else {"model": draft_folder, "num_speculative_tokens": 3, **EVERY_STEP}
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=42)
    prompt = [9, 8, 7, 9, 8, 7, 9]
    engine = dict(device="cpu", speculative_config=spec, max_model_len=64, seed=0)
    alone = LLM(tiny_model, **engine).generate([prompt], params, use_tqdm=False)
    others = random_prompts(4, [6, 12, 50])  # the last runs into max_model_len while the seeded one decodes
    llm = LLM(tiny_model, **engine)
    crowd = llm.generate(
        [*others, prompt],
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3 + [params],
        use_tqdm=False,
    )
    assert crowd[-1]["token_ids"] == alone[0]["token_ids"]
    widths = {n for step in llm.metrics.steps if step.kind == "decode" for _, n in step.seqs}
    assert 4 in widths and widths - {4}, f"both verify paths were meant to run: {widths}"


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_seeded_request_preempted_and_recomputed_samples_what_it_samples_alone(tiny_model, draft_folder, proposer):
    """KV blocks for about two of the four requests: the newest are preempted and recompute their tokens (partly from
    the prefix cache). The recompute stops short of the last token, which goes into the next verify step, so every
    seeded sample draws what it draws alone (a prefill sampling the next token would draw otherwise from then on)."""
    spec = ngram(3, 2) if proposer == "ngram" else {"model": draft_folder, "num_speculative_tokens": 3, **EVERY_STEP}
    engine = dict(device="cpu", speculative_config=spec, kvcache_block_size=16)
    rng = random.Random(3)
    prompts = repetitive_prompts(10, 4)
    params = [
        SamplingParams(temperature=1.0, top_k=rng.choice([0, 20]), max_tokens=rng.randrange(20, 40),
                       seed=rng.randrange(100), n=rng.choice([1, 2]), ignore_eos=True)
        for _ in prompts
    ]  # fmt: skip
    llm = LLM(tiny_model, **engine, num_kvcache_blocks=7, max_num_batched_tokens=32)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0, "the budget was meant to preempt"
    assert_no_block_leaked(llm)
    alone = LLM(tiny_model, **engine)  # (one request at a time: alone in its batch)
    for prompt, p, out in zip(prompts, params, together):
        expected = alone.generate([prompt], p, use_tqdm=False)[0]
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in expected.outputs]


def test_a_step_that_fails_aborts_not_the_recompute_that_sat_it_out(tiny_model, monkeypatch):
    """A preempted request whose recompute has only its last token left (the rest from the prefix cache) sits the
    prefill step out (that token goes into its next verify step): when that prefill fails, the requests in it are
    aborted, and the one that sat it out runs on to the tokens it makes alone."""
    engine = dict(device="cpu", speculative_config=ngram(3, 2), kvcache_block_size=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = list(range(1, 33))  # two full blocks: after the first step, all but the last token are cached
    llm = LLM(tiny_model, **engine, num_kvcache_blocks=32)
    resumed = llm.add_request(prompt, params)
    llm.step()
    llm.scheduler.running.remove(resumed)
    llm.scheduler.preempt(resumed)  # (as the scheduler preempts one whose next block is missing)
    failing = llm.add_request(list(range(40, 50)), params)
    real_run = llm.model_runner.run

    def run(seqs, is_prefill, *args):
        if is_prefill:
            raise RuntimeError("injected prefill failure")
        return real_run(seqs, is_prefill, *args)

    monkeypatch.setattr(llm.model_runner, "run", run)
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        llm.step()
    assert failing.finish_reason == "abort" and llm.failed == [failing]
    assert not resumed.is_finished
    monkeypatch.setattr(llm.model_runner, "run", real_run)
    while not llm.is_finished():
        llm.step()
    alone = LLM(tiny_model, **engine).generate([prompt], params, use_tqdm=False)[0]
    assert resumed.finish_reason == "length" and resumed.completion_token_ids == alone["token_ids"]
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_each_sample_of_an_n_request_equals_its_seed_run_alone(tiny_model, draft_folder, proposer):
    """Samples 1..n-1 read sample 0's prompt blocks and are verified beside it; each gives the tokens of its seed
    (seed + i) run alone, with no prefix cache. (Greedy takes only n=1, as in vLLM: these samples are seeded.)"""
    spec = ngram(3, 2) if proposer == "ngram" else {"model": draft_folder, "num_speculative_tokens": 3, **EVERY_STEP}
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=42, n=3, ignore_eos=True)
    prompt = ([9, 8, 7] * 7)[:20]
    llm = LLM(tiny_model, device="cpu", speculative_config=spec, kvcache_block_size=16, num_kvcache_blocks=64)
    together = [out["token_ids"] for out in llm.generate([prompt], params, use_tqdm=False)[0]["outputs"]]
    assert llm.scheduler.block_manager.num_hit_blocks >= 2, "samples 1 and 2 were meant to read sample 0's block"
    assert sum(step.num_draft_tokens for step in llm.metrics.steps) > 0, "nothing was proposed"
    alone = LLM(tiny_model, device="cpu", speculative_config=spec, enable_prefix_caching=False)
    each = [SamplingParams(temperature=1.0, max_tokens=16, seed=42 + i, ignore_eos=True) for i in range(3)]
    assert together == [out["token_ids"] for out in alone.generate([prompt] * 3, each, use_tqdm=False)]
    assert len({tuple(tokens) for tokens in together}) > 1, "the samples differ (seed + i each)"
    assert_no_block_leaked(llm)


# -- blocks and bad settings ---------------------------------------------------------------------


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_random_workloads_with_speculation_leak_no_block(tiny_model, draft_folder, proposer):
    spec = ngram(3, 2) if proposer == "ngram" else {"model": draft_folder, "num_speculative_tokens": 2, **EVERY_STEP}
    llm = LLM(tiny_model, device="cpu", speculative_config=spec, num_kvcache_blocks=16, max_num_batched_tokens=48)
    rng = random.Random(7)
    for round_ in range(3):
        prompts = repetitive_prompts(round_, 8)
        params = [
            SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 30), seed=rng.randrange(9))
            for _ in prompts
        ]
        for prompt, p in zip(prompts, params):
            llm.add_request(prompt, p)
        while not llm.is_finished():
            llm.step()
            live = [*llm.scheduler.running, *llm.scheduler.waiting]
            llm.scheduler.block_manager.check_invariants([seq for seq in live if seq.block_table])
            for seq in llm.scheduler.running:  # nothing held past what its tokens need, between steps
                assert len(seq.block_table) <= seq.num_blocks
        assert_no_block_leaked(llm)


def test_a_failing_verify_step_aborts_its_requests_and_the_engine_serves_on(tiny_model):
    llm = LLM(tiny_model, device="cpu", speculative_config=ngram())
    prompts = repetitive_prompts(5, 3)
    expected = LLM(tiny_model, device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    calls = {"n": 0}

    def flaky(draft_ids, target_ids):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected")
        return accept_greedy(draft_ids, target_ids)

    seqs = [llm.add_request(prompt, GREEDY) for prompt in prompts]
    with seams.use(accept_greedy=flaky):
        with pytest.raises(RuntimeError, match="injected"):
            while not llm.is_finished():
                llm.step()
    # the verify step held all three: each ends with "abort", its blocks back, and nothing is left queued
    assert llm.is_finished() and [seq.finish_reason for seq in seqs] == ["abort"] * 3
    assert llm.failed == seqs and not llm.metrics.requests
    assert_no_block_leaked(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert_no_block_leaked(llm)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ({"method": "medusa", "num_speculative_tokens": 2}, 'needs "method": "ngram"'),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            r"prompt_lookup_min \(4\) exceeds prompt_lookup_max \(3\)",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"model": "/no/such/folder", "num_speculative_tokens": 2}, "/no/such/folder"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_settings_are_clear_errors(tiny_model, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, device="cpu", speculative_config=settings)


def test_a_draft_with_another_vocabulary_is_a_clear_error(tiny_model, tmp_path):
    other = make_tiny_qwen3(tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens .* has 256"):
        LLM(tiny_model, device="cpu", speculative_config={"model": other, "num_speculative_tokens": 2, **EVERY_STEP})


def test_speculation_refuses_the_overlapped_loop(tiny_model):
    with pytest.raises(ValueError, match="overlap_scheduling=True cannot run with speculative_config"):
        LLM(tiny_model, device="cpu", overlap_scheduling=True, speculative_config=ngram())


def test_the_server_streams_speculative_output_and_reports_acceptance_in_metrics():
    """Through the real server and the openai client: the same greedy text as offline speculation, and /metrics
    counts the proposed and accepted tokens (rate = accepted / proposed, mean accepted length = per verify row)."""
    pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    parser = pytest.importorskip("prometheus_client.parser")
    from nanoref.serving.async_llm import AsyncLLM

    from .helpers import running_server

    spec = {
        "model": DEFAULT_MODEL,
        "num_speculative_tokens": 3,
        **EVERY_STEP,
    }  # (the built-in model: it has a tokenizer)
    prompt = "Beautiful is better than"
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    offline = LLM(device="cpu", speculative_config=spec)
    expected = offline.generate([prompt], params, use_tqdm=False)[0]["text"]
    with running_server(AsyncLLM(LLM(device="cpu", speculative_config=spec)), "m") as srv:
        stream = srv.client().completions.create(
            model="m", prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == expected
        srv.wait_until_idle()
        text = httpx.get(srv.url.removesuffix("/v1") + "/metrics", timeout=30).text
    values = {s.name: s.value for f in parser.text_string_to_metric_families(text) for s in f.samples}
    drafted = values["nanoref_spec_decode_num_draft_tokens_total"]
    accepted = values["nanoref_spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and accepted == drafted  # the draft is the target itself: every proposal is kept
    assert values["nanoref_spec_decode_acceptance_rate"] == 1.0
    assert (
        values["nanoref_spec_decode_mean_accepted_length"]
        == accepted / values["nanoref_spec_decode_num_verified_rows_total"]
    )
    assert values["nanoref_spec_decode_request_acceptance_rate_count"] == 1


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_request_that_exactly_fits_the_kv_budget_is_served_with_speculation(tiny_model, draft_folder, proposer):
    """One 16-token block holds a 4-token prompt and its 12 tokens: the lookahead reserves slots for the proposals
    only up to the request's own end (prompt + max_tokens), so its last steps still fit in that one block."""
    spec = dict(method="ngram", num_speculative_tokens=4, **EVERY_STEP, prompt_lookup_max=2)
    if proposer == "draft":
        spec = dict(model=draft_folder, num_speculative_tokens=4, **EVERY_STEP)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 5, 9]]
    llm = LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=1, speculative_config=spec)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs[0]["token_ids"]) == 12
    assert_matches_hf(tiny_model, prompts, outputs, params.max_tokens)
    assert_no_block_leaked(llm)
