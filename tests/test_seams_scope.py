"""A `use(...)` block holds for its own thread (its context) only: other threads' engines keep nanoref's functions,
and blocks that overlap across threads each end exactly where they began."""

from __future__ import annotations

import threading

from nanoref import LLM, SamplingParams
from nanoref.layers.layernorm import rms_norm
from nanoref.utils import seams

from .helpers import assert_matches_hf, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def wrong_rms_norm(x, weight, eps):
    """Scales q and k (qk-norm) by 3: attention, the K/V of later layers and the tokens all change."""
    return 3 * rms_norm(x, weight, eps)


def engine(folder, **kwargs) -> LLM:
    return LLM(folder, device="cpu", num_kvcache_blocks=32, **kwargs)


def run_steps(llm: LLM) -> None:
    while not llm.is_finished():
        llm.step()


def under_wrong(folder, prompts: list[list[int]]) -> list[dict]:
    """What a fresh engine generates inside use(rms_norm=wrong_rms_norm): nothing cached before."""
    with seams.use(rms_norm=wrong_rms_norm):
        return engine(folder).generate(prompts, GREEDY, use_tqdm=False)


# -- scope: one thread, one context ---------------------------------------------------------------
def test_another_threads_engine_keeps_nanorefs_functions_during_a_use_block(tiny_model):
    prompt = random_prompts(seed=40, lengths=[9])[0]
    plain = engine(tiny_model).generate([prompt], GREEDY, use_tqdm=False)
    wrong = under_wrong(tiny_model, [prompt])
    assert wrong != plain, "the wrong function changes nothing: the test proves nothing"
    inside, done = threading.Event(), threading.Event()
    results: dict[str, list] = {}

    def learner():
        llm = engine(tiny_model)
        with seams.use(rms_norm=wrong_rms_norm):
            inside.set()
            done.wait(timeout=120)  # the other thread generates while this block is open
            results["learner"] = llm.generate([prompt], GREEDY, use_tqdm=False)

    def other():
        llm = engine(tiny_model)
        inside.wait(timeout=120)
        results["active"] = seams.active()
        results["other"] = llm.generate([prompt], GREEDY, use_tqdm=False)
        done.set()

    threads = [threading.Thread(target=learner), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert results["active"] == {}, "another thread's use(...) block is visible here"
    assert results["other"] == plain, "another thread's engine ran the learner's function"
    assert results["learner"] == wrong


def test_use_blocks_overlapping_across_threads_leave_nothing_installed(tiny_model):
    """A enters, B enters, A exits, B exits: each block ends exactly where it began, and after both nothing is
    installed, in this thread, in a new one, or for a new engine."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, dict] = {}

    def mine_a(x, weight, eps):
        return wrong_rms_norm(x, weight, eps)

    def mine_b(x, weight, eps):
        return wrong_rms_norm(x, weight, eps)

    def a():
        with seams.use(rms_norm=mine_a):
            a_in.set()
            b_in.wait(timeout=60)
            seen["a inside"] = seams.active()
        a_out.set()
        seen["a after"] = seams.active()

    def b():
        a_in.wait(timeout=60)
        with seams.use(rms_norm=mine_b):
            b_in.set()
            a_out.wait(timeout=60)
            seen["b inside"] = seams.active()
        seen["b after"] = seams.active()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert seen["a inside"] == {"rms_norm": mine_a} and seen["b inside"] == {"rms_norm": mine_b}
    assert seen["a after"] == seen["b after"] == {}
    assert seams.active() == {} and seams.forward_key() is None
    fresh: list = []
    thread = threading.Thread(target=lambda: fresh.append(seams.active()))
    thread.start()
    thread.join()
    assert fresh == [{}]
    prompt = random_prompts(seed=41, lengths=[7])[0]
    assert_matches_hf(tiny_model, [prompt], engine(tiny_model).generate([prompt], GREEDY, use_tqdm=False), 6)


def test_nested_use_blocks_restore_the_outer_block():
    def outer(x, weight, eps):
        return x

    def inner(x, weight, eps):
        return x

    def silu(x):
        return x

    with seams.use(rms_norm=outer):
        key = seams.forward_key()
        with seams.use(rms_norm=inner, silu_and_mul=silu):
            assert seams.active() == {"rms_norm": inner, "silu_and_mul": silu}
            assert seams.forward_key() != key
        assert seams.active() == {"rms_norm": outer} and seams.forward_key() == key
    assert seams.active() == {} and seams.forward_key() is None


def test_host_seams_keep_nanorefs_forward():
    """Which blocks are shared, who is preempted and which token is drawn do not change the K/V of given tokens:
    a learner's prefix lookup still finds (and is checked against) the K/V nanoref's forward cached."""
    with seams.use(find_cached_prefix=lambda *args: [], choose_preemption_victim=lambda running, seq: seq):
        assert seams.forward_key() is None
