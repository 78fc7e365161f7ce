"""Requests that come and go while the engine runs: abort one between steps, follow one's text as it grows, and
why each finished. The pieces the streaming front (nanoref/serving/) and the server build on."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.engine.detokenizer import IncrementalDetokenizer, decode

from .helpers import assert_no_block_leaked, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def step_until(llm, done) -> None:
    for _ in range(200):  # bounded: a bug must fail the test, not hang it
        if done():
            return
        llm.step()
    raise AssertionError("the condition was never reached")


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_aborting_a_running_request_frees_its_blocks_and_the_others_run_on(tiny_model, overlap):
    llm = LLM(tiny_model, device="cpu", overlap_scheduling=overlap, num_kvcache_blocks=32)
    prompts = random_prompts(seed=5, lengths=[9, 21, 14])
    seqs = [llm.add_request(prompt, GREEDY) for prompt in prompts]
    step_until(llm, lambda: seqs[1].num_completion_tokens >= 3)  # (on the overlapped loop a step is in flight)
    llm.abort_request(seqs[1])
    assert seqs[1].is_finished and seqs[1].finish_reason == "abort" and not seqs[1].block_table
    aborted_tokens = list(seqs[1].token_ids)
    step_until(llm, llm.is_finished)
    assert seqs[1].token_ids == aborted_tokens  # no token of a step in flight was appended after the abort
    for seq, prompt in zip([seqs[0], seqs[2]], [prompts[0], prompts[2]]):
        assert seq.completion_token_ids == hf_greedy(tiny_model, prompt, GREEDY.max_tokens)
        assert seq.finish_reason == "length"
    assert_no_block_leaked(llm)
    assert seqs[1].seq_id not in llm.metrics.requests  # an aborted request is not reported as served


def test_aborting_waiting_and_half_prefilled_requests_leaves_no_block_held(tiny_model):
    llm = LLM(tiny_model, device="cpu", max_num_batched_tokens=16, num_kvcache_blocks=32)
    long_prompt, queued_prompt = random_prompts(seed=6, lengths=[40, 10])
    half = llm.add_request(long_prompt, GREEDY)
    queued = llm.add_request(queued_prompt, GREEDY)
    llm.step()  # the first 16 tokens of the long prompt: it holds blocks while it waits for the next chunk
    assert half.block_table and not half.is_finished and queued.num_computed_tokens == 0
    llm.abort_request(half)
    llm.abort_request(queued)
    llm.abort_request(queued)  # a second abort changes nothing
    assert llm.is_finished()
    assert_no_block_leaked(llm)
    again = llm.generate([queued_prompt], GREEDY, use_tqdm=False)[0]
    assert again["token_ids"] == hf_greedy(tiny_model, queued_prompt, GREEDY.max_tokens)


def test_finish_reasons_say_eos_or_length(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    prompt = random_prompts(seed=7, lengths=[11])[0]
    tokens = hf_greedy(tiny_model, prompt, 6)
    llm.scheduler.eos_token_ids = {tokens[2]}  # the third greedy token ends the request as EOS would
    out = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=6), GREEDY], use_tqdm=False)
    stop_at = tokens.index(tokens[2]) + 1
    assert (out[0]["finish_reason"], out[0]["token_ids"]) == ("stop", tokens[:stop_at])
    assert out[1]["finish_reason"] == "length"


def test_a_streamed_request_grows_its_text_to_the_offline_text():
    llm = LLM(device="cpu")  # the built-in model: a real byte-level tokenizer
    params = SamplingParams(temperature=0.8, max_tokens=40, seed=3)
    prompt = "Once upon a time"
    seq = llm.add_request(prompt, params, request_id="r-1", stream=True)
    assert seq.output.request_id == "r-1"
    seen = []
    step_until(llm, lambda: seen.append(llm.output_processor.text_so_far(seq)) or seq.is_finished)
    for shorter, longer in zip(seen, seen[1:]):
        assert longer.startswith(shorter)
    offline = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.output_processor.text_so_far(seq) == offline["text"] == decode(llm.tokenizer, seq.completion_token_ids)


def test_the_detokenizer_never_shows_half_a_character():
    llm = LLM(device="cpu", num_kvcache_blocks=8)
    tokenizer = llm.tokenizer
    text = "naïve 日本語 🙂 ok"
    ids = tokenizer.encode(text)
    detokenizer, pieces = IncrementalDetokenizer(tokenizer), []
    for token_id in ids:
        pieces.append(detokenizer.add([token_id]))
        assert "\ufffd" not in detokenizer.text
    pieces.append(detokenizer.finish())
    assert "".join(pieces) == decode(tokenizer, ids) == text
    assert any(piece == "" for piece in pieces), "the text was meant to split a character over tokens"


def test_two_engines_stepping_in_two_threads_at_once_do_not_share_step_metadata(tiny_model):
    """Each thread publishes its own per-step Context (utils/context.py): a server's engine and an offline one in
    the same process can step at the same time."""
    import threading

    prompts = random_prompts(seed=8, lengths=[13, 29, 7, 18])
    engines = [LLM(tiny_model, device="cpu", num_kvcache_blocks=32) for _ in range(2)]
    outputs: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            outputs[index] = [engines[index].generate([p], GREEDY, use_tqdm=False)[0] for p in prompts for _ in "ab"]
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    expected = [hf_greedy(tiny_model, p, GREEDY.max_tokens) for p in prompts for _ in "ab"]
    for index in range(2):
        assert [out["token_ids"] for out in outputs[index]] == expected
