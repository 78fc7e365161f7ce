"""vLLM's request options on the sampling side: stop_token_ids, min_tokens, the three penalties and logprobs.

Greedy outputs are compared token for token with HF transformers' `generate` (min_new_tokens, repetition_penalty,
and a small logits processor for OpenAI's presence/frequency formula); logprobs with log_softmax of HF's logits.
Each penalty test first checks that the penalty changes the output, so a penalty that did nothing would fail.
"""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.engine.sampling_inputs import sampling_batch
from nanoref.engine.scheduler import Scheduler
from nanoref.engine.sequence import Sequence
from nanoref.layers import logits_processors
from nanoref.layers.logits_processors import TokenLogprobs

from .helpers import assert_no_block_leaked, copy_with_eos, hf_model, random_prompts

# short prompts over few distinct ids: a random tiny model soon repeats itself, so penalties change its output
PROMPTS = [[5, 6, 5, 6, 5, 6, 7], [9, 9, 9, 4], [100, 101, 100, 101, 102, 100, 101]]
MAX_TOKENS = 24


def engine(folder, **kwargs) -> LLM:
    return LLM(folder, device="cpu", num_kvcache_blocks=64, **kwargs)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def hf_generate(folder, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """HF's greedy `generate` for one prompt, with extra generate arguments (penalties, processors, eos)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(folder).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def run_to_the_end(llm: LLM, prompt: list[int], params: SamplingParams):
    """One request through add_request and step: the Sequence itself (stop_reason, logprobs) at the end."""
    seq = llm.add_request(prompt, params)
    while not llm.is_finished():
        llm.step()
    return seq


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("stop_token_ids", 3),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", [1.0]),
        ("min_tokens", -1),
        ("min_tokens", 65),  # more than max_tokens (64)
        ("min_tokens", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logprobs", -2),  # (-1 is vLLM's whole vocabulary: the engine checks it against max_logprobs)
        ("logprobs", 21),
        ("logprobs", False),  # (True is vLLM's 1)
    ],
)
def test_each_bad_option_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_the_range_ends_are_accepted():
    ends = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.1, logprobs=20, min_tokens=64)
    assert (ends.presence_penalty, ends.frequency_penalty, ends.repetition_penalty) == (-2, 2, 0.1)
    assert (ends.logprobs, ends.min_tokens) == (20, 64)  # kept as given, not clamped
    low = SamplingParams(logprobs=0, stop_token_ids=None, min_tokens=0)  # None: vLLM's spelling of no stop ids
    assert (low.logprobs, low.min_tokens) == (0, 0) and not low.stop_token_ids


def test_a_stop_token_id_outside_the_vocabulary_is_refused_queuing_nothing(tiny_model):
    llm = engine(tiny_model)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 256 is outside the vocabulary \[0, 256\)"):
        llm.generate([[1, 2, 3], [4, 5]], [greedy(), greedy(stop_token_ids=[7, 256])], use_tqdm=False)
    assert llm.is_finished()
    assert_no_block_leaked(llm)


# -- stop_token_ids -----------------------------------------------------------------------------
def test_a_stop_token_id_ends_the_request_with_it_as_stop_reason(tiny_model):
    llm = engine(tiny_model)
    free = llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0]["token_ids"]
    stop = free[5]
    cut = free[: free.index(stop) + 1]
    assert len(cut) < MAX_TOKENS
    seq = run_to_the_end(llm, PROMPTS[0], greedy(stop_token_ids=[stop, 255]))
    assert seq.completion_token_ids == cut  # the stop token is kept in the output, as in vLLM
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    out = llm.generate([PROMPTS[0]], greedy(stop_token_ids=[stop]), use_tqdm=False)[0]
    assert (out["token_ids"], out["finish_reason"]) == (cut, "stop")
    assert "logprobs" not in out  # only where asked
    assert_no_block_leaked(llm)


def test_eos_ends_a_request_with_no_stop_reason(tiny_model, tmp_path):
    free = engine(tiny_model).generate([PROMPTS[0]], greedy(), use_tqdm=False)[0]["token_ids"]
    eos = free[3]
    llm = engine(copy_with_eos(tmp_path, tiny_model, eos))
    seq = run_to_the_end(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert seq.completion_token_ids == free[: free.index(eos) + 1]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)


# -- min_tokens ---------------------------------------------------------------------------------
def test_min_tokens_matches_hf_min_new_tokens(tiny_model, tmp_path):
    """EOS is the first token greedy picks, and a stop token id comes soon after: with min_tokens both are masked
    until then, exactly as HF's MinNewTokensLengthLogitsProcessor masks its eos ids."""
    free = engine(tiny_model).generate(PROMPTS, greedy(), use_tqdm=False)
    eos, stop = free[0]["token_ids"][0], free[1]["token_ids"][1]
    folder = copy_with_eos(tmp_path, tiny_model, eos)
    llm = engine(folder)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=6, stop_token_ids=[stop])
    unmasked = llm.generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]), use_tqdm=False
    )
    assert [len(out["token_ids"]) for out in unmasked] == [1, 2], "EOS and the stop id were meant to end both early"
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_generate(folder, prompt, MAX_TOKENS, min_new_tokens=6, eos_token_id=[eos, stop])
        assert output["token_ids"] == expected
        assert len(output["token_ids"]) > 6
        assert eos not in output["token_ids"][:6] and stop not in output["token_ids"][:6]
    assert_no_block_leaked(llm)


def test_min_tokens_masks_eos_under_ignore_eos_too():
    """vLLM masks every stop id before min_tokens, EOS included whatever ignore_eos says (ignore_eos only keeps EOS
    from ending the request): a bias that makes EOS certain shows it nowhere in the first min_tokens tokens."""
    llm = LLM(device="cpu")
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    tokens = llm.generate(["Beautiful is better than"], params, use_tqdm=False)[0]["token_ids"]
    assert len(tokens) == 6 and eos not in tokens[:3] and tokens[3:] == [eos] * 3


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_schedulers_finish_rule_lets_no_stop_token_end_a_request_short_of_min_tokens(ignore_eos):
    """The scheduler's own rule, the sampler's mask aside (which keeps stop tokens from being sampled there at all):
    stop tokens among the first min_tokens completion tokens end nothing, the first one after ends the request."""
    eos, stop = 2, 7
    scheduler = Scheduler(
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=64,
        num_kvcache_blocks=4,
        kvcache_block_size=16,
        eos_token_ids={eos},
    )
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[stop], ignore_eos=ignore_eos)
    seq = Sequence([1, 2, 3], params, 16)
    scheduler.add(seq)
    batch, _ = scheduler.schedule()
    assert batch == [seq]
    assert scheduler.postprocess(batch, [stop]) == []  # completion token 1: short of min_tokens, stops nothing
    for token in (eos, stop):  # tokens 2 and 3, appended through the scheduler
        assert not scheduler.append(seq, token)
    assert seq.num_completion_tokens == params.min_tokens and seq.finish_reason is None
    if not ignore_eos:  # token 4 is past min_tokens: EOS ends it
        assert scheduler.append(seq, eos) and (seq.finish_reason, seq.stop_reason) == ("stop", None)
    else:  # EOS is ignored, a stop token id ends it
        assert not scheduler.append(seq, eos)
        assert scheduler.append(seq, stop) and (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    assert scheduler.is_finished() and scheduler.block_manager.num_free_blocks == 4


# -- penalties ----------------------------------------------------------------------------------
class OpenAIPenalties:
    """HF logits processor: OpenAI's presence/frequency penalties on the counts of the completion's tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)  # (1, V)
        completion = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, completion, torch.ones_like(completion, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def assert_penalty_changes_output_and_matches(folder, params: SamplingParams, hf_kwargs) -> None:
    llm = engine(folder)
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(plain, outputs)), "the penalty changed nothing"
    for i, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
        assert output["token_ids"] == hf_generate(folder, prompt, MAX_TOKENS, **hf_kwargs(prompt)), f"prompt {i}"
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_repetition_penalty_matches_hf(tiny_model, penalty):
    assert_penalty_changes_output_and_matches(
        tiny_model, greedy(repetition_penalty=penalty), lambda prompt: dict(repetition_penalty=penalty)
    )


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0), (0.5, 0.7), (-1.0, 0.0)])
def test_greedy_with_presence_and_frequency_penalties_matches_hf_with_openais_formula(tiny_model, presence, frequency):
    assert_penalty_changes_output_and_matches(
        tiny_model,
        greedy(presence_penalty=presence, frequency_penalty=frequency),
        lambda prompt: dict(logits_processor=[OpenAIPenalties(len(prompt), presence, frequency)]),
    )


@pytest.mark.parametrize("seed", range(3))
def test_apply_penalties_matches_hfs_repetition_processor_and_openais_formula_on_logits_of_both_signs(seed):
    """The penalty function on fresh random logits of both signs (the greedy tests above only ever see the tokens
    near the top, whose logits are positive): repetition as HF's RepetitionPenaltyLogitsProcessor (a negative
    logit is multiplied, a positive one divided), then presence/frequency on the completion's counts."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(seed)
    vocab = 40
    settings = [(1.3, 0.5, 0.7), (0.7, -1.0, 0.0), (1.0, 0.0, 0.0), (2.0, 0.0, 1.5)]  # repetition, presence, freq
    logits = torch.randn(len(settings), vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (7,), generator=g) for _ in settings]
    completions = [torch.randint(0, vocab, (9,), generator=g) for _ in settings]
    counts = torch.stack([torch.bincount(c, minlength=vocab).float() for c in completions])
    seen = torch.stack([torch.bincount(torch.cat([p, c]), minlength=vocab) > 0 for p, c in zip(prompts, completions)])
    assert (logits[seen] < 0).sum() >= 10 and (logits[seen] > 0).sum() >= 10, "both signs among the seen tokens"
    repetition, presence, frequency = (torch.tensor(column, dtype=torch.float32) for column in zip(*settings))
    got = logits_processors.apply_penalties(logits.clone(), counts, seen, presence, frequency, repetition)
    for row, (rep, pres, freq) in enumerate(settings):
        ids = torch.cat([prompts[row], completions[row]])[None]  # (1, L): HF's input_ids
        expected = RepetitionPenaltyLogitsProcessor(rep)(ids, logits[row : row + 1].clone())
        expected = OpenAIPenalties(len(prompts[row]), pres, freq)(ids, expected)[0]
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2], logits[2], rtol=0, atol=0)  # the row with no penalty is untouched


def test_rows_without_penalties_are_untouched_beside_penalised_ones(tiny_model):
    llm = engine(tiny_model)
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    mixed = llm.generate(PROMPTS, [greedy(), greedy(repetition_penalty=1.5), greedy()], use_tqdm=False)
    assert mixed[1] != plain[1]
    assert [mixed[0], mixed[2]] == [plain[0], plain[2]]


def test_seeded_sampling_with_penalties_is_reproducible_and_independent_of_its_batch(tiny_model):
    seeded = SamplingParams(
        temperature=0.8, top_k=50, max_tokens=16, seed=7, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.5
    )
    unpenalised = SamplingParams(temperature=0.8, top_k=50, max_tokens=16, seed=7, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, presence_penalty=1.0)
    llm = engine(tiny_model, seed=0)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]
    assert alone != llm.generate([PROMPTS[0]], unpenalised, use_tqdm=False)[0], "the penalties changed nothing"
    beside = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, seeded, greedy()], use_tqdm=False)[1]
    assert beside == alone
    assert engine(tiny_model, seed=1).generate([PROMPTS[0]], seeded, use_tqdm=False)[0] == alone
    # unseeded rows with penalties: LLM(seed=N) still makes them repeat from one engine to the next
    twice = [engine(tiny_model, seed=3).generate(PROMPTS, others, use_tqdm=False) for _ in range(2)]
    assert twice[0] == twice[1]


# -- logprobs -----------------------------------------------------------------------------------
def hf_logprobs(folder, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(len(completion), V): log_softmax of HF's logits predicting each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf_model(folder)(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(dim=-1)


@pytest.mark.parametrize("num", [0, 1, 5])
def test_logprobs_are_log_softmax_of_the_raw_logits_with_rank_and_sorted_top(tiny_model, num):
    """Sampled at temperature 0.7 with a repetition penalty: logprobs are still the model's raw ones."""
    params = SamplingParams(
        temperature=0.7, max_tokens=12, seed=3, ignore_eos=True, repetition_penalty=1.3, logprobs=num
    )
    llm = engine(tiny_model)
    outputs = llm.generate(PROMPTS, [params, greedy(), params], use_tqdm=False)
    assert "logprobs" not in outputs[1]
    for prompt, output in zip([PROMPTS[0], PROMPTS[2]], [outputs[0], outputs[2]]):
        tokens, entries = output["token_ids"], output["logprobs"]
        assert len(entries) == len(tokens)
        expected = hf_logprobs(tiny_model, prompt, tokens)
        assert any(entry.rank > 1 for entry in entries), "sampling was meant to pick a token that is not the top one"
        for entry, token, row in zip(entries, tokens, expected):
            assert isinstance(entry, TokenLogprobs) and entry.token_id == token
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry.rank == int((row >= row[token] - 1e-6).sum())
            assert len(entry.top) == num
            values = list(entry.top.values())
            assert values == sorted(values, reverse=True)
            assert list(entry.top) == row.topk(num).indices.tolist()
            assert values == pytest.approx(row.topk(num).values.tolist(), abs=1e-4)
    assert_no_block_leaked(llm)


def test_logprobs_survive_chunked_prefill_and_preemption(tiny_model):
    """A chunked prompt's mid-prompt rows emit no token and no entry; a preempted request keeps its entries."""
    prompts = random_prompts(seed=5, lengths=[40, 30, 35])
    params = greedy(logprobs=2)
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=9, kvcache_block_size=16, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(step.preempted for step in llm.metrics.steps), "the KV budget was meant to force preemption"
    for prompt, output in zip(prompts, outputs):
        expected = hf_logprobs(tiny_model, prompt, output["token_ids"])
        assert [e.token_id for e in output["logprobs"]] == output["token_ids"]
        assert [e.logprob for e in output["logprobs"]] == pytest.approx(
            [row[t].item() for row, t in zip(expected, output["token_ids"])], abs=1e-4
        )
    assert_no_block_leaked(llm)


# -- the hot path -------------------------------------------------------------------------------
def test_a_batch_asking_for_none_of_it_builds_and_runs_no_logits_processing(tiny_model, monkeypatch):
    calls = []
    build = logits_processors.LogitsProcessing.build
    monkeypatch.setattr(logits_processors.LogitsProcessing, "build", lambda *a: calls.append(a) or build(*a))
    llm = engine(tiny_model)
    llm.generate(PROMPTS[:2], [greedy(), SamplingParams(temperature=1.0, max_tokens=8, seed=1)], use_tqdm=False)
    assert calls == []
    seq = llm.add_request(PROMPTS[0], greedy())
    runner = llm.model_runner
    batch = sampling_batch([seq], False, 0, runner.device, runner.generator, 256, runner.eos_token_ids)
    assert batch.processing is None
    llm.generate(PROMPTS, greedy(repetition_penalty=1.2), use_tqdm=False)
    assert calls, "a penalised batch was meant to build its processing"


# -- the overlapped loop ------------------------------------------------------------------------
def test_the_overlapped_loop_gives_the_plain_loops_tokens_with_penalties_min_tokens_and_logprobs(tiny_model, tmp_path):
    free = engine(tiny_model).generate(PROMPTS, greedy(), use_tqdm=False)
    eos = free[0]["token_ids"][2]
    folder = copy_with_eos(tmp_path, tiny_model, eos)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=8),
        SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, seed=5, presence_penalty=1.0, logprobs=3),
    ]
    plain = LLM(folder, device="cpu", num_kvcache_blocks=64, overlap_scheduling=False)
    overlapped = LLM(folder, device="cpu", num_kvcache_blocks=64, overlap_scheduling=True)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    assert overlapped.generate(PROMPTS, params, use_tqdm=False) == expected
    assert_no_block_leaked(overlapped)
    # min_tokens alone needs only token counts: its steps still run ahead, with the same tokens
    ahead = []
    schedule_ahead = overlapped.overlapped_loop.schedule_ahead
    overlapped.overlapped_loop.schedule_ahead = lambda in_flight: ahead.append(schedule_ahead(in_flight)) or ahead[-1]
    # the second request stops at a stop id that comes first right where the mask lifts (a mask one step late in
    # the ahead steps would hide it)
    unstopped = free[1]["token_ids"]
    at = next(i for i in range(3, MAX_TOKENS) if unstopped[i] not in unstopped[:i])
    stopping = greedy(min_tokens=at, stop_token_ids=[unstopped[at]])
    outputs = overlapped.generate(PROMPTS[:2], [params[1], stopping], use_tqdm=False)
    assert outputs == plain.generate(PROMPTS[:2], [params[1], stopping], use_tqdm=False)
    assert sum(map(bool, ahead)) >= 5, "min_tokens steps were meant to be scheduled ahead"
    assert len(outputs[0]["token_ids"]) > 8 and outputs[1]["token_ids"] == unstopped[: at + 1]
    assert_no_block_leaked(overlapped)


# -- tensor parallelism -------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_apply_the_options_as_one_rank_does(tiny_model):
    """Rank 0 gets the whole vocabulary's logits and samples: penalties, masks and logprobs are all its own."""
    params = [
        greedy(repetition_penalty=1.3, presence_penalty=0.5, logprobs=2),
        greedy(min_tokens=4, stop_token_ids=[7]),
    ]
    one = engine(tiny_model).generate(PROMPTS[:2], params, use_tqdm=False)
    with LLM(tiny_model, device="cpu", num_kvcache_blocks=64, tensor_parallel_size=2) as llm:
        two = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o["token_ids"] for o in two] == [o["token_ids"] for o in one]
    assert [e.token_id for e in two[0]["logprobs"]] == [e.token_id for e in one[0]["logprobs"]]
    assert [e.logprob for e in two[0]["logprobs"]] == pytest.approx([e.logprob for e in one[0]["logprobs"]], abs=1e-4)


@pytest.mark.parametrize(
    "options",
    [dict(top_p=1e-46), dict(temperature=1e-39, seed=3), dict(repetition_penalty=1e-46), dict(temperature=1e-39)],
    ids=["top_p", "seeded-temperature", "repetition_penalty", "temperature"],
)
def test_tiny_sampling_values_give_finite_probabilities_and_a_real_completion(tiny_model, options):
    """Values validation accepts but float32 rounds to 0 or overflows on (top_p 1e-46, temperature 1e-39, a
    repetition penalty of 1e-46) sample from a real distribution: top-p keeps the most likely token, the
    temperature is clamped (MIN_TEMPERATURE, as vLLM does) and penalised logits stay finite. Before, the
    probabilities were NaN and every row "sampled" token 0."""
    llm = engine(tiny_model)
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, **options})
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(set(output["token_ids"]) != {0} for output in outputs), outputs  # NaN's argmax: token 0 every time
    from nanoref.layers.sampler import sampling_probs

    logits = torch.randn(3, 50) * 20
    temperatures = torch.tensor([params.temperature] * 3)
    top_k, top_p = torch.zeros(3, dtype=torch.int64), torch.tensor([params.top_p] * 3)
    processing = logits_processors.LogitsProcessing.build(
        [(row, [1, 2], [3], 0.0, 0.0, params.repetition_penalty) for row in range(3)], [], 50, torch.device("cpu")
    )
    probs = sampling_probs(processing.apply(logits), temperatures, top_k, top_p)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(dim=-1), torch.ones(3))
    if options.get("top_p"):  # only the most likely token is left
        assert (probs.argmax(dim=-1) == processing.apply(logits).argmax(dim=-1)).all() and (
            probs.max(-1).values == 1
        ).all()
    if options == dict(top_p=1e-46):
        assert outputs == llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
